"""Reading a batch of one mount directory's arrays straight from the store, each checked as it is
copied (by rows.py: the compiled ``_batchread`` where it built, else its Python twin); knows
mounts, keys and kept entry files, not torch, samplers or the daemon.

A ``BatchReader`` serves one ``<mount>/<version>/<size>/`` directory and a fixed
array of keys (a dataset's), in one process. Per batch: a ``stat`` of the
directory and of the mount's root (which mount, which version and size, as
reader.py learns them from inodes), a ``pread`` of the store's change token,
and calls that read every stored entry of the batch into its row with the GIL
released, checking each as ``read_array`` does (regular file of the daemon's
alone, length, .npy header, trailer: magic, store format, decoder fingerprint,
length; the key-seeded xxh3-64 of the bytes read, computed as they are copied,
each piece while it is in the CPU's cache): ``read_kept`` for the keys whose
file is kept open, by the reader's own arrays, then ``read_rows`` for the
others, which it opens. The rows they could not serve are given back: the
caller reads those through the mount (``read_array_into``), where the daemon
decodes a miss and rebuilds an entry that failed its check.

``read_kept`` takes the stats and the token itself, before its reads: a warm
batch gives up the GIL once, not once per system call (a training loop that
holds the GIL would make each of them a wait). A batch whose stats say the
directory is no longer the mount the reader knew is read again from the start.

What is done once, not per array:
- a key is looked up on the mount (``lstat``, as ``read_array`` does) the first
  time it is read while that mount is the same one (reader.py's ``Mount``: a
  daemon restarted or another store.json makes a new one), not every time;
- up to ``open_entries`` entry files stay open (default: a quarter of the
  process's soft limit on open files and of ``vm.max_map_count``, at most
  65,536), and, read by the compiled reader, mapped: a hit in the page cache is
  then a copy out of the mapping, with no system call while the store's change
  token stays (a kept file is looked at, ``fstat``, once the token moved: an
  entry evicted, replaced by a rebuild or given other readers is never read
  through it, but opened again by its path, or read through the mount). Each
  batch also looks at as many other keys' kept files as it has arrays
  (``_sweep``, until a whole round was looked at under the current token), so
  an evicted entry's disk space is held for about an epoch at most. Entries
  past the bound are opened and closed by the same call, and read by
  ``preadv2``.
Entries not in the page cache are read in two passes: the first reads what is
cached and starts reading ahead every other entry of the batch at once
(``posix_fadvise(WILLNEED)``) and names the misses (``on_miss``) so their
decodes can start; the second reads the rest by ``preadv2``, by then on its way
from disk.
"""

from __future__ import annotations

import os
import resource
import stat
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt

from ..common.entry import EntryKey
from ..common.inodes import Kind, Node
from ..common.names import array_name
from ..common.npy import npy_header
from ..common.protocol import (
    CHANGES_FILE,
    STORE_FORMAT,
    TRAILER,
    TRAILER_MAGIC,
    TRAILER_SIZE,
    encode_access,
    encode_accesses,
)
from ..common.trusted import owned_alone
from . import rows as row_readers
from .discovery import Mount, current_mount, readable_mount
from .hits import report_hits
from .listing import LISTED_PER_LOOKUP, among, list_below, names_entry
from .reader import locate, stored_into
from .rows import (
    BAD,
    EXPECT_SIZE,
    GONE,
    MISSING,
    NOT_CACHED,
    NOWAIT,
    OK,
    TRUSTED,
    UNREAD,
    Looked,
    ReadRows,
    gone_py,
    major_faults,
    read_entries_py,
    read_kept_py,
)

__all__ = ["BatchReader"]

_OPEN_ENTRIES_MAX: Final = 65_536


