"""The cluster says what is wrong: an L2 that is configured but cannot be used (no
credentials, an endpoint nobody answers at, a shared directory that is not there) is
said by `decodefs mount` on the terminal and in `decodefs stats`, before any miss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import decodefs, unmount_quietly, write_config

# No credentials anywhere boto3 looks: the environment, files, the instance metadata.
NO_AWS = {
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
    "AWS_CONFIG_FILE": "/nonexistent/config",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def mount_with(
    tmp_path: Path, photos_dir: Path, env: dict[str, str] | None = None, **l2: str
) -> tuple[Path, str, str]:
    """Mount with the l2 keys ``l2``; the mount point, what `mount` printed on stderr,
    and `decodefs stats` (the caller unmounts)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    config = write_config(tmp_path / "c.toml", tmp_path / "store", {"v1": photos_dir}, **l2)
    # The daemon inherits the command's environment (``env`` over this one's).
    result = decodefs("mount", mnt, "--config", config, "--log-file", tmp_path / "log", env=env)
    assert result.returncode == 0, result.stderr
    return mnt, result.stderr, decodefs("stats", mnt).stdout


@pytest.fixture
def unmount(tmp_path: Path) -> object:
    yield None
    decodefs("umount", tmp_path / "mnt")
    unmount_quietly(tmp_path / "mnt")


def test_a_shared_directory_that_is_not_there_is_said_at_mount(
    tmp_path: Path, photos_dir: Path, unmount: object
) -> None:
    missing = tmp_path / "juicefs" / "decodefs"  # the shared filesystem is not mounted
    mnt, said, table = mount_with(tmp_path, photos_dir, l2=str(missing))
    warning = [line for line in said.splitlines() if "l2" in line]
    assert warning == [
        f"decodefs: warning: l2 {missing} is configured but cannot be used: ENOENT: "
        f"[Errno 2] No such file or directory: '{missing}'; every miss decodes here until it "
        "answers (`decodefs stats` says when it does)"
    ], said
    assert f"CANNOT BE USED: ENOENT: [Errno 2] No such file or directory: '{missing}'" in table
    stats = json.loads((mnt / ".decodefs" / "stats.json").read_bytes())
    assert stats["l2_check"] == "failing" and stats["l2_problem"].startswith("ENOENT")
    metrics = (mnt / ".decodefs" / "metrics").read_text()
    assert 'decodefs_l2_check{state="failing"} 1.0' in metrics


def test_an_s3_l2_without_credentials_is_said_at_mount(
    tmp_path: Path, photos_dir: Path, unmount: object
) -> None:
    env = {**NO_AWS, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    _, said, table = mount_with(
        tmp_path, photos_dir, env=env, l2="s3://decodefs-l2/cache", l2_endpoint="http://127.0.0.1:9"
    )
    assert (
        "decodefs: warning: l2 s3://decodefs-l2/cache at http://127.0.0.1:9 is configured " in said
    )
    assert "cannot be used: credentials: Unable to locate credentials" in said
    assert "CANNOT BE USED: credentials" in table


def test_a_usable_l2_says_nothing(tmp_path: Path, photos_dir: Path, unmount: object) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    mnt, said, table = mount_with(tmp_path, photos_dir, l2=str(shared))
    assert "warning" not in said
    stats = json.loads((mnt / ".decodefs" / "stats.json").read_bytes())
    assert stats["l2_check"] == "ok" and stats["l2_problem"] == ""
    assert "CANNOT BE USED" not in table
