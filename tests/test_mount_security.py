"""What another local user can and cannot do to a root daemon, on real mounts.

Each test reads as user ``nobody`` (setpriv), through the mount and straight
from the store, with ``access = "owner"`` and ``"everyone"``: the store's modes
must say what the mount says (``"originals"``: tests/test_mount_access.py).
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import MountFactory, needs_root
from tests.helpers import (
    NOBODY,
    as_nobody,
    decodefs,
    errno_of,
    python_as_nobody,
    reference_npy,
    write_config,
)

pytestmark = needs_root


READ_ARRAY = (
    "import sys; from decodefs import read_array; "
    "sys.stdout.buffer.write(read_array(sys.argv[1]).tobytes())"
)


def entry_in_store(store: Path, size: int, uuid: str) -> Path:
    return store / "v1" / str(size) / uuid[:2] / f"{uuid}.npy"


def test_with_access_owner_another_user_reads_neither_the_mount_nor_the_store(
    public_mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = public_mounts({"v1": photos_dir}, access="owner")
    uuid = sorted(photos)[0]
    path = mount.path("v1", "64", f"{uuid}.npy")
    assert path.read_bytes() == reference_npy(photos[uuid], 64)  # stored, by root
    store = mount.config.parent / "store"
    stored = entry_in_store(store, 64, uuid)
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600

    commands: list[list[str | Path]] = [["cat", path], ["cat", stored], ["ls", store]]
    for command in commands:
        result = as_nobody(*command)
        assert result.returncode != 0 and b"Permission denied" in result.stderr, command
    result = python_as_nobody(READ_ARRAY, path)
    assert result.returncode != 0 and b"PermissionError" in result.stderr


def test_with_access_everyone_another_user_reads_arrays_but_writes_nothing(
    public_mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = public_mounts({"v1": photos_dir}, access="everyone", sizes=[64])
    first, second = sorted(photos)[:2]
    path = mount.path("v1", "64", f"{first}.npy")
    want = reference_npy(photos[first], 64)
    read = as_nobody("cat", path)  # the first open by another user, right after the mount
    # answers: a miss, decoded for nobody
    assert read.stdout == want, (read.returncode, read.stderr, mount.log_text()[-2000:])
    store = mount.config.parent / "store"
    stored = entry_in_store(store, 64, first)
    assert stat.S_IMODE(store.stat().st_mode) == 0o755
    assert stat.S_IMODE(stored.stat().st_mode) == 0o644
    assert as_nobody("cat", stored).stdout[: len(want)] == want  # the same policy as the mount

    hits = mount.stats()["hits"]
    result = python_as_nobody(READ_ARRAY, path)  # straight from the store, not the daemon
    assert result.returncode == 0, result.stderr
    assert result.stdout == np.load(io.BytesIO(want)).tobytes()
    assert mount.stats()["hits"] == hits

    # Nothing can be written, through the mount or into the store.
    other = mount.path("v1", "64", f"{second}.npy")
    writes: list[list[str | Path]] = [
        ["sh", "-c", f"echo x >> '{other}'"],
        ["touch", mount.path("v1", "64", "new.npy")],
        ["rm", "-f", path],
        ["touch", store / "v1" / "planted"],
        ["ln", "-s", "/etc", store / "v1" / "64" / "zz"],
        ["sh", "-c", f"echo x >> '{stored}'"],
    ]
    for command in writes:
        result = as_nobody(*command)
        assert result.returncode != 0, command
        assert b"Read-only file system" in result.stderr or b"Permission denied" in result.stderr
    assert errno_of(open, other, "r+b") == errno.EROFS
    assert stored.read_bytes()[: len(want)] == want


def test_another_user_cannot_fill_the_flash_with_sizes_nobody_configured(
    public_mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = public_mounts({"v1": photos_dir}, access="everyone", sizes=[64], unlisted_sizes="owner")
    uuid = sorted(photos)[0]
    for size in [64, *range(100, 110)]:  # one listed size and ten sizes nobody listed
        result = as_nobody("cat", mount.path("v1", str(size), f"{uuid}.npy"))
        assert result.stdout == reference_npy(photos[uuid], size), size
    stats = mount.stats()
    assert stats["store_entries"] == 1  # only the listed size went to flash
    assert stats["unlisted_not_stored"] == 10
    assert sorted(p.name for p in (mount.config.parent / "store" / "v1").iterdir()) == [
        ".fingerprint.json",
        "64",
    ]
    # The daemon's own user (the admin, a warm) still stores any size.
    assert mount.path("v1", "100", f"{uuid}.npy").read_bytes() == reference_npy(photos[uuid], 100)
    assert mount.stats()["store_entries"] == 2


def test_a_store_another_user_prepared_is_refused_before_anything_is_mounted(
    tmp_path: Path, photos_dir: Path
) -> None:
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, 0o1777)  # like /tmp
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    store = base / "store"  # the other user got there first, with traps inside
    store.mkdir()
    (store / ".tmp").symlink_to(victim)
    (store / "v1").symlink_to(victim)
    for path in (store, store / ".tmp", store / "v1"):
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    config = write_config(tmp_path / "c.toml", store, {"v1": photos_dir})
    result = decodefs("mount", mountpoint, "--config", config, "--log-file", tmp_path / "log")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("decodefs: error: store: ")
    assert f"belongs to uid {NOBODY}" in lines[0] and "Traceback" not in result.stderr
    assert not os.path.ismount(mountpoint)
    assert os.listdir(victim) == ["precious"]


AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
HOLD_OPEN = """
import os, sys
fds = [os.open(path, os.O_RDONLY) for path in sys.argv[1:]]  # all held at once
print("opened", flush=True)
sys.stdin.readline()  # until told: then read each one through its open file
for fd in fds:
    sys.stdout.buffer.write(os.pread(fd, 1 << 30, 0))
    os.close(fd)
