"""A batch's rows read from store entries in Python: the twin of the compiled ``_batchread``
(the same statuses, the same rows, the same checks), and which of the two this machine has;
knows the entry format and the trusted-file check, not keys, mounts or batches (``read_kept``
stats the paths it is given: what they mean is batch.py's).

``_batchread`` (``_ext/``, C) builds where a compiler and Python's headers are found
(``scripts/setup.sh`` installs both); ``compiled`` and its siblings are None where it
did not, and ``BatchReader`` reads with the functions here.
"""

from __future__ import annotations

import errno
import os
import resource
import stat
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import xxhash

from ..common.protocol import TRAILER, TRAILER_SIZE
from ..common.trusted import owned_alone

__all__ = [
    "BAD",
    "BUILDS",
    "EXPECT_SIZE",
    "EXTENSION",
    "GONE",
    "MISSING",
    "NOT_CACHED",
    "NOWAIT",
    "OK",
    "TRUSTED",
    "UNREAD",
    "Looked",
    "ReadRows",
    "change_token",
    "compiled",
    "compiled_gone",
    "compiled_kept",
    "gone_py",
    "major_faults",
    "read_entries_py",
    "read_kept_py",
    "unmap",
]

# The statuses of an item of read_rows, as _batchread.c has them.
OK: Final = 0
MISSING: Final = 1  # no entry file (or none to open): read through the mount
NOT_CACHED: Final = 2  # not in the page cache; with nowait, its reading ahead started
BAD: Final = 3  # failed a check, or an error: reader.py finds out why, then the mount
GONE: Final = 4  # a kept descriptor's file was unlinked: closed, to be opened again
UNREAD: Final = 5  # read_kept: no kept file (or a key not looked up on this mount): opened
# read_rows' nowait: 0 reads whatever it takes, NOWAIT only what is in the page cache, and
# TRUSTED copies mapped entries without asking the kernel (mincore) whether they are.
NOWAIT: Final = 1
TRUSTED: Final = 2

EXPECT_SIZE: Final = TRAILER_SIZE - 8  # the trailer but its checksum
_PIECE: Final = 64 * 1024


class ReadRows(Protocol):
    def __call__(
        self,
        dirfd: int,
        rows: Any,
        row_bytes: int,
        positions: npt.NDArray[np.int32],
        fds: npt.NDArray[np.int32],
        maps: npt.NDArray[np.uint64],
        names: Sequence[bytes | None],
        seeds: npt.NDArray[np.uint64],
        header: bytes,
        expect: bytes,
        owner: int,
        keep: int,
        map: bool,
        nowait: int,
        token: int,
        checked: npt.NDArray[np.uint64],
        ctimes: npt.NDArray[np.int64],
        status: npt.NDArray[np.int32],
    ) -> int: ...


def read_entries_py(
    dirfd: int,
    rows: Any,
    row_bytes: int,
    positions: npt.NDArray[np.int32],
    fds: npt.NDArray[np.int32],
    maps: npt.NDArray[np.uint64],
    names: Sequence[bytes | None],
    seeds: npt.NDArray[np.uint64],
    header: bytes,
    expect: bytes,
    owner: int,
    keep: int,
    map: bool,
    nowait: int,
    token: int,
    checked: npt.NDArray[np.uint64],
    ctimes: npt.NDArray[np.int64],
    status: npt.NDArray[np.int32],
) -> int:
    """``_batchread.read_rows`` in Python: the same rows, statuses and kept descriptors
    (see its docstring), where the extension did not build. It maps nothing: ``map``
    and ``maps`` (all 0) are taken for the same signature, TRUSTED is NOWAIT, and every
    kept descriptor is looked at, whatever ``checked`` says."""
    memory = memoryview(rows).cast("B")
    kept = 0
    for i in range(len(positions)):
        fd, opened = int(fds[i]), False
        if fd < 0:
            name = names[i]
            if name is None:
                status[i] = MISSING
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dirfd)
            except (FileNotFoundError, NotADirectoryError):
                status[i] = MISSING
                continue
            except OSError:
                status[i] = BAD
                continue
            opened = True
        start = int(positions[i]) * row_bytes
        row = memory[start : start + row_bytes]
        got = _read_row_py(fd, opened, row, int(seeds[i]), header, expect, owner, nowait, ctimes, i)
        if got != GONE:
            checked[i] = token
        status[i] = got
        if opened:
            if got in (OK, NOT_CACHED) and kept < keep:
                fds[i] = fd
                kept += 1
            else:
                os.close(fd)
    return kept


def _read_row_py(
    fd: int,
    opened: bool,
    row: memoryview,
    seed: int,
    header: bytes,
    expect: bytes,
    owner: int,
    nowait: int,
    ctimes: npt.NDArray[np.int64],
    i: int,
) -> int:
    length = len(header) + len(row) + TRAILER_SIZE
    try:
        st = os.fstat(fd)
        if st.st_nlink == 0:
            return MISSING if opened else GONE
        if opened and not (stat.S_ISREG(st.st_mode) and owned_alone(st, owner)):
            return BAD
        if opened:
            ctimes[i] = st.st_ctime_ns
        elif st.st_ctime_ns != ctimes[i]:
            return GONE  # other readers since it was opened: opened again, or refused
        if st.st_size != length:
            return BAD
        head, trailer = bytearray(len(header)), bytearray(TRAILER_SIZE)
        nowait_read = bool(nowait) and st.st_dev not in _nowait_refused
        got = _preadv(fd, [head, row, trailer], os.RWF_NOWAIT if nowait_read else 0, st.st_dev)
    except BlockingIOError:
        os.posix_fadvise(fd, 0, length, os.POSIX_FADV_WILLNEED)
        return NOT_CACHED
    except OSError:
        return BAD
    if got != length:
        if nowait_read:
            os.posix_fadvise(fd, 0, length, os.POSIX_FADV_WILLNEED)
            return NOT_CACHED
        return BAD
    if bytes(head) != header or bytes(trailer[:EXPECT_SIZE]) != expect:
        return BAD
    hasher = xxhash.xxh3_64(seed=seed)
    hasher.update(head)
    hasher.update(row)
    recorded = TRAILER.unpack(bytes(trailer))[4]
    return OK if hasher.intdigest() == recorded else BAD


