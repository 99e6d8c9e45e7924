"""The store on disk: atomic self-verifying entries, fingerprints, locks, usage."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from decodefs.decode import DecodeSettings, decoder_fingerprint, npy_bytes
from decodefs.store import (
    TRAILER_SIZE,
    CorruptEntry,
    EntryKey,
    Store,
    StoreError,
    StoreReadError,
    StoreWriteError,
)
from tests.conftest import Tmpfs, needs_root

V1 = decoder_fingerprint(DecodeSettings())
KEY = EntryKey("v1", 16, "abcdef")


def payload(seed: int = 0, size: int = 16) -> bytes:
    rng = np.random.default_rng(seed)
    return npy_bytes(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def stored_and_closed(root: Path, uuids: list[str]) -> None:
    """Write an entry of size 16 for each uuid (payload(i) for the i-th) and close the store."""
    s = Store(root, {"v1": V1})
    s.open()
    for i, uuid in enumerate(uuids):
        s.write(EntryKey("v1", 16, uuid), payload(i))
    s.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "store", {"v1": V1})
    s.open()
    yield s
    s.close()


def test_entry_is_numpy_save_bytes_plus_trailer_at_the_sharded_path(
    store: Store, tmp_path: Path
) -> None:
    data = payload()
    store.write(KEY, data)
    path = tmp_path / "store" / "v1" / "16" / "ab" / "abcdef.npy"
    assert store.path(KEY) == str(path)
    raw = path.read_bytes()
    assert raw[:-TRAILER_SIZE] == data and len(raw) == len(data) + TRAILER_SIZE
    assert np.array_equal(np.load(path), np.load(io.BytesIO(data)))  # numpy ignores the trailer
    assert np.array_equal(np.load(path, mmap_mode="r"), np.load(io.BytesIO(data)))
    assert bytes(store.read(KEY) or b"") == data
    assert store.read(EntryKey("v1", 16, "absent")) is None
    assert os.listdir(tmp_path / "store" / ".tmp") == []


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b[:100], "no integrity trailer"),
        (lambda b: b[:-1], "no integrity trailer"),
        (lambda b: b"", "truncated to 0 bytes"),
        (lambda b: b[:5] + bytes([b[5] ^ 0x01]) + b[6:], "checksum mismatch"),  # header bit
        (lambda b: b[:200] + bytes([b[200] ^ 0x10]) + b[201:], "checksum mismatch"),  # payload bit
        (
            lambda b: b[: -TRAILER_SIZE - 1] + b[-TRAILER_SIZE:],
            "length",
        ),  # a byte short, trailer intact
    ],
)
def test_damaged_entries_are_detected_and_removed(
    store: Store, damage: object, reason: str
) -> None:
    store.write(KEY, payload())
    path = Path(store.path(KEY))
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(CorruptEntry, match=reason):
        store.read(KEY)
    assert not path.exists()
    assert store.read(KEY) is None


def test_every_single_bit_flip_is_caught(store: Store) -> None:
    data = payload(size=8)
    store.write(KEY, data)
    path = Path(store.path(KEY))
    good = path.read_bytes()
    rng = np.random.default_rng(1)
    for position in rng.choice(len(good), 64, replace=False):
        bit = 1 << int(rng.integers(8))
        path.write_bytes(good[:position] + bytes([good[position] ^ bit]) + good[position + 1 :])
        with pytest.raises(CorruptEntry):
            store.read(KEY)
        store.write(KEY, data)


def test_entries_of_other_decode_settings_are_never_served(tmp_path: Path) -> None:
    first = Store(tmp_path / "store", {"v1": V1})
    first.open()
    first.write(KEY, payload())
    path = Path(first.path(KEY))
    first.close()
    copy = path.read_bytes()

    changed = Store(
        tmp_path / "store", {"v1": decoder_fingerprint(DecodeSettings(resample="bicubic"))}
    )
    changed.open()
    assert not path.exists()  # the old version directory was discarded
    path.parent.mkdir(parents=True)
    path.write_bytes(copy)  # even an old entry put back by hand is refused
    with pytest.raises(CorruptEntry, match="other settings"):
        changed.read(KEY)
    changed.close()


def test_leftover_temp_files_are_removed_at_open(tmp_path: Path) -> None:
    tmp = tmp_path / "store" / ".tmp"
    tmp.mkdir(parents=True)
    (tmp / "0123abcd.npy").write_bytes(b"half a write")
    s = Store(tmp_path / "store", {"v1": V1})
    s.open()
    assert os.listdir(tmp) == []
    s.close()


def test_one_daemon_per_store(store: Store, tmp_path: Path) -> None:
    second = Store(tmp_path / "store", {"v1": V1})
    with pytest.raises(StoreError, match="in use by another decodefs daemon"):
        second.open()


def test_a_store_of_another_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / ".decodefs-store").write_text('{"format": 99}')
    with pytest.raises(StoreError, match="store format 99"):
        Store(tmp_path / "store", {"v1": V1}).open()


def test_usage_is_counted_at_start_and_kept_current(tmp_path: Path) -> None:
    stored_and_closed(tmp_path / "store", [f"u{i:02d}" for i in range(5)])
    entry_bytes = len(payload()) + TRAILER_SIZE

    s = Store(tmp_path / "store", {"v1": V1})
    s.open()
    usage = s.wait_for_usage()
    assert (usage.entries, usage.bytes, usage.complete) == (5, 5 * entry_bytes, True)
    s.write(EntryKey("v1", 16, "new"), payload(9))
    s.write(EntryKey("v1", 16, "u00"), payload(0))  # a rewrite adds nothing
    s.remove(EntryKey("v1", 16, "u01"))
    assert (s.usage().entries, s.usage().bytes) == (5, 5 * entry_bytes)
    s.close()


def test_a_store_that_cannot_be_created_serves_nothing_and_raises_nothing(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    s = Store(tmp_path / "file" / "store", {"v1": V1})
    s.open()
    assert not s.writable
    assert s.read(KEY) is None
    with pytest.raises(StoreWriteError, match="ENOTDIR"):
        s.write(KEY, payload())


@needs_root
def test_full_and_read_only_stores_raise_store_write_error(tmpfs: Tmpfs) -> None:
    root = tmpfs("256k")
    s = Store(root / "store", {"v1": V1})
    s.open()
    big = payload(size=96)  # ~27 KiB each
    written = 0
    with pytest.raises(StoreWriteError, match="ENOSPC"):
        for i in range(100):
            s.write(EntryKey("v1", 96, f"k{i:03d}"), big)
            written += 1
    assert 3 < written < 100
    assert os.listdir(root / "store" / ".tmp") == []  # the failed temp file is gone
    assert bytes(s.read(EntryKey("v1", 96, "k000")) or b"") == big
    s.close()

    subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
    ro = Store(root / "store", {"v1": V1})
    ro.open()
    assert not ro.writable
    assert bytes(ro.read(EntryKey("v1", 96, "k000")) or b"") == big  # hits still work
    with pytest.raises(StoreWriteError, match="EROFS"):
        ro.write(EntryKey("v1", 96, "other"), big)
    ro.close()


def test_an_entry_moved_to_another_keys_path_fails(store: Store) -> None:
    other = EntryKey("v1", 16, "abzzzz")
    store.write(KEY, payload(1))
    store.write(other, payload(2))
    Path(store.path(KEY)).replace(store.path(other))  # same shard dir: a misdirected rename
    with pytest.raises(CorruptEntry, match="another entry's file"):
        store.read(other)


def test_an_unreadable_entry_is_left_alone_not_called_corrupt(store: Store) -> None:
    path = Path(store.path(KEY))
    path.mkdir(parents=True)  # open() fails with EISDIR: nothing is known of its bytes
    with pytest.raises(StoreReadError, match="EISDIR"):
        store.read(KEY)
    assert path.is_dir()


def test_odd_leftovers_do_not_make_the_store_read_only(tmp_path: Path) -> None:
    root = tmp_path / "store"
    (root / ".tmp" / "a-directory").mkdir(parents=True)
    (root / ".tmp" / "a-directory" / "x").write_bytes(b"x")
    (root / "v1").mkdir()
    (root / "v1" / ".fingerprint.json").write_text("[]")  # valid JSON, not an object
    s = Store(root, {"v1": V1})
    s.open()
    assert s.writable
    assert os.listdir(root / ".tmp") == []
    assert V1.hex in (root / "v1" / ".fingerprint.json").read_text()
    s.close()


@needs_root
def test_a_store_full_at_start_opens_and_refuses_writes(tmpfs: Tmpfs) -> None:
    root = tmpfs("64k")
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={root}/filler", "bs=4k"], capture_output=True, check=False
    )
    s = Store(root / "store", {"v1": V1})
    s.open()  # no exception: the daemon must still start
    with pytest.raises(StoreWriteError, match="ENOSPC"):
        s.write(KEY, payload())
    s.close()


def entry_bytes(size: int = 16) -> int:
    return len(payload(size=size)) + TRAILER_SIZE


def test_max_bytes_evicts_least_recently_used_first(tmp_path: Path) -> None:
    s = Store(tmp_path / "store", {"v1": V1}, max_bytes=3 * entry_bytes())
    s.open()
    keys = [EntryKey("v1", 16, f"k{i}") for i in range(3)]
    for i, key in enumerate(keys):
        s.write(key, payload(i))
        time.sleep(0.01)  # distinct access times
    s.record_access(keys[0])  # k0 is now the most recently used
    s.write(EntryKey("v1", 16, "k3"), payload(3))
    assert not Path(s.path(keys[1])).exists()  # k1 was the least recently used
    assert all(Path(s.path(k)).exists() for k in (keys[0], keys[2], EntryKey("v1", 16, "k3")))
    usage = s.usage()
    assert (usage.entries, usage.bytes, usage.evictions) == (3, 3 * entry_bytes(), 1)
    assert list(s.evicted) == [keys[1]]
    s.close()


def test_pinned_entries_are_never_evicted(tmp_path: Path) -> None:
    s = Store(tmp_path / "store", {"v1": V1}, max_bytes=2 * entry_bytes())
    s.open()
    a, b, c = (EntryKey("v1", 16, name) for name in "abc")
    s.write(a, payload(1))
    s.write(b, payload(2))
    s.pin(a)
    s.pin(b)
    with pytest.raises(StoreWriteError, match=r"EDQUOT.*every entry left is in use"):
        s.write(c, payload(3))
    assert Path(s.path(a)).exists() and Path(s.path(b)).exists()
    assert not Path(s.path(c)).exists() and os.listdir(tmp_path / "store" / ".tmp") == []
    s.unpin(b)
    s.write(c, payload(3))  # now b may go
    assert Path(s.path(a)).exists() and not Path(s.path(b)).exists()
    s.close()


def test_usage_is_known_at_once_after_a_restart(tmp_path: Path) -> None:
    stored_and_closed(tmp_path / "store", [f"k{i}" for i in range(4)])
    again = Store(tmp_path / "store", {"v1": V1})
    again.open()
    usage = again.usage()  # no waiting: read from the catalog
    assert (usage.entries, usage.bytes, usage.complete) == (4, 4 * entry_bytes(), True)
    again.close()


def test_a_store_without_a_catalog_is_counted_by_a_scan(tmp_path: Path) -> None:
    stored_and_closed(tmp_path / "store", [f"k{i}" for i in range(4)])
    for name in os.listdir(tmp_path / "store"):
        if name.startswith(".catalog"):
            os.unlink(tmp_path / "store" / name)
    again = Store(tmp_path / "store", {"v1": V1}, max_bytes=4 * entry_bytes())
    again.open()
    assert again.wait_for_usage().entries == 4
    again.write(EntryKey("v1", 16, "new"), payload(9))  # the scanned entries are evictable
    assert again.usage().entries == 4 and again.usage().evictions == 1
    again.close()


def test_a_failing_catalog_stops_eviction_instead_of_spinning(tmp_path: Path) -> None:
    s = Store(tmp_path / "store", {"v1": V1}, max_bytes=2 * entry_bytes())
    s.open()
    s.write(EntryKey("v1", 16, "a"), payload(1))
    s.write(EntryKey("v1", 16, "b"), payload(2))
    catalog = s._catalog
    assert catalog is not None
    catalog.close()  # every further SQLite call fails, as on a broken disk
    started = time.monotonic()
    with pytest.raises(StoreWriteError, match=r"EIO.*catalog"):
        s.write(EntryKey("v1", 16, "c"), payload(3))
    assert time.monotonic() - started < 5
    assert s.evictions <= 1


@needs_root
def test_min_free_fraction_never_wipes_the_store_for_nothing(tmpfs: Tmpfs) -> None:
    root = tmpfs("1m")
    s = Store(root / "store", {"v1": V1}, min_free_fraction=0.5)
    s.open()
    for i in range(3):
        s.write(EntryKey("v1", 16, f"k{i}"), payload(i))
    # Another tenant fills the filesystem far past what evicting the store frees.
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={root}/other", "bs=4k", "count=200"], capture_output=True
    )
    with pytest.raises(StoreWriteError, match="no room even if every entry were evicted"):
        s.write(EntryKey("v1", 16, "new"), payload(9))
    assert s.evictions == 0 and s.usage().entries == 3
    assert all(Path(s.path(EntryKey("v1", 16, f"k{i}"))).exists() for i in range(3))
    s.close()


def test_usage_is_exact_after_a_fill_raced_by_writes_and_removals(tmp_path: Path) -> None:
    # A store without a catalog: 20,000 entries in many shard directories (the
    # fill only stats files, so their bytes need not be real entries).
    root = tmp_path / "store"
    rng = np.random.default_rng(5)
    keys = [EntryKey("v1", 8, rng.bytes(6).hex()) for _ in range(20_000)]
    for key in keys:
        path = root / "v1" / "8" / key.uuid[:2] / f"{key.uuid}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 300)
    s = Store(root, {"v1": V1})
    s.open()  # the fill scan runs in the background ...
    for i, key in enumerate(keys[::7]):  # ... while entries are removed and written
        s.remove(key)
        if i % 10 == 0:
            s.write(EntryKey("v1", 8, f"new{i:05d}"), payload(i, size=8))
    usage = s.wait_for_usage()
    on_disk = list((root / "v1").glob("*/*/*.npy"))
    assert s._catalog is not None
    assert s._catalog.totals() == (usage.entries, usage.bytes)
    assert usage.entries == len(on_disk)
    assert usage.bytes == sum(p.stat().st_size for p in on_disk)
    s.close()


def test_pending_accesses_stay_bounded(store: Store) -> None:
    keys = [EntryKey("v1", 16, f"k{i}") for i in range(3)]
    assert store.record_access(keys[0], limit=2) and store.record_access(keys[1], limit=2)
    assert not store.record_access(keys[2], limit=2)  # a new key over the limit: not noted
    assert store.record_access(keys[0], limit=2)  # a pending one is refreshed
    store.flush_accesses()
    assert store.record_access(keys[2], limit=2)  # room again after a flush


def test_derived_caches_are_the_daemons_alone(store: Store) -> None:
    path = store.cache_dir("index")
    assert path is not None and stat.S_IMODE(os.stat(path).st_mode) == 0o700
