"""The intake of direct-hit reports: arrays read_array() read straight from the store.

Readers send them to a unix datagram socket in the store (protocol.ACCESS_SOCKET);
each valid line orders the store's LRU and counts in ``direct_hits``, and does
nothing more. Any local user may send anything there, so only a line naming a
configured version, an allowed size and a known original counts, and the
accesses waiting for the catalog stay bounded. It knows nothing of FUSE or the
engine's caching policy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Mapping
from itertools import repeat
from typing import Final

import trio

from ..common.config import Config
from ..common.metrics import LogThrottle, Metrics
from ..common.protocol import ACCESS_REPORT_MAX, parse_access_groups
from ..common.source import SourceIndex
from ..store import Store

__all__ = ["REPORT_PAUSE", "DirectHits"]

log = logging.getLogger(__name__)

_MAX_PENDING_ACCESSES: Final = 1_000_000  # ~200 MB at most between two flushes
# Reports are taken in at most this often (seconds). A unix datagram socket queues at
# most net.unix.max_dgram_qlen (10 by default) datagrams, a reader's of up to ~1,000
# hits: more than a DataLoader's readers send in this time.
REPORT_PAUSE: Final = 0.02
_REPORTS_AT_ONCE: Final = 64  # datagrams noted before the event loop serves others


class DirectHits:
    """Counts the valid lines of direct-hit reports into the store's LRU and ``metrics``."""

    def __init__(
        self, config: Config, sources: Mapping[str, SourceIndex], store: Store, metrics: Metrics
    ) -> None:
        self._sizes = range(config.min_size, config.max_size + 1)
        self._sources = sources
        self._store = store
        self._metrics = metrics

    def note(self, report: bytes) -> None:
        """Record the accesses of one report (protocol.parse_access_groups)."""
        store = self._store
        # Only stored arrays are read directly, so no honest reports name more keys.
        limit = min(_MAX_PENDING_ACCESSES, max(1024, store.usage().entries))
        for (version, size), names in parse_access_groups(report).items():
            source = self._sources.get(version)
            if source is None or size not in self._sizes:
                continue
            # (version, size, key) tuples, as EntryKeys are: made at C speed
            keys = list(zip(repeat(version), repeat(size), source.known(names), strict=False))
            noted = store.capacity.record_accesses(keys, limit)
            self._metrics.direct_hits += noted
            if noted < len(keys):
                return  # until the next flush: the LRU order of the rest can wait

    async def receive(self, path: str) -> None:
        """Listen at ``path`` and note every report until cancelled (a daemon task).

        Reports are taken in at most every ``REPORT_PAUSE`` seconds, all that came
        meanwhile at once: a reader's send wakes the daemon only when it waits idle,
        and the woken daemon would run on the reader's CPU, ahead of it."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK) as sock:
            # Bound beside and renamed into place: an earlier serving process of the
            # mount may still listen there, and stops hearing reports at once.
            ours = f"{path}.{os.getpid()}"
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(ours)
                sock.bind(ours)
                os.chmod(ours, 0o666)  # any reader may report; reports only order the LRU
                bound = os.stat(ours).st_ino
                os.replace(ours, path)
            except OSError as exc:
                log.warning("cannot listen for direct hits at %s: %s", path, exc)
                return
            throttle = LogThrottle(log)
            try:
                while True:
                    await trio.lowlevel.wait_readable(sock)
                    try:
                        self._take_in(sock)
                    except Exception as exc:  # a report orders the LRU: never worth the daemon
                        throttle.log(logging.ERROR, "direct-hits", "direct-hit report: %r", exc)
                    await trio.sleep(REPORT_PAUSE)
            finally:
                with contextlib.suppress(OSError):
                    if os.stat(path).st_ino == bound:  # not a later serving process's
                        os.unlink(path)

    def _take_in(self, sock: socket.socket) -> None:
        """Note the reports waiting at ``sock``: as many as its queue holds, at most."""
        for _ in range(_REPORTS_AT_ONCE):
            try:
                report = sock.recv(ACCESS_REPORT_MAX)
            except BlockingIOError:
                return
            self.note(report)
