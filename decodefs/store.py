"""The flash directory: entry paths, atomic writes, integrity checks, usage.

Layout::

    <store>/.decodefs-store           format marker
    <store>/.lock                     flock held by the one daemon using the store
    <store>/.access.sock              readers report the hits they read directly
    <store>/.catalog.sqlite3          sizes and last access of entries (catalog.py)
    <store>/.index/<version>.json     the cached source index (source.py)
    <store>/.tmp/                     temp files, emptied at start
    <store>/.trash/                   discarded versions, deleted in the background
    <store>/<version>/.fingerprint.json
    <store>/<version>/<size>/<uuid[:2]>/<uuid>.npy

An entry file is the exact .npy bytes followed by a 40-byte trailer (magic,
format, decoder fingerprint, payload length, xxh3-64 of the payload seeded
with the entry's key), so every entry proves its own integrity on any
filesystem, a file moved to another key's path fails, and ``np.load`` reads
the file as it is (numpy ignores bytes after the array). Writes go to ``.tmp``
and are renamed into place; there is no fsync, because a torn entry after a
power cut fails its check and is rebuilt rather than served.

Capacity: past ``max_bytes`` (or below ``min_free_fraction`` of the filesystem
free), least-recently-used entries are evicted before a new one is written,
except pinned ones: a caller pins a key while it relies on its file.

This module stores opaque payloads: it knows nothing of images, numpy or FUSE.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import sqlite3
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple, Protocol, TypeVar

import xxhash

from .catalog import Catalog

__all__ = [
    "ACCESS_SOCKET",
    "CATALOG_FILE",
    "STALE",
    "STORE_FORMAT",
    "TRAILER_SIZE",
    "CorruptEntry",
    "EntryKey",
    "Fingerprint",
    "Store",
    "StoreError",
    "StoreReadError",
    "StoreUsage",
    "StoreWriteError",
    "check_entry",
    "iter_entry_files",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_FORMAT: Final = 1
_MAGIC: Final = b"DCFS"
_TRAILER: Final = struct.Struct("<4sI16sQQ")  # magic, format, fingerprint, length, xxh3_64
TRAILER_SIZE: Final = _TRAILER.size
_MARKER: Final = ".decodefs-store"
_FINGERPRINT_FILE: Final = ".fingerprint.json"
CATALOG_FILE: Final = ".catalog.sqlite3"
ACCESS_SOCKET: Final = ".access.sock"
STALE: Final = "decoded with other settings or libraries"
_EVICT_BATCH: Final = 64
_FILL_BATCH: Final = 2000


class StoreError(Exception):
    """The store cannot be used as configured (a user-fixable problem)."""


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


class Fingerprint(Protocol):
    """What produced a version's payloads (decode.Fingerprint is one)."""

    @property
    def digest(self) -> bytes: ...  # 16 bytes, stored in every entry's trailer

    @property
    def hex(self) -> str: ...

    @property
    def description(self) -> Mapping[str, object]: ...


class EntryKey(NamedTuple):
    """One array: a tuple, so hashing it (pins, accesses, flights) is cheap."""

    version: str
    size: int
    uuid: str

    def __str__(self) -> str:
        return f"{self.version}/{self.size}/{self.uuid}"

    def checksum(self, payload: bytes | memoryview) -> int:
        """xxh3-64 of ``payload``, seeded so only this key's file verifies."""
        seed = xxhash.xxh3_64_intdigest(os.fsencode(str(self)))
        return xxhash.xxh3_64_intdigest(payload, seed=seed)


@dataclass(frozen=True)
class StoreUsage:
    entries: int
    bytes: int
    complete: bool  # False while a scan is still filling the catalog
    evictions: int = 0