class Looked(NamedTuple):
    """What ``read_kept`` looked at before its reads, and how they went."""

    stated: int  # 1: the directory and the mount's root were stated; 0: either failed (all 0)
    device: int  # the directory's st_dev
    inode: int  # the directory's st_ino
    root_device: int
    root_mtime_ns: int
    token: int  # the store's change token the reads went by (0: none)
    faults: int  # this thread's major page faults during the reads
    failed: int  # items not OK


def read_kept_py(
    rows: Any,
    row_bytes: int,
    index: npt.NDArray[np.int64],
    verified: npt.NDArray[np.uint32],
    generation: int,
    fds: npt.NDArray[np.int32],
    maps: npt.NDArray[np.uint64],
    seeds: npt.NDArray[np.uint64],
    header: bytes,
    expect: bytes,
    nowait: int,
    checked: npt.NDArray[np.uint64],
    ctimes: npt.NDArray[np.int64],
    status: npt.NDArray[np.int32],
    used: npt.NDArray[np.int32],
    directory: bytes,
    root: bytes,
    changes: int,
) -> Looked:
    """``_batchread.read_kept`` in Python (see its docstring): the stats of ``directory``
    and ``root`` and the change token read from ``changes``, then the keys' kept files
    read into rows 0, 1, ..., a key without one UNREAD. Maps nothing (``maps`` is taken
    for the same signature)."""
    try:
        st, root_st = os.stat(directory), os.stat(root)
    except OSError:
        stats = (0, 0, 0, 0, 0)
    else:
        stats = (1, st.st_dev, st.st_ino, root_st.st_dev, root_st.st_mtime_ns)
    token = change_token(changes)
    faults = major_faults()
    memory = memoryview(rows).cast("B")
    for p, i in enumerate(index.tolist()):
        fd = used[p] = int(fds[i])
        if fd < 0 or verified[i] != generation:
            status[p] = UNREAD
            continue
        row = memory[p * row_bytes : (p + 1) * row_bytes]
        got = _read_row_py(fd, False, row, int(seeds[i]), header, expect, 0, nowait, ctimes, i)
        if got != GONE:
            checked[i] = token
        status[p] = got
    failed = int(np.count_nonzero(status != OK))
    return Looked(*stats, token, major_faults() - faults, failed)


def gone_py(
    fds: npt.NDArray[np.int32],
    out: npt.NDArray[np.uint8],
    checked: npt.NDArray[np.uint64],
    ctimes: npt.NDArray[np.int64],
    token: int,
) -> None:
    """``_batchread.gone`` in Python: out[i] = 1 where fds[i]'s file is unlinked, changed
    since ctimes[i] or closed; a file whose checked[i] is token (not 0) is not looked at."""
    for i, fd in enumerate(fds.tolist()):
        out[i] = 0
        if fd < 0 or (token and int(checked[i]) == token):
            continue
        try:
            st = os.fstat(fd)
        except OSError:
            out[i] = 1
            continue
        out[i] = st.st_nlink == 0 or st.st_ctime_ns != ctimes[i]
        if not out[i]:
            checked[i] = token


# The file systems (st_dev) that said they cannot read without waiting (RWF_NOWAIT):
# each is read the plain way from then on, and only it.
_nowait_refused: set[int] = set()


def _preadv(fd: int, buffers: list[Any], flags: int, dev: int) -> int:
    try:
        return os.preadv(fd, buffers, 0, flags)
    except OSError as exc:
        if flags and exc.errno == errno.EOPNOTSUPP:  # this file system reads no other way
            _nowait_refused.add(dev)
            return os.preadv(fd, buffers, 0)
        raise


try:
    from . import _batchread  # type: ignore[attr-defined]

    compiled: ReadRows | None = _batchread.read_rows
    compiled_kept: Callable[..., tuple[int, ...]] | None = _batchread.read_kept
    compiled_gone: Callable[..., None] | None = _batchread.gone
    unmap: Callable[[Any, int], None] | None = _batchread.unmap
    EXTENSION: Final[str | None] = f"_batchread ({_batchread.VECTOR})"
    BUILDS: Final[tuple[str, ...]] = _batchread.BUILDS  # the builds this CPU runs, widest last
except ImportError:  # not built here: a compiler or Python's headers were missing
    compiled = None
    compiled_kept = None
    compiled_gone = None
    unmap = None
    EXTENSION = None  # type: ignore[misc]
    BUILDS = ()  # type: ignore[misc]


def major_faults() -> int:
    """This thread's major page faults so far: reads from disk of pages it touched."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_majflt


def change_token(changes: int) -> int:
    """The store's change token now, read from its file open at ``changes`` (0: none known)."""
    if changes < 0:
        return 0
    try:
        data = os.pread(changes, 8, 0)
    except OSError:
        return 0
    return int.from_bytes(data, "little") if len(data) == 8 else 0
