"""Store entries and the kernel's page cache: reads that never wait, and leaving one copy.

An array read through the mount is cached by the kernel as the mount file's
pages. The daemon serves those bytes from the store's entry file, so unless it
says otherwise they would stay cached a second time as the entry file's pages.
The rules:

- Pages of an entry file that were resident before the daemon read them belong
  to someone else (``read_array`` readers read the store's files directly):
  they are read and left alone. Resident means that a read asking the kernel
  not to wait (``RWF_NOWAIT``) got every byte; one that gets fewer started the
  readahead of the rest, so only the first answer tells.
- Pages the daemon brought in (a read from the disk, a verification, a write)
  are dropped (``POSIX_FADV_DONTNEED``) once their bytes are in the mount's
  page cache: in a batch shortly after (``READ_DROP_DELAY``), never on the
  event loop (a drop may wait for other CPUs to hand back their page lists).
  A written page is dropped only once written back, so written entries are
  dropped after a longer delay (``WRITTEN_DROP_DELAY``); the write starts its
  writeback at once.

``open_cached``, ``resident`` and ``read_resident`` never wait for a device,
so the event loop may call them; ``read_noting_residency``, ``drop`` and
``start_writeback`` block and belong in a worker thread. ``PendingDrops`` is the
queue of drops. Knows nothing of trio, FUSE or the store's layout; the daemon's
reads (daemon/entry_reads.py) are the one place that applies the rules.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import os
from collections.abc import Hashable
from typing import Final, Generic, TypeVar

from .root import read_all

__all__ = [
    "READ_DROP_DELAY",
    "WRITTEN_DROP_DELAY",
    "PendingDrops",
    "drop",
    "nowait_unsupported",
    "open_cached",
    "read_noting_residency",
    "read_resident",
    "resident",
    "start_writeback",
]

K = TypeVar("K", bound=Hashable)

# Long enough for a started writeback of an entry to finish on any working device.
WRITTEN_DROP_DELAY: Final = 2.0
# Short next to the page cache's life, long enough that a worker thread drops many at once.
READ_DROP_DELAY: Final = 0.5
_PAGE: Final = os.sysconf("SC_PAGE_SIZE")
# Drops are an optimisation: past this many pending, new ones are not queued.
_MAX_PENDING_DROPS: Final = 100_000

# openat2(2), which the standard library lacks: RESOLVE_CACHED fails (EAGAIN) rather than
# read a directory from the disk. The same number on every Linux architecture.
_SYS_OPENAT2: Final = 437
_RESOLVE_NO_SYMLINKS: Final = 0x04
_RESOLVE_BENEATH: Final = 0x08
_RESOLVE_CACHED: Final = 0x20
_RESOLVE: Final = _RESOLVE_CACHED | _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS
# Called holding the GIL (PyDLL): both system calls return at once, and letting a worker
# thread take the GIL in between would make the event loop wait to get it back.
_libc = ctypes.PyDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


# cachestat(2) (Linux 6.5): how many pages of a range are in the page cache, without
# reading any in. The same number on every Linux architecture.
_SYS_CACHESTAT: Final = 451


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def resident(fd: int, offset: int, length: int) -> bool | None:
    """Whether every page holding a byte of the range (which lies within the file) is
    in the page cache; None where the kernel cannot say (older than 6.5). Never
    waits, and unlike a read that misses, brings nothing in: the event loop may
    ask before it reads."""
    start = offset - offset % _PAGE
    pages = -(-(offset + length - start) // _PAGE)
    span = _CachestatRange(start, pages * _PAGE)
    stat = _Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        return None
    return int(stat.nr_cache) >= pages


def open_cached(directory: int, relpath: str, flags: int) -> int | None:
    """``relpath`` below ``directory`` opened with ``flags`` if every name on the way is
    in the kernel's caches, else None: never waits for a device. No symlink is
    followed, nothing outside ``directory`` is reached. None too on kernels older
    than 5.12 (no openat2) or where the flags are refused."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE)
    fd: int = _libc.syscall(
        _SYS_OPENAT2, directory, os.fsencode(relpath), ctypes.byref(how), ctypes.sizeof(how)
    )
    return fd if fd >= 0 else None


