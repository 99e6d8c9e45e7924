"""The flash directory: entry paths, atomic writes, integrity checks, usage.

Layout::

    <store>/.decodefs-store           format marker
    <store>/.lock                     flock held by the one daemon using the store
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
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Protocol

import xxhash

__all__ = [
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
]

log = logging.getLogger(__name__)

STORE_FORMAT: Final = 1
_MAGIC: Final = b"DCFS"
_TRAILER: Final = struct.Struct("<4sI16sQQ")  # magic, format, fingerprint, length, xxh3_64
TRAILER_SIZE: Final = _TRAILER.size
_MARKER: Final = ".decodefs-store"
_FINGERPRINT_FILE: Final = ".fingerprint.json"


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


@dataclass(frozen=True, order=True)
class EntryKey:
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
    complete: bool  # False while the start-up scan is still counting


class Store:
    """Entries on flash. Methods block (call them off the event loop) and are thread-safe.

    Concurrency: callers guarantee at most one operation per key at a time (the
    engine's single flight). ``_lock`` makes each rename or unlink atomic with
    its usage accounting, and the start-up scan holds it while it counts one
    shard directory, so every entry is counted exactly once. ``usage()`` reads
    the counters without the lock: the event loop never waits for the scan.
    """

    def __init__(
        self, root: os.PathLike[str] | str, fingerprints: Mapping[str, Fingerprint]
    ) -> None:
        self.root = os.path.abspath(root)
        self._fingerprints = dict(fingerprints)
        self._tmp = os.path.join(self.root, ".tmp")
        self._trash = os.path.join(self.root, ".trash")
        self._lock_fd: int | None = None
        self._lock = threading.Lock()
        self._entries = 0
        self._bytes = 0
        self._scan_done = False
        self._unscanned_dirs: set[str] = set()
        self.writable = False

    # -- life cycle ---------------------------------------------------------

    def open(self) -> None:
        """Prepare the store. Raises StoreError only for what a user must fix.

        A store that cannot be created, written or even read is not an error:
        the daemon then serves from memory and says so in the log.
        """
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            log.error("store %s cannot be created (%s); serving from memory only", self.root, exc)
            self._scan_done = True
            return
        self._check_marker()
        self._take_lock()
        self.writable = self._prepare_tmp()
        if self.writable:
            for version in self._fingerprints:
                self._check_fingerprint(version)
            self._start_trash_cleanup()
        else:
            log.error(
                "store %s is not writable; hits are served from it, misses from memory", self.root
            )
        # Listing directories is quick; counting and sizing files is the slow part
        # and runs in the background while the daemon already serves.
        self._unscanned_dirs = {
            shard_dir
            for version in self._fingerprints
            for size_dir in _subdirs(os.path.join(self.root, version))
            for shard_dir in _subdirs(size_dir)
        }
        threading.Thread(target=self._scan_usage, name="store-usage-scan", daemon=True).start()

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def wait_for_usage(self, timeout: float = 60.0) -> StoreUsage:
        """Block until the start-up scan has counted everything (tests, tools)."""
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
        problem = self._check(key, data)
        if problem:
            self._discard(path)
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

    def write(self, key: EntryKey, payload: bytes) -> None:
        """Atomically store ``payload`` for ``key``; raises StoreWriteError."""
        digest = self._fingerprints[key.version].digest
        trailer = _TRAILER.pack(_MAGIC, STORE_FORMAT, digest, len(payload), key.checksum(payload))
        final = self.path(key)
        tmp = os.path.join(self._tmp, secrets.token_hex(8) + ".npy")
        try:
            try:
                with open(tmp, "xb") as f:
                    f.write(payload)
                    f.write(trailer)
                os.makedirs(os.path.dirname(final), exist_ok=True)
                with self._lock:
                    existed = os.path.exists(final)
                    os.rename(tmp, final)
                    if not existed:
                        self._account(final, +1, len(payload) + TRAILER_SIZE)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            raise StoreWriteError(key, exc) from exc

    def remove(self, key: EntryKey) -> None:
        self._discard(self.path(key))

    def usage(self) -> StoreUsage:
        # No lock: three int reads, each atomic; a momentary mismatch between
        # them is harmless in a status file.
        return StoreUsage(self._entries, self._bytes, self._scan_done)

    def fingerprint_description(self, version: str) -> Mapping[str, object]:
        return self._fingerprints[version].description

    # -- internals ----------------------------------------------------------

    def _check(self, key: EntryKey, data: bytes) -> str | None:
        if len(data) < TRAILER_SIZE:
            return f"truncated to {len(data)} bytes"
        magic, fmt, digest, length, checksum = _TRAILER.unpack_from(data, len(data) - TRAILER_SIZE)
        if magic != _MAGIC:
            return "no integrity trailer (truncated or not written by decodefs)"
        if fmt != STORE_FORMAT:
            return f"store format {fmt}, expected {STORE_FORMAT}"
        if digest != self._fingerprints[key.version].digest:
            return "decoded with other settings or libraries"
        if length != len(data) - TRAILER_SIZE:
            return f"length {len(data) - TRAILER_SIZE}, trailer says {length}"
        if key.checksum(memoryview(data)[:length]) != checksum:
            return "checksum mismatch (damaged, or another entry's file)"
        return None

    def _discard(self, path: str) -> None:
        try:
            with self._lock:
                size = os.stat(path).st_size
                os.unlink(path)
                self._account(path, -1, -size)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot remove bad entry %s: %s", path, exc)

    def _account(self, path: str, entries: int, nbytes: int) -> None:
        # Caller holds _lock. The start-up scan counts whatever it finds in a
        # directory it has yet to visit; every other change is ours to count.
        if os.path.dirname(path) not in self._unscanned_dirs:
            self._entries += entries
            self._bytes += nbytes

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
            os.makedirs(directory, exist_ok=True)
            _write_json(marker, {"digest": expected.hex, "description": dict(expected.description)})
        except OSError as exc:
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

    def _scan_usage(self) -> None:
        started = time.monotonic()
        for shard_dir in sorted(self._unscanned_dirs):
            with self._lock:
                count, nbytes = _count_files(shard_dir)
                self._entries += count
                self._bytes += nbytes
                self._unscanned_dirs.discard(shard_dir)
        self._scan_done = True
        log.info(
            "store %s holds %d entries, %.1f MiB (counted in %.1f s)",
            self.root,
            self._entries,
            self._bytes / 2**20,
            time.monotonic() - started,
        )


def _subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [
                e.path for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return []


def _count_files(path: str) -> tuple[int, int]:
    count = nbytes = 0
    try:
        with os.scandir(path) as it:
            for entry in it:
                if entry.name.endswith(".npy") and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        nbytes += entry.stat(follow_symlinks=False).st_size
                        count += 1
    except OSError:
        pass
    return count, nbytes


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
