"""Bad originals are a list, not a crash: `decodefs failed`, .decodefs/failed.json,
`decodefs stats` and decodefs.failed_keys name each one with its key, path and reason,
while a plain read stays EIO."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from decodefs import failed_keys
from decodefs.client import failed_originals
from decodefs.common.protocol import FAILED_FILE, STATUS_DIR
from tests.conftest import MountFactory
from tests.helpers import decodefs, errno_of, wait_until, write_bad_originals

REASONS = {
    "bad-truncated": "image file is truncated",
    "bad-text": "cannot identify image file",
    "bad-bomb": "decompression bomb",
}


@pytest.fixture
def corpus(tmp_path: Path, photos: dict[str, Path]) -> Path:
    root = tmp_path / "originals"
    root.mkdir()
    for path in list(photos.values())[:3]:
        shutil.copy(path, root / path.name)
    bad = write_bad_originals(root / "bad", photos["astronaut-baseline"])
    for key in set(bad) - set(REASONS):
        bad[key].unlink()
    return root


def test_every_failed_original_is_listed_with_its_key_path_and_reason(
    mounts: MountFactory, corpus: Path, tmp_path: Path
) -> None:
    mount = mounts({"v1": corpus, "v2": corpus}, error_cache_seconds=0.2)
    for key in REASONS:
        assert errno_of(Path.read_bytes, mount.path("v1", "224", f"{key}.npy")) == errno.EIO
    assert errno_of(Path.read_bytes, mount.path("v1", "64", "bad-text.npy")) == errno.EIO
    assert errno_of(Path.read_bytes, mount.path("v2", "64", "bad-text.npy")) == errno.EIO

    # `decodefs failed MOUNT VERSION`: one line each, VERSION KEY PATH REASON
    shown = decodefs("failed", mount.mountpoint, "v1")
    assert shown.returncode == 0, shown.stderr
    rows = [line.split("\t") for line in shown.stdout.splitlines()]
    suffix = {"bad-bomb": ".png", "bad-text": ".jpg", "bad-truncated": ".jpg"}
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("v1", key, str(corpus / "bad" / f"{key}{suffix[key]}")) for key in sorted(REASONS)
    ]
    for row in rows:
        assert REASONS[row[1]] in row[3], row
    assert "3 originals of v1 failed to decode since the daemon started" in shown.stderr
    every = decodefs("failed", mount.mountpoint)
    assert len(every.stdout.splitlines()) == 4 and "\tv2\t" not in every.stdout

    # --json, the status file, and the client's function agree
    as_json = json.loads(decodefs("failed", mount.mountpoint, "v1", "--json").stdout)
    assert [(f["key"], f["sizes"]) for f in as_json["failed"]] == [
        ("bad-bomb", [224]),
        ("bad-text", [64, 224]),
        ("bad-truncated", [224]),
    ]
    assert as_json["not_listed"] == 0
    status = json.loads((mount.mountpoint / STATUS_DIR / FAILED_FILE).read_bytes())
    assert len(status["failed"]) == 4
    assert failed_keys(mount.mountpoint, "v1") == frozenset(REASONS)
    assert failed_keys(mount.mountpoint, "v2") == {"bad-text"}
    assert mount.stats()["failed_originals"] == 4

    # `decodefs stats` names them
    stats = decodefs("stats", mount.mountpoint)
    assert "4 originals fail now (`decodefs failed` lists them)" in stats.stdout
    assert f"v1 bad-truncated: {corpus / 'bad' / 'bad-truncated.jpg'}: " in stats.stdout

    # The original is fixed: its next decode succeeds and takes it off the list.
    shutil.copyfile(next(corpus.glob("*.jpg")), corpus / "bad" / "bad-text.jpg")
    entry = mount.path("v2", "64", "bad-text.npy")
    wait_until(lambda: errno_of_or_none(entry) is None, what="a decode after the negative cache")
    assert failed_keys(mount.mountpoint, "v2") == frozenset()
    assert "bad-text" in failed_keys(mount.mountpoint, "v1")  # listed per version, until
    mount.path("v1", "32", "bad-text.npy").read_bytes()  # a decode of it at any size
    assert failed_keys(mount.mountpoint, "v1") == {"bad-bomb", "bad-truncated"}


def errno_of_or_none(path: Path) -> int | None:
    try:
        path.read_bytes()
    except OSError as exc:
        return exc.errno
    return None


def test_failed_says_what_is_wrong_in_one_line(mounts: MountFactory, corpus: Path) -> None:
    mount = mounts({"v1": corpus})
    nothing = decodefs("failed", mount.mountpoint, "v1")
    assert nothing.returncode == 0 and nothing.stdout == ""
    assert "no originals of v1 failed to decode" in nothing.stderr
    wrong = decodefs("failed", mount.mountpoint, "v9")
    assert wrong.returncode == 1
    assert wrong.stderr.splitlines() == [
        f"decodefs: error: {mount.mountpoint} has no version 'v9' (it has: v1)"
    ]
    assert json.loads(decodefs("failed", mount.mountpoint, "--json").stdout) == {
        "failed": [],
        "not_listed": 0,
    }
    with pytest.raises(FileNotFoundError):
        failed_originals(mount.mountpoint.parent)  # not a mount
