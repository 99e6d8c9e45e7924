"""Telling daemons about direct hits, in batches of access reports over their datagram sockets
(so their LRU order sees them); knows the report lines (protocol), not mounts, stores or reads.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import socket
import threading
import time
from typing import Final

from ..common.entry import EntryKey
from ..common.protocol import ACCESS_REPORT_MAX, encode_access

__all__ = ["HitReporter", "flush_reports", "report_hit", "report_hits"]

# A datagram as long as the daemon reads (each one it takes in costs it a wakeup)
_REPORT_BYTES: Final = ACCESS_REPORT_MAX
_REPORT_HITS: Final = 1024  # hits that make the reporter send at once
_REPORT_SECONDS: Final = 1.0


class HitReporter:
    """Batches access report lines (protocol.encode_access) into datagrams to the daemon.

    A hit costs one tuple appended; the lines are made when they are sent. A
    batch's hits come as their lines, made by the caller (protocol.encode_accesses).
    Fire and forget: a full or absent socket only makes LRU order approximate.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (socket address, a key or whole report lines) to send, and how many hits
        self._pending: list[tuple[str, EntryKey | bytes]] = []
        self._hits = 0
        self._last_flush = time.monotonic()
        self._socket: socket.socket | None = None

    def report(self, address: str | None, key: EntryKey) -> None:
        """A direct hit of ``key``, for the daemon listening at ``address`` (None: none)."""
        if address is None:
            return
        self._add(address, key, 1)

    def report_lines(self, address: str | None, lines: bytes, count: int) -> None:
        """``count`` direct hits (a batch's) as their report lines (protocol.encode_access)."""
        if address is None or not count:
            return
        self._add(address, lines, count)

    def _add(self, address: str, hits: EntryKey | bytes, count: int) -> None:
        with self._lock:
            self._pending.append((address, hits))
            self._hits += count
            full = self._hits >= _REPORT_HITS
        if full or time.monotonic() - self._last_flush >= _REPORT_SECONDS:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._hits = 0
            self._last_flush = time.monotonic()
        if not pending:
            return
        datagrams: dict[str, list[bytearray]] = {}
        for address, hits in pending:
            lines = datagrams.setdefault(address, [bytearray()])
            if isinstance(hits, bytes) and len(lines[-1]) + len(hits) <= _REPORT_BYTES:
                lines[-1] += hits  # a batch's lines, whole
                continue
            each = hits.splitlines(keepends=True) if isinstance(hits, bytes) else [hits]
            for one in each:
                line = one if isinstance(one, bytes) else encode_access(*one)
                if lines[-1] and len(lines[-1]) + len(line) > _REPORT_BYTES:
                    lines.append(bytearray())
                lines[-1] += line
        sock = self._sock()
        for address, lines in datagrams.items():
            for datagram in lines:
                with contextlib.suppress(OSError):  # no daemon listening, or its queue is full
                    sock.sendto(datagram, address)

    def after_fork(self) -> None:
        """In a forked child (a DataLoader worker): start afresh, sharing nothing."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._pending = []
        self._hits = 0
        self._last_flush = time.monotonic()
        self._socket = None

    def _sock(self) -> socket.socket:
        with self._lock:
            if self._socket is None:
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                )
            return self._socket


def report_hit(address: str | None, key: EntryKey) -> None:
    """A direct hit of ``key`` for the daemon at ``address``, sent with the next batch."""
    _reporter.report(address, key)


def report_hits(address: str | None, lines: bytes, count: int) -> None:
    """``count`` direct hits as their report lines, sent with the next batch."""
    _reporter.report_lines(address, lines, count)


def flush_reports() -> None:
    """Send the direct hits not yet reported to their daemons now (they go in
    batches, at the latest with the next hit a second later, or at exit)."""
    _reporter.flush()


def _flush_at_child_exit(reporter: HitReporter) -> None:
    # A multiprocessing child started by fork (DataLoader workers, Pool) ends
    # with os._exit: atexit never runs there, multiprocessing's finalizers do.
    multiprocessing.util.Finalize(None, reporter.flush, exitpriority=0)


_reporter = HitReporter()
atexit.register(_reporter.flush)
os.register_at_fork(after_in_child=_reporter.after_fork)
multiprocessing.util.register_after_fork(_reporter, _flush_at_child_exit)
