"""The cluster tier for the engine: a local miss asks L2 before it decodes, a lease keeps
nodes from decoding the same array at once, and every decode is published to L2.

``L2Tier.obtain`` gives the engine an array's .npy bytes: an L2 object that
passed the same checks as a local entry (entry.check_entry and the .npy
layout), else a decode by the engine's own ``decode``, which is then queued
for publishing. A corrupt object is never served: it is counted, deleted and
replaced by the next decode's publish (a conditional create, like any other).

Leases: before decoding, a node creates ``.leases/<name>`` (a create that never
overwrites) holding its expiry; a node that finds a live lease polls for the
object until the lease expires (at most ``lease_seconds``), then decodes
itself. The holder publishes, then deletes the lease. Expiries are wall-clock
times, so nodes' clocks must agree to well within ``lease_seconds`` (NTP).

L2 never breaks a read: every call runs in a worker thread under this tier's
own limiter with a deadline, failures feed a circuit breaker (breaker.py), and
any failure means a local decode. Publishing happens in background tasks
(``run``) from a queue bounded in bytes; a full queue or an unreachable L2
drops the publish, never delays a reader. Everything here but the worker
threads runs on the trio thread. This module knows nothing of FUSE or the
local store.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeVar

import trio

from .breaker import CircuitBreaker, State
from .config import L2Config
from .decode import Fingerprint, npy_file_size, npy_layout_problem
from .entry import EntryKey, check_entry, encode_trailer
from .l2 import L2Backend, L2Error, lease_name, object_name
from .metrics import Histogram, LogThrottle
from .protocol import STORE_FORMAT, TRAILER, TRAILER_MAGIC, TRAILER_SIZE

__all__ = [
    "L2_SECONDS_BUCKETS",
    "L2Metrics",
    "L2Tier",
    "L2Unavailable",
    "Obtained",
    "verify_object",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
L2_SECONDS_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_POLL_FIRST: Final = 0.05  # a waiter's first look for the holder's object, then 1.5x ...
_POLL_MAX: Final = 0.5  # ... up to this: ~2 requests a second per waiting array
_LEASE_MAX: Final = 4096  # bytes of a lease object read
_CLAIM_TRIES: Final = 3  # lease takeovers raced by other nodes before decoding anyway


class L2Unavailable(Exception):
    """L2 cannot answer now (a failed call, or the breaker is open): decode locally."""

    def __init__(self, bypassed: bool = False) -> None:
        super().__init__("L2 unavailable")
        self.bypassed = bypassed  # no call was made: the breaker is open


@dataclass
class L2Metrics:
    """What this node's L2 tier has done. See docs/operations.md, "Status files"."""

    hits: int = 0  # arrays fetched from L2 and verified (instead of decoding)
    misses: int = 0  # arrays L2 could not give (absent, bad, unreachable): decoded here
    bypassed: int = 0  # of those, decoded without asking L2 (its breaker was open)
    leases: int = 0  # leases this node took to decode an array
    lease_waits: int = 0  # times this node waited for another node's lease
    lease_timeouts: int = 0  # waits that ran out: this node decoded too
    publishes: int = 0  # objects this node created
    publish_exists: int = 0  # publishes that found the object there already
    publish_dropped: int = 0  # publishes given up (queue full, L2 failing)
    corrupt: int = 0  # objects that failed verification (never served; deleted and replaced)
    bytes_fetched: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # kind -> count
    fetch_seconds: Histogram = field(default_factory=lambda: Histogram(L2_SECONDS_BUCKETS))


@dataclass(frozen=True)
class Obtained:
    data: bytes | memoryview  # the .npy bytes
    decoded: bool  # decoded here; else fetched from L2


@dataclass
class _Job:
    """On the publish queue: an array to publish and/or a lease to let go."""

    key: EntryKey
    name: str
    data: bytes | memoryview | None  # None: only let go of the lease
    lease: str | None

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else len(self.data)


def verify_object(
    key: EntryKey, data: bytes | memoryview, digest: bytes
) -> tuple[str | None, bool]:
    """Why the L2 object ``data`` must not be served for ``key`` (None if it may), and
    whether it is another decodefs format's (left alone, not replaced). The checks
    are the local store's: the entry trailer, then the .npy layout."""
    if len(data) >= TRAILER_SIZE:
        magic, fmt, *_ = TRAILER.unpack(bytes(data[-TRAILER_SIZE:]))
        if magic == TRAILER_MAGIC and fmt != STORE_FORMAT:
            return f"store format {fmt}, expected {STORE_FORMAT}", True
    problem = check_entry(key, data, digest)
    if problem is None:
        problem = npy_layout_problem(data[:4096], len(data) - TRAILER_SIZE, key.size)
    return problem, False


