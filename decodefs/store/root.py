"""The store's directory and its life: open it trusted, check it, lose it, make it again.

The store is opened once, by a walk from ``/`` that trusts only directories of
root or the daemon's user that nobody else may write to (trusted.py); a missing
store is made with ``mkdir``. It and every directory in it must belong to the
daemon's user and be writable by no one else, and nothing in it may be a
symlink, or it is refused (``StoreError``). From then on, every operation is
relative to its directory descriptor with ``O_NOFOLLOW``. The one-daemon lock
lives outside the store, so removing its contents cannot remove the lock; a
store removed at runtime is noticed by ``check`` and made again. This module
knows the store's directories, its format marker and ``.tmp``; not entries'
contents, the catalog or fingerprints (the store wires those in through
``attach`` and ``detach``).
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
import stat
import threading
from collections.abc import Callable
from typing import Final

from ..common import runtime
from ..common.entry import EntryKey
from ..common.protocol import STORE_FORMAT, STORE_MARKER
from ..common.trusted import (
    CREATE_FLAGS,
    DIRECTORY_FLAGS,
    READ_FLAGS,
    UntrustedPath,
    open_trusted_dir,
    owned_alone_problem,
)

__all__ = [
    "HIDDEN_DIRS",
    "StoreError",
    "StoreInUse",
    "StoreRoot",
    "lock_store",
    "read_all",
    "read_small",
    "set_file_mode",
    "set_mode",
    "temp_name",
    "write_json_at",
]

log = logging.getLogger(__name__)

TMP: Final = ".tmp"
# Which temp files a store's new user removes: all (it took the lock afresh), or those
# whose writer is gone (the lock was handed over by a process that may still write).
CLEAN_ALL: Final = "all"
CLEAN_GONE_WRITERS: Final = "gone writers"
HIDDEN_DIRS: Final = (".index", TMP, ".trash")  # the daemon's alone (0700), whatever the policy


class StoreError(Exception):
    """The store cannot be used as configured (a user-fixable problem)."""


class StoreInUse(StoreError):
    """Another process holds the store's one-daemon lock (``holder_pid``: its pid, if known)."""

    def __init__(self, message: str, holder_pid: int | None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid


class StoreRoot:
    """The store's directory descriptor, its ``.tmp`` and whether it can be written.

    ``attach(fd, writable)`` runs each time a directory becomes the store (at
    open, made again, writable again), ``detach()`` each time the store's
    contents can no longer be counted on (lost, or about to be attached again),
    ``gone()`` each time every entry may be gone at once (lost, made again).
    Concurrency: ``_state_lock`` serializes ``open``, ``check`` and ``close``,
    which swap the descriptors. A descriptor is never closed while the store is
    open (an operation in another thread may still use it): one retired when
    the store was removed stays open, pointing at the removed directory, until
    ``close``.
    """

    def __init__(
        self,
        path: os.PathLike[str] | str,
        *,
        dir_mode: int,
        file_mode: int,
        lock_dir: str | None,
        attach: Callable[[int, bool], None],
        detach: Callable[[], None],
        gone: Callable[[], None],
    ) -> None:
        self.path = os.path.abspath(path)
        self.dir_mode = dir_mode
        self.file_mode = file_mode
        self._lock_dir = lock_dir
        self._attach = attach
        self._detach = detach
        self._gone = gone
        self.fd: int | None = None
        self.tmp_fd: int | None = None
        self._lock_fd: int | None = None
        self._retired_fds: list[int] = []
        self._state_lock = threading.Lock()
        self.closing = threading.Event()
        self.writable = False
        self.lock_taken = False  # by this process (not handed over by an earlier one)
        self._unusable: str | None = None  # why the store made again cannot be used (logged)

    def open(self, held_lock: int | None = None, owner: int | None = None) -> bool:
        """Open (or make) the store and take its lock; False if it cannot be created or
        opened at all (the daemon then serves from memory). Raises StoreError only
        for what a user must fix.

        ``held_lock``: the lock of an earlier serving process of the same mount, which
        may still be finishing its writes: if it is this store's, it is shared (the
        descriptor is the store's now) and only the temp files of writers that are
        gone are removed; if not (the config names another store now), it is closed.
        ``owner``: the pid the lock file names (default: this process's; a mount's
        holder, which outlives its serving processes)."""
        try:
            fd = open_trusted_dir(self.path, create_mode=self.dir_mode)
        except UntrustedPath as exc:
            raise StoreError(f"store: {exc}") from None
        except OSError as exc:
            log.error("store %s cannot be created (%s); serving from memory only", self.path, exc)
            return False
        try:
            handed_over = held_lock is not None and _is_lock_of(held_lock, fd, self._lock_dir)
            if handed_over:
                self._lock_fd, held_lock = held_lock, None
                self.lock_taken = False
            else:
                self._lock_fd = lock_store(fd, self._lock_dir, owner)
                self.lock_taken = True
            self._adopt(fd, clean=CLEAN_GONE_WRITERS if handed_over else CLEAN_ALL)
        except BaseException:
            os.close(fd)
            raise
        finally:
            if held_lock is not None:
                os.close(held_lock)
        return True

    @property
    def lock_fd(self) -> int | None:
        """The descriptor of the store's lock (to hand to the next serving process)."""
        return self._lock_fd

    def close(self) -> None:
        """Close every descriptor (after ``closing`` is set and the store's threads ended)."""
        with self._state_lock:
            for fd in (self.fd, self.tmp_fd, self._lock_fd, *self._retired_fds):
                if fd is not None:
                    os.close(fd)
            self.fd = self.tmp_fd = self._lock_fd = None
            self._retired_fds.clear()

    def check(self) -> bool:
        """Notice a store removed or replaced at runtime, and make it again when it can.

        Returns True if the store's state changed (lost, or made again).
        """
        with self._state_lock:
            if self.closing.is_set():
                return False
            fd = self.fd
            if fd is not None and self._still_there(fd):
                return self._writable_again(fd)
            changed = False
            if fd is not None:
                log.error(
                    "store %s was removed or replaced while in use; serving misses from memory "
                    "until it is made again",
                    self.path,
                )
                self._lose()
                changed = True
            try:
                fresh = open_trusted_dir(self.path, create_mode=self.dir_mode)
            except (OSError, UntrustedPath) as exc:
                log.debug("store %s cannot be made again yet: %s", self.path, exc)
                return changed
            try:
                self._adopt(fresh)
            except (OSError, StoreError) as exc:
                os.close(fresh)
                self.fd = None
                # Logged once, not at every check for as long as it lasts.
                level = logging.DEBUG if str(exc) == self._unusable else logging.ERROR
                self._unusable = str(exc)
                log.log(level, "store %s was made again but cannot be used: %s", self.path, exc)
                return True
            self._unusable = None
            self._gone()
            log.warning("store %s made again (empty); storing arrays again", self.path)
            return True

    def statvfs(self) -> os.statvfs_result:
        fd = self.fd
        if fd is None:
            raise OSError(errno.ENOENT, "the store is gone")
        return os.fstatvfs(fd)

    def entry_dir(self, root: int, key: EntryKey) -> int:
        """The directory of ``key``'s entry under ``root``, made if missing (a
        descriptor to close)."""
        fd = root
        for name in (key.version, str(key.size), key.shard):
            try:
                child = os.open(name, DIRECTORY_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, self.dir_mode, dir_fd=fd)
                child = os.open(name, DIRECTORY_FLAGS, dir_fd=fd)
                set_mode(child, self.dir_mode)  # whatever the umask
            finally:
                if fd != root:
                    os.close(fd)
            fd = child
        return fd

    def exists(self, relpath: str) -> bool:
        fd = self.fd
        if fd is None:
            return False
        try:
            os.stat(relpath, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False
        return True

    # -- internals --------------------------------------------------------------------

    def _adopt(self, fd: int, *, clean: str | None = CLEAN_ALL) -> None:
        """Make the trusted directory ``fd`` the store: check it, then prepare it
        (``clean``: which leftover temp files to remove), then attach what lives in it."""
        self._check_tree(fd)
        self._check_marker(fd)
        self.fd = fd
        if self.tmp_fd is not None:
            self._retired_fds.append(self.tmp_fd)  # another thread may still use it
        self.tmp_fd = self._prepare_tmp(fd, clean=clean)
        self.writable = self.tmp_fd is not None and self._probe(self.tmp_fd)
        if not self.writable:
            log.error(
                "store %s is not writable; hits are served from it, misses from memory", self.path
            )
        self._attach(fd, self.writable)

    def _writable_again(self, fd: int) -> bool:
        """A store that could not be written (read-only, full at start): if it can be now,
        prepare it again. True if so."""
        if self.writable:
            return False
        tmp = self._prepare_tmp(fd, clean=None)
        if tmp is None:
            return False
        try:
            if not self._probe(tmp):
                return False
        finally:
            os.close(tmp)
        self._detach()
        self._adopt(fd, clean=None)  # writes may be under way in .tmp
        log.warning("store %s can be written again; storing arrays again", self.path)
        return True

    def _lose(self) -> None:
        """The store's directory is gone: forget its entries, keep its descriptors open."""
        self.writable = False
        self._gone()
        self._detach()
        self._retired_fds += [fd for fd in (self.fd, self.tmp_fd) if fd is not None]
        self.fd = self.tmp_fd = None

    def _still_there(self, fd: int) -> bool:
        try:
            held = os.fstat(fd)
            now = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)

    def _check_tree(self, root: int) -> None:
        """Refuse a store that has a symlink, or a directory someone else owns or may
        write to, down to the entries' directories; give directories the policy's mode."""
        set_mode(root, self.dir_mode)
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
                                f"store: {os.path.join(self.path, path)} is a symlink; nothing "
                                "in the store may be one (remove it, or use another store)"
                            )
                        if depth == 3 or not stat.S_ISDIR(st.st_mode):
                            continue  # entry files are checked when they are read
                        problem = owned_alone_problem(os.path.join(self.path, path), st)
                        if problem is not None:
                            raise StoreError(f"store: {problem}")
                        child = os.open(name, DIRECTORY_FLAGS, dir_fd=fd)
                        if name not in HIDDEN_DIRS:
                            set_mode(child, self.dir_mode)
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
            text = read_small(root, STORE_MARKER)
        except FileNotFoundError:
            text = b""
        except OSError as exc:
            raise StoreError(
                f"store: {os.path.join(self.path, STORE_MARKER)} is unreadable ({exc}); "
                "remove it to reuse the store"
            ) from exc
        if not text:
            # Missing, or empty as a crash soon after it was written leaves it (nothing in
            # the store is synced): it says nothing, and every entry records its format.
            with contextlib.suppress(OSError):  # a read-only store stays unmarked
                write_json_at(root, STORE_MARKER, {"format": STORE_FORMAT}, self.file_mode)
            return
        try:
            recorded = json.loads(text)
        except ValueError as exc:
            raise StoreError(
                f"store: {os.path.join(self.path, STORE_MARKER)} is unreadable ({exc}); "
                "remove it to reuse the store"
            ) from exc
        fmt = recorded.get("format") if isinstance(recorded, dict) else None
        if fmt != STORE_FORMAT:
            raise StoreError(
                f"store: {self.path} has store format {fmt!r}, this decodefs writes "
                f"{STORE_FORMAT}; point `store` at another directory"
            )
        set_file_mode(root, STORE_MARKER, self.file_mode)  # the policy may have changed

    def _prepare_tmp(self, root: int, *, clean: str | None) -> int | None:
        """.tmp's descriptor (None if it cannot be made or opened), emptied of
        leftovers: all of them (CLEAN_ALL), those of writers no longer running
        (CLEAN_GONE_WRITERS: an earlier serving process may still be writing), or none."""
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(TMP, 0o700, dir_fd=root)
            fd = os.open(TMP, DIRECTORY_FLAGS, dir_fd=root)
        except OSError as exc:
            log.debug("store %s not writable: %s", self.path, exc)
            return None
        set_mode(fd, 0o700)
        if clean is None:
            return fd
        removed = 0
        try:
            with os.scandir(fd) as it:
                leftovers = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            if clean == CLEAN_GONE_WRITERS:
                leftovers = [(n, d) for n, d in leftovers if not _writer_running(n)]
            for name, is_dir in leftovers:
                try:
                    if is_dir:
                        shutil.rmtree(name, dir_fd=fd)
                    else:
                        os.unlink(name, dir_fd=fd)
                    removed += 1
                except OSError as exc:
                    log.warning("cannot remove leftover %s/.tmp/%s: %s", self.path, name, exc)
            if removed:
                log.info("removed %d leftover temp files from %s/.tmp", removed, self.path)
        except OSError as exc:
            log.debug("cannot empty %s/.tmp: %s", self.path, exc)
        return fd

    def _probe(self, tmp: int) -> bool:
        """Whether a file with data can be written in .tmp now."""
        # A byte of data, not just a name: a full filesystem still has inodes.
        probe = "probe-" + secrets.token_hex(4)
        try:
            probe_fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=tmp)
        except OSError as exc:
            log.debug("store %s not writable: %s", self.path, exc)
            return False
        try:
            os.write(probe_fd, b"decodefs")
        except OSError as exc:
            log.debug("store %s not writable: %s", self.path, exc)
            return False
        finally:
            os.close(probe_fd)
            with contextlib.suppress(OSError):
                os.unlink(probe, dir_fd=tmp)
        return True