"""


def test_files_held_open_by_another_user_cannot_starve_the_daemons_memory(
    public_mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    # The repro of docs/reliability.md's hold-and-wait: another user holds open more
    # arrays than the memory budget fits, of sizes the store does not take for them.
    # Every open returns, everyone else's misses still decode, and each held file
    # reads right (fetched again if memory had to drop it meanwhile).
    budget = 2 << 20
    mount = public_mounts(
        {"v1": photos_dir}, access="everyone", sizes=[64], memory_cache_bytes=budget
    )
    uuid = sorted(photos)[0]
    sizes = range(300, 316)  # 16 arrays of ~270 KiB: twice the budget
    paths = [str(mount.path("v1", str(size), f"{uuid}.npy")) for size in sizes]
    hostile = subprocess.Popen(
        [*AS_NOBODY, sys.executable, "-c", HOLD_OPEN, *paths],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert hostile.stdout is not None and hostile.stdin is not None
        assert hostile.stdout.readline() == b"opened\n"  # all 16 at once
        assert mount.stats()["memory_bytes"] <= budget
        for other in sorted(photos)[1:4]:
            result = subprocess.run(
                ["cat", mount.path("v1", "64", f"{other}.npy")], capture_output=True, timeout=60
            )
            assert result.stdout == reference_npy(photos[other], 64)
        hostile.stdin.write(b"go\n")
        hostile.stdin.close()
        out = hostile.stdout.read()
        assert hostile.wait(timeout=60) == 0
    finally:
        hostile.kill()
        hostile.wait()
    want = b"".join(reference_npy(photos[uuid], size) for size in sizes)
    assert out == want
    stats = mount.stats()
    assert stats["memory_waits"] == 0 and stats["memory_refills"] >= 8
    assert stats["memory_bytes"] <= budget and stats["store_entries"] == 3
    assert stats["unlisted_not_stored"] == stats["decodes"] - 3 >= len(sizes)


def test_a_user_who_may_not_open_dev_fuse_is_told_so_when_mounting(
    shared_tmp: Path, photos: dict[str, Path]
) -> None:
    if os.stat("/dev/fuse").st_mode & 0o006 == 0o006:
        pytest.skip("/dev/fuse is open to every user here: nothing to be told")
    originals = shared_tmp / "originals"
    originals.mkdir()
    shutil.copy(next(iter(photos.values())), originals)
    config = write_config(shared_tmp / "config.toml", shared_tmp / "store", {"v1": originals})
    (shared_tmp / "mnt").mkdir()
    for path in [shared_tmp, *shared_tmp.rglob("*")]:
        os.chown(path, NOBODY, NOBODY)
    command: list[str | Path] = [sys.executable, "-m", "decodefs", "mount", shared_tmp / "mnt"]
    result = as_nobody(*command, "--config", config, "--foreground")
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr
    assert f"/dev/fuse (crw-------) cannot be opened by uid {NOBODY}" in stderr, stderr
    assert "Traceback" not in stderr
