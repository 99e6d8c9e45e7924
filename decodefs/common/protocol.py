"""What the daemon and every client agree on, defined once: names, flags, byte layouts.

Both sides import this module (the daemon's fs, engine and store layers; the
client's read_array, warm and CLI), and a reader in another language follows
docs/mount.md, which restates it. A change here is a change of the
on-disk or on-wire format: bump the number that says so (``STORE_FORMAT``,
``inodes.INODE_LAYOUT``). This module imports nothing of decodefs.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from collections.abc import Iterator, Mapping
from typing import Final, NamedTuple

__all__ = [
    "ACCESS_LINE_MAX",
    "ACCESS_REPORT_MAX",
    "ACCESS_SOCKET",
    "CHANGES_FILE",
    "CONFIG_FILE",
    "FAILED_FILE",
    "FS_NAME",
    "FS_TYPE",
    "METRICS_FILE",
    "NAME_MAX",
    "RECHECK_FLAG",
    "SIZE_NAME",
    "STATS_FILE",
    "STATUS_DIR",
    "STATUS_FILES",
    "STORE_FILE",
    "STORE_FORMAT",
    "STORE_MARKER",
    "TRAILER",
    "TRAILER_MAGIC",
    "TRAILER_SIZE",
    "WARM_FLAG",
    "FailedList",
    "FailedOriginal",
    "OpenRequest",
    "StoreStatus",
    "encode_access",
    "encode_accesses",
    "parse_access_groups",
    "parse_access_report",
]

# -- the mount -------------------------------------------------------------------------

FS_NAME: Final = "decodefs"  # the mount's fsname and subtype
FS_TYPE: Final = f"fuse.{FS_NAME}"  # as /proc/self/mountinfo names a decodefs mount
# The longest name, in bytes, of one path component in the mount and in the store
# (Linux's NAME_MAX): a longer name does not exist, and no source's key makes one.
NAME_MAX: Final = 255
# A size as a name (``<version>/<size>/``, an access report's size): canonical decimal,
# no sign, no leading zero, no spaces; its bounds are the config's.
SIZE_NAME: Final = re.compile(rb"[1-9][0-9]{0,4}")

# -- status files: <mount>/.decodefs/<name> -----------------------------------------------

STATUS_DIR: Final = ".decodefs"
STATS_FILE: Final = "stats.json"  # live counters (JSON)
METRICS_FILE: Final = "metrics"  # the same, in Prometheus text format
CONFIG_FILE: Final = "config.json"  # the effective config
STORE_FILE: Final = "store.json"  # where the store is, for read_array (client/discovery.py)
FAILED_FILE: Final = "failed.json"  # originals that failed to decode (FailedList)
# Every status file, as the status directory lists them: a file's inode number
# follows from its place here (namespace.py), the same in every serving process.
# A new file goes at the END, so that the others keep their numbers.
STATUS_FILES: Final = (STATS_FILE, METRICS_FILE, CONFIG_FILE, STORE_FILE, FAILED_FILE)


class FailedOriginal(NamedTuple):
    """One original that failed to decode at its last try (a row of failed.json)."""

    version: str
    key: str  # as the version names it: <key>.npy below <version>/<size>/
    path: str  # the original, as found in the version's source
    reason: str  # why it cannot be decoded (Pillow's words, shortened)
    sizes: tuple[int, ...]  # the sizes asked for when it failed
    time: float  # when it last failed (Unix time)

    def to_json(self) -> dict[str, object]:
        return {**self._asdict(), "sizes": list(self.sizes)}

    @classmethod
    def from_json(cls, value: Mapping[str, object]) -> FailedOriginal:
        """Raises ValueError (or KeyError, TypeError) for anything the daemon did not write."""
        sizes = value["sizes"]
        if not isinstance(sizes, list):
            raise TypeError(f"sizes is {sizes!r}, not a list")
        when = value["time"]
        if not isinstance(when, int | float):
            raise TypeError(f"time is {when!r}, not a number")
        return cls(
            version=str(value["version"]),
            key=str(value["key"]),
            path=str(value["path"]),
            reason=str(value["reason"]),
            sizes=tuple(int(s) for s in sizes),
            time=float(when),
        )


class FailedList(NamedTuple):
    """The content of failed.json: every original that failed to decode since the
    serving process started and has not decoded since, within a bound on the
    list's bytes; failures past that bound are only counted (``not_listed``)."""

    failed: tuple[FailedOriginal, ...]
    not_listed: int  # failures met while the list was full: not in ``failed``

    def to_json(self) -> bytes:
        value = {"failed": [f.to_json() for f in self.failed], "not_listed": self.not_listed}
        return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, value: Mapping[str, object]) -> FailedList:
        """Raises ValueError (or KeyError, TypeError) for anything the daemon did not write."""
        rows = value["failed"]
        if not isinstance(rows, list):
            raise TypeError(f"failed is {type(rows).__name__}, not a list")
        not_listed = value.get("not_listed", 0)
        if not isinstance(not_listed, int):
            raise TypeError(f"not_listed is {not_listed!r}, not an integer")
        return cls(tuple(FailedOriginal.from_json(row) for row in rows), not_listed)


