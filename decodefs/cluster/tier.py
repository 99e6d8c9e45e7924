"""The cluster tier for the engine: a local miss asks L2 before it decodes, a lease keeps
nodes from decoding the same array at once, and every decode is published to L2.

The engine asks and this tier answers; it never calls the engine. For each
local miss the engine opens an ``L2Miss`` (``L2Tier.miss``) and drives it:
``lookup`` gives an L2 object that passed the one check of a local entry
(entry.check_entry, which reads the trailer and the .npy layout), else the
engine decodes the array and says so (``decoded``: then it is queued for
publishing) or that it failed (``failed``). A corrupt object is never served:
it is counted, deleted and replaced by the next decode's publish (a
conditional create, like any other).

Claims (leases.py): once the engine's decode can start, its memory and decode
slot granted, it asks ``claim``; only then does the node claim the array, so
a claim covers a decode, never a wait in a queue. Where another node's claim
is live (or the array was published meanwhile), ``claim`` says no: the engine
gives its slot back and ``wait`` polls for the object until that claim runs
out or is let go, then the engine tries again. The holder renews its claim
while it decodes and publishes (for at most RENEW_LEASES leases: a hung decode
lets the others go on), then lets go of it. Expiries are wall-clock times, so
nodes' clocks must agree to well within ``lease_seconds`` (NTP).

L2 never breaks a read: every call runs in a worker thread under this tier's
own limiter with a deadline that starts once the call has its thread (time
queued behind other calls is not L2's), failures feed a circuit breaker
(breaker.py), and any failure means a local decode. Publishing happens in background tasks
(``run``) from a queue bounded in bytes; a full queue or an unreachable L2
drops the publish, never delays a reader. Everything here but the worker
threads runs on the trio thread. This module knows nothing of FUSE or the
local store.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, TypeVar, cast

import trio

from ..common.config import L2Config
from ..common.entry import EntryKey, Verdict, check_entry, encode_trailer
from ..common.fingerprint import Fingerprint
from ..common.metrics import Histogram, LogThrottle, figures
from ..common.npy import npy_file_size
from ..common.protocol import TRAILER_SIZE
from . import leases
from .backends import L2Backend, L2Error, object_name
from .breaker import CircuitBreaker, State
from .leases import Claim

__all__ = [
    "L2_SECONDS_BUCKETS",
    "L2Metrics",
    "L2Miss",
    "L2Tier",
    "L2Unavailable",
    "verify_object",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
L2_SECONDS_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_POLL_FIRST: Final = 0.05  # a waiter's first look for the holder's object, then 1.5x ...
_POLL_MAX: Final = 0.5  # ... up to this: ~2 requests a second per waiting array
_WAITS: Final = 3  # other nodes' claims on one array waited out before decoding it anyway
RENEW_LEASES: Final = 6  # a claim is renewed for at most this many leases from when taken
_TAKE_CALLS: Final = 4  # L2 calls a claim makes (leases.take): its deadline is that many


# Whether the tier can be used: not known yet, it answered, its last call failed.
CheckState = Literal["checking", "ok", "failing"]


class L2Unavailable(Exception):
    """L2 cannot answer now (a failed call, or the breaker is open): decode locally."""

    def __init__(self, bypassed: bool = False) -> None:
        super().__init__("L2 unavailable")
        self.bypassed = bypassed  # no call was made: the breaker is open


@dataclass
class L2Metrics:
    """What this node's L2 tier has done: each field is the figure ``l2_<field>`` of
    stats_schema.STATS (tests/test_stats.py checks it). See docs/operations.md, "Status files"."""

    hits: int = 0  # arrays fetched from L2 and verified (instead of decoding)
    misses: int = 0  # arrays L2 could not give (absent, bad, unreachable): decoded here
    bypassed: int = 0  # of those, decoded without asking L2 (its breaker was open)
    leases: int = 0  # claims this node took to decode an array
    lease_renewals: int = 0  # claims this node renewed while decoding and publishing
    lease_waits: int = 0  # times this node waited for another node's claim
    lease_timeouts: int = 0  # waits that ran out (the holder did not publish in time)
    publishes: int = 0  # objects this node created
    publish_exists: int = 0  # publishes that found the object there already
    publish_dropped: int = 0  # publishes given up (queue full, L2 failing)
    corrupt: int = 0  # objects that failed verification (never served; deleted and replaced)
    bytes_fetched: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # kind -> count
    fetch_seconds: Histogram = field(default_factory=lambda: Histogram(L2_SECONDS_BUCKETS))


@dataclass(eq=False)
class _Held:
    """A claim this node holds for a decode, renewed until it is let go."""

    claim: Claim  # the current term (renewing replaces it)
    taken: float  # wall-clock time
    renewing: bool = False
    released: bool = False


@dataclass
class _Job:
    """On the publish queue: an array to publish and/or a claim to let go of."""

    key: EntryKey
    name: str
    data: bytes | memoryview | None  # None: only let go of the claim
    lease: _Held | None

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else len(self.data)


def verify_object(
    key: EntryKey, data: bytes | memoryview, digest: bytes
) -> tuple[str | None, bool]:
    """Why the L2 object ``data`` must not be served for ``key`` (None if it may), and
    whether it is another decodefs format's (left alone, not replaced). The check
    is the local store's (entry.check_entry)."""
    checked = check_entry(key, data, digest)
    return (None if checked.ok else checked.reason), checked.verdict is Verdict.FOREIGN


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
        # Claims hold a decode slot, renewals a claim about to run out: they never queue
        # behind fetches and publishes, so they have threads of their own.
        self._claim_limiter = trio.CapacityLimiter(settings.workers)
        # botocore's own timeouts fire first; this catches what has none (a hung mount).
        self._deadline = 2 * settings.timeout_seconds + 1
        self._breaker = CircuitBreaker(
            clock, first_backoff=settings.retry_seconds, on_change=self._log_change
        )
        self._send, self._receive = trio.open_memory_channel[_Job](math.inf)
        self._queued_bytes = 0  # bounded by settings.publish_queue_bytes
        self._queued = 0
        self._held: set[_Held] = set()  # renewed by ``run``
        self.metrics = L2Metrics()
        # Whether the tier can be used, as its check at start and every call since say.
        self.check_state: CheckState = "checking"
        self.problem = ""  # the last failure, while the tier fails; "" once a call succeeds
        self._throttle = LogThrottle(log)

    @property
    def state(self) -> State:
        return self._breaker.state

    # -- for the engine ---------------------------------------------------------------

    def miss(self, key: EntryKey, *, publish: bool = True) -> L2Miss:
        """The way through L2 of one local miss of ``key`` (see ``L2Miss``); a decode
        it leads to is published if ``publish``."""
        name = object_name(key, self._fingerprints[key.version].hex)
        return L2Miss(self, key, name, publish=publish)

    async def run(self) -> None:
        """Publish queued arrays and renew claims until cancelled (a task of the daemon's
        nursery)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.check)
            for _ in range(max(1, self.settings.workers // 2)):
                nursery.start_soon(self._publisher)
            if self.settings.lease_seconds > 0:
                nursery.start_soon(self._renewer, nursery)

    async def check(self) -> None:
        """Find out at once whether the tier can be used (credentials, endpoint, the
        shared directory), not after misses have failed: ``check_state`` and
        ``problem`` say, in stats.json, and ``decodefs mount`` on the terminal."""
        try:
            await self._call(self.backend.check)
        except L2Unavailable:
            self.check_state = "failing"
            log.warning(
                "L2 %s is configured but cannot be used: %s; every miss decodes here until "
                "it answers",
                self.backend.description,
                self.problem or "its circuit breaker is open",
            )
        else:
            log.info("L2 %s answers", self.backend.description)

    def stats(self) -> dict[str, object]:
        """The tier's figures of stats.json (stats_schema.STATS, those with ``l2``)."""
        return {
            "l2": self.backend.description,
            "l2_check": self.check_state,
            "l2_problem": self.problem,
            "l2_state": self._breaker.state,
            "l2_breaker_opens": self._breaker.opened,
            "l2_publish_queue": self._queued,
            "l2_publish_queue_bytes": self._queued_bytes,
            **figures(self.metrics, prefix="l2_"),
        }

    def close(self) -> None:
        self.backend.close()

    # -- fetching and leases ----------------------------------------------------------

    async def _fetch(self, key: EntryKey, name: str, *, urgent: bool = False) -> memoryview | None:
        """The verified payload of ``name``; None if there is none or it is bad (then it
        is deleted, unless another format wrote it). Raises L2Unavailable."""
        limit = npy_file_size(key.size) + TRAILER_SIZE
        started = time.perf_counter()
        data = await self._call(self.backend.get, name, limit, urgent=urgent)
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

    async def _claim(self, key: EntryKey, name: str) -> Claim | memoryview | _Held | None:
        """Claim ``name`` for a decode that can start now: this node's claim (held and
        renewed until let go); another node's live claim (wait for it); the array,
        published meanwhile (no decode); or None where L2 does not answer or other
        nodes won every try (decode unclaimed)."""
        try:
            claim = await self._call(
                leases.take,
                self.backend,
                name,
                self._node,
                self._wall(),
                self.settings.lease_seconds,
                calls=_TAKE_CALLS,
                urgent=True,
            )
        except L2Unavailable as exc:
            self.metrics.bypassed += exc.bypassed
            return None
        if claim is None:
            log.info("other nodes won %d claims of %s in a row; decoding it", leases.TRIES, name)
            return None
        if claim.holder != self._node:
            return claim
        self.metrics.leases += 1
        held = _Held(claim, self._wall())
        self._held.add(held)
        try:
            # The holder before us may have published and let go just before.
            payload = await self._fetch(key, name, urgent=True)
        except L2Unavailable:
            return held
        except BaseException:  # cancelled before the miss holds it: let go of it here
            self._let_go(key, name, held)
            raise
        if payload is not None:
            self._let_go(key, name, held)
            return payload
        return held

    def _let_go(self, key: EntryKey, name: str, held: _Held) -> None:
        """Let go of ``held`` once what is queued before it is published."""
        self._enqueue(_Job(key, name, None, held))

    async def _wait(self, key: EntryKey, name: str, claim: Claim) -> memoryview | None:
        """Poll for the array another node's ``claim`` covers, following its renewals,
        until it runs out or is let go: the payload, or None (then try to claim it).
        Raises L2Unavailable."""
        self.metrics.lease_waits += 1
        lease = self.settings.lease_seconds
        give_up = self._clock() + RENEW_LEASES * lease  # a holder renews no longer
        deadline = self._clock() + min(claim.expires - self._wall(), lease)
        interval = _POLL_FIRST
        while (remaining := min(deadline, give_up) - self._clock()) > 0:
            await trio.sleep(min(interval, remaining))
            interval = min(interval * 1.5, _POLL_MAX)
            payload = await self._fetch(key, name)
            if payload is not None:
                return payload
            if await self._call(self.backend.size, claim.name) is None:
                # Renewed under the next term, or let go: after publishing (look once
                # more: a holder publishes before it lets go), or its decode failed.
                renewed = await self._call(leases.current, self.backend, name, self._wall())
                if renewed is None or renewed.holder == self._node:
                    return await self._fetch(key, name)
                claim = renewed
                deadline = self._clock() + min(claim.expires - self._wall(), lease)
        self.metrics.lease_timeouts += 1
        log.info("claim %s ran out before its holder published; claiming it here", claim.name)
        return None

    async def _renewer(self, nursery: trio.Nursery) -> None:
        """Renew the claims this node holds once half their lease has passed."""
        lease = self.settings.lease_seconds
        while True:
            await trio.sleep(lease / 4)
            now = self._wall()
            for held in self._held:
                if held.renewing or held.claim.expires - now > lease / 2:
                    continue
                if now - held.taken < RENEW_LEASES * lease:
                    held.renewing = True
                    nursery.start_soon(self._renew, held)

    async def _renew(self, held: _Held) -> None:
        lease = self.settings.lease_seconds
        try:
            args = (self.backend, held.claim, self._wall(), lease)
            claim = await self._call(leases.renew, *args, calls=_TAKE_CALLS, urgent=True)
        except L2Unavailable:
            return  # tried again at the next tick, until it runs out
        finally:
            held.renewing = False
        if claim is None:
            self._held.discard(held)
            log.info("claim %s ran out and was taken over while decoding", held.claim.name)
        elif held.released:  # let go of while this renewal ran: the new term too
            with contextlib.suppress(L2Unavailable):
                await self._call(leases.release, self.backend, claim)
        else:
            held.claim = claim
            self.metrics.lease_renewals += 1

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
            held = job.lease
            held.released = True
            self._held.discard(held)
            with contextlib.suppress(L2Unavailable):  # else it runs out
                await self._call(leases.release, self.backend, held.claim)

    def _entry(self, key: EntryKey, payload: bytes | memoryview) -> bytes:
        """The object for ``payload``: the store entry, trailer included."""
        digest = self._fingerprints[key.version].digest
        return bytes(payload) + encode_trailer(key, payload, digest)

    # -- calls --------------------------------------------------------------------------

    async def _call(
        self, fn: Callable[..., T], *args: object, calls: int = 1, urgent: bool = False
    ) -> T:
        """``fn(*args)`` in a worker thread (an ``urgent`` one: for claims), within ``calls``
        deadlines counted from when it has its thread; raises L2Unavailable for any
        failure (counted, and told to the breaker). Waiting for a thread behind other
        calls is not L2's time: it counts toward neither the deadline nor the breaker."""
        if self._breaker.state == "open" and self._breaker.retry_in > 0:
            raise L2Unavailable(bypassed=True)  # no need to queue to learn that
        slot = _Slot(self._claim_limiter if urgent else self._limiter)
        await slot.take()
        try:
            if not self._breaker.allow():  # it may have opened while this call queued
                raise L2Unavailable(bypassed=True)
            try:
                with trio.fail_after(calls * self._deadline):
                    result = await trio.to_thread.run_sync(
                        functools.partial(fn, *args),
                        # trio takes any object with a CapacityLimiter's two methods.
                        limiter=cast(trio.CapacityLimiter, slot),
                        abandon_on_cancel=True,
                    )
            except trio.TooSlowError:
                self._failed("deadline", f"no answer in {calls * self._deadline:g} s")
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
        finally:
            slot.give_back()
        self._breaker.success()
        self.check_state, self.problem = "ok", ""
        return result

    def _failed(self, kind: str, detail: str) -> None:
        said = detail if detail.startswith(f"{kind}:") else f"{kind}: {detail}"
        self.check_state, self.problem = "failing", said[:300]
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


