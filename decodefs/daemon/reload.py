"""What a serving process changes that the kernel may have cached: a reload, applied.

A new serving process finds, from the mount's numbers (numbers.py), its config
and its scan, what differs from what the mount served before: versions added
and removed, decode settings changed, originals added, removed and changed in
place, config keys. Once no earlier serving process answers any more, the
kernel is told to forget what would now be wrong: the names that stop
existing, and the pages of every array whose pixels change (in each size the
mount has seen), then the directories' attributes. Nothing here decides
what is served; it computes and says what changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..common.inodes import Kind, Node
from ..common.names import array_name
from ..common.source import SourceIndex
from .namespace import ROOT
from .numbers import MountNumbers, NumberChanges

__all__ = ["Invalidator", "Reload", "config_changes"]

log = logging.getLogger(__name__)

# The kernel's side (fs.FuseSession's static methods): forget a name in a directory,
# forget an inode's pages (or only its attributes); each says whether the kernel knew it.
Invalidator = tuple[Callable[[int, bytes], bool], Callable[..., bool]]


@dataclass
class Reload:
    """What this serving process serves differently from the mount's earlier ones."""

    numbers: MountNumbers
    changes: NumberChanges
    sources: Mapping[str, SourceIndex]
    changed: dict[str, list[int]] = field(default_factory=dict)  # originals changed in place
    # Originals whose readers changed (access = "originals": their arrays' attributes).
    readers_changed: dict[str, list[int]] = field(default_factory=dict)
    # access = "originals": shards and a mirror's folders show their source directory's
    # readers, which may have changed too (attributes only; a handful of directories).
    directories_have_readers: bool = False
    # Whether the kernel may hold directory attributes an earlier serving process gave.
    # Not in a mount's first: it gave every one itself. Forgetting them there would
    # race the kernel's first look-ups: the kernel drops the fresh attributes of a
    # permission check that a forget overtook, and decides on what it held, for the
    # mount's root its initial ones, with no permission bits: another user's first
    # open right after the mount answered EACCES.
    directories_seen: bool = True
    config: list[str] = field(default_factory=list)  # config keys changed: "key: a -> b"
    invalidated_names: int = 0
    invalidated_inodes: int = 0

    def describe(self) -> list[str]:
        """What changed, a line each, as `decodefs reload` prints it."""
        lines = [f"version {name} added ({len(self.sources[name])} originals)"
                 for name in self.changes.added]  # fmt: skip
        lines += [f"version {name} removed" for name, _ in self.changes.removed]
        lines += [
            f"version {name}: decode settings changed; its stored arrays are discarded and "
            "decoded again"
            for name in self.changes.redecoded
        ]
        for name, version in self.numbers.versions.items():
            if name in self.changes.added:
                continue
            added, gone = version.new_keys, len(version.gone_keys)
            changed = len(self.changed.get(name, ()))
            if added or gone or changed:
                lines.append(
                    f"version {name}: {added} originals added, {gone} removed, "
                    f"{changed} changed in place"
                )
        lines += [f"config: {line}" for line in self.config]
        return lines

    def invalidate(self, kernel: Invalidator) -> None:
        """Tell the kernel what to forget (blocking: a worker thread, while the loop
        serves, since an invalidation may wait for a request on the same node)."""
        forget_name, forget_inode = kernel
        names = inodes = 0
        for name, _ in self.changes.removed:
            names += forget_name(ROOT.ino, name.encode())
        for name, version in self.numbers.versions.items():
            sizes = sorted(self.numbers.sizes_seen(name))
            vid = version.version_id
            for size in sizes:
                for parent, child in self._gone_names(name, size):
                    names += forget_name(parent, child)
            if name in self.changes.redecoded:
                numbers: Iterable[int] = version.key_numbers
            else:
                numbers = [version.key_numbers[i] for i in self.changed.get(name, ())]
            numbers = list(numbers)
            for size in sizes:
                for number in numbers:
                    inodes += forget_inode(Node(Kind.ENTRY, vid, size, number).ino)
            for index in self.readers_changed.get(name, ()):
                for size in sizes:
                    ino = Node(Kind.ENTRY, vid, size, version.key_numbers[index]).ino
                    forget_inode(ino, attributes_only=True)
            if self.directories_have_readers:
                below = [n for n in version.folder_numbers if n] + [
                    n for n, shard in enumerate(version.shard_names) if shard is not None
                ]
                kind = Kind.FOLDER if version.folder_numbers else Kind.SHARD
                for size in sizes:
                    for number in below:
                        forget_inode(Node(kind, vid, size, number).ino, attributes_only=True)
            if self.directories_seen:  # their listings and mtimes changed: attributes only
                forget_inode(Node(Kind.VERSION, vid).ino, attributes_only=True)
                for size in sizes:
                    forget_inode(Node(Kind.SIZE, vid, size).ino, attributes_only=True)
        if self.directories_seen:
            forget_inode(ROOT.ino, attributes_only=True)
        self.invalidated_names, self.invalidated_inodes = names, inodes
        log.info("reload: the kernel forgot %d names and the pages of %d arrays", names, inodes)

    def _gone_names(self, version_name: str, size: int) -> Iterable[tuple[int, bytes]]:
        """(parent inode, name) of each name of ``version_name`` at ``size`` that went away."""
        version = self.numbers.versions[version_name]
        vid = version.version_id
        size_ino = Node(Kind.SIZE, vid, size).ino
        mirror = self.sources[version_name].mirror is not None
        for key, _ in version.gone_keys:
            if not mirror:
                yield size_ino, array_name(key).encode(errors="surrogateescape")
                shard = version.shards.number(key[:2])
                if shard is not None:
                    shard_ino = Node(Kind.SHARD, vid, size, shard).ino
                    yield shard_ino, array_name(key).encode(errors="surrogateescape")
            else:
                folder, _, base = key.rpartition("/")
                parent = version.folders.number(folder)
                if parent is not None:
                    yield (
                        _folder_ino(vid, size, parent),
                        array_name(base).encode(errors="surrogateescape"),
                    )
        for path, _ in version.gone_folders:
            folder, _, base = path.rpartition("/")
            parent = version.folders.number(folder)
            if parent is not None:
                yield _folder_ino(vid, size, parent), base.encode(errors="surrogateescape")
        for shard_name, _ in version.gone_shards:
            yield size_ino, shard_name.encode(errors="surrogateescape")


def _folder_ino(version: int, size: int, number: int) -> int:
    if number == 0:
        return Node(Kind.SIZE, version, size).ino
    return Node(Kind.FOLDER, version, size, number).ino


def config_changes(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> list[str]:
    """Each config key whose value changed, ``key: before -> after`` (versions added or
    removed are said apart)."""
    if before is None:
        return []
    flat_before, flat_after = _flatten(before), _flatten(after)
    lines = []
    for key in sorted(flat_before.keys() | flat_after.keys()):
        old, new = flat_before.get(key), flat_after.get(key)
        if old != new and not (key.startswith("versions.") and (old is None or new is None)):
            lines.append(f"{key}: {old!r} -> {new!r}")
    return lines


def _flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(item, Mapping):
            flat.update(_flatten(item, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = item
    return flat
