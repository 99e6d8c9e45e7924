"""Arrays held in the daemon's memory, all under one budget: decodes in flight and
arrays served from memory because the store would not take them.

``MemoryBudget`` counts the bytes; an ``acquire`` that does not fit first drops
arrays only the cache still holds, then waits (first come, first served) until
releases make room, so a flood of opens waits instead of growing the daemon.
A ``HeldArray`` is released when its last holder (the cache, or a request
in progress) lets go. Everything here runs on the trio thread. This module knows nothing
of FUSE, the store or images.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

import cachetools
import trio

__all__ = ["HeldArray", "MemoryBudget", "MemoryCache"]


class MemoryBudget:
    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.used = 0
        self._waiting: collections.deque[tuple[int, trio.Event]] = collections.deque()
        self._caches: list[MemoryCache] = []
        self.waits = 0  # acquires that had to wait (reclaiming cached arrays was not enough)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, nbytes: int) -> int:
        """Take ``nbytes`` (at most the whole budget, which one array may need);
        returns what was taken, to give back to ``release``."""
        nbytes = min(nbytes, self.limit)
        if not self._waiting and not self._fits(nbytes):
            self._reclaim(nbytes)
        if not self._waiting and self._fits(nbytes):
            self.used += nbytes
            return nbytes
        ticket = (nbytes, trio.Event())
        self._waiting.append(ticket)
        self.waits += 1
        try:
            await ticket[1].wait()
        except BaseException:
            if ticket[1].is_set():  # granted as we were cancelled: give it back
                self.release(nbytes)
            else:
                self._waiting.remove(ticket)
                self._grant()  # the head may have changed
            raise
        return nbytes

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._grant()

    def retry_waiting(self) -> None:
        """Grant waiting acquires what reclaiming cached arrays can free now."""
        if self._waiting:
            self._grant()

    def hold(self, data: memoryview, granted: int) -> HeldArray:
        """Hand the ``granted`` bytes of a decode over to the array it produced;
        what the decode needed beyond the array itself is given back."""
        kept = min(granted, len(data))
        if granted > kept:
            self.release(granted - kept)
        return HeldArray(data, kept, self)

    def _fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.limit

    def _grant(self) -> None:
        if self._waiting and not self._fits(self._waiting[0][0]):
            self._reclaim(self._waiting[0][0])
        while self._waiting and self._fits(self._waiting[0][0]):
            nbytes, event = self._waiting.popleft()
            self.used += nbytes
            event.set()

    def _reclaim(self, nbytes: int) -> None:
        for cache in self._caches:
            while not self._fits(nbytes) and cache.drop_oldest():
                pass


class HeldArray:
    """One array in memory and its budget bytes, released with its last holder."""

    __slots__ = ("_budget", "_holders", "data", "nbytes")

    def __init__(self, data: memoryview, nbytes: int, budget: MemoryBudget) -> None:
        self.data = data
        self.nbytes = nbytes
        self._budget = budget
        self._holders = 1  # whoever made it

    def retain(self) -> HeldArray:
        self._holders += 1
        return self

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._budget.release(self.nbytes)
        else:
            # Perhaps only the cache holds it now: an acquire waiting for room
            # may take that room by dropping it, and nothing else would tell it.
            self._budget.retry_waiting()


class _DroppingLRU(cachetools.LRUCache[Hashable, HeldArray]):
    def popitem(self) -> tuple[Hashable, HeldArray]:
        key, held = super().popitem()
        held.release()
        return key, held


class MemoryCache:
    """Arrays kept for later opens, least recently used dropped first: when ``limit``
    is reached, or when the budget needs room for something else."""

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self._items = _DroppingLRU(maxsize=budget.limit, getsizeof=lambda held: held.nbytes)
        budget._caches.append(self)

    def touch(self, key: Hashable) -> bool:
        """Whether ``key`` is cached (now the most recently used)."""
        return self._items.get(key) is not None

    def get(self, key: Hashable) -> HeldArray | None:
        """A new hold on ``key``'s array (the caller releases it), or None."""
        held = self._items.get(key)
        return held.retain() if held is not None else None

    def put(self, key: Hashable, held: HeldArray) -> None:
        self.discard(key)
        if held.nbytes <= self._items.maxsize:
            self._items[key] = held.retain()  # may drop older arrays to fit

    def discard(self, key: Hashable) -> None:
        held = self._items.pop(key, None)
        if held is not None:
            held.release()

    def drop_oldest(self) -> bool:
        if not self._items:
            return False
        self._items.popitem()
        return True

    @property
    def bytes(self) -> int:
        return int(self._items.currsize)

    def __len__(self) -> int:
        return len(self._items)
