"""`decodefs verify`: an offline check of every stored entry."""

from __future__ import annotations

from pathlib import Path

from decodefs.common.protocol import TRAILER_SIZE
from tests.conftest import MountFactory
from tests.helpers import decodefs


def test_verify_reports_and_removes_corrupt_entries(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    mount = mounts({"v1": photos_dir})
    for uuid in photos:
        mount.path("v1", "64", f"{uuid}.npy").read_bytes()

    first, second = sorted(store.glob("v1/64/*/*.npy"))[:2]
    data = bytearray(first.read_bytes())
    data[500] ^= 0x04
    first.write_bytes(bytes(data))
    second.write_bytes(second.read_bytes()[:-TRAILER_SIZE])

    result = decodefs("verify", store)  # fine while the daemon runs: it only reads
    assert result.returncode == 1
    assert f"{first}: checksum mismatch" in result.stdout
    assert f"{second}: no integrity trailer" in result.stdout
    assert (
        f"checked {len(photos)} entries of v1: {len(photos) - 2} ok, 2 corrupt, 0 stale"
        in result.stdout
    )

    refused = decodefs("verify", store, "--remove")
    assert refused.returncode == 1 and "a decodefs daemon is using" in refused.stderr
    assert first.exists()

    assert mount.stop() == 0
    removed = decodefs("verify", store, "--remove")
    assert removed.returncode == 0 and ", 2 removed" in removed.stdout
    assert not first.exists() and not second.exists()
    clean = decodefs("verify", store)
    assert clean.returncode == 0 and f"{len(photos) - 2} ok, 0 corrupt" in clean.stdout

    mount.start()  # the catalog lost the removed rows too: usage is right at once
    assert mount.stats()["store_entries"] == len(photos) - 2


def test_verify_against_a_config_finds_stale_entries(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    mount = mounts({"v1": photos_dir})
    for uuid in photos:
        mount.path("v1", "64", f"{uuid}.npy").read_bytes()
    assert decodefs("verify", mount.config).returncode == 0
    changed = tmp_path / "changed.toml"
    changed.write_text(mount.config.read_text() + 'resample = "bicubic"\n')
    result = decodefs("verify", changed)
    assert result.returncode == 1
    assert f"0 ok, 0 corrupt, {len(photos)} stale" in result.stdout
    assert "decoded with other settings or libraries" in result.stdout
