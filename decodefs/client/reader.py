"""Reading a mounted array (``read_array``): a stored one straight from its store's file, checked
as the daemon checks it, anything else through the mount; knows the entry format, not the daemon.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from ..common.entry import STALE, EntryKey, check_entry_pieces, layout_problem
from ..common.inodes import Kind, Node
from ..common.names import key_of
from ..common.npy import npy_file_size, npy_header
from ..common.protocol import RECHECK_FLAG, STATUS_DIR, TRAILER_SIZE
from ..common.trusted import owned_alone
from .discovery import Mount, forget_mounts, readable_mount
from .hits import flush_reports, report_hit
from .keys import missing_directory

__all__ = ["flush_reports", "read_array", "read_array_into", "read_stored_rows"]

# A stored entry is checked as the daemon checks it before serving it
# (integrity trailer, decoder fingerprint, length, key-seeded checksum, .npy
# header), and its hit reported to the daemon (hits.py). An open descriptor
# survives eviction, and a rebuild replaces the file by rename, so the bytes
# read are one whole entry or the read falls back to the mount: unbuffered,
# so Python's open() sends no isatty() ioctl. Which stores may be read
# directly is discovery.py's to say.
# The path is looked up as given (the kernel answers from its caches), so a
# name the daemon does not serve fails as ``open`` would, and the array's
# version and size come from the inode the kernel reports (inodes.py), never
# from the path's text: symlinks and ``..`` mean what they mean to ``open``.
# An array's key is its file name without ".npy" (names.key_of); in a mirror
# version it is its path below ``<mount>/<version>/<size>/``
# (protocol.StoreStatus), symlinks resolved as ``open`` resolves them, and
# used only if that path is the entry the kernel reported.

_PROBLEMS_MAX: Final = 100_000


def read_array(path: str | os.PathLike[str]) -> npt.NDArray[np.uint8]:
    """The array of a ``<mount>/<version>/<size>/[<uu>/]<uuid>.npy`` file.

    The same dtype, shape and values as ``np.load(path)``, as a writable,
    C-contiguous uint8 array; usually several times faster on a hit. Raises
    what ``open(path)`` would for a name the mount does not have. A path on
    any other filesystem is read with ``np.load``.
    """
    path = os.fspath(path)
    found = locate(path)
    if found is None:
        return _load_any(path)
    mount, key = found
    out = np.empty((key.size, key.size, 3), np.uint8)
    if stored_into(mount, key, path, out):
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
    found = locate(path)
    if found is not None:
        mount, key = found
        if stored_into(mount, key, path, out):
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
    known: dict[int, Mount | None] = {}  # st_dev -> its mount, for this batch
    misses = []
    for i, name in enumerate(paths):
        path = os.fspath(name)
        found = locate(path, known)
        if found is None or not stored_into(*found, path, rows[i]):
            misses.append(i)
    return misses


def stored_into(mount: Mount, key: EntryKey, path: str, out: npt.NDArray[np.uint8]) -> bool:
    """Whether ``key``'s stored entry was read into ``out`` (of its array's shape, else
    ValueError), checked, and reported as a direct hit."""
    _check_shape(out, (key.size, key.size, 3), path)
    if not _read_stored(mount, key, out):
        return False
    report_hit(mount.access_socket, key)
    return True


def _check_out(out: npt.NDArray[np.uint8]) -> None:
    if not (out.dtype == np.uint8 and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("reading into an array needs a writable, C-contiguous uint8 one")


def _check_shape(out: npt.NDArray[np.uint8], shape: tuple[int, ...], path: str) -> None:
    if out.shape != shape:
        raise ValueError(f"{path} holds an array of shape {shape}, not {out.shape}")


def locate(
    path: str, known: dict[int, Mount | None] | None = None
) -> tuple[Mount, EntryKey] | None:
    """The mount whose store may hold ``path``'s array, and its key; None if the
    file is no array of a mount whose store this process may read. ``known``:
    the mounts found by device so far in one batch, used and added to."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, _why_missing(path), path) from None
    name = os.path.basename(path)
    if stat.S_ISLNK(st.st_mode):
        real = os.path.realpath(path)
        st, name = os.stat(real), os.path.basename(real)
    if known is not None and st.st_dev in known:
        mount = known[st.st_dev]
    else:
        mount = readable_mount(st.st_dev)
        if known is not None:
            known[st.st_dev] = mount
    if mount is None:
        return None
    key = _key_of(mount, st, name, path)
    return None if key is None else (mount, key)


def _why_missing(path: str) -> str:
    """What is missing of ``<mount>/<version>/<size>/<key>.npy``: the mount, the version,
    the size (out of the config's bounds) or the original; the plain reason for a path
    on no mount."""
    plain = os.strerror(errno.ENOENT)
    parts = os.path.abspath(path).split(os.sep)
    for depth in range(len(parts) - 3, 0, -1):  # the mount's root: the one with STATUS_DIR
        root = os.sep.join(parts[:depth]) or os.sep
        if os.path.isdir(os.path.join(root, STATUS_DIR)):
            break
    else:
        return plain
    version, size = parts[depth], parts[depth + 1]
    if not os.path.isdir(os.path.join(root, version, size)):
        if size.isdigit() and str(int(size)) == size:
            return missing_directory(root, version, int(size))
        return f"{os.path.join(root, version)} has no size {size!r}" if version else plain
    key = os.sep.join(parts[depth + 2 :]).removesuffix(".npy")
    return f"{version} has no original {key!r} (decodefs.list_keys lists its keys)"


# -- which array a file is ----------------------------------------------------------


def _key_of(mount: Mount, st: os.stat_result, name: str, path: str) -> EntryKey | None:
    """The key of the file ``st`` named ``name`` (at ``path``) on ``mount``, or None if
    it is no array, or not one this process can name for sure."""
    try:
        node = Node.from_ino(st.st_ino)
    except IndexError:
        return None
    if node.kind != Kind.ENTRY or node.version >= len(mount.versions):
        return None
    key = key_of(name)
    if key is None or not mount.min_size <= node.size <= mount.max_size:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size != npy_file_size(node.size):
        return None
    version = mount.versions[node.version]
    if not version:
        return None
    if version in mount.mirrors:
        return _mirror_key(mount, st, path, version, node.size)
    return EntryKey(version, node.size, key)


def _mirror_key(
    mount: Mount, st: os.stat_result, path: str, version: str, size: int
) -> EntryKey | None:
    """A mirror entry's key: its path below ``<mount>/<version>/<size>/``, without
    ".npy"; None unless that path is still the entry ``st`` the kernel reported."""
    real = os.path.realpath(path)  # symlinks and ".." as open() resolves them
    below = os.path.join(mount.root, version, str(size), "")
    key = key_of(real[len(below) :]) if real.startswith(below) else None
    if key is None:
        return None
    try:
        again = os.stat(real)
    except OSError:
        return None
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
        return None  # a symlink on the way was changed meanwhile
    return EntryKey(version, size, key)


# -- reading ------------------------------------------------------------------------

_lock = threading.Lock()  # guards _last_problem's growth
_last_problem: dict[EntryKey, str] = {}


def _read_stored(mount: Mount, key: EntryKey, out: npt.NDArray[np.uint8]) -> bool:
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
            forget_mounts()
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
        if not (stat.S_ISREG(st.st_mode) and owned_alone(st, owner)):
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
    # RECHECK_FLAG asks the daemon to check its stored entry again before serving it:
    # this process just found that entry bad.
    flags = os.O_RDONLY | (RECHECK_FLAG if _last_problem.get(key) is not None else 0)
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


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork)
