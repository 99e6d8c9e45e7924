"""The store's entries on flash: the API every other layer uses (``Store``).

Layout::

    <store>/.decodefs-store           format marker (root.py)
    <store>/.catalog.sqlite3          sizes and last access of entries (catalog.py)
    <store>/.index/<version>.json     the cached source index (source.py)
    <store>/.access.sock              readers report the hits they read directly
    <store>/.tmp/                     temp files, emptied at start (root.py)
    <store>/.trash/                   discarded versions, deleted in the background
    <store>/<version>/.fingerprint.json                (fingerprints.py)
    <store>/<version>/<size>/<uuid[:2]>/<uuid>.npy     (entry.py: the file format)
    <store>/<version>/<size>/%<hh>/<escaped key>.npy   a key with "/" (entry.py)

Writes go to ``.tmp`` and are renamed into place: a crash leaves no entry or a
whole one. There is no fsync, because a torn entry after a power cut fails its
check and is rebuilt rather than served. The rooms behind this one: the
directory's life and safety in root.py, fingerprint markers and the trash
in fingerprints.py, usage, the catalog fill and eviction in capacity.py, the
in-place move of ``adopt --move`` in movein.py, the file format and its one
check in entry.py. Who may read entries is the mount's policy (``access``), and
every file's and directory's mode says the same: "owner", the daemon's alone
(0700/0600); "everyone", all (0755/0644); "originals", directories that anyone
may pass but no one else list (0711), files of the daemon's alone (0600) but
entries, each no more readable than its original (entry_modes.py). This
module knows nothing of images, decoding or FUSE.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Final, NamedTuple

from ..common.entry import (
    EntryKey,
    Verdict,
    check_entry,
    check_entry_file,
    encode_trailer,
)
from ..common.fingerprint import Fingerprint
from ..common.protocol import ACCESS_SOCKET, TRAILER_SIZE
from ..common.readers import Readers
from ..common.trusted import CREATE_FLAGS
from ..common.trusted import DIRECTORY_FLAGS as _DIR
from ..common.trusted import READ_FLAGS as _READ
from . import movein, pagecache
from .capacity import Capacity, SizeUsage, StoreUsage
from .catalog import Catalog
from .changes import ChangeToken
from .entry_modes import EntryModes
from .fingerprints import Discarded, check_fingerprint, recorded_digest, start_trash_cleanup
from .flights import FlightClaims
from .movein import CannotMove
from .root import (
    StoreError,
    StoreInUse,
    StoreRoot,
    lock_store,
    read_all,
    read_small,
    set_file_mode,
    set_mode,
    temp_name,
    write_json_at,
)
from .walk import iter_entries

if TYPE_CHECKING:
    from ..common.config import Config

__all__ = [
    "CATALOG_FILE",
    "CannotMove",
    "CorruptEntry",
    "Discarded",
    "Fingerprint",
    "SizeUsage",
    "Store",
    "StoreError",
    "StoreInUse",
    "StoreReadError",
    "StoreUsage",
    "StoreWriteError",
    "VerifiedEntry",
    "lock_store",
]

log = logging.getLogger(__name__)


CATALOG_FILE: Final = ".catalog.sqlite3"
# Present while the store's entries are given modes by access = "originals" (JSON).
ACCESS_MARKER: Final = ".access.json"
_DIR_MODES: Final = {"owner": 0o700, "everyone": 0o755, "originals": 0o711}
_WHOLE: Final = 1 << 20  # entries up to this size are read whole, in one read
_SHARE_BY_WALK: Final = 4096  # share_all walks the store for more keys than this


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
    """A stored entry failed its check (``verdict``: not OK); it has been removed if possible."""

    def __init__(self, key: EntryKey, reason: str, verdict: Verdict) -> None:
        super().__init__(f"{key}: {reason}")
        self.reason = reason
        self.verdict = verdict


class VerifiedEntry(NamedTuple):
    """What ``Store.verify`` found: an entry that passed every check."""

    length: int  # the payload's length
    brought_in: bool  # pages the check read in from the disk are left in the page cache
    payload: memoryview | None = None  # the payload, if asked for and read whole
    dropped: bool = False  # the pages the check read in were dropped at once


class Store:
    """Entries on flash. Methods block (call them off the event loop) and are thread-safe;
    ``open_cached`` never waits. Pins, accesses and evictions are ``capacity``'s
    (capacity.py: pins are the event loop's alone). What to do with the page
    cache is the reader's to decide (daemon/entry_reads.py); the store only says
    what a check read in.

    Concurrency: callers guarantee at most one write or removal per key at a
    time (the engine's single flight). Capacity (capacity.py) has its own
    locks; the root (root.py) serializes open, ``check`` and close.
    """

    def __init__(
        self,
        root: os.PathLike[str] | str,
        fingerprints: Mapping[str, Fingerprint],
        *,
        max_bytes: int | None = None,
        min_free_fraction: float | None = None,
        access: str = "owner",
        lock_dir: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._fingerprints = dict(fingerprints)
        # Who may read arrays is the mount's policy (config.Access): the modes follow it.
        self.access = access
        self.dir_mode = _DIR_MODES[access]
        self.file_mode = 0o644 if access == "everyone" else 0o600
        self._entry_modes = EntryModes(access)
        # access = "originals": who may read the original of an entry (the daemon's
        # sources, once scanned; None, or a key it does not know: the daemon alone).
        self.readers: Callable[[EntryKey], Readers | None] | None = None
        self._root = StoreRoot(
            root,
            dir_mode=self.dir_mode,
            file_mode=self.file_mode,
            lock_dir=lock_dir,
            attach=self._attach,
            detach=self._detach,
            gone=self._gone,
        )
        # Bumped whenever every entry may be gone at once (the store was removed):
        # whoever remembers entries as verified must forget them.
        self.generation = 0
        self._handed_over = False  # the lock came from an earlier serving process
        self.unsettled: list[str] = []  # versions to discard once it serves no more
        # Claims of keys being decoded, among the processes using this store (flights.py).
        self.flights = FlightClaims(None)
        # Rewritten after any entry file is unlinked, replaced or given other readers.
        self.changes = ChangeToken()
        # Versions whose stored arrays were made by another fingerprint, discarded at open
        # (or, after a handover, once the serving process before is gone).
        self.discarded: dict[str, Discarded] = {}
        self.root = self._root.path
        self.capacity = Capacity(
            max_bytes=max_bytes,
            min_free_fraction=min_free_fraction,
            statvfs=self._root.statvfs,
            unlink=self._unlink_entry,
            clock=clock,
        )

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        lock_dir: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Store:
        """The store a config names, with its versions' fingerprints, limits and mode
        policy: the one way the daemon, adopt and the tests build it (``lock_dir``:
        elsewhere than the machine's, for tests)."""
        return cls(
            config.store,
            config.fingerprints(),
            max_bytes=config.max_store_bytes,
            min_free_fraction=config.min_free_fraction,
            access=config.access,
            lock_dir=lock_dir,
            clock=clock,
        )

    @property
    def writable(self) -> bool:
        return self._root.writable

    @writable.setter
    def writable(self, value: bool) -> None:
        self._root.writable = value

    # -- life cycle -------------------------------------------------------------------

    def open(self, held_lock: int | None = None, owner: int | None = None) -> None:
        """Prepare the store. Raises StoreError only for what a user must fix.

        A store that cannot be created, written or even read is not an error:
        the daemon then serves from memory and says so in the log.

        ``held_lock``: the store lock of the mount's earlier serving process (root.py),
        which may still serve: a version whose decode settings changed is then not
        discarded yet, but once this process serves alone (``settle_versions``).
        ``owner``: the pid the lock names (a mount's holder; default: this process).
        """
        self._handed_over = held_lock is not None
        if not self._root.open(held_lock, owner):
            catalog, _ = Catalog.open(":memory:")
            self.capacity.attach(catalog, filled=True)
        self._handed_over = self._handed_over and not self._root.lock_taken
        self.flights = FlightClaims.beside(self.lock_fd)

    @property
    def lock_fd(self) -> int | None:
        """The store's lock, to hand to the mount's next serving process."""
        return self._root.lock_fd

    @property
    def lock_taken(self) -> bool:
        """Whether this process took the lock (not handed it by an earlier one)."""
        return self._root.lock_taken

    def settle_versions(self) -> list[str]:
        """Discard the arrays of versions whose decode settings changed, held back while
        an earlier serving process of the mount still served them; those versions."""
        fd = self._root.fd
        pending, self.unsettled = self.unsettled, []
        if fd is None or not self.writable:
            return []
        for version in pending:
            self._check_fingerprint(fd, version)
        return pending

    def close(self) -> None:
        self._root.closing.set()
        self.capacity.stop_filling()
        with contextlib.suppress(Exception):
            self.capacity.flush_accesses()
        catalog = self.capacity.detach()
        if catalog is not None:
            catalog.close()
        self.flights.close()
        self.changes.close()
        self._root.close()

    def wait_for_usage(self, timeout: float = 60.0) -> StoreUsage:
        """Block until a scan filling the catalog has finished (tests, tools)."""
        self.capacity.wait_filled(timeout)
        return self.usage()

    def check(self) -> bool:
        """Notice a store removed or replaced at runtime, and make it again when it can
        (root.py). Returns True if the store's state changed (lost, or made
        again). Call it now and then, and after a write failed for a missing directory.
        """
        return self._root.check()

    # -- entries ----------------------------------------------------------------------

    def verify(self, key: EntryKey, *, with_payload: bool = False) -> VerifiedEntry | None:
        """Check ``key``'s entry (entry.check_entry: trailer, fingerprint, length,
        checksum, .npy layout): its payload's length; None if there is none.

        An entry of up to 1 MiB is read whole, in one read (one trip to the disk);
        with ``with_payload`` its payload comes back too, for the caller to serve
        from, so the pages this read brought into the page cache are dropped at
        once. A bigger one is read in pieces, none of it held. ``brought_in`` says
        whether pages the check read in from the disk are left in the page cache
        (pagecache.py). Raises CorruptEntry (after removing the file) if the entry
        fails its check, StoreReadError if it cannot be read at all.
        """
        if self._root.fd is None:
            return None
        try:
            entry = self.open_entry(key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self.remove(key)
                raise CorruptEntry(key, "a symlink, not an entry", Verdict.CORRUPT) from exc
            raise StoreReadError(key, exc) from exc
        digest = self.digest(key.version)
        payload: memoryview | None = None
        dropped = False
        try:
            size = os.fstat(entry).st_size
            if TRAILER_SIZE <= size <= _WHOLE:
                data, brought_in = pagecache.read_noting_residency(entry, 0, size)
                checked = check_entry(key, data, digest, size)
                if with_payload and checked.ok:
                    payload = memoryview(data)[: checked.length]
                    if brought_in:  # served from the payload: nobody needs these pages
                        pagecache.drop(entry)
                        brought_in, dropped = False, True
            else:
                first, brought_in = pagecache.read_noting_residency(entry, 0, min(size, _WHOLE))
                del first  # the check reads it again, from the page cache
                checked = check_entry_file(entry, key, digest)
            if checked.ok:  # before it is first served: a policy or an original changed
                self._give_readers(entry, key)
        except OSError as exc:
            raise StoreReadError(key, exc) from exc
        finally:
            os.close(entry)
        if not checked.ok:
            self.remove(key)
            raise CorruptEntry(key, checked.reason, checked.verdict)
        return VerifiedEntry(checked.length, brought_in, payload, dropped)

    def share(self, key: EntryKey) -> bool:
        """Give ``key``'s entry, if there is one, the mode its original's readers call for
        now (they changed); False if there is none or it cannot be changed."""
        try:
            entry = self.open_entry(key)
        except OSError:
            return False
        try:
            self._give_readers(entry, key)
        finally:
            os.close(entry)
            self.changes.note()
        return True

    def share_all(self, version: str, sizes: Collection[int], keys: Collection[str]) -> int:
        """``share`` the entries of ``keys`` of ``version`` at ``sizes`` that the store
        has; how many. Many keys (a first start's every original) are matched against one
        walk of the version's entries, not opened one by one at each size (370k originals
        at 3 sizes: ~10 s of failed opens)."""
        root = self._root.fd
        if len(keys) * len(sizes) > _SHARE_BY_WALK and root is not None:
            wanted = set(keys)
            there = [
                key
                for key, _ in iter_entries(root, {version: None})
                if key.size in sizes and key.key in wanted
            ]
        else:
            there = [EntryKey(version, size, key) for key in keys for size in sizes]
        return sum(self.share(key) for key in there)

    def _give_readers(self, fd: int, key: EntryKey) -> None:
        """The policy's mode for the entry open at ``fd`` (a read-only store keeps its own)."""
        if not self.writable:
            return
        readers = self.readers(key) if self.readers is not None else None
        try:
            if self._entry_modes.apply(fd, readers):
                log.debug("%s: mode set for its readers %s", key, readers)
        except OSError as exc:
            log.warning("cannot give %s its original's readers: %s", key, exc)

    def read_range(self, key: EntryKey, offset: int, length: int) -> bytes:
        """Bytes of an entry verified earlier; raises OSError if it is gone or unreadable.

        Opens the file for each call, so no descriptor outlives the request and
        an entry replaced meanwhile is read whole from its new file.
        """
        entry = self.open_entry(key)
        try:
            return read_all(entry, length, offset)
        finally:
            os.close(entry)

    def open_entry(self, key: EntryKey) -> int:
        """``key``'s entry file open for reading, without updating its access time
        where the store's owner may ask so (no journal write for a read). Raises
        OSError (FileNotFoundError if the store or the entry is gone)."""
        fd = self._root.fd
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, "the store is gone", key.relpath)
        try:
            return os.open(key.relpath, _READ | os.O_NOATIME, dir_fd=fd)
        except PermissionError:  # O_NOATIME needs the file's owner
            return os.open(key.relpath, _READ, dir_fd=fd)

    def open_cached(self, key: EntryKey) -> int | None:
        """``open_entry`` if every name on the entry's path is in the kernel's caches,
        else None: never waits for a device, so the event loop may call it."""
        fd = self._root.fd
        if fd is None:
            return None
        return pagecache.open_cached(fd, key.relpath, _READ | os.O_NOATIME)

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
        tmp_dir = self._root.tmp_fd
        if self._root.fd is None or tmp_dir is None:
            raise StoreWriteError(key, OSError(errno.EROFS, "the store is not writable"))
        trailer = encode_trailer(key, payload, self.digest(key.version))
        name = temp_name(".npy")
        flags = os.O_RDWR | CREATE_FLAGS
        try:
            fd = os.open(name, flags, self.file_mode, dir_fd=tmp_dir)
        except OSError as exc:
            raise self._write_error(key, exc) from exc

        def fill() -> None:
            with open(fd, "wb", closefd=False) as f:
                f.write(payload)
                f.write(trailer)
            pagecache.start_writeback(fd)

        try:
            self.place(
                key, len(payload) + TRAILER_SIZE, fd, (tmp_dir, name), may_evict=may_evict,
                prepare=fill,
            )  # fmt: skip
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=tmp_dir)
            raise
        finally:
            os.close(fd)

    def place(
        self,
        key: EntryKey,
        nbytes: int,
        fd: int,
        source: tuple[int, str],
        *,
        may_evict: bool,
        prepare: Callable[[], None],
    ) -> None:
        """Make the file open at ``fd``, named ``source`` (a directory descriptor and a
        name on the store's filesystem), ``key``'s entry of ``nbytes``: with room held
        (evicting first if a limit needs it and ``may_evict``), ``prepare()`` writes
        it, it gets the policy's mode, its catalog row is committed, and it is
        renamed to the key's path (``write`` and ``move_in`` both place this way).
        Raises StoreWriteError."""
        root = self._root.fd
        if root is None:
            raise StoreWriteError(key, OSError(errno.EROFS, "the store is not writable"))
        directory, name = source
        try:
            with self.capacity.room(key, nbytes, may_evict=may_evict):
                prepare()
                readers = self.readers(key) if self.readers is not None else None
                self._entry_modes.apply(fd, readers)  # whatever the umask
                shard = self._root.entry_dir(root, key)
                replacing = self._root.exists(key.relpath)  # one write per key at a time
                try:
                    self.capacity.commit(
                        key,
                        nbytes,
                        lambda: os.rename(
                            name, key.file_name, src_dir_fd=directory, dst_dir_fd=shard
                        ),
                    )
                finally:
                    os.close(shard)
                    if replacing:
                        self.changes.note()
        except OSError as exc:
            raise self._write_error(key, exc) from exc

    def contains(self, key: EntryKey) -> bool:
        """Whether ``key`` has an entry file (not checked: ``verify`` does that)."""
        return self._root.exists(key.relpath)

    def entry_stat(self, key: EntryKey) -> os.stat_result | None:
        """The stat of ``key``'s entry file (not followed), None if there is none."""
        fd = self._root.fd
        if fd is None:
            return None
        try:
            return os.stat(key.relpath, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None

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
        no copy, no second file's room on flash (``decodefs adopt``; movein.py).

        The file's first ``payload_length`` bytes are the payload; a file that
        already ends with this key's valid trailer (a move interrupted before
        its rename) is taken as it is. Only a file of this user alone on the
        store's filesystem is moved (movein.py); otherwise, or if it is not
        such a payload, CannotMove is raised and nothing is changed. Raises
        StoreWriteError as ``write`` does; the file is then as it was.
        """
        if not movein.move_in(self, key, directory, name, payload_length, may_evict=may_evict):
            # Another file took the name between the checks and the rename.
            self.remove(key)
            raise StoreWriteError(key, OSError(errno.EAGAIN, "the file was replaced while moved"))

    def device(self, key: EntryKey) -> int:
        """The store's filesystem (``st_dev``); StoreWriteError if it cannot be written."""
        root = self._root.fd
        if root is None or self._root.tmp_fd is None:
            raise StoreWriteError(key, OSError(errno.EROFS, "the store is not writable"))
        return os.fstat(root).st_dev

    def remove_if_present(self, key: EntryKey) -> bool:
        """Delete ``key``'s entry if there is one (its original changed); True if there was."""
        try:
            self._unlink_entry(key)
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("cannot remove stale entry %s: %s", key, exc)
            return False
        with contextlib.suppress(OSError):
            self.capacity.forget(key)
        return True

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
        fd = self._root.fd
        if fd is None or not self.writable:
            return None
        directory = f".{name}"
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700, dir_fd=fd)
            sub = os.open(directory, _DIR, dir_fd=fd)
            try:
                set_mode(sub, 0o700)  # however it was created
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

    def digest(self, version: str) -> bytes:
        """The fingerprint digest ``version``'s entries must carry (in their trailer)."""
        return self._fingerprints[version].digest

    def fingerprint_description(self, version: str) -> Mapping[str, object]:
        return self._fingerprints[version].description

    # -- capacity, for the engine ----------------------------------------------------

    def usage(self) -> StoreUsage:
        return self.capacity.usage()

    def usage_by_size(self) -> dict[tuple[str, int], SizeUsage]:
        return self.capacity.usage_by_size()

    def stored_keys(self, version: str, size: int) -> set[str]:
        return self.capacity.stored_keys(version, size)

    # -- internals --------------------------------------------------------------------

    def _attach(self, fd: int, writable: bool) -> None:
        """The directory ``fd`` is the store now (root.py): count from its catalog,
        discard versions decoded another way, and fill a new catalog from the files."""
        empty = self._open_catalog(fd, writable)
        if writable:
            # Read by whoever reads entries directly: with "originals", others than the owner.
            self.changes.open(fd, 0o600 if self.access == "owner" else 0o644)
            for version, fingerprint in self._fingerprints.items():
                recorded = recorded_digest(fd, version)
                if self._handed_over and recorded not in (None, fingerprint.digest):
                    self.unsettled.append(version)  # an earlier process still serves it
                    continue
                self._check_fingerprint(fd, version)  # before a fill scan sees what it discards
            start_trash_cleanup(fd, done=self.changes.note)
            self._follow_access(fd)
        if empty:
            # A new catalog on an existing store (or a read-only store): fill it
            # from the files, in the background, while the daemon already serves.
            self.capacity.fill_in_background(
                lambda: iter_entries(fd, self._fingerprints),
                lambda key: self._root.exists(key.relpath),
                durable=writable,
                where=self.root,
            )

    def _follow_access(self, root: int) -> None:
        """Before anything is served with access = "originals": if the store's entries
        were given modes by another policy (no marker says "originals"), make every
        entry the daemon's alone (0600); each gets its original's readers when first
        served. With another policy the marker goes."""
        if self.access != "originals":
            try:
                os.unlink(ACCESS_MARKER, dir_fd=root)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", ACCESS_MARKER, exc)
            return
        try:
            recorded = json.loads(read_small(root, ACCESS_MARKER)).get("access")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if recorded == self.access:
            return
        started = time.monotonic()
        versions = dict.fromkeys(_version_dirs(root))
        closed = EntryModes("owner")
        count = 0
        for key, _ in iter_entries(root, versions):
            try:
                entry = os.open(key.relpath, _READ | os.O_NONBLOCK, dir_fd=root)
            except OSError:
                continue  # gone meanwhile
            try:
                count += closed.apply(entry, None)
            except OSError as exc:  # unmarked: tried again at the next start
                log.warning("cannot make %s the daemon's alone: %s", key, exc)
                return
            finally:
                os.close(entry)
        log.info("store %s: %d entries made the daemon's alone (access was %s, is "
                 "originals) in %.2f s", self.root, count, recorded or "not recorded",
                 time.monotonic() - started)  # fmt: skip
        self.changes.note()
        try:
            write_json_at(root, ACCESS_MARKER, {"access": self.access}, self.file_mode)
        except OSError as exc:
            log.warning("cannot record the store's access policy: %s", exc)

    def _check_fingerprint(self, fd: int, version: str) -> None:
        discarded = check_fingerprint(
            fd,
            version,
            self._fingerprints[version],
            where=self.root,
            dir_mode=self.dir_mode,
            file_mode=self.file_mode,
            discard_rows=self.capacity.discard_version,
        )
        if discarded is not None:
            self.discarded[version] = discarded
            self.changes.note()

    def _gone(self) -> None:
        self.generation += 1

    def _write_error(self, key: EntryKey, exc: OSError) -> StoreWriteError:
        if exc.errno == errno.EROFS:
            self.writable = False  # check() notices when it can be written again
        return StoreWriteError(key, exc)

    def _detach(self) -> None:
        """The store's contents are gone, or about to be attached again."""
        self.changes.close()
        catalog = self.capacity.detach()
        if catalog is not None:
            with contextlib.suppress(sqlite3.Error):
                catalog.close()

    def _open_catalog(self, root: int, writable: bool) -> bool:
        """Open the catalog and count from it; True if a scan has to fill it."""
        path = ":memory:"
        if writable:
            path = os.path.join(self.root, CATALOG_FILE)
            # Made with the policy's mode before SQLite opens it: its WAL and SHM
            # files take the database file's mode.
            set_file_mode(root, CATALOG_FILE, self.file_mode, create=True)
            for suffix in ("-wal", "-shm"):
                set_file_mode(root, CATALOG_FILE + suffix, self.file_mode)
        try:
            catalog, empty = Catalog.open(path)
        except (sqlite3.Error, OSError) as exc:
            log.error("catalog %s cannot be used (%s); keeping one in memory", path, exc)
            catalog, empty = Catalog.open(":memory:")
        self.capacity.attach(catalog, filled=not empty)
        return empty

    def _unlink_entry(self, key: EntryKey) -> None:
        fd = self._root.fd
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.unlink(key.relpath, dir_fd=fd)
        self.changes.note()


def _version_dirs(root: int) -> list[str]:
    """The names of the store's version directories (configured now or not)."""
    with os.scandir(root) as it:
        return [
            e.name for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
        ]