class Store:
    """Entries on flash. Methods block (call them off the event loop) and are thread-safe.

    Concurrency: callers guarantee at most one operation per key at a time (the
    engine's single flight). Three locks, never one held while taking another
    out of this order: ``_evict_lock`` (one evictor at a time) before
    ``_pin_lock`` (pins, and the decision to unlink an unpinned entry; the
    event loop takes it to pin, so it is never held across SQLite) and
    ``_count_lock`` (the usage counters and reservations together with the
    catalog rows they mirror; held across SQLite, never taken by the event
    loop). ``usage()`` reads the counters without a lock. The catalog is kept
    a superset of the files (see catalog.py).
    """

    def __init__(
        self,
        root: os.PathLike[str] | str,
        fingerprints: Mapping[str, Fingerprint],
        max_bytes: int | None = None,
        min_free_fraction: float | None = None,
    ) -> None:
        self.root = os.path.abspath(root)
        self._fingerprints = dict(fingerprints)
        self._max_bytes = max_bytes
        self._min_free_fraction = min_free_fraction
        self._tmp = os.path.join(self.root, ".tmp")
        self._trash = os.path.join(self.root, ".trash")
        self._lock_fd: int | None = None
        self._evict_lock = threading.Lock()
        self._pin_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._access_lock = threading.Lock()
        self._catalog: Catalog | None = None
        self._entries = 0
        self._bytes = 0
        self._reserved = 0
        self._reservations: dict[EntryKey, int] = {}
        self._filled = True
        self._removed_while_filling: set[EntryKey] = set()
        self._pins: dict[EntryKey, int] = {}
        self._accesses: dict[EntryKey, float] = {}
        self.evicted: deque[EntryKey] = deque()  # for the engine to forget; thread-safe appends
        self.evictions = 0
        self.writable = False
        self._closing = threading.Event()
        self._fill_thread: threading.Thread | None = None

    # -- life cycle ---------------------------------------------------------

    def open(self) -> None:
        """Prepare the store. Raises StoreError only for what a user must fix.

        A store that cannot be created, written or even read is not an error:
        the daemon then serves from memory and says so in the log.
        """
        try:
            os.makedirs(self.root, mode=0o755, exist_ok=True)
        except OSError as exc:
            log.error("store %s cannot be created (%s); serving from memory only", self.root, exc)
            self._catalog, _ = Catalog.open(":memory:")
            return
        self._check_marker()
        self._take_lock()
        self.writable = self._prepare_tmp()
        empty = self._open_catalog()
        if self.writable:
            for version in self._fingerprints:
                self._check_fingerprint(version)  # before a fill scan can see what it discards
            self._start_trash_cleanup()
        else:
            log.error(
                "store %s is not writable; hits are served from it, misses from memory", self.root
            )
        if empty:
            # A new catalog on an existing store (or a read-only store): fill it
            # from the files, in the background, while the daemon already serves.
            self._filled = False
            self._fill_thread = threading.Thread(
                target=self._fill, name="store-catalog-fill", daemon=True
            )
            self._fill_thread.start()

    def close(self) -> None:
        self._closing.set()
        if self._fill_thread is not None:
            self._fill_thread.join()
        if self._catalog is not None:
            with contextlib.suppress(Exception):
                self.flush_accesses()
            self._catalog.close()
            self._catalog = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def wait_for_usage(self, timeout: float = 60.0) -> StoreUsage:
        """Block until a scan filling the catalog has finished (tests, tools)."""
        deadline = time.monotonic() + timeout
        while not self.usage().complete and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.usage()

    # -- entries ------------------------------------------------------------

    def path(self, key: EntryKey) -> str:
        return os.path.join(self.root, key.version, str(key.size), key.uuid[:2], key.uuid + ".npy")

    def read(self, key: EntryKey) -> memoryview | None:
        """The verified payload of ``key``, or None if there is no entry.

        Raises CorruptEntry (after removing the file) if the entry fails its
        check: truncated, damaged, another fingerprint or format, another key's
        file. Raises StoreReadError if it cannot be read at all.
        """
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StoreReadError(key, exc) from exc
        problem = check_entry(key, data, self._fingerprints[key.version].digest)
        if problem:
            self.remove(key)
            raise CorruptEntry(key, problem)
        return memoryview(data)[: len(data) - TRAILER_SIZE]

    def read_range(self, key: EntryKey, offset: int, length: int) -> bytes:
        """Bytes of an entry verified earlier; raises OSError if it is gone or unreadable.

        Opens the file for each call, so no descriptor outlives the request and
        an entry replaced meanwhile is read whole from its new file.
        """
        fd = os.open(self.path(key), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def write(self, key: EntryKey, payload: bytes, may_evict: bool = True) -> None:
        """Atomically store ``payload`` for ``key``, evicting first if over a limit.

        Raises StoreWriteError: the store is full, read-only or unwritable, or
        at its limit (EDQUOT) with everything left pinned or ``may_evict`` False.
        """
        assert self._catalog is not None
        catalog = self._catalog
        digest = self._fingerprints[key.version].digest
        trailer = _TRAILER.pack(_MAGIC, STORE_FORMAT, digest, len(payload), key.checksum(payload))
        nbytes = len(payload) + TRAILER_SIZE
        final = self.path(key)
        tmp = os.path.join(self._tmp, secrets.token_hex(8) + ".npy")
        try:
            self._make_room(key, nbytes, may_evict)  # reserves nbytes until counted
            try:
                # 0644 whatever the umask: read_array trusts only files no one else may write.
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                with open(fd, "wb") as f:
                    f.write(payload)
                    f.write(trailer)
                os.makedirs(os.path.dirname(final), mode=0o755, exist_ok=True)
                with self._count_lock:
                    new = _catalog_call(
                        catalog.put, key.version, key.size, key.uuid, nbytes, time.time()
                    )
                    try:
                        os.rename(tmp, final)
                    except OSError:
                        if new:
                            _catalog_call(catalog.remove, key.version, key.size, key.uuid)
                        raise
                    if new:
                        self._entries += 1
                        self._bytes += nbytes
                    self._reserved -= self._reservations.pop(key, 0)  # with the count, at once
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            raise StoreWriteError(key, exc) from exc
        finally:
            with self._count_lock:
                self._reserved -= self._reservations.pop(key, 0)

    def remove(self, key: EntryKey) -> None:
        """Delete an entry (a bad one); its catalog row goes after its file."""
        path = self.path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove bad entry %s: %s", path, exc)
            return
        try:
            self._forget(key)
        except OSError as exc:
            log.warning("%s; its row stays in the catalog until evicted", exc)

    def cache_dir(self, name: str) -> str | None:
        """A directory in the store for a derived cache (the source index), or None
        if the store is not writable."""
        if not self.writable:
            return None
        path = os.path.join(self.root, f".{name}")
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            os.chmod(path, 0o700)  # the daemon's alone, however it was created
        except OSError:
            return None
        return path

    def access_socket_path(self) -> str | None:
        """Where readers may report the hits they read directly (None: nowhere)."""
        path = os.path.join(self.root, ACCESS_SOCKET)
        # A unix socket's path must fit in sun_path (108 bytes with its NUL).
        return path if self.writable and len(os.fsencode(path)) < 108 else None

    def digests(self) -> dict[str, str]:
        """version -> the fingerprint its entries must carry (hex)."""
        return {version: fp.hex for version, fp in self._fingerprints.items()}

    def stored_uuids(self, version: str, size: int) -> set[str]:
        assert self._catalog is not None
        return self._catalog.uuids(version, size)

    # -- pins, accesses and eviction -----------------------------------------

    def pin(self, key: EntryKey) -> None:
        """Keep ``key``'s file from eviction until unpin. Cheap: safe on the event loop."""
        pins = self._pins
        with self._pin_lock:
            pins[key] = pins.get(key, 0) + 1

    def unpin(self, key: EntryKey) -> None:
        pins = self._pins
        with self._pin_lock:
            count = pins.pop(key, 1) - 1
            if count > 0:
                pins[key] = count

    def record_access(self, key: EntryKey, limit: int | None = None) -> bool:
        """Note a hit for LRU; written to the catalog by flush_accesses. Cheap.

        With ``limit``, a new key is noted only while fewer than ``limit`` are
        pending; returns whether it was noted.
        """
        now = time.time()
        with self._access_lock:
            if limit is not None and len(self._accesses) >= limit and key not in self._accesses:
                return False
            self._accesses[key] = now
        return True

    def flush_accesses(self) -> None:
        with self._access_lock:
            accesses, self._accesses = self._accesses, {}
        if accesses and self._catalog is not None and self.writable:
            try:
                self._catalog.touch((k.version, k.size, k.uuid, t) for k, t in accesses.items())
            except sqlite3.Error as exc:
                log.warning("cannot record %d accesses in the catalog: %s", len(accesses), exc)

    def usage(self) -> StoreUsage:
        # No lock: plain int reads; a momentary mismatch is harmless in a status file.
        return StoreUsage(self._entries, self._bytes, self._filled, self.evictions)

    def fingerprint_description(self, version: str) -> Mapping[str, object]:
        return self._fingerprints[version].description

    def would_evict(self, incoming: int) -> bool:
        """Whether writing ``incoming`` more bytes would evict something first."""
        return self._shortfall(incoming) > 0

    def _shortfall(self, incoming: int) -> int:
        """Bytes to free before ``incoming`` more fit within the limits (<= 0: none).

        Room reserved by writes in progress counts as used, so concurrent
        writers never each find the same free space.
        """
        need = 0
        if self._max_bytes is not None:
            need = self._bytes + self._reserved + incoming - self._max_bytes
        if self._min_free_fraction is not None:
            vfs = os.statvfs(self.root)
            free = vfs.f_bavail * vfs.f_frsize - incoming - self._reserved
            need = max(need, int(self._min_free_fraction * vfs.f_blocks * vfs.f_frsize) - free)
        return need

    def _make_room(self, key: EntryKey, incoming: int, may_evict: bool) -> None:
        """Evict least-recently-used, unpinned entries until ``incoming`` bytes fit,
        and reserve them for ``key`` (write() releases the reservation)."""
        if self._max_bytes is None and self._min_free_fraction is None:
            return
        with self._evict_lock:
            need = self._shortfall(incoming)
            if need > 0:
                if not may_evict:
                    raise OSError(errno.EDQUOT, "the store is at its capacity limit")
                if need > self._bytes:
                    # Other data filled the filesystem: evicting everything would
                    # still not make room, so evict nothing.
                    raise OSError(
                        errno.ENOSPC,
                        f"no room even if every entry were evicted ({need:,} bytes short)",
                    )
                self._evict_for(key, incoming)
            with self._count_lock:
                self._reservations[key] = incoming
                self._reserved += incoming

    def _evict_for(self, key: EntryKey, incoming: int) -> None:
        assert self._catalog is not None
        self.flush_accesses()  # so that recent hits are not the oldest
        skipped = 0  # pinned rows stay at the front of the LRU order
        while self._shortfall(incoming) > 0:
            rows = _catalog_call(self._catalog.oldest, _EVICT_BATCH, skipped)
            if not rows:
                raise OSError(
                    errno.EDQUOT,
                    "the store is at its capacity limit and every entry left is in use",
                )
            for row in rows:
                victim = EntryKey(row.version, row.size, row.uuid)
                if victim == key or not self._evict(victim):
                    skipped += 1
                if self._shortfall(incoming) <= 0:
                    break

    def _evict(self, key: EntryKey) -> bool:
        """Unlink ``key`` unless pinned, then drop its row; raises OSError if the
        catalog fails (eviction must stop: it could not tell what it freed)."""
        with self._pin_lock:
            if self._pins.get(key):
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(key))
            self.evicted.append(key)
        self._forget(key)
        self.evictions += 1
        return True

    def _forget(self, key: EntryKey) -> None:
        """Drop ``key``'s catalog row (after its file) and uncount it; OSError on failure."""
        assert self._catalog is not None
        with self._count_lock:
            nbytes = _catalog_call(self._catalog.remove, key.version, key.size, key.uuid)
            if not self._filled:
                self._removed_while_filling.add(key)
            if nbytes is not None:
                self._entries -= 1
                self._bytes -= nbytes

    def _check_marker(self) -> None:
        marker = os.path.join(self.root, _MARKER)
        try:
            with open(marker, encoding="utf-8") as f:
                recorded = json.load(f)
        except FileNotFoundError:
            with contextlib.suppress(OSError):  # a read-only store stays unmarked
                _write_json(marker, {"format": STORE_FORMAT})
            return
        except (OSError, ValueError) as exc:
            raise StoreError(
                f"store: {marker} is unreadable ({exc}); remove it to reuse the store"
            ) from exc
        fmt = recorded.get("format") if isinstance(recorded, dict) else None
        if fmt != STORE_FORMAT:
            raise StoreError(
                f"store: {self.root} has store format {fmt!r}, this decodefs writes "
                f"{STORE_FORMAT}; point `store` at another directory"
            )

    def _take_lock(self) -> None:
        path = os.path.join(self.root, ".lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return  # read-only store without a lock file: we will not write to it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(
                f"store: {self.root} is in use by another decodefs daemon; "
                "give each daemon its own store"
            ) from None
        self._lock_fd = fd

    def _prepare_tmp(self) -> bool:
        """Empty .tmp of leftovers; True if a file can be created there."""
        removed = 0
        try:
            with os.scandir(self._tmp) as it:
                leftovers = list(it)
        except OSError:
            leftovers = []  # absent, or not a directory: the probe below decides
        for entry in leftovers:
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed += 1
            except OSError as exc:
                log.warning("cannot remove leftover %s: %s", entry.path, exc)
        if removed:
            log.info("removed %d leftover temp files from %s", removed, self._tmp)
        probe = os.path.join(self._tmp, "probe-" + secrets.token_hex(4))
        try:
            os.makedirs(self._tmp, exist_ok=True)
            with open(probe, "xb") as f:
                f.write(b"decodefs")
            os.unlink(probe)
        except OSError as exc:
            log.debug("store %s not writable: %s", self.root, exc)
            return False
        return True

    def _check_fingerprint(self, version: str) -> None:
        """Discard a version's arrays if they were decoded another way.

        Only a readable marker naming another fingerprint discards anything:
        each entry carries its own fingerprint, so a missing or unreadable
        marker is simply rewritten.
        """
        directory = os.path.join(self.root, version)
        marker = os.path.join(directory, _FINGERPRINT_FILE)
        expected = self._fingerprints[version]
        try:
            with open(marker, encoding="utf-8") as f:
                recorded = json.load(f)
        except FileNotFoundError:
            recorded = None
        except (OSError, ValueError) as exc:
            log.warning("unreadable %s (%s); rewriting it", marker, exc)
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
                os.makedirs(self._trash, exist_ok=True)
                os.rename(directory, os.path.join(self._trash, f"{version}.{time.time_ns()}"))
                if self._catalog is not None:
                    self._catalog.remove_version(version)
                    self._entries, self._bytes = self._catalog.totals()
            os.makedirs(directory, exist_ok=True)
            _write_json(marker, {"digest": expected.hex, "description": dict(expected.description)})
        except (OSError, sqlite3.Error) as exc:
            # A full disk must not stop the daemon: stale entries still fail
            # their own fingerprint check and are rebuilt one by one.
            log.error(
                "version %s: cannot record its fingerprint in %s: %s", version, directory, exc
            )

    def _start_trash_cleanup(self) -> None:
        if not os.path.isdir(self._trash):
            return

        def cleanup() -> None:
            started = time.monotonic()
            shutil.rmtree(self._trash, ignore_errors=True)
            log.info("deleted discarded arrays in %.1f s", time.monotonic() - started)

        threading.Thread(target=cleanup, name="store-trash", daemon=True).start()

    def _open_catalog(self) -> bool:
        """Open the catalog and count from it; True if a scan has to fill it."""
        path = os.path.join(self.root, CATALOG_FILE) if self.writable else ":memory:"
        try:
            catalog, empty = Catalog.open(path)
            entries, nbytes = catalog.totals()
        except (sqlite3.Error, OSError) as exc:
            log.error("catalog %s cannot be used (%s); keeping one in memory", path, exc)
            catalog, empty = Catalog.open(":memory:")
            entries, nbytes = 0, 0
        self._catalog = catalog
        self._entries, self._bytes = entries, nbytes
        return empty

    def _fill(self) -> None:
        assert self._catalog is not None
        catalog = self._catalog
        started = time.monotonic()
        batch: list[tuple[str, int, str, int, float]] = []
        try:
            for key, path in iter_entry_files(self.root, self._fingerprints):
                if self._closing.is_set():
                    return  # the next start fills it again
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                batch.append((key.version, key.size, key.uuid, st.st_size, st.st_mtime))
                if len(batch) >= _FILL_BATCH:
                    catalog.fill(batch)
                    batch.clear()
            catalog.fill(batch)
            with self._count_lock:
                # Files the scan listed but that were evicted or removed before
                # their row went in must not come back as rows.
                for key in self._removed_while_filling:
                    if not os.path.exists(self.path(key)):
                        catalog.remove(key.version, key.size, key.uuid)
                self._removed_while_filling.clear()
                if self.writable:
                    catalog.mark_filled()
                # Writes and evictions went on meanwhile; the catalog is the truth.
                self._entries, self._bytes = catalog.totals()
                self._filled = True
        except sqlite3.Error as exc:
            log.error("cannot fill the catalog of %s: %s; usage is undercounted", self.root, exc)
            self._filled = True
        log.info(
            "store %s holds %d entries, %.1f MiB (catalog filled from disk in %.1f s)",
            self.root,
            self._entries,
            self._bytes / 2**20,
            time.monotonic() - started,
        )


