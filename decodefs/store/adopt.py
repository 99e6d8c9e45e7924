"""`decodefs adopt`: import an existing cache of ``<version>/<size>/<uu>/<uuid>.npy`` files.

Teams already keep such caches: plain ``np.save`` bytes of arrays decoded the
default way. Adopting one first decodes a random sample of its arrays with
``decode_image`` and the version's settings and compares them byte for byte;
one difference and nothing is adopted, unless ``skip_differing``: then every
array is decoded and compared, and those that differ stay in the cache. Then
every array whose uuid is an original of the version becomes a store entry
through the store's own API (``Store.write``: a copy, the cache left as it
was; with ``move``, ``Store.move_in``: the trailer appended in place and the
file renamed into the store, when the file is the store user's alone on the
store's filesystem), with its catalog row, under the store's capacity
limits, never evicting. Entries already stored are skipped, so an
interrupted adoption resumes; a stop request is honoured between two
entries, so nothing is half-written.

The store must not be in use: the daemon holds the store's lock and keeps
its catalog counts and verified entries in memory, so adopting under it is
refused. Files are opened without following symlinks: a cache cannot make
the store take a file from elsewhere. This module knows the cache's layout
and the .npy format; the store knows how entries are written.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import random
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import PIL
from tqdm import tqdm

from ..common.config import Config
from ..common.decode import DecodeError, decode_image
from ..common.entry import EntryKey, check_entry, layout_problem
from ..common.names import ARRAY_SUFFIX, is_array_name
from ..common.npy import npy_bytes, npy_file_size
from ..common.protocol import TRAILER_SIZE
from ..common.source import OriginalMissing, SourceIndex, scan_source
from ..common.trusted import (
    DIRECTORY_FLAGS,
    READ_FLAGS,
    UntrustedPath,
    open_trusted_dir,
    opened_directory,
)
from .store import CannotMove, Store, StoreInUse, StoreWriteError, lock_store

__all__ = ["DEFAULT_SAMPLE", "AdoptError", "AdoptReport", "adopt"]

DEFAULT_SAMPLE = 300


class AdoptError(Exception):
    """Adoption refused or stopped for a reason the user can act on (one line)."""

    def __init__(self, message: str, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid  # the pid holding the store's lock, if that is why


@dataclass
class AdoptReport:
    found: int = 0  # .npy files in the cache's <version>/<size>/<uu>/ directories
    sampled: int = 0  # decoded again and compared, all equal
    moved: int = 0
    copied: int = 0
    already_stored: int = 0
    unknown: int = 0  # no original of the version has that uuid
    bad: int = 0  # not the .npy of a (size, size, 3) uint8 array, or in the wrong <uu>
    undecodable: int = 0  # sampled, but the original cannot be decoded: left out
    differing: int = 0  # checked (skip_differing), not what a fresh decode makes: left out
    examples: dict[str, str] = field(default_factory=dict)  # kind -> first example
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def adopted(self) -> int:
        return self.moved + self.copied

    def skip(self, kind: str, example: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.examples.setdefault(kind, example)


@dataclass(frozen=True)
class _Candidate:
    shard: str  # the <uu> directory it is in
    name: str  # <uuid>.npy
    key: EntryKey
    index: int  # the original's position in the source index


def adopt(
    config: Config,
    version: str,
    size: int,
    cache_dir: Path,
    *,
    sample: int = DEFAULT_SAMPLE,
    move: bool = False,
    skip_differing: bool = False,
    progress: bool = False,
    stop: threading.Event | None = None,
    seed: int | None = None,
) -> AdoptReport:
    """Adopt ``<cache_dir>/<version>/<size>/<uu>/<uuid>.npy`` into the config's store.

    Files are copied, leaving the cache as it was; with ``move``, a file that is
    the store user's alone on the store's filesystem is moved instead (no second
    copy on flash; the cache loses it). Raises AdoptError if arrays of the sample
    differ from a fresh decode (naming how many, an example, and the decode
    settings to check), if a daemon holds the store, or if the store fills up.
    With ``skip_differing`` every array is checked, not a sample, and those that
    differ are left in the cache and counted. ``stop`` (set from a signal
    handler) ends the import after the entry in hand.
    """
    stop = stop or threading.Event()
    if version not in config.versions:
        raise AdoptError(f"version {version!r} is not in the config ({', '.join(config.versions)})")
    if not config.min_size <= size <= config.max_size:
        raise AdoptError(
            f"size {size} is outside the config's min_size..max_size "
            f"({config.min_size}..{config.max_size})"
        )
    if config.versions[version].layout != "uuid":
        # The cache names an original by its stem, wherever it lies; a mirror
        # version names it by its relative path, so "0001" would mean another file.
        raise AdoptError(
            f"version {version!r} has layout = {config.versions[version].layout!r}; a cache of "
            "<uu>/<uuid>.npy files can be adopted only into a uuid version"
        )
    if sample < 1:
        raise AdoptError("--sample must be at least 1: adopting means checking a sample")
    directory = cache_dir / version / str(size)
    if not directory.is_dir():
        raise AdoptError(f"{directory} is not a directory (the cache's <version>/<size>/)")
    _refuse_if_in_use(config.store)
    store = Store.from_config(config)
    store.open()
    try:
        if not store.writable:
            raise AdoptError(f"the store {config.store} cannot be written (see the log line above)")
        store.wait_for_usage()
        source = config.versions[version]
        index = scan_source(
            version, source.source, source.extensions, source.duplicates, store.cache_dir("index")
        )
        started = time.monotonic()
        with opened_directory(directory) as root:
            adoption = _Adoption(config, version, size, (directory, root), store, index)
            adoption.run(sample, seed, move, skip_differing, stop, progress)
        adoption.report.interrupted = stop.is_set()
        adoption.report.seconds = time.monotonic() - started
        return adoption.report
    finally:
        store.close()


class _Adoption:
    """One adoption of a cache's <version>/<size>/ directory, open at ``root``."""

    def __init__(
        self,
        config: Config,
        version: str,
        size: int,
        cache: tuple[Path, int],  # the <version>/<size>/ directory, and a descriptor of it
        store: Store,
        index: SourceIndex,
    ) -> None:
        self.version, self.size = version, size
        self.directory, self.root = cache
        self.settings = config.versions[version].decode
        self.max_pixels = config.max_pixels
        self.workers = config.decode_workers
        self.digest = store.digest(version)  # what the store's entries of it carry
        self.store = store
        self.index = index
        self.report = AdoptReport()

    def run(
        self,
        sample: int,
        seed: int | None,
        move: bool,
        skip_differing: bool,
        stop: threading.Event,
        progress: bool,
    ) -> None:
        candidates = self.candidates()
        if candidates and not stop.is_set():
            count = len(candidates) if skip_differing else sample
            candidates = self.check_sample(candidates, count, seed, skip_differing, stop, progress)
        if not stop.is_set():
            self.import_all(candidates, move, stop, progress)

    def candidates(self) -> list[_Candidate]:
        """Every cache file to import, by shard and name; counts what is skipped."""
        found = []
        for shard, name in _cache_files(self.root):
            self.report.found += 1
            key = EntryKey(self.version, self.size, name[: -len(ARRAY_SUFFIX)])
            position = self.index.find(key.key)
            if position is None:
                self.report.skip("unknown", key.key)
            elif key.key[:2] != shard:
                self.report.skip("bad", f"{self.directory / shard / name} (not in {key.key[:2]}/)")
            elif self.store.contains(key):
                self.report.already_stored += 1
            else:
                found.append(_Candidate(shard, name, key, position))
        return found

    def check_sample(
        self,
        candidates: list[_Candidate],
        sample: int,
        seed: int | None,
        skip_differing: bool,
        stop: threading.Event,
        progress: bool,
    ) -> list[_Candidate]:
        """Decode a random sample again and compare. Unless ``skip_differing``, any
        difference is an AdoptError (how many, the first by uuid, the settings to
        check). The candidates left to import: not those whose original fails,
        nor (``skip_differing``) those that differ."""
        chosen = sorted(
            random.Random(seed).sample(candidates, min(sample, len(candidates))),
            key=lambda c: c.key.key,
        )
        left_out: set[_Candidate] = set()
        differing: list[str] = []
        pool = concurrent.futures.ThreadPoolExecutor(self.workers, "adopt-sample")
        label = "check" if skip_differing else "sample"
        bar = tqdm(total=len(chosen), desc=label, unit="img", disable=not progress)
        try:
            for candidate, (verdict, detail) in zip(
                chosen, pool.map(self.compare, chosen), strict=True
            ):
                bar.update(1)
                if verdict == "differs":
                    where = self.directory / candidate.shard / candidate.name
                    differing.append(f"{candidate.key.key}: {where} ({detail})")
                    if skip_differing:
                        left_out.add(candidate)
                        self.report.skip("differing", differing[-1])
                elif verdict == "undecodable":
                    left_out.add(candidate)
                    self.report.skip("undecodable", f"{candidate.key.key}: {detail}")
                elif verdict == "equal":
                    self.report.sampled += 1
                if stop.is_set():
                    return []
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            bar.close()
        if differing and not skip_differing:
            raise AdoptError(self.differing_message(differing, len(chosen)))
        if not self.report.sampled and not differing:
            example = self.report.examples.get("undecodable") or "their files are not .npy arrays"
            raise AdoptError(
                f"none of the {len(chosen)} sampled arrays could be checked against its "
                f"original ({example}); nothing adopted"
            )
        return [c for c in candidates if c not in left_out]

    def differing_message(self, differing: list[str], checked: int) -> str:
        """Why nothing was adopted: how many sampled arrays differ, the first, what to check."""
        settings = ", ".join(f"{k} = {_toml(v)}" for k, v in asdict(self.settings).items())
        what = (
            f"all {checked} sampled arrays differ"
            if len(differing) == checked
            else f"{len(differing)} of {checked} sampled arrays differ"
        )
        return (
            f"{what} from what decode_image makes of their originals with versions."
            f"{self.version}'s decode settings ({settings}; Pillow {PIL.__version__}), e.g. "
            f"{differing[0]}: nothing adopted. If the cache was made with other settings, "
            f"set them under [versions.{self.version}] (resample, fit, exif_transpose, draft) "
            "and run adopt again; to adopt only the arrays that match, leaving the others in "
            "the cache, pass --skip-differing (it decodes every array to check it)"
        )

    def compare(self, candidate: _Candidate) -> tuple[str, str | None]:
        """One sampled file against a fresh decode (a pool thread):
        ("equal" | "differs" | "bad" | "undecodable", detail)."""
        with _opened_at(self.root, candidate.shard) as shard:
            payload, problem = _payload(shard, candidate.name, candidate.key, self.digest)
        if problem is not None:
            return "bad", problem  # counted when the import meets it
        try:
            original = self.index.original_path(candidate.index)
            array = decode_image(original, self.size, self.settings, max_pixels=self.max_pixels)
        except (DecodeError, OriginalMissing) as exc:
            return "undecodable", str(exc)
        fresh = npy_bytes(array)
        if fresh == payload:
            return "equal", None
        first = next(i for i, (a, b) in enumerate(zip(fresh, payload, strict=True)) if a != b)
        return "differs", f"first difference at byte {first} of {len(payload)}"

    def import_all(
        self, candidates: list[_Candidate], move: bool, stop: threading.Event, progress: bool
    ) -> None:
        bar = tqdm(total=len(candidates), desc="adopt", unit="img", disable=not progress)
        shards = _ShardDirectories(self.root)
        try:
            for candidate in candidates:
                if stop.is_set():
                    return
                bar.update(1)
                shard = shards.open(candidate.shard)
                payload, problem = _payload(shard, candidate.name, candidate.key, self.digest)
                if problem is not None:
                    where = self.directory / candidate.shard / candidate.name
                    self.report.skip("bad", f"{where} ({problem})")
                    continue
                try:
                    if move and self.moved(candidate, shard, len(payload)):
                        self.report.moved += 1
                    else:
                        self.store.write(candidate.key, payload, may_evict=False)
                        self.report.copied += 1
                except StoreWriteError as exc:
                    raise AdoptError(
                        f"the store takes no more ({exc}); {self.report.adopted:,} arrays were "
                        "adopted before it filled (adopt never evicts)"
                    ) from None
        finally:
            shards.close()
            bar.close()

    def moved(self, candidate: _Candidate, shard: int, payload_length: int) -> bool:
        """Move the file into the store if it may be moved; False if it is to be copied."""
        try:
            self.store.move_in(
                candidate.key, shard, candidate.name, payload_length, may_evict=False
            )
        except CannotMove:
            return False  # not the store user's alone, or on another filesystem
        return True