class L2Tier:
    def __init__(
        self,
        backend: L2Backend,
        settings: L2Config,
        fingerprints: Mapping[str, Fingerprint],
        *,
        clock: Callable[[], float] = trio.current_time,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self._fingerprints = dict(fingerprints)
        self._clock = clock
        self._wall = wall
        self._node = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        self._limiter = trio.CapacityLimiter(settings.workers)
        # botocore's own timeouts fire first; this catches what has none (a hung mount).
        self._deadline = 2 * settings.timeout_seconds + 1
        self._breaker = CircuitBreaker(
            clock, first_backoff=settings.retry_seconds, on_change=self._log_change
        )
        self._send, self._receive = trio.open_memory_channel[_Job](math.inf)
        self._queued_bytes = 0  # bounded by settings.publish_queue_bytes
        self._queued = 0
        self.metrics = L2Metrics()
        self._throttle = LogThrottle(log)

    @property
    def state(self) -> State:
        return self._breaker.state

    # -- for the engine ---------------------------------------------------------------

    async def obtain(
        self, key: EntryKey, decode: Callable[[], Awaitable[bytes]], *, publish: bool = True
    ) -> Obtained:
        """``key``'s .npy bytes from L2, else from ``decode()`` (then queued for publishing
        if ``publish``). Raises only what ``decode`` raises."""
        name = object_name(key, self._fingerprints[key.version].hex)
        lease: str | None = None
        payload: memoryview | None = None
        try:
            payload = await self._fetch(key, name)
            if payload is None and self.settings.lease_seconds > 0:
                payload, lease = await self._claim(key, name)
        except L2Unavailable as exc:
            self.metrics.bypassed += exc.bypassed
        if payload is not None:
            self.metrics.hits += 1
            return Obtained(payload, decoded=False)
        self.metrics.misses += 1
        try:
            data = await decode()
        except BaseException:
            if lease is not None:
                self._enqueue(_Job(key, name, None, lease))
            raise
        if publish or lease is not None:
            self._enqueue(_Job(key, name, data if publish else None, lease))
        return Obtained(data, decoded=True)

    async def run(self) -> None:
        """Publish queued arrays until cancelled (a task of the daemon's nursery)."""
        async with trio.open_nursery() as nursery:
            for _ in range(max(1, self.settings.workers // 2)):
                nursery.start_soon(self._publisher)

    def stats(self) -> dict[str, object]:
        m = self.metrics
        return {
            "l2": self.backend.description,
            "l2_state": self._breaker.state,
            "l2_breaker_opens": self._breaker.opened,
            "l2_hits": m.hits,
            "l2_misses": m.misses,
            "l2_bypassed": m.bypassed,
            "l2_leases": m.leases,
            "l2_lease_waits": m.lease_waits,
            "l2_lease_timeouts": m.lease_timeouts,
            "l2_publishes": m.publishes,
            "l2_publish_exists": m.publish_exists,
            "l2_publish_dropped": m.publish_dropped,
            "l2_publish_queue": self._queued,
            "l2_publish_queue_bytes": self._queued_bytes,
            "l2_corrupt": m.corrupt,
            "l2_bytes_fetched": m.bytes_fetched,
            "l2_errors": dict(m.errors),
            "l2_fetch_seconds": m.fetch_seconds.as_dict(),
        }

    def close(self) -> None:
        self.backend.close()

    # -- fetching and leases ----------------------------------------------------------

    async def _fetch(self, key: EntryKey, name: str) -> memoryview | None:
        """The verified payload of ``name``; None if there is none or it is bad (then it
        is deleted, unless another format wrote it). Raises L2Unavailable."""
        limit = npy_file_size(key.size) + TRAILER_SIZE
        started = time.perf_counter()
        data = await self._call(self.backend.get, name, limit)
        self.metrics.fetch_seconds.observe(time.perf_counter() - started)
        if data is None:
            return None
        digest = self._fingerprints[key.version].digest
        problem, foreign = await trio.to_thread.run_sync(verify_object, key, data, digest)
        if problem is not None:
            if foreign:
                self.metrics.errors["foreign_format"] += 1
            else:
                self.metrics.corrupt += 1
            self._throttle.log(
                logging.WARNING,
                f"l2-corrupt-{name}",
                "L2 object %s failed verification (%s); %s",
                name,
                problem,
                "leaving it (another decodefs wrote it)" if foreign else "replacing it",
            )
            if not foreign:
                await self._call(self.backend.delete, name)
            return None
        self.metrics.bytes_fetched += len(data)
        return memoryview(data)[: len(data) - TRAILER_SIZE]

    async def _claim(self, key: EntryKey, name: str) -> tuple[memoryview | None, str | None]:
        """Take the lease to decode ``key`` (returns None and the lease's name), or wait
        for the node holding it to publish (returns the payload, or None when the wait
        ran out). Raises L2Unavailable only while holding no lease."""
        lease = lease_name(name)
        for _ in range(_CLAIM_TRIES):
            expires = self._wall() + self.settings.lease_seconds
            body = json.dumps({"holder": self._node, "expires": expires}).encode()
            if await self._call(self.backend.create, lease, body):
                self.metrics.leases += 1
                try:
                    # The holder before us may have published and let go in between.
                    payload = await self._fetch(key, name)
                except L2Unavailable:
                    return None, lease
                if payload is None:
                    return None, lease
                self._enqueue(_Job(key, name, None, lease))
                return payload, None
            held = await self._call(self.backend.get, lease, _LEASE_MAX)
            if held is None:  # let go meanwhile: its array may be there now
                payload = await self._fetch(key, name)
                if payload is not None:
                    return payload, None
                continue
            until = _lease_expiry(held)
            if until is None or until <= self._wall():
                log.info("L2 lease %s expired (%s); taking it over", lease, held[:200])
                await self._call(self.backend.delete, lease)
                continue
            return await self._wait(key, name, lease, until), None
        return None, None

    async def _wait(self, key: EntryKey, name: str, lease: str, until: float) -> memoryview | None:
        """Poll for the object another node holds the lease for, until the lease expires."""
        self.metrics.lease_waits += 1
        deadline = self._clock() + min(until - self._wall(), self.settings.lease_seconds)
        interval = _POLL_FIRST
        while (remaining := deadline - self._clock()) > 0:
            await trio.sleep(min(interval, remaining))
            interval = min(interval * 1.5, _POLL_MAX)
            payload = await self._fetch(key, name)
            if payload is not None:
                return payload
            if await self._call(self.backend.size, lease) is None:
                # Let go: published just before (look once more), or its decode failed.
                return await self._fetch(key, name)
        self.metrics.lease_timeouts += 1
        log.info("another node's lease on %s ran out before it published; decoding it here", name)
        return None

    # -- publishing -------------------------------------------------------------------

    def _enqueue(self, job: _Job) -> None:
        limit = self.settings.publish_queue_bytes
        if job.data is not None and self._queued_bytes + job.nbytes > limit:
            self.metrics.publish_dropped += 1
            self._throttle.log(
                logging.WARNING,
                "l2-queue-full",
                "L2 publish queue full (%d arrays, %d bytes); not publishing %s",
                self._queued,
                self._queued_bytes,
                job.key,
            )
            if job.lease is None:
                return
            job.data = None
        self._queued += 1
        self._queued_bytes += job.nbytes
        self._send.send_nowait(job)

    async def _publisher(self) -> None:
        async for job in self._receive:
            try:
                await self._publish(job)
            finally:
                self._queued -= 1
                self._queued_bytes -= job.nbytes

    async def _publish(self, job: _Job) -> None:
        if job.data is not None:
            # Hashing and copying a large array would hold up the loop: a thread does it.
            entry = await trio.to_thread.run_sync(self._entry, job.key, job.data)
            try:
                created = await self._call(self.backend.create, job.name, entry)
            except L2Unavailable:
                self.metrics.publish_dropped += 1
            else:
                self.metrics.publishes += created
                self.metrics.publish_exists += not created
        if job.lease is not None:
            with contextlib.suppress(L2Unavailable):  # else it expires
                await self._call(self.backend.delete, job.lease)

    def _entry(self, key: EntryKey, payload: bytes | memoryview) -> bytes:
        """The object for ``payload``: the store entry, trailer included."""
        digest = self._fingerprints[key.version].digest
        return bytes(payload) + encode_trailer(key, payload, digest)

    # -- calls --------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a worker thread, within the deadline; raises L2Unavailable
        for any failure (counted, and told to the breaker)."""
        if not self._breaker.allow():
            raise L2Unavailable(bypassed=True)
        try:
            with trio.fail_after(self._deadline):
                result = await trio.to_thread.run_sync(
                    functools.partial(fn, *args), limiter=self._limiter, abandon_on_cancel=True
                )
        except trio.TooSlowError:
            self._failed("deadline", f"no answer in {self._deadline:g} s")
            raise L2Unavailable() from None
        except L2Error as exc:
            self._failed(exc.kind, str(exc))
            raise L2Unavailable() from exc
        except Exception as exc:
            log.exception("unexpected error in an L2 call")
            self._failed("unexpected", repr(exc))
            raise L2Unavailable() from exc
        except BaseException:
            self._breaker.abandon()
            raise
        self._breaker.success()
        return result

    def _failed(self, kind: str, detail: str) -> None:
        self.metrics.errors[kind] += 1
        log.debug("L2 call failed: %s", detail)
        self._breaker.failure(f"{kind}: {detail[:300]}")

    def _log_change(self, previous: State, state: State, why: str) -> None:
        level = logging.INFO if state != "open" else logging.WARNING
        consequence = " ; decoding locally until then" if state == "open" else ""
        log.log(
            level,
            "L2 %s: %s -> %s (%s)%s",
            self.backend.description,
            previous,
            state,
            why,
            consequence,
        )


def _lease_expiry(data: bytes) -> float | None:
    try:
        value = json.loads(data)
        expires = float(value["expires"])
    except (ValueError, KeyError, TypeError):
        return None
    return expires if math.isfinite(expires) else None
