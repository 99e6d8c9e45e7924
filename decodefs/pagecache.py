"""Store entries and the kernel's page cache: read resident pages without waiting, leave one copy.

An array read through the mount is cached by the kernel as the mount file's
pages. The daemon serves those bytes from the store's entry file, so unless it
says otherwise they would stay cached a second time as the entry file's pages.
The rules, which the engine applies:

- Pages of an entry file that were resident before the daemon read them belong
  to someone else (``read_array`` readers read the store's files directly):
  they are read and left alone.
- Pages the daemon brought in (a read from the disk, a verification, a write)
  are dropped (``POSIX_FADV_DONTNEED``) once their bytes are in the mount's
  page cache. A written page is dropped only once written back, so written
  entries are dropped after a delay (``WRITTEN_DROP_DELAY``); the write starts
  its writeback at once.

``read_resident`` never waits for a device (``RWF_NOWAIT``), so the event loop
may call it; ``drop`` and ``start_writeback`` block and belong in a worker
thread. ``EntryFiles`` keeps descriptors of recently verified or written
entries for those reads. ``PendingDrops`` is the queue of drops, owned by the
event loop.
Knows nothing of trio, FUSE or the store's layout.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Hashable
from typing import Final, Generic, TypeVar

import cachetools

__all__ = [
    "WRITTEN_DROP_DELAY",
    "EntryFiles",
    "PendingDrops",
    "drop",
    "is_resident",
    "read_resident",
    "start_writeback",
]

K = TypeVar("K", bound=Hashable)

# Long enough for a started writeback of an entry to finish on any working device.
WRITTEN_DROP_DELAY: Final = 2.0
_PAGE: Final = os.sysconf("SC_PAGE_SIZE")
# mmap(2), mincore(2) and munmap(2), for is_resident: the standard library has no mincore.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]  # fmt: skip
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED: Final = ctypes.c_void_p(-1).value
# Drops are an optimisation: past this many pending, new ones are not queued.
_MAX_PENDING_DROPS: Final = 100_000


def read_resident(fd: int, offset: int, length: int) -> bytearray | None:
    """``length`` bytes of ``fd`` from ``offset`` if every page is in the page cache
    (fewer only at the end of the file), else None; never waits for a device (a
    miss starts the readahead the read after it will use).

    None too where the filesystem cannot answer without waiting (tmpfs, older
    kernels: EOPNOTSUPP). Raises OSError for a descriptor that cannot be read.
    """
    buffer = bytearray(length)
    try:
        got = os.preadv(fd, [buffer], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    if got == length:
        return buffer
    # A short read: the end of the file, or a page further on that is not resident.
    if offset + got >= os.fstat(fd).st_size:
        del buffer[got:]
        return buffer
    return None


def is_resident(fd: int, offset: int = 0) -> bool | None:
    """Whether the page of ``fd`` at ``offset`` is in the page cache (mincore(2) of a
    one-page mapping: unlike a read, it brings nothing in); None if the file cannot
    be mapped. Never waits for a device."""
    start = offset - offset % _PAGE
    address = _libc.mmap(None, _PAGE, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address is None or address == _MAP_FAILED:
        return None
    try:
        vector = (ctypes.c_ubyte * 1)()
        if _libc.mincore(address, _PAGE, vector) != 0:
            return None
        return bool(vector[0] & 1)
    finally:
        _libc.munmap(address, _PAGE)


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


class EntryFiles(Generic[K]):
    """Descriptors of entry files kept open for ``read_resident``, by key; past
    ``maxsize`` the least recently kept is closed.

    Thread-safe. A descriptor is only ever used and closed under the lock, so a
    key's descriptor can be closed (``discard``: its entry is about to be
    removed) while another thread reads through it. The owner closes a key's
    descriptor before removing its entry, so that a kept descriptor never holds
    a removed entry's blocks on the disk.
    """

    def __init__(self, maxsize: int) -> None:
        self._lock = threading.Lock()
        self._fds: cachetools.LRUCache[K, int] = cachetools.LRUCache(maxsize)

    def __len__(self) -> int:
        return len(self._fds)

    def __contains__(self, key: K) -> bool:
        return key in self._fds

    def keep(self, key: K, fd: int) -> None:
        """Keep ``fd`` for ``key`` (taking ownership), closing any older one and, if
        full, the least recently kept."""
        with self._lock:
            fds = self._fds
            old = fds.pop(key, None)
            if old is not None:
                os.close(old)
            if len(fds) >= fds.maxsize:
                os.close(fds.popitem()[1])
            fds[key] = fd

    def read_resident(self, key: K, offset: int, length: int) -> bytearray | None:
        """``read_resident`` through ``key``'s kept descriptor; None if there is none,
        if a page is not resident, or if it cannot be read (then it is closed)."""
        with self._lock:
            fd = self._fds.get(key)
            if fd is None:
                return None
            try:
                return read_resident(fd, offset, length)
            except OSError:
                os.close(self._fds.pop(key))
                return None

    def discard(self, key: K) -> None:
        with self._lock:
            fd = self._fds.pop(key, None)
            if fd is not None:
                os.close(fd)

    def clear(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class PendingDrops(Generic[K]):
    """Entries whose pages the daemon brought into the page cache, to drop when due.

    For the event loop alone. Pages read in are due at once; written ones after
    ``WRITTEN_DROP_DELAY`` (``due`` takes the caller's clock). Bounded: past
    ``_MAX_PENDING_DROPS`` new ones are not queued (``skipped`` counts them);
    the kernel reclaims those pages under pressure as it would any others.
    """

    def __init__(self, written_delay: float = WRITTEN_DROP_DELAY) -> None:
        self._read: collections.deque[K] = collections.deque()
        self._written: collections.deque[tuple[float, K]] = collections.deque()
        self._written_delay = written_delay
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._read) + len(self._written)

    def add(self, key: K, now: float, *, written: bool) -> None:
        if len(self) >= _MAX_PENDING_DROPS:
            self.skipped += 1
        elif written:
            self._written.append((now + self._written_delay, key))
        else:
            self._read.append(key)

    def next_due(self) -> float | None:
        """When the next drop is due (-inf: now); None if nothing is pending."""
        if self._read:
            return float("-inf")
        return self._written[0][0] if self._written else None

    def due(self, now: float) -> list[K]:
        """Take every key whose drop is due at ``now`` (each once)."""
        keys = list(self._read)
        self._read.clear()
        written = self._written
        while written and written[0][0] <= now:
            keys.append(written.popleft()[1])
        return list(dict.fromkeys(keys))
