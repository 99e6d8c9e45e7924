"""The client-side reader: ``read_array(path)`` for files under a decodefs mount.

A stored array is read straight from the store's file, skipping FUSE, and
checked exactly as the daemon checks it before serving (integrity trailer,
decoder fingerprint, length, key-seeded checksum, .npy header). An open
descriptor survives eviction, and a rebuild replaces the file by rename, so
the bytes read are one whole entry or the read falls back. Anything else (a
miss, a bad entry, a store this user may not read) reads through the mount,
unbuffered, so Python's open() sends no isatty() ioctl. Hits are reported to
the daemon in batches over a datagram socket, so its LRU order sees them.
``read_array_into`` reads the same array into a caller's memory (a batch
tensor's row): a hit is one ``preadv`` of the entry file, checked in pieces.

The path is looked up through the mount as given (the kernel answers from
its caches), so a name the daemon does not serve fails as ``open`` would, and
the array's version and size come from the inode the kernel reports
(inodes.py), never from the path's text: symlinks and ``..`` mean what they
mean to ``open``. An array's key is its file name without ".npy"; in a mirror
version it is its path below ``<mount>/<version>/<size>/`` (protocol.StoreStatus),
symlinks resolved as ``open`` resolves them, and used only if that path is the
entry the kernel reported. A store is trusted only when the file's device is a
``fuse.decodefs`` mount in this process's mount table, and its directory and
the entry file belong to the mount's owner and nobody else may write to them.
Knows the store's file format and the inode layout; not the daemon.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.util
import os
import socket
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from ..common.decode import npy_file_size, npy_header
from ..common.entry import STALE, EntryKey, check_entry_pieces, layout_problem
from ..common.inodes import INODE_LAYOUT, Kind, Node
from ..common.mounts import mounts
from ..common.protocol import (
    FS_TYPE,
    STATUS_DIR,
    STORE_FILE,
    TRAILER_SIZE,
    StoreStatus,
    encode_access,
)

__all__ = ["flush_reports", "read_array", "read_array_into", "read_stored_rows"]

log = logging.getLogger(__name__)

STATUS_FILE: Final = os.path.join(STATUS_DIR, STORE_FILE)
_REPORT_BYTES: Final = 8192  # at most one datagram of access reports
_REPORT_LINES: Final = 256  # hits that make the reporter send at once
_REPORT_SECONDS: Final = 1.0
_NOT_A_MOUNT_SECONDS: Final = 10.0  # how long "this device is no decodefs mount" is believed
_PROBLEMS_MAX: Final = 100_000
_STATUS_ERRORS: Final = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
    ArithmeticError,
    RecursionError,
)


@dataclass(frozen=True)
class _Mount:
    """What a process needs to read a mount's store directly (from its store.json)."""

    root: str  # the mount point, as this process's mount table names it
    root_mtime_ns: int  # when its daemon mounted it: tells this mount from a later one
    owner: int  # the uid the daemon runs as (the mount root's owner)
    store: str
    versions: tuple[str, ...]  # by the version index in inode numbers
    digests: dict[str, bytes]
    min_size: int
    max_size: int
    access_socket: str | None
    mirrors: frozenset[str]  # versions whose keys are paths below <version>/<size>/


@dataclass(frozen=True)
class _Refused:
    """A decodefs mount whose store this process must not read directly."""

    root: str
    root_mtime_ns: int


def read_array(path: str | os.PathLike[str]) -> npt.NDArray[np.uint8]:
    """The array of a ``<mount>/<version>/<size>/[<uu>/]<uuid>.npy`` file.

    The same dtype, shape and values as ``np.load(path)``, as a writable,
    C-contiguous uint8 array; usually several times faster on a hit. Raises
    what ``open(path)`` would for a name the mount does not have. A path on
    any other filesystem is read with ``np.load``.
    """
    path = os.fspath(path)
    found = _locate(path)
    if found is None:
        return _load_any(path)
    mount, key = found
    out = np.empty((key.size, key.size, 3), np.uint8)
    if _stored_into(mount, key, path, out):
        return out
    array = _read_through_mount(path, key, out)
    return array if array is not None else _load_any(path)