def _refuse_if_in_use(store: Path) -> None:
    """AdoptError if a daemon holds the store's lock (a store not made yet is free)."""
    try:
        fd = open_trusted_dir(str(store))
    except (OSError, UntrustedPath):
        return  # missing, or refused: Store.open says why
    try:
        lock = lock_store(fd)
    except StoreInUse as exc:
        pid = f" (pid {exc.holder_pid})" if exc.holder_pid else ""
        raise AdoptError(
            f"the store {store} is in use by a running decodefs daemon{pid}; stop it first "
            "and run adopt again (the daemon keeps the store's counts and checked entries "
            "in memory)",
            exc.holder_pid,
        ) from None
    finally:
        os.close(fd)
    os.close(lock)


def _cache_files(root: int) -> Iterator[tuple[str, str]]:
    """(shard, name) of each ``*.npy`` that is no directory in the <uu> directories
    of the cache's <version>/<size>/ directory open at ``root`` (a symlink is
    listed, to be refused when opened); no symlink followed, names starting
    with '.' skipped."""
    with os.scandir(root) as it:
        shards = sorted(
            e.name for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
        )
    for shard in shards:
        with _opened_at(root, shard) as fd, os.scandir(fd) as it:
            names = [e.name for e in it if not e.is_dir(follow_symlinks=False)]
        for name in sorted(names):
            if is_array_name(name) and not name.startswith("."):
                yield shard, name


