"""The mount's inode numbers: given once, never changed in meaning while the mount lives.

The kernel keeps node ids (and the pages behind them) across a switch of
serving processes, so every serving process of one mount must read a number
as the first one did. A version gets an id, and each of its originals, mirror
folders and shards a number, the first time a serving process of the mount
sees it; a name that goes away keeps its number unused, and comes back to it.
They live in the mount's state directory (``numbers.json`` and one
``numbers-<id>.json`` per version), written before a serving process answers
anything, so a crash never loses one given out. Without a state directory (the
tests' in-process daemon) numbers are the sorted positions, as they would be
at a mount's first start.

Positions (an original's index in its sorted ``SourceIndex``) are what the
engine and the namespace's listings work with; numbers are what inode numbers
carry. This module maps one to the other; it knows the sources, not the tree.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..common.inodes import NUMBER_MASK, VERSION_MASK
from ..common.source import SourceIndex
from ..common.trusted import CREATE_FLAGS, DIRECTORY_FLAGS, READ_FLAGS

__all__ = ["Allocation", "MountNumbers", "NumberChanges", "NumbersLost", "VersionNumbers"]

log = logging.getLogger(__name__)

_FORMAT: Final = 1
_MOUNT_FILE: Final = "numbers.json"
_LOCK_FILE: Final = "numbers.lock"


class NumbersLost(Exception):
    """The mount's numbers are not where a serving process that is not the first expects
    them: it cannot know what the kernel's node ids mean, so it must not serve."""


class Allocation:
    """Numbers of one kind of name (keys, folders or shards) of one version."""

    def __init__(self, by_number: list[str | None]) -> None:
        self.by_number = by_number  # number -> name (None: never given, or no longer there)
        self._numbers = {name: n for n, name in enumerate(by_number) if name is not None}
        self.given = 0  # numbers given by this process

    def place(
        self, names: Sequence[str], *, first: str | None = None
    ) -> tuple[array[int], list[tuple[str, int]]]:
        """Numbers for ``names`` (in their order), giving new ones as needed, and the
        names that had a number but are not among ``names`` (with it). ``first``:
        a name that must have number 0 (a mirror's root folder)."""
        if first is not None and not self.by_number:
            self._give(first)
        if not self.by_number and len(set(names)) == len(names):  # a first start: in order
            return self._give_all(names), []
        numbers = array("q", bytes(8 * len(names)))
        present = set()
        for position, name in enumerate(names):
            number = self._numbers.get(name)
            if number is None:
                number = self._give(name)
            numbers[position] = number
            present.add(number)
        gone = [(name, n) for name, n in self._numbers.items() if n not in present]
        return numbers, gone

    def number(self, name: str) -> int | None:
        """The number ``name`` was given (whether or not it is there now)."""
        return self._numbers.get(name)

    def _give_all(self, names: Sequence[str]) -> array[int]:
        if len(names) > NUMBER_MASK + 1:
            raise OverflowError("a version has used every number an inode can hold")
        self.by_number = list(names)
        self._numbers = dict(zip(names, range(len(names)), strict=True))
        self.given = len(names)
        return array("q", range(len(names)))

    def _give(self, name: str) -> int:
        number = len(self.by_number)
        if number > NUMBER_MASK:
            raise OverflowError("a version has used every number an inode can hold")
        self.by_number.append(name)
        self._numbers[name] = number
        self.given += 1
        return number


@dataclass
class VersionNumbers:
    """One version's numbers, by position and back."""

    version_id: int
    key_numbers: array[int]  # by position in the source's sorted keys
    key_positions: array[int]  # by number: the position, or -1
    folder_numbers: array[int]  # a mirror's folders, by folder index (empty otherwise)
    folder_positions: array[int]
    shard_names: list[str | None]  # by number
    shard_numbers: dict[str, int]
    new_keys: int = 0  # originals given a number by this process (new since the last)
    gone_keys: list[tuple[str, int]] = field(default_factory=list)  # since the last server
    gone_folders: list[tuple[str, int]] = field(default_factory=list)
    gone_shards: list[tuple[str, int]] = field(default_factory=list)
    folders: Allocation = field(default_factory=lambda: Allocation([]))  # every folder given one
    shards: Allocation = field(default_factory=lambda: Allocation([]))


@dataclass
class NumberChanges:
    """What the mount's numbers say changed since the last serving process (its reload)."""

    added: list[str] = field(default_factory=list)  # versions
    removed: list[tuple[str, int]] = field(default_factory=list)  # (version, its id)
    redecoded: list[str] = field(default_factory=list)  # versions whose fingerprint changed
    sizes_seen: dict[str, set[int]] = field(default_factory=dict)  # version -> sizes looked up


