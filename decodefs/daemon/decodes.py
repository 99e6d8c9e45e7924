"""Running decodes: a reader's in the decode pool, a warm's on low-priority threads,
each with the memory it takes; failures become the engine's errors and are
remembered a while (the negative cache).

Pillow releases the GIL, so a reader's decode runs in a worker thread under a
limiter sized to the cores; the warm's run on their own low-priority threads
(workers.py), so a reader never waits for a slot behind the warm and gets the
CPU first, and a reader waiting on a warm decode boosts it. Runs on the trio
thread but for the worker threads. Knows the sources and the decode function;
not the store, not single flight (the engine's), not FUSE.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Final, Protocol, TypeVar

import cachetools
import trio

from ..cluster import L2Miss
from ..common.config import Config
from ..common.decode import DecodeError, decode_image, decode_peak_bytes, image_dimensions
from ..common.entry import EntryKey
from ..common.metrics import LogThrottle, Metrics
from ..common.npy import npy_bytes
from ..common.source import OriginalMissing, SourceIndex
from .failures import FailedOriginals
from .memory import MemoryBudget
from .workers import Job, LowPriorityPool, run_in_thread

__all__ = ["Decodes", "OriginalNotFound", "OriginalUndecodable", "Purpose", "WarmJob"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_FAILURE_CACHE_MAX: Final = 100_000


class OriginalNotFound(Exception):
    """The uuid's original no longer exists (ENOENT)."""


class OriginalUndecodable(Exception):
    """The original exists but cannot be decoded (EIO)."""


class Purpose(enum.Enum):
    """Why an array is acquired: it decides priority, eviction and what is counted."""

    READ = "read"  # a reader waits for it: full priority, may evict
    WARM_REQUEST = "warm request"  # an O_NONBLOCK open (decodefs warm): low priority, never evicts
    BACKGROUND = "background warm"  # the daemon's own warm: low priority, never evicts


class WarmJob(Protocol):
    """Where a warm decode's job is kept, so that a reader who comes to wait boosts it."""

    job: Job[tuple[bytes, float]] | None
    boosted: bool  # a reader waits for it (a warm decode not yet submitted too)


