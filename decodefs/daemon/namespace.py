"""The mount's namespace: which names exist, their inodes, listings and attributes.

Inode numbers are computed from the mount's numbers (inodes.py, numbers.py):
the kernel can hold millions of entries without a table of lookups here, and
an entry has the same inode under ``<size>/`` and under ``<size>/<uu>/`` (one
page cache for both paths). A number means the same to every serving process
of the mount; a name that went away answers ENOENT by its old number.

A mirror version (source.MirrorFolders) has no shard directories: its size
directory is the source's root folder, and each folder lists its subfolders,
then its originals as ``<name>.npy``. In a folder, ``<name>.npy`` is the
original ``<folder>/<name>`` if there is one, else (like any other name) a
subfolder.

Attributes follow the config's ``access``: with "originals", an array shows its
original's owner, group and read bits, and a version's directories its source
directory's (readers.py), for the kernel to enforce; otherwise everything is the
daemon's, readable by whoever reaches the mount.

The tree reads the config (versions, sizes, size bounds, access) and the sources
(each version's originals) directly; it knows nothing of the engine or the store.
This module is filesystem logic only: it does not import pyfuse3.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import time
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from ..common import metrics
from ..common.config import Config
from ..common.inodes import (
    KIND_SHIFT,
    NUMBER_MASK,
    SIZE_MASK,
    SIZE_SHIFT,
    VERSION_MASK,
    VERSION_SHIFT,
    Kind,
    Node,
)
from ..common.names import ARRAY_SUFFIX_BYTES, key_of_bytes
from ..common.npy import npy_file_size
from ..common.protocol import FAILED_FILE, NAME_MAX, SIZE_NAME, STATUS_DIR, STATUS_FILES
from ..common.readers import Readers
from ..common.source import Folder, MirrorFolders, SourceIndex
from .numbers import MountNumbers, VersionNumbers

__all__ = [
    "ROOT",
    "STATUS_DIR_NODE",
    "ArrayRows",
    "Attributes",
    "Kind",
    "Node",
    "Tree",
]

log = logging.getLogger(__name__)

_STATUS_DIR_NAME: Final = STATUS_DIR.encode()
_FS_ENCODING: Final = sys.getfilesystemencoding()
_SIZE_KIND: Final = int(Kind.SIZE)
_ENTRY_KIND: Final = int(Kind.ENTRY)
_BELOW_KIND: Final = (1 << KIND_SHIFT) - 1  # an inode number's version, size and number


ROOT: Final = Node(Kind.SPECIAL, number=1)  # pyfuse3.ROOT_INODE == 1
STATUS_DIR_NODE: Final = Node(Kind.SPECIAL, number=2)  # protocol.STATUS_DIR, in the root
_FIRST_STATUS_FILE: Final = 3
_DIRECTORY_KINDS: Final = (Kind.VERSION, Kind.SIZE, Kind.SHARD, Kind.FOLDER)
_FILE_NOBODY: Final = stat.S_IFREG  # an original never seen: the daemon alone reads it
# With access = "originals", the list of failed originals (their paths) is the daemon's alone.
_PRIVATE_STATUS_FILES: Final = frozenset({FAILED_FILE})


class ArrayRows(NamedTuple):
    """Entry ``i`` of ``rows`` (a position) is named keys[i][strip:] + ".npy", has inode
    ``base_ino | numbers[i]`` and the attributes of ``sample``, but for its owner,
    group and mode where ``readers`` holds them (``readers.at(i)``); the listing
    resumes at offset i + offset_delta."""

    sample: Node
    rows: range
    keys: Sequence[str]
    numbers: Sequence[int]
    base_ino: int
    strip: int = 0  # a mirror folder's keys start with its path and a "/"
    offset_delta: int = 1  # a mirror folder lists its subfolders first
    readers: ArrayReaders | None = None  # access = "originals": each array's own


class ArrayReaders(NamedTuple):
    """Each original's owner, group and read bits (-1: never seen), by position."""

    uids: Sequence[int]
    gids: Sequence[int]
    reads: Sequence[int]

    def at(self, index: int) -> tuple[int, int, int]:
        """(uid, gid, st_mode) of the array of the original at ``index``."""
        bits = self.reads[index]
        if bits < 0:
            return 0, 0, _FILE_NOBODY
        return self.uids[index], self.gids[index], stat.S_IFREG | bits