def _default_open_entries() -> int:
    """A quarter of the soft limit on open files, and of the mappings a process may have."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = _OPEN_ENTRIES_MAX if soft == resource.RLIM_INFINITY else soft // 4
    return max(0, min(_OPEN_ENTRIES_MAX, files, _max_map_count() // 4))


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65_530  # Linux's default


@dataclass
class _Serving:
    """What one mount's store needs, found once per mount (per daemon) for the directory."""

    mount: Mount
    directory_ino: int
    version: str
    dirfd: int
    expect: bytes
    generation: int
    report_prefix: bytes  # a report line before its keys (protocol.encode_accesses)
    root_path: bytes  # the mount's root (mount.root), stated with each batch's first pass
    changes: int = -1  # the store's change token file (protocol.CHANGES_FILE), or none
    users: int = 0  # calls reading with dirfd or kept descriptors of this mount now
    listed: bool = False  # the directory was listed once for the lookups (_list)
    retired: bool = False
    # Kept descriptors and their mappings (0: none) to close once no call uses them: a
    # call in flight may be copying out of a mapping, or reading a descriptor's number.
    closing: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _FirstPass:
    """A batch's first pass (read_kept): each item's status and the kept descriptor it
    read (-1: none), and what the call looked at."""

    status: npt.NDArray[np.int32]
    used: npt.NDArray[np.int32]
    nowait: int  # NOWAIT, or TRUSTED: mapped entries copied without asking if they are cached
    looked: Looked


