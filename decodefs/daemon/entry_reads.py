"""READs of stored entries, and the one owner of their page cache: one copy of what was served.

A READ of a stored array is answered, cheapest first: from the bytes that a
verification or a write of the entry just had in memory (kept, up to
``FRESH_BYTES``, for the READs that follow an open); from the entry file's
resident pages on the event loop (a path and pages already in the kernel's
caches, never a wait for a device); else in a worker thread. Whose an entry
file's pages are (``Pages``) is decided here alone, from what each read or
check found (the one drop the store makes itself: a check asked for the
payload drops the pages it read in, as the READs are served from the payload),
and the pages the daemon brought in for an open are dropped once that open is
released (store/pagecache.py states the rules; the engine only
carries each open's ``Pages`` from ``verified``/``written`` to ``read`` and
``release``).

Everything here runs on the event loop's thread, except what it hands to a
worker thread. Knows the store's opens and the page cache's calls; not FUSE,
not decoding, not which arrays are stored or verified (engine.py).
"""

from __future__ import annotations

import enum
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Final

import cachetools
import trio

from ..common.entry import EntryKey
from ..common.metrics import LogThrottle, Metrics
from ..store import PendingDrops, Store, VerifiedEntry, pagecache
from .workers import run_in_thread

__all__ = ["FRESH_BYTES", "EntryReads", "Pages"]

log = logging.getLogger(__name__)

# Enough for the READs that follow the opens of many readers at once (~200 arrays of 224).
FRESH_BYTES: Final = 32 << 20


class Pages(enum.Enum):
    """Whose the page cache's copy of an entry file is, as far as one open knows."""

    NOT_OURS = "not ours"  # resident before the daemon read it (or unknown): left alone
    READ_IN = "read in"  # the daemon read it in from the disk: dropped once served
    WRITTEN = "written"  # the daemon wrote it: dropped once written back


