"""What this daemon knows of its store's entries without asking the disk: a bit per
original verified in its life, and one per original believed stored.

So an open of an array verified before needs no disk, and one believed stored
needs none until its first READ verifies it. On the trio thread alone; evictions
the store notes from its threads are read here only. Knows the sources and the
store's generation and evictions; not how an entry is read, checked or decoded.
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

from ..common.config import Config
from ..common.entry import EntryKey
from ..common.source import SourceIndex
from ..store import Store
from .entry_reads import EntryReads
from .workers import run_in_thread

__all__ = ["Bitmap", "KnownEntries"]


class Bitmap:
    """One bit per original: 46 KiB per (version, size) at 370k originals."""

    def __init__(self, size: int) -> None:
        self.bits = bytearray((size + 7) // 8)

    def __getitem__(self, index: int) -> bool:
        return bool(self.bits[index >> 3] & (1 << (index & 7)))

    def set(self, index: int, value: bool) -> None:
        if value:
            self.bits[index >> 3] |= 1 << (index & 7)
        else:
            self.bits[index >> 3] &= ~(1 << (index & 7)) & 0xFF


class KnownEntries:
    def __init__(
        self,
        config: Config,
        sources: Mapping[str, SourceIndex],
        store: Store,
        reads: EntryReads,
        read_limiter: trio.CapacityLimiter,
    ) -> None:
        self._config = config
        self._sources = sources
        self._store = store
        self._reads = reads
        self._read_limiter = read_limiter
        # (version, size) -> a bit per original, set once verified in this daemon's life;
        # and a bit per original believed stored (from the catalog, and the writes since),
        # so that its open needs no disk: the first READ verifies it. Only ever cleared
        # in place: the engine's hot path holds these very dicts.
        self.verified: dict[tuple[str, int], Bitmap] = {}
        self.stored: dict[tuple[str, int], Bitmap] = {}
        self.generation = store.generation

    def mark_stored(self, key: EntryKey, index: int) -> None:
        """``key``'s entry is stored and verified (written, or checked, just now)."""
        self.verified_map(key.version, key.size).set(index, True)
        self.stored_map(key.version, key.size).set(index, True)

    def forget_evicted(self) -> None:
        """Forget the entries the store evicted since (and all, if the store was lost)."""
        self.notice_store_generation()
        # The store appends evicted keys from its threads; only we read them.
        evicted = self._store.capacity.evicted
        while evicted:
            key = evicted.popleft()
            source = self._sources.get(key.version)  # None: a version no longer configured
            index = source.find(key.key) if source is not None else None
            if index is not None:
                self.not_stored(key, index)

    def notice_store_generation(self) -> None:
        if self._store.generation != self.generation:
            # The store was removed or made again: nothing verified before is there.
            self.generation = self._store.generation
            self.verified.clear()
            self.stored.clear()
            self._reads.forget_all()

    def verified_map(self, version: str, size: int) -> Bitmap:
        verified = self.verified.get((version, size))
        if verified is None:
            verified = self.verified[version, size] = Bitmap(len(self._sources[version]))
        return verified

    def stored_map(self, version: str, size: int) -> Bitmap:
        stored = self.stored.get((version, size))
        if stored is None:
            stored = self.stored[version, size] = Bitmap(len(self._sources[version]))
        return stored

    def not_stored(self, key: EntryKey, index: int) -> None:
        """``key``'s entry is gone or not to be trusted: its opens go the whole way."""
        self.verified_map(key.version, key.size).set(index, False)
        self.stored_map(key.version, key.size).set(index, False)
        self._reads.forget(key)

    async def note_stored(self) -> None:
        """Learn from the catalog which arrays of the configured sizes are stored, so that
        their opens need no disk (each is verified at its first READ). Before this, or
        for other sizes, an open verifies the entry first."""
        generation = self._store.generation
        for version in sorted(self._config.versions):
            source = self._sources[version]
            for size in self._config.versions[version].sizes:
                keys = await run_in_thread(
                    self._read_limiter, self._store.stored_keys, version, size
                )
                if self._store.generation != generation:
                    return  # the store was lost meanwhile: what it held is gone
                stored = self.stored_map(version, size)
                for key in keys:
                    index = source.find(key)
                    if index is not None:
                        stored.set(index, True)
                await trio.lowlevel.checkpoint()
