"""Claims to decode an array of the cluster's L2: numbered by term, each created once, and
removed only by the node that created it. Blocking code over an L2Backend (backends.py),
run in worker threads by the tier (tier.py) and on Dask workers by the cluster
warm (dask_warm.py); it knows nothing of trio, the engine or images.

A claim on the array ``<name>`` is the object ``.leases/<name>@<term>`` holding its
holder and its expiry (unix time). To claim, a node creates the next term with a
create that never overwrites: of the nodes that find the same claim expired, the
one whose create of the next term wins holds it, and the others find its claim
live. Nobody deletes a claim but its holder (to let go), so a holder that
finishes after its claim ran out lets go of its own term, never its successor's.

A holder renews its claim while its decode runs and until it has published: it
creates the next term for itself, then lets go of the old one. A node waiting on
a claim that was let go looks for a live one before it tries to claim.

Because claims are let go of, terms have holes: a node may take term 1 while a
node holds term 2 (the first was let go between the two). So a node that created
a term looks again, and if any other claim is live it lets its own go and defers
to that one. Of two nodes that created claims at once, the later to look always
sees the other's, so at most one of them goes on to decode.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Final

from .backends import LEASES, L2Backend

__all__ = ["TRIES", "Claim", "claim_name", "claims", "current", "release", "renew", "take"]

TRIES: Final = 3  # creates raced by other nodes before a node decodes without a claim
MAX_CLAIMS: Final = 64  # claims of one array looked at (more are someone's litter)
_BODY_MAX: Final = 4096  # bytes of a claim's object read
_TERM: Final = re.compile(r"[1-9][0-9]{0,17}")


@dataclass(frozen=True)
class Claim:
    name: str  # its object: .leases/<the array's name>@<term>
    term: int
    holder: str
    expires: float  # unix time; nodes' clocks must agree to well within a lease

    @property
    def array(self) -> str:
        """The name of the array it claims."""
        return self.name[len(LEASES) + 1 : self.name.rindex("@")]

    def live(self, now: float) -> bool:
        return now < self.expires

    def body(self) -> bytes:
        return json.dumps({"holder": self.holder, "expires": self.expires}).encode()


def claim_name(name: str, term: int) -> str:
    return f"{_prefix(name)}{term}"


def claims(backend: L2Backend, name: str) -> list[Claim]:
    """The claims on the array ``name`` there now, lowest term first. One whose object
    cannot be parsed counts as expired (a holder that died while writing it)."""
    prefix = _prefix(name)
    found = []
    for entry in backend.list(prefix, MAX_CLAIMS):
        term = entry[len(prefix) :]
        if not _TERM.fullmatch(term):
            continue  # another array's claim whose name begins like this one's, or litter
        body = backend.get(entry, _BODY_MAX)
        if body is None:
            continue  # let go meanwhile
        holder, expires = _parse(body)
        found.append(Claim(entry, int(term), holder, expires))
    return sorted(found, key=lambda c: c.term)


def take(backend: L2Backend, name: str, holder: str, now: float, seconds: float) -> Claim | None:
    """The claim that governs the array ``name`` now: one created here for ``holder``,
    lasting ``seconds`` from ``now``, or another live one (its holder decodes; the
    caller checks ``claim.holder``). None if other nodes won TRIES creates in a row."""
    term = 1  # where none was ever let go of, the first create is the only call
    for _ in range(TRIES):
        mine = Claim(claim_name(name, term), term, holder, now + seconds)
        if backend.create(mine.name, mine.body()):
            rivals = [c for c in claims(backend, name) if c.name != mine.name and c.live(now)]
            if not rivals:
                return mine
            backend.delete(mine.name)  # ours: another claim stands (see the docstring)
            return rivals[0]
        found = claims(backend, name)
        live = [c for c in found if c.live(now)]
        if live:
            return live[-1]
        # Every claim there has expired (taken over: the next term), or was let go.
        term = max((c.term for c in found), default=term - 1) + 1
    return None


def current(backend: L2Backend, name: str, now: float) -> Claim | None:
    """The live claim on the array ``name`` with the highest term, if there is one."""
    live = [c for c in claims(backend, name) if c.live(now)]
    return live[-1] if live else None


def renew(backend: L2Backend, claim: Claim, now: float, seconds: float) -> Claim | None:
    """``claim``, held here, extended to ``now + seconds``: the next term is created for
    its holder, then the old one let go. None if it was lost (another holder's claim is
    live: the old one ran out and was taken over)."""
    name = claim.array

    term = max((c.term for c in claims(backend, name)), default=claim.term) + 1
    renewed = Claim(claim_name(name, term), term, claim.holder, now + seconds)
    if not backend.create(renewed.name, renewed.body()):
        return None  # another node took the next term: ours ran out
    if any(c.holder != claim.holder and c.live(now) for c in claims(backend, name)):
        backend.delete(renewed.name)  # taken over (with a lower, free term): ours ran out
        return None
    backend.delete(claim.name)
    return renewed


def release(backend: L2Backend, claim: Claim) -> None:
    """Let go of ``claim``, which this node holds: its own term, nobody else's."""
    backend.delete(claim.name)


def _prefix(name: str) -> str:
    return f"{LEASES}/{name}@"


def _parse(body: bytes) -> tuple[str, float]:
    try:
        value = json.loads(body)
        holder, expires = str(value["holder"]), float(value["expires"])
    except (ValueError, KeyError, TypeError):
        return "?", -math.inf
    return holder, expires if math.isfinite(expires) else -math.inf
