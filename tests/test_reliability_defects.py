"""Defects scripts/reliability.py found, each kept as the case that showed it.

See docs/reliability.md for the runs that found them.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from tests.conftest import MountFactory
from tests.helpers import errno_of


def test_a_vanished_source_logs_one_line_not_one_per_read(
    mounts: MountFactory, tmp_path: Path, photos: dict[str, Path]
) -> None:
    # Part 5: with the source directory renamed (or unmounted) under the daemon, every
    # read of an array not stored yet logged its own WARNING line.
    source = tmp_path / "originals"
    source.mkdir()
    for path in photos.values():
        shutil.copy(path, source / path.name)
    mount = mounts({"v1": source})
    source.rename(tmp_path / "moved")
    for _ in range(3):
        for uuid in photos:
            assert errno_of(mount.path("v1", "64", f"{uuid}.npy").read_bytes) == errno.ENOENT
    assert mount.stats()["errors"]["ENOENT"] == 3 * len(photos)
    assert mount.log_text().count("is gone") == 1