def read_resident(fd: int, offset: int, length: int) -> bytearray | None:
    """``length`` bytes of ``fd`` from ``offset`` if every page is in the page cache
    (fewer only at the end of the file), else None: never waits for a device. A
    miss starts the readahead that the read after it will use. Raises OSError
    (EOPNOTSUPP on a filesystem that cannot answer without waiting: tmpfs)."""
    buffer = bytearray(length)
    try:
        got = os.preadv(fd, [buffer], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return None
    if got == length:
        return buffer
    # Short: the end of the file, or a page further on that is not resident.
    if offset + got >= os.fstat(fd).st_size:
        del buffer[got:]
        return buffer
    return None


def read_noting_residency(fd: int, offset: int, length: int) -> tuple[bytes, bool]:
    """Up to ``length`` bytes of ``fd`` from ``offset``, and whether this read brought
    any of them in from the disk (not all were resident; where the kernel cannot
    say, its first try, which waits for nothing, fell short); a filesystem that
    cannot tell (tmpfs) brings nothing in."""
    known = resident(fd, offset, length)
    if known is not None:
        return read_all(fd, length, offset), not known
    try:
        found = read_resident(fd, offset, length)
    except OSError as exc:
        if not nowait_unsupported(exc):
            raise
        return read_all(fd, length, offset), False
    if found is not None:
        return bytes(found), False
    return read_all(fd, length, offset), True


def nowait_unsupported(exc: OSError) -> bool:
    """Whether ``exc`` says the filesystem cannot read without waiting (tmpfs)."""
    return exc.errno in (errno.EOPNOTSUPP, errno.EINVAL)


def drop(fd: int, offset: int = 0, length: int = 0) -> None:
    """Let the kernel drop ``fd``'s clean pages that hold any byte of the range (0:
    to the end). Blocks while it starts the writeback of dirty ones; errors are
    ignored."""
    start = offset - offset % _PAGE
    if length:
        length = -(-(offset + length - start) // _PAGE) * _PAGE  # whole pages
    with contextlib.suppress(OSError):  # an optimisation only
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)


def start_writeback(fd: int) -> None:
    """Start writing ``fd``'s dirty pages back now, so a later ``drop`` can drop them."""
    drop(fd)  # DONTNEED starts the writeback of dirty pages and drops only clean ones


class PendingDrops(Generic[K]):
    """Entries whose pages the daemon brought into the page cache, to drop when due.

    For the event loop alone. Pages read in are due after ``READ_DROP_DELAY``, so
    that one worker thread drops many at a time; written ones after
    ``WRITTEN_DROP_DELAY`` (``due`` takes the caller's clock). Bounded: past
    ``_MAX_PENDING_DROPS`` new ones are not queued (``skipped`` counts them);
    the kernel reclaims those pages under pressure as it would any others.
    """

    def __init__(
        self, read_delay: float = READ_DROP_DELAY, written_delay: float = WRITTEN_DROP_DELAY
    ) -> None:
        # Each queue is in the order its keys fall due: one delay per queue.
        self._queues = {
            False: (read_delay, collections.deque[tuple[float, K]]()),
            True: (written_delay, collections.deque[tuple[float, K]]()),
        }
        self.skipped = 0

    def __len__(self) -> int:
        return sum(len(queue) for _, queue in self._queues.values())

    def add(self, key: K, now: float, *, written: bool) -> None:
        if len(self) >= _MAX_PENDING_DROPS:
            self.skipped += 1
            return
        delay, queue = self._queues[written]
        queue.append((now + delay, key))

    def next_due(self) -> float | None:
        """When the next drop is due; None if nothing is pending."""
        heads = [queue[0][0] for _, queue in self._queues.values() if queue]
        return min(heads) if heads else None

    def due(self, now: float) -> list[K]:
        """Take every key whose drop is due at ``now`` (each once)."""
        keys: dict[K, None] = {}
        for _, queue in self._queues.values():
            while queue and queue[0][0] <= now:
                keys[queue.popleft()[1]] = None
        return list(keys)
