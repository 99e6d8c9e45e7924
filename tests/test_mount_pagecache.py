"""One page-cache copy, on a real mount read by plain clients: an array read through
the mount stays cached as the mount file's pages, the store file's pages that the
daemon read to serve it are dropped, and a direct reader's (read_array) are left.
Also: an entry removed mid-read, and the daemon killed mid-read.

Residency is read with fincore (mincore(2)), which brings nothing in. On a store
filesystem that cannot read without waiting (tmpfs), the page cache is the
storage and nothing is dropped: those tests skip there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from decodefs import read_array
from decodefs.common.entry import EntryKey
from decodefs.common.npy import npy_file_size
from decodefs.daemon.process import READAHEAD_KB
from decodefs.store.pagecache import drop, read_resident
from tests.conftest import MountFactory, needs_root_because
from tests.helpers import is_live_mount, reference_npy, wait_until

SIZE = 224


def resident_bytes(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(out)


def readahead_kb(mountpoint: Path) -> int:
    device = os.stat(mountpoint).st_dev
    bdi = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
    return int(bdi.read_text())


def evict_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        drop(fd)
    finally:
        os.close(fd)


@pytest.fixture
def on_disk(tmp_path: Path) -> None:
    probe = tmp_path / ".probe"
    probe.write_bytes(b"x" * 4096)
    fd = os.open(probe, os.O_RDONLY)
    try:
        read_resident(fd, 0, 1)
    except OSError:
        pytest.skip(f"{tmp_path} is a tmpfs: its page cache is the store itself")
    finally:
        os.close(fd)
        probe.unlink()


def stored_then_cold(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], store: Path
) -> list[Path]:
    """Store every photo's array with a first daemon, stop it, and push the entry
    files out of the page cache: a store on flash, as after a reboot."""
    first = mounts({"v1": photos_dir}, name="first", store=store)
    for uuid in photos:
        first.path("v1", str(SIZE), f"{uuid}.npy").read_bytes()
    first.stop()
    entries = [store / EntryKey("v1", SIZE, uuid).relpath for uuid in photos]
    for entry in entries:
        evict_pages(entry)
    return entries


@needs_root_because("only root may raise a mount's readahead")
def test_a_plain_read_leaves_one_copy_the_mount_files(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path, on_disk: None
) -> None:
    store = tmp_path / "store"
    entries = stored_then_cold(mounts, photos_dir, photos, store)
    mount = mounts({"v1": photos_dir}, store=store)
    # The daemon raises the mount's readahead once the kernel has the mount (root only).
    wait_until(lambda: readahead_kb(mount.mountpoint) >= READAHEAD_KB, what="the readahead")
    files = [mount.path("v1", str(SIZE), f"{uuid}.npy") for uuid in photos]
    for path, original in zip(files, photos.values(), strict=True):
        assert path.read_bytes() == reference_npy(original, SIZE)  # a plain read, as cat does
    try:
        wait_until(
            lambda: [resident_bytes(e) for e in entries] == [0] * len(entries),
            what="every entry file's pages to be dropped",
            timeout=5,
        )
    except AssertionError:
        print("DEBUG", [(e.name, resident_bytes(e)) for e in entries], mount.stats())
        raise
    size = npy_file_size(SIZE)
    assert all(resident_bytes(f) >= size for f in files)  # the one copy: the mount's
    stats = mount.stats()
    assert stats["page_drops"] == len(photos) and stats["decodes"] == 0
    # Verified on its first open, then read in one READ from those pages: the entry
    # came from the disk once.
    assert stats["store_reads_inline"] == len(photos) and stats["store_reads_threaded"] == 0
    # The second epoch is the kernel's: no request reaches the store.
    for path in files:
        np.load(path)
    assert mount.stats()["store_reads_inline"] == len(photos)


def test_a_direct_readers_pages_stay_while_plain_readers_read_the_same_arrays(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path, on_disk: None
) -> None:
    store = tmp_path / "store"
    entries = stored_then_cold(mounts, photos_dir, photos, store)
    mount = mounts({"v1": photos_dir}, store=store)
    uuids = list(photos)
    direct = set(uuids[: len(uuids) // 2])
    for uuid in direct:  # read_array reads the store's files: their pages are its
        array = read_array(mount.path("v1", str(SIZE), f"{uuid}.npy"))
        assert array.shape == (SIZE, SIZE, 3)
    for uuid in uuids:  # then a plain reader reads every array through the mount
        path = mount.path("v1", str(SIZE), f"{uuid}.npy")
        assert path.read_bytes() == reference_npy(photos[uuid], SIZE)
    plain_only = [e for e, u in zip(entries, uuids, strict=True) if u not in direct]
    wait_until(
        lambda: sum(resident_bytes(e) for e in plain_only) == 0,
        what="the pages only the daemon read to be dropped",
    )
    kept = [e for e, u in zip(entries, uuids, strict=True) if u in direct]
    assert all(resident_bytes(e) > 0 for e in kept)  # read_array's copy stays
    assert mount.stats()["page_drops"] == len(plain_only)


def test_an_entry_removed_mid_read_is_still_read_right(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    # 1024x1024: a 3 MiB array, read in several READ requests.
    store = tmp_path / "store"
    mount = mounts({"v1": photos_dir}, store=store, sizes=[1024])
    uuids = list(photos)[:2]
    for uuid in uuids:  # stored, then a fresh daemon: nothing verified or kept open
        os.close(os.open(mount.path("v1", "1024", f"{uuid}.npy"), os.O_RDONLY | os.O_NONBLOCK))
    mount.stop()
    mount = mounts({"v1": photos_dir}, name="again", store=store, sizes=[1024])
    for i, uuid in enumerate(uuids):
        entry = store / EntryKey("v1", 1024, uuid).relpath
        with open(mount.path("v1", "1024", f"{uuid}.npy"), "rb", buffering=0) as f:
            head = f.read(64 * 1024)
            if i == 1:  # also without its pages: the rest must come from a rebuild
                evict_pages(entry)
                mount.path(".decodefs", "stats.json").read_bytes()
            entry.unlink()  # removed behind the daemon's back, as eviction would
            rest = f.read()
        assert head + rest == reference_npy(photos[uuid], 1024), uuid
    assert "unexpected" not in mount.stats()["errors"]


_READ_FOREVER = """
import sys
from pathlib import Path
import numpy as np
files = sorted(Path(sys.argv[1]).iterdir())
while True:
    for path in files:
        try:
            array = np.load(path)
        except OSError:
            continue  # the daemon is gone: an error, never other bytes
        assert array.shape == (int(sys.argv[2]),) * 2 + (3,), path
        print(path.name, int(array.astype(np.uint64).sum()), flush=True)