class StoreStatus(NamedTuple):
    """The content of store.json: what read_array needs to read the store directly.

    An array's key is its file's name without ".npy", except in a mirror version
    (``layout = "mirror"``), where it is the file's path below
    ``<mount>/<version>/<size>/`` without ".npy" (``cat/0001``). Mirror versions'
    fingerprints are listed apart, under "mirror_versions": a reader that
    predates layouts would take ``0001`` for the key, finds no fingerprint for
    the version, and reads through the mount.
    """

    store: str  # the store directory
    digests: Mapping[str, str]  # version -> the decoder fingerprint its entries carry (hex)
    version_order: tuple[str, ...]  # versions by their id in inode numbers ("": none)
    inode_layout: int  # inodes.INODE_LAYOUT of the daemon
    min_size: int
    max_size: int
    access_socket: str | None  # where to report direct hits (None: nowhere)
    mirrors: frozenset[str] = frozenset()  # versions whose keys are relative paths

    def to_json(self) -> bytes:
        value = {
            "store": self.store,
            "versions": {v: d for v, d in self.digests.items() if v not in self.mirrors},
            "mirror_versions": {v: d for v, d in self.digests.items() if v in self.mirrors},
            "version_order": list(self.version_order),
            "inode_layout": self.inode_layout,
            "sizes": {"min": self.min_size, "max": self.max_size},
            "access_socket": self.access_socket,
        }
        return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoreStatus:
        """Raises ValueError (or KeyError, TypeError) for anything this daemon did not write."""
        value = json.loads(data)
        socket = value.get("access_socket")
        mirrors = {str(v): str(d) for v, d in value.get("mirror_versions", {}).items()}
        return cls(
            store=str(value["store"]),
            digests={**{str(v): str(d) for v, d in value["versions"].items()}, **mirrors},
            version_order=tuple(str(v) for v in value["version_order"]),
            inode_layout=int(value["inode_layout"]),
            min_size=int(value["sizes"]["min"]),
            max_size=int(value["sizes"]["max"]),
            access_socket=None if socket is None else str(socket),
            mirrors=frozenset(mirrors),
        )


# -- open flags on an array: requests to the daemon ---------------------------------------

WARM_FLAG: Final = os.O_NONBLOCK  # "store it ahead of training": low priority, never evicts
RECHECK_FLAG: Final = os.O_SYNC  # "check the stored entry again": a reader found it damaged


class OpenRequest(NamedTuple):
    warm: bool
    recheck: bool

    @classmethod
    def from_flags(cls, flags: int) -> OpenRequest:
        # O_SYNC includes O_DSYNC's bit: all of it must be set.
        return cls(bool(flags & WARM_FLAG), flags & RECHECK_FLAG == RECHECK_FLAG)


# -- the entry trailer: every store entry is .npy bytes + this -----------------------------

STORE_FORMAT: Final = 1
STORE_MARKER: Final = ".decodefs-store"  # in the store's root: {"format": STORE_FORMAT}
TRAILER_MAGIC: Final = b"DCFS"
# magic, format, decoder fingerprint (16 bytes), payload length, xxh3-64 of the payload
# seeded with xxh3-64 of "<version>/<size>/<uuid>" (see entry.py).
TRAILER: Final = struct.Struct("<4sI16sQQ")
TRAILER_SIZE: Final = TRAILER.size

# -- the access report: read_array tells the daemon about hits it read directly -------------

ACCESS_SOCKET: Final = ".access.sock"  # in the store; a unix datagram socket
# In the store: 8 bytes rewritten at random after any entry file changed (store/changes.py)
CHANGES_FILE: Final = ".changes"
ACCESS_REPORT_MAX: Final = 65536  # bytes per datagram the daemon reads
ACCESS_LINE_MAX: Final = 8192  # bytes of keys a reader puts in one line (encode_accesses)


def encode_access(version: str, size: int, key: str) -> bytes:
    """One report line: ``version<TAB>size<TAB>uuid<LF>`` (names as file-system bytes)."""
    return b"%s\t%d\t%s\n" % (os.fsencode(version), size, os.fsencode(key))


def encode_accesses(head: bytes, keys: list[bytes]) -> bytes:
    """The report lines of several hits in one directory: ``head`` (``encode_access``'s
    line up to its key) then the keys, one line for all of them
    (``version<TAB>size<TAB>key<TAB>key...<LF>``, the daemon parses it once), or one
    line each where a line of them all would be longer than ``ACCESS_LINE_MAX``. A key
    holding a tab or a line break names no array in a report: it is left out."""
    line = b"\t".join(keys)
    if line.count(b"\t") != len(keys) - 1 or _breaks(line):
        keys = [key for key in keys if not _breaks(key) and b"\t" not in key]
        if not keys:
            return b""
        line = b"\t".join(keys)
    if len(line) > ACCESS_LINE_MAX:
        return head + (b"\n" + head).join(keys) + b"\n"
    return head + line + b"\n"


def _breaks(data: bytes) -> bool:
    """Whether bytes.splitlines() splits ``data``."""
    return b"\n" in data or b"\r" in data


def parse_access_report(report: bytes) -> Iterator[tuple[str, int, str]]:
    """The well-formed lines of a datagram; anything else is skipped (anyone may send)."""
    for (version, size), keys in parse_access_groups(report).items():
        for key in keys:
            yield version, size, key


def parse_access_groups(report: bytes) -> dict[tuple[str, int], list[str]]:
    """``parse_access_report``'s keys by version and size, in order within each: a
    reader's datagram names one directory's keys, decoded here once a line."""
    groups: dict[tuple[str, int], list[str]] = {}
    heads: dict[tuple[bytes, bytes], list[str] | None] = {}
    encoding, errors = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
    for line in report.splitlines():
        fields = line.split(b"\t", 2)
        if len(fields) != 3:
            continue
        head = (fields[0], fields[1])
        keys = heads.get(head, _UNSEEN)
        if keys is _UNSEEN:
            keys = None
            if SIZE_NAME.fullmatch(fields[1]) is not None:
                group = (fields[0].decode(encoding, errors), int(fields[1]))
                keys = groups.setdefault(group, [])
            heads[head] = keys
        if keys is not None:
            keys.extend(fields[2].decode(encoding, errors).split("\t"))
    return groups


_UNSEEN: Final[list[str]] = []  # parse_access_groups: a head not seen yet