def check_entry(key: EntryKey, data: bytes | bytearray, digest: bytes) -> str | None:
    """Why the entry file ``data`` must not be served for ``key``, or None if it may."""
    if len(data) < TRAILER_SIZE:
        return f"truncated to {len(data)} bytes"
    magic, fmt, recorded, length, checksum = _TRAILER.unpack_from(data, len(data) - TRAILER_SIZE)
    if magic != _MAGIC:
        return "no integrity trailer (truncated or not written by decodefs)"
    if fmt != STORE_FORMAT:
        return f"store format {fmt}, expected {STORE_FORMAT}"
    if recorded != digest:
        return STALE
    if length != len(data) - TRAILER_SIZE:
        return f"length {len(data) - TRAILER_SIZE}, trailer says {length}"
    if key.checksum(memoryview(data)[:length]) != checksum:
        return "checksum mismatch (damaged, or another entry's file)"
    return None


def iter_entry_files(root: str, versions: Iterable[str]) -> Iterator[tuple[EntryKey, str]]:
    """Every entry file under ``root`` for ``versions``, by walking the layout."""
    for version in versions:
        for size_dir in _subdirs(os.path.join(root, version)):
            size_name = os.path.basename(size_dir)
            if not size_name.isdigit():
                continue
            for shard_dir in _subdirs(size_dir):
                try:
                    with os.scandir(shard_dir) as it:
                        names = [
                            e.name
                            for e in it
                            if e.name.endswith(".npy") and e.is_file(follow_symlinks=False)
                        ]
                except OSError:
                    continue
                for name in names:
                    yield (
                        EntryKey(version, int(size_name), name[: -len(".npy")]),
                        os.path.join(shard_dir, name),
                    )


def _catalog_call(fn: Callable[..., T], *args: object) -> T:
    """A catalog call whose failure is an OSError, like any other storage failure."""
    try:
        return fn(*args)
    except sqlite3.Error as exc:
        raise OSError(errno.EIO, f"catalog: {exc}") from exc


def _subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [
                e.path for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return []


def _write_json(path: str, value: object) -> None:
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
