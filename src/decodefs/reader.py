"""The client-side reader: ``read_array(path)`` for files under a decodefs mount.

A stored array is read straight from the store's file, skipping FUSE, and
checked exactly as the daemon checks it before serving (integrity trailer,
decoder fingerprint, length, key-seeded checksum, .npy header). An open
descriptor survives eviction, and a rebuild replaces the file by rename, so
the bytes read are one whole entry or the read falls back. Anything else (a
miss, a bad entry, a store this user may not read, a path outside decodefs)
reads through the mount, unbuffered, so Python's open() sends no isatty()
ioctl. Hits are reported to the daemon in batches over a datagram socket, so
its LRU order sees them. Knows the store's file format; not the daemon.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from .decode import npy_file_size, npy_header
from .store import STALE, TRAILER_SIZE, EntryKey, check_entry

__all__ = ["read_array"]

log = logging.getLogger(__name__)

STATUS_FILE: Final = os.path.join(".decodefs", "store.json")
_REPORT_BYTES: Final = 8192  # one datagram of access reports
_REPORT_SECONDS: Final = 1.0


@dataclass(frozen=True)
class _Mount:
    """What a process needs to read a mount's store directly (from its store.json)."""

    root: str
    store: str
    digests: dict[str, bytes]
    access_socket: str | None


def read_array(path: str | os.PathLike[str]) -> npt.NDArray[np.uint8]:
    """The array of a ``<mount>/<version>/<size>/[<uu>/]<uuid>.npy`` file.

    Identical to ``np.load(path)`` (a writable uint8 array), usually several
    times faster on a hit. Any .npy path works; non-decodefs paths are read
    with np.load.
    """
    path = os.fspath(path)
    located = _locate(path)
    if located is None:
        return _load_any(path)
    mount, key = located
    array = _read_stored(mount, key)
    if array is not None:
        _reporter.report(mount, key)
        return array
    return _read_through_mount(path, key, verify_again=_last_problem.get(key) is not None)


# -- where a path's array is stored ----------------------------------------------

_mounts: dict[str, _Mount | None] = {}  # directory of a read file -> its mount (or not one)
_last_problem: dict[EntryKey, str] = {}


def _locate(path: str) -> tuple[_Mount, EntryKey] | None:
    directory, name = os.path.split(os.path.abspath(path))
    if not name.endswith(".npy"):
        return None
    uuid = name[: -len(".npy")]
    parts = directory.split(os.sep)
    sharded = len(parts) >= 3 and 1 <= len(parts[-1]) <= 2 and uuid[:2] == parts[-1]
    size_dir = os.sep.join(parts[:-1]) if sharded else directory
    if size_dir not in _mounts:
        _mounts[size_dir] = _find_mount(os.path.dirname(os.path.dirname(size_dir)))
    mount = _mounts[size_dir]
    if mount is None:
        return None
    version = os.path.basename(os.path.dirname(size_dir))
    size_name = os.path.basename(size_dir)
    if version not in mount.digests or not size_name.isdigit():
        return None
    return mount, EntryKey(version, int(size_name), uuid)


def _find_mount(root: str) -> _Mount | None:
    try:
        with open(os.path.join(root, STATUS_FILE), "rb", buffering=0) as f:
            status = json.loads(f.read())
        return _Mount(
            root=root,
            store=status["store"],
            digests={v: bytes.fromhex(d) for v, d in status["versions"].items()},
            access_socket=status.get("access_socket"),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# -- reading ------------------------------------------------------------------------


def _read_stored(mount: _Mount, key: EntryKey) -> npt.NDArray[np.uint8] | None:
    path = os.path.join(mount.store, key.version, str(key.size), key.uuid[:2], key.uuid + ".npy")
    length = npy_file_size(key.size) + TRAILER_SIZE
    buffer = bytearray(length)
    try:
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(buffer)
            extra = f.read(1)  # a longer file is not this entry either
    except OSError:
        return None  # a miss, or a store this user may not read
    if got != length or extra:
        problem: str | None = f"length {got}"
    else:
        problem = check_entry(key, buffer, mount.digests[key.version])
    header = npy_header(key.size)
    if problem is None and buffer[: len(header)] != header:
        problem = "payload is not the expected .npy layout"
    if problem is not None:
        _last_problem[key] = problem
        if problem == STALE:  # the daemon may have restarted with other settings
            _mounts.clear()
        return None
    _last_problem.pop(key, None)
    return _array(buffer, key.size)


def _read_through_mount(path: str, key: EntryKey, verify_again: bool) -> npt.NDArray[np.uint8]:
    # O_SYNC asks the daemon to check its stored entry again before serving it:
    # this process just found that entry bad.
    flags = os.O_RDONLY | (os.O_SYNC if verify_again else 0)
    fd = os.open(path, flags)
    with open(fd, "rb", buffering=0) as f:
        data = f.read()
    _last_problem.pop(key, None)
    header = npy_header(key.size)
    if len(data) == npy_file_size(key.size) and data[: len(header)] == header:
        return _array(bytearray(data), key.size)
    return _load_any(path)


def _array(buffer: bytearray, size: int) -> npt.NDArray[np.uint8]:
    offset = len(npy_header(size))
    return np.frombuffer(buffer, dtype=np.uint8, count=size * size * 3, offset=offset).reshape(
        size, size, 3
    )


def _load_any(path: str) -> npt.NDArray[np.uint8]:
    array: npt.NDArray[np.uint8] = np.load(path)
    return array


# -- telling the daemon about direct hits ----------------------------------------------


class _Reporter:
    """Batches "version<TAB>size<TAB>uuid" lines into datagrams to the daemon.

    Fire and forget: a full or absent socket only makes LRU order approximate.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[bytes]] = {}
        self._sizes: dict[str, int] = {}
        self._last_flush = time.monotonic()
        self._socket: socket.socket | None = None
        self._pid = os.getpid()

    def report(self, mount: _Mount, key: EntryKey) -> None:
        if mount.access_socket is None:
            return
        line = os.fsencode(f"{key.version}\t{key.size}\t{key.uuid}\n")
        with self._lock:
            lines = self._pending.setdefault(mount.access_socket, [])
            lines.append(line)
            self._sizes[mount.access_socket] = self._sizes.get(mount.access_socket, 0) + len(line)
            full = self._sizes[mount.access_socket] >= _REPORT_BYTES
            due = time.monotonic() - self._last_flush >= _REPORT_SECONDS
        if full or due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending, self._sizes = self._pending, {}, {}
            self._last_flush = time.monotonic()
        if not pending:
            return
        sock = self._sock()
        for address, lines in pending.items():
            with contextlib.suppress(OSError):  # no daemon listening, or its queue is full
                sock.sendto(b"".join(lines), address)

    def _sock(self) -> socket.socket:
        if self._socket is None or self._pid != os.getpid():  # a fork (DataLoader worker)
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
            self._pid = os.getpid()
        return self._socket


_reporter = _Reporter()
atexit.register(_reporter.flush)
