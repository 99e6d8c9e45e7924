"""Nothing silent: `decodefs mount` says when a version's stored arrays were discarded for
changed decode settings and how much will be decoded again; a size no version lists is
served from memory, not stored; `decodefs stats` shows usage per version and size."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import MountFactory
from tests.helpers import decodefs, reference_npy, unmount_quietly, write_config


def test_mount_says_which_versions_arrays_were_discarded_and_how_many(
    tmp_path: Path, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mnt, store, log = tmp_path / "mnt", tmp_path / "store", tmp_path / "daemon.log"
    mnt.mkdir()
    versions = {"v1": photos_dir, "v2": photos_dir}
    config = write_config(tmp_path / "a.toml", store, versions, sizes=[64])
    first = decodefs("mount", mnt, "--config", config, "--log-file", log)
    try:
        assert first.returncode == 0, first.stderr
        assert "warning" not in first.stderr
        for uuid in photos:
            (mnt / "v1" / "64" / f"{uuid}.npy").read_bytes()
        (mnt / "v2" / "64" / f"{sorted(photos)[0]}.npy").read_bytes()
        stored = decodefs("stats", mnt, "--json").stdout
        assert f'"store_entries": {len(photos) + 1}' in stored
    finally:
        assert decodefs("umount", mnt).returncode == 0
    changed = tmp_path / "b.toml"
    changed.write_text(
        config.read_text().replace("[versions.v1]\n", '[versions.v1]\nresample = "bicubic"\n')
    )
    second = decodefs("mount", mnt, "--config", changed, "--log-file", log)
    try:
        assert second.returncode == 0, second.stderr
        warnings = [line for line in second.stderr.splitlines() if "warning" in line]
        assert len(warnings) == 1, second.stderr
        assert warnings[0].startswith(
            "decodefs: warning: version v1's decode settings or libraries changed "
            "(settings.resample: bilinear -> bicubic): "
            f"its {len(photos)} stored arrays ("
        ), warnings
        assert "were discarded, and will be decoded again as they are read" in warnings[0]
        assert "store" in second.stdout and "in 1 arrays" in second.stdout  # v2's one is kept
    finally:
        assert decodefs("umount", mnt).returncode == 0
        unmount_quietly(mnt)


def test_a_size_no_version_lists_is_served_from_memory_never_stored(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir}, sizes=[64], unlisted_sizes=None)  # the default
    uuid = sorted(photos)[0]
    for size in (64, 2240 // 10, 999):  # the daemon's own user: a typo costs no flash
        assert mount.path("v1", str(size), f"{uuid}.npy").read_bytes() == reference_npy(
            photos[uuid], size
        )
    stats = mount.stats()
    assert stats["store_entries"] == 1
    assert stats["unlisted_not_stored"] == 2
    assert stats["store_by_size"] == {"v1": {"64": {"entries": 1, "bytes": stats["store_bytes"]}}}
    assert sorted(p.name for p in (mount.config.parent / "store" / "v1").iterdir()) == [
        ".fingerprint.json",
        "64",
    ]
    refused = decodefs("warm", mount.mountpoint, "v1", "999")
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        "decodefs: error: size 999 is not one of v1's sizes (64), and the daemon stores no "
        'unlisted size (unlisted_sizes = "memory"): a warm would store nothing; add 999 to '
        "versions.v1.sizes in its config and mount again"
    ]


def test_stats_show_usage_per_version_and_size(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir, "v2": photos_dir}, sizes=[32, 64])
    keys = sorted(photos)
    for key in keys[:3]:
        mount.path("v1", "32", f"{key}.npy").read_bytes()
    for key in keys[:2]:
        mount.path("v1", "64", f"{key}.npy").read_bytes()
    mount.path("v2", "64", f"{keys[0]}.npy").read_bytes()
    by_size = mount.stats()["store_by_size"]
    assert {v: {s: u["entries"] for s, u in sizes.items()} for v, sizes in by_size.items()} == {
        "v1": {"32": 3, "64": 2},
        "v2": {"64": 1},
    }
    assert by_size["v1"]["64"]["bytes"] == 2 * by_size["v2"]["64"]["bytes"]
    table = decodefs("stats", mount.mountpoint).stdout
    v1 = next(line for line in table.splitlines() if line.startswith("version v1"))
    assert "; stored: 32 " in v1 and " in 3, 64 " in v1 and v1.endswith(" in 2"), v1
    metrics = (mount.mountpoint / ".decodefs" / "metrics").read_text()
    assert 'decodefs_stored_bytes{size="64",version="v2"}' in metrics