class L2Miss:
    """One local miss's way through L2, driven by the engine (this never calls it).

    ``lookup`` first: L2's object (a hit), or None: decode. Once the decode can
    start, ``claim``: True, decode now (claimed, or unclaimed where L2 does not
    answer); False, do not decode: ``wait`` gives the array another node
    publishes, or None to decode after all (``claim`` again once the decode can
    start). After a decode, ``decoded`` (publish, let go of the claim); if it
    raised or was cancelled, ``failed`` (let go). On the trio thread alone.
    """

    def __init__(self, tier: L2Tier, key: EntryKey, name: str, *, publish: bool) -> None:
        self._tier = tier
        self.key = key
        self.name = name
        self._publish = publish
        self._claims = tier.settings.lease_seconds > 0  # whether a decode claims first
        self._waits = 0  # other nodes' claims waited out for this miss
        self._held: _Held | None = None  # this node's claim for the decode running
        self._answer: Claim | memoryview | None = None  # why ``claim`` said no

    async def lookup(self) -> memoryview | None:
        """L2's verified payload for the key (a hit), or None: decode it here."""
        tier = self._tier
        try:
            payload = await tier._fetch(self.key, self.name)
        except L2Unavailable as exc:
            tier.metrics.bypassed += exc.bypassed
            self._claims = False  # L2 does not answer: no claim either
            return None
        if payload is not None:
            tier.metrics.hits += 1
        return payload

    async def claim(self) -> bool:
        """The decode can start: whether it should (see the class)."""
        if not self._claims or self._waits >= _WAITS:
            return True
        answer = await self._tier._claim(self.key, self.name)
        if answer is None or isinstance(answer, _Held):
            self._held = answer
            return True
        self._answer = answer
        return False

    async def wait(self) -> memoryview | None:
        """After ``claim`` said no: the array (a hit), or None: decode it after all."""
        answer, self._answer = self._answer, None
        if isinstance(answer, Claim):  # another node's: wait for what it publishes
            self._waits += 1
            try:
                answer = await self._tier._wait(self.key, self.name, answer)
            except L2Unavailable:
                self._claims = False
                return None
        if answer is not None:
            self._tier.metrics.hits += 1
        return answer

    def decoded(self, data: bytes | memoryview) -> None:
        """The decode ran and gave ``data``: publish it (if asked), let go of the claim."""
        self._tier.metrics.misses += 1
        held, self._held = self._held, None
        if self._publish or held is not None:
            self._tier._enqueue(_Job(self.key, self.name, data if self._publish else None, held))

    def failed(self) -> None:
        """The decode raised or was cancelled: let go of the claim."""
        self._tier.metrics.misses += 1
        held, self._held = self._held, None
        if held is not None:
            self._tier._let_go(self.key, self.name, held)


class _Slot:
    """One of the tier's threads, taken before a call's deadline starts. trio's
    ``to_thread.run_sync`` takes it as its limiter and gives it back when the thread
    ends, an abandoned one too, so hung calls still count against ``l2_workers``."""

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        self._limiter = limiter
        self._handed = False  # to trio: it gives the slot back

    async def take(self) -> None:
        await self._limiter.acquire_on_behalf_of(self)

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        self._handed = True  # taken already: the thread may start

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(self)

    def give_back(self) -> None:
        """After the call: give the slot back, unless trio has it (to give back itself)."""
        if not self._handed:
            self._limiter.release_on_behalf_of(self)