"""


def test_kill_9_mid_read_serves_no_wrong_byte_and_leaves_the_store_whole(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    mount = mounts({"v1": photos_dir}, store=store, sizes=[96], expect_errors=("",))
    directory = mount.path("v1", "96")
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _READ_FOREVER, str(directory), "96"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        assert readers[0].stdout is not None
        for _ in range(len(photos)):  # every array decoded, stored and read at least once
            readers[0].stdout.readline()
        mount.kill9()
        wait_until(lambda: not is_live_mount(mount.mountpoint), what="the mount to go dead")
    finally:
        for reader in readers:
            reader.send_signal(signal.SIGKILL)
    sums = {
        path.stem: int(np.frombuffer(reference_npy(path, 96)[-96 * 96 * 3 :], np.uint8).sum())
        for path in photos.values()
    }
    for reader in readers:
        out, err = reader.communicate()
        assert "AssertionError" not in err, err
        for line in out.splitlines():  # every array any reader got was the right one
            name, total = line.split()
            assert sums[name.removesuffix(".npy")] == int(total), name
    again = mounts({"v1": photos_dir}, name="restarted", store=store, sizes=[96])
    for uuid, path in photos.items():
        assert again.path("v1", "96", f"{uuid}.npy").read_bytes() == reference_npy(path, 96)
    stats = again.stats()
    assert stats["corrupt_entries"] == 0  # nothing half-written or damaged by the kill