class Decodes:
    def __init__(
        self,
        config: Config,
        sources: Mapping[str, SourceIndex],
        metrics: Metrics,
        read_limiter: trio.CapacityLimiter,
        *,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._config = config
        self._sources = sources
        self._metrics = metrics
        self._read_limiter = read_limiter  # finding an original: the source may be slow
        self._limiter = trio.CapacityLimiter(config.decode_workers)
        # Decode threads are capped by _limiter; their trio limiter must not cap them again.
        self._pool_threads = trio.CapacityLimiter(math.inf)
        self._warm_pool = LowPriorityPool(config.decode_workers)
        # As many as the pool's threads: a warm decode submitted starts at once.
        self._warm_slots = trio.CapacityLimiter(config.decode_workers)
        # What decodes take while they run: 8 bytes a pixel (decode.decode_peak_bytes).
        self.memory = MemoryBudget(config.decode_memory_bytes)
        # Originals that failed to decode, answered EIO until their entry expires.
        self.failures: cachetools.TTLCache[EntryKey, str] = cachetools.TTLCache(
            maxsize=_FAILURE_CACHE_MAX, ttl=config.error_cache_seconds, timer=clock
        )
        # Every original that failed to decode and has not decoded since (failed.json).
        self.failed = FailedOriginals()
        self._throttle = LogThrottle(log)

    def close(self) -> None:
        self._warm_pool.shutdown()

    def check_recent_failure(self, key: EntryKey) -> None:
        """Raise OriginalUndecodable if ``key`` failed to decode lately (the negative cache)."""
        reason = self.failures.get(key)
        if reason is not None:
            self._metrics.errors["EIO"] += 1
            raise OriginalUndecodable(reason)

    async def decode(
        self,
        key: EntryKey,
        index: int,
        purpose: Purpose,
        flight: WarmJob,
        miss: L2Miss | None = None,
    ) -> bytes | None:
        """Decode ``key``; once the decode has its memory and its slot, ``miss`` (the
        cluster tier's) is asked whether to: None if it says no (nothing decoded)."""
        source = self._sources[key.version]
        settings = self._config.versions[key.version].decode
        max_pixels = self._config.max_pixels
        path = source.relpaths[index]

        def locate() -> int:
            # Worker thread: the source may be slow network storage.
            nonlocal path
            path = source.original_path(index)
            return decode_peak_bytes(*image_dimensions(path))

        def work() -> tuple[bytes, float]:
            started = time.perf_counter()
            array = decode_image(path, key.size, settings, max_pixels=max_pixels)
            return npy_bytes(array), time.perf_counter() - started

        try:
            peak = await run_in_thread(self._read_limiter, locate)
            granted = await self.memory.acquire(peak)  # a bigger one runs alone
            try:
                if purpose is Purpose.READ:
                    done = await self._run(work, miss)
                else:
                    done = await self._run_warm(work, flight, miss)
            finally:
                self.memory.release(granted)
            if done is None:
                return None
            data, seconds = done
        except OriginalMissing as exc:
            self._metrics.errors["ENOENT"] += 1
            self._throttle.log(  # once per version per interval: a whole source may vanish
                logging.WARNING,
                f"original-gone-{key.version}",
                "original of %s is gone: %s",
                key,
                exc,
            )
            raise OriginalNotFound(str(exc)) from exc
        except DecodeError as exc:
            self._metrics.decodes += 1  # it ran: `decodes` counts every decode
            self._metrics.decode_errors += 1
            self._metrics.errors["EIO"] += 1
            self.failures[key] = f"{path}: {exc.reason}"
            listed = os.path.join(source.root, source.relpaths[index])  # as the source has it
            self.failed.add(key.version, key.key, key.size, listed, exc.reason)
            self._throttle.log(  # once per original per interval, however often asked
                logging.WARNING,
                f"decode-{path}",
                "cannot decode %s for %s: %s",
                path,
                key,
                exc.reason,
            )
            raise OriginalUndecodable(f"{path}: {exc.reason}") from exc
        self._metrics.decodes += 1
        self.failed.discard(key.version, key.key)  # it decodes now (replaced, or fixed)
        self._metrics.background_decodes += purpose is Purpose.BACKGROUND
        self._metrics.warm_decodes += purpose is Purpose.WARM_REQUEST
        self._metrics.decode_seconds.observe(seconds)
        log.debug("decoded %s from %s in %.0f ms", key, path, seconds * 1000)
        return data

    async def _run(self, work: Callable[[], T], miss: L2Miss | None = None) -> T | None:
        """Run a reader's ``work`` in the decode pool, counting it as queued, then running;
        once it has its slot, ``miss`` is asked whether to (None if not)."""
        self._metrics.queued_decodes += 1
        queued = True
        try:
            async with self._limiter:
                self._metrics.queued_decodes -= 1
                queued = False
                if miss is not None and not await miss.claim():
                    return None
                self._metrics.inflight_decodes += 1
                try:
                    return await run_in_thread(self._pool_threads, work)
                finally:
                    self._metrics.inflight_decodes -= 1
        finally:
            if queued:  # cancelled while waiting for a slot
                self._metrics.queued_decodes -= 1

    async def _run_warm(
        self, work: Callable[[], tuple[bytes, float]], flight: WarmJob, miss: L2Miss | None
    ) -> tuple[bytes, float] | None:
        """Run a warm's ``work`` on the low-priority pool (a reader waiting boosts it);
        once it has its slot, ``miss`` is asked whether to (None if not)."""
        async with self._warm_slots:
            if miss is not None and not await miss.claim():
                return None
            flight.job = self._warm_pool.submit(work)
            if flight.boosted:
                flight.job.boost()
            return await flight.job.wait()
