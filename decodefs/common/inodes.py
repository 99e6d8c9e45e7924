"""Inode numbers of the mount: a node packs into 64 bits, computed, never allocated.

    bits 60-63  kind      bits 48-59  version id (given once per mount, numbers.py)
    bits 35-47  size      bits  0-34  number: an original's, a shard's or a mirror
                                      folder's (given once per mount, numbers.py)

Shared by the daemon's namespace (namespace.py, whose hot paths take the
fields apart with the shifts and masks below rather than make a Node), the
config (the largest size a field holds) and the client reader (client/reader.py),
which learns an array's version and size from the inode the kernel reports.
A change to the layout must change INODE_LAYOUT, which the daemon publishes
in store.json: a reader of another layout then reads through the mount.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Final, NamedTuple

__all__ = [
    "INODE_LAYOUT",
    "KIND_SHIFT",
    "NUMBER_MASK",
    "SIZE_LIMIT",
    "SIZE_MASK",
    "SIZE_SHIFT",
    "VERSION_MASK",
    "VERSION_SHIFT",
    "Kind",
    "Node",
]

INODE_LAYOUT: Final = 2
KIND_SHIFT: Final = 60
VERSION_SHIFT: Final = 48
VERSION_MASK: Final = (1 << (KIND_SHIFT - VERSION_SHIFT)) - 1  # 12 bits
SIZE_SHIFT: Final = 35
SIZE_MASK: Final = (1 << (VERSION_SHIFT - SIZE_SHIFT)) - 1  # 13 bits
NUMBER_MASK: Final = (1 << SIZE_SHIFT) - 1  # 35 bits
SIZE_LIMIT: Final = SIZE_MASK  # the largest size an inode number holds (8191)


class Kind(IntEnum):
    SPECIAL = 0  # root, the status directory and its files
    VERSION = 1
    SIZE = 2
    SHARD = 3
    ENTRY = 4
    FOLDER = 5  # a folder of a mirror version (its size directory is folder 0)


_KINDS: Final = tuple(Kind)  # Kind(n) without the enum lookup, per request


class Node(NamedTuple):
    """A name in the mount, decoded from its inode number (a tuple: cheap per request)."""

    kind: Kind
    version: int = 0
    size: int = 0
    number: int = 0  # an original's, a shard's or a folder's number, a status file's

    @property
    def ino(self) -> int:
        return (
            (self.kind << KIND_SHIFT)
            | (self.version << VERSION_SHIFT)
            | (self.size << SIZE_SHIFT)
            | self.number
        )

    @classmethod
    def from_ino(cls, ino: int) -> Node:
        """The node of ``ino``; raises IndexError for a kind no node has."""
        return cls(
            _KINDS[ino >> KIND_SHIFT],
            (ino >> VERSION_SHIFT) & VERSION_MASK,
            (ino >> SIZE_SHIFT) & SIZE_MASK,
            ino & NUMBER_MASK,
        )
