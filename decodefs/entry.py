"""The store's entry file format: a key's path, its integrity trailer, and the check.

An entry file is an opaque payload (the exact .npy bytes) followed by the
trailer of protocol.py: magic, format, decoder fingerprint, payload length and
an xxh3-64 checksum seeded with the entry's key, so every entry proves its own
integrity on any filesystem, a file moved to another key's path fails, and
``np.load`` reads the file as it is (numpy ignores bytes after the array).
The daemon's store, ``decodefs verify`` and ``read_array`` all check entries
here. This module reads only through a descriptor it is given, and knows
nothing of images.
"""

from __future__ import annotations

import os
from typing import Final, NamedTuple

import xxhash

from .protocol import STORE_FORMAT, TRAILER, TRAILER_MAGIC, TRAILER_SIZE

__all__ = ["STALE", "EntryKey", "FileCheck", "check_entry", "check_entry_file", "encode_trailer"]

STALE: Final = "decoded with other settings or libraries"
_CHECKSUM_MISMATCH: Final = "checksum mismatch (damaged, or another entry's file)"
_HEAD: Final = 4096  # enough for any .npy header of ours
_PIECE: Final = 1 << 20


class EntryKey(NamedTuple):
    """One array: a tuple, so hashing it (pins, accesses, flights) is cheap."""

    version: str
    size: int
    uuid: str

    def __str__(self) -> str:
        return f"{self.version}/{self.size}/{self.uuid}"

    @property
    def relpath(self) -> str:
        """Where the entry lives under the store: ``<version>/<size>/<uu>/<uuid>.npy``."""
        return f"{self.version}/{self.size}/{self.uuid[:2]}/{self.uuid}.npy"

    def checksum(self, payload: bytes | bytearray | memoryview) -> int:
        """xxh3-64 of ``payload``, seeded so only this key's file verifies."""
        return xxhash.xxh3_64_intdigest(payload, seed=self._seed())

    def hasher(self) -> xxhash.xxh3_64:
        """The same checksum, fed piece by piece."""
        return xxhash.xxh3_64(seed=self._seed())

    def _seed(self) -> int:
        return xxhash.xxh3_64_intdigest(os.fsencode(str(self)))


def encode_trailer(key: EntryKey, payload: bytes | memoryview, digest: bytes) -> bytes:
    """The trailer that follows ``payload`` in ``key``'s entry file."""
    return TRAILER.pack(TRAILER_MAGIC, STORE_FORMAT, digest, len(payload), key.checksum(payload))


def check_entry(key: EntryKey, data: bytes | bytearray | memoryview, digest: bytes) -> str | None:
    """Why the entry file ``data`` must not be served for ``key``, or None if it may."""
    if len(data) < TRAILER_SIZE:
        return f"truncated to {len(data)} bytes"
    length = len(data) - TRAILER_SIZE
    trailer = bytes(data[length:])
    problem = _check_trailer(trailer, length, digest)
    if problem is None and key.checksum(memoryview(data)[:length]) != _checksum_of(trailer):
        problem = _CHECKSUM_MISMATCH
    return problem


class FileCheck(NamedTuple):
    head: bytes  # the payload's first bytes (up to 4 KiB: its .npy header)
    length: int  # the payload's length
    problem: str | None  # why the file must not be served, or None


def check_entry_file(fd: int, key: EntryKey, digest: bytes) -> FileCheck:
    """``check_entry`` for the entry file open at ``fd``, read in pieces so that at
    most one piece is in memory. Raises OSError."""
    size = os.fstat(fd).st_size
    if size < TRAILER_SIZE:
        return FileCheck(b"", 0, f"truncated to {size} bytes")
    length = size - TRAILER_SIZE
    trailer = os.pread(fd, TRAILER_SIZE, length)
    head = os.pread(fd, min(length, _HEAD), 0)
    problem = _check_trailer(trailer, length, digest)
    if problem is not None:
        return FileCheck(head, length, problem)
    hasher = key.hasher()
    offset = 0
    while offset < length:
        piece = os.pread(fd, min(_PIECE, length - offset), offset)
        if not piece:
            return FileCheck(head, length, f"truncated to {offset} bytes while being read")
        hasher.update(piece)
        offset += len(piece)
    if hasher.intdigest() != _checksum_of(trailer):
        return FileCheck(head, length, _CHECKSUM_MISMATCH)
    return FileCheck(head, length, None)


def _check_trailer(trailer: bytes, length: int, digest: bytes) -> str | None:
    magic, fmt, recorded, recorded_length, _ = TRAILER.unpack(trailer)
    if magic != TRAILER_MAGIC:
        return "no integrity trailer (truncated or not written by decodefs)"
    if fmt != STORE_FORMAT:
        return f"store format {fmt}, expected {STORE_FORMAT}"
    if recorded != digest:
        return STALE
    if recorded_length != length:
        return f"length {length}, trailer says {recorded_length}"
    return None


def _checksum_of(trailer: bytes) -> int:
    checksum: int = TRAILER.unpack(trailer)[4]
    return checksum
