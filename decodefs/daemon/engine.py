"""Caching policy: a stored hit, or one decode per key, stored; never a failure it can avoid.

``Engine.open`` returns a Handle for one array: a verified store entry (read
from its file), or an array held in memory when the store cannot take it.
Caching policy lives here and nothing else: the namespace is namespace.py's
(over the sources), running decodes decodes.py's, what is known verified or
stored known.py's, READs of entries and their page cache entry_reads.py's, the
stats snapshot stats.py's, the background warm's choice of arrays
background_warm.py's, the per-user limit admission.py's, direct-hit reports
direct_hits.py's. The engine runs its own periodic loops (``run``). The fs
layer only translates FUSE requests, and this module never imports pyfuse3.

Concurrency: everything here runs on the trio thread, so the engine's own
state needs no locks. Blocking work goes to worker threads: decodes as
decodes.py runs them, and store reads and writes through their own limiters,
so a hit never queues behind decodes or slow writes. ``_flights`` is the
single-flight map: one task per key does the
work, every other opener of that key waits for its result (a reader waiting
on a warm decode boosts it). Every open handle and every flight pins its key
in the store, so eviction never removes a file someone relies on.

Memory: a stored array is served from its file, never held. Every array in
memory (a decode in flight, an array the store did not take) counts against
one budget (memory.py); when it is spent, new decodes wait. An open file holds
no memory between its requests: an array the store did not take lives in the
memory cache, which the budget may always reclaim, and a read that finds it
dropped fetches it again (``memory_refills``). So memory is only ever waited
for by requests in progress, which finish: no reader holding files open can
make another's open wait for good.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

import trio

from ..cluster import L2Tier
from ..common.config import Config
from ..common.entry import EntryKey
from ..common.metrics import LogThrottle, Metrics
from ..common.npy import npy_file_size
from ..common.source import SourceIndex
from ..store import (
    CorruptEntry,
    Store,
    StoreReadError,
    StoreWriteError,
    VerifiedEntry,
)
from .admission import WAITING_PER_USER, Admission
from .decodes import Decodes, OriginalNotFound, OriginalUndecodable, Purpose
from .entry_reads import EntryReads, Pages
from .known import KnownEntries
from .memory import HeldArray, MemoryBudget, MemoryCache
from .upkeep import ACCESS_FLUSH_SECONDS, STORE_CHECK_SECONDS, StoreUpkeep
from .workers import Job, run_in_thread

__all__ = [
    "Engine",
    "Handle",
    "OriginalNotFound",
    "OriginalUndecodable",
]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Handle:
    """One open array, pinned in the store until released. Reads come from the store
    entry, verified earlier in this daemon's life, or with ``in_memory`` from the
    memory cache (fetched again if it was dropped); the handle itself holds nothing."""

    key: EntryKey
    index: int
    length: int
    in_memory: bool = False
    may_store: bool = True  # whether a fetch for this handle may store the array
    uid: int | None = None  # who opened it, if not the daemon's own user
    pages: Pages = Pages.NOT_OURS  # the entry file's cached pages, dropped at release if ours
    unverified: bool = False  # stored, but not yet checked in this daemon's life: its first
    # READ checks it (and rebuilds it if it fails), so the open needed no disk; that READ
    # counts the open as a hit or a miss, if a reader's
    reader: bool = True  # opened by a reader (not a warm request)

    @property
    def memory_key(self) -> Hashable:
        """Its array's key in the memory cache: one kept for a user who may not store
        it is kept apart, so that a user who may still stores it."""
        return self.key if self.may_store else (self.key, "unlisted")


@dataclass(frozen=True)
class _Outcome:
    held: HeldArray | None  # the bytes, when the store did not take them (a hold for each opener)
    decoded: bool  # a decode ran for it (a miss), rather than a verified stored hit
    refused: str | None = None  # why the store would not take it (an errno name)
    pages: Pages = Pages.NOT_OURS  # what getting it did to the entry file's page cache

    @property
    def stored(self) -> bool:
        return self.held is None


@dataclass
class _Flight:
    done: trio.Event = field(default_factory=trio.Event)
    outcome: _Outcome | None = None
    error: Exception | None = None
    job: Job[tuple[bytes, float]] | None = None  # a warm decode, which a reader may boost
    boosted: bool = False  # a reader waits for it (a warm decode not yet submitted too)
    waiters: int = 0  # openers waiting for the outcome, each to get its own hold


# EntryKey(...) without NamedTuple's Python-level __new__, for open's hot path.
_new_key = tuple.__new__

# How often a key another process claimed is tried again (seconds, doubling).
CLAIM_POLL_FIRST: Final = 0.005
CLAIM_POLL_MAX: Final = 0.1


class Engine:
    def __init__(
        self,
        config: Config,
        sources: Mapping[str, SourceIndex],
        store: Store,
        metrics: Metrics | None = None,
        *,
        clock: Callable[[], float] = trio.current_time,
        l2: L2Tier | None = None,
        waiting_per_user: int = WAITING_PER_USER,
    ) -> None:
        self.config = config
        self.l2 = l2  # the cluster's shared tier (cluster/tier.py), asked before decoding
        self.metrics = metrics or Metrics()
        self.store = store
        # Pins, accesses and evictions (store/capacity.py: pins are the event loop's alone).
        self._capacity = store.capacity
        self._sources = sources
        self._clock = clock
        self._owner = os.geteuid()
        self._read_limiter = trio.CapacityLimiter(config.io_workers)
        self._write_limiter = trio.CapacityLimiter(config.io_workers)
        self._flights: dict[EntryKey, _Flight] = {}
        # Serving READs of stored entries, and dropping the entry pages they brought in.
        self.reads = EntryReads(store, self._read_limiter, self.metrics, clock=clock)
        # What is verified and stored, without the disk (known.py). Its dicts, held here
        # too for open's hot path, are only ever cleared in place.
        self.known = KnownEntries(config, sources, store, self.reads, self._read_limiter)
        self._verified, self._stored = self.known.verified, self.known.stored
        self.upkeep = StoreUpkeep(store, self.known, self._write_limiter)
        self._decodes = Decodes(config, sources, self.metrics, self._read_limiter, clock=clock)
        self.decode_memory = self._decodes.memory  # stats.py reports it
        self.failed = self._decodes.failed  # originals that failed to decode (failed.json)
        self.memory = MemoryBudget(config.memory_cache_bytes)
        # Arrays the store did not take (stats.py reads its size).
        self.memory_cache = MemoryCache(self.memory)
        self._throttle = LogThrottle(log)
        # Requests of each other user waiting for a decode now (admission.py).
        self.admission = Admission(self.metrics, waiting_per_user)
        # Versions none of whose arrays may be served yet (``hold``): their decode
        # settings changed while an earlier serving process of the mount still serves.
        self._held: dict[str, trio.Event] = {}

    # -- versions held ----------------------------------------------------------

    def hold(self, versions: Iterable[str]) -> None:
        """Serve none of ``versions``' arrays until ``release_held``: opens and reads wait."""
        for version in versions:
            self._held.setdefault(version, trio.Event())

    def release_held(self) -> None:
        held, self._held = self._held, {}
        for event in held.values():
            event.set()

    async def _unheld(self, version: str) -> None:
        event = self._held.get(version)
        if event is not None:
            await event.wait()

    # -- arrays -------------------------------------------------------------

    async def open(
        self,
        version: str,
        size: int,
        index: int,
        *,
        warm: bool = False,
        recheck: bool = False,
        uid: int | None = None,
    ) -> Handle:
        """A handle for the array of original ``index``; decodes at most once per key.

        Raises OriginalNotFound or OriginalUndecodable; never a store problem.
        The handle pins the entry until ``release``. A ``warm`` request (a
        client filling the cache, not reading) decodes at low priority and
        never evicts; if the store will not take the array, the handle still
        serves it (a reader must never fail for the flag) and ``warm_not_stored``
        counts it. ``uid`` is who asks (None: the daemon's own user); a size the
        version does not list is stored only as ``unlisted_sizes`` says (by
        default for nobody: served from memory), so no one can fill the flash
        with sizes nobody configured. ``recheck``
        verifies the stored entry again even if it was verified earlier in this
        daemon's life (a reader found it damaged). Any user may ask: a recheck
        reads and hashes the file once, as reading it would, joins one already
        running for the key, and waits for a store read slot, so a flood of them
        costs no more than a flood of reads.
        """
        if self._held:
            await self._unheld(version)
        key = EntryKey(version, size, self._sources[version].keys[index])
        if recheck:  # check it now, at this open, whatever was believed of it
            self.known.not_stored(key, index)
        self._capacity.pin(key)
        try:
            return await self._open_pinned(
                key,
                index,
                Purpose.WARM_REQUEST if warm else Purpose.READ,
                may_store=self._may_store(version, size, uid),
                uid=None if uid == self._owner else uid,
            )
        except BaseException:
            self._capacity.unpin(key)
            raise

    def open_verified(self, version: str, size: int, index: int, uid: int | None) -> Handle | None:
        """``open``'s hot path, with nothing to wait for: a handle for a reader's open of
        an array verified earlier in this daemon's life, or believed stored (its first
        READ then verifies it); None if ``open`` must do more.

        The bits change only on this thread; evictions, noted by the store's threads,
        are checked after the pin, so eviction cannot take the file once the check
        has passed. Written for the fewest steps: it runs for most requests.
        """
        if self._held and version in self._held:
            return None
        verified = self._verified.get((version, size))
        bit = 1 << (index & 7)
        unverified = verified is None or not verified.bits[index >> 3] & bit
        if unverified:
            stored = self._stored.get((version, size))
            if stored is None or not stored.bits[index >> 3] & bit:
                return None
        key = _new_key(EntryKey, (version, size, self._sources[version].keys[index]))
        capacity = self._capacity
        capacity.pin_hit(key)
        if capacity.evicted or self.store.generation != self.known.generation:
            capacity.unpin(key)  # evictions the bits do not know of: the whole way notes them
            return None
        if unverified:
            handle = Handle(key, index, npy_file_size(size), False, True, None)
            handle.unverified = True
        else:
            self.metrics.hits += 1
            handle = Handle(key, index, npy_file_size(size))
        if uid != self._owner:
            handle.uid, handle.may_store = uid, self._may_store(version, size, uid)
        return handle

    async def run(
        self,
        access_flush: float = ACCESS_FLUSH_SECONDS,
        store_check: float = STORE_CHECK_SECONDS,
    ) -> None:
        """The engine's own work beside the requests, until cancelled (a task of the
        daemon's nursery): learn what is stored, record hits for LRU, watch the
        store, bring it within its limits, drop the entry pages brought in, and
        publish to the cluster's L2."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.known.note_stored)
            nursery.start_soon(self.upkeep.flush_accesses_forever, access_flush)
            nursery.start_soon(self.upkeep.watch_store_forever, store_check)
            nursery.start_soon(self.upkeep.trim_forever, store_check)
            nursery.start_soon(self.reads.drop_forever)
            if self.l2 is not None:
                nursery.start_soon(self.l2.run)

    def close(self) -> None:
        self._decodes.close()
        if self.l2 is not None:
            self.l2.close()

    def _may_store(self, version: str, size: int, uid: int | None) -> bool:
        """Whether an array of ``size`` asked for by ``uid`` may go to flash: a listed
        size always; one no version lists as ``unlisted_sizes`` says (by default never:
        a typo such as 2240 must not fill the flash with a second cache)."""
        if size in self.config.versions[version].sizes:
            return True
        unlisted = self.config.unlisted_sizes
        return unlisted == "everyone" or (
            unlisted == "owner" and (uid is None or uid == self._owner)
        )

    def release(self, handle: Handle) -> None:
        self._capacity.unpin(handle.key)
        # Served (or never to be read through this open): the mount's page cache holds
        # what readers need, so a copy of the entry file's that is ours goes.
        self.reads.release(handle.key, handle.pages)

    async def read(self, handle: Handle, offset: int, size: int) -> memoryview | bytes | bytearray:
        end = min(offset + size, handle.length)
        if offset >= end:
            return b""
        if self._held:
            await self._unheld(handle.key.version)
        if handle.unverified:
            await self._verify_for_read(handle)
        data: memoryview | bytes | bytearray
        if handle.in_memory:
            data = await self._read_memory(handle, offset, end - offset)
        else:
            data = await self._read_stored(handle, offset, end - offset)
        self.metrics.bytes_served += len(data)
        return data

    async def warm_one(self, version: str, size: int, index: int) -> bool:
        """Decode and store one array for the background warm (background_warm.py), at low
        priority, unless it is stored, in flight or failed lately. False if the store
        would take it only by evicting, or did not take it: the warm stops then."""
        key = EntryKey(version, size, self._sources[version].keys[index])
        if (
            self.known.verified_map(version, size)[index]
            or self.known.stored_map(version, size)[index]
            or key in self._flights
            or key in self._decodes.failures
        ):
            return True
        if await run_in_thread(self._read_limiter, self._capacity.would_evict, npy_file_size(size)):
            return False
        if key in self._flights:  # a reader got there meanwhile
            return True
        self._capacity.pin(key)
        try:
            flight = await self._fly(key, index, Purpose.BACKGROUND)
        finally:
            self._capacity.unpin(key)
        outcome = flight.outcome
        if outcome is not None:
            self.reads.release(key, outcome.pages)  # nobody reads it through the mount now
        if outcome is not None and outcome.held is not None:
            outcome.held.release()  # nobody reads it
            return False
        return True

    # -- internals ----------------------------------------------------------

    async def _open_pinned(
        self,
        key: EntryKey,
        index: int,
        purpose: Purpose,
        *,
        may_store: bool = True,
        uid: int | None = None,
    ) -> Handle:
        self.known.forget_evicted()
        reading = purpose is Purpose.READ
        length = npy_file_size(key.size)
        verified = self.known.verified_map(key.version, key.size)
        handle = Handle(key, index, length, may_store=may_store, uid=uid)
        if verified[index]:
            # Pinned before this check, so eviction cannot take the file now.
            self.metrics.hits += reading
            self._capacity.record_access(key)
            return handle
        if (
            purpose is not Purpose.BACKGROUND
            and self.known.stored_map(key.version, key.size)[index]
        ):
            # Believed stored: the open needs no disk; a READ verifies it first.
            self._capacity.record_access(key)
            handle.unverified, handle.reader = True, reading
            return handle
        if self.memory_cache.touch(handle.memory_key):
            self.metrics.hits += reading
            handle.in_memory = True
            return handle
        self._decodes.check_recent_failure(key)
        with self.admission.waiting(uid):
            outcome = await self._outcome(key, index, purpose, may_store=may_store)
        handle.pages = outcome.pages
        if not reading:  # a size this user may not store is no sign of a full store
            self.metrics.warm_not_stored += outcome.refused not in (None, "unlisted")
        elif outcome.decoded:
            self.metrics.misses += 1
        else:
            self.metrics.hits += 1
            self._capacity.record_access(key)
        if outcome.held is not None:
            # Kept where memory can be reclaimed, not by this handle (see the docstring).
            self.memory_cache.put(handle.memory_key, outcome.held)
            outcome.held.release()
            handle.in_memory = True
        return handle

    async def _verify_for_read(self, handle: Handle) -> None:
        """Before the first bytes of an entry opened as believed stored: check it, as an
        open would have (a single flight: it is rebuilt if it fails)."""
        key, index = handle.key, handle.index
        decoded = False
        if not self.known.verified_map(key.version, key.size)[index]:  # none verified it since
            self._decodes.check_recent_failure(key)
            with self.admission.waiting(handle.uid):
                outcome = await self._outcome(key, index, Purpose.READ, may_store=handle.may_store)
            handle.pages, decoded = outcome.pages, outcome.decoded
            if outcome.held is not None:
                self.memory_cache.put(handle.memory_key, outcome.held)
                outcome.held.release()
                handle.in_memory = True
        handle.unverified = False  # only now: a READ cancelled before this checks again
        if handle.reader:  # the open's count: a miss if the entry failed and was rebuilt
            self.metrics.misses += decoded
            self.metrics.hits += not decoded

    async def _outcome(
        self, key: EntryKey, index: int, purpose: Purpose, *, may_store: bool
    ) -> _Outcome:
        """``key`` acquired by this task or by the one already at it (single flight);
        an outcome in memory comes with a hold for the caller to release."""
        reading = purpose is Purpose.READ
        while True:
            flight = self._flights.get(key)
            if flight is None:
                flight = await self._fly(key, index, purpose, may_store=may_store)
            else:
                self.metrics.coalesced += reading
                if reading:
                    flight.boosted = True  # a reader now waits for this warm decode
                    if flight.job is not None:
                        flight.job.boost()
                flight.waiters += 1
                try:
                    await flight.done.wait()
                except BaseException:  # left before the outcome: no hold is kept for us
                    flight.waiters -= 1
                    raise
            if flight.outcome is not None or flight.error is not None:
                break
            # The flight was abandoned (its task cancelled, at shutdown): try again.
        if flight.error is not None:
            raise flight.error
        assert flight.outcome is not None
        return flight.outcome

    async def _fly(
        self, key: EntryKey, index: int, purpose: Purpose, *, may_store: bool = True
    ) -> _Flight:
        """Be the one task that acquires ``key``; others wait on the returned flight."""
        flight = self._flights[key] = _Flight()
        claims = self.store.flights
        claimed = False
        try:
            claimed = await self._claim(key)
            flight.outcome = await self._acquire(key, index, purpose, flight, may_store=may_store)
            if flight.outcome.stored:
                self.known.mark_stored(key, index)
        except Exception as exc:
            flight.error = exc
        finally:
            if claimed:
                claims.release(key)
            del self._flights[key]
            if flight.outcome is not None and flight.outcome.held is not None:
                for _ in range(flight.waiters):  # one hold each; the caller keeps the first
                    flight.outcome.held.retain()
            flight.done.set()
        return flight

    async def _claim(self, key: EntryKey) -> bool:
        """Claim ``key`` among the processes using the store (while serving processes of
        the mount overlap, another may be decoding it: wait for it, then find its
        entry stored). True once claimed."""
        delay = CLAIM_POLL_FIRST
        while not self.store.flights.claim(key):
            self.metrics.claim_waits += delay == CLAIM_POLL_FIRST
            await trio.sleep(delay)
            delay = min(2 * delay, CLAIM_POLL_MAX)
        return True

    async def _acquire(
        self, key: EntryKey, index: int, purpose: Purpose, flight: _Flight, *, may_store: bool
    ) -> _Outcome:
        """``key`` verified in the store, else freshly decoded (and stored if possible
        and ``may_store``)."""
        reading = purpose is Purpose.READ
        try:
            found = await run_in_thread(self._read_limiter, self._verify_stored, key, reading)
        except StoreReadError as exc:
            # Say nothing of its integrity and leave it; decode and replace it.
            self.metrics.errors[f"store_read_{exc.kind}"] += 1
            self._throttle.log(logging.WARNING, f"store-read-{exc.kind}", "%s; decoding it", exc)
            found = ""
        if isinstance(found, VerifiedEntry):  # its READs come next: from its payload if kept
            return _Outcome(None, decoded=False, pages=self.reads.verified(key, found))
        self.known.not_stored(key, index)  # none, or a bad one (removed): rebuilt below
        problem = found
        if problem:
            self.metrics.corrupt_entries += 1
            self._throttle.log(  # once per entry: a read-only store cannot drop it
                logging.WARNING,
                f"corrupt-{key}",
                "stored entry %s failed verification (%s); rebuilding it",
                key,
                problem,
            )
        # Twice the array: the decoded pixels and their .npy bytes, for a moment.
        granted = await self.memory.acquire(2 * npy_file_size(key.size))
        try:
            payload, decoded = await self._obtain(key, index, purpose, flight, may_store=may_store)
            data = memoryview(payload)
            held = self.memory.hold(data, granted)
        except BaseException:
            self.memory.release(granted)
            raise
        if not may_store:  # served to its readers, never kept: the next asks decode again
            self.metrics.unlisted_not_stored += 1
            return _Outcome(held, decoded=decoded, refused="unlisted")
        try:
            # A warm never evicts what readers have stored.
            await run_in_thread(
                self._write_limiter,
                functools.partial(self.store.write, key, data, may_evict=reading),
            )
        except StoreWriteError as exc:
            if exc.kind == "ENOENT":  # the store's directory is gone: notice it now
                await self.upkeep.check_store()
            self.metrics.store_write_errors += 1
            self.metrics.errors[f"store_{exc.kind}"] += 1
            if purpose is Purpose.READ:
                self.metrics.memory_fallbacks += 1
                self._throttle.log(
                    logging.WARNING, f"store-{exc.kind}", "%s; serving it from memory", exc
                )
            return _Outcome(held, decoded=decoded, refused=exc.kind)
        except BaseException:
            held.release()
            raise
        pages = self.reads.written(key, data, read_next=reading)
        held.release()  # stored: every reader reads the file
        return _Outcome(None, decoded=decoded, pages=pages)

    async def _obtain(
        self, key: EntryKey, index: int, purpose: Purpose, flight: _Flight, *, may_store: bool
    ) -> tuple[bytes | memoryview, bool]:
        """The array's .npy bytes, and whether they were decoded here: from the cluster's
        L2 when it has them (cluster/tier.py), else decoded here and published. The
        decode asks the tier whether to run once it can start (``Decodes.decode``)."""
        if self.l2 is None:
            data = await self._decodes.decode(key, index, purpose, flight)
            assert data is not None  # only a claim can stop a decode
            return data, True
        miss = self.l2.miss(key, publish=may_store)
        payload = await miss.lookup()
        while payload is None:
            try:
                data = await self._decodes.decode(key, index, purpose, flight, miss)
            except BaseException:
                miss.failed()
                raise
            if data is not None:
                miss.decoded(data)
                return data, True
            payload = await miss.wait()  # another node decodes it: its array, or try again
        return payload, False

    def _verify_stored(self, key: EntryKey, with_payload: bool) -> VerifiedEntry | str:
        """Worker thread: the entry if it passes every check (with its payload, if
        asked and small enough to have been read whole), "" if there is none, why
        not if it was bad (and is removed)."""
        try:
            checked = self.store.verify(key, with_payload=with_payload)
        except CorruptEntry as exc:
            return exc.reason
        if checked is None:
            return ""
        return checked

    async def _read_stored(
        self, handle: Handle, offset: int, size: int
    ) -> memoryview | bytes | bytearray:
        """Bytes of an entry verified earlier in this daemon's life (and pinned); if it
        went away or cannot be read, fetched again (and stored again if it can be)."""
        data = await self.reads.read(handle.key, offset, size, handle.pages)
        if data is not None:
            return data
        self.known.not_stored(handle.key, handle.index)
        handle.in_memory = True
        return await self._read_memory(handle, offset, size)

    async def _read_memory(
        self, handle: Handle, offset: int, size: int
    ) -> memoryview | bytes | bytearray:
        """Bytes of an array the store did not take, from the memory cache; fetched
        again (one flight per key) if the cache dropped it since."""
        key = handle.key
        held = self.memory_cache.get(handle.memory_key)
        if held is None:
            self.metrics.memory_refills += 1
            self._decodes.check_recent_failure(key)
            with self.admission.waiting(handle.uid):
                outcome = await self._outcome(
                    key, handle.index, Purpose.READ, may_store=handle.may_store
                )
            if outcome.held is None:  # the store took it this time: read the file
                handle.in_memory = False
                handle.pages = outcome.pages
                data = await self.reads.read(handle.key, offset, size, handle.pages)
                if data is None:  # stored, then unreadable at once: the store is failing
                    raise OriginalUndecodable(f"stored entry {key} cannot be read back")
                return data
            held = outcome.held
            self.memory_cache.put(handle.memory_key, held)
        try:
            # The slice keeps the bytes alive until they are sent; the budget counts
            # the cache's hold (for an array too big to cache, only this moment).
            return held.data[offset : offset + size]
        finally:
            held.release()
