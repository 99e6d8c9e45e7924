"""client/rows.py's row readers on real entry files: the compiled one and its pure-Python twin
read the same rows and give the same statuses, for good entries and every kind of bad one."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from decodefs.client import rows as row_readers
from decodefs.client.rows import (
    BAD,
    GONE,
    MISSING,
    NOT_CACHED,
    NOWAIT,
    OK,
    TRUSTED,
    UNREAD,
    ReadRows,
)
from decodefs.common.entry import EntryKey, encode_trailer
from decodefs.common.npy import npy_header
from decodefs.common.protocol import STORE_FORMAT, TRAILER, TRAILER_MAGIC, TRAILER_SIZE
from tests.conftest import Tmpfs, needs_root_because

SIZE = 16
DIGEST = bytes(range(16))
HEADER = npy_header(SIZE)
ROW = SIZE * SIZE * 3
LENGTH = len(HEADER) + ROW
EXPECT = TRAILER.pack(TRAILER_MAGIC, STORE_FORMAT, DIGEST, LENGTH, 0)[: TRAILER_SIZE - 8]

IMPLEMENTATIONS = {"python": row_readers.read_entries_py}
if row_readers.compiled is not None:
    IMPLEMENTATIONS["compiled"] = row_readers.compiled


GONE_CHECKS = [row_readers.gone_py]
if row_readers.compiled_gone is not None:
    GONE_CHECKS.append(row_readers.compiled_gone)
# read_kept beside the read_rows that kept (and, compiled, mapped) the files it reads
KEPT_READERS: dict[str, Callable[..., tuple[int, ...]]] = {"python": row_readers.read_kept_py}
if row_readers.compiled_kept is not None:
    KEPT_READERS["compiled"] = row_readers.compiled_kept


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def read_rows(request: pytest.FixtureRequest) -> ReadRows:
    return IMPLEMENTATIONS[request.param]


def test_the_extension_builds_here() -> None:
    # scripts/setup.sh installs a compiler and Python's headers: CI must test the compiled reader.
    assert row_readers.compiled is not None, "decodefs/client/_batchread did not build"


def write_entry(store: Path, key: EntryKey, array: np.ndarray, digest: bytes = DIGEST) -> Path:
    payload = HEADER + array.tobytes()
    path = store / key.relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload + encode_trailer(key, payload, digest))
    path.chmod(0o644)
    return path


class Store:
    def __init__(self, root: Path, count: int) -> None:
        self.root = root
        rng = np.random.default_rng(3)
        self.keys = [EntryKey("v1", SIZE, f"{i:02x}key{i}") for i in range(count)]
        self.arrays = [rng.integers(0, 256, (SIZE, SIZE, 3), np.uint8) for _ in self.keys]
        self.paths = [write_entry(root, k, a) for k, a in zip(self.keys, self.arrays, strict=True)]
        self.dirfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)

    def read(
        self,
        read_rows: ReadRows,
        fds: np.ndarray | None = None,
        keep: int = 0,
        nowait: bool = False,
        names: list[bytes | None] | None = None,
        maps: np.ndarray | None = None,
        token: int = 0,
        checked: np.ndarray | None = None,
        ctimes: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        count = len(self.keys)
        rows = np.zeros((count, SIZE, SIZE, 3), np.uint8)
        fds = np.full(count, -1, np.int32) if fds is None else fds
        maps = np.zeros(count, np.uint64) if maps is None else maps
        mapping = read_rows is not row_readers.read_entries_py
        if names is None:
            pairs = zip(self.keys, fds.tolist(), strict=True)
            names = [k.relpath.encode() if fd < 0 else None for k, fd in pairs]
        status = np.full(count, -7, np.int32)
        seeds = np.array([k.seed for k in self.keys], np.uint64)
        positions = np.arange(count, dtype=np.int32)
        self.checked = np.zeros(count, np.uint64) if checked is None else checked
        self.ctimes = np.zeros(count, np.int64) if ctimes is None else ctimes
        kept = read_rows(
            self.dirfd, rows, ROW, positions, fds, maps, names, seeds, HEADER, EXPECT,
            os.geteuid(), keep, mapping, nowait, token, self.checked, self.ctimes, status,
        )  # fmt: skip
        self.maps = maps
        return rows, status, fds, kept


def let_go(fds: np.ndarray, maps: np.ndarray) -> None:
    """Close the descriptors ``fds`` a read kept, and unmap ``maps`` (the compiled reader
    maps what it keeps)."""
    for fd in fds:
        os.close(int(fd))
    if row_readers.unmap is not None:
        row_readers.unmap(maps, LENGTH + TRAILER_SIZE)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    made = Store(tmp_path / "store", 6)
    try:
        yield made
    finally:
        os.close(made.dirfd)


def test_good_entries_are_read_into_their_rows(store: Store, read_rows: ReadRows) -> None:
    rows, status, fds, kept = store.read(read_rows)
    assert status.tolist() == [OK] * 6 and kept == 0 and (fds == -1).all()
    for row, array in zip(rows, store.arrays, strict=True):
        assert np.array_equal(row, array)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_every_bad_entry_is_refused_alike(store: Store, read_rows: ReadRows) -> None:
    flip(store.paths[0], len(HEADER) + 100)  # a pixel
    flip(store.paths[1], 10)  # the .npy header
    flip(store.paths[2], LENGTH + TRAILER_SIZE - 1)  # the checksum
    write_entry(store.root, store.keys[3], store.arrays[3], digest=bytes(16))  # stale
    store.paths[4].write_bytes(store.paths[4].read_bytes()[:-1])  # truncated
    store.paths[5].unlink()  # missing
    _, status, _, _ = store.read(read_rows)
    bad, missing = BAD, MISSING
    assert status.tolist() == [bad, bad, bad, bad, bad, missing]
    # another key's entry in this key's place fails its checksum (the seed is the key's)
    store.paths[5].write_bytes(store.paths[0].read_bytes())
    assert store.read(read_rows)[1][5] == bad


def test_an_entry_others_may_write_is_refused(store: Store, read_rows: ReadRows) -> None:
    store.paths[2].chmod(stat.S_IMODE(store.paths[2].stat().st_mode) | 0o020)
    store.paths[3].chmod(0o646)
    _, status, _, _ = store.read(read_rows)
    assert status.tolist() == [OK, OK, BAD, BAD, OK, OK]


def test_descriptors_are_kept_within_the_bound_and_a_gone_file_is_said(
    store: Store, read_rows: ReadRows
) -> None:
    _, status, fds, kept = store.read(read_rows, keep=4)
    maps, ctimes = store.maps, store.ctimes.copy()
    assert kept == 4 and (status == OK).all()
    assert (fds[:4] >= 0).all() and (fds[4:] == -1).all()
    compiled = read_rows is not row_readers.read_entries_py
    assert (maps[:4] != 0).all() if compiled else not maps.any()  # kept files are mapped
    assert not maps[4:].any()
    rows, status, _, _ = store.read(
        read_rows, fds=fds.copy(), maps=maps.copy(), nowait=True, ctimes=ctimes.copy()
    )
    assert (status == OK).all()  # read out of the mappings, in the page cache
    assert all(np.array_equal(r, a) for r, a in zip(rows, store.arrays, strict=True))
    for fd, path in zip(fds[:4], store.paths, strict=False):
        assert os.path.samestat(os.fstat(int(fd)), path.stat())
    try:
        store.paths[0].unlink()  # evicted
        rebuilt = write_entry(store.root / "tmp", store.keys[1], store.arrays[1])
        rebuilt.rename(store.paths[1])  # rebuilt as the daemon does: the kept file unlinked
        again = fds.copy()
        rows, status, after, kept = store.read(
            read_rows, fds=again, maps=maps.copy(), keep=0, nowait=True, ctimes=ctimes.copy()
        )
        assert kept == 0 and status.tolist()[:4] == [GONE, GONE, OK, OK]
        assert (after == fds).all()  # a gone file's descriptor is the caller's to close
        for gone in GONE_CHECKS:
            out = np.full(6, 7, np.uint8)
            checked = np.zeros(6, np.uint64)
            changed = np.array([*ctimes[:4], 0, 0], np.int64)
            gone(np.array([*fds[:4], -1, 999_999], np.int32), out, checked, changed, 5)
            assert out.tolist() == [1, 1, 0, 0, 0, 1]  # unlinked, unlinked, ..., none, closed
        assert np.array_equal(rows[3], store.arrays[3]) and np.array_equal(rows[5], store.arrays[5])
    finally:
        let_go(fds[:4], maps)


@pytest.mark.parametrize("name", sorted(KEPT_READERS))
def test_kept_files_are_read_by_key_and_the_rest_left_unread(
    store: Store, tmp_path: Path, name: str
) -> None:
    read_kept = KEPT_READERS[name]
    _, status, fds, kept = store.read(IMPLEMENTATIONS[name], keep=5, token=3)
    maps, ctimes, checked = store.maps, store.ctimes.copy(), store.checked.copy()
    assert kept == 5 and (status == OK).all()
    verified = np.array([1, 1, 1, 1, 2, 1], np.uint32)  # key 4: looked up on another mount
    seeds = np.array([k.seed for k in store.keys], np.uint64)
    changes = tmp_path / "changes"  # the store's change token, as store/changes.py writes it
    changes_fd = os.open(changes, os.O_RDWR | os.O_CREAT)

    def read(index: list[int], token: int, nowait: int = NOWAIT) -> tuple[Any, ...]:
        os.pwrite(changes_fd, token.to_bytes(8, "little"), 0)
        keys = np.array(index, np.int64)
        rows = np.zeros((len(keys), SIZE, SIZE, 3), np.uint8)
        status = np.full(len(keys), -7, np.int32)
        used = np.full(len(keys), -7, np.int32)
        directory, root = bytes(store.root), bytes(tmp_path)
        looked = row_readers.Looked(
            *read_kept(
                rows, ROW, keys, verified, 1, fds, maps, seeds, HEADER, EXPECT, nowait,
                checked, ctimes, status, used, directory, root, changes_fd,
            )
        )  # fmt: skip
        st, root_st = store.root.stat(), tmp_path.stat()
        assert looked[:5] == (1, st.st_dev, st.st_ino, root_st.st_dev, root_st.st_mtime_ns)
        assert looked.token == token
        assert looked.faults == 0  # every page in the page cache
        assert looked.failed == int(np.count_nonzero(status != OK))
        return rows, status.tolist(), used.tolist()

    try:
        rows, status, used = read([3, 0, 5, 4, 3], token=3)  # key 5: no kept file
        ok, unread = OK, UNREAD
        assert status == [ok, ok, unread, unread, ok]
        assert used == [fds[3], fds[0], -1, fds[4], fds[3]]
        for p, key in ((0, 3), (1, 0), (4, 3)):
            assert np.array_equal(rows[p], store.arrays[key])
        assert not rows[2].any() and not rows[3].any()  # left for the caller
        flip(store.paths[1], len(HEADER) + 7)  # a pixel, in place
        store.paths[2].unlink()  # evicted behind the token's back
        _, status, _ = read([1, 2], token=3, nowait=TRUSTED)
        # The token says nothing changed: the compiled reader copies out of the mappings,
        # the changed bytes failing their check, the unlinked file's still the entry it
        # checked; the pure-Python one looks at every file (the flip changed its ctime).
        if name == "compiled":
            assert status == [BAD, OK]
        else:
            assert status == [GONE, GONE]
        _, status, _ = read([2], token=4)  # a new token: every kept file is looked at
        assert status == [GONE]
        assert checked[2] == 3  # a gone file is not marked looked at
        _, status, _ = read([0], token=2**64 - 2)  # every bit of the token counts
        assert status == [OK] and checked[0] == 2**64 - 2
        with pytest.raises(IndexError):
            read([6], token=4)  # no such key
    finally:
        os.close(changes_fd)
        let_go(fds[:5], maps)


@pytest.mark.parametrize("name", sorted(KEPT_READERS))
def test_read_kept_says_when_it_could_not_look_and_reads_by_token_zero_without_one(
    store: Store, tmp_path: Path, name: str
) -> None:
    read_kept = KEPT_READERS[name]
    _, _, fds, _ = store.read(IMPLEMENTATIONS[name], keep=6, token=3)
    checked = store.checked.copy()
    seeds = np.array([k.seed for k in store.keys], np.uint64)
    rows = np.zeros((1, SIZE, SIZE, 3), np.uint8)
    status, used = np.empty(1, np.int32), np.empty(1, np.int32)
    try:
        for directory, root in ((tmp_path / "gone", tmp_path), (store.root, tmp_path / "gone")):
            looked = read_kept(
                rows, ROW, np.array([0], np.int64), np.ones(6, np.uint32), 1, fds, store.maps,
                seeds, HEADER, EXPECT, NOWAIT, checked, store.ctimes, status, used,
                bytes(directory), bytes(root), -1,
            )  # fmt: skip
            assert tuple(looked) == (0, 0, 0, 0, 0, 0, 0, 0)  # nothing stated, no token
            assert status.tolist() == [OK] and checked[0] == 0  # read by token 0
            assert np.array_equal(rows[0], store.arrays[0])
    finally:
        let_go(fds[:6], store.maps)


def dropped(path: Path, check: bool = True) -> bool:
    """Drop ``path``'s pages from the page cache; whether a read now would wait for the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if check:
            os.preadv(fd, [bytearray(8)], 0, os.RWF_NOWAIT)
        return False
    except BlockingIOError:
        return True
    except OSError as exc:  # a file system that cannot read without waiting (a tmpfs)
        if exc.errno == errno.EOPNOTSUPP:
            return False
        raise
    finally:
        os.close(fd)


