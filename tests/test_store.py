"""The store on disk: atomic self-verifying entries, fingerprints, locks, usage."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from decodefs.common.config import parse_config
from decodefs.common.decode import DecodeSettings, decoder_fingerprint
from decodefs.common.entry import EntryKey
from decodefs.common.npy import npy_bytes
from decodefs.common.protocol import CHANGES_FILE, TRAILER_SIZE
from decodefs.common.readers import Readers
from decodefs.common.source import scan_source
from decodefs.store.store import CorruptEntry, Store, StoreError, StoreReadError, StoreWriteError
from tests.conftest import Tmpfs, fail_read_only, needs_root

V1 = decoder_fingerprint(DecodeSettings())
KEY = EntryKey("v1", 16, "abcdef")


def payload(seed: int = 0, size: int = 16) -> bytes:
    rng = np.random.default_rng(seed)
    return npy_bytes(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def stored_and_closed(root: Path, uuids: list[str]) -> None:
    """Write an entry of size 16 for each uuid (payload(i) for the i-th) and close the store,
    once its catalog is filled (closed before, the next start would fill it again)."""
    s = Store(root, {"v1": V1})
    s.open()
    s.wait_for_usage()
    for i, uuid in enumerate(uuids):
        s.write(EntryKey("v1", 16, uuid), payload(i))
    s.close()


def read(store: Store, key: EntryKey) -> bytes | None:
    """The verified payload of ``key``, as the engine reads it; None if there is none."""
    checked = store.verify(key)
    return None if checked is None else store.read_range(key, 0, checked.length)


def path_of(store: Store, key: EntryKey) -> Path:
    return Path(store.root) / key.relpath


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
    assert path_of(store, KEY) == path
    raw = path.read_bytes()
    assert raw[:-TRAILER_SIZE] == data and len(raw) == len(data) + TRAILER_SIZE
    assert np.array_equal(np.load(path), np.load(io.BytesIO(data)))  # numpy ignores the trailer
    assert np.array_equal(np.load(path, mmap_mode="r"), np.load(io.BytesIO(data)))
    assert read(store, KEY) == data
    assert read(store, EntryKey("v1", 16, "absent")) is None
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
    path = path_of(store, KEY)
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(CorruptEntry, match=reason):
        read(store, KEY)
    assert not path.exists()
    assert read(store, KEY) is None


def test_every_single_bit_flip_is_caught(store: Store) -> None:
    data = payload(size=8)
    store.write(KEY, data)
    path = path_of(store, KEY)
    good = path.read_bytes()
    rng = np.random.default_rng(1)
    for position in rng.choice(len(good), 64, replace=False):
        bit = 1 << int(rng.integers(8))
        path.write_bytes(good[:position] + bytes([good[position] ^ bit]) + good[position + 1 :])
        with pytest.raises(CorruptEntry):
            read(store, KEY)
        store.write(KEY, data)


def test_entries_of_other_decode_settings_are_never_served(tmp_path: Path) -> None:
    first = Store(tmp_path / "store", {"v1": V1})
    first.open()
    first.write(KEY, payload())
    path = path_of(first, KEY)
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
        read(changed, KEY)
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
    assert read(s, KEY) is None
    with pytest.raises(StoreWriteError, match="EROFS"):
        s.write(KEY, payload())


@needs_root
def test_full_and_read_only_stores_raise_store_write_error(tmpfs: Tmpfs) -> None:
    root = tmpfs("320k")  # (the catalog or an entry meets the full filesystem first: ENOSPC)
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
    assert read(s, EntryKey("v1", 96, "k000")) == big
    s.close()

    subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
    ro = Store(root / "store", {"v1": V1})
    ro.open()
    assert not ro.writable
    assert read(ro, EntryKey("v1", 96, "k000")) == big  # hits still work
    with pytest.raises(StoreWriteError, match="EROFS"):
        ro.write(EntryKey("v1", 96, "other"), big)
    ro.close()


def test_an_entry_moved_to_another_keys_path_fails(store: Store) -> None:
    other = EntryKey("v1", 16, "abzzzz")
    store.write(KEY, payload(1))
    store.write(other, payload(2))
    path_of(store, KEY).replace(path_of(store, other))  # same shard dir: a misdirected rename
    with pytest.raises(CorruptEntry, match="another entry's file"):
        read(store, other)


def test_an_unreadable_entry_is_left_alone_not_called_corrupt(store: Store) -> None:
    path = path_of(store, KEY)
    path.mkdir(parents=True)  # open() fails with EISDIR: nothing is known of its bytes
    with pytest.raises(StoreReadError, match="EISDIR"):
        read(store, KEY)
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
    ticks = iter(range(1_000_000))
    s = Store(
        tmp_path / "store", {"v1": V1}, max_bytes=3 * entry_bytes(), clock=lambda: next(ticks)
    )
    s.open()
    keys = [EntryKey("v1", 16, f"k{i}") for i in range(3)]
    for i, key in enumerate(keys):
        s.write(key, payload(i))
    s.capacity.record_access(keys[0])  # k0 is now the most recently used
    s.write(EntryKey("v1", 16, "k3"), payload(3))
    assert not path_of(s, keys[1]).exists()  # k1 was the least recently used
    assert all(path_of(s, k).exists() for k in (keys[0], keys[2], EntryKey("v1", 16, "k3")))
    usage = s.usage()
    assert (usage.entries, usage.bytes, usage.evictions) == (3, 3 * entry_bytes(), 1)
    assert list(s.capacity.evicted) == [keys[1]]
    s.close()


def test_pinned_entries_are_never_evicted(tmp_path: Path) -> None:
    s = Store(tmp_path / "store", {"v1": V1}, max_bytes=2 * entry_bytes())
    s.open()
    a, b, c = (EntryKey("v1", 16, name) for name in "abc")
    s.write(a, payload(1))
    s.write(b, payload(2))
    s.capacity.pin(a)
    s.capacity.pin(b)
    with pytest.raises(StoreWriteError, match=r"EDQUOT.*every entry left is in use"):
        s.write(c, payload(3))
    assert path_of(s, a).exists() and path_of(s, b).exists()
    assert not path_of(s, c).exists() and os.listdir(tmp_path / "store" / ".tmp") == []
    s.capacity.unpin(b)
    s.write(c, payload(3))  # now b may go
    assert path_of(s, a).exists() and not path_of(s, b).exists()
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
    catalog = s.capacity._catalog
    assert catalog is not None
    catalog.close()  # every further SQLite call fails, as on a broken disk
    started = time.monotonic()
    with pytest.raises(StoreWriteError, match=r"EIO.*catalog"):
        s.write(EntryKey("v1", 16, "c"), payload(3))
    assert time.monotonic() - started < 5
    assert s.capacity.evictions <= 1


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
    assert s.capacity.evictions == 0 and s.usage().entries == 3
    assert all(path_of(s, EntryKey("v1", 16, f"k{i}")).exists() for i in range(3))
    s.close()


def test_usage_is_exact_after_a_fill_raced_by_writes_and_removals(tmp_path: Path) -> None:
    # A store without a catalog: 20,000 entries in many shard directories (the
    # fill only stats files, so their bytes need not be real entries).
    root = tmp_path / "store"
    rng = np.random.default_rng(5)
    keys = [EntryKey("v1", 8, rng.bytes(6).hex()) for _ in range(20_000)]
    for key in keys:
        path = root / "v1" / "8" / key.key[:2] / f"{key.key}.npy"
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
    assert s.capacity._catalog is not None
    assert s.capacity._catalog.totals() == (usage.entries, usage.bytes)
    assert usage.entries == len(on_disk)
    assert usage.bytes == sum(p.stat().st_size for p in on_disk)
    s.close()


def test_pending_accesses_stay_bounded(store: Store) -> None:
    keys = [EntryKey("v1", 16, f"k{i}") for i in range(3)]
    assert store.capacity.record_access(keys[0], limit=2) and store.capacity.record_access(
        keys[1], limit=2
    )
    assert not store.capacity.record_access(keys[2], limit=2)  # a new key over the limit: not noted
    assert store.capacity.record_access(keys[0], limit=2)  # a pending one is refreshed
    store.capacity.flush_accesses()
    assert store.capacity.record_access(keys[2], limit=2)  # room again after a flush


def test_a_report_of_many_hits_stays_bounded_and_reaches_the_catalog(store: Store) -> None:
    capacity = store.capacity
    keys = [EntryKey("v1", 16, f"k{i}") for i in range(6)]
    for i, key in enumerate(keys):
        store.write(key, payload(i, size=16))
    capacity.flush_accesses()
    times = iter(range(int(time.time()) + 1000, int(time.time()) + 2000))  # after the writes
    capacity._clock = lambda: float(next(times))
    capacity.pin_hit(keys[5])  # an open's hit: pending, and counted against the limit
    capacity.unpin(keys[5])
    # A report names keys as plain (version, size, key) tuples, one of them twice.
    plain = [(key.version, key.size, key.key) for key in keys]
    report = [plain[0], plain[1], plain[0], plain[2], plain[3]]
    assert capacity.record_accesses(report, limit=3) == 3  # k2 and k3 new past the limit
    assert capacity.record_accesses([plain[3]], limit=3) == 0  # still full: not noted
    assert capacity.record_accesses([plain[1]], limit=3) == 1  # a pending one refreshed
    assert set(capacity._accesses) == {keys[5], keys[0], keys[1]}
    capacity.flush_accesses()
    assert capacity._catalog is not None
    # Least recently used first: k2, k3 and k4 never reported, then k5, k0, k1.
    order = [EntryKey(row.version, row.size, row.key) for row in capacity._catalog.oldest(6)]
    assert order[3:] == [keys[5], keys[0], keys[1]]
    assert set(order[:3]) == {keys[2], keys[3], keys[4]}


def test_derived_caches_are_the_daemons_alone(store: Store) -> None:
    path = store.cache_dir("index")
    assert path is not None and stat.S_IMODE(os.stat(path).st_mode) == 0o700


# -- a root daemon on a shared machine (defects 1, 2 and 6 of the reliability issue) ---

OTHER_UID = 65534  # nobody: "another local user"


@needs_root
def test_a_store_another_user_made_is_refused_and_nothing_it_points_to_is_touched(
    tmp_path: Path,
) -> None:
    victim, victim2 = tmp_path / "victim", tmp_path / "victim2"
    victim.mkdir()
    victim2.mkdir()
    (victim / "precious").write_text("keep me")
    root = tmp_path / "store"  # made by another user ahead of the daemon, with traps
    root.mkdir()
    (root / ".tmp").symlink_to(victim)
    (root / "v1").symlink_to(victim2)
    for path in (root, root / ".tmp", root / "v1"):
        os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
    with pytest.raises(StoreError, match=f"belongs to uid {OTHER_UID}"):
        Store(root, {"v1": V1}).open()
    assert (victim / "precious").read_text() == "keep me"
    assert os.listdir(victim2) == []


@needs_root
def test_a_symlink_anywhere_in_the_store_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    for trap in (".tmp", "v1", ".catalog.sqlite3", "v1/16", "v1/16/ab"):
        root = tmp_path / f"store-{trap.replace('/', '-')}"
        (root / trap).parent.mkdir(parents=True, exist_ok=True)
        (root / trap).symlink_to(victim)
        with pytest.raises(StoreError, match="is a symlink"):
            Store(root, {"v1": V1}).open()
    assert os.listdir(victim) == ["precious"]


@needs_root
@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_store_others_may_write_to_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "store"
    (root / "v1").mkdir(parents=True)
    os.chmod(root / "v1", mode)
    with pytest.raises(StoreError, match="writable by no one else"):
        Store(root, {"v1": V1}).open()


@needs_root
def test_the_path_to_the_store_must_not_pass_another_users_directory_or_symlink(
    tmp_path: Path,
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(StoreError, match=f"{theirs} belongs to uid {OTHER_UID}"):
        Store(theirs / "store", {"v1": V1}).open()
    assert not (theirs / "store").exists()  # nothing was made there

    shared = tmp_path / "shared"  # like /tmp: everyone may create, the sticky bit protects
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "store").symlink_to(tmp_path / "elsewhere")
    os.chown(shared / "store", OTHER_UID, OTHER_UID, follow_symlinks=False)
    with pytest.raises(StoreError, match="another user's symlink"):
        Store(shared / "store", {"v1": V1}).open()
    assert not (tmp_path / "elsewhere").exists()

    mine = Store(shared / "mine", {"v1": V1})  # made by the daemon itself: fine
    mine.open()
    mine.write(KEY, payload())
    mine.close()


def test_a_symlink_of_roots_in_the_path_is_followed(tmp_path: Path) -> None:
    (tmp_path / "flash").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "flash")
    s = Store(tmp_path / "link" / "store", {"v1": V1})
    s.open()
    s.write(KEY, payload())
    s.close()
    assert (tmp_path / "flash" / "store" / KEY.relpath).is_file()


@pytest.mark.parametrize(("shared", "dirs", "files"), [(False, 0o700, 0o600), (True, 0o755, 0o644)])
def test_the_stores_modes_follow_who_may_read_the_mount(
    tmp_path: Path, shared: bool, dirs: int, files: int
) -> None:
    originals = tmp_path / "originals"
    originals.mkdir()
    (originals / "a.jpg").write_bytes(b"not decoded by a scan")
    root = tmp_path / "store"
    os.umask(0o000 if shared else 0o022)  # whatever the umask says
    try:
        s = Store(root, {"v1": V1}, access="everyone" if shared else "owner")
        s.open()
        s.wait_for_usage()
        s.write(KEY, payload())
        index = s.cache_dir("index")  # the daemon's alone, whatever the policy
        scan_source("v1", originals, {".jpg"}, cache_dir=index)
        # Every file in the store while it is open (the catalog's WAL and SHM too).
        modes = {p.relative_to(root): stat.S_IMODE(p.lstat().st_mode) for p in _files(root)}
        s.close()
    finally:
        os.umask(0o022)
    assert index is not None and stat.S_IMODE(os.stat(index).st_mode) == 0o700
    entry = root / KEY.relpath
    for directory in (root, root / "v1", entry.parent.parent, entry.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == dirs, directory
    assert {".decodefs-store", "v1/.fingerprint.json", KEY.relpath, ".index/v1.json"} <= {
        str(p) for p in modes
    }
    assert {".catalog.sqlite3", ".catalog.sqlite3-wal", ".catalog.sqlite3-shm"} <= {
        str(p) for p in modes
    }
    for path, mode in modes.items():  # the index cache is the daemon's alone
        assert mode == (0o600 if path.parts[0] == ".index" else files), path

    # The policy changes with the config: the store follows at the next start.
    again = Store(root, {"v1": V1}, access="owner" if shared else "everyone")
    again.open()
    again.close()
    assert stat.S_IMODE(root.stat().st_mode) == (0o755 if not shared else 0o700)
    for name in (".decodefs-store", "v1/.fingerprint.json", ".catalog.sqlite3"):
        assert stat.S_IMODE((root / name).stat().st_mode) == (0o644 if not shared else 0o600)


def _files(root: Path) -> Iterator[Path]:
    """Every file under ``root`` that is no directory (nothing is followed)."""
    for path in root.rglob("*"):
        if not path.is_dir() or path.is_symlink():
            yield path


def test_the_one_daemon_lock_survives_the_stores_contents_being_removed(tmp_path: Path) -> None:
    locks = str(tmp_path / "locks")
    first = Store(tmp_path / "store", {"v1": V1}, lock_dir=locks)
    first.open()
    for name in os.listdir(tmp_path / "store"):
        path = tmp_path / "store" / name
        subprocess.run(["rm", "-rf", str(path)], check=True)
    second = Store(tmp_path / "store", {"v1": V1}, lock_dir=locks)
    with pytest.raises(StoreError, match="in use by another decodefs daemon"):
        second.open()
    subprocess.run(["rm", "-rf", str(tmp_path / "store")], check=True)  # the store itself too
    with pytest.raises(StoreError, match="in use by another decodefs daemon"):
        Store(tmp_path / "store", {"v1": V1}, lock_dir=locks).open()
    first.close()
    third = Store(tmp_path / "store", {"v1": V1}, lock_dir=locks)
    third.open()  # free once the first is gone
    third.close()


def test_a_store_removed_at_runtime_is_noticed_and_made_again(tmp_path: Path) -> None:
    s = Store(tmp_path / "store", {"v1": V1})
    s.open()
    s.write(KEY, payload(1))
    generation = s.generation
    assert not s.check()  # nothing happened

    subprocess.run(["rm", "-rf", str(tmp_path / "store")], check=True)
    assert s.check()
    assert s.generation != generation  # every entry verified before is gone
    assert s.writable and s.usage().entries == 0
    assert read(s, KEY) is None
    s.write(KEY, payload(2))
    assert read(s, KEY) == payload(2)
    assert (tmp_path / "store" / KEY.relpath).is_file()
    assert s.usage().entries == 1
    s.close()


def test_a_store_that_cannot_be_made_again_is_not_writable_until_it_can(tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    s = Store(parent / "store", {"v1": V1})
    s.open()
    s.write(KEY, payload(1))
    subprocess.run(["rm", "-rf", str(parent)], check=True)
    (tmp_path / "parent").write_text("now a file: the store cannot be made here")
    assert s.check()
    assert not s.writable and s.usage().entries == 0
    with pytest.raises(StoreWriteError):
        s.write(KEY, payload(1))
    assert not s.check()  # still impossible: no change
    (tmp_path / "parent").unlink()
    assert s.check()
    assert s.writable
    s.write(KEY, payload(3))
    assert read(s, KEY) == payload(3)
    s.close()


@needs_root
def test_a_store_that_fails_read_only_at_runtime_keeps_serving_hits(
    ext4: Callable[[str], Path],
) -> None:
    root = ext4("16M")
    s = Store(root / "store", {"v1": V1})
    s.open()
    s.write(KEY, payload(1))
    fail_read_only(root)
    with pytest.raises(StoreWriteError, match="EROFS"):
        s.write(EntryKey("v1", 16, "other"), payload(2))
    assert not s.writable and not s.check()  # still read-only: nothing changes
    assert read(s, KEY) == payload(1)  # hits go on
    s.close()


@needs_root
def test_a_store_read_only_or_full_at_start_is_written_once_it_can_be(tmpfs: Tmpfs) -> None:
    root = tmpfs("1m")
    made = Store(root / "store", {"v1": V1})
    made.open()
    made.close()
    subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
    s = Store(root / "store", {"v1": V1})
    s.open()
    assert not s.writable and not s.check()
    subprocess.run(["mount", "-o", "remount,rw", str(root)], check=True)
    assert s.check() and s.writable
    s.write(KEY, payload(1))
    assert read(s, KEY) == payload(1)
    s.close()

    subprocess.run(["dd", "if=/dev/zero", f"of={root}/filler", "bs=4k"], capture_output=True)
    full = Store(root / "store", {"v1": V1})
    full.open()  # full at start: serves, does not write
    assert not full.writable and not full.check()
    with pytest.raises(StoreWriteError, match="ENOSPC"):
        full.write(EntryKey("v1", 16, "other"), payload(2))
    (root / "filler").unlink()
    assert full.check() and full.writable
    full.write(EntryKey("v1", 16, "third"), payload(3))
    assert read(full, EntryKey("v1", 16, "third")) == payload(3)
    assert full.wait_for_usage().entries == 2
    full.close()


def test_a_file_moved_in_is_named_as_a_write_names_it(store: Store, tmp_path: Path) -> None:
    """A mirror version's key with "/" is stored under its escaped name, not its key."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    for i, uuid in enumerate(["cat/0001", "100%/x", "abcdef"]):
        key = EntryKey("v1", 16, uuid)
        (cache / "array.npy").write_bytes(payload(i))
        (cache / "array.npy").chmod(0o600)
        fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
        try:
            store.move_in(key, fd, "array.npy", len(payload(i)))
        finally:
            os.close(fd)
        assert not (cache / "array.npy").exists()
        assert path_of(store, key).name == key.file_name
        assert read(store, key) == payload(i)
    assert store.usage().entries == 3


