"""The mounted namespace, seen through real syscalls and real tools."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from decodefs.common.npy import npy_file_size
from tests.conftest import MountFactory
from tests.helpers import Mount, errno_of


@pytest.fixture(scope="module")
def mount(module_mounts: MountFactory, photos_dir: Path) -> Mount:
    return module_mounts({"v1": photos_dir, "v2": photos_dir}, sizes=[224, 64])


def test_root_lists_versions_and_status_dir(mount: Mount) -> None:
    assert sorted(os.listdir(mount.mountpoint)) == [".decodefs", "v1", "v2"]
    assert sorted(os.listdir(mount.path(".decodefs"))) == [
        "config.json",
        "failed.json",
        "metrics",
        "stats.json",
        "store.json",
    ]


def test_version_lists_configured_sizes_and_resolves_any_in_bounds(mount: Mount) -> None:
    assert sorted(os.listdir(mount.path("v1")), key=int) == ["64", "224"]
    for size in ["8", "9", "100", "333", "4096"]:
        assert stat.S_ISDIR(os.stat(mount.path("v1", size)).st_mode), size
    for bad in [
        "7",
        "4097",
        "0",
        "0224",
        "+224",
        "-224",
        " 224",
        "224 ",
        "22 4",
        "1e3",
        "224.0",
        "0x10",
        "abc",
        "\uff12\uff12\uff14",  # fullwidth digits
    ]:
        assert errno_of(os.stat, mount.path("v1", bad)) == errno.ENOENT, bad


def test_size_dir_lists_every_original_once(mount: Mount, photos: dict[str, Path]) -> None:
    expected = sorted(f"{uuid}.npy" for uuid in photos)
    assert sorted(os.listdir(mount.path("v1", "224"))) == expected
    assert sorted(os.listdir(mount.path("v1", "333"))) == expected  # unlisted size, same entries
    found = subprocess.run(
        ["find", str(mount.path("v1")), "-name", "*.npy"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sorted(Path(p).name for p in found) == sorted(
        expected * 2
    )  # sizes 64 and 224, no shard copies


def test_sharded_path_resolves_to_the_same_inode_and_is_not_listed(
    mount: Mount, photos: dict[str, Path]
) -> None:
    for uuid in photos:
        flat = os.stat(mount.path("v2", "64", f"{uuid}.npy"))
        sharded = os.stat(mount.path("v2", "64", uuid[:2], f"{uuid}.npy"))
        assert flat.st_ino == sharded.st_ino
        assert f"{uuid}.npy" in os.listdir(mount.path("v2", "64", uuid[:2]))
    assert not any(len(name) <= 2 for name in os.listdir(mount.path("v2", "64")))
    uuid = next(iter(photos))
    other_shard = "zz" if uuid[:2] != "zz" else "yy"
    assert errno_of(os.stat, mount.path("v2", "64", other_shard)) == errno.ENOENT
    wrong = next(u for u in photos if u[:2] != uuid[:2])
    assert errno_of(os.stat, mount.path("v2", "64", uuid[:2], f"{wrong}.npy")) == errno.ENOENT


def test_metadata_never_decodes(mount: Mount, photos: dict[str, Path]) -> None:
    before = mount.stats()["decodes"]
    listing = subprocess.run(
        ["ls", "-lR", str(mount.mountpoint / "v2")], capture_output=True, text=True, check=True
    ).stdout
    subprocess.run(
        ["find", str(mount.mountpoint), "-type", "f", "-size", "+1k"],
        capture_output=True,
        check=True,
    )
    for uuid in photos:
        for size in (64, 224, 999):
            st = os.stat(mount.path("v2", str(size), f"{uuid}.npy"))
            assert st.st_size == npy_file_size(size) == 128 + size * size * 3
            # access = "originals" (root's default): root's originals, below pytest's
            # root-only tmp directory, are root's alone.
            assert stat.S_IMODE(st.st_mode) == 0o400 and stat.S_ISREG(st.st_mode)
    assert f" {npy_file_size(224)} " in listing
    assert mount.stats()["decodes"] == before


@pytest.mark.parametrize(
    "name",
    [
        "missing.npy",
        "astronaut-baseline",  # no suffix
        "astronaut-baseline.NPY",
        "astronaut-baseline.npy.npy",
        "astronaut-baseline.jpg",
        ".npy",
        "..npy",
        "a" * 255,
    ],
)
def test_unknown_names_do_not_exist(mount: Mount, name: str) -> None:
    assert errno_of(os.stat, mount.path("v1", "224", name)) == errno.ENOENT


def test_names_that_cannot_exist(mount: Mount) -> None:
    assert errno_of(os.stat, mount.path("v1", "224", "a" * 256)) == errno.ENAMETOOLONG
    assert errno_of(os.stat, mount.path("v3")) == errno.ENOENT
    assert errno_of(os.stat, mount.path(".decodefs", "secrets")) == errno.ENOENT
    # ".." walks back up inside the mount; nothing leads outside the sources.
    assert os.stat(mount.path("v1", "224", "..", "..")).st_ino == os.stat(mount.mountpoint).st_ino
    assert errno_of(os.stat, mount.path("v1", "224", "group-0")) == errno.ENOENT
    assert (
        errno_of(os.stat, mount.path("v1", "224", "astronaut-baseline.npy", "x")) == errno.ENOTDIR
    )


def test_the_mount_is_read_only(mount: Mount, photos: dict[str, Path]) -> None:
    entry = mount.path("v1", "224", f"{next(iter(photos))}.npy")
    erofs = {errno.EROFS}
    assert errno_of(open, entry, "r+b") in erofs
    assert errno_of(open, entry, "ab") in erofs
    assert errno_of(os.open, entry, os.O_RDONLY | os.O_TRUNC) in erofs
    assert errno_of(open, mount.path("v1", "224", "new.npy"), "wb") in erofs
    assert errno_of(os.mkdir, mount.path("v1", "512x")) in erofs
    assert errno_of(os.unlink, entry) in erofs
    assert errno_of(os.rename, entry, mount.path("v1", "224", "renamed.npy")) in erofs
    assert errno_of(os.rmdir, mount.path("v1", "224")) in erofs
    assert errno_of(os.symlink, "x", mount.path("v1", "link")) in erofs
    assert errno_of(os.chmod, entry, 0o644) in erofs
    assert errno_of(os.truncate, entry, 0) in erofs
    assert errno_of(os.setxattr, entry, "user.x", b"1") in erofs | {errno.EOPNOTSUPP}


def test_status_files(mount: Mount) -> None:
    stats = json.loads(mount.path(".decodefs", "stats.json").read_bytes())
    for key in [
        "hits",
        "misses",
        "decodes",
        "decode_errors",
        "store_bytes",
        "bytes_served",
        "errors",
    ]:
        assert key in stats
    assert stats["versions"]["v1"]["originals"] == len(os.listdir(mount.path("v1", "224")))
    config = json.loads(mount.path(".decodefs", "config.json").read_bytes())
    assert config["versions"]["v1"]["sizes"] == [64, 224]
    # Live: a read changes what the next cat shows. Counted before the READ reply
    # is sent, so the reader's read returning is enough; a size no other test reads.
    before = mount.stats()["bytes_served"]
    data = mount.path("v1", "97", os.listdir(mount.path("v1", "97"))[0]).read_bytes()
    assert mount.stats()["bytes_served"] == before + len(data)


def test_statvfs_and_stat_of_directories(mount: Mount) -> None:
    vfs = os.statvfs(mount.mountpoint)
    assert vfs.f_namemax == 255
    for path, mode in [
        (mount.mountpoint, 0o555),
        (mount.path("v1"), 0o500),  # the source's, root's alone (below pytest's tmp)
        (mount.path("v1", "224"), 0o500),
        (mount.path(".decodefs"), 0o555),
    ]:
        st = os.stat(path)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == mode, path