# -- the one-daemon lock ------------------------------------------------------------------


def lock_store(root: int, lock_dir: str | None = None, owner: int | None = None) -> int:
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
        name = _lock_name(root)
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
    os.write(fd, os.fsencode(f"{owner or os.getpid()} {real}\n"))
    return fd


def temp_name(suffix: str) -> str:
    """A temp file's name in .tmp: its writer's pid first, so that a serving process
    that takes the store over from another removes only what dead writers left."""
    return f"{os.getpid()}-{secrets.token_hex(8)}{suffix}"


def _writer_running(name: str) -> bool:
    pid, dash, _ = name.partition("-")
    if not dash or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_lock_of(lock: int, root: int, lock_dir: str | None) -> bool:
    """Whether the descriptor ``lock`` is the lock file of the store open at ``root``."""
    directory = lock_dir or _default_lock_dir()
    try:
        named = os.stat(os.path.join(directory, _lock_name(root)), follow_symlinks=False)
        held = os.fstat(lock)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _lock_name(root: int) -> str:
    real = os.readlink(f"/proc/self/fd/{root}")
    return hashlib.sha256(os.fsencode(real)).hexdigest()[:32] + ".lock"


def _lock_holder(fd: int) -> int | None:
    """The pid the lock file's holder wrote into it ("<pid> <store>"), if it says one."""
    try:
        first = os.pread(fd, 64, 0).split(maxsplit=1)[:1]
        return int(first[0]) if first else None
    except (OSError, ValueError):
        return None