def read_array_into(path: str | os.PathLike[str], out: npt.NDArray[np.uint8]) -> None:
    """``read_array(path)`` written into ``out``, a writable, C-contiguous uint8
    array of the file's shape (a row of a batch tensor, say), with no array of
    its own: a hit is read from the store file into ``out``'s memory by one
    ``preadv`` (the .npy header and the trailer into small buffers), checked as
    ``read_array`` checks it, and reported as a hit. Raises ValueError if the
    array's shape is not ``out``'s.
    """
    path = os.fspath(path)
    _check_out(out)
    found = _locate(path)
    if found is not None:
        mount, key = found
        if _stored_into(mount, key, path, out):
            return
        if _read_through_mount(path, key, out) is not None:
            return
    array = _load_any(path)
    _check_shape(out, array.shape, path)
    out[...] = array


def read_stored_rows(
    paths: Sequence[str | os.PathLike[str]], rows: npt.NDArray[np.uint8]
) -> list[int]:
    """``read_array_into(paths[i], rows[i])``'s hits alone, for each ``i`` (``rows`` a
    writable, C-contiguous uint8 array of one row per path: a batch tensor's
    memory): each array the store holds is read into its row, checked and
    reported, with ``rows`` checked once and each mount found once for the batch.
    Returns the indices of the paths that were no hit (a miss, an entry that
    failed its check, a file of no store this process may read):
    ``read_array_into`` reads those through the mount."""
    _check_out(rows)
    if len(paths) != len(rows):
        raise ValueError(f"{len(paths)} paths for {len(rows)} rows")
    known: dict[int, _Mount | None] = {}  # st_dev -> its mount, for this batch
    misses = []
    for i, name in enumerate(paths):
        path = os.fspath(name)
        found = _locate(path, known)
        if found is None or not _stored_into(*found, path, rows[i]):
            misses.append(i)
    return misses


def _stored_into(mount: _Mount, key: EntryKey, path: str, out: npt.NDArray[np.uint8]) -> bool:
    """Whether ``key``'s stored entry was read into ``out`` (of its array's shape, else
    ValueError), checked, and reported as a direct hit."""
    _check_shape(out, (key.size, key.size, 3), path)
    if not _read_stored(mount, key, out):
        return False
    _reporter.report(mount, key)
    return True