class EntryReads:
    def __init__(
        self,
        store: Store,
        limiter: trio.CapacityLimiter,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = trio.current_time,
        fresh_bytes: int = FRESH_BYTES,
    ) -> None:
        self._store = store
        self._limiter = limiter
        self._metrics = metrics
        self._clock = clock
        # The whole .npy bytes of entries just verified or written, by key.
        self._fresh: cachetools.LRUCache[EntryKey, memoryview] = cachetools.LRUCache(
            fresh_bytes, getsizeof=len
        )
        self._drops: PendingDrops[EntryKey] = PendingDrops()
        self._wakeup = trio.Event()
        self._dropping = trio.CapacityLimiter(1)
        self._throttle = LogThrottle(log)

    @property
    def fresh_bytes(self) -> int:
        return int(self._fresh.currsize)

    def _keep_fresh(self, key: EntryKey, payload: bytes | memoryview) -> None:
        """Keep ``payload``, ``key``'s .npy bytes just verified or written, for the
        READs that follow (an array bigger than the whole room is not kept)."""
        if len(payload) <= self._fresh.maxsize:
            self._fresh[key] = memoryview(payload)

    def forget(self, key: EntryKey) -> None:
        """``key``'s entry may have changed (rebuilt, evicted): nothing kept of it serves."""
        self._fresh.pop(key, None)

    def forget_all(self) -> None:
        self._fresh.clear()

    def verified(self, key: EntryKey, found: VerifiedEntry) -> Pages:
        """An open found ``key``'s entry verified: keep its payload (if the check kept
        it) for the READs that follow, and say whose the entry file's pages are."""
        self._metrics.page_drops += found.dropped
        if found.payload is not None:
            self._keep_fresh(key, found.payload)
        return Pages.READ_IN if found.brought_in else Pages.NOT_OURS

    def written(self, key: EntryKey, payload: bytes | memoryview, *, read_next: bool) -> Pages:
        """``key``'s entry was just written from ``payload``: if READs come next, they
        are served from these bytes, not read back. Its pages are the daemon's."""
        if read_next:
            self._keep_fresh(key, payload)
        return Pages.WRITTEN

    async def read(
        self, key: EntryKey, offset: int, size: int, pages: Pages
    ) -> memoryview | bytearray | bytes | None:
        """``size`` bytes of ``key``'s entry (verified and pinned) from ``offset``;
        None (logged) if the entry cannot give them: gone, shrunk, unreadable."""
        fresh = self._fresh.get(key)
        if fresh is not None:
            self._metrics.store_reads_inline += 1
            if offset + size >= len(fresh):
                del self._fresh[key]  # read to its end: the kernel's page cache has it now
            return fresh[offset : offset + size]  # pyfuse3 copies it out before it is freed
        cached, read_ahead = self._read_resident(key, offset, size)
        if cached is not None:
            self._metrics.store_reads_inline += 1
            return cached
        self._metrics.store_reads_threaded += 1
        # Pages found not resident: the try started their readahead, so the worker
        # thread could not tell its own doing from a direct reader's; they are ours.
        ours = pages is not Pages.NOT_OURS or read_ahead
        try:
            data, dropped = await run_in_thread(
                self._limiter, self._read_from_disk, key, offset, size, ours
            )
        except OSError as exc:
            # Removed behind our back or unreadable: never fail the reader.
            self._throttle.log(
                logging.WARNING,
                "store-reread",
                "stored entry %s cannot be read (%s); rebuilding it",
                key,
                exc,
            )
            return None
        self._metrics.page_drops += dropped
        if len(data) != size:
            self._throttle.log(
                logging.WARNING, "store-reread", "stored entry %s shrank; rebuilding it", key
            )
            return None
        return data

    def _read_resident(
        self, key: EntryKey, offset: int, size: int
    ) -> tuple[bytearray | None, bool]:
        """On the event loop: the bytes, if the entry's path and pages are all in the
        kernel's caches; else None, and whether the try found pages not resident (it
        started their readahead). Never waits for a device."""
        entry = self._store.open_cached(key)
        if entry is None:
            return None, False
        try:
            # Asked first: a read that misses would start the disk's work on this thread.
            if pagecache.resident(entry, offset, size) is False:
                return None, True
            data = pagecache.read_resident(entry, offset, size)
        except OSError:
            return None, False  # a tmpfs cannot tell without waiting: a worker thread reads it
        finally:
            os.close(entry)
        if data is None:
            return None, True
        return (data, False) if len(data) == size else (None, False)

    def _read_from_disk(
        self, key: EntryKey, offset: int, size: int, drop: bool
    ) -> tuple[bytes, bool]:
        """Worker thread: the bytes (fewer only if the file is shorter), and whether
        their pages were dropped after: if ``drop``, or if this read brought them in;
        pages someone else keeps resident stay."""
        entry = self._store.open_entry(key)
        try:
            data, brought_in = pagecache.read_noting_residency(entry, offset, size)
            if drop or brought_in:
                pagecache.drop(entry, offset, size)
            return data, drop or brought_in
        finally:
            os.close(entry)

    def release(self, key: EntryKey, pages: Pages) -> None:
        """An open of ``key`` is released: what it brought into the page cache goes."""
        if pages is not Pages.NOT_OURS:
            self._fresh.pop(key, None)
            before = self._drops.next_due()
            self._drops.add(key, self._clock(), written=pages is Pages.WRITTEN)
            after = self._drops.next_due()
            if before is None or (after is not None and after < before):
                self._wakeup.set()  # else the dropper already wakes before this is due

    async def drop_forever(self) -> None:
        """Drop the entry pages brought into the page cache when they are due."""
        while True:
            due = self._drops.next_due()
            wait = math.inf if due is None else due - self._clock()
            if wait > 0:
                self._wakeup = trio.Event()
                with trio.move_on_after(wait):
                    await self._wakeup.wait()
                continue
            await self.drop_due()

    async def drop_due(self) -> None:
        """One round of ``drop_forever``: the drops due now, in a worker thread."""
        keys = self._drops.due(self._clock())
        if keys:
            await run_in_thread(self._dropping, self._drop, keys)
            self._metrics.page_drops += len(keys)

    def _drop(self, keys: Sequence[EntryKey]) -> None:
        """Worker thread: let the kernel drop the pages of each entry (quietly none
        of one that is gone)."""
        for key in keys:
            try:
                entry = self._store.open_entry(key)
            except OSError:
                continue
            try:
                pagecache.drop(entry)
            finally:
                os.close(entry)