class MountNumbers:
    """Every version's id and numbers for one serving process of the mount."""

    def __init__(
        self,
        ids: dict[str, int],
        versions: dict[str, VersionNumbers],
        state: _State | None,
        recorded: dict[str, Any],
        digests: Mapping[str, str | None],
    ) -> None:
        self.ids = ids  # every version the mount has seen -> its id (removed ones too)
        self.versions = versions  # the configured versions
        self._state = state
        self._recorded = recorded  # numbers.json, as this process sees the mount
        self._digests = dict(digests)  # each configured version's decoder fingerprint

    @classmethod
    def load(
        cls,
        state_dir: str | None,
        sources: Mapping[str, SourceIndex],
        digests: Mapping[str, str],
        *,
        first: bool,
    ) -> tuple[MountNumbers, NumberChanges]:
        """The numbers of this mount for ``sources`` (giving new ones, written before this
        returns), and what changed since the last serving process that applied its
        changes (``save_applied``: a process that prepares and is let go, as a standby
        is at a reload, leaves them for the next). ``digests``: each version's decoder
        fingerprint (hex). Raises NumbersLost, OSError."""
        state = _State(state_dir) if state_dir is not None else None
        with state.locked() if state is not None else contextlib.nullcontext():
            return cls._load(state, sources, digests, first=first)

    @classmethod
    def _load(
        cls,
        state: _State | None,
        sources: Mapping[str, SourceIndex],
        digests: Mapping[str, str],
        *,
        first: bool,
    ) -> tuple[MountNumbers, NumberChanges]:
        state_dir = state.path if state is not None else None
        recorded = state.read_mount() if state is not None else None
        if recorded is None:
            if state is not None and not first:
                raise NumbersLost(
                    f"{os.path.join(state_dir or '', _MOUNT_FILE)} is missing: the inode "
                    "numbers this mount gave out are lost"
                )
            recorded = {"format": _FORMAT, "versions": {}}
        # What the file keeps: the ids and numbers given here, not yet which versions
        # are present with which fingerprint (save_applied, once acted on).
        on_disk = json.loads(json.dumps(recorded))
        entries: dict[str, dict[str, Any]] = recorded["versions"]
        changes = NumberChanges()
        ids = {name: int(entry["id"]) for name, entry in entries.items()}
        versions: dict[str, VersionNumbers] = {}
        for name in sorted(sources):
            entry = entries.get(name)
            if entry is None:
                entry = entries[name] = {"id": _next_id(ids), "present": False, "sizes": []}
                on_disk["versions"][name] = dict(entry)
                ids[name] = entry["id"]
            if not entry.get("present"):
                changes.added.append(name)
            elif entry.get("digest") != digests.get(name):
                changes.redecoded.append(name)
            entry["present"], entry["digest"] = True, digests.get(name)
            changes.sizes_seen[name] = set(entry.get("sizes", []))
            versions[name] = _version_numbers(state, entry["id"], sources[name])
        for name, entry in entries.items():
            if name not in sources and entry.get("present"):
                entry["present"] = False
                changes.removed.append((name, int(entry["id"])))
                changes.sizes_seen[name] = set(entry.get("sizes", []))
        if state is not None:
            state.write_mount(on_disk)
        mine = {name: digests.get(name) for name in sources}
        return cls(ids, versions, state, recorded, mine), changes

    @classmethod
    def positions(cls, sources: Mapping[str, SourceIndex]) -> MountNumbers:
        """Numbers that are the sorted positions, versions in sorted order: a mount's
        first start, without a state directory to keep them in."""
        numbers, _ = cls.load(None, sources, {}, first=True)
        return numbers

    def version_order(self) -> tuple[str, ...]:
        """Version names by id ("" for an id no configured version has): store.json's
        ``version_order``."""
        order = [""] * (max(self.ids.values(), default=-1) + 1)
        for name in self.versions:
            order[self.ids[name]] = name
        return tuple(order)

    def note_size(self, version: str, size: int) -> bool:
        """Whether ``size`` of ``version`` is looked up for the first time: then it must be
        saved (``save_size``) before the lookup is answered (its pages may be cached)."""
        entry = self._recorded["versions"].get(version)
        return self._state is not None and entry is not None and size not in entry["sizes"]

    def save_size(self, version: str, size: int) -> None:
        """Record that ``size`` of ``version`` was looked up (blocking). Merged into what
        the file says: another serving process of the mount may have written since."""
        if self._state is None:
            return
        with self._state.locked():
            recorded = self._state.read_mount() or self._recorded
            entry = recorded["versions"].get(version)
            if entry is not None:
                entry["sizes"] = sorted({*entry.get("sizes", []), size})
                self._state.write_mount(recorded)
                self._recorded = recorded

    def save_applied(self) -> None:
        """Record which versions this process serves, with which fingerprints (blocking):
        once what changed since the last one is acted on, so that the next process finds
        only what changed after. Merged into what the file says (sizes, ids)."""
        if self._state is None:
            return
        with self._state.locked():
            recorded = self._state.read_mount() or self._recorded
            for name, entry in recorded["versions"].items():
                if name in self._digests:
                    entry["present"], entry["digest"] = True, self._digests[name]
                else:
                    entry["present"] = False
            self._state.write_mount(recorded)

    def refresh_sizes(self) -> None:
        """Take the sizes an earlier serving process recorded after this one started
        (blocking): they may have pages cached too."""
        if self._state is None:
            return
        with self._state.locked():
            recorded = self._state.read_mount()
        if recorded is None:
            return
        for name, entry in self._recorded["versions"].items():
            theirs = recorded["versions"].get(name, {}).get("sizes", [])
            entry["sizes"] = sorted({*entry.get("sizes", []), *theirs})

    def sizes_seen(self, version: str) -> set[int]:
        entry = self._recorded["versions"].get(version)
        return set(entry["sizes"]) if entry is not None else set()