def test_a_store_from_a_config_has_its_limits_policy_and_fingerprints(tmp_path: Path) -> None:
    originals = tmp_path / "originals"
    originals.mkdir()
    raw = {
        "store": "store",
        "allow_other": True,
        "max_store_bytes": 10 * entry_bytes(),
        "min_free_fraction": 0.01,
        "versions": {
            "u": {"source": "originals"},
            "m": {"source": "originals", "layout": "mirror", "resample": "nearest"},
        },
    }
    config = parse_config(raw, base_dir=tmp_path)
    s = Store.from_config(config, lock_dir=str(tmp_path / "locks"))
    assert s.root == str(tmp_path / "store") and s.file_mode == 0o644 and s.dir_mode == 0o755
    assert (s.capacity.max_bytes, s.capacity.min_free_fraction) == (10 * entry_bytes(), 0.01)
    # The fingerprints the daemon checks entries against: the layout is part of them.
    assert s.digests() == {name: v.fingerprint().hex for name, v in config.versions.items()}
    assert s.digest("m") != s.digest("u") == config.versions["u"].fingerprint().digest


def test_a_lowered_limit_is_met_by_trim_oldest_first_and_never_a_pinned_entry(
    tmp_path: Path,
) -> None:
    uuids = [f"e{i:02d}" for i in range(10)]
    stored_and_closed(tmp_path / "store", uuids)  # no limit then: 10 entries
    ticks = iter(range(1_000_000, 2_000_000))
    s = Store(
        tmp_path / "store", {"v1": V1}, max_bytes=4 * entry_bytes(), clock=lambda: next(ticks)
    )
    s.open()
    try:
        assert s.wait_for_usage().entries == 10 and s.capacity.over_limit()
        for uuid in uuids[5:]:  # read lately: the newest
            s.capacity.record_access(EntryKey("v1", 16, uuid))
        s.capacity.pin(EntryKey("v1", 16, "e00"))  # held open by a reader: stays
        assert s.capacity.trim() == (6, 6 * entry_bytes())
        assert not s.capacity.over_limit()
        kept = sorted(k for k in uuids if s.contains(EntryKey("v1", 16, k)))
        assert kept == ["e00", "e07", "e08", "e09"]
        assert s.usage().bytes == 4 * entry_bytes() and s.usage().evictions == 6
        assert s.usage_by_size()[("v1", 16)].entries == 4
        assert s.capacity.trim() == (0, 0)  # within its limit: nothing more
    finally:
        s.close()


