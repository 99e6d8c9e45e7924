"""The store's entry file format: a key's path, its integrity trailer, and the check.

An entry file is an opaque payload (the exact .npy bytes) followed by the
trailer of protocol.py: magic, format, decoder fingerprint, payload length and
an xxh3-64 checksum seeded with the entry's key, so every entry proves its own
integrity on any filesystem, a file moved to another key's path fails, and
``np.load`` reads the file as it is (numpy ignores bytes after the array).
The daemon's store, ``decodefs verify`` and ``read_array`` all check entries
here. This module reads only through a descriptor it is given, and knows
nothing of images.

Where an entry lives: ``<version>/<size>/<shard>/<file name>``. A key without
``/`` (a uuid) has shard ``uuid[:2]`` and file name ``<uuid>.npy``. A key with
``/`` (a mirror version's relative path) has shard ``%`` + the first two hex
digits of the key's xxh3-64, and its file name is the key with ``%`` escaped as
``%25`` and ``/`` as ``%2F``, plus ``.npy``. A shard of three characters is
never a uuid's first two, so the two kinds of file never share a directory,
and every file name gives back its key (``EntryKey.from_store_path``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

import xxhash

from .protocol import STORE_FORMAT, TRAILER, TRAILER_MAGIC, TRAILER_SIZE

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "STALE",
    "EntryKey",
    "FileCheck",
    "check_entry",
    "check_entry_bytes",
    "check_entry_file",
    "check_entry_pieces",
    "encode_trailer",
]

STALE: Final = "decoded with other settings or libraries"
_CHECKSUM_MISMATCH: Final = "checksum mismatch (damaged, or another entry's file)"
_HEAD: Final = 4096  # enough for any .npy header of ours
_PIECE: Final = 1 << 20
_PATH_SHARD: Final = "%"  # starts the shard of a key with "/": never a uuid's shard


class EntryKey(NamedTuple):
    """One array: a tuple, so hashing it (pins, accesses, flights) is cheap."""

    version: str
    size: int
    uuid: str

    def __str__(self) -> str:
        return f"{self.version}/{self.size}/{self.uuid}"

    @property
    def relpath(self) -> str:
        """Where the entry lives under the store: ``<version>/<size>/<uu>/<uuid>.npy``
        for a uuid; see the module's docstring for a key with ``/``."""
        return f"{self.version}/{self.size}/{self.shard}/{self.file_name}"

    @property
    def shard(self) -> str:
        """The directory under ``<version>/<size>/`` that holds the entry."""
        if "/" in self.uuid:
            return _PATH_SHARD + xxhash.xxh3_64_hexdigest(os.fsencode(self.uuid))[:2]
        return self.uuid[:2]

    @property
    def file_name(self) -> str:
        """The entry's file name in its shard: one path component for any key."""
        if "/" in self.uuid:
            return self.uuid.replace("%", "%25").replace("/", "%2F") + ".npy"
        return f"{self.uuid}.npy"

    @classmethod
    def from_store_path(cls, version: str, size: int, shard: str, name: str) -> EntryKey | None:
        """The key whose entry is the file ``name`` in ``shard`` of ``<version>/<size>/``;
        None if the name is no entry's (in a shard of keys with ``/``: not the
        canonical escape of such a key, or not the shard its key hashes to)."""
        if not name.endswith(".npy"):
            return None
        stem = name[: -len(".npy")]
        if len(shard) <= 2:  # a uuid's shard (which may start with "%" too)
            return cls(version, size, stem)
        uuid = _unescape(stem)
        if uuid is None or "/" not in uuid:
            return None
        key = cls(version, size, uuid)
        return key if key.shard == shard else None

    def checksum(self, payload: bytes | bytearray | memoryview) -> int:
        """xxh3-64 of ``payload``, seeded so only this key's file verifies."""
        return xxhash.xxh3_64_intdigest(payload, seed=self._seed())

    def hasher(self) -> xxhash.xxh3_64:
        """The same checksum, fed piece by piece."""
        return xxhash.xxh3_64(seed=self._seed())

    def _seed(self) -> int:
        return xxhash.xxh3_64_intdigest(os.fsencode(str(self)))


def _unescape(name: str) -> str | None:
    """The key a file name in a shard of keys with "/" escapes; None unless canonical."""
    pieces = name.split("%")
    key = [pieces[0]]
    for piece in pieces[1:]:
        escaped = {"25": "%", "2F": "/"}.get(piece[:2])
        if escaped is None:
            return None
        key += (escaped, piece[2:])
    return "".join(key)


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


def check_entry_pieces(
    key: EntryKey, payload: Sequence[Buffer], trailer: bytes | bytearray, digest: bytes
) -> str | None:
    """``check_entry`` for an entry file read in pieces: its payload as consecutive
    buffers (a .npy header in one, the array in another: ``read_array_into``
    reads a payload straight into a caller's array), then its trailer."""
    if len(trailer) != TRAILER_SIZE:
        return f"a trailer of {len(trailer)} bytes"
    trailer = bytes(trailer)
    problem = _check_trailer(trailer, sum(memoryview(p).nbytes for p in payload), digest)
    if problem is None:
        hasher = key.hasher()
        for piece in payload:
            hasher.update(piece)
        if hasher.intdigest() != _checksum_of(trailer):
            problem = _CHECKSUM_MISMATCH
    return problem


class FileCheck(NamedTuple):
    head: bytes  # the payload's first bytes (up to 4 KiB: its .npy header)
    length: int  # the payload's length
    problem: str | None  # why the file must not be served, or None


def check_entry_file(fd: int, key: EntryKey, digest: bytes) -> FileCheck:
    """``check_entry`` for the entry file open at ``fd``: whole in one read if it is
    at most one piece (1 MiB), else in pieces so that at most one is in memory.
    Raises OSError."""
    size = os.fstat(fd).st_size
    if size < TRAILER_SIZE:
        return FileCheck(b"", 0, f"truncated to {size} bytes")
    length = size - TRAILER_SIZE
    if size <= _PIECE:  # one read, so one trip to the disk, not one per piece
        return check_entry_bytes(key, os.pread(fd, size, 0), digest, size)
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


def check_entry_bytes(key: EntryKey, data: bytes, digest: bytes, size: int) -> FileCheck:
    """``check_entry_file`` for an entry file of ``size`` bytes read whole into
    ``data`` (shorter if it shrank while being read)."""
    length = size - TRAILER_SIZE
    if len(data) < size:
        return FileCheck(data[:_HEAD], length, f"truncated to {len(data)} bytes while being read")
    return FileCheck(data[: min(length, _HEAD)], length, check_entry(key, data, digest))


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
