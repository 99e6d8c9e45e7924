"""The store's entry file format: a key's path, its integrity trailer, and the one check.

An entry file is a payload (the exact .npy bytes of the key's array) followed
by the trailer of protocol.py: magic, format, decoder fingerprint, payload
length and an xxh3-64 checksum seeded with the entry's key, so every entry
proves its own integrity on any filesystem, a file moved to another key's path
fails, and ``np.load`` reads the file as it is (numpy ignores bytes after the
array). Every reader of entries and L2 objects (the store, ``decodefs verify``,
``adopt``, ``read_array``, the cluster tier) checks them here, and nowhere
else: ``check_entry`` (bytes in hand) and ``check_entry_file`` (a descriptor)
give one ``EntryCheck`` whose verdict is ok, corrupt, foreign or stale. This
module reads only through a descriptor it is given, takes the .npy layout
from npy.py, and knows nothing of images or of walking a store (store/walk.py).

Where an entry lives: ``<version>/<size>/<shard>/<file name>``. A key without
``/`` (a uuid) has shard ``uuid[:2]`` and file name ``<uuid>.npy``. A key with
``/`` (a mirror version's relative path) has shard ``%`` + the first two hex
digits of the key's xxh3-64, and its file name is the key with ``%`` escaped as
``%25`` and ``/`` as ``%2F``, plus ``.npy``. A shard of three characters is
never a uuid's first two, so the two kinds of file never share a directory,
and every file name gives back its key (``EntryKey.from_store_path``).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

import xxhash

from .names import array_name, key_of
from .npy import HEADER_BOUND, npy_layout_problem
from .protocol import STORE_FORMAT, TRAILER, TRAILER_MAGIC, TRAILER_SIZE

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "STALE",
    "EntryCheck",
    "EntryKey",
    "Verdict",
    "check_entry",
    "check_entry_file",
    "check_entry_pieces",
    "encode_trailer",
    "layout_problem",
]

STALE: Final = "decoded with other settings or libraries"  # the reason of a stale entry
_CHECKSUM_MISMATCH: Final = "checksum mismatch (damaged, or another entry's file)"
_PIECE: Final = 1 << 20

_PATH_SHARD: Final = "%"  # starts the shard of a key with "/": never a uuid's shard


class EntryKey(NamedTuple):
    """One array: a tuple, so hashing it (pins, accesses, flights) is cheap."""

    version: str
    size: int
    key: str  # the original's key in its version: a uuid, or a mirror's relative path

    def __str__(self) -> str:
        return f"{self.version}/{self.size}/{self.key}"

    @property
    def relpath(self) -> str:
        """Where the entry lives under the store: ``<version>/<size>/<uu>/<uuid>.npy``
        for a uuid; see the module's docstring for a key with ``/``."""
        return f"{self.version}/{self.size}/{self.shard}/{self.file_name}"

    @property
    def shard(self) -> str:
        """The directory under ``<version>/<size>/`` that holds the entry."""
        if "/" in self.key:
            return _PATH_SHARD + xxhash.xxh3_64_hexdigest(os.fsencode(self.key))[:2]
        return self.key[:2]

    @property
    def file_name(self) -> str:
        """The entry's file name in its shard: one path component for any key."""
        if "/" in self.key:
            return array_name(self.key.replace("%", "%25").replace("/", "%2F"))
        return array_name(self.key)

    @classmethod
    def from_store_path(cls, version: str, size: int, shard: str, name: str) -> EntryKey | None:
        """The key whose entry is the file ``name`` in ``shard`` of ``<version>/<size>/``;
        None if the name is no entry's (in a shard of keys with ``/``: not the
        canonical escape of such a key, or not the shard its key hashes to)."""
        stem = key_of(name)
        if stem is None:
            return None
        if len(shard) <= 2:  # a uuid's shard (which may start with "%" too)
            return cls(version, size, stem)
        uuid = _unescape(stem)
        if uuid is None or "/" not in uuid:
            return None
        key = cls(version, size, uuid)
        return key if key.shard == shard else None

    def checksum(self, payload: bytes | bytearray | memoryview) -> int:
        """xxh3-64 of ``payload``, seeded so only this key's file verifies."""
        return xxhash.xxh3_64_intdigest(payload, seed=self.seed)

    def hasher(self) -> xxhash.xxh3_64:
        """The same checksum, fed piece by piece."""
        return xxhash.xxh3_64(seed=self.seed)

    @property
    def seed(self) -> int:
        """The checksum's seed: the xxh3-64 of ``str(self)``."""
        return int(xxhash.xxh3_64_intdigest(os.fsencode(str(self))))


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


# -- the check ----------------------------------------------------------------------


class Verdict(enum.Enum):
    """What a check found; only an OK entry may be served."""

    OK = "ok"
    CORRUPT = "corrupt"  # truncated, damaged, not decodefs's, another key's, not the .npy
    FOREIGN = "foreign"  # an entry of another decodefs store format (left alone in L2)
    STALE = "stale"  # decoded with other settings or libraries (another fingerprint)


class EntryCheck(NamedTuple):
    """One entry file's check: its verdict, why (empty if OK), and its payload's length."""

    verdict: Verdict
    reason: str
    length: int

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.OK


