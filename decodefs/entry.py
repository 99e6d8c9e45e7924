"""The store's entry file format: a key's path, its integrity trailer, and the check.

An entry file is an opaque payload (the exact .npy bytes) followed by the
trailer of protocol.py: magic, format, decoder fingerprint, payload length and
an xxh3-64 checksum seeded with the entry's key, so every entry proves its own
integrity on any filesystem, a file moved to another key's path fails, and
``np.load`` reads the file as it is (numpy ignores bytes after the array).
The daemon's store, ``decodefs verify`` and ``read_array`` all check entries
with ``check_entry``. This module does no I/O and knows nothing of images.
"""

from __future__ import annotations

import os
from typing import Final, NamedTuple

import xxhash

from .protocol import STORE_FORMAT, TRAILER, TRAILER_MAGIC, TRAILER_SIZE

__all__ = ["STALE", "EntryKey", "check_entry", "encode_trailer"]

STALE: Final = "decoded with other settings or libraries"


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
        seed = xxhash.xxh3_64_intdigest(os.fsencode(str(self)))
        return xxhash.xxh3_64_intdigest(payload, seed=seed)


def encode_trailer(key: EntryKey, payload: bytes | memoryview, digest: bytes) -> bytes:
    """The trailer that follows ``payload`` in ``key``'s entry file."""
    return TRAILER.pack(TRAILER_MAGIC, STORE_FORMAT, digest, len(payload), key.checksum(payload))


def check_entry(key: EntryKey, data: bytes | bytearray | memoryview, digest: bytes) -> str | None:
    """Why the entry file ``data`` must not be served for ``key``, or None if it may."""
    if len(data) < TRAILER_SIZE:
        return f"truncated to {len(data)} bytes"
    magic, fmt, recorded, length, checksum = TRAILER.unpack_from(data, len(data) - TRAILER_SIZE)
    if magic != TRAILER_MAGIC:
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