def test_a_kept_file_is_looked_at_again_once_the_store_changed_or_its_inode_did(
    store: Store, read_rows: ReadRows
) -> None:
    _, status, fds, kept = store.read(read_rows, keep=4, token=7)
    maps, ctimes = store.maps, store.ctimes.copy()
    assert kept == 4 and (status == OK).all()
    assert store.checked[:4].tolist() == [7] * 4  # looked at (opened) under token 7
    compiled = read_rows is not row_readers.read_entries_py
    try:
        store.paths[0].unlink()  # behind the daemon's back: no new token
        store.paths[1].chmod(0o600)  # other readers: a new ctime
        rows, status, _, _ = store.read(
            read_rows, fds=fds.copy(), maps=maps.copy(), nowait=True, token=7,
            checked=store.checked.copy(), ctimes=ctimes.copy(),
        )  # fmt: skip
        if compiled:  # the token says nothing changed: the kept files are not looked at
            assert (status == OK).all()
            assert np.array_equal(rows[0], store.arrays[0])  # the bytes it held, checked
        else:  # the pure-Python reader looks at every kept file
            assert status.tolist()[:4] == [GONE, GONE, OK, OK]
        checked = np.full(6, 7, np.uint64)
        _, status, _, _ = store.read(
            read_rows, fds=fds.copy(), maps=maps.copy(), nowait=True, token=8,
            checked=checked, ctimes=ctimes.copy(),
        )  # fmt: skip
        assert status.tolist()[:4] == [GONE, GONE, OK, OK]
        assert checked[2:4].tolist() == [8, 8]  # looked at under the new token
        for gone in GONE_CHECKS:
            out = np.full(4, 9, np.uint8)
            looked = np.full(4, 7, np.uint64)
            gone(fds[:4].copy(), out, looked, ctimes[:4].copy(), 8)
            assert out.tolist() == [1, 1, 0, 0]  # unlinked, other readers, as it was, as it was
            assert looked.tolist() == [7, 7, 8, 8]
            looked = np.full(4, 8, np.uint64)
            gone(fds[:4].copy(), out, looked, ctimes[:4].copy(), 8)
            assert out.tolist() == [0, 0, 0, 0]  # all looked at under this token: none is
    finally:
        let_go(fds[:4], maps)


