"""The store's upkeep while the daemon serves: hits' access times recorded for LRU
eviction, the store checked for being removed or made again, and a store over its
limits (one lowered since its entries were written) brought within them.

Both run on the store-write threads (a write that finds the store gone checks it
at once) and never raise: a failure is logged. Knows the store and what is known
of it (known.py); not reads, decodes or FUSE.
"""

from __future__ import annotations

import logging
import time
from typing import Final

import trio

from ..common.metrics import LogThrottle
from ..store import Store
from .known import KnownEntries
from .workers import run_in_thread

__all__ = ["ACCESS_FLUSH_SECONDS", "STORE_CHECK_SECONDS", "StoreUpkeep"]

log = logging.getLogger(__name__)

# How often hits' access times go to the catalog (LRU), and the store is checked.
ACCESS_FLUSH_SECONDS: Final = 30.0
STORE_CHECK_SECONDS: Final = 5.0


class StoreUpkeep:
    def __init__(
        self, store: Store, known: KnownEntries, write_limiter: trio.CapacityLimiter
    ) -> None:
        self._store = store
        self._known = known
        self._write_limiter = write_limiter
        self._throttle = LogThrottle(log)

    async def flush_accesses(self) -> None:
        """Write hits' access times to the catalog, for LRU eviction (``flush_accesses_forever``
        calls it); a failure is logged, never raised: LRU order is not worth more."""
        try:
            await run_in_thread(self._write_limiter, self._store.capacity.flush_accesses)
        except Exception as exc:
            self._throttle.log(
                logging.ERROR, "flush-accesses", "cannot record hits for LRU: %r", exc
            )

    async def check_store(self) -> None:
        """Notice a store removed at runtime, and use it again once it is made again
        (``watch_store_forever`` calls it, and the engine when a write finds the store
        gone)."""
        try:
            await run_in_thread(self._write_limiter, self._store.check)
        except Exception as exc:
            self._throttle.log(logging.ERROR, "store-check", "cannot check the store: %r", exc)
        self._known.notice_store_generation()

    async def trim(self) -> None:
        """Bring a store over its limits within them (``trim_forever`` calls it): evict the
        least recently used entries in a worker thread, a batch at a time; readers never
        wait for it, and pinned entries stay. A failure is logged, never raised."""
        capacity = self._store.capacity
        if not capacity.over_limit():
            return
        usage = self._store.usage()
        log.warning(
            "store %s holds %.1f MiB, over its limit (max_store_bytes %s, min_free_fraction "
            "%s): evicting the least recently used entries in the background",
            self._store.root,
            usage.bytes / 2**20,
            capacity.max_bytes,
            capacity.min_free_fraction,
        )
        started = time.monotonic()
        try:
            entries, nbytes = await run_in_thread(self._write_limiter, capacity.trim)
        except Exception as exc:
            self._throttle.log(logging.ERROR, "trim", "cannot trim the store: %r", exc)
            return
        log.info(
            "store trimmed: %d entries (%.1f MiB) evicted in %.1f s; it holds %.1f MiB",
            entries,
            nbytes / 2**20,
            time.monotonic() - started,
            self._store.usage().bytes / 2**20,
        )

    async def trim_forever(self, interval: float = STORE_CHECK_SECONDS) -> None:
        """Bring the store within its limits at start (once it is counted) and whenever it
        is found over them, checked every ``interval``."""
        while True:
            await self.trim()
            await trio.sleep(interval)

    async def flush_accesses_forever(self, interval: float = ACCESS_FLUSH_SECONDS) -> None:
        """Write hits' access times to the catalog every ``interval``, for LRU eviction."""
        while True:
            await trio.sleep(interval)
            await self.flush_accesses()

    async def watch_store_forever(self, interval: float = STORE_CHECK_SECONDS) -> None:
        """Notice a store removed at runtime, and use it again once it is made again."""
        while True:
            await trio.sleep(interval)
            await self.check_store()