def check_entry(
    key: EntryKey, data: bytes | bytearray | memoryview, digest: bytes, size: int | None = None
) -> EntryCheck:
    """Whether the entry file ``data`` (whole) may be served for ``key``: its trailer,
    fingerprint ``digest``, length, checksum and the .npy layout of ``key.size``.
    ``size``: the file's size when it was read whole (``data`` is shorter if it
    shrank meanwhile)."""
    if size is not None and len(data) < size:
        reason = f"truncated to {len(data)} bytes while being read"
        return EntryCheck(Verdict.CORRUPT, reason, max(0, size - TRAILER_SIZE))
    if len(data) < TRAILER_SIZE:
        return EntryCheck(Verdict.CORRUPT, f"truncated to {len(data)} bytes", 0)
    length = len(data) - TRAILER_SIZE
    fields = TRAILER.unpack(bytes(data[length:]))
    bad = _check_trailer(fields, length, digest)
    if bad is not None:
        return EntryCheck(*bad, length)
    payload = memoryview(data)[:length]
    if key.checksum(payload) != fields[4]:
        return EntryCheck(Verdict.CORRUPT, _CHECKSUM_MISMATCH, length)
    return _checked_layout(key, payload, length)


def check_entry_pieces(
    key: EntryKey, payload: Sequence[Buffer], trailer: bytes | bytearray, digest: bytes
) -> EntryCheck:
    """``check_entry`` for an entry file read in pieces: its payload as consecutive
    buffers (its .npy header first, then the array: ``read_array_into`` reads a
    payload straight into a caller's array), then its trailer."""
    length = sum(memoryview(p).nbytes for p in payload)
    if len(trailer) != TRAILER_SIZE:
        return EntryCheck(Verdict.CORRUPT, f"a trailer of {len(trailer)} bytes", length)
    fields = TRAILER.unpack(bytes(trailer))
    bad = _check_trailer(fields, length, digest)
    if bad is not None:
        return EntryCheck(*bad, length)
    hasher = key.hasher()
    for piece in payload:
        hasher.update(piece)
    if hasher.intdigest() != fields[4]:
        return EntryCheck(Verdict.CORRUPT, _CHECKSUM_MISMATCH, length)
    return _checked_layout(key, memoryview(payload[0]) if payload else b"", length)


def check_entry_file(fd: int, key: EntryKey, digest: bytes) -> EntryCheck:
    """``check_entry`` for the entry file open at ``fd``: whole in one read if it is
    at most one piece (1 MiB), else in pieces so that at most one is in memory.
    Raises OSError."""
    size = os.fstat(fd).st_size
    if size < TRAILER_SIZE:
        return EntryCheck(Verdict.CORRUPT, f"truncated to {size} bytes", 0)
    if size <= _PIECE:  # one read, so one trip to the disk, not one per piece
        return check_entry(key, os.pread(fd, size, 0), digest, size)
    length = size - TRAILER_SIZE
    fields = TRAILER.unpack(os.pread(fd, TRAILER_SIZE, length))
    head = os.pread(fd, min(length, HEADER_BOUND), 0)
    bad = _check_trailer(fields, length, digest)
    if bad is not None:
        return EntryCheck(*bad, length)
    hasher = key.hasher()
    offset = 0
    while offset < length:
        piece = os.pread(fd, min(_PIECE, length - offset), offset)
        if not piece:
            reason = f"truncated to {offset} bytes while being read"
            return EntryCheck(Verdict.CORRUPT, reason, length)
        hasher.update(piece)
        offset += len(piece)
    if hasher.intdigest() != fields[4]:
        return EntryCheck(Verdict.CORRUPT, _CHECKSUM_MISMATCH, length)
    return _checked_layout(key, head, length)


def layout_problem(key: EntryKey, head: bytes | bytearray | memoryview, length: int) -> str | None:
    """Why a payload of ``length`` bytes starting with ``head`` (up to HEADER_BOUND
    bytes, or all of it) is not the .npy file of ``key``'s array, or None."""
    return npy_layout_problem(head, length, key.size)


def _checked_layout(key: EntryKey, head: bytes | memoryview, length: int) -> EntryCheck:
    """The verdict on an intact payload: OK if it is the .npy of ``key``'s array."""
    problem = npy_layout_problem(head, length, key.size)
    if problem is not None:
        return EntryCheck(Verdict.CORRUPT, problem, length)
    return EntryCheck(Verdict.OK, "", length)


def _check_trailer(
    fields: tuple[bytes, int, bytes, int, int], length: int, digest: bytes
) -> tuple[Verdict, str] | None:
    magic, fmt, recorded, recorded_length, _ = fields
    if magic != TRAILER_MAGIC:
        return Verdict.CORRUPT, "no integrity trailer (truncated or not written by decodefs)"
    if fmt != STORE_FORMAT:
        return Verdict.FOREIGN, f"store format {fmt}, expected {STORE_FORMAT}"
    if recorded != digest:
        return Verdict.STALE, STALE
    if recorded_length != length:
        return Verdict.CORRUPT, f"length {length}, trailer says {recorded_length}"
    return None