def _next_id(ids: Mapping[str, int]) -> int:
    new = max(ids.values(), default=-1) + 1
    if new > VERSION_MASK:
        raise OverflowError(
            f"this mount has seen {new} versions, more than an inode number holds; remount"
        )
    return new


def _version_numbers(state: _State | None, version_id: int, source: SourceIndex) -> VersionNumbers:
    recorded = state.read_version(version_id) if state is not None else None
    keys = Allocation(list(recorded["keys"]) if recorded else [])
    folders = Allocation(list(recorded["folders"]) if recorded else [])
    shards = Allocation(list(recorded["shards"]) if recorded else [])
    key_numbers, gone_keys = keys.place(source.keys)
    if source.mirror is not None:
        folder_numbers, gone_folders = folders.place(source.mirror.paths, first="")
        shard_list: list[str] = []
    else:
        folder_numbers, gone_folders = array("q"), []
        shard_list = sorted({key[:2] for key in source.keys})
    _, gone_shards = shards.place(shard_list)
    present = set(shard_list)
    if state is not None and (keys.given or folders.given or shards.given or not recorded):
        state.write_version(
            version_id,
            {"keys": keys.by_number, "folders": folders.by_number, "shards": shards.by_number},
        )
    return VersionNumbers(
        version_id=version_id,
        key_numbers=key_numbers,
        key_positions=_inverse(key_numbers, len(keys.by_number)),
        folder_numbers=folder_numbers,
        folder_positions=_inverse(folder_numbers, len(folders.by_number)),
        shard_names=[name if name in present else None for name in shards.by_number],
        shard_numbers={n: i for i, n in enumerate(shards.by_number) if n in present},
        new_keys=keys.given if recorded else 0,
        gone_keys=gone_keys,
        gone_folders=gone_folders,
        gone_shards=gone_shards,
        folders=folders,
        shards=shards,
    )


def _inverse(numbers: Iterable[int], count: int) -> array[int]:
    positions = array("q", [-1]) * count
    for position, number in enumerate(numbers):
        positions[number] = position
    return positions


class _State:
    """The files of the mount's state directory (its holder's user's alone)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """numbers.json read, changed and written by one serving process at a time (one
        prepares while another serves)."""
        directory = os.open(self.path, DIRECTORY_FLAGS)
        try:
            fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=directory)  # fmt: skip
        finally:
            os.close(directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def read_mount(self) -> dict[str, Any] | None:
        value = self._read(_MOUNT_FILE)
        if value is None:
            return None
        if value.get("format") != _FORMAT or not isinstance(value.get("versions"), dict):
            raise NumbersLost(f"{os.path.join(self.path, _MOUNT_FILE)} is not this format")
        return value

    def write_mount(self, value: dict[str, Any]) -> None:
        self._write(_MOUNT_FILE, value)

    def read_version(self, version_id: int) -> dict[str, Any] | None:
        return self._read(f"numbers-{version_id}.json")

    def write_version(self, version_id: int, value: dict[str, Any]) -> None:
        self._write(f"numbers-{version_id}.json", value)

    def _read(self, name: str) -> dict[str, Any] | None:
        directory = os.open(self.path, DIRECTORY_FLAGS)
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=directory)
        except FileNotFoundError:
            return None
        finally:
            os.close(directory)
        with open(fd, "rb") as f:
            value = json.loads(f.read())
        if not isinstance(value, dict):
            raise NumbersLost(f"{os.path.join(self.path, name)} is not an object")
        return value

    def _write(self, name: str, value: dict[str, Any]) -> None:
        directory = os.open(self.path, DIRECTORY_FLAGS)
        tmp = f".{name}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | CREATE_FLAGS, 0o600, dir_fd=directory)
            with open(fd, "w", encoding="utf-8") as f:
                # ensure_ascii: non-UTF-8 names survive as escapes. (dumps: dump
                # encodes in Python, chunk by chunk, 5x slower for 370,000 names.)
                f.write(json.dumps(value))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=directory)
            raise
        finally:
            os.close(directory)