def _default_lock_dir() -> str:
    return runtime.lock_dir()


# -- small files in the store -------------------------------------------------------------


def read_small(root: int, relpath: str) -> bytes:
    """Up to 1 MiB of the file ``relpath`` under ``root`` (a marker), no symlink followed."""
    fd = os.open(relpath, READ_FLAGS, dir_fd=root)
    with open(fd, "rb") as f:
        return f.read(1 << 20)


def read_all(fd: int, length: int, start: int = 0) -> bytes:
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


def write_json_at(directory: int, name: str, value: object, mode: int) -> None:
    """Replace ``name`` in ``directory`` with ``value`` as JSON, with ``mode``, atomically."""
    tmp = f"{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | CREATE_FLAGS, mode, dir_fd=directory)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            set_mode(f.fileno(), mode)  # whatever the umask
            json.dump(value, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=directory)
        raise


def set_file_mode(directory: int, name: str, mode: int, *, create: bool = False) -> None:
    """Give the file ``name`` in ``directory`` the permission bits ``mode`` (``create``:
    an empty one if missing); quietly nothing if it is missing or cannot be changed."""
    flags = READ_FLAGS | os.O_NONBLOCK  # a FIFO planted under the name must not block
    try:
        fd = os.open(name, flags | (os.O_CREAT if create else 0), mode, dir_fd=directory)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            set_mode(fd, mode)
    finally:
        os.close(fd)


def set_mode(fd: int, mode: int) -> None:
    """Give ``fd`` the permission bits ``mode`` (a read-only store keeps what it has)."""
    if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
        try:
            os.fchmod(fd, mode)
        except OSError as exc:
            log.debug("cannot set mode %o: %s", mode, exc)