@dataclass(frozen=True)
class Attributes:
    mode: int
    size: int
    mtime_ns: int
    nlink: int
    uid: int
    gid: int


_EMPTY: Final = SourceIndex(version="", root="/", keys=(), relpaths=(), scanned_at_ns=0)


class Tree:
    """Resolves names and lists directories from the config and the sources' indexes."""

    def __init__(
        self,
        config: Config,
        sources: Mapping[str, SourceIndex],
        status_files: Sequence[str] = STATUS_FILES,
        numbers: MountNumbers | None = None,
    ) -> None:
        """``status_files``: what the status directory lists, in order (a file's inode
        number follows from its place); every serving process of a mount lists
        protocol.STATUS_FILES, the default. ``numbers``: the mount's (default: the
        sorted positions, as at a mount's first start)."""
        self._config = config
        self._throttle = metrics.LogThrottle(log)  # sizes out of bounds: said, not flooded
        self.numbers = numbers or MountNumbers.positions(sources)
        # By version id, as inode numbers name versions ("": an id no version has now).
        self._versions = self.numbers.version_order()
        self._sources = tuple(sources.get(name, _EMPTY) for name in self._versions)
        self._version_index = {name.encode(): i for i, name in enumerate(self._versions) if name}
        self._status_files = [name.encode() for name in status_files]
        self._mirrors = tuple(source.mirror for source in self._sources)
        self._mounted_ns = time.time_ns()
        none = VersionNumbers(-1, array("q"), array("q"), array("q"), array("q"), [], {})
        self._numbers = tuple(self.numbers.versions.get(name, none) for name in self._versions)
        # For ``entry`` and ``entry_below``, per request: position <-> number.
        self._key_numbers = tuple(n.key_numbers for n in self._numbers)
        self._key_positions = tuple(n.key_positions for n in self._numbers)
        self._sizes = range(config.min_size, config.max_size + 1)
        self._finders = tuple(source.find for source in self._sources)
        self._uid, self._gid = os.getuid(), os.getgid()
        # access = "originals": each array's and directory's owner, group and mode are
        # its original's, its source directory's (None: the daemon's, for everyone).
        self.originals = config.access == "originals"
        self._readers = tuple(
            ArrayReaders(source.uids, source.gids, source.reads) if self.originals else None
            for source in self._sources
        )

    # -- names -> nodes -----------------------------------------------------

    def lookup(self, parent: Node, name: bytes) -> Node | None:
        if not _valid_component(name) or not self.exists(parent):
            return None
        if parent == ROOT:
            if name == _STATUS_DIR_NAME:
                return STATUS_DIR_NODE
            index = self._version_index.get(name)
            return Node(Kind.VERSION, version=index) if index is not None else None
        if parent == STATUS_DIR_NODE:
            if name in self._status_files:
                return Node(
                    Kind.SPECIAL, number=_FIRST_STATUS_FILE + self._status_files.index(name)
                )
            return None
        if parent.kind == Kind.VERSION:
            size = self._parse_size(name)
            if size is None and SIZE_NAME.fullmatch(name):
                config = self._config  # a size, but out of bounds: say why, not bare ENOENT
                self._throttle.log(
                    logging.WARNING,
                    "size-out-of-bounds",
                    "%s/%s: size %s is outside min_size..max_size (%d..%d): ENOENT",
                    self._versions[parent.version],
                    name.decode(),
                    name.decode(),
                    config.min_size,
                    config.max_size,
                )
            return Node(Kind.SIZE, parent.version, size) if size is not None else None
        if parent.kind in (Kind.SIZE, Kind.FOLDER):
            mirror = self._mirrors[parent.version]
            if mirror is not None:
                return self._lookup_in_folder(parent, mirror, name)
            if parent.kind == Kind.FOLDER:
                return None
            entry = self._lookup_entry(parent, name)
            if entry is not None:
                return entry
            return self._lookup_shard(parent, name)
        if parent.kind == Kind.SHARD:
            entry = self._lookup_entry(parent, name)
            shard = self._shard_name(parent)
            if entry is not None and self.key(entry)[:2] == shard:
                return entry
        return None

    def entry_below(self, parent_ino: int, name: bytes) -> int | None:
        """The inode of ``<uuid>.npy`` in the size directory ``parent_ino`` of a uuid
        version, or None for anything else (another directory, another name, a
        uuid with no original): ``lookup``'s hot path, without making a Node."""
        if parent_ino >> KIND_SHIFT != _SIZE_KIND or parent_ino & NUMBER_MASK:
            return None
        version = (parent_ino >> VERSION_SHIFT) & VERSION_MASK
        size = (parent_ino >> SIZE_SHIFT) & SIZE_MASK
        if (
            version >= len(self._versions)
            or self._mirrors[version] is not None
            or size not in self._sizes
            or not name.endswith(ARRAY_SUFFIX_BYTES)  # key_of_bytes, inlined: the hot path
            or not _valid_component(name)
            or len(name) == len(ARRAY_SUFFIX_BYTES)
        ):
            return None
        key = name[: -len(ARRAY_SUFFIX_BYTES)].decode(_FS_ENCODING, "surrogateescape")
        index = self._finders[version](key)
        if index is None:
            return None
        number = self._key_numbers[version][index]
        return (_ENTRY_KIND << KIND_SHIFT) | (parent_ino & _BELOW_KIND) | number

    def entry(self, ino: int) -> tuple[str, int, int] | None:
        """(version, size, original index) of the array ``ino`` names, or None (not an
        array's number, or one that names nothing): ``exists`` for open's hot path."""
        if ino >> KIND_SHIFT != _ENTRY_KIND:  # inodes.py's layout, without a call per request
            return None
        version = (ino >> VERSION_SHIFT) & VERSION_MASK
        size, number = (ino >> SIZE_SHIFT) & SIZE_MASK, ino & NUMBER_MASK
        if version < len(self._versions) and size in self._sizes:
            positions = self._key_positions[version]
            if number < len(positions):
                index = positions[number]
                if index >= 0:
                    return self._versions[version], size, index
        return None

    def position(self, entry: Node) -> int:
        """The original's index (in its version's sorted keys) that an entry node names;
        the caller has checked that it ``exists``."""
        return self._key_positions[entry.version][entry.number]

    def parent(self, node: Node) -> Node:
        if node.kind == Kind.VERSION or node in (ROOT, STATUS_DIR_NODE):
            return ROOT
        if node.kind == Kind.SPECIAL:
            return STATUS_DIR_NODE
        if node.kind == Kind.SIZE:
            return Node(Kind.VERSION, node.version)
        folder = self._folder(node)
        if folder is not None:
            return self._folder_node(node.version, node.size, folder.parent)
        return Node(Kind.SIZE, node.version, node.size)  # shard (entries: their listed parent)

    def is_dir(self, node: Node) -> bool:
        return node.kind in _DIRECTORY_KINDS or node in (ROOT, STATUS_DIR_NODE)

    def status_file_name(self, node: Node) -> str | None:
        position = node.number - _FIRST_STATUS_FILE
        if node.kind == Kind.SPECIAL and 0 <= position < len(self._status_files):
            return self._status_files[position].decode()
        return None

    def exists(self, node: Node) -> bool:
        """Whether an inode number the kernel hands back names something now: exactly
        the numbers ``lookup`` gives out (unused fields zero)."""
        if node.kind == Kind.SPECIAL:
            return node.version == node.size == 0 and (
                node in (ROOT, STATUS_DIR_NODE) or self.status_file_name(node) is not None
            )
        if node.version >= len(self._versions) or not self._versions[node.version]:
            return False
        if node.kind == Kind.VERSION:
            return node.size == node.number == 0
        if node.size not in self._sizes:
            return False
        if node.kind == Kind.SIZE:
            return node.number == 0
        numbers = self._numbers[node.version]
        if node.kind == Kind.FOLDER:
            return node.number > 0 and self._folder_position(node) is not None
        if node.kind == Kind.SHARD:
            names = numbers.shard_names
            return node.number < len(names) and names[node.number] is not None
        positions = numbers.key_positions
        return node.number < len(positions) and positions[node.number] >= 0

    # -- listings -----------------------------------------------------------

    def children(self, node: Node, start: int) -> Iterator[tuple[int, bytes, Node]]:
        """(next offset, name, node) from offset ``start``; offsets are stable.

        For the root, the status directory, version directories and a mirror's
        subfolders; size, shard and mirror folders list their arrays through
        ``array_rows``, after these.
        """
        if node == ROOT:
            names = [v.encode() for v in sorted(filter(None, self._versions))] + [_STATUS_DIR_NAME]
            for i in range(start, len(names)):
                child = self.lookup(ROOT, names[i])
                assert child is not None
                yield i + 1, names[i], child
        elif node == STATUS_DIR_NODE:
            for i in range(start, len(self._status_files)):
                yield (
                    i + 1,
                    self._status_files[i],
                    Node(Kind.SPECIAL, number=_FIRST_STATUS_FILE + i),
                )
        elif node.kind == Kind.VERSION:
            sizes = self._config.versions[self._versions[node.version]].sizes
            for i in range(start, len(sizes)):
                yield i + 1, str(sizes[i]).encode(), Node(Kind.SIZE, node.version, sizes[i])
        else:
            folder = self._folder(node)
            if folder is not None:
                subfolders = folder.subfolders
                for i in range(start, len(subfolders)):
                    name, index = subfolders[i]
                    yield (
                        i + 1,
                        os.fsencode(name),
                        self._folder_node(node.version, node.size, index),
                    )

    def array_rows(self, node: Node, start: int) -> ArrayRows | None:
        """For a size, shard or mirror folder, what its listing of arrays needs from
        ``start``; None for other directories. The fast path for hundreds of
        thousands of arrays: the caller loops over ``rows`` with no object per entry."""
        sample = Node(Kind.ENTRY, node.version, node.size, 0)
        keys = self._sources[node.version].keys
        numbers = self._key_numbers[node.version]
        folder = self._folder(node)
        if folder is not None:
            listed, files = len(folder.subfolders), folder.files  # offsets 1..listed: subfolders
            rows = range(files.start + max(0, start - listed), files.stop)
            strip = len(folder.path) + 1 if folder.path else 0
            delta = listed - files.start + 1
            readers = self._readers[node.version]
            return ArrayRows(sample, rows, keys, numbers, sample.ino, strip, delta, readers)
        if node.kind == Kind.SIZE:
            rows = range(start, len(keys))
        elif node.kind == Kind.SHARD:
            shard = self._shard_range(node)
            rows = range(max(start, shard.start), shard.stop)
        else:
            return None
        return ArrayRows(
            sample, rows, keys, numbers, sample.ino, readers=self._readers[node.version]
        )

    # -- attributes ---------------------------------------------------------

    def attributes(self, node: Node, status_size: int = 0) -> Attributes:
        uid, gid = self._uid, self._gid
        if self.is_dir(node):
            mode = stat.S_IFDIR | 0o555
            readers = self._directory_readers(node)
            if readers is not None:
                uid, gid, mode = readers.uid, readers.gid, readers.directory_mode
            return Attributes(mode, 0, self._mtime(node), 2, uid, gid)
        if node.kind == Kind.ENTRY:
            mode = stat.S_IFREG | 0o444
            if self.originals:  # (a listing's sample may name no original: the daemon's)
                uid, gid, mode = self.entry_readers(node.ino) or (0, 0, _FILE_NOBODY)
            return Attributes(mode, npy_file_size(node.size), self._mtime(node), 1, uid, gid)
        mode = stat.S_IFREG | 0o444
        if self.originals and self.status_file_name(node) in _PRIVATE_STATUS_FILES:
            mode = stat.S_IFREG | 0o400
        return Attributes(mode, status_size, time.time_ns(), 1, uid, gid)

    def entry_readers(self, ino: int) -> tuple[int, int, int] | None:
        """(uid, gid, st_mode) of the array ``ino`` (an ``entry``) with access =
        "originals"; None otherwise (lookup's hot path)."""
        found = self.entry(ino)
        if found is None:
            return None
        readers = self._readers[(ino >> VERSION_SHIFT) & VERSION_MASK]
        return None if readers is None else readers.at(found[2])

    def _directory_readers(self, node: Node) -> Readers | None:
        """Who may list a version's directory (access = "originals"; None: everyone who
        reaches the mount): its source directory's readers."""
        if not self.originals or node.kind not in _DIRECTORY_KINDS:
            return None
        source = self._sources[node.version]
        folder = self._folder(node)
        return source.folder(folder.path if folder is not None else "")

    def _mtime(self, node: Node) -> int:
        if node.kind in (Kind.SIZE, Kind.SHARD, Kind.ENTRY, Kind.VERSION, Kind.FOLDER):
            return self._sources[node.version].scanned_at_ns
        return self._mounted_ns

    # -- helpers ------------------------------------------------------------

    def version_name(self, node: Node) -> str:
        return self._versions[node.version]

    def key(self, entry: Node) -> str:
        """The key (uuid, or a mirror's relative path) of the original an entry node names."""
        return self._sources[entry.version].keys[self.position(entry)]

    def _parse_size(self, name: bytes) -> int | None:
        if not SIZE_NAME.fullmatch(name):
            return None
        size = int(name)
        return size if size in self._sizes else None

    def _lookup_entry(self, parent: Node, name: bytes) -> Node | None:
        stem = key_of_bytes(name)
        if stem is None:
            return None
        key = os.fsdecode(stem)
        index = self._finders[parent.version](key)
        if index is None:
            return None
        return Node(
            Kind.ENTRY, parent.version, parent.size, self._key_numbers[parent.version][index]
        )

    def _folder_position(self, node: Node) -> int | None:
        """The index in its mirror of the folder ``node`` is (a size directory: the
        root folder, number 0), or None."""
        if node.kind not in (Kind.SIZE, Kind.FOLDER) or self._mirrors[node.version] is None:
            return None
        positions = self._numbers[node.version].folder_positions
        if node.number >= len(positions) or positions[node.number] < 0:
            return None
        return positions[node.number]

    def _folder(self, node: Node) -> Folder | None:
        """The mirror folder ``node`` is (a size directory: the root folder), or None."""
        position = self._folder_position(node)
        mirror = self._mirrors[node.version]
        if position is None or mirror is None:
            return None
        return mirror.folders[position]

    def _folder_node(self, version: int, size: int, index: int) -> Node:
        """The node of the folder at ``index`` of its mirror."""
        number = self._numbers[version].folder_numbers[index]
        if number == 0:
            return Node(Kind.SIZE, version, size)
        return Node(Kind.FOLDER, version, size, number)

    def _lookup_in_folder(self, parent: Node, mirror: MirrorFolders, name: bytes) -> Node | None:
        folder = self._folder(parent)
        if folder is None:
            return None
        prefix = f"{folder.path}/" if folder.path else ""
        stem = key_of_bytes(name)
        if stem is not None:
            key = prefix + os.fsdecode(stem)
            index = self._finders[parent.version](key)
            if index is not None:
                number = self._key_numbers[parent.version][index]
                return Node(Kind.ENTRY, parent.version, parent.size, number)
        child = mirror.find(prefix + os.fsdecode(name))
        return None if child is None else self._folder_node(parent.version, parent.size, child)

    def _lookup_shard(self, parent: Node, name: bytes) -> Node | None:
        if not 1 <= len(name) <= 8:  # two characters, up to 4 UTF-8 bytes each
            return None
        shard = os.fsdecode(name)
        if len(shard) > 2:
            return None
        number = self._numbers[parent.version].shard_numbers.get(shard)
        if number is None or not self._sources[parent.version].prefix_range(shard):
            return None
        return Node(Kind.SHARD, parent.version, parent.size, number)

    def _shard_name(self, shard: Node) -> str:
        name = self._numbers[shard.version].shard_names[shard.number]
        assert name is not None  # the caller has checked that the shard exists
        return name

    def _shard_range(self, shard: Node) -> range:
        return self._sources[shard.version].prefix_range(self._shard_name(shard))


def _valid_component(name: bytes) -> bool:
    return (
        0 < len(name) <= NAME_MAX
        and name not in (b".", b"..")
        and b"/" not in name
        and b"\0" not in name
    )
