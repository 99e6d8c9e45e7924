"""Faults injected for real: bad originals, corrupt entries, full and read-only stores."""

from __future__ import annotations

import errno
import io
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from decodefs import DecodeSettings, npy_bytes, read_array
from decodefs.common.decode import decoder_fingerprint
from decodefs.common.entry import EntryKey
from decodefs.common.protocol import TRAILER_SIZE
from decodefs.store.store import Store
from tests.conftest import MountFactory, Tmpfs, needs_root
from tests.helpers import decodefs, errno_of, reference_npy, wait_until, write_bad_originals


def read(path: Path) -> bytes:
    return path.read_bytes()


@pytest.fixture
def corpus(tmp_path: Path, photos: dict[str, Path]) -> Path:
    """A private copy of the photos (tests change originals)."""
    root = tmp_path / "originals"
    for path in photos.values():
        shutil.copy(path, root / path.name if root.exists() else _mkdir(root) / path.name)
    return root


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def test_bad_originals_are_eio_for_that_file_only(
    mounts: MountFactory, corpus: Path, photos: dict[str, Path]
) -> None:
    bad = write_bad_originals(corpus / "bad", photos["astronaut-baseline"])
    mount = mounts({"v1": corpus}, error_cache_seconds=0.5)
    for uuid in bad:
        assert errno_of(read, mount.path("v1", "224", f"{uuid}.npy")) == errno.EIO, uuid
        assert os.stat(mount.path("v1", "224", f"{uuid}.npy")).st_size > 0  # listing still works
    for uuid, path in photos.items():  # the daemon keeps serving everything else
        assert read(mount.path("v1", "224", f"{uuid}.npy")) == reference_npy(path, 224)
    stats = mount.stats()
    assert stats["decode_errors"] == len(bad)
    assert stats["decodes"] == len(bad) + len(photos)  # failed decodes ran too
    assert stats["errors"]["EIO"] == len(bad)
    log = mount.log_text()
    for uuid, path in bad.items():
        assert f"cannot decode {path}" in log, uuid
    assert "image file is truncated" in log
    assert "cannot identify image file" in log
    assert "decompression bomb" in log


def test_a_failed_original_is_negative_cached(mounts: MountFactory, corpus: Path) -> None:
    # Its expiry, in virtual time: test_engine.py (the negative cache ... until it expires).
    broken = corpus / "broken.jpg"
    broken.write_bytes(b"not yet an image")
    mount = mounts({"v1": corpus}, error_cache_seconds=3600)
    entry = mount.path("v1", "64", "broken.npy")
    assert errno_of(read, entry) == errno.EIO
    shutil.copyfile(corpus / "astronaut-baseline.jpg", broken)  # fixed, but too late
    assert errno_of(read, entry) == errno.EIO  # answered from the negative cache
    stats = mount.stats()
    assert stats["decode_errors"] == stats["decodes"] == 1 and stats["errors"]["EIO"] == 2


def test_an_original_deleted_after_the_scan_is_enoent(mounts: MountFactory, corpus: Path) -> None:
    mount = mounts({"v1": corpus})
    victim = next(corpus.glob("*.png"))
    victim.unlink()
    assert errno_of(read, mount.path("v1", "224", f"{victim.stem}.npy")) == errno.ENOENT
    assert mount.stats()["errors"]["ENOENT"] == 1


