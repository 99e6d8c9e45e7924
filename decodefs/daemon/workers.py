"""The daemon's worker threads: ``run_in_thread`` for the request loop's blocking calls,
and ``LowPriorityPool`` for work that must yield to readers (the warm).

``run_in_thread`` does what ``trio.to_thread.run_sync`` does for this daemon at
half its cost (a CapacityLimiter bounds the threads; the caller waits for the
thread, which cancellation cannot abandon) without the rest: no context
variables carried over, no thread renamed per call. Every store read, write and
verification is one of these calls; measured here: 22 against 44 us of the
loop's CPU per call, 31 against 61 us of latency.

Linux applies a nice value per thread, so the low-priority pool's threads run
at nice 19 while readers' decode threads stay at the daemon's own priority:
when both want the CPU, the kernel gives it to the readers. A job that a
reader comes to wait for can be boosted back (``Job.boost``), which needs
CAP_SYS_NICE (root has it); without it the job finishes at low priority.
Knows nothing of decodefs's images, store or FUSE.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Final, Generic, TypeVar

import outcome
import trio

__all__ = ["Job", "LowPriorityPool", "run_in_thread"]

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)

T = TypeVar("T")
LOW_PRIORITY: Final = 19


class Job(Generic[T]):
    """One function running (or queued) on a LowPriorityPool."""

    def __init__(
        self, executor: concurrent.futures.ThreadPoolExecutor, fn: Callable[[], T]
    ) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        self._lock = threading.Lock()
        self._tid: int | None = None
        self._boosted = False
        self._future = executor.submit(self._call, fn)
        # Not a bound method: the future would refer back to the Job, and its result (a
        # whole decoded array) would wait for the cycle collector after the Job is gone.
        self._future.add_done_callback(functools.partial(_wake, self._token, self._done))

    async def wait(self) -> T:
        with trio.CancelScope(shield=True):  # a thread cannot be stopped: wait for it
            await self._done.wait()
        return self._future.result()

    def boost(self) -> None:
        """Compete with readers again: a reader waits for this job."""
        with self._lock:
            self._boosted = True
            tid = self._tid
        if tid is not None:
            _set_nice(tid, 0)

    def _call(self, fn: Callable[[], T]) -> T:
        tid = threading.get_native_id()
        with self._lock:
            self._tid = tid
            boosted = self._boosted
        # Every job sets its thread's priority: a boost must not outlive its job.
        _set_nice(tid, 0 if boosted else LOW_PRIORITY)
        try:
            return fn()
        finally:
            with self._lock:
                self._tid = None


class LowPriorityPool:
    def __init__(self, workers: int) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="decodefs-warm"
        )

    def submit(self, fn: Callable[[], T]) -> Job[T]:
        """Queue ``fn``; call from the trio thread."""
        return Job(self._executor, fn)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _wake(token: trio.lowlevel.TrioToken, done: trio.Event, _: object) -> None:
    with contextlib.suppress(trio.RunFinishedError):
        token.run_sync_soon(done.set)


def _set_nice(tid: int, value: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except PermissionError:
        log.debug("cannot set thread %d to nice %d (needs CAP_SYS_NICE)", tid, value)
    except ProcessLookupError:
        pass


async def run_in_thread(limiter: trio.CapacityLimiter, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a worker thread, at most ``limiter``'s total at once.

    Waiting for the limiter can be cancelled; once the thread runs, the caller
    waits for it to finish (a cancellation is delivered at the next checkpoint).
    """
    try:
        limiter.acquire_nowait()  # the usual case: no wait, no checkpoint
    except trio.WouldBlock:
        await limiter.acquire()
    try:
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def deliver(result: outcome.Outcome[T]) -> None:
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        def work() -> T:  # start_thread_soon captures its outcome
            return fn(*args)

        trio.lowlevel.start_thread_soon(work, deliver)
        result: T = await trio.lowlevel.wait_task_rescheduled(
            lambda _: trio.lowlevel.Abort.FAILED  # the thread cannot be stopped: wait for it
        )
        return result
    finally:
        limiter.release()
