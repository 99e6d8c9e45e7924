"""Index of one version's originals: uuid -> path, found by a recursive scan.

Rules: a file counts when its extension (any case) is configured; the uuid is
its stem; names starting with '.' are skipped (editor and macOS litter); a
symlink is followed only when it resolves inside the source. This module knows
nothing of decoding, the store or FUSE.

A version with ``layout = "mirror"`` is indexed by relative path instead: an
original's key (what the uuid is elsewhere) is its path without the extension
(``cat/0001``), every directory is a folder (``MirrorFolders``), and a
symlinked directory shows under the link's own path, as
``os.walk(followlinks=True)`` would, except that a directory is never entered
again below itself.

An index can be cached as JSON in a directory the caller names. It is reused
while every directory of the source has the mtime (and inode) it had when it
was listed: adding, removing or renaming an entry changes its directory's
mtime, so checking costs one stat per directory instead of listing every file.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import secrets
import stat
import time
from array import array
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

from .names import ARRAY_SUFFIX, key_of
from .protocol import NAME_MAX
from .readers import DAEMON_ONLY, Readers, directory_readers, file_readers
from .trusted import CREATE_FLAGS

__all__ = [
    "Duplicates",
    "Folder",
    "Layout",
    "MirrorFolders",
    "OriginalMissing",
    "Restat",
    "SourceError",
    "SourceIndex",
    "changed_originals",
    "restat_originals",
    "save_stamps",
    "scan_source",
]

log = logging.getLogger(__name__)

_CACHE_FORMAT: Final = 1
# A directory changed this close to the scan may have changed again within
# its filesystem's mtime granularity (seconds on some network filesystems).
_MTIME_SLACK_NS: Final = 2_000_000_000


# A version's layout: "uuid" keys an original by its file stem, "mirror" by its
# relative path without the extension. Its duplicates: stems found twice in a
# uuid version are an error, or are skipped.
Layout = Literal["uuid", "mirror"]
Duplicates = Literal["error", "skip"]


class SourceError(Exception):
    """The source cannot be indexed as configured (a user-fixable problem)."""


class OriginalMissing(Exception):
    """The original behind a uuid is gone, or now leads outside the source."""


class Folder(NamedTuple):
    """A directory of a mirror version."""

    path: str  # relative to the source, "/"-separated; "" for the source itself
    parent: int  # the folder it is in (the source itself: 0)
    subfolders: tuple[tuple[str, int], ...]  # (name, folder index), sorted by name
    files: range  # the indices of the originals directly in it, sorted by name


class MirrorFolders:
    """The folders of a mirror version and the originals each one holds.

    Folder 0 is the source itself; folders are in the order of their paths'
    components, so a parent comes before its children. Keys (relative paths
    without the extension) are sorted by (folder, name): each folder's
    originals are one run of indices, and within a run the keys are sorted.
    """

    def __init__(self, paths: Sequence[str], keys: Sequence[str]) -> None:
        """Raises ValueError unless ``paths`` and ``keys`` are a tree this module
        could have indexed (names, order, parents, lengths)."""
        self._positions: dict[str, int] = {}
        children: list[list[tuple[str, int]]] = []
        parents: list[int] = []
        previous = ""
        for i, path in enumerate(paths):
            if not isinstance(path, str):
                raise ValueError("a folder is not a string")
            order = _folder_order(path)
            parent_path, _, name = path.rpartition("/")
            if i == 0:
                parent = 0
                if path != "":
                    raise ValueError("the first folder is not the source itself")
            else:
                parent = self._positions.get(parent_path, -1)
                named = _valid_name(name) and len(os.fsencode(name)) <= NAME_MAX
                if parent < 0 or not named or order <= previous:
                    raise ValueError(f"folder {path!r} is not a folder decodefs lists")
                children[parent].append((name, i))
            self._positions[path] = i
            parents.append(parent)
            children.append([])
            previous = order
        if not paths:
            raise ValueError("there is no root folder")
        starts = [0] * len(paths)
        stops = [0] * len(paths)
        # One pass, kept lean: it checks a cached index of hundreds of thousands.
        find = self._positions.get
        last_position, last_name = -1, ""
        for index, key in enumerate(keys):
            folder, _, name = key.rpartition("/")
            position = find(folder, -1)
            if position < 0:
                raise ValueError(f"key {key!r} is in no folder")
            if position != last_position:
                if position < last_position:
                    raise ValueError(f"key {key!r} is out of order")
                starts[position] = index
                last_position = position
            elif name <= last_name:
                raise ValueError(f"key {key!r} is out of order, or twice")
            if not name or name[0] == "." or "\0" in name or _store_name_bytes(key) > NAME_MAX:
                raise ValueError(f"key {key!r} is not a name decodefs lists")
            stops[position] = index + 1
            last_name = name
        self.folders: tuple[Folder, ...] = tuple(
            Folder(path, parents[i], tuple(children[i]), range(starts[i], stops[i]))
            for i, path in enumerate(paths)
        )
        for holder in self.folders:
            for name, _ in holder.subfolders:
                stem = key_of(name)
                if stem:
                    key = f"{holder.path}/{stem}" if holder.path else stem
                    at = bisect.bisect_left(keys, key, holder.files.start, holder.files.stop)
                    if at < holder.files.stop and keys[at] == key:
                        raise ValueError(f"folder {name!r} and original {key!r} share a name")

    def __len__(self) -> int:
        return len(self.folders)

    @property
    def paths(self) -> list[str]:
        return [folder.path for folder in self.folders]

    def find(self, path: str) -> int | None:
        """The index of the folder at ``path`` ("" for the source itself)."""
        return self._positions.get(path)


@dataclass(frozen=True)
class SourceIndex:
    """The originals of one version, sorted by uuid (a mirror version: by folder
    and name, see MirrorFolders).

    Indices are stable for the life of the object, so callers may use them as
    compact keys (the daemon's numbers.py gives each key an inode number).
    """

    version: str
    root: str
    keys: Sequence[str]
    relpaths: Sequence[str]
    scanned_at_ns: int
    duplicates: dict[str, list[str]] = field(default_factory=dict)
    symlinks_outside: int = 0
    skipped_names: int = 0
    from_cache: bool = False
    mirror: MirrorFolders | None = None  # the folders of a mirror version
    # Each original's size and mtime (ns) as last seen, by index; -1 where never seen:
    # what ``changed_originals`` compares with (and records anew).
    sizes: array[int] = field(default_factory=lambda: array("q"), repr=False)
    mtimes: array[int] = field(default_factory=lambda: array("q"), repr=False)
    # Who may read each original (readers.py: owner, group, read bits; bits -1 where
    # never seen), and each directory that holds originals (by relative path, "": the
    # source itself), as last seen with the stamps.
    uids: array[int] = field(default_factory=lambda: array("q"), repr=False)
    gids: array[int] = field(default_factory=lambda: array("q"), repr=False)
    reads: array[int] = field(default_factory=lambda: array("q"), repr=False)
    folder_readers: dict[str, Readers] = field(default_factory=dict, repr=False)
    # Where and how it is cached, to save it again with new stamps (None: not cached).
    cache: tuple[str, dict[str, object], dict[str, list[int]]] | None = field(
        default=None, repr=False
    )
    # Non-empty while stamps seen are not in the cache yet (save_stamps); a list, as the
    # index is frozen.
    _unsaved: list[bool] = field(default_factory=list, repr=False)
    _positions: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self._positions:
            self._positions.update((uuid, i) for i, uuid in enumerate(self.keys))
        if len(self.sizes) != len(self.keys):
            self.sizes[:] = array("q", [-1]) * len(self.keys)
            self.mtimes[:] = array("q", [-1]) * len(self.keys)
        if len(self.reads) != len(self.keys):
            self.uids[:] = array("q", [0]) * len(self.keys)
            self.gids[:] = array("q", [0]) * len(self.keys)
            self.reads[:] = array("q", [-1]) * len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, key: str) -> int | None:
        return self._positions.get(key)

    def known(self, keys: list[str]) -> list[str]:
        """Those of ``keys`` this version has, in order."""
        positions = self._positions
        return [key for key in keys if key in positions]

    def readers(self, index: int) -> Readers:
        """Who may read the original at ``index`` (the daemon alone while never seen)."""
        bits = self.reads[index]
        return DAEMON_ONLY if bits < 0 else Readers(self.uids[index], self.gids[index], bits)

    def folder(self, relative: str) -> Readers:
        """Who may list the source's directory ``relative`` ("": the source itself)."""
        return self.folder_readers.get(relative, DAEMON_ONLY)

    def original_path(self, index: int) -> str:
        """The original's path, re-checked to still lie inside the source."""
        path = os.path.join(self.root, self.relpaths[index])
        real = os.path.realpath(path)
        if not _inside(real, self.root):
            raise OriginalMissing(f"{path} now resolves outside the source ({real})")
        if not os.path.isfile(real):
            raise OriginalMissing(f"{path} no longer exists")
        return real

    @property
    def layout(self) -> Layout:
        return "uuid" if self.mirror is None else "mirror"

    def prefix_range(self, prefix: str) -> range:
        """Indices of uuids whose first two characters are ``prefix``."""
        if not 1 <= len(prefix) <= 2:
            return range(0)
        if len(prefix) == 1:
            i = self.find(prefix)
            return range(i, i + 1) if i is not None else range(0)
        start = bisect.bisect_left(self.keys, prefix)
        # The end compares first two characters, not ``prefix`` plus one: a second
        # character of U+10FFFF has no successor.
        end = bisect.bisect_right(self.keys, prefix, lo=start, key=_first_two)
        return range(start, end)


def scan_source(
    version: str,
    root: os.PathLike[str] | str,
    extensions: Iterable[str],
    duplicates: Duplicates = "error",
    cache_dir: str | None = None,
    layout: Layout = "uuid",
) -> SourceIndex:
    """Index every original under ``root`` by its stem (``layout = "mirror"``: by
    its relative path): from the cache in ``cache_dir`` while the tree is
    unchanged, else by walking it (and caching)."""
    started = time.monotonic()
    root_real = os.path.realpath(root)
    if not os.path.isdir(root_real):
        raise SourceError(f"versions.{version}.source: {root} is not a directory")
    extension_set = frozenset(e.lower() for e in extensions)
    key = {
        "format": _CACHE_FORMAT,
        "root": root_real,
        "extensions": sorted(extension_set),
        "duplicates": duplicates,
    }
    if layout != "uuid":  # so that caches written before layouts existed stay valid
        key["layout"] = layout
    cache = os.path.join(cache_dir, f"{version}.json") if cache_dir else None
    stamps: dict[str, _Stamp] = {}
    index = _load_cache(version, cache, key, root_real, layout, stamps) if cache else None
    if index is None:
        index, dirs, complete = _walk(version, root_real, extension_set, duplicates, layout)
        if cache and complete:  # a listing that failed may succeed next time: walk again
            index = dataclasses.replace(index, cache=(cache, key, dirs))
        unseen = (-1, -1, 0, 0, -1)
        for i, k in enumerate(index.keys):  # what the last index saw of each original
            stamp = stamps.get(k, unseen)
            index.sizes[i], index.mtimes[i] = stamp[0], stamp[1]
            index.uids[i], index.gids[i], index.reads[i] = stamp[2], stamp[3], stamp[4]
        if index.cache is not None:
            _save_cache(index)
    log.info(
        "version %s: %d originals under %s, %s in %.2f s",
        version,
        len(index),
        root_real,
        "from the cached index" if index.from_cache else "indexed",
        time.monotonic() - started,
    )
    return index


def _walk(
    version: str,
    root: str,
    extensions: frozenset[str],
    duplicates: Duplicates,
    layout: Layout = "uuid",
) -> tuple[SourceIndex, dict[str, list[int]], bool]:
    """The index, the directories it depends on, and whether every listing succeeded."""
    mirror = layout == "mirror"
    walker = _Walker(root, extensions, mirror=mirror)
    walker.walk()
    walker.merge_aliases()
    if mirror:
        # A folder "x.npy" and an original "x.jpg" beside it would have one name in the mount.
        for folder in walker.folders:
            stem = key_of(folder)
            if stem is not None and not stem.endswith("/") and stem:
                paths = walker.found.get(stem)
                if paths is not None:
                    paths.append(f"{folder}/")
    what = "key" if mirror else "uuid"
    clashes = {uuid: sorted(paths) for uuid, paths in walker.found.items() if len(paths) > 1}
    if clashes and duplicates == "error":
        # Stems that repeat across folders (cat/0001.jpg, dog/0001.jpg) are what a
        # folder dataset looks like: the mirror layout keys them by path, apart.
        by_path = [u for u, paths in clashes.items() if len({_key_of(p) for p in paths}) > 1]
        example_key = min(by_path or clashes)
        example = ", ".join(clashes[example_key][:3])
        fix = (
            f'if these are class folders, set versions.{version}.layout = "mirror" (keys '
            f"become paths: {_key_of(clashes[example_key][0])!r}); else "
            if by_path and not mirror
            else ""
        )
        raise SourceError(
            f"versions.{version}.source: {len(clashes)} {what}(s) have more than one original "
            f"(e.g. {example_key!r}: {example}); {fix}rename them, or set "
            f'versions.{version}.duplicates = "skip" to leave them all out'
        )
    for uuid, paths in sorted(clashes.items()):
        log.warning(
            "version %s: %s %r has %d originals %s; left out",
            version,
            what,
            uuid,
            len(paths),
            paths,
        )
    unique = (u for u, paths in walker.found.items() if len(paths) == 1)
    keys = _mirror_sorted(unique) if mirror else sorted(unique)
    folders = MirrorFolders(sorted(walker.folders, key=_folder_order), keys) if mirror else None
    index = SourceIndex(
        version=version,
        root=root,
        keys=keys,
        relpaths=[walker.found[u][0] for u in keys],
        scanned_at_ns=time.time_ns(),
        duplicates=clashes,
        symlinks_outside=walker.symlinks_outside,
        skipped_names=walker.skipped_names,
        mirror=folders,
    )
    return index, walker.dirs, walker.listing_errors == 0


def _load_cache(
    version: str,
    path: str,
    key: dict[str, object],
    root: str,
    layout: Layout = "uuid",
    stamps: dict[str, _Stamp] | None = None,
) -> SourceIndex | None:
    """The cached index if the tree is as it was; ``stamps`` gets what it saw of each
    original even when the tree changed since (a re-walk compares with them)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.getuid():
                raise ValueError("it belongs to another user")
            cached = json.loads(f.read())
        if not isinstance(cached, dict) or cached.get("key") != key:
            return None
        sizes, mtimes = _cached_stamps(cached)
        uids, gids, reads, folders = _cached_readers(cached)
        if stamps is not None:
            seen = zip(sizes, mtimes, uids, gids, reads, strict=True)
            stamps.update(zip(cached["uuids"], seen, strict=True))
        mirror = None
        if layout == "mirror":
            _check_cached_mirror(cached)
            mirror = MirrorFolders(cached["folders"], cached["uuids"])
        else:
            _check_cached(cached)
        scanned_at = int(cached["scanned_at_ns"])
        for relative, (mtime_ns, inode) in cached["dirs"].items():
            st = os.stat(os.path.join(root, relative))
            if (st.st_mtime_ns, st.st_ino) != (mtime_ns, inode):
                log.info(
                    "version %s: %s changed since the index was cached", version, relative or "."
                )
                return None
            if mtime_ns >= scanned_at - _MTIME_SLACK_NS:
                return None  # changed too near the scan to trust its mtime
        return SourceIndex(
            version=version,
            root=root,
            keys=cached["uuids"],
            relpaths=cached["relpaths"],
            scanned_at_ns=scanned_at,
            duplicates=cached["duplicates"],
            symlinks_outside=int(cached["symlinks_outside"]),
            skipped_names=int(cached["skipped_names"]),
            from_cache=True,
            mirror=mirror,
            sizes=sizes,
            mtimes=mtimes,
            uids=uids,
            gids=gids,
            reads=reads,
            folder_readers=folders,
            cache=(path, key, cached["dirs"]),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the cached index %s: %s", path, exc)
        return None


def _check_cached(cached: dict[str, object]) -> None:
    """Raise ValueError unless ``cached`` is an index this module could have written.

    Whole-list string operations, not a loop per original: at 370,000
    originals this costs ~0.2 s of a ~1 s start. It guards against damage
    and against paths outside the source; the file is the daemon's alone
    (its owner and a 0700 directory are checked), so it does not check that
    each uuid is its path's stem.
    """
    keys, relpaths, dirs = cached["uuids"], cached["relpaths"], cached["dirs"]
    if not (isinstance(keys, list) and isinstance(relpaths, list) and len(keys) == len(relpaths)):
        raise ValueError("uuids and relpaths are not two lists of one length")
    if not (isinstance(dirs, dict) and isinstance(cached["duplicates"], dict)):
        raise ValueError("dirs or duplicates is not a mapping")
    if not all(isinstance(v, list) and len(v) == 2 for v in dirs.values()) or not all(
        type(n) is int for v in dirs.values() for n in v
    ):
        raise ValueError("a directory's mtime and inode are not two integers")
    if _outside(_joined(list(dirs))):
        raise ValueError("a directory leads outside the source")
    if not keys:
        return
    names = _joined(keys)  # raises TypeError for anything but strings
    if "/" in names or "\0." in names or _has_empty(names) or names.startswith("."):
        raise ValueError("a uuid is not a file name decodefs lists")
    too_long = NAME_MAX - len(ARRAY_SUFFIX)
    if max(map(len, keys)) * 4 > too_long and any(  # 4: the most UTF-8 bytes per character
        len(os.fsencode(u)) > too_long for u in keys
    ):
        raise ValueError("a uuid is too long for a file name")
    if not all(map(str.__lt__, keys, itertools.islice(keys, 1, None))):
        raise ValueError("uuids are not sorted and unique")
    paths = _joined(relpaths)
    if _outside(paths) or _has_empty(paths):
        raise ValueError("a path leads outside the source")


def _check_cached_mirror(cached: dict[str, object]) -> None:
    """Raise ValueError unless ``cached`` is a mirror index this module could have
    written. MirrorFolders checks the keys and folders; here each path must be
    its key plus an extension, so nothing leads outside the source."""
    keys, relpaths, dirs = cached["uuids"], cached["relpaths"], cached["dirs"]
    if not (isinstance(keys, list) and isinstance(relpaths, list) and len(keys) == len(relpaths)):
        raise ValueError("keys and relpaths are not two lists of one length")
    if not (isinstance(dirs, dict) and isinstance(cached["duplicates"], dict)):
        raise ValueError("dirs or duplicates is not a mapping")
    if not isinstance(cached["folders"], list):
        raise ValueError("folders is not a list")
    if not all(isinstance(v, list) and len(v) == 2 for v in dirs.values()) or not all(
        type(n) is int for v in dirs.values() for n in v
    ):
        raise ValueError("a directory's mtime and inode are not two integers")
    if _outside(_joined(list(dirs))):
        raise ValueError("a directory leads outside the source")
    _joined(keys)  # raises TypeError for anything but strings, ValueError for a NUL
    for key, relpath in zip(keys, relpaths, strict=True):
        if not isinstance(relpath, str) or not relpath.startswith(key):
            raise ValueError(f"{relpath!r} is not the path of key {key!r}")
        dot, extension = relpath[len(key) : len(key) + 1], relpath[len(key) + 1 :]
        if dot != "." or not extension.isalnum():
            raise ValueError(f"{relpath!r} is not the path of key {key!r}")


def _outside(joined: str) -> bool:
    """Whether a path of NUL-joined relative paths is absolute or has a ".." component."""
    if joined.startswith("/") or "\0/" in joined:
        return True
    return "/../" in f"/{joined.replace(chr(0), '/')}/"


def _has_empty(joined: str) -> bool:
    return "\0\0" in joined or joined.startswith("\0") or joined.endswith("\0") or not joined


def _joined(strings: list[object]) -> str:
    """``strings`` joined by NUL; ValueError if one holds a NUL itself."""
    joined = "\0".join(strings)  # type: ignore[arg-type]  # TypeError for a non-string
    if joined.count("\0") != max(len(strings) - 1, 0):
        raise ValueError("a name holds a NUL")
    return joined


def _cached_stamps(cached: dict[str, Any]) -> tuple[array[int], array[int]]:
    """The stamps a cached index recorded (-1 for each where it recorded none)."""
    count = len(cached["uuids"])
    sizes, mtimes = cached.get("sizes"), cached.get("mtimes")
    if not (isinstance(sizes, list) and isinstance(mtimes, list)):
        return array("q", [-1]) * count, array("q", [-1]) * count
    if len(sizes) != count or len(mtimes) != count:
        raise ValueError("sizes and mtimes are not one per original")
    return array("q", sizes), array("q", mtimes)  # TypeError for anything but integers


class Restat(NamedTuple):
    """What ``restat_originals`` found, by index."""

    changed: list[int]  # size or mtime not what the index last saw: the arrays are stale
    readers_changed: list[int]  # who may read it is not what the index last showed


def _cached_readers(
    cached: dict[str, Any],
) -> tuple[array[int], array[int], array[int], dict[str, Readers]]:
    """Who may read each original and folder, as a cached index recorded it (unseen
    where it recorded none)."""
    count = len(cached["uuids"])
    uids, gids, reads = cached.get("uids"), cached.get("gids"), cached.get("reads")
    folders = cached.get("folder_readers")
    if not all(isinstance(v, list) for v in (uids, gids, reads)) or not isinstance(folders, dict):
        return array("q", [0]) * count, array("q", [0]) * count, array("q", [-1]) * count, {}
    assert isinstance(uids, list) and isinstance(gids, list) and isinstance(reads, list)
    if not len(uids) == len(gids) == len(reads) == count:
        raise ValueError("uids, gids and reads are not one per original")
    known = {}
    for path, value in folders.items():
        if not (isinstance(value, list) and len(value) == 3 and all(type(n) is int for n in value)):
            raise ValueError("a folder's readers are not three integers")
        known[str(path)] = Readers(*value)
    # TypeError for anything but integers; OverflowError past 64 bits.
    return array("q", uids), array("q", gids), array("q", reads), known


def changed_originals(index: SourceIndex, threads: int = 16) -> list[int]:
    """``restat_originals(index).changed``."""
    return restat_originals(index, threads).changed


def restat_originals(index: SourceIndex, threads: int = 16, *, save: bool = True) -> Restat:
    """Stat every original: those whose size or mtime is not what ``index`` last saw
    (replaced or rewritten in place, so their arrays are stale), and those whose
    readers (readers.py: owner, group, mode and the directories above) changed; records
    what it sees now (and saves the cached index with it; with ``save`` false, later:
    ``save_stamps``, once what changed has been acted on). An original that cannot be
    stat'ed is left as it was: a read of it says why. Up to ``threads`` threads stat
    where a stat waits on storage (see ``_stat_all``)."""
    prefix = index.root.rstrip(os.sep) + os.sep
    paths = [prefix + relpath for relpath in index.relpaths]
    folders = _directories_above(index)
    if not paths:
        index.folder_readers.update(folders)
        return Restat([], [])
    seen = _stat_all(paths, threads)
    above = _StatsAbove()
    changed, readers_changed = [], []
    updated = index.folder_readers != folders
    index.folder_readers.clear()
    index.folder_readers.update(folders)
    sizes, mtimes = index.sizes, index.mtimes
    uids, gids, reads = index.uids, index.gids, index.reads
    file_readers_in = above.file_readers
    for i, found in enumerate(seen):
        if found is None:
            continue
        st, target_dir = found
        readers = file_readers_in(paths[i].rpartition(os.sep)[0] or os.sep, st)
        if target_dir is not None:  # a symlink: read through its path and its target's
            readers = readers._replace(bits=readers.bits & file_readers_in(target_dir, st).bits)
        if uids[i] != readers.uid or gids[i] != readers.gid or reads[i] != readers.bits:
            readers_changed.append(i)
            uids[i], gids[i], reads[i] = readers
            updated = True
        if sizes[i] == st.st_size and mtimes[i] == st.st_mtime_ns:
            continue
        if sizes[i] >= 0:  # seen before, and different now
            changed.append(i)
        sizes[i], mtimes[i] = st.st_size, st.st_mtime_ns
        updated = True
    if index.cache is not None and updated:
        index._unsaved[:] = [True]
        if save:
            save_stamps(index)
    return Restat(changed, readers_changed)


# How many threads stat the originals, from the mean time of a first few stats in one
# thread. A local stat is a few microseconds, mostly the GIL's, and threads only hand it
# back and forth (370k originals, warm: 1.7 s in one thread, 4.6 s in 16); one that reads
# inodes from a local disk overlaps a little (cold: 5.9 s in one, 5.0 s in 4, 8.9 s in
# 16); one that waits on a network file system's round trips overlaps them all.
_STAT_THREADS: Final = ((500e-6, 16), (50e-6, 4))  # (mean stat over this, threads)
_PROBE_STATS: Final = 512  # stat'ed in one thread first, to tell which


def _stat_all(paths: list[str], threads: int) -> list[tuple[os.stat_result, str | None] | None]:
    """``_stats(paths)``: the first ``_PROBE_STATS`` in this thread, the rest in as many
    threads (up to ``threads``) as their time calls for."""
    started = time.perf_counter()
    probe = _stats(paths[:_PROBE_STATS])
    rest = paths[_PROBE_STATS:]
    mean = (time.perf_counter() - started) / max(len(probe), 1)
    threads = min(threads, next((n for slower, n in _STAT_THREADS if mean > slower), 1))
    if not rest or threads <= 1:
        return probe + _stats(rest)
    chunk = -(-len(rest) // threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="restat") as pool:
        parts = pool.map(_stats, [rest[i : i + chunk] for i in range(0, len(rest), chunk)])
        return probe + [found for part in parts for found in part]


def save_stamps(index: SourceIndex) -> None:
    """Write the stamps ``restat_originals`` recorded into the cached index. Not before
    the changes they show were acted on: a process that saved them and died (or was
    let go, as a standby is at a reload) would leave the next one finding nothing
    changed while the kernel still held the old pages."""
    if index._unsaved and index.cache is not None:
        _save_cache(index)
        index._unsaved.clear()


def _stats(paths: list[str]) -> list[tuple[os.stat_result, str | None] | None]:
    """Each original's stat (followed), and for a symlink the directory it leads to."""
    found: list[tuple[os.stat_result, str | None] | None] = []
    for path in paths:
        try:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                found.append((os.stat(path), os.path.dirname(os.path.realpath(path))))
            else:
                found.append((st, None))
        except OSError:
            found.append(None)
    return found


class _StatsAbove:
    """The directories above originals, each stat'ed once (from ``/``, followed as
    ``open`` follows them); who may read an original below them."""

    def __init__(self) -> None:
        self._stats: dict[str, os.stat_result | None] = {}
        self._chains: dict[str, list[os.stat_result | None]] = {}
        self._masks: dict[tuple[str, int, int, int], Readers] = {}

    def chain(self, directory: str) -> list[os.stat_result | None]:
        """Stats of ``directory`` and every directory above it, from ``/`` down."""
        chain = self._chains.get(directory)
        if chain is None:
            parent = os.path.dirname(directory)
            chain = [*self.chain(parent)] if parent != directory else []
            chain.append(self._stat(directory))
            self._chains[directory] = chain
        return chain

    def file_readers(self, directory: str, st: os.stat_result) -> Readers:
        """Who may read the file ``st`` in ``directory``: past the directories of its
        path, and past those its path leads to (a symlinked directory on the way)."""
        # Originals of one folder mostly share an owner, a group and a mode.
        key = (directory, st.st_uid, st.st_gid, st.st_mode)
        readers = self._masks.get(key)
        if readers is None:
            readers = file_readers(st, self.chain(directory))
            real = os.path.realpath(directory)
            if real != directory:
                readers = readers._replace(
                    bits=readers.bits & file_readers(st, self.chain(real)).bits
                )
            self._masks[key] = readers
        return readers

    def directory_readers(self, directory: str) -> Readers:
        st = self._stat(directory)
        if st is None:
            return DAEMON_ONLY
        return directory_readers(st, self.chain(os.path.dirname(directory)))

    def _stat(self, directory: str) -> os.stat_result | None:
        if directory not in self._stats:
            try:
                self._stats[directory] = os.stat(directory)
            except OSError:
                self._stats[directory] = None
        return self._stats[directory]


def _directories_above(index: SourceIndex) -> dict[str, Readers]:
    """Who may list each directory the mount shows of the source: the source itself,
    and a mirror's folders."""
    above = _StatsAbove()
    relatives = index.mirror.paths if index.mirror is not None else [""]
    return {
        relative: above.directory_readers(os.path.join(index.root, relative).rstrip(os.sep))
        for relative in relatives
    }


def _save_cache(index: SourceIndex) -> None:
    assert index.cache is not None
    path, key, dirs = index.cache
    value: dict[str, object] = {
        "key": key,
        "scanned_at_ns": index.scanned_at_ns,
        "dirs": dirs,
        "uuids": list(index.keys),
        "relpaths": list(index.relpaths),
        "duplicates": index.duplicates,
        "symlinks_outside": index.symlinks_outside,
        "skipped_names": index.skipped_names,
        "sizes": list(index.sizes),
        "mtimes": list(index.mtimes),
        "uids": list(index.uids),
        "gids": list(index.gids),
        "reads": list(index.reads),
        "folder_readers": {path: list(readers) for path, readers in index.folder_readers.items()},
    }
    if index.mirror is not None:
        value["folders"] = index.mirror.paths
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    try:
        # The daemon's alone, whatever the umask.
        fd = os.open(tmp, os.O_WRONLY | CREATE_FLAGS, 0o600)
        with open(fd, "w", encoding="utf-8") as f:
            os.fchmod(fd, 0o600)
            # ensure_ascii: non-UTF-8 names survive as \udcXX escapes. dumps, not dump:
            # dump encodes in Python, piece by piece (370k originals: 6.7 s against 0.5 s).
            f.write(json.dumps(value))
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        log.warning("cannot cache the index at %s: %s", path, exc)


class _Walker:
    """Lists the source. By default a directory is entered once, however many
    symlinks lead to it; with ``mirror``, once per path that leads to it, but
    never again below itself (a symlink to an ancestor is a cycle)."""

    def __init__(self, root: str, extensions: frozenset[str], *, mirror: bool = False) -> None:
        self.root = root
        self.extensions = extensions
        self.mirror = mirror
        self.found: dict[str, list[str]] = {}  # uuid (mirror: key) -> relative paths
        self.folders: list[str] = []  # mirror: every directory listed, by its relative path
        self.symlinks_outside = 0
        self.skipped_names = 0
        # Relative path -> [mtime_ns, inode] when listed: the directories the index
        # depends on (also those holding a symlink's target, so a change there counts).
        self.dirs: dict[str, list[int]] = {}
        self.listing_errors = 0
        self._seen_dirs: set[tuple[int, int]] = set()
        self._prefix = len(root.rstrip(os.sep)) + 1

    def walk(self) -> None:
        root_stat = os.stat(self.root)
        root_id = (root_stat.st_dev, root_stat.st_ino)
        self._seen_dirs.add(root_id)
        # (directory, the directories on its path: (st_dev, st_ino), itself included)
        pending: list[tuple[str, frozenset[tuple[int, int]]]] = [(self.root, frozenset({root_id}))]
        while pending:
            directory, ancestors = pending.pop()
            if self.mirror:
                self.folders.append(directory[self._prefix :])
            try:
                # Its mtime before listing: a change made during the walk then
                # shows up as a mismatch when the cache is next checked.
                st = os.stat(directory)
                self.dirs[directory[self._prefix :]] = [st.st_mtime_ns, st.st_ino]
                entries = list(os.scandir(directory))
            except OSError as exc:
                self.listing_errors += 1
                log.warning("cannot list %s: %s; its originals are left out", directory, exc)
                continue
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                try:
                    self._entry(entry, pending, ancestors)
                except OSError as exc:
                    self.listing_errors += 1
                    log.warning("cannot index %s: %s; left out", entry.path, exc)

    def _entry(self, entry: os.DirEntry[str], pending: _Pending, ancestors: _Ancestors) -> None:
        if entry.is_symlink():
            self._symlink(entry, pending, ancestors)
        elif entry.is_dir(follow_symlinks=False):
            self._enter(entry.path, entry.stat(follow_symlinks=False), pending, ancestors)
        elif entry.is_file(follow_symlinks=False):
            self._file(entry.path, entry.name)

    def _enter(
        self, path: str, st: os.stat_result, pending: _Pending, ancestors: _Ancestors
    ) -> None:
        directory = (st.st_dev, st.st_ino)
        if self.mirror:
            if directory in ancestors:
                log.debug("not entering %s: it leads back to a directory above it", path)
                return
            pending.append((path, ancestors | {directory}))
        elif directory not in self._seen_dirs:
            self._seen_dirs.add(directory)
            pending.append((path, ancestors))

    def merge_aliases(self) -> None:
        """A symlink and its target with one stem are one original, not a clash."""
        for stem, paths in self.found.items():
            if len(paths) > 1:
                by_file = {
                    os.path.realpath(os.path.join(self.root, p)): p
                    for p in sorted(paths, reverse=True)
                }
                if len(by_file) < len(paths):
                    self.found[stem] = sorted(by_file.values())

    def _symlink(self, entry: os.DirEntry[str], pending: _Pending, ancestors: _Ancestors) -> None:
        target = os.path.realpath(entry.path)
        if not _inside(target, self.root):
            self.symlinks_outside += 1
            log.debug("not following %s: it leads outside the source (%s)", entry.path, target)
            return
        self._depend_on(os.path.dirname(target))  # where it may appear or go
        try:
            st = os.stat(target)
        except OSError:
            return  # dangling
        if stat.S_ISDIR(st.st_mode):
            self._enter(entry.path, st, pending, ancestors)
        elif stat.S_ISREG(st.st_mode):
            self._file(entry.path, entry.name)

    def _depend_on(self, directory: str) -> None:
        """Record ``directory`` (real, inside the source), or its nearest existing
        ancestor, as one the index depends on."""
        while _inside(directory, self.root):
            relative = directory[self._prefix :] if directory != self.root else ""
            if relative in self.dirs:
                return
            try:
                st = os.stat(directory)
            except OSError:
                directory = os.path.dirname(directory)  # its creation changes the parent
                continue
            self.dirs[relative] = [st.st_mtime_ns, st.st_ino]
            return

    def _file(self, path: str, name: str) -> None:
        stem, dot, extension = name.rpartition(".")
        if not dot or not stem or extension.lower() not in self.extensions:
            return
        relative = path[self._prefix :]
        key = relative[: -len(extension) - 1] if self.mirror else stem
        if _store_name_bytes(key) > NAME_MAX:
            self.skipped_names += 1
            log.warning(
                "skipping %s: its %s is too long for a file name",
                path,
                "key" if self.mirror else "uuid",
            )
            return
        self.found.setdefault(key, []).append(relative)


_Pending = list[tuple[str, frozenset[tuple[int, int]]]]
# What an index saw of an original: size, mtime (ns), owner, group, read bits (-1: unseen).
_Stamp = tuple[int, int, int, int, int]
_Ancestors = frozenset[tuple[int, int]]


def _store_name_bytes(key: str) -> int:
    """The length of the store's file name for ``key`` (entry.EntryKey.file_name):
    ``<key>.npy``, and for a key with "/", each "%" and "/" escaped in three bytes."""
    length = len(key) if key.isascii() else len(os.fsencode(key))
    if "/" in key:
        length += 2 * (key.count("/") + key.count("%"))
    return length + len(ARRAY_SUFFIX)


def _key_of(relative: str) -> str:
    """A mirror version's key for the original at ``relative``: the path without its extension
    (a folder listed among a clash's paths ends with "/" and is its own key)."""
    stem, dot, _ = relative.rstrip("/").rpartition(".")
    return stem if dot and not relative.endswith("/") else relative.rstrip("/")


def _folder_order(path: str) -> str:
    """The order of a mirror's folders: by their paths' components (NUL sorts before
    any character a name may hold, so a parent comes first, then its children)."""
    return path.replace("/", "\0")


def _mirror_sorted(keys: Iterable[str]) -> list[str]:
    """A mirror's keys in its order: by folder, then by name within each folder
    (where every key starts with the folder's path, so plainly sorted)."""
    by_folder: dict[str, list[str]] = {}
    for key in keys:
        by_folder.setdefault(key.rpartition("/")[0], []).append(key)
    return [
        key for folder in sorted(by_folder, key=_folder_order) for key in sorted(by_folder[folder])
    ]


def _valid_name(name: str) -> bool:
    """Whether ``name`` is a folder or file name a mirror lists (one path component)."""
    return bool(name) and name[0] != "." and "\0" not in name and "/" not in name


def _first_two(uuid: str) -> str:
    return uuid[:2]


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