def test_a_row_not_in_the_page_cache_is_started_and_said(store: Store, read_rows: ReadRows) -> None:
    scratch = store.root / "scratch"
    scratch.write_bytes(bytes(4096))
    if not any(dropped(scratch) for _ in range(5)):  # (a read without waiting starts reading
        pytest.skip(f"{store.root} keeps pages after a drop (a tmpfs?)")  # ahead: not an entry)
    for _ in range(20):  # (the pages of a file just written may take a moment to go)
        for path in store.paths:
            dropped(path, check=False)
        _, status, _, _ = store.read(read_rows, nowait=True)
        assert set(status.tolist()) <= {NOT_CACHED, OK}
        if NOT_CACHED in status:
            break
    assert NOT_CACHED in status
    rows, status, _, _ = store.read(read_rows, nowait=False)
    assert (status == OK).all()
    assert all(np.array_equal(r, a) for r, a in zip(rows, store.arrays, strict=True))


@needs_root_because("it mounts a tmpfs")
def test_a_file_system_that_cannot_read_without_waiting_is_read_plainly_alone(
    tmpfs: Tmpfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tmpfs answers RWF_NOWAIT with EOPNOTSUPP here: the pure-Python reader reads it
    the plain way from then on, and only it (no other file system of the process)."""
    refused: set[int] = set()
    monkeypatch.setattr(row_readers, "_nowait_refused", refused)
    other = tmpfs("1m") / "f"
    other.write_bytes(b"x" * 4096)
    fd = os.open(other, os.O_RDONLY)
    try:
        dev = os.fstat(fd).st_dev
        buffer = bytearray(8)
        assert row_readers._preadv(fd, [buffer], os.RWF_NOWAIT, dev) == 8 and buffer == b"x" * 8
    finally:
        os.close(fd)
    assert refused <= {dev}  # that file system alone (none, should it read without waiting)


def test_no_name_is_missing_and_bad_arguments_raise(store: Store, read_rows: ReadRows) -> None:
    _, status, _, _ = store.read(read_rows, names=[None] * 6)
    assert (status == MISSING).all()
    if read_rows is row_readers.read_entries_py:
        return
    rows = np.zeros((1, SIZE, SIZE, 3), np.uint8)
    one = np.zeros(1, np.int32)
    seeds = np.zeros(1, np.uint64)
    with pytest.raises(IndexError, match="outside rows"):
        read_rows(
            store.dirfd, rows, ROW, np.array([1], np.int32), one.copy(), seeds.copy(), [None],
            seeds, HEADER, EXPECT, 0, 0, True, 0, 0, seeds.copy(), seeds.view(np.int64).copy(),
            one.copy(),
        )  # fmt: skip
    with pytest.raises(ValueError, match="holds"):
        read_rows(
            store.dirfd, rows, ROW, np.array([0], np.int32), one.copy(), seeds.copy(), [None],
            np.zeros(2, np.uint64), HEADER, EXPECT, 0, 0, True, 0, 0, seeds.copy(),
            seeds.view(np.int64).copy(), one.copy(),
        )  # fmt: skip
    with pytest.raises(ValueError, match="one name"):
        read_rows(
            store.dirfd, rows, ROW, np.array([0], np.int32), one.copy(), seeds.copy(), [],
            seeds, HEADER, EXPECT, 0, 0, True, 0, 0, seeds.copy(), seeds.view(np.int64).copy(),
            one.copy(),
        )  # fmt: skip


# Every build rows.inc has; those this CPU does not run are skipped (and say so).
BUILDS = ("base", "avx2", "avx512")


def _runs(build: str) -> None:
    if row_readers.compiled is None:
        pytest.skip("the extension did not build")
    if build not in row_readers.BUILDS:
        pytest.skip(f"this CPU, or the compiler the extension was built with, has no {build}")


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(row_readers.compiled is None, reason="the extension did not build")
def test_the_widest_build_this_cpu_runs_is_the_one_used() -> None:
    from decodefs.client import _batchread  # type: ignore[attr-defined]

    if os.uname().machine == "x86_64" and sysconfig.get_config_var("CC").startswith("gcc"):
        assert _batchread.COMPILED == BUILDS  # as setup.sh's gcc builds it
    flags = _cpu_flags() if os.uname().machine == "x86_64" else set()
    runs = {"base": True, "avx2": "avx2" in flags, "avx512": {"avx2", "avx512f"} <= flags}
    want = tuple(b for b in _batchread.COMPILED if runs[b])
    assert want == _batchread.BUILDS
    assert _batchread.BUILDS[-1] == _batchread.VECTOR
    calls: list[Callable[[str | None], int]] = [
        lambda build: _batchread.checksum(b"data", 1, build),
        lambda build: _batchread.copy_checksum(b"data", 0, 1, bytearray(4), build),
    ]
    for call in calls:
        assert call(None) == call(_batchread.VECTOR) == xxhash.xxh3_64_intdigest(b"data", seed=1)
        with pytest.raises(ValueError, match="no build no-such-build runs"):
            call("no-such-build")


@pytest.mark.parametrize("build", BUILDS)
@given(st.binary(max_size=5000), st.integers(0, 2**64 - 1))
def test_the_compiled_checksum_is_xxh3(build: str, data: bytes, seed: int) -> None:
    """By each build (for any CPU, and each of its vector instructions)."""
    _runs(build)
    from decodefs.client import _batchread  # type: ignore[attr-defined]

    want = xxhash.xxh3_64_intdigest(data, seed=seed)
    assert _batchread.checksum(data, seed, build) == want
    assert _batchread.checksum(data, seed) == want  # the build the reads use


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("aligned", [64, 32, 16, 1])
@given(
    st.integers(0, 6000),
    st.integers(0, 8),
    st.one_of(st.just(0), st.integers(0, 2**64 - 1)),
    st.integers(0, 63),
    st.randoms(use_true_random=False),
)
def test_the_copy_that_checks_in_one_pass_is_xxh3_and_a_copy(
    build: str, aligned: int, length: int, stripes: int, seed: int, shift: int, random: Any
) -> None:
    """The pass over a mapped entry: xxh3-64 of it all and a copy of all but its header
    (a whole number of 64-byte stripes; other lengths take the two-pass way), into a
    row at any alignment (one aligned to 16, 32 or 64 bytes takes the stores past the
    cache that wide; that the streamed stores are fenced is not seen by one thread), by
    each build (for any CPU, and each of its vector instructions)."""
    _runs(build)
    from decodefs.client import _batchread  # type: ignore[attr-defined]

    data = random.randbytes(length)
    skip = min(64 * stripes, length)
    memory = np.zeros(length - skip + 128, np.uint8)
    start = -memory.ctypes.data % 64 + shift // aligned * aligned  # aligned to `aligned`
    into = memory[start : start + length - skip]
    assert _batchread.copy_checksum(data, skip, seed, into, build) == xxhash.xxh3_64_intdigest(
        data, seed=seed
    )
    assert into.tobytes() == data[skip:]
    assert not memory[:start].any() and not memory[start + len(into) :].any()


@pytest.mark.skipif(row_readers.compiled is None, reason="the extension did not build")
def test_a_mapped_file_truncated_under_a_copy_fails_it_and_the_process_lives(
    store: Store,
) -> None:
    from decodefs.client import _batchread  # type: ignore[attr-defined]

    big = store.root / "big"  # a file of several pages (a SIGBUS needs a whole page past EOF)
    big.write_bytes(bytes(range(256)) * 256)
    assert _batchread.probe(str(big), 65536)
    os.truncate(big, 100)  # in place, as no daemon does
    assert not _batchread.probe(str(big), 65536)
    assert not _batchread.probe(str(big), 65536)  # and again: still guarded
    os.truncate(store.paths[0], 100)
    _, status, fds, _ = store.read(IMPLEMENTATIONS["compiled"], keep=6)
    try:
        assert status.tolist() == [BAD] + [OK] * 5
    finally:
        let_go(fds[fds >= 0], store.maps)


_REPLACED_GUARD = """
import faulthandler, os, sys
from decodefs.client import _batchread
path = sys.argv[1]
assert _batchread.probe(path, 65536)  # installs the guard
faulthandler.enable()
faulthandler.disable()  # puts back what it found first (what pytest does to an inner session)
os.truncate(path, 100)
print(_batchread.probe(path, 65536))
"""


@pytest.mark.skipif(row_readers.compiled is None, reason="the extension did not build")
def test_the_guard_is_put_back_when_someone_replaced_it(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(bytes(65536))
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _REPLACED_GUARD, str(big)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, "False\n"), result.stderr
