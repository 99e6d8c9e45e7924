"""Capacity: LRU eviction under max_store_bytes and min_free_fraction, pins, usage at restart."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from decodefs.common.npy import npy_file_size
from decodefs.common.protocol import TRAILER_SIZE
from tests.conftest import MountFactory, Tmpfs, needs_root
from tests.helpers import reference_npy, wait_until

ENTRY = npy_file_size(224) + TRAILER_SIZE  # one stored 224 array


def stored(store: Path) -> dict[str, int]:
    """uuid -> bytes of every entry file on disk (ones evicted while looking are skipped)."""
    sizes = {}
    for path in store.glob("v1/*/*/*.npy"):
        try:
            sizes[path.stem] = path.stat().st_size
        except FileNotFoundError:
            continue
    return sizes


def entries_on_disk(fs: Path, store: Path) -> int:
    """Bytes the entries occupy on ``fs`` right now: an atomic statvfs, less the catalog's
    files and temp files (which a glob of the entries could not give: it is not atomic)."""
    vfs = os.statvfs(fs)
    used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
    for path in [*store.glob(".catalog*"), *store.glob(".tmp/*")]:
        with contextlib.suppress(FileNotFoundError):
            used -= path.stat().st_blocks * 512
    return used


@needs_root
def test_max_store_bytes_holds_under_a_stream_of_misses(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmpfs: Tmpfs
) -> None:
    store_tmpfs = tmpfs("64m")  # the store's own filesystem: its usage is one statvfs
    store = store_tmpfs / "store"
    cap = 4 * ENTRY + 1000
    # max_store_bytes counts file sizes; blocks round each entry up by < 1 page,
    # and the store's marker files take a page each.
    bound = cap + 4 * 4096 + 4 * 4096
    mount = mounts({"v1": photos_dir}, store=store, max_store_bytes=cap, decode_workers=8)
    for uuid, path in sorted(photos.items()):
        assert mount.path("v1", "224", f"{uuid}.npy").read_bytes() == reference_npy(path, 224)
        assert sum(stored(store).values()) <= cap
    stats = mount.stats()
    assert stats["store_entries"] == len(stored(store)) == 4
    assert stats["store_bytes"] == sum(stored(store).values())
    assert stats["evictions"] == len(photos) - 4
    assert stats["store_write_errors"] == 0  # eviction made room; nothing fell back to memory

    # Concurrent misses: reservations keep them from overshooting together.
    sizes = [str(s) for s in range(216, 232)]
    stop = threading.Event()
    peak = [0]

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], entries_on_disk(store_tmpfs, store))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        threads = [
            threading.Thread(
                target=lambda s=s: [mount.path("v1", s, f"{u}.npy").read_bytes() for u in photos]
            )
            for s in sizes
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        watcher.join()
    assert 0 < peak[0] <= bound
    assert sum(stored(store).values()) <= cap


def test_an_open_file_is_never_evicted_from_under_its_reader(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    uuids = sorted(photos)
    mount = mounts({"v1": photos_dir}, max_store_bytes=3 * ENTRY)
    held = uuids[0]
    mount.path("v1", "224", f"{held}.npy").read_bytes()
    with open(mount.path("v1", "224", f"{held}.npy"), "rb", buffering=0) as reader:
        head = reader.read(1000)
        for uuid in uuids[1:6]:  # five misses, each evicting the oldest unpinned entry
            mount.path("v1", "224", f"{uuid}.npy").read_bytes()
            assert held in stored(store)
        assert head + reader.read() == reference_npy(photos[held], 224)
    for uuid in uuids[6:9]:
        mount.path("v1", "224", f"{uuid}.npy").read_bytes()
    assert held not in stored(store)  # unpinned once closed, and oldest


def test_usage_is_known_right_after_a_restart(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    mount = mounts({"v1": photos_dir}, sizes=[64])
    for uuid in photos:
        mount.path("v1", "64", f"{uuid}.npy").read_bytes()
    assert mount.stop() == 0
    mount.start()
    stats = mount.stats()  # the first thing asked: no scan to wait for
    assert stats["store_usage_complete"] is True
    assert stats["store_entries"] == len(photos)
    assert stats["store_bytes"] == sum(stored(store).values())
    after_restart = mount.log_text().split("unmounted", 1)[1]
    assert "catalog filled from disk" not in after_restart  # no scan of the store


@needs_root
def test_min_free_fraction_keeps_the_filesystem_free(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmpfs: Tmpfs
) -> None:
    small_tmpfs = tmpfs("2m")
    mount = mounts({"v1": photos_dir}, store=small_tmpfs / "store", min_free_fraction=0.5)
    for uuid, path in photos.items():
        assert mount.path("v1", "224", f"{uuid}.npy").read_bytes() == reference_npy(path, 224)
        vfs = os.statvfs(small_tmpfs)
        # Entries never eat into the free half (the catalog's own pages may nibble at it).
        assert vfs.f_bavail * vfs.f_frsize >= 0.5 * vfs.f_blocks * vfs.f_frsize - 64 * 1024
    stats = mount.stats()
    assert stats["evictions"] > 0 and stats["store_write_errors"] == 0


def test_entries_of_a_version_no_longer_configured_are_evicted_quietly(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    mount = mounts({"v1": photos_dir, "old": photos_dir})
    for uuid in photos:
        mount.path("old", "224", f"{uuid}.npy").read_bytes()
    assert mount.stop() == 0
    # "old" leaves the config; the store is capped below what it holds.
    text = mount.config.read_text().split("[versions.old]")[0] + f"max_store_bytes = {4 * ENTRY}\n"
    text = text.replace("[versions.v1]", f"max_store_bytes = {4 * ENTRY}\n[versions.v1]").rsplit(
        "max_store_bytes", 1
    )[0]
    mount.config.write_text(text)
    mount.start()
    for uuid, path in photos.items():
        assert mount.path("v1", "224", f"{uuid}.npy").read_bytes() == reference_npy(path, 224)
    stats = mount.stats()
    assert stats["evictions"] >= len(photos)
    assert not list(store.glob("old/*/*/*.npy"))
    assert "unexpected" not in stats["errors"]


def test_a_lowered_limit_is_met_soon_after_the_start_while_reads_go_on(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    mount = mounts({"v1": photos_dir})
    for uuid in photos:
        mount.path("v1", "224", f"{uuid}.npy").read_bytes()
    assert mount.stop() == 0
    assert len(stored(store)) == len(photos)
    # The limit is lowered to a third of what the store holds; nothing writes now.
    limit = len(photos) // 3 * ENTRY
    mount.config.write_text(f"max_store_bytes = {limit}\n" + mount.config.read_text())
    mount.start()
    keys = sorted(photos)
    reads = 0

    def trimmed() -> dict[str, Any] | None:
        # Readers go on meanwhile (hits and, once evicted, misses): none fails or waits long.
        nonlocal reads
        key = keys[reads % len(keys)]
        assert mount.path("v1", "224", f"{key}.npy").read_bytes() == reference_npy(photos[key], 224)
        reads += 1
        stats = mount.stats()
        return stats if stats["store_bytes"] <= limit else None

    stats = wait_until(trimmed, 60, "the store within its lowered limit")
    assert stats is not None
    assert stats["evictions"] >= len(photos) - len(photos) // 3
    assert sum(stored(store).values()) <= limit
    assert "store trimmed:" in mount.log_text()
