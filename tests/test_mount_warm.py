"""Warming the cache: `decodefs warm` through the mount, and the daemon's background warm."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from decodefs.sample import make_sample_corpus
from tests.conftest import LARGE_COUNT, MountFactory
from tests.helpers import (
    Mount,
    decodefs,
    interruptible,
    reference_npy,
    wait_until,
    write_bad_originals,
)


def test_warm_fills_the_cache_and_a_second_run_costs_nothing(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    result = decodefs("warm", mount.mountpoint, "v1", "224", "--jobs", "2")
    assert result.returncode == 0, result.stderr
    assert f"warmed {len(photos)} of {len(photos)} arrays of v1/224" in result.stdout
    assert f"the daemon decoded {len(photos)} meanwhile" in result.stdout
    stats = mount.stats()
    assert stats["decodes"] == stats["store_entries"] == len(photos)
    assert stats["bytes_served"] == 0  # opened, never read: nothing crossed into the client

    again = decodefs("warm", mount.mountpoint, "v1", "224")
    assert again.returncode == 0 and "the daemon decoded 0 meanwhile" in again.stdout
    for uuid, path in photos.items():  # training then finds every array stored
        assert mount.path("v1", "224", f"{uuid}.npy").read_bytes() == reference_npy(path, 224)
    assert mount.stats()["decodes"] == len(photos)


def test_warm_a_listed_subset_and_report_what_is_wrong(
    mounts: MountFactory, photos: dict[str, Path], tmp_path: Path
) -> None:
    source = tmp_path / "originals"
    shutil.copytree(next(iter(photos.values())).parents[2], source)
    bad = write_bad_originals(source / "bad", photos["astronaut-baseline"])
    mount = mounts({"v1": source}, expect_errors=(), sizes=[64])
    wanted = sorted(photos)[:3]
    listing = tmp_path / "uuids.txt"
    listing.write_text(
        "# a subset\n" + "\n".join(wanted) + f"\n{wanted[0]}.npy\nno-such-uuid\nbad-truncated\n\n"
    )
    result = decodefs("warm", mount.mountpoint, "v1", "64", "--uuids", listing)
    assert result.returncode == 1
    assert "warmed 4 of 6 arrays" in result.stdout  # wanted[0] listed twice
    assert (
        f"decodefs: error: 1 keys of {listing} are not originals of v1, e.g. 'no-such-uuid'"
        in result.stderr
    )
    # The line names where the reason is: the daemon's log file.
    assert f"failed: bad-truncated: Input/output error ({mount.log} says why)" in result.stderr
    stats = mount.stats()
    assert stats["store_entries"] == 3 and stats["decode_errors"] == 1
    assert str(bad["bad-truncated"]) in mount.log_text()


def test_warm_is_interruptible_and_resumes(mounts: MountFactory, large: list[Path]) -> None:
    mount = mounts({"v1": large[0].parents[1]}, decode_workers=1, sizes=[512])
    warm = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "decodefs",
            "warm",
            str(mount.mountpoint),
            "v1",
            "512",
            "--jobs",
            "1",
        ],
        preexec_fn=interruptible,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: mount.stats()["decodes"] >= 1, 60, "the warm's first decode")
    warm.send_signal(signal.SIGINT)
    _, err = warm.communicate(timeout=60)
    assert warm.returncode == 130, err
    assert "interrupted; run the same command again to resume" in err
    done_before = mount.stats()["store_entries"]
    assert 1 <= done_before < LARGE_COUNT

    result = decodefs("warm", mount.mountpoint, "v1", "512")
    assert result.returncode == 0
    assert f"warmed {LARGE_COUNT} of {LARGE_COUNT}" in result.stdout
    stats = mount.stats()
    assert stats["store_entries"] == LARGE_COUNT
    assert stats["decodes"] == LARGE_COUNT  # nothing decoded twice


def test_background_warm_fills_the_configured_sizes_while_idle(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir}, sizes=[64, 96], version_warm=True)
    # Its last line, written once every worker has stored what it decoded (the
    # counter of decodes alone runs ahead of the last store write).
    wait_until(lambda: "background warm: v1/96 done" in mount.log_text(), 120, "the warm to end")
    stats = mount.stats()
    assert stats["background_decodes"] == stats["store_entries"] == 2 * len(photos)
    for uuid, path in photos.items():
        assert mount.path("v1", "96", f"{uuid}.npy").read_bytes() == reference_npy(path, 96)
    stats = mount.stats()
    assert stats["misses"] == 0 and stats["hits"] == len(photos)


def test_readers_never_wait_behind_the_background_warm(
    mounts: MountFactory, tmp_path: Path
) -> None:
    originals = tmp_path / "warm-queue"
    make_sample_corpus(originals, 16, 2400, 1800, seed=11)
    mount = mounts({"v1": originals}, sizes=[300], version_warm=True, decode_workers=2)
    # The warm walks uuids in order; a reader asks for the last ones at once.
    last = sorted(p.stem for p in originals.rglob("*.jpg"))[-3:]
    for uuid in last:
        data = mount.path("v1", "300", f"{uuid}.npy").read_bytes()
        assert data == reference_npy(next(originals.rglob(f"{uuid}.jpg")), 300)
        # Served while the warm still had work queued: it did not wait for it.
        assert mount.stats()["background_decodes"] < 16 - len(last)
    wait_until(lambda: mount.stats()["store_entries"] >= 16, 120, "the warm to store all 16")
    stats = mount.stats()
    assert stats["store_entries"] == 16
    assert stats["decodes"] == 16  # readers and the warm never decoded the same array twice
    assert stats["misses"] + stats["hits"] == len(last)


def test_with_one_core_and_one_worker_a_reader_still_goes_first(
    mounts: MountFactory, large: list[Path]
) -> None:
    # The warm and the reader share one CPU; the warm's threads run at nice 19.
    originals = large[0].parents[1]
    mount = mounts(
        {"v1": originals},
        sizes=[512],
        version_warm=True,
        decode_workers=1,
        wrapper=("taskset", "-c", "0"),
    )
    wait_until(lambda: mount.stats()["background_decodes"] >= 1, 60, "the warm to be running")
    last = sorted(p.stem for p in large)[-1]  # the warm walks uuids in order: this one is last
    before = mount.stats()["background_decodes"]
    data = mount.path("v1", "512", f"{last}.npy").read_bytes()
    after = mount.stats()
    assert data == reference_npy(next(p for p in large if p.stem == last), 512)
    # No warm decode finished while the reader waited: it neither queued behind
    # the warm nor shared the core with it.
    assert after["background_decodes"] == before
    assert after["misses"] == 1


def test_readers_joining_a_warm_that_stops_get_their_arrays(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    entry = 128 + 160 * 160 * 3 + 40
    mount = mounts({"v1": photos_dir}, sizes=[160], version_warm=True, max_store_bytes=4 * entry)
    # Read everything at once, in the warm's own order, while it fills and then stops.
    uuids = sorted(photos)
    threads = [
        threading.Thread(target=lambda u=u: results.__setitem__(u, _read(mount, u))) for u in uuids
    ]
    results: dict[str, bytes | OSError] = {}
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for uuid in uuids:
        assert results[uuid] == reference_npy(photos[uuid], 160), uuid
    assert "unexpected" not in mount.stats()["errors"]


def _read(mount: Mount, uuid: str) -> bytes | OSError:
    try:
        return mount.path("v1", "160", f"{uuid}.npy").read_bytes()
    except OSError as exc:
        return exc


def test_cli_warm_stops_at_the_cap_without_evicting(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    entry = 128 + 64 * 64 * 3 + 40
    mount = mounts({"v1": photos_dir}, max_store_bytes=3 * entry, sizes=[64])
    trained = sorted(photos)[:3]
    for uuid in trained:  # training's entries fill the store
        mount.path("v1", "64", f"{uuid}.npy").read_bytes()
    result = decodefs("warm", mount.mountpoint, "v1", "64", "--jobs", "1")
    assert result.returncode == 1
    assert "the store takes no more (it is at its capacity limit" in result.stderr
    stats = mount.stats()
    assert stats["evictions"] == 0 and stats["store_entries"] == 3
    assert stats["warm_not_stored"] >= 1 and stats["errors"]["store_EDQUOT"] >= 1
    assert {p.stem for p in (mount.config.parent / "store").glob("v1/64/*/*.npy")} == set(trained)

    # The flag asks for a warm, but a program that reads what it opened gets the array.
    rest = [uuid for uuid in sorted(photos) if uuid not in trained]
    for uuid in rest[:2]:
        fd = os.open(mount.path("v1", "64", f"{uuid}.npy"), os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb", buffering=0) as f:
            assert f.read() == reference_npy(photos[uuid], 64)
    assert mount.stats()["evictions"] == 0
