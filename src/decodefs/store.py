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
the file as it is (numpy ignores bytes after the array). Writes go to ``.tmp`` and
are renamed into place; there is no fsync, because a torn entry after a power
cut fails its check and is rebuilt rather than served.

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
from typing import Final

import xxhash

from .decode import Fingerprint

__all__ = [
    "STORE_FORMAT",
    "TRAILER_SIZE",
    "CorruptEntry",
    "EntryKey",
    "Store",
    "StoreError",
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
        kind = errno.errorcode.get(cause.errno or 0, "OSError")
        super().__init__(f"cannot store {key}: {kind}: {cause.strerror or cause}")
        self.kind = kind


class CorruptEntry(Exception):
    """A stored entry failed its integrity check; it has been removed."""

    def __init__(self, key: EntryKey, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.reason = reason


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
    """Entries on flash. Methods are thread-safe and block: call them off the event loop.

    Concurrency: callers guarantee at most one operation per key at a time (the
    engine's single flight). ``_lock`` guards only the usage counters and the
    start-up scan's progress, never I/O on an entry.
    """

    def __init__(
        self, root: os.PathLike[str] | str, fingerprints: Mapping[str, Fingerprint]
    ) -> None:
        self.root = os.path.abspath(root)
        self._fingerprints = {name: fp.digest for name, fp in fingerprints.items()}
        self._descriptions = dict(fingerprints)
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

        A store that cannot be created or written is not an error: the daemon
        then serves from memory (``writable`` is False) and says so in the log.
        """
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            log.error("store %s cannot be created (%s); serving from memory only", self.root, exc)
            with self._lock:
                self._scan_done = True
            return
        self._check_marker()
        self._take_lock()
        self.writable = self._prepare_writable()
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
        """Block until the start-up scan has counted everything (tests, `stats`)."""
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
        check: truncated, damaged, another fingerprint or another format.
        """
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self._discard(key, path)
            raise CorruptEntry(key, f"unreadable: {exc}") from exc
        problem = self._check(key, data)
        if problem:
            self._discard(key, path)
            raise CorruptEntry(key, problem)
        return memoryview(data)[: len(data) - TRAILER_SIZE]

    def write(self, key: EntryKey, payload: bytes) -> None:
        """Atomically store ``payload`` for ``key``; raises StoreWriteError."""
        digest = self._fingerprints[key.version]
        trailer = _TRAILER.pack(_MAGIC, STORE_FORMAT, digest, len(payload), key.checksum(payload))
        final = self.path(key)
        tmp = os.path.join(self._tmp, secrets.token_hex(8) + ".npy")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                with open(fd, "wb", closefd=True) as f:
                    f.write(payload)
                    f.write(trailer)
                os.makedirs(os.path.dirname(final), exist_ok=True)
                existed = os.path.exists(final)
                os.rename(tmp, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            raise StoreWriteError(key, exc) from exc
        if not existed:
            self._account(final, +1, len(payload) + TRAILER_SIZE)

    def remove(self, key: EntryKey) -> None:
        self._discard(key, self.path(key))

    def usage(self) -> StoreUsage:
        with self._lock:
            return StoreUsage(self._entries, self._bytes, self._scan_done)

    def fingerprint_description(self, version: str) -> Mapping[str, object]:
        return self._descriptions[version].description

    # -- internals ----------------------------------------------------------

    def _check(self, key: EntryKey, data: bytes) -> str | None:
        if len(data) < TRAILER_SIZE:
            return f"truncated to {len(data)} bytes"
        magic, fmt, digest, length, checksum = _TRAILER.unpack_from(data, len(data) - TRAILER_SIZE)
        if magic != _MAGIC:
            return "no integrity trailer (truncated or not written by decodefs)"
        if fmt != STORE_FORMAT:
            return f"store format {fmt}, expected {STORE_FORMAT}"
        if digest != self._fingerprints[key.version]:
            return "decoded with other settings or libraries"
        if length != len(data) - TRAILER_SIZE:
            return f"length {len(data) - TRAILER_SIZE}, trailer says {length}"
        if key.checksum(memoryview(data)[:length]) != checksum:
            return "checksum mismatch (damaged, or another entry's file)"
        return None

    def _discard(self, key: EntryKey, path: str) -> None:
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot remove bad entry %s: %s", path, exc)
            return
        self._account(path, -1, -size)

    def _account(self, path: str, entries: int, nbytes: int) -> None:
        # The start-up scan counts whatever it finds in a directory it has yet to
        # visit; every other change is ours to count. Never both, never neither.
        with self._lock:
            if os.path.dirname(path) not in self._unscanned_dirs:
                self._entries += entries
                self._bytes += nbytes

    def _check_marker(self) -> None:
        marker = os.path.join(self.root, _MARKER)
        try:
            with open(marker, encoding="utf-8") as f:
                fmt = json.load(f).get("format")
        except FileNotFoundError:
            with contextlib.suppress(OSError):  # a read-only store stays unmarked
                _write_json(marker, {"format": STORE_FORMAT})
            return
        except (OSError, ValueError, AttributeError) as exc:
            raise StoreError(
                f"store: {marker} is unreadable ({exc}); remove it to reuse the store"
            ) from exc
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

    def _prepare_writable(self) -> bool:
        try:
            if os.path.isdir(self._tmp):
                leftovers = os.listdir(self._tmp)
                for name in leftovers:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self._tmp, name))
                if leftovers:
                    log.info("removed %d leftover temp files from %s", len(leftovers), self._tmp)
            os.makedirs(self._tmp, exist_ok=True)
            probe = os.path.join(self._tmp, "probe-" + secrets.token_hex(4))
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as exc:
            log.debug("store %s not writable: %s", self.root, exc)
            return False
        return True

    def _check_fingerprint(self, version: str) -> None:
        directory = os.path.join(self.root, version)
        marker = os.path.join(directory, _FINGERPRINT_FILE)
        expected = self._descriptions[version]
        try:
            with open(marker, encoding="utf-8") as f:
                recorded = json.load(f)
        except FileNotFoundError:
            recorded = None
        except (OSError, ValueError) as exc:
            log.warning("unreadable %s (%s); rewriting it", marker, exc)
            recorded = {}
        if recorded is not None and recorded.get("digest") == expected.hex:
            return
        if recorded is not None and os.path.isdir(directory):
            old = recorded.get("description", {})
            log.warning(
                "version %s: decode settings or libraries changed (was %s, now %s); "
                "discarding its stored arrays",
                version,
                json.dumps(old, sort_keys=True),
                json.dumps(expected.description, sort_keys=True),
            )
            os.makedirs(self._trash, exist_ok=True)
            os.rename(directory, os.path.join(self._trash, f"{version}.{time.time_ns()}"))
        os.makedirs(directory, exist_ok=True)
        _write_json(marker, {"digest": expected.hex, "description": expected.description})

    def _start_trash_cleanup(self) -> None:
        if not os.path.isdir(self._trash) or not os.listdir(self._trash):
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
        with self._lock:
            self._scan_done = True
            entries, nbytes = self._entries, self._bytes
        log.info(
            "store %s holds %d entries, %.1f MiB (counted in %.1f s)",
            self.root,
            entries,
            nbytes / 2**20,
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
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