def _payload(shard: int, name: str, key: EntryKey, digest: bytes) -> tuple[bytes, str | None]:
    """The .npy bytes of the cache file ``name`` in the <uu> directory open at
    ``shard``, and why they cannot be adopted (None: they can).

    A file that ends with this key's valid trailer is one an interrupted move
    left behind (the trailer appended, not yet renamed): its payload is taken.
    """
    length = npy_file_size(key.size)
    try:
        fd = os.open(name, READ_FLAGS | os.O_NONBLOCK, dir_fd=shard)  # a FIFO: no wait
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return b"", "not a regular file"
            if st.st_size not in (length, length + TRAILER_SIZE):
                return b"", f"{st.st_size} bytes, not the .npy of a {key.size}x{key.size} array"
            data = os.pread(fd, st.st_size, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return b"", "a symlink (not followed)"
        return b"", f"unreadable: {exc.strerror}"
    if len(data) == length + TRAILER_SIZE:
        if not check_entry(key, data, digest).ok:  # its .npy layout included
            return b"", "bytes after the array"
        return data[:length], None
    if layout_problem(key, data, len(data)) is not None:
        return b"", f"not the .npy of a ({key.size}, {key.size}, 3) uint8 array"
    return data, None


class _ShardDirectories:
    """The <uu> directory in hand, kept open while its files are imported one by one."""

    def __init__(self, root: int) -> None:
        self._root = root
        self._name: str | None = None
        self._fd = -1

    def open(self, name: str) -> int:
        if name != self._name:
            self.close()
            self._fd = os.open(name, DIRECTORY_FLAGS, dir_fd=self._root)
            self._name = name
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._name, self._fd = None, -1


@contextlib.contextmanager
def _opened_at(parent: int, name: str) -> Iterator[int]:
    fd = os.open(name, DIRECTORY_FLAGS, dir_fd=parent)
    try:
        yield fd
    finally:
        os.close(fd)


def _toml(value: object) -> str:
    """A setting as it is written in the config ("bilinear", false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"'
