"""SIGUSR1: every thread's stack and the trio task tree in the log, for a daemon that
seems stuck. Knows nothing of what the tasks do.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
from collections.abc import Iterator

import trio

__all__ = ["dump_on_sigusr1", "stacks_on_sigusr1"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def stacks_on_sigusr1() -> Iterator[None]:
    """SIGUSR1 dumps every thread's stack, for the whole life of ``serve``.

    faulthandler answers it from its C signal handler, which works even while
    the main thread is stuck in a system call or a C library holding the GIL:
    a stuck daemon still shows where it is stuck. While the trio loop runs,
    dump_on_sigusr1 chains trio's handler behind it to add the task tree.
    SIG_IGN underneath means the signal never kills the daemon in the instant
    one handler hands over to the other.
    """
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    try:
        yield
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, previous)


async def dump_on_sigusr1() -> None:
    """SIGUSR1 in the loop: faulthandler dumps the threads' stacks at once, then this
    task logs the trio task tree (when the loop gets to it: not if the loop is stuck)."""
    # trio restores the handler it replaced when the receiver closes, and that
    # must be a Python-level one, which faulthandler's is not: so faulthandler
    # steps aside (to SIG_IGN) while trio installs its handler, then registers
    # again in front of it, chaining to it.
    faulthandler.unregister(signal.SIGUSR1)
    try:
        with trio.open_signal_receiver(signal.SIGUSR1) as signals:
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
            try:
                async for _ in signals:
                    log.warning(
                        "SIGUSR1: every thread's stack is above; the trio tasks:\n%s",
                        "\n".join(_task_tree()),
                    )
            finally:
                faulthandler.unregister(signal.SIGUSR1)
    finally:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def _task_tree() -> list[str]:
    """One line per trio task, indented by nesting: its name and where it waits.

    Where = the innermost frame of its await chain outside trio itself (the
    line of our code, or pyfuse3's, that awaits), else the innermost one.
    """
    trio_dir = os.path.dirname(trio.__file__) + os.sep
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        frames = list(task.iter_await_frames())
        ours = [f for f in frames if not f[0].f_code.co_filename.startswith(trio_dir)]
        where = ""
        if frames:
            frame, lineno = (ours or frames)[-1]
            code = frame.f_code
            where = f" at {code.co_filename}:{lineno} in {code.co_name}"
        lines.append(f"{'  ' * depth}task {task.name}{where}")
        for nursery in task.child_nurseries:
            for child in sorted(nursery.child_tasks, key=lambda t: t.name):
                walk(child, depth + 1)

    root = trio.lowlevel.current_root_task()
    if root is not None:
        walk(root, 0)
    return lines
