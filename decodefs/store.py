"""The flash directory: where entries live, atomic writes, verified reads, and its safety.

Layout::

    <store>/.decodefs-store           format marker
    <store>/.catalog.sqlite3          sizes and last access of entries (catalog.py)
    <store>/.index/<version>.json     the cached source index (source.py)
    <store>/.access.sock              readers report the hits they read directly
    <store>/.tmp/                     temp files, emptied at start
    <store>/.trash/                   discarded versions, deleted in the background
    <store>/<version>/.fingerprint.json
    <store>/<version>/<size>/<uuid[:2]>/<uuid>.npy     (entry.py: the file format)
    <store>/<version>/<size>/%<hh>/<escaped key>.npy   a key with "/" (entry.py)

Writes go to ``.tmp`` and are renamed into place: a crash leaves no entry or a
whole one. There is no fsync, because a torn entry after a power cut fails its
check and is rebuilt rather than served. Capacity and eviction live in
capacity.py, the entry file format in entry.py; this module stores opaque
payloads and knows nothing of images, numpy or FUSE.

Safety, for a daemon that runs as root on a shared machine: the store is
opened once, by a walk from ``/`` that trusts only directories of root or the
daemon's user that nobody else may write to (sticky ones aside), without
following a symlink anyone else could have planted; a missing store is made
with ``mkdir``, which cannot be raced into following someone else's
directory. The store and every directory in it must belong to the daemon's
user and be writable by no one else, and nothing in it may be a symlink, or
it is refused (``StoreError``). From then on, every operation is relative to
the store's directory descriptor with ``O_NOFOLLOW``. Who may read entries is
the mount's policy (``shared``: ``allow_other``), and the modes say the same.
The one-daemon-per-store lock lives outside the store, so removing the store's
contents cannot remove it; a store removed at runtime is noticed by ``check``
and made again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Final, NamedTuple, Protocol

from . import pagecache
from .capacity import Capacity, StoreUsage
from .catalog import Catalog
from .entry import (
    STALE,
    EntryKey,
    check_entry,
    check_entry_bytes,
    check_entry_file,
    encode_trailer,
)
from .protocol import ACCESS_SOCKET, STORE_FORMAT, STORE_MARKER, TRAILER_SIZE
from .trusted import DIRECTORY_FLAGS as _DIR
from .trusted import UntrustedPath, open_trusted_dir, owned_alone_problem

__all__ = [
    "CATALOG_FILE",
    "STALE",
    "CannotMove",
    "CorruptEntry",
    "Fingerprint",
    "Store",
    "StoreError",
    "StoreInUse",
    "StoreReadError",
    "StoreUsage",
    "StoreWriteError",
    "VerifiedEntry",
    "iter_entries",
    "lock_store",
]

log = logging.getLogger(__name__)


CATALOG_FILE: Final = ".catalog.sqlite3"
_WHOLE: Final = 1 << 20  # entries up to this size are read whole, in one read
_FINGERPRINT_FILE: Final = ".fingerprint.json"
_TMP: Final = ".tmp"
_TRASH: Final = ".trash"
_READ: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class StoreError(Exception):
    """The store cannot be used as configured (a user-fixable problem)."""


class StoreInUse(StoreError):
    """Another process holds the store's one-daemon lock (``holder_pid``: its pid, if known)."""

    def __init__(self, message: str, holder_pid: int | None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid


class StoreWriteError(Exception):
    """An entry could not be written (full, read-only, unwritable store)."""

    def __init__(self, key: EntryKey, cause: OSError) -> None:
        self.kind = errno.errorcode.get(cause.errno or 0, "OSError")
        super().__init__(f"cannot store {key}: {self.kind}: {cause.strerror or cause}")


class StoreReadError(Exception):
    """An entry exists but could not be read (I/O error, no file descriptors).

    Nothing is known about its integrity, so it is left in place.
    """

    def __init__(self, key: EntryKey, cause: OSError) -> None:
        self.kind = errno.errorcode.get(cause.errno or 0, "OSError")
        super().__init__(f"cannot read stored {key}: {self.kind}: {cause.strerror or cause}")


class CorruptEntry(Exception):
    """A stored entry failed its integrity check; it has been removed if possible."""

    def __init__(self, key: EntryKey, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.reason = reason


class CannotMove(Exception):
    """A file may not be moved into the store (``Store.move_in``); nothing was changed."""


class VerifiedEntry(NamedTuple):
    """What ``Store.verify`` found: an entry that passed every check."""

    head: bytes  # the payload's first bytes (up to 4 KiB: its .npy header)
    length: int  # the payload's length
    brought_in: bool  # pages the check read in from the disk are left in the page cache
    payload: memoryview | None = None  # the payload, if asked for and read whole
    dropped: bool = False  # the pages the check read in were dropped at once


class Fingerprint(Protocol):
    """What produced a version's payloads (decode.Fingerprint is one)."""

    @property
    def digest(self) -> bytes: ...  # 16 bytes, stored in every entry's trailer

    @property
    def hex(self) -> str: ...

    @property
    def description(self) -> Mapping[str, object]: ...


class Store:
    """Entries on flash. Methods block (call them off the event loop) and are thread-safe.

    Concurrency: callers guarantee at most one write or removal per key at a
    time (the engine's single flight). Capacity (capacity.py) has its own
    locks; ``_state_lock`` serializes open, ``check`` and close, which swap
    the directory descriptor. A descriptor is never closed while the store
    is open (an operation in another thread may still use it): one retired
    when the store was removed stays open, pointing at the removed directory,
    until ``close``.
    """

    def __init__(
        self,
        root: os.PathLike[str] | str,
        fingerprints: Mapping[str, Fingerprint],
        *,
        max_bytes: int | None = None,
        min_free_fraction: float | None = None,
        shared: bool = False,
        lock_dir: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = os.path.abspath(root)
        self._fingerprints = dict(fingerprints)
        # Who may read arrays is the mount's policy (allow_other): the modes follow it.
        self.dir_mode = 0o755 if shared else 0o700
        self.file_mode = 0o644 if shared else 0o600
        self._lock_dir = lock_dir
        self._lock_fd: int | None = None
        self._root_fd: int | None = None
        self._tmp_fd: int | None = None
        self._retired_fds: list[int] = []
        self._state_lock = threading.Lock()
        self._closing = threading.Event()
        self._filled = threading.Event()
        self._fill_thread: threading.Thread | None = None
        self.capacity = Capacity(
            max_bytes=max_bytes,
            min_free_fraction=min_free_fraction,
            statvfs=self._statvfs,
            unlink=self._unlink_entry,
            clock=clock,
        )
        self.writable = False
        self._unusable: str | None = None  # why the store made again cannot be used (logged)
        # Bumped whenever every entry may be gone at once (the store was removed):
        # whoever remembers entries as verified must forget them.
        self.generation = 0

    # -- life cycle -------------------------------------------------------------------

    def open(self) -> None:
        """Prepare the store. Raises StoreError only for what a user must fix.

        A store that cannot be created, written or even read is not an error:
        the daemon then serves from memory and says so in the log.
        """
        try:
            fd = open_trusted_dir(self.root, create_mode=self.dir_mode)
        except UntrustedPath as exc:
            raise StoreError(f"store: {exc}") from None
        except OSError as exc:
            log.error("store %s cannot be created (%s); serving from memory only", self.root, exc)
            self._attach_memory_catalog()
            return
        try:
            self._lock_fd = lock_store(fd, self._lock_dir)
            self._adopt(fd)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        self._closing.set()
        if self._fill_thread is not None:
            self._fill_thread.join()
        with contextlib.suppress(Exception):
            self.capacity.flush_accesses()
        catalog = self.capacity.detach()
        if catalog is not None:
            catalog.close()
        with self._state_lock:
            for fd in (self._root_fd, self._tmp_fd, self._lock_fd, *self._retired_fds):
                if fd is not None:
                    os.close(fd)
            self._root_fd = self._tmp_fd = self._lock_fd = None
            self._retired_fds.clear()

    def wait_for_usage(self, timeout: float = 60.0) -> StoreUsage:
        """Block until a scan filling the catalog has finished (tests, tools)."""
        self._filled.wait(timeout)
        return self.usage()

    def check(self) -> bool:
        """Notice a store removed or replaced at runtime, and make it again when it can.

        Returns True if the store's state changed (lost, or made again). Call
        it now and then, and after a write failed for a missing directory.
        """
        with self._state_lock:
            if self._closing.is_set():
                return False
            fd = self._root_fd
            if fd is not None and self._still_there(fd):
                return self._writable_again(fd)
            changed = False
            if fd is not None:
                log.error(
                    "store %s was removed or replaced while in use; serving misses from memory "
                    "until it is made again",
                    self.root,
                )
                self._lose()
                changed = True
            try:
                fresh = open_trusted_dir(self.root, create_mode=self.dir_mode)
            except (OSError, UntrustedPath) as exc:
                log.debug("store %s cannot be made again yet: %s", self.root, exc)
                return changed
            try:
                self._adopt(fresh)
            except (OSError, StoreError) as exc:
                os.close(fresh)
                self._root_fd = None
                # Logged once, not at every check for as long as it lasts.
                level = logging.DEBUG if str(exc) == self._unusable else logging.ERROR
                self._unusable = str(exc)
                log.log(level, "store %s was made again but cannot be used: %s", self.root, exc)
                return True
            self._unusable = None
            self.generation += 1
            log.warning("store %s made again (empty); storing arrays again", self.root)
            return True

    # -- entries ----------------------------------------------------------------------

    def verify(self, key: EntryKey, *, with_payload: bool = False) -> VerifiedEntry | None:
        """Check ``key``'s entry: its payload's first bytes (for its own .npy header)
        and length; None if there is none.

        An entry of up to 1 MiB is read whole, in one read (one trip to the disk);
        with ``with_payload`` its payload comes back too, for the caller to serve
        from, so the pages this read brought into the page cache are dropped at
        once. A bigger one is read in pieces, none of it held. ``brought_in`` says
        whether pages the check read in from the disk are left in the page cache
        (pagecache.py). Raises CorruptEntry (after removing the file) if the entry
        fails its check, StoreReadError if it cannot be read at all.
        """
        fd = self._root_fd
        if fd is None:
            return None
        try:
            entry = self._open_entry(key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self.remove(key)
                raise CorruptEntry(key, "a symlink, not an entry") from exc
            raise StoreReadError(key, exc) from exc
        digest = self._fingerprints[key.version].digest
        payload: memoryview | None = None
        dropped = False
        try:
            size = os.fstat(entry).st_size
            if TRAILER_SIZE <= size <= _WHOLE:
                data, brought_in = _read_noting_residency(entry, 0, size)
                checked = check_entry_bytes(key, data, digest, size)
                if with_payload and checked.problem is None:
                    payload = memoryview(data)[: checked.length]
                    if brought_in:  # served from the payload: nobody needs these pages
                        pagecache.drop(entry)
                        brought_in, dropped = False, True
            else:
                first, brought_in = _read_noting_residency(entry, 0, min(size, _WHOLE))
                del first  # the check reads it again, from the page cache
                checked = check_entry_file(entry, key, digest)
        except OSError as exc:
            raise StoreReadError(key, exc) from exc
        finally:
            os.close(entry)
        if checked.problem is not None:
            self.remove(key)
            raise CorruptEntry(key, checked.problem)
        return VerifiedEntry(checked.head, checked.length, brought_in, payload, dropped)

    def read_range(self, key: EntryKey, offset: int, length: int) -> bytes:
        """Bytes of an entry verified earlier; raises OSError if it is gone or unreadable.

        Opens the file for each call, so no descriptor outlives the request and
        an entry replaced meanwhile is read whole from its new file.
        """
        return self.read_served(key, offset, length, drop=False)[0]

    def read_cached(self, key: EntryKey, offset: int, length: int) -> bytearray | bool:
        """Bytes of an entry if its path and its pages are all in the kernel's caches;
        never waits for a device, so the event loop may call it. Else False if the
        pages were found not resident (the try started their readahead), True if it
        could not look (the path is not cached, no openat2, a tmpfs)."""
        fd = self._root_fd
        if fd is None:
            return True
        entry = pagecache.open_cached(fd, key.relpath, _READ | os.O_NOATIME)
        if entry is None:
            return True
        try:
            # Asked first: a read that misses would start the disk's work on this thread.
            if pagecache.resident(entry, offset, length) is False:
                return False
            data = pagecache.read_resident(entry, offset, length)
        except OSError:
            return True  # a tmpfs cannot tell without waiting: a worker thread reads it
        finally:
            os.close(entry)
        return False if data is None else data

    def read_served(
        self, key: EntryKey, offset: int, length: int, *, drop: bool
    ) -> tuple[bytes, bool]:
        """``read_range`` for bytes about to be served through the mount, and whether
        their pages were dropped from the page cache afterwards: if ``drop`` or if
        this read brought them in from the disk; pages someone else keeps resident
        stay (pagecache.py). Fewer bytes only if the file is shorter."""
        entry = self._open_entry(key)
        try:
            data, brought_in = _read_noting_residency(entry, offset, length)
            if drop or brought_in:
                pagecache.drop(entry, offset, length)
            return data, drop or brought_in
        finally:
            os.close(entry)

    def drop_pages(self, key: EntryKey) -> None:
        """Let the kernel drop the page cache of ``key``'s entry (pagecache.py); quietly
        nothing if it is gone."""
        try:
            entry = self._open_entry(key)
        except OSError:
            return
        try:
            pagecache.drop(entry)
        finally:
            os.close(entry)

    def write(
        self,
        key: EntryKey,
        payload: bytes | memoryview,
        *,
        may_evict: bool = True,
    ) -> None:
        """Atomically store ``payload`` for ``key``, evicting first if over a limit.

        The written pages' writeback starts at once, so that they can be dropped
        from the page cache soon (pagecache.py).
        Raises StoreWriteError: the store is full, read-only, unwritable or gone,
        or at its limit (EDQUOT) with everything left pinned or ``may_evict`` False.
        """
        root, tmp_dir = self._root_fd, self._tmp_fd
        if root is None or tmp_dir is None:
            raise StoreWriteError(key, OSError(errno.EROFS, "the store is not writable"))
        trailer = encode_trailer(key, payload, self._fingerprints[key.version].digest)
        nbytes = len(payload) + TRAILER_SIZE
        name = secrets.token_hex(8) + ".npy"
        try:
            with self.capacity.room(key, nbytes, may_evict=may_evict):
                fd = os.open(
                    name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    self.file_mode, dir_fd=tmp_dir,
                )  # fmt: skip
                try:
                    with open(fd, "wb", closefd=False) as f:
                        _set_mode(fd, self.file_mode)  # whatever the umask
                        f.write(payload)
                        f.write(trailer)
                    pagecache.start_writeback(fd)
                    shard = self._entry_dir(root, key)
                    try:
                        self.capacity.commit(
                            key,
                            nbytes,
                            lambda: os.rename(
                                name, key.file_name, src_dir_fd=tmp_dir, dst_dir_fd=shard
                            ),
                        )
                    finally:
                        os.close(shard)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=tmp_dir)
                    raise
                finally:
                    if fd >= 0:
                        os.close(fd)
        except OSError as exc:
            if exc.errno == errno.EROFS:
                self.writable = False  # check() notices when it can be written again
            raise StoreWriteError(key, exc) from exc

    def contains(self, key: EntryKey) -> bool:
        """Whether ``key`` has an entry file (not checked: ``verify`` does that)."""
        return self._exists(key)

    def move_in(
        self,
        key: EntryKey,
        directory: int,
        name: str,
        payload_length: int,
        *,
        may_evict: bool = True,
    ) -> None:
        """Make the file ``name`` in the directory open at ``directory`` the entry of
        ``key``, by appending the trailer in place and renaming it into the store:
        no copy, no second file's room on flash (``decodefs adopt``).

        The file's first ``payload_length`` bytes are the payload; a file that
        already ends with this key's valid trailer (a move interrupted before
        its rename) is taken as it is. Only a file that nobody but this user can
        change or keep a way into is moved: a regular file of this user alone
        (not a symlink), with one link, in a directory of this user alone, on
        the store's filesystem. Otherwise, or if it is not such a payload,
        CannotMove is raised and nothing is changed. Raises StoreWriteError as
        ``write`` does; the file is then as it was.
        """
        root = self._root_fd
        if root is None or self._tmp_fd is None:
            raise StoreWriteError(key, OSError(errno.EROFS, "the store is not writable"))
        digest = self._fingerprints[key.version].digest
        try:
            named = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if not stat.S_ISREG(named.st_mode):
                raise CannotMove("not a regular file")  # never opened for writing
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(name, flags, dir_fd=directory)
        except OSError as exc:
            raise CannotMove(f"cannot open it for writing: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            problem = _move_problem(st, os.fstat(directory), os.fstat(root).st_dev)
            if (st.st_dev, st.st_ino) != (named.st_dev, named.st_ino):
                problem = "replaced while being opened"
            if problem is not None:
                raise CannotMove(problem)
            nbytes = payload_length + TRAILER_SIZE
            data = _read_all(fd, st.st_size)
            trailer: bytes | None = None
            if len(data) == payload_length:
                trailer = encode_trailer(key, data, digest)
            elif len(data) != nbytes or check_entry(key, data, digest) is not None:
                raise CannotMove(f"{len(data)} bytes: not a payload of {payload_length}")
            self._move(key, fd, st, (directory, name), payload_length, trailer, may_evict)
        finally:
            os.close(fd)

    def _move(
        self,
        key: EntryKey,
        fd: int,
        st: os.stat_result,
        source: tuple[int, str],
        payload_length: int,
        trailer: bytes | None,
        may_evict: bool,
    ) -> None:
        root = self._root_fd
        assert root is not None
        directory, name = source
        try:
            with self.capacity.room(key, payload_length + TRAILER_SIZE, may_evict=may_evict):
                try:
                    if trailer is not None:
                        written = os.pwrite(fd, trailer, payload_length)
                        if written != len(trailer):
                            raise OSError(errno.ENOSPC, "the trailer was written in part")
                    _set_mode(fd, self.file_mode)
                    shard = self._entry_dir(root, key)
                    try:
                        self.capacity.commit(
                            key,
                            payload_length + TRAILER_SIZE,
                            lambda: os.rename(
                                name, f"{key.uuid}.npy", src_dir_fd=directory, dst_dir_fd=shard
                            ),
                        )
                        placed = os.stat(f"{key.uuid}.npy", dir_fd=shard, follow_symlinks=False)
                    finally:
                        os.close(shard)
                except BaseException:
                    if trailer is not None and _same_file(st, directory, name):  # not moved
                        with contextlib.suppress(OSError):
                            os.ftruncate(fd, payload_length)  # as it was
                    raise
        except OSError as exc:
            if exc.errno == errno.EROFS:
                self.writable = False
            raise StoreWriteError(key, exc) from exc
        if (placed.st_dev, placed.st_ino) != (st.st_dev, st.st_ino):
            # Another file took the name between the checks and the rename.
            self.remove(key)
            raise StoreWriteError(key, OSError(errno.EAGAIN, "the file was replaced while moved"))

    def remove(self, key: EntryKey) -> None:
        """Delete an entry (a bad one); its catalog row goes after its file."""
        try:
            self._unlink_entry(key)
        except OSError as exc:
            log.warning("cannot remove bad entry %s: %s", key, exc)
            return
        try:
            self.capacity.forget(key)
        except OSError as exc:
            log.warning("%s; its row stays in the catalog until evicted", exc)

    def cache_dir(self, name: str) -> str | None:
        """A directory in the store for a derived cache (the source index), the
        daemon's alone (0700); None if the store is not writable."""
        fd = self._root_fd
        if fd is None or not self.writable:
            return None
        directory = f".{name}"
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700, dir_fd=fd)
            sub = os.open(directory, _DIR, dir_fd=fd)
            try:
                _set_mode(sub, 0o700)  # however it was created
            finally:
                os.close(sub)
        except OSError:
            return None
        return os.path.join(self.root, directory)

    def access_socket_path(self) -> str | None:
        """Where readers may report the hits they read directly (None: nowhere)."""
        path = os.path.join(self.root, ACCESS_SOCKET)
        # A unix socket's path must fit in sun_path (108 bytes with its NUL).
        return path if self.writable and len(os.fsencode(path)) < 108 else None

    def digests(self) -> dict[str, str]:
        """version -> the fingerprint its entries must carry (hex)."""
        return {version: fp.hex for version, fp in self._fingerprints.items()}

    def fingerprint_description(self, version: str) -> Mapping[str, object]:
        return self._fingerprints[version].description

    # -- capacity, for the engine ----------------------------------------------------

    def usage(self) -> StoreUsage:
        return self.capacity.usage()

    def stored_uuids(self, version: str, size: int) -> set[str]:
        return self.capacity.stored_uuids(version, size)

    # -- internals --------------------------------------------------------------------

    def _adopt(self, fd: int, *, clean: bool = True) -> None:
        """Make the trusted directory ``fd`` this store: check it, then prepare it
        (``clean``: remove leftover temp files)."""
        self._check_tree(fd)
        self._check_marker(fd)
        self._root_fd = fd
        if self._tmp_fd is not None:
            self._retired_fds.append(self._tmp_fd)  # another thread may still use it
        self._tmp_fd = self._prepare_tmp(fd, clean=clean)
        self.writable = self._tmp_fd is not None and self._probe(self._tmp_fd)
        empty = self._open_catalog()
        if self.writable:
            for version in self._fingerprints:
                self._check_fingerprint(fd, version)  # before a fill scan sees what it discards
            self._start_trash_cleanup(fd)
        else:
            log.error(
                "store %s is not writable; hits are served from it, misses from memory", self.root
            )
        if empty:
            # A new catalog on an existing store (or a read-only store): fill it
            # from the files, in the background, while the daemon already serves.
            self._filled.clear()
            self._fill_thread = threading.Thread(
                target=self._fill, args=(fd,), name="store-catalog-fill", daemon=True
            )
            self._fill_thread.start()
        else:
            self._filled.set()

    def _writable_again(self, fd: int) -> bool:
        """A store that could not be written (read-only, full at start): if it can be now,
        prepare it again, with its catalog on disk. True if so."""
        if self.writable:
            return False
        tmp = self._prepare_tmp(fd, clean=False)
        if tmp is None:
            return False
        try:
            if not self._probe(tmp):
                return False
        finally:
            os.close(tmp)
        old = self.capacity.detach()
        if old is not None:
            with contextlib.suppress(sqlite3.Error):
                old.close()
        self._adopt(fd, clean=False)  # writes may be under way in .tmp
        log.warning("store %s can be written again; storing arrays again", self.root)
        return True

    def _lose(self) -> None:
        """The store's directory is gone: forget its entries, keep its descriptors open."""
        self.writable = False
        self.generation += 1
        catalog = self.capacity.detach()
        if catalog is not None:
            with contextlib.suppress(sqlite3.Error):
                catalog.close()
        self._retired_fds += [fd for fd in (self._root_fd, self._tmp_fd) if fd is not None]
        self._root_fd = self._tmp_fd = None

    def _still_there(self, fd: int) -> bool:
        try:
            held = os.fstat(fd)
            now = os.stat(self.root, follow_symlinks=False)
        except OSError:
            return False
        return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)

    def _attach_memory_catalog(self) -> None:
        catalog, _ = Catalog.open(":memory:")
        self.capacity.attach(catalog, filled=True)
        self._filled.set()

    def _statvfs(self) -> os.statvfs_result:
        fd = self._root_fd
        if fd is None:
            raise OSError(errno.ENOENT, "the store is gone")
        return os.fstatvfs(fd)

    def _open_entry(self, key: EntryKey) -> int:
        """``key``'s entry file open for reading, without updating its access time
        where the store's owner may ask so (no journal write for a read)."""
        fd = self._root_fd
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, "the store is gone", key.relpath)
        try:
            return os.open(key.relpath, _READ | os.O_NOATIME, dir_fd=fd)
        except PermissionError:  # O_NOATIME needs the file's owner
            return os.open(key.relpath, _READ, dir_fd=fd)

    def _unlink_entry(self, key: EntryKey) -> None:
        fd = self._root_fd
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.unlink(key.relpath, dir_fd=fd)

    def _entry_dir(self, root: int, key: EntryKey) -> int:
        """The directory of ``key``'s entry, made if missing (a descriptor to close)."""
        fd = root
        for name in (key.version, str(key.size), key.shard):
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, self.dir_mode, dir_fd=fd)
                child = os.open(name, _DIR, dir_fd=fd)
                _set_mode(child, self.dir_mode)  # whatever the umask
            finally:
                if fd != root:
                    os.close(fd)
            fd = child
        return fd

    def _check_tree(self, root: int) -> None:
        """Refuse a store that has a symlink, or a directory someone else owns or may
        write to, down to the entries' directories; give directories the policy's mode."""
        _set_mode(root, self.dir_mode)
        pending: list[tuple[int, str, int]] = [(root, "", 0)]  # (fd, relative path, depth)
        try:
            while pending:
                fd, where, depth = pending.pop()
                try:
                    with os.scandir(fd) as it:
                        names = [(e.name, e.stat(follow_symlinks=False)) for e in it]
                    for name, st in names:
                        path = f"{where}{name}"
                        if stat.S_ISLNK(st.st_mode):
                            raise StoreError(
                                f"store: {os.path.join(self.root, path)} is a symlink; nothing "
                                "in the store may be one (remove it, or use another store)"
                            )
                        if depth == 3 or not stat.S_ISDIR(st.st_mode):
                            continue  # entry files are checked when they are read
                        problem = owned_alone_problem(os.path.join(self.root, path), st)
                        if problem is not None:
                            raise StoreError(f"store: {problem}")
                        child = os.open(name, _DIR, dir_fd=fd)
                        if name not in (".index", _TMP, _TRASH):
                            _set_mode(child, self.dir_mode)
                        if name.startswith(".") or depth == 2:
                            os.close(child)  # hidden directories hold no entries
                        else:
                            pending.append((child, f"{path}/", depth + 1))
                finally:
                    if fd != root:
                        os.close(fd)
        finally:
            for fd, _, _ in pending:
                if fd != root:
                    os.close(fd)

    def _check_marker(self, root: int) -> None:
        try:
            text = _read_small(root, STORE_MARKER)
        except FileNotFoundError:
            text = b""
        except OSError as exc:
            raise StoreError(
                f"store: {os.path.join(self.root, STORE_MARKER)} is unreadable ({exc}); "
                "remove it to reuse the store"
            ) from exc
        if not text:
            # Missing, or empty as a crash soon after it was written leaves it (nothing in
            # the store is synced): it says nothing, and every entry records its format.
            with contextlib.suppress(OSError):  # a read-only store stays unmarked
                _write_json_at(root, STORE_MARKER, {"format": STORE_FORMAT}, 0o644)
            return
        try:
            recorded = json.loads(text)
        except ValueError as exc:
            raise StoreError(
                f"store: {os.path.join(self.root, STORE_MARKER)} is unreadable ({exc}); "
                "remove it to reuse the store"
            ) from exc
        fmt = recorded.get("format") if isinstance(recorded, dict) else None
        if fmt != STORE_FORMAT:
            raise StoreError(
                f"store: {self.root} has store format {fmt!r}, this decodefs writes "
                f"{STORE_FORMAT}; point `store` at another directory"
            )

    def _prepare_tmp(self, root: int, *, clean: bool) -> int | None:
        """.tmp's descriptor (None if it cannot be made or opened), emptied of
        leftovers if ``clean``."""
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(_TMP, 0o700, dir_fd=root)
            fd = os.open(_TMP, _DIR, dir_fd=root)
        except OSError as exc:
            log.debug("store %s not writable: %s", self.root, exc)
            return None
        _set_mode(fd, 0o700)
        if not clean:
            return fd
        removed = 0
        try:
            with os.scandir(fd) as it:
                leftovers = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            for name, is_dir in leftovers:
                try:
                    if is_dir:
                        shutil.rmtree(name, dir_fd=fd)
                    else:
                        os.unlink(name, dir_fd=fd)
                    removed += 1
                except OSError as exc:
                    log.warning("cannot remove leftover %s/.tmp/%s: %s", self.root, name, exc)
            if removed:
                log.info("removed %d leftover temp files from %s/.tmp", removed, self.root)
        except OSError as exc:
            log.debug("cannot empty %s/.tmp: %s", self.root, exc)
        return fd

    def _probe(self, tmp: int) -> bool:
        """Whether a file with data can be written in .tmp now."""
        # A byte of data, not just a name: a full filesystem still has inodes.
        probe = "probe-" + secrets.token_hex(4)
        try:
            probe_fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=tmp)
        except OSError as exc:
            log.debug("store %s not writable: %s", self.root, exc)
            return False
        try:
            os.write(probe_fd, b"decodefs")
        except OSError as exc:
            log.debug("store %s not writable: %s", self.root, exc)
            return False
        finally:
            os.close(probe_fd)
            with contextlib.suppress(OSError):
                os.unlink(probe, dir_fd=tmp)
        return True

    def _open_catalog(self) -> bool:
        """Open the catalog and count from it; True if a scan has to fill it."""
        path = os.path.join(self.root, CATALOG_FILE) if self.writable else ":memory:"
        try:
            catalog, empty = Catalog.open(path)
        except (sqlite3.Error, OSError) as exc:
            log.error("catalog %s cannot be used (%s); keeping one in memory", path, exc)
            catalog, empty = Catalog.open(":memory:")
        self.capacity.attach(catalog, filled=not empty)
        return empty

    def _check_fingerprint(self, root: int, version: str) -> None:
        """Discard a version's arrays if they were decoded another way.

        Only a readable marker naming another fingerprint discards anything:
        each entry carries its own fingerprint, so a missing or unreadable
        marker is simply rewritten.
        """
        expected = self._fingerprints[version]
        marker = f"{version}/{_FINGERPRINT_FILE}"
        try:
            recorded = json.loads(_read_small(root, marker))
        except (FileNotFoundError, NotADirectoryError):
            recorded = None
        except (OSError, ValueError) as exc:
            log.warning("unreadable %s/%s (%s); rewriting it", self.root, marker, exc)
            recorded = None
        if not isinstance(recorded, dict):
            recorded = None
        if recorded is not None and recorded.get("digest") == expected.hex:
            return
        try:
            if recorded is not None:
                log.warning(
                    "version %s: decode settings or libraries changed (was %s, now %s); "
                    "discarding its stored arrays",
                    version,
                    json.dumps(recorded.get("description"), sort_keys=True),
                    json.dumps(expected.description, sort_keys=True),
                )
                with contextlib.suppress(FileExistsError):
                    os.mkdir(_TRASH, 0o700, dir_fd=root)
                trash = os.open(_TRASH, _DIR, dir_fd=root)
                try:
                    os.rename(
                        version, f"{version}.{time.time_ns()}", src_dir_fd=root, dst_dir_fd=trash
                    )
                finally:
                    os.close(trash)
                catalog = self.capacity.detach()
                if catalog is not None:
                    catalog.remove_version(version)
                    self.capacity.attach(catalog, filled=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(version, self.dir_mode, dir_fd=root)
            directory = os.open(version, _DIR, dir_fd=root)
            try:
                _set_mode(directory, self.dir_mode)
                _write_json_at(
                    directory,
                    _FINGERPRINT_FILE,
                    {"digest": expected.hex, "description": dict(expected.description)},
                    0o644,
                )
            finally:
                os.close(directory)
        except (OSError, sqlite3.Error) as exc:
            # A full disk must not stop the daemon: stale entries still fail
            # their own fingerprint check and are rebuilt one by one.
            log.error(
                "version %s: cannot record its fingerprint in %s: %s", version, self.root, exc
            )

    def _start_trash_cleanup(self, root: int) -> None:
        try:
            os.stat(_TRASH, dir_fd=root, follow_symlinks=False)
        except OSError:
            return

        def cleanup() -> None:
            started = time.monotonic()
            shutil.rmtree(_TRASH, dir_fd=root, ignore_errors=True)
            log.info("deleted discarded arrays in %.1f s", time.monotonic() - started)

        threading.Thread(target=cleanup, name="store-trash", daemon=True).start()

    def _fill(self, root: int) -> None:
        started = time.monotonic()
        try:
            rows = (
                (key, st.st_size, st.st_mtime) for key, st in iter_entries(root, self._fingerprints)
            )
            if not self.capacity.fill(rows, self._closing):
                return
            self.capacity.finish_fill(self._exists, durable=self.writable)
        except (sqlite3.Error, OSError) as exc:
            log.error("cannot fill the catalog of %s: %s; usage is undercounted", self.root, exc)
            self.capacity.give_up_fill()
        finally:
            self._filled.set()
        usage = self.capacity.usage()
        log.info(
            "store %s holds %d entries, %.1f MiB (catalog filled from disk in %.1f s)",
            self.root,
            usage.entries,
            usage.bytes / 2**20,
            time.monotonic() - started,
        )

    def _exists(self, key: EntryKey) -> bool:
        fd = self._root_fd
        if fd is None:
            return False
        try:
            os.stat(key.relpath, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False
        return True


def lock_store(root: int, lock_dir: str | None = None) -> int:
    """Take the one-daemon-per-store lock of the store open at ``root``; its descriptor.

    The lock file lives outside the store (in ``lock_dir``, by default
    /run/decodefs/locks for root, else under $XDG_RUNTIME_DIR or /tmp),
    named after the store's real path, so removing the store's contents
    cannot remove it. Raises StoreError if another daemon holds it.
    """
    real = os.readlink(f"/proc/self/fd/{root}")
    directory = lock_dir or _default_lock_dir()
    try:
        dir_fd = open_trusted_dir(directory, create_mode=0o700)
    except UntrustedPath as exc:
        raise StoreError(f"lock directory: {exc}") from None
    try:
        name = hashlib.sha256(os.fsencode(real)).hexdigest()[:32] + ".lock"
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)  # fmt: skip
    finally:
        os.close(dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise StoreInUse(
            f"store: {real} is in use by another decodefs daemon"
            f"{f' (pid {holder})' if holder else ''}; give each daemon its own store",
            holder,
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, os.fsencode(f"{os.getpid()} {real}\n"))
    return fd


def _lock_holder(fd: int) -> int | None:
    """The pid the lock file's holder wrote into it ("<pid> <store>"), if it says one."""
    try:
        first = os.pread(fd, 64, 0).split(maxsplit=1)[:1]
        return int(first[0]) if first else None
    except (OSError, ValueError):
        return None


def _default_lock_dir() -> str:
    if os.geteuid() == 0:
        return "/run/decodefs/locks"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "decodefs") if runtime else f"/tmp/decodefs-{os.geteuid()}"


# -- walking the store -------------------------------------------------------------------


def iter_entries(
    root: int, versions: Mapping[str, object]
) -> Iterator[tuple[EntryKey, os.stat_result]]:
    """Every entry file in the store open at ``root`` for ``versions``, with its stat;
    no symlink is followed."""
    for version in versions:
        for size_name, size_fd in _subdirs(root, version):
            try:
                if not size_name.isdigit():
                    continue
                for shard, shard_fd in _subdirs(size_fd, None):
                    try:
                        found = list(_entry_files(shard_fd))
                    finally:
                        os.close(shard_fd)
                    for name, st in found:
                        key = EntryKey.from_store_path(version, int(size_name), shard, name)
                        if key is not None:
                            yield key, st
            finally:
                os.close(size_fd)


def _entry_files(directory: int) -> Iterator[tuple[str, os.stat_result]]:
    """(name, stat) of each regular ``*.npy`` file in ``directory``; one removed
    while being listed is skipped."""
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if entry.name.endswith(".npy") and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        yield entry.name, entry.stat(follow_symlinks=False)
    except OSError:
        return


def _subdirs(parent: int, name: str | None) -> Iterator[tuple[str, int]]:
    """(name, descriptor) of each directory in ``parent``/``name`` not starting with '.';
    the caller closes each descriptor."""
    try:
        fd = os.open(name, _DIR, dir_fd=parent) if name is not None else os.dup(parent)
    except OSError:
        return
    try:
        with os.scandir(fd) as it:
            names = [
                e.name for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            ]
        for child in names:
            try:
                yield child, os.open(child, _DIR, dir_fd=fd)
            except OSError:
                continue
    except OSError:
        return
    finally:
        os.close(fd)


def _move_problem(st: os.stat_result, directory: os.stat_result, store_device: int) -> str | None:
    """Why a file (``st``, in ``directory``) may not be moved into the store, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_dev != store_device:
        return "on another filesystem than the store"
    if st.st_nlink != 1:
        return f"{st.st_nlink} links to it"
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return f"owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}"
    if directory.st_uid != os.geteuid() or directory.st_mode & 0o022:
        return f"in a directory of uid {directory.st_uid}, mode {stat.filemode(directory.st_mode)}"
    return None


def _same_file(st: os.stat_result, directory: int, name: str) -> bool:
    """Whether ``name`` in ``directory`` is still the file ``st`` describes."""
    try:
        now = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _read_all(fd: int, length: int, start: int = 0) -> bytes:
    """Up to ``length`` bytes of ``fd`` from ``start`` (fewer if it is shorter)."""
    pieces = []
    offset = 0
    while offset < length:
        piece = os.pread(fd, length - offset, start + offset)
        if not piece:
            break
        pieces.append(piece)
        offset += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _read_noting_residency(fd: int, offset: int, length: int) -> tuple[bytes, bool]:
    """Up to ``length`` bytes of ``fd`` from ``offset``, and whether this read brought
    any of them in from the disk (not all were resident; where the kernel cannot
    say, its first try, which waits for nothing, fell short); a filesystem that
    cannot tell (tmpfs) brings nothing in."""
    known = pagecache.resident(fd, offset, length)
    if known is not None:
        return _read_all(fd, length, offset), not known
    try:
        resident = pagecache.read_resident(fd, offset, length)
    except OSError as exc:
        if not pagecache.nowait_unsupported(exc):
            raise
        return _read_all(fd, length, offset), False
    if resident is not None:
        return bytes(resident), False
    return _read_all(fd, length, offset), True


def _read_small(root: int, relpath: str) -> bytes:
    fd = os.open(relpath, _READ, dir_fd=root)
    with open(fd, "rb") as f:
        return f.read(1 << 20)


def _write_json_at(directory: int, name: str, value: object, mode: int) -> None:
    tmp = f"{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                 dir_fd=directory)  # fmt: skip
    try:
        with open(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=directory)
        raise


def _set_mode(fd: int, mode: int) -> None:
    """Give ``fd`` the permission bits ``mode`` (a read-only store keeps what it has)."""
    if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
        try:
            os.fchmod(fd, mode)
        except OSError as exc:
            log.debug("cannot set mode %o: %s", mode, exc)