@pytest.mark.parametrize("absent", [10, 6000])  # opened one by one; matched by a walk
def test_share_all_gives_the_entries_there_their_readers_mode(tmp_path: Path, absent: int) -> None:
    readers = {"k-open": Readers(0, 0, 0o444), "k-shut": Readers(0, 0, 0o400)}
    s = Store(tmp_path / "store", {"v1": V1}, access="originals")
    s.readers = lambda key: readers.get(key.key, Readers(0, 0, 0o400))
    s.open()
    try:
        s.wait_for_usage()
        stored = [EntryKey("v1", 16, key) for key in readers]
        for key in stored:
            s.write(key, payload())
        for key in stored:  # as a store written under the "everyone" policy left them
            os.chmod(tmp_path / "store" / key.relpath, 0o644)
        missing = [f"gone-{i}" for i in range(absent)]
        assert s.share_all("v1", {16, 32}, [*missing, *readers]) == len(stored)
        assert s.share_all("v2", {16}, list(readers)) == 0  # another version's keys
    finally:
        s.close()
    modes = {key.key: stat.S_IMODE((tmp_path / "store" / key.relpath).stat().st_mode)
             for key in stored}  # fmt: skip
    assert modes == {"k-open": 0o644, "k-shut": 0o600}


def test_the_change_token_is_new_whenever_an_entry_a_reader_may_hold_changes(
    store: Store,
) -> None:
    token_file = Path(store.root) / CHANGES_FILE

    def token() -> bytes:
        data = token_file.read_bytes()
        assert len(data) == 8
        return data

    st = token_file.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600  # access = "owner"
    assert st.st_uid == os.geteuid()
    seen = [token()]
    store.write(KEY, payload(1))
    assert token() == seen[-1]  # a new entry: no reader holds it
    for change in (
        lambda: store.write(KEY, payload(2)),  # replaced
        lambda: store.share(KEY),  # given its original's readers
        lambda: store.remove(KEY),  # unlinked (evicted, or removed)
    ):
        change()
        assert token() not in seen
        seen.append(token())
    store.close()
    again = Store(store.root, {"v1": V1})
    again.open()  # a new serving process: it knows nothing of what changed before it
    assert token() not in seen
    again.close()