class BatchReader:
    """A directory's arrays by key index, a batch at a time, from the store (see the module).

    Safe to call from several threads at once (each with its own rows); a forked
    child may go on using one its parent made.
    """

    def __init__(
        self,
        directory: str,
        keys: npt.NDArray[np.bytes_],
        size: int,
        open_entries: int | None = None,
        read_rows: ReadRows | None = None,
    ) -> None:
        self.directory = directory
        self._directory_path = os.fsencode(directory)
        self.size = size
        self.open_entries = _default_open_entries() if open_entries is None else open_entries
        self._read_rows: ReadRows = read_rows or row_readers.compiled or read_entries_py
        self._read_kept: Callable[..., tuple[int, ...]] = read_kept_py
        self._gone: Callable[..., None] = gone_py
        compiled = self._read_rows is row_readers.compiled
        if compiled and row_readers.compiled_gone is not None:
            self._gone = row_readers.compiled_gone
        if compiled and row_readers.compiled_kept is not None:
            self._read_kept = row_readers.compiled_kept
        self._keys = keys
        self._header = npy_header(size)
        self._row_bytes = size * size * 3
        count = len(keys)
        self._fds = np.full(count, -1, np.int32)  # a kept descriptor per key, or -1
        self._maps = np.zeros(count, np.uint64)  # its mapping's address (compiled reads), or 0
        # Each mapping is one of the process's max_map_count (65,530 by default): kept
        # files past half of that are not mapped at all.
        self._map = compiled and self.open_entries <= _max_map_count() // 2
        self._length = len(self._header) + self._row_bytes + TRAILER_SIZE
        self._verified = np.zeros(count, np.uint32)  # the generation a key was looked up in
        self._seeds = np.zeros(count, np.uint64)
        # A kept file's ctime when opened, and the store's change token when it was last
        # looked at: while the token stays, nothing in the store changed, and it is not.
        self._ctimes = np.zeros(count, np.int64)
        self._checked = np.zeros(count, np.uint64)
        self._lock = threading.Lock()  # the fields below, and _fds' changes
        self._serving: _Serving | None = None
        self._kept = 0
        self._sweep_from = 0  # where the next sweep of kept files starts (_sweep)
        self._round = 0  # the change token the sweep's round began under
        self._quiet = 0  # a token under which a whole round was looked at (0: none yet)
        # Whether the last batch found all its entries in the page cache: the next one then
        # copies mapped entries without asking (TRUSTED), until a batch takes a major fault.
        self._cached = False
        _readers.add(self)
        # A reader let go of closes its kept files (a dataset made per epoch must not
        # leak a quarter of the process's descriptors each time).
        self._box: list[_Serving | None] = [None]  # _serving, as the finalizer sees it
        weakref.finalize(self, _let_go, self._box, self._fds, self._maps, self._length)

    @property
    def kept(self) -> int:
        """How many entry files are open now."""
        return self._kept

    def read(
        self,
        indices: Sequence[int] | npt.NDArray[np.int64],
        rows: npt.NDArray[np.uint8],
        on_miss: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Read key ``indices[p]``'s array into ``rows[p]`` for each position ``p`` whose
        entry the store holds, checked and reported to the daemon as a hit. Returns
        the other positions, after calling ``on_miss(p)`` for each as soon as it is
        known (before the entries not in the page cache are read): the caller reads
        those through the mount. ``rows``: writable, C-contiguous uint8
        ``[len(indices), size, size, 3]``."""
        count = len(indices)
        index = np.asarray(indices, np.int64).reshape(count) % max(1, len(self._keys))
        serving = self._in_use()
        if serving is not None:  # as last found: the first pass says if it still is
            try:
                first = self._first_pass(serving, index, rows)
                if self._still_serving(serving, first.looked):
                    return self._read(serving, index, rows, on_miss, first)
            finally:
                self._end(serving)
        serving = self._begin()  # none found yet, or the first pass found another mount
        if serving is None:
            return self._give_back(range(count), on_miss)
        try:
            return self._read(serving, index, rows, on_miss, self._first_pass(serving, index, rows))
        finally:
            self._end(serving)

    def close(self) -> None:
        """Close the kept entry files (the reader opens them again if used)."""
        with self._lock:
            serving, self._serving = self._serving, None
            self._box[0] = None
            if serving is not None:
                self._retire(serving)

    # -- one batch -----------------------------------------------------------------

    def _first_pass(
        self, serving: _Serving, index: npt.NDArray[np.int64], rows: npt.NDArray[np.uint8]
    ) -> _FirstPass:
        """The keys with a kept file read, in one call that touches nothing else, and
        first looks at the directory, the mount's root and the store's change token
        (the GIL is released once for all of it)."""
        count = len(index)
        status, used = np.empty(count, np.int32), np.empty(count, np.int32)
        nowait = TRUSTED if self._cached and self._map else NOWAIT
        looked = self._read_kept(
            rows,
            self._row_bytes,
            index,
            self._verified,
            serving.generation,
            self._fds,
            self._maps,
            self._seeds,
            self._header,
            serving.expect,
            nowait,
            self._checked,
            self._ctimes,
            status,
            used,
            self._directory_path,
            serving.root_path,
            serving.changes,
        )
        return _FirstPass(status, used, nowait, Looked(*looked))

    def _read(
        self,
        serving: _Serving,
        index: npt.NDArray[np.int64],
        rows: npt.NDArray[np.uint8],
        on_miss: Callable[[int], None] | None,
        first: _FirstPass,
    ) -> list[int]:
        count = len(index)
        status, token, nowait = first.status, first.looked.token, first.nowait
        trusted = nowait == TRUSTED
        if not first.looked.failed:  # every array a hit, read and checked (warm epochs)
            self._cached = first.looked.faults == 0 if trusted else True
            self._sweep(serving, count, token)
            self._report(serving, self._keys[index].tolist())
            return []
        self._let_go_of_gone(serving, index, status, first.used)
        faults = major_faults() if trusted else 0
        opening = np.flatnonzero((status == UNREAD) | (status == GONE)).astype(np.int32)
        if len(opening):  # the rest: looked up on the mount, if need be, and opened
            status[opening] = self._open(serving, index[opening], opening, rows, nowait, token)
        if trusted:
            self._cached = first.looked.faults == 0 and major_faults() == faults
        else:
            self._cached = not (status == NOT_CACHED).any()
        keys = index.tolist()
        misses = np.flatnonzero(status == MISSING).tolist()
        if on_miss is not None:
            for p in misses:
                on_miss(p)
        again = np.flatnonzero((status == NOT_CACHED) | (status == GONE)).astype(np.int32)
        if len(again):  # not in the page cache (on its way now), or to open again
            status[again] = self._open(serving, index[again], again, rows, 0, token)
        self._sweep(serving, count, token)
        hits = np.flatnonzero(status == OK).tolist()
        given_back = []
        for p in np.flatnonzero((status != OK) & (status != MISSING)).tolist():
            # BAD: reader.py reads it again and says why (reporting it if fine after all)
            if status[p] != BAD or not self._recheck(serving, keys[p], rows[p]):
                given_back.append(p)
        self._report(serving, self._keys[index[hits]].tolist())
        return sorted(misses + self._give_back(given_back, on_miss))

    def _open(
        self,
        serving: _Serving,
        index: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int32],
        rows: npt.NDArray[np.uint8],
        nowait: int,
        token: int,
    ) -> npt.NDArray[np.int32]:
        """The statuses of reading keys ``index`` into rows ``positions``: a key not yet
        looked up on this mount is looked up first (one the mount does not serve is
        MISSING); each is then read by its kept file, if one is kept now (another
        call's, or this one's first pass), else opened by its name."""
        known = self._verified[index] == serving.generation
        if not known.all():
            if not self._list(serving):  # (listed now: every key was looked up after it)
                for p in np.flatnonzero(~known).tolist():
                    self._verify(serving, int(index[p]))
            known = self._verified[index] == serving.generation
        fds = np.where(known, self._fds[index], -1).astype(np.int32)
        maps = np.where(known, self._maps[index], 0).astype(np.uint64)
        names: list[bytes | None] = [None] * len(index)
        for p in np.flatnonzero(known & (fds < 0)).tolist():
            names[p] = self._relpath(serving, int(index[p]))
        status = np.empty(len(index), np.int32)
        self._call(serving, rows, index, positions, fds, maps, names, nowait, token, status=status)
        return status

    def _let_go_of_gone(
        self,
        serving: _Serving,
        index: npt.NDArray[np.int64],
        status: npt.NDArray[np.int32],
        used: npt.NDArray[np.int32],
    ) -> None:
        """Let go of the kept files read_kept found GONE (unless let go of already)."""
        gone = np.flatnonzero(status == GONE).tolist()
        if gone:
            with self._lock:
                for p in gone:
                    i = int(index[p])
                    if self._fds[i] == used[p] and not serving.retired:
                        self._release(serving, i)

    def _report(self, serving: _Serving, keys: list[bytes]) -> None:
        """The daemon's LRU order sees these hits (a report line for them all)."""
        if keys:
            lines = encode_accesses(serving.report_prefix, keys)
            report_hits(serving.mount.access_socket, lines, len(keys))

    def _call(
        self,
        serving: _Serving,
        rows: npt.NDArray[np.uint8],
        index: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int32],
        fds: npt.NDArray[np.int32],
        maps: npt.NDArray[np.uint64],
        names: list[bytes | None],
        nowait: int,
        token: int,
        *,
        status: npt.NDArray[np.int32],
    ) -> None:
        opening = len(names) - names.count(None)
        with self._lock:  # room for descriptors, reserved before the call
            room = max(0, min(opening, self.open_entries - self._kept))
            self._kept += room
        kept = 0
        checked, ctimes = self._checked[index], self._ctimes[index]
        try:
            kept = self._read_rows(
                serving.dirfd,
                rows,
                self._row_bytes,
                positions,
                fds,
                maps,
                names,
                self._seeds[index],
                self._header,
                serving.expect,
                serving.mount.owner,
                room,
                self._map,
                nowait,
                token,
                checked,
                ctimes,
                status,
            )
        finally:
            self._keep(serving, index, fds, maps, checked, ctimes, status, room, kept)

    def _keep(
        self,
        serving: _Serving,
        index: npt.NDArray[np.int64],
        fds: npt.NDArray[np.int32],
        maps: npt.NDArray[np.uint64],
        checked: npt.NDArray[np.uint64],
        ctimes: npt.NDArray[np.int64],
        status: npt.NDArray[np.int32],
        room: int,
        kept: int,
    ) -> None:
        """Record the descriptors (and mappings) a call left open, and let go of kept ones
        whose file is gone. Kept descriptors are let go of here alone, under the lock,
        and closed once no call uses them (_release)."""
        with self._lock:
            self._kept -= room - kept
            changed = np.flatnonzero((fds != self._fds[index]) | (status == GONE)).tolist()
            for p in changed:
                i = int(index[p])
                fd, was = int(fds[p]), int(self._fds[i])
                if status[p] == GONE:
                    if was == fd and not serving.retired:  # (retired: already let go of)
                        self._release(serving, i)
                elif fd != was and fd >= 0:  # opened and left open by the call
                    if was >= 0 or serving.retired:  # another thread kept one, or a new mount
                        serving.closing.append((fd, int(maps[p])))
                        self._kept -= 1
                    else:
                        self._fds[i], self._maps[i] = fd, maps[p]
            # What the call learnt of the files kept now (a file looked at, or opened).
            ours = (fds >= 0) & (self._fds[index] == fds)
            self._checked[index[ours]] = checked[ours]
            self._ctimes[index[ours]] = ctimes[ours]

    def _release(self, serving: _Serving, i: int) -> None:
        """Under _lock: key ``i``'s kept file is no longer read; closed (and unmapped)
        once no call of ``serving`` is in flight."""
        serving.closing.append((int(self._fds[i]), int(self._maps[i])))
        self._fds[i], self._maps[i], self._checked[i] = -1, 0, 0
        self._kept -= 1

    def _sweep(self, serving: _Serving, count: int, token: int) -> None:
        """Let go of the kept files of the next ``count`` keys whose entry is gone (evicted,
        or rebuilt): a batch of N arrays looks at the next N keys' in turn, so a kept file
        holds an evicted entry's disk space for about an epoch at most, even if its key
        is not read again. Once a whole round of them was looked at under one change
        token, none is again while the token stays: nothing in the store changed."""
        with self._lock:
            if token and token == self._quiet:
                return
            start = self._sweep_from
            if start == 0:
                self._round = token  # the token this round began under
            window = self._fds[start : start + count]
            self._sweep_from = 0 if start + count >= len(self._fds) else start + count
            if self._sweep_from == 0 and token and self._round == token:
                self._quiet = token
            if serving.retired or not (window >= 0).any():
                return
            end = start + len(window)
            gone = np.zeros(len(window), np.uint8)
            self._gone(window, gone, self._checked[start:end], self._ctimes[start:end], token)
            for offset in np.flatnonzero(gone).tolist():
                self._release(serving, start + offset)

    def _recheck(self, serving: _Serving, i: int, row: npt.NDArray[np.uint8]) -> bool:
        """An entry that failed the batch's check: reader.py reads it again and notes why
        (so the mount is asked to check it again); True if it was fine after all."""
        key = EntryKey(serving.version, self.size, self._key(i))
        return stored_into(serving.mount, key, self._path(i), row)

    def _give_back(
        self, positions: Sequence[int] | range, on_miss: Callable[[int], None] | None
    ) -> list[int]:
        given = list(positions)
        if on_miss is not None:
            for p in given:
                on_miss(p)
        return given

    # -- keys ------------------------------------------------------------------------

    def _key(self, i: int) -> str:
        return os.fsdecode(self._keys[i])

    def _list(self, serving: _Serving) -> bool:
        """List the directory once before its keys are first looked up on ``serving``'s
        mount. A key the listing names as an array of this directory is taken as looked
        up: the listing is the mount's own answer, as a lookup's is (the name, and the
        node its inode number says). The rest (a mirror's keys, those past the listing's
        end) are looked up at once; those the listing returned are answered by the
        kernel from it (READDIRPLUS), not by the mount. The listing stops after as many
        entries as the lookups it spares would cost. True if this call listed; False if
        another call did (or does) for ``serving``."""
        with self._lock:
            if serving.listed:
                return False
            serving.listed = True
        unknown = np.flatnonzero(self._verified != serving.generation)
        mount = serving.mount
        # The keys still to look up, sorted, for the listing's names to be found among
        # (a chunk of names at a time: nothing the size of the directory is kept).
        keys = self._keys[unknown]
        order = np.argsort(keys, kind="stable")
        wanted = keys[order]
        version = Node.from_ino(serving.directory_ino).version
        listed = np.zeros(len(unknown), bool)

        def ours(st: os.stat_result) -> bool:  # still the directory serving was found for
            return st.st_ino == serving.directory_ino and readable_mount(st.st_dev) is mount

        mirror = serving.version in mount.mirrors  # a key is a path: reader.py resolves it

        def found(names: list[str], inos: list[int]) -> None:
            if mirror:
                return  # its keys are looked up
            positions, numbers = among(wanted, names, inos)
            for p, ino in zip(positions, numbers, strict=True):
                if names_entry(ino, version, self.size):
                    listed[order[p]] = True

        list_below(self.directory, len(unknown) * LISTED_PER_LOOKUP, ours, found)
        # Every key at once, while the kernel has the entries: memory pressure (a store
        # bigger than memory) would take them back before later batches looked theirs up.
        for p, i in enumerate(unknown.tolist()):
            if listed[p]:
                self._looked_up(serving, i, self._key(i))
            else:
                self._verify(serving, i)
        return True

    def _path(self, i: int) -> str:
        return os.path.join(self.directory, array_name(self._key(i)))

    def _relpath(self, serving: _Serving, i: int) -> bytes:
        return os.fsencode(EntryKey(serving.version, self.size, self._key(i)).relpath)

    def _verify(self, serving: _Serving, i: int) -> None:
        """Look key ``i`` up on the mount as read_array does (its name is served, and is
        this directory's array of that key); if it is, it is read from the store while
        ``serving`` lasts. Anything else is read by the caller."""
        key = self._key(i)
        try:
            found = locate(self._path(i))
        except OSError:
            return  # the caller's read raises what open() raises
        want = EntryKey(serving.version, self.size, key)
        if found is None or found[0] is not serving.mount or found[1] != want:
            return
        self._looked_up(serving, i, key)

    def _looked_up(self, serving: _Serving, i: int, key: str) -> None:
        """Key ``i`` (``key``) is this directory's array on ``serving``'s mount: read from
        the store while ``serving`` lasts."""
        self._seeds[i] = EntryKey(serving.version, self.size, key).seed
        self._verified[i] = serving.generation

    # -- which mount -------------------------------------------------------------------

    def _in_use(self) -> _Serving | None:
        """The store found for the directory last (None: none yet), counted as in use."""
        with self._lock:
            serving = self._serving
            if serving is not None:
                serving.users += 1
            return serving

    def _still_serving(self, serving: _Serving, looked: Looked) -> bool:
        """Whether the stats a first pass took say the directory is still ``serving``'s,
        as ``_begin`` would find it."""
        if not looked.stated or serving.retired:
            return False
        mount = current_mount(looked.device, looked.root_device, looked.root_mtime_ns)
        return mount is serving.mount and looked.inode == serving.directory_ino

    def _begin(self) -> _Serving | None:
        """The store serving the directory now (one stat of it), counted as in use."""
        try:
            st = os.stat(self.directory)
        except OSError:
            return None
        mount = readable_mount(st.st_dev)
        with self._lock:
            serving = self._serving
            current = (
                serving is not None
                and mount is serving.mount
                and st.st_ino == serving.directory_ino
            )
            if not current:
                serving = self._serve(mount, st) if mount is not None else None
                if self._serving is not None:
                    self._retire(self._serving)
                self._serving = self._box[0] = serving
            if serving is not None:
                serving.users += 1
            return serving

    def _serve(self, mount: Mount, st: os.stat_result) -> _Serving | None:
        try:
            node = Node.from_ino(st.st_ino)
        except IndexError:
            return None
        if node.kind != Kind.SIZE or node.size != self.size or node.version >= len(mount.versions):
            return None
        version = mount.versions[node.version]
        digest = mount.digests.get(version)
        if digest is None:
            return None
        try:
            dirfd = os.open(mount.store, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        length = len(self._header) + self._row_bytes
        expect = TRAILER.pack(TRAILER_MAGIC, STORE_FORMAT, digest, length, 0)[:EXPECT_SIZE]
        global _generation
        _generation += 1
        prefix = encode_access(version, self.size, "")[:-1]
        root = os.fsencode(mount.root)
        serving = _Serving(mount, st.st_ino, version, dirfd, expect, _generation, prefix, root)
        serving.changes = _open_token(dirfd, mount.owner)
        return serving

    def _retire(self, serving: _Serving) -> None:
        """Under _lock: ``serving`` is no longer the directory's; its descriptors close
        once no call uses them."""
        serving.retired = True
        self._quiet = self._round = 0  # another store's tokens from now on
        for i in np.flatnonzero(self._fds >= 0).tolist():
            self._release(serving, i)
        if serving.users == 0:
            self._close(serving)

    def _end(self, serving: _Serving) -> None:
        with self._lock:
            serving.users -= 1
            if serving.users == 0:
                self._close(serving)

    def _close(self, serving: _Serving) -> None:
        """Under _lock, no call of ``serving`` in flight: close what it let go of (and,
        retired, its store directory)."""
        _close_serving(serving, self._length)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork
        if self._serving is not None:
            self._serving.users = 0  # the calls of the parent's threads are not here


def _let_go(
    box: list[_Serving | None],
    fds: npt.NDArray[np.int32],
    maps: npt.NDArray[np.uint64],
    length: int,
) -> None:
    """A BatchReader no longer referenced (no call in flight): its kept files closed and
    unmapped, and its store directory and change token closed."""
    serving = box[0]
    if serving is None:
        return  # never read, or closed: nothing is kept
    kept = [(int(fd), int(address)) for fd, address in zip(fds, maps, strict=True) if fd >= 0]
    serving.closing.extend(kept)
    serving.retired = True
    _close_serving(serving, length)


def _close_serving(serving: _Serving, length: int) -> None:
    """Close (and unmap) the kept files ``serving`` let go of, and, retired, its store
    directory and change token: no call of it may be in flight."""
    for fd, address in serving.closing:
        os.close(fd)
        if address and row_readers.unmap is not None:
            row_readers.unmap(np.array([address], np.uint64), length)
    serving.closing.clear()
    if serving.retired and serving.dirfd >= 0:
        os.close(serving.dirfd)
        serving.dirfd = -1
        if serving.changes >= 0:
            os.close(serving.changes)
            serving.changes = -1


def _open_token(dirfd: int, owner: int) -> int:
    """The store's change token file (store/changes.py), if it is the daemon's alone;
    else -1: every kept file is then looked at before each read."""
    try:
        fd = os.open(CHANGES_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dirfd)
    except OSError:
        return -1
    try:
        st = os.fstat(fd)
    except OSError:
        st = None
    if st is None or not (stat.S_ISREG(st.st_mode) and owned_alone(st, owner)):
        os.close(fd)
        return -1
    return fd


_generation = 0  # of _Serving: each mount found anew gets the next; 0 is none
_readers: weakref.WeakSet[BatchReader] = weakref.WeakSet()


def _after_fork() -> None:
    for reader in list(_readers):
        reader._after_fork()


os.register_at_fork(after_in_child=_after_fork)