def test_corrupt_entries_are_rebuilt_never_served(
    mounts: MountFactory, corpus: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    mount = mounts({"v1": corpus})
    uuids = sorted(photos)
    for uuid in uuids:
        read(mount.path("v1", "224", f"{uuid}.npy"))
    assert mount.stop() == 0

    store = tmp_path / "store" / "v1" / "224"

    def entry(uuid: str) -> Path:
        return store / uuid[:2] / f"{uuid}.npy"

    def flip(path: Path, offset: int, bit: int = 0x01) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= bit
        path.write_bytes(bytes(data))

    damaged = uuids[:6]
    entry(damaged[0]).write_bytes(entry(damaged[0]).read_bytes()[:70_000])  # truncated
    flip(entry(damaged[1]), 10)  # header
    flip(entry(damaged[2]), 60_000, 0x20)  # one payload bit
    entry(damaged[3]).write_bytes(
        entry(damaged[3]).read_bytes()[:-TRAILER_SIZE]
    )  # plain .npy, no trailer
    entry(damaged[4]).write_bytes(b"")  # zero length, as after a power cut
    os.replace(entry(damaged[5]), entry(damaged[5]).with_name("moved"))
    shutil.copy(entry(uuids[-1]), entry(damaged[5]))  # another uuid's intact entry

    mount.start()
    for uuid in uuids:
        assert read(mount.path("v1", "224", f"{uuid}.npy")) == reference_npy(photos[uuid], 224), (
            uuid
        )
    stats = mount.stats()
    assert stats["corrupt_entries"] == len(damaged)
    assert stats["decodes"] == len(damaged)  # rebuilds are decodes
    assert stats["hits"] == len(uuids) - len(damaged)
    for uuid in damaged:  # repaired on disk, too
        assert entry(uuid).read_bytes()[:-TRAILER_SIZE] == reference_npy(photos[uuid], 224)
    assert mount.log_text().count("failed verification") == len(damaged)


def test_an_intact_entry_that_is_not_its_sizes_npy_is_rebuilt_never_served(
    mounts: MountFactory, corpus: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    mount = mounts({"v1": corpus})
    victim, other = sorted(photos)[:2]
    assert mount.stop() == 0
    # A valid trailer and checksum around a payload that is no uint8 (224, 224, 3)
    # .npy: only the layout check stands between it and a reader.
    forged = bytearray(npy_bytes(np.zeros((224, 224, 3), np.uint8)))
    forged[forged.index(b"|u1") : forged.index(b"|u1") + 3] = b"|i1"
    store = Store(tmp_path / "store", {"v1": decoder_fingerprint(DecodeSettings())})
    store.open()
    store.write(EntryKey("v1", 224, victim), bytes(forged))
    store.close()
    entry = tmp_path / "store" / "v1" / "224" / victim[:2] / f"{victim}.npy"

    result = decodefs("verify", tmp_path / "store")
    assert result.returncode == 1
    assert f"{entry}: payload is not the expected .npy layout" in result.stdout

    mount.start()
    want = np.load(io.BytesIO(reference_npy(photos[victim], 224)))
    assert np.array_equal(read_array(mount.path("v1", "224", f"{victim}.npy")), want)
    assert read(mount.path("v1", "224", f"{victim}.npy")) == reference_npy(photos[victim], 224)
    assert read(mount.path("v1", "224", f"{other}.npy")) == reference_npy(photos[other], 224)
    assert mount.stats()["corrupt_entries"] == 1
    assert entry.read_bytes()[:-TRAILER_SIZE] == reference_npy(photos[victim], 224)


@needs_root
def test_a_full_store_serves_from_memory(
    mounts: MountFactory, corpus: Path, photos: dict[str, Path], tmpfs: Tmpfs
) -> None:
    tiny_tmpfs = tmpfs("1m")
    mount = mounts(
        {"v1": corpus},
        store=tiny_tmpfs / "store",
        memory_cache_bytes="400K",
        min_free_fraction=0,  # no limit: the filesystem itself fills up
    )
    for _ in range(2):
        for uuid, path in photos.items():  # 11 x 147 KiB into 1 MiB
            assert read(mount.path("v1", "224", f"{uuid}.npy")) == reference_npy(path, 224), uuid
    stats = mount.stats()
    assert 0 < stats["store_entries"] < len(photos)
    assert stats["store_write_errors"] == stats["memory_fallbacks"] > 0
    assert stats["errors"]["store_ENOSPC"] == stats["store_write_errors"]
    assert stats["memory_cache_bytes"] <= 400 * 1024
    assert stats["decode_errors"] == 0
    log = mount.log_text()
    assert "ENOSPC" in log and "serving it from memory" in log
    assert log.count("serving it from memory") < stats["store_write_errors"]  # rate-limited
    assert os.listdir(tiny_tmpfs / "store" / ".tmp") == []


@needs_root
def test_a_read_only_store_serves_hits_from_flash_and_misses_from_memory(
    mounts: MountFactory, corpus: Path, photos: dict[str, Path], tmpfs: Tmpfs
) -> None:
    tiny_tmpfs = tmpfs("1m")
    uuids = sorted(photos)
    mount = mounts({"v1": corpus}, store=tiny_tmpfs / "store", expect_errors=("is not writable",))
    for uuid in uuids[:3]:
        read(mount.path("v1", "64", f"{uuid}.npy"))
    assert mount.stop() == 0
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)

    mount.start()
    for uuid in uuids:
        assert read(mount.path("v1", "64", f"{uuid}.npy")) == reference_npy(photos[uuid], 64), uuid
    stats = mount.stats()
    assert stats["store_writable"] is False
    assert stats["hits"] == 3
    assert stats["decodes"] == stats["memory_fallbacks"] == len(uuids) - 3
    assert stats["errors"]["store_EROFS"] == len(uuids) - 3


def test_an_unexpected_exception_is_eio_for_that_request_only(
    mounts: MountFactory, corpus: Path, photos: dict[str, Path]
) -> None:
    mount = mounts(
        {"v1": corpus},
        env={"DECODEFS_FAILPOINT_OPEN": "camera-gray"},
        expect_errors=("unexpected error in open", "Traceback"),
    )
    for _ in range(3):
        assert errno_of(read, mount.path("v1", "224", "camera-gray.npy")) == errno.EIO
    for uuid, path in photos.items():
        if uuid != "camera-gray":
            assert read(mount.path("v1", "224", f"{uuid}.npy")) == reference_npy(path, 224)
    assert mount.stats()["errors"]["unexpected"] == 3
    assert "RuntimeError: failpoint" in mount.log_text()


def test_hundreds_of_open_files_do_not_exhaust_the_daemons_descriptors(
    mounts: MountFactory, tmp_path: Path
) -> None:
    originals = tmp_path / "small"
    originals.mkdir()
    rng = np.random.default_rng(3)
    for i in range(300):
        Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(
            originals / f"s{i:03d}.png"
        )
    # The daemon may hold at most 64 descriptors, soft and hard: it cannot raise them.
    mount = mounts({"v1": originals}, sizes=[16], wrapper=("prlimit", "--nofile=64:64"))
    entries = sorted(mount.path("v1", "16").iterdir())
    for entry in entries:  # decode and store all; no data enters the page cache
        os.close(os.open(entry, os.O_RDONLY))
    files = [open(entry, "rb", buffering=0) for entry in entries]  # noqa: SIM115
    try:  # 300 handles open at once, each read reaching the daemon
        for entry, f in zip(entries, files, strict=True):
            assert f.read() == reference_npy(originals / f"{entry.stem}.png", 16), entry.name
    finally:
        for f in files:
            f.close()
    stats = mount.stats()
    assert "unexpected" not in stats["errors"]
    assert stats["decodes"] == 300 and stats["hits"] == 300


def test_an_unreadable_entry_fails_open(
    mounts: MountFactory, corpus: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    uuid = "chelsea-444"
    entry = tmp_path / "store" / "v1" / "224" / uuid[:2] / f"{uuid}.npy"
    entry.mkdir(parents=True)  # reading it fails with EISDIR, and so does replacing it
    mount = mounts({"v1": corpus})
    for _ in range(2):
        assert read(mount.path("v1", "224", f"{uuid}.npy")) == reference_npy(photos[uuid], 224)
    stats = mount.stats()
    assert stats["errors"]["store_read_EISDIR"] == 1  # the second open was a memory hit
    assert stats["memory_fallbacks"] == 1 and stats["corrupt_entries"] == 0
    assert entry.is_dir()


@needs_root
def test_a_store_full_at_start_still_mounts_and_serves(
    mounts: MountFactory, corpus: Path, photos: dict[str, Path], tmpfs: Tmpfs
) -> None:
    tiny_tmpfs = tmpfs("1m")
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={tiny_tmpfs}/filler", "bs=4k"], capture_output=True, check=False
    )
    mount = mounts({"v1": corpus}, store=tiny_tmpfs / "store", expect_errors=("is not writable",))
    for uuid, path in photos.items():
        assert read(mount.path("v1", "64", f"{uuid}.npy")) == reference_npy(path, 64)
    stats = mount.stats()
    assert stats["store_writable"] is False
    assert stats["memory_fallbacks"] == len(photos)


def test_a_damaged_catalog_is_set_aside_and_the_store_recounted(
    mounts: MountFactory, corpus: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    mount = mounts({"v1": corpus})
    for uuid in photos:
        read(mount.path("v1", "64", f"{uuid}.npy"))
    assert mount.stop() == 0
    catalog = tmp_path / "store" / ".catalog.sqlite3"
    data = bytearray(catalog.read_bytes())
    data[4096 : 4096 + 64] = b"\xff" * 64  # a b-tree page header
    catalog.write_bytes(bytes(data))
    mount.start()
    for uuid, path in photos.items():  # still served, without decoding again
        assert read(mount.path("v1", "64", f"{uuid}.npy")) == reference_npy(path, 64)
    assert (tmp_path / "store" / ".catalog.sqlite3.damaged").exists()
    wait_until(lambda: mount.stats()["store_usage_complete"], what="the scan to count the store")
    stats = mount.stats()
    assert stats["store_entries"] == len(photos) and stats["decodes"] == 0
    assert "is damaged" in mount.log_text()