def _check_out(out: npt.NDArray[np.uint8]) -> None:
    if not (out.dtype == np.uint8 and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("reading into an array needs a writable, C-contiguous uint8 one")


def flush_reports() -> None:
    """Send the direct hits not yet reported to their daemons now (they go in
    batches, at the latest with the next hit a second later, or at exit)."""
    _reporter.flush()


def _check_shape(out: npt.NDArray[np.uint8], shape: tuple[int, ...], path: str) -> None:
    if out.shape != shape:
        raise ValueError(f"{path} holds an array of shape {shape}, not {out.shape}")


def _locate(
    path: str, known: dict[int, _Mount | None] | None = None
) -> tuple[_Mount, EntryKey] | None:
    """The mount whose store may hold ``path``'s array, and its key; None if the
    file is no array of a mount whose store this process may read. ``known``:
    the mounts found by device so far in one batch, used and added to."""
    st = os.lstat(path)
    name = os.path.basename(path)
    if stat.S_ISLNK(st.st_mode):
        real = os.path.realpath(path)
        st, name = os.stat(real), os.path.basename(real)
    if known is not None and st.st_dev in known:
        mount = known[st.st_dev]
    else:
        mount = _readable_mount(st.st_dev)
        if known is not None:
            known[st.st_dev] = mount
    if mount is None:
        return None
    key = _key_of(mount, st, name, path)
    return None if key is None else (mount, key)


def _readable_mount(device: int) -> _Mount | None:
    """The mount on ``device`` now, if this process may read its store directly."""
    mount = _mount_of(device)
    if mount is not None and not _current(mount, device):
        # Another mount since: the kernel reuses a device number after an unmount.
        mount = _mount_of(device, again=True)
    return mount if isinstance(mount, _Mount) else None


# -- which mount and key a file is -------------------------------------------------

_lock = threading.Lock()
# st_dev -> its decodefs mount, or when it was found to be none (time.monotonic).
_mounts: dict[int, _Mount | _Refused | float] = {}
_last_problem: dict[EntryKey, str] = {}


def _mount_of(device: int, again: bool = False) -> _Mount | _Refused | None:
    """The mount of ``device``: one whose store may be read, one whose store may
    not (its identity only), or None (no decodefs mount, believed for a while)."""
    with _lock:
        known = _mounts.get(device)
    if isinstance(known, (_Mount, _Refused)) and not again:
        return known
    if isinstance(known, float) and time.monotonic() - known < _NOT_A_MOUNT_SECONDS:
        return None
    mount = _find_mount(device)
    with _lock:
        _mounts[device] = mount if mount is not None else time.monotonic()
    return mount


def _current(mount: _Mount | _Refused, device: int) -> bool:
    """Whether ``mount`` still describes the mount on ``device`` (a cached stat)."""
    try:
        st = os.stat(mount.root)
    except OSError:
        return False
    return st.st_dev == device and st.st_mtime_ns == mount.root_mtime_ns


def _forget_mounts() -> None:
    """Read every mount's store.json again (a daemon restarted with other settings)."""
    with _lock:
        _mounts.clear()


def _find_mount(device: int) -> _Mount | _Refused | None:
    """The decodefs mount of ``device``, and whether this process may trust its store."""
    for root in _decodefs_mount_points(device):
        try:
            root_st = os.stat(root)
            if root_st.st_dev != device:
                continue  # hidden by a later mount on the same path
            with open(os.path.join(root, STATUS_FILE), "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_dev != device:
                    continue
                status = StoreStatus.from_json(f.read())
            refused = _Refused(root, root_st.st_mtime_ns)
            if status.inode_layout != INODE_LAYOUT:
                return refused  # another decodefs release: read through the mount
            mount = _Mount(
                root=root,
                root_mtime_ns=root_st.st_mtime_ns,
                owner=root_st.st_uid,
                store=status.store,
                versions=status.version_order,
                digests={v: bytes.fromhex(d) for v, d in status.digests.items()},
                min_size=status.min_size,
                max_size=status.max_size,
                access_socket=status.access_socket,
                mirrors=status.mirrors,
            )
            store_st = os.stat(mount.store)
        except _STATUS_ERRORS:
            continue
        if not _owned_alone(store_st, mount.owner):
            log.debug("not reading the store %s directly: not the mount owner's alone", mount.store)
            return refused
        return mount
    return None


def _owned_alone(st: os.stat_result, owner: int) -> bool:
    return st.st_uid == owner and not st.st_mode & 0o022


def _decodefs_mount_points(device: int) -> list[str]:
    try:
        table = mounts()
    except (OSError, ValueError):
        return []
    wanted = (os.major(device), os.minor(device))
    return [
        m.mountpoint for m in table if m.device == wanted and m.root == "/" and m.fstype == FS_TYPE
    ]


def _key_of(mount: _Mount, st: os.stat_result, name: str, path: str) -> EntryKey | None:
    """The key of the file ``st`` named ``name`` (at ``path``) on ``mount``, or None if
    it is no array, or not one this process can name for sure."""
    try:
        node = Node.from_ino(st.st_ino)
    except IndexError:
        return None
    if node.kind != Kind.ENTRY or node.version >= len(mount.versions):
        return None
    if not (mount.min_size <= node.size <= mount.max_size and name.endswith(".npy")):
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size != npy_file_size(node.size):
        return None
    version = mount.versions[node.version]
    if version in mount.mirrors:
        return _mirror_key(mount, st, path, version, node.size)
    return EntryKey(version, node.size, name[: -len(".npy")])


def _mirror_key(
    mount: _Mount, st: os.stat_result, path: str, version: str, size: int
) -> EntryKey | None:
    """A mirror entry's key: its path below ``<mount>/<version>/<size>/``, without
    ".npy"; None unless that path is still the entry ``st`` the kernel reported."""
    real = os.path.realpath(path)  # symlinks and ".." as open() resolves them
    below = os.path.join(mount.root, version, str(size), "")
    if not (real.startswith(below) and real.endswith(".npy")):
        return None
    try:
        again = os.stat(real)
    except OSError:
        return None
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
        return None  # a symlink on the way was changed meanwhile
    return EntryKey(version, size, real[len(below) : -len(".npy")])


# -- reading ------------------------------------------------------------------------


def _read_stored(mount: _Mount, key: EntryKey, out: npt.NDArray[np.uint8]) -> bool:
    """Whether ``key``'s entry was read from the store into ``out`` and may be served."""
    digest = mount.digests.get(key.version)
    if digest is None:
        return False
    path = os.path.join(mount.store, key.relpath)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # a miss, or a store this user may not read
    try:
        problem = _read_entry(fd, key, digest, mount.owner, out)
    finally:
        os.close(fd)
    if problem is not None:
        _note_problem(key, problem)
        if problem == STALE:  # the daemon may have restarted with other settings
            _forget_mounts()
        return False
    _last_problem.pop(key, None)
    return True


def _read_entry(
    fd: int, key: EntryKey, digest: bytes, owner: int, out: npt.NDArray[np.uint8]
) -> str | None:
    """Read the entry file open at ``fd``, its array into ``out``; why it must not
    be served (None: it may, and ``out`` holds its array)."""
    header = npy_header(key.size)
    length = len(header) + out.nbytes + TRAILER_SIZE
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and _owned_alone(st, owner)):
            return "not a file of the daemon's alone"
        if st.st_size != length:
            return f"length {st.st_size}"
        head = bytearray(len(header))
        array = out.data.cast("B")  # the caller's memory, as bytes
        trailer = bytearray(TRAILER_SIZE)
        got = os.preadv(fd, [head, array, trailer], 0)
    except OSError as exc:
        return str(exc)
    if got != length:
        return f"length {got}"
    checked = check_entry_pieces(key, [head, array], trailer, digest)
    return None if checked.ok else checked.reason


def _note_problem(key: EntryKey, problem: str) -> None:
    with _lock:
        if len(_last_problem) >= _PROBLEMS_MAX:
            _last_problem.clear()
        _last_problem[key] = problem


def _read_through_mount(
    path: str, key: EntryKey, out: npt.NDArray[np.uint8]
) -> npt.NDArray[np.uint8] | None:
    """``out`` holding the array read through the mount (the daemon decodes a
    miss); None if the file is not the .npy layout of ``key``'s array."""
    # O_SYNC asks the daemon to check its stored entry again before serving it:
    # this process just found that entry bad.
    flags = os.O_RDONLY | (os.O_SYNC if _last_problem.get(key) is not None else 0)
    fd = os.open(path, flags)
    with open(fd, "rb", buffering=0) as f:
        data = f.read()
    _last_problem.pop(key, None)
    if layout_problem(key, data, len(data)) is not None:
        return None
    out.reshape(-1)[:] = np.frombuffer(data, np.uint8, offset=len(npy_header(key.size)))
    return out


def _load_any(path: str) -> npt.NDArray[np.uint8]:
    array: npt.NDArray[np.uint8] = np.load(path)
    return array


# -- telling the daemon about direct hits ----------------------------------------------


class _Reporter:
    """Batches access report lines (protocol.encode_access) into datagrams to the daemon.

    A hit costs one tuple appended; the lines are made when they are sent.
    Fire and forget: a full or absent socket only makes LRU order approximate.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[str, EntryKey]] = []  # (socket address, key) to send
        self._last_flush = time.monotonic()
        self._socket: socket.socket | None = None

    def report(self, mount: _Mount, key: EntryKey) -> None:
        if mount.access_socket is None:
            return
        with self._lock:
            self._pending.append((mount.access_socket, key))
            full = len(self._pending) >= _REPORT_LINES
        if full or time.monotonic() - self._last_flush >= _REPORT_SECONDS:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._last_flush = time.monotonic()
        if not pending:
            return
        datagrams: dict[str, list[bytearray]] = {}
        for address, key in pending:
            line = encode_access(*key)
            lines = datagrams.setdefault(address, [bytearray()])
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
        self._last_flush = time.monotonic()
        self._socket = None

    def _sock(self) -> socket.socket:
        with self._lock:
            if self._socket is None:
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                )
            return self._socket


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _reporter.after_fork()


def _flush_at_child_exit(reporter: _Reporter) -> None:
    # A multiprocessing child started by fork (DataLoader workers, Pool) ends
    # with os._exit: atexit never runs there, multiprocessing's finalizers do.
    multiprocessing.util.Finalize(None, reporter.flush, exitpriority=0)


_reporter = _Reporter()
atexit.register(_reporter.flush)
os.register_at_fork(after_in_child=_after_fork)
multiprocessing.util.register_after_fork(_reporter, _flush_at_child_exit)
