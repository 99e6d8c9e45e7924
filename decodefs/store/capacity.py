"""The store's capacity: usage counters, the catalog fill, limits, reservations, pins and
LRU eviction.

Usage comes from the catalog (catalog.py), so it is known at start without a
scan; a new catalog on an existing store is filled from a scan of its entry
files in a background thread while the daemon already serves. Past
``max_bytes`` (or below ``min_free_fraction`` of the filesystem free),
least-recently-used entries are evicted before a new one is written, except
pinned ones: a caller pins a key while it relies on its file. Writers reserve
their room first, so concurrent writers never each find the same free space.
This module knows the catalog and entry keys; it does no I/O of its own beyond
the callables the store hands it (statvfs, unlink, the scan).

Concurrency: every method may be called from any thread, but ``pin``,
``pin_hit`` and ``unpin``, which only the event loop calls: pins change on
that one thread, with no lock (open's hot path), and an evictor reads a key's
pin count in one dictionary read. Three locks, never one held while taking
another out of this order: ``_evict_lock`` (one evictor at a time) before
``_count_lock`` (the counters and reservations together with the catalog
rows they mirror; held across SQLite, never taken by the event loop);
``_access_lock`` guards pending accesses alone. ``usage()`` reads the
counters without a lock.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from ..common.entry import EntryKey
from .catalog import Catalog

__all__ = ["Capacity", "SizeUsage", "StoreUsage"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_EVICT_BATCH: Final = 64
_FILL_BATCH: Final = 2000


@dataclass(frozen=True)
class StoreUsage:
    entries: int
    bytes: int
    complete: bool  # False while a scan is still filling the catalog
    evictions: int = 0


@dataclass(frozen=True)
class SizeUsage:
    """What the store holds of one version at one size."""

    entries: int
    bytes: int


class Capacity:
    def __init__(
        self,
        *,
        max_bytes: int | None,
        min_free_fraction: float | None,
        statvfs: Callable[[], os.statvfs_result],
        unlink: Callable[[EntryKey], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_bytes = max_bytes
        self.min_free_fraction = min_free_fraction
        self._statvfs = statvfs
        self._unlink = unlink
        self._clock = clock  # wall-clock seconds: last access times outlive the daemon
        self._evict_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._access_lock = threading.Lock()
        self._catalog: Catalog | None = None
        self._entries = 0
        self._bytes = 0
        # (version, size) -> its usage, changed with _entries and _bytes. Each value is
        # replaced whole, never changed in place, so a reader's dict() copy is a
        # consistent snapshot of each pair (CPython copies a dict under the GIL).
        self._by_size: dict[tuple[str, int], SizeUsage] = {}
        self._reserved = 0
        self._reservations: dict[EntryKey, int] = {}
        self._filled = True
        self._removed_while_filling: set[EntryKey] = set()
        self._fill_done = threading.Event()  # no fill scan is running
        self._fill_done.set()
        self._fill_thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._pins: dict[EntryKey, int] = {}
        # (version, size, key), an EntryKey or a plain tuple (a report's), to its last hit
        self._accesses: dict[tuple[str, int, str], float] = {}
        self.evicted: deque[EntryKey] = deque()  # for the engine to forget; thread-safe appends
        self.evictions = 0

    @property
    def limited(self) -> bool:
        return self.max_bytes is not None or self.min_free_fraction is not None

    # -- the catalog behind the counters ----------------------------------------------

    def attach(self, catalog: Catalog, *, filled: bool) -> None:
        """Count from ``catalog`` from now on (at open, and when the store is made again)."""
        entries, nbytes = catalog.totals()
        by_size = _usage_by_size(catalog)
        with self._count_lock:
            self._catalog = catalog
            self._entries, self._bytes = entries, nbytes
            self._by_size = by_size
            self._filled = filled
            self._removed_while_filling.clear()
        with self._access_lock:
            self._accesses.clear()

    def detach(self) -> Catalog | None:
        """Stop counting (the store is gone): usage reads zero until ``attach``."""
        with self._count_lock:
            catalog, self._catalog = self._catalog, None
            self._entries = self._bytes = 0
            self._by_size = {}
            self._filled = True
        with self._access_lock:
            self._accesses.clear()
        return catalog

    def discard_version(self, version: str) -> SizeUsage | None:
        """Drop every row of ``version`` (its arrays went to the trash); OSError on failure.
        Returns what the rows counted, None if that is not known (a catalog still to be
        filled by a scan)."""
        with self._count_lock:
            catalog = self._catalog
            if catalog is None:
                return None
            held = [u for (v, _), u in self._by_size.items() if v == version]
            known = self._filled
            _catalog_call(catalog.remove_version, version)
            self._entries, self._bytes = _catalog_call(catalog.totals)
            self._by_size = {k: u for k, u in self._by_size.items() if k[0] != version}
        if not known:
            return None
        return SizeUsage(sum(u.entries for u in held), sum(u.bytes for u in held))

    # -- the fill from disk -------------------------------------------------------------

    def fill_in_background(
        self,
        scan: Callable[[], Iterable[tuple[EntryKey, os.stat_result]]],
        exists: Callable[[EntryKey], bool],
        *,
        durable: bool,
        where: str,
    ) -> None:
        """Fill the catalog attached, which is new (``attach(filled=False)``), from
        ``scan`` (every entry file, with its stat) in a thread; ``durable``: mark
        it filled, so the next start needs no scan. ``where``: the store, for the log."""

        def fill() -> None:
            started = time.monotonic()
            try:
                if not self._fill_rows((key, st.st_size, st.st_mtime) for key, st in scan()):
                    return
                self._finish_fill(exists, durable=durable)
            except (sqlite3.Error, OSError) as exc:
                log.error("cannot fill the catalog of %s: %s; usage is undercounted", where, exc)
                self._filled = True
            finally:
                self._fill_done.set()
            log.info(
                "store %s holds %d entries, %.1f MiB (catalog filled from disk in %.1f s)",
                where,
                self._entries,
                self._bytes / 2**20,
                time.monotonic() - started,
            )

        self._fill_done.clear()
        self._fill_thread = threading.Thread(target=fill, name="store-catalog-fill", daemon=True)
        self._fill_thread.start()

    def wait_filled(self, timeout: float) -> None:
        """Block until no fill scan is running, or ``timeout`` seconds (tests, tools)."""
        self._fill_done.wait(timeout)

    def stop_filling(self) -> None:
        """End a fill scan (the next start fills the catalog again) and wait for it."""
        self._closing.set()
        if self._fill_thread is not None:
            self._fill_thread.join()

    def _fill_rows(self, rows: Iterable[tuple[EntryKey, int, float]]) -> bool:
        """Add rows a scan of the store found; True if the scan ran to its end."""
        catalog = self._catalog
        if catalog is None:
            return False
        batch: list[tuple[str, int, str, int, float]] = []
        for key, nbytes, mtime in rows:
            if self._closing.is_set():
                return False  # the next start fills it again
            batch.append((key.version, key.size, key.key, nbytes, mtime))
            if len(batch) >= _FILL_BATCH:
                catalog.fill(batch)
                batch.clear()
        catalog.fill(batch)
        return True

    def _finish_fill(self, exists: Callable[[EntryKey], bool], *, durable: bool) -> None:
        """The scan has ended: usage is exact from now on."""
        with self._count_lock:
            catalog = self._catalog
            if catalog is None:
                return
            # Files the scan listed but that were evicted or removed before
            # their row went in must not come back as rows.
            for key in self._removed_while_filling:
                if not exists(key):
                    catalog.remove(key.version, key.size, key.key)
            self._removed_while_filling.clear()
            if durable:
                catalog.mark_filled()
            # Writes and evictions went on meanwhile; the catalog is the truth.
            self._entries, self._bytes = catalog.totals()
            self._by_size = _usage_by_size(catalog)
            self._filled = True

    def stored_keys(self, version: str, size: int) -> set[str]:
        catalog = self._catalog
        return set() if catalog is None else catalog.keys(version, size)

    # -- usage ---------------------------------------------------------------------

    def usage(self) -> StoreUsage:
        # No lock: plain int reads; a momentary mismatch is harmless in a status file.
        return StoreUsage(self._entries, self._bytes, self._filled, self.evictions)

    def usage_by_size(self) -> dict[tuple[str, int], SizeUsage]:
        """(version, size) -> what the store holds of it (no lock: see ``_by_size``)."""
        return dict(self._by_size)

    def would_evict(self, incoming: int) -> bool:
        """Whether writing ``incoming`` more bytes would evict something first."""
        return self.limited and self._shortfall(incoming) > 0

    # -- pins and accesses -----------------------------------------------------------

    def pin(self, key: EntryKey) -> None:
        """Keep ``key``'s file from eviction until unpin. Event loop only (see the module's
        docstring): cheap, no lock."""
        pins = self._pins
        pins[key] = pins.get(key, 0) + 1

    def pin_hit(self, key: EntryKey) -> None:
        """``pin`` and ``record_access`` in one call: open's hot path."""
        now = self._clock()
        pins = self._pins
        pins[key] = pins.get(key, 0) + 1
        with self._access_lock:
            self._accesses[key] = now

    def unpin(self, key: EntryKey) -> None:
        pins = self._pins
        count = pins.pop(key, 1) - 1
        if count > 0:
            pins[key] = count

    def pinned(self, key: EntryKey) -> bool:
        return bool(self._pins.get(key))

    def record_access(self, key: EntryKey, limit: int | None = None) -> bool:
        """Note a hit for LRU; written to the catalog by flush_accesses. Cheap.

        With ``limit``, a new key is noted only while fewer than ``limit`` are
        pending; returns whether it was noted.
        """
        now = self._clock()
        with self._access_lock:
            if limit is not None and len(self._accesses) >= limit and key not in self._accesses:
                return False
            self._accesses[key] = now
        return True

    def record_accesses(
        self, keys: Sequence[tuple[str, int, str]], limit: int | None = None
    ) -> int:
        """``record_access`` of each of ``keys`` (``(version, size, key)``, an EntryKey or a
        plain tuple) at one time and under one lock (a report of direct hits); with
        ``limit``, new keys past it are not noted. Returns how many were noted."""
        now = self._clock()
        with self._access_lock:
            accesses = self._accesses
            before = len(accesses)
            accesses.update(dict.fromkeys(keys, now))
            added = len(accesses) - before  # the keys not pending before, last in the dict
            over = 0 if limit is None else max(0, min(added, len(accesses) - limit))
            for _ in range(over):  # dropped until the next flush
                accesses.popitem()
            return len(keys) - over

    def flush_accesses(self) -> None:
        with self._access_lock:
            accesses, self._accesses = self._accesses, {}
        catalog = self._catalog
        if accesses and catalog is not None:
            try:
                catalog.touch((v, s, k, t) for (v, s, k), t in accesses.items())
            except sqlite3.Error as exc:
                log.warning("cannot record %d accesses in the catalog: %s", len(accesses), exc)

    # -- writes ----------------------------------------------------------------------

    @contextlib.contextmanager
    def room(self, key: EntryKey, incoming: int, *, may_evict: bool) -> Iterator[None]:
        """Hold room for ``incoming`` bytes of ``key``, evicting least-recently-used,
        unpinned entries first if a limit needs it; raises OSError (EDQUOT, ENOSPC)
        if there is none. The room is released when ``commit`` counts the entry
        or the block ends."""
        if self.limited:
            with self._evict_lock:
                need = self._shortfall(incoming)
                if need > 0:
                    if not may_evict:
                        raise OSError(errno.EDQUOT, "the store is at its capacity limit")
                    if need > self._bytes:
                        # Other data filled the filesystem: evicting everything would
                        # still not make room, so evict nothing.
                        raise OSError(
                            errno.ENOSPC,
                            f"no room even if every entry were evicted ({need:,} bytes short)",
                        )
                    self._evict_for(key, incoming)
                with self._count_lock:
                    self._reservations[key] = incoming
                    self._reserved += incoming
        try:
            yield
        finally:
            with self._count_lock:
                self._reserved -= self._reservations.pop(key, 0)

    def commit(self, key: EntryKey, nbytes: int, place: Callable[[], None]) -> None:
        """Record ``key`` in the catalog, then ``place`` its file (a rename), then count it.

        The row is committed (and synced) before the file appears, so the
        catalog stays a superset of the files; if ``place`` fails, a new row
        is dropped again. Raises OSError.
        """
        with self._count_lock:
            catalog = self._catalog
            if catalog is None:
                raise OSError(errno.ENOENT, "the store is gone")
            new = _catalog_call(catalog.put, key.version, key.size, key.key, nbytes, self._clock())
            try:
                place()
            except OSError:
                if new:
                    _catalog_call(catalog.remove, key.version, key.size, key.key)
                raise
            if new:
                self._entries += 1
                self._bytes += nbytes
                self._count_size(key, 1, nbytes)
            self._reserved -= self._reservations.pop(key, 0)  # with the count, at once

    def forget(self, key: EntryKey) -> None:
        """Drop ``key``'s row (after its file is gone) and uncount it; OSError on failure."""
        with self._count_lock:
            catalog = self._catalog
            if catalog is None:
                return
            nbytes = _catalog_call(catalog.remove, key.version, key.size, key.key)
            if not self._filled:
                self._removed_while_filling.add(key)
            if nbytes is not None:
                self._entries -= 1
                self._bytes -= nbytes
                self._count_size(key, -1, -nbytes)

    def _count_size(self, key: EntryKey, entries: int, nbytes: int) -> None:
        """Count an entry in or out of its (version, size); with ``_count_lock`` held."""
        pair = (key.version, key.size)
        old = self._by_size.get(pair, SizeUsage(0, 0))
        new = SizeUsage(old.entries + entries, old.bytes + nbytes)
        if new.entries > 0:
            self._by_size[pair] = new
        else:
            self._by_size.pop(pair, None)

    # -- eviction --------------------------------------------------------------------

    def over_limit(self) -> bool:
        """Whether the store holds more than its limits allow now (a limit lowered since
        the entries were written); False while a scan is still counting it."""
        return self._filled and self.limited and self._trim_need() > 0

    def trim(self) -> tuple[int, int]:
        """Evict least-recently-used, unpinned entries until the store is within its
        limits; returns the entries and bytes evicted. A batch at a time, the evict
        lock let go between batches, so a writer waits for one batch at most, and a
        reader never (pinned entries are skipped). Raises OSError if the catalog fails."""
        evicted = freed = 0
        skipped = 0  # pinned rows stay at the front of the LRU order
        while True:
            with self._evict_lock:
                catalog = self._catalog
                if catalog is None or self._trim_need() <= 0:
                    return evicted, freed
                self.flush_accesses()  # so that recent hits are not the oldest
                rows = _catalog_call(catalog.oldest, _EVICT_BATCH, skipped)
                if not rows:
                    return evicted, freed  # every entry left is pinned
                for row in rows:
                    if self._trim_need() <= 0:
                        break
                    if self._evict(EntryKey(row.version, row.size, row.key)):
                        evicted += 1
                        freed += row.bytes
                    else:
                        skipped += 1

    def _trim_need(self) -> int:
        """Bytes to evict to be within the limits now; only ``max_bytes``'s share when
        other data fills the filesystem (evicting every entry would not free enough)."""
        need = self._shortfall(0)
        if need > self._bytes:
            need = 0 if self.max_bytes is None else self._bytes + self._reserved - self.max_bytes
        return need

    def _shortfall(self, incoming: int) -> int:
        """Bytes to free before ``incoming`` more fit within the limits (<= 0: none).

        Room reserved by writes in progress counts as used.
        """
        need = 0
        if self.max_bytes is not None:
            need = self._bytes + self._reserved + incoming - self.max_bytes
        if self.min_free_fraction is not None:
            vfs = self._statvfs()
            free = vfs.f_bavail * vfs.f_frsize - incoming - self._reserved
            need = max(need, int(self.min_free_fraction * vfs.f_blocks * vfs.f_frsize) - free)
        return need

    def _evict_for(self, key: EntryKey, incoming: int) -> None:
        catalog = self._catalog
        if catalog is None:
            raise OSError(errno.ENOENT, "the store is gone")
        self.flush_accesses()  # so that recent hits are not the oldest
        skipped = 0  # pinned rows stay at the front of the LRU order
        while self._shortfall(incoming) > 0:
            rows = _catalog_call(catalog.oldest, _EVICT_BATCH, skipped)
            if not rows:
                raise OSError(
                    errno.EDQUOT,
                    "the store is at its capacity limit and every entry left is in use",
                )
            for row in rows:
                victim = EntryKey(row.version, row.size, row.key)
                if victim == key or not self._evict(victim):
                    skipped += 1
                if self._shortfall(incoming) <= 0:
                    break

    def _evict(self, key: EntryKey) -> bool:
        """Unlink ``key`` unless pinned, then drop its row; raises OSError if the
        catalog fails (eviction must stop: it could not tell what it freed).

        The pin check and the unlink are not atomic: a reader that pins the
        key in between may find its verified file gone. The engine then
        decodes it again (its reads fail open), which is what that reader
        would have met a moment later anyway; in exchange no system call ever
        runs under the lock the event loop takes.
        """
        if self._pins.get(key):  # a read of one key: atomic, whoever pins meanwhile
            return False
        self.evicted.append(key)  # before the unlink: an open from now on re-verifies
        self._unlink(key)
        self.forget(key)
        self.evictions += 1
        return True


def _usage_by_size(catalog: Catalog) -> dict[tuple[str, int], SizeUsage]:
    return {pair: SizeUsage(*figures) for pair, figures in catalog.totals_by_size().items()}


def _catalog_call(fn: Callable[..., T], *args: object) -> T:
    """A catalog call whose failure is an OSError, like any other storage failure (a
    full filesystem is ENOSPC, as when an entry's own write meets it)."""
    try:
        return fn(*args)
    except sqlite3.Error as exc:
        full = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
        raise OSError(errno.ENOSPC if full else errno.EIO, f"catalog: {exc}") from exc
