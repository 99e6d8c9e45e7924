"""layout = "mirror" on real mounts: class folders of real photographs whose names repeat,
read by plain open, np.load, os.walk, threads, read_array and the CLI."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import stat
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from decodefs import read_array
from decodefs.client import flush_reports
from decodefs.common.config import DEFAULT_EXTENSIONS
from decodefs.common.entry import EntryKey
from decodefs.common.npy import npy_file_size
from decodefs.common.protocol import TRAILER_SIZE
from tests.conftest import MountFactory
from tests.helpers import Mount, decodefs, errno_of, reference_npy, wait_until

SIZE = 64
# Every photograph once, in class folders whose file names repeat, nested folders, a name
# with spaces, and one at the top.
LAYOUT = [
    "cat/0001",
    "cat/0002",
    "cat/0003",
    "dog/0001",
    "dog/0002",
    "dog/0003",
    "bird/0001",
    "bird/0002",
    "wild/big cats/lion 01",
    "wild/big cats/0001",
    "0001",
]


@pytest.fixture(scope="module")
def classes(tmp_path_factory: pytest.TempPathFactory, photos: dict[str, Path]) -> dict[str, Path]:
    """key -> original, under ``source(classes)``; also an empty class, a folder with no
    images, a symlinked class folder inside the source, and litter that is no original."""
    root = tmp_path_factory.mktemp("classes") / "src"
    keys: dict[str, Path] = {}
    for key, uuid in zip(LAYOUT, sorted(photos), strict=True):
        path = root / f"{key}{photos[uuid].suffix}"  # the photo's own extension (.JPG, .TIFF, ...)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(photos[uuid], path)
        keys[key] = path
    (root / "zebra").mkdir()  # an empty class: listed, as ImageFolder lists it
    (root / "docs").mkdir()
    (root / "docs" / "readme.txt").write_text("not an image\n")
    (root / ".thumbs").mkdir()
    shutil.copyfile(keys["cat/0001"], root / ".thumbs" / "0001.jpg")
    shutil.copyfile(keys["cat/0001"], root / "cat" / ".0004.jpg")
    (root / "kitty").symlink_to("cat")  # cat's arrays again, under kitty/
    for key in ["cat/0001", "cat/0002", "cat/0003"]:
        keys[key.replace("cat/", "kitty/")] = keys[key]
    return keys


def source(classes: dict[str, Path]) -> Path:
    return classes["0001"].parent


def array(mount: Mount, key: str, size: int = SIZE) -> Path:
    return mount.path("v1", str(size), *f"{key}.npy".split("/"))


def mirror_mount(mounts: MountFactory, root: Path, **config: object) -> Mount:
    return mounts({"v1": root}, version_layout="mirror", sizes=[SIZE], **config)


def as_npy(value: npt.NDArray[np.uint8]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, value)
    return buffer.getvalue()


def tree_of(root: Path, *, originals: bool) -> dict[str, tuple[list[str], list[str]]]:
    """relative directory -> (subdirectories, files) as os.walk sees them; for a source
    (``originals``), the names its mirror must show: hidden names skipped, images as .npy."""
    result = {}
    for top, dirs, files in os.walk(root, followlinks=originals):
        if originals:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files = [
                f"{f.rpartition('.')[0]}.npy"
                for f in files
                if not f.startswith(".") and f.rpartition(".")[2].lower() in DEFAULT_EXTENSIONS
            ]
        result[os.path.relpath(top, root)] = (sorted(dirs), sorted(files))
    return result


def test_every_photo_is_served_byte_exact_under_its_own_path(
    mounts: MountFactory, classes: dict[str, Path]
) -> None:
    mount = mirror_mount(mounts, source(classes))
    for key, original in classes.items():
        assert array(mount, key).read_bytes() == reference_npy(original, SIZE), key
        loaded = np.load(array(mount, key))
        assert loaded.shape == (SIZE, SIZE, 3) and loaded.dtype == np.uint8
    for key in ["cat/0001", "dog/0001", "0001"]:  # any size, and names repeated across classes
        assert array(mount, key, 224).read_bytes() == reference_npy(classes[key], 224), key
    assert array(mount, "cat/0001").read_bytes() != array(mount, "dog/0001").read_bytes()
    stats = mount.stats()
    assert stats["decodes"] == stats["misses"] == len(classes) + 3
    assert stats["versions"]["v1"]["originals"] == len(classes)
    assert stats["versions"]["v1"]["layout"] == "mirror"


def test_the_mount_is_the_source_tree_and_listing_it_never_decodes(
    mounts: MountFactory, classes: dict[str, Path]
) -> None:
    mount = mirror_mount(mounts, source(classes))
    root = mount.path("v1", str(SIZE))
    assert tree_of(root, originals=False) == tree_of(source(classes), originals=True)
    # What torchvision's ImageFolder/DatasetFolder does with its root: the same classes,
    # the empty one included, and every array below them.
    classes_seen = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    assert classes_seen == ["bird", "cat", "docs", "dog", "kitty", "wild", "zebra"]
    samples = sorted(
        os.path.relpath(os.path.join(top, name), root)
        for name_of_class in classes_seen
        for top, _, files in os.walk(root / name_of_class)
        for name in files
        if name.endswith(".npy")
    )
    assert samples == sorted(f"{key}.npy" for key in classes if "/" in key)
    for top, dirs, files in os.walk(root):
        for name in dirs:
            st = os.stat(os.path.join(top, name))
            # access = "originals" (root's default): the source's folders and originals,
            # root's, below pytest's root-only tmp directory, are root's alone.
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o500
        for name in files:
            st = os.stat(os.path.join(top, name))
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o400
            assert st.st_size == npy_file_size(SIZE)
    # ".." climbs back up, folder by folder.
    nested = array(mount, "wild/big cats/0001")
    assert os.stat(nested.parent / ".." / ".." / "cat" / "0001.npy").st_ino == (
        os.stat(array(mount, "cat/0001")).st_ino
    )
    stats = mount.stats()
    assert stats["decodes"] == 0 and stats["misses"] == 0 and stats["hits"] == 0


@pytest.mark.parametrize(
    "path",
    [
        "cat/0004.npy",  # no such original
        "cat/.0004.npy",  # hidden
        "cat/0001.jpg",  # the original's name
        "cat/0001",  # a key is no folder
        "cat/0001.npy/x",
        "zebra/0001.npy",
        "docs/readme.npy",
        ".thumbs",
        ".thumbs/0001.npy",
        "lion 01.npy",  # it is under wild/big cats/
        "big cats/lion 01.npy",
        "ca",  # no shard directories in a mirror version
        "00/0001.npy",
        "nope",
        "nope/0001.npy",
        "cat/" + "x" * 251 + ".npy",
    ],
)
def test_names_the_source_does_not_have_do_not_exist(
    mounts: MountFactory, classes: dict[str, Path], path: str
) -> None:
    mount = mirror_mount(mounts, source(classes))
    target = mount.path("v1", str(SIZE), *path.split("/"))
    assert errno_of(os.stat, target) in (errno.ENOENT, errno.ENOTDIR), path
    assert mount.stats()["decodes"] == 0


def test_the_mirror_is_read_only(mounts: MountFactory, classes: dict[str, Path]) -> None:
    mount = mirror_mount(mounts, source(classes))
    cat = mount.path("v1", str(SIZE), "cat")
    assert errno_of(os.open, cat / "0001.npy", os.O_WRONLY) in (errno.EROFS, errno.EACCES)
    assert errno_of(os.mkdir, cat / "new") in (errno.EROFS, errno.EACCES)
    assert errno_of(os.rename, cat / "0001.npy", cat / "0009.npy") in (errno.EROFS, errno.EACCES)
    assert errno_of(os.unlink, cat / "0001.npy") in (errno.EROFS, errno.EACCES)
    assert errno_of(os.rmdir, mount.path("v1", str(SIZE), "zebra")) in (errno.EROFS, errno.EACCES)


def test_cold_readers_of_one_array_cause_one_decode(
    mounts: MountFactory, large: list[Path], tmp_path: Path
) -> None:
    root = tmp_path / "src"
    for folder, original in [("a", large[0]), ("b", large[1])]:
        (root / folder).mkdir(parents=True)
        shutil.copyfile(original, root / folder / "0001.jpg")
    mount = mirror_mount(mounts, root, decode_workers=2)
    target = array(mount, "a/0001")
    want = hashlib.sha256(reference_npy(large[0], SIZE)).hexdigest()
    barrier = threading.Barrier(8)
    digests: list[str] = []

    def reader_thread() -> None:
        barrier.wait()
        digests.append(hashlib.sha256(target.read_bytes()).hexdigest())

    threads = [threading.Thread(target=reader_thread) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert digests == [want] * 8
    stats = mount.stats()
    assert stats["decodes"] == 1
    assert stats["hits"] + stats["misses"] == 8 and stats["coalesced"] == stats["misses"] - 1
    other = array(mount, "b/0001").read_bytes()  # the same name in another folder
    assert hashlib.sha256(other).hexdigest() != want
    assert mount.stats()["decodes"] == 2


def test_read_array_reads_stored_mirror_arrays_straight_from_the_store(
    mounts: MountFactory, classes: dict[str, Path], tmp_path: Path
) -> None:
    mount = mirror_mount(mounts, source(classes))
    for key, original in classes.items():  # misses: through the mount
        assert as_npy(read_array(array(mount, key))) == reference_npy(original, SIZE), key
    before = mount.stats()
    assert before["decodes"] == len(classes)
    dataset = tmp_path / "dataset"  # a dataset root pointed at the mount
    dataset.symlink_to(mount.path("v1", str(SIZE)))
    for key, original in classes.items():
        want = reference_npy(original, SIZE)
        for path in [
            array(mount, key),
            dataset.joinpath(*f"{key}.npy".split("/")),
            mount.path("v1", str(SIZE), "zebra", "..", *f"{key}.npy".split("/")),
        ]:
            got = read_array(path)
            assert got.flags.writeable and got.flags.c_contiguous
            assert as_npy(got) == want, path
    after = mount.stats()
    assert after["hits"] == before["hits"] and after["decodes"] == before["decodes"]
    flush_reports()  # the hits, reported for LRU with their mirror keys
    wait_until(lambda: mount.stats()["direct_hits"] == 3 * len(classes), what="direct hits")
    # A symlink to an array names that array's key, wherever the link lives.
    link = tmp_path / "alias.npy"
    link.symlink_to(array(mount, "dog/0001"))
    assert as_npy(read_array(link)) == reference_npy(classes["dog/0001"], SIZE)


def test_a_restart_serves_stored_arrays_without_decoding(
    mounts: MountFactory, classes: dict[str, Path]
) -> None:
    mount = mirror_mount(mounts, source(classes))
    for key in classes:
        array(mount, key).read_bytes()
    assert mount.stats()["decodes"] == len(classes)
    assert mount.stop() == 0
    mount.start()
    for key, original in classes.items():
        assert array(mount, key).read_bytes() == reference_npy(original, SIZE), key
    stats = mount.stats()
    assert stats["decodes"] == 0 and stats["hits"] == len(classes)
    assert stats["store_entries"] == len(classes)


def test_the_background_warm_fills_a_mirror_version(
    mounts: MountFactory, classes: dict[str, Path]
) -> None:
    mount = mirror_mount(mounts, source(classes), version_warm=True)
    wait_until(
        lambda: mount.stats()["background_decodes"] == len(classes), timeout=120, what="the warm"
    )
    for key, original in classes.items():
        assert array(mount, key).read_bytes() == reference_npy(original, SIZE), key
    stats = mount.stats()
    assert stats["misses"] == 0 and stats["hits"] == len(classes)
    assert stats["decodes"] == stats["store_entries"] == len(classes)


def test_warm_and_verify_over_a_mirror_version(
    mounts: MountFactory, classes: dict[str, Path], tmp_path: Path
) -> None:
    mount = mirror_mount(mounts, source(classes))
    count = len(classes)
    warmed = decodefs("warm", mount.mountpoint, "v1", "48", "--jobs", "2")
    assert warmed.returncode == 0, warmed.stderr
    assert f"warmed {count} of {count} arrays of v1/48" in warmed.stdout
    assert mount.stats()["decodes"] == count
    again = decodefs("warm", mount.mountpoint, "v1", "48")
    assert again.returncode == 0 and "the daemon decoded 0 meanwhile" in again.stdout

    listing = tmp_path / "keys.txt"
    listing.write_text("# a subset, by key\ncat/0002\nwild/big cats/lion 01.npy\ncat/9999\n")
    subset = decodefs("warm", mount.mountpoint, "v1", "40", "--keys", listing)
    assert subset.returncode == 1  # cat/9999 does not exist
    assert "warmed 2 of 3 arrays of v1/40" in subset.stdout
    assert "'cat/9999'" in subset.stderr
    assert mount.stats()["decodes"] == count + 2

    store = tmp_path / "store"
    verified = decodefs("verify", store)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"checked {count + 2} entries of v1: {count + 2} ok, 0 corrupt" in verified.stdout
    entry = store / EntryKey("v1", 48, "wild/big cats/lion 01").relpath
    assert entry.parent.name.startswith("%") and entry.name == "wild%2Fbig cats%2Flion 01.npy"
    data = bytearray(entry.read_bytes())
    data[-TRAILER_SIZE - 100] ^= 0x01
    entry.write_bytes(bytes(data))
    damaged = decodefs("verify", store)
    assert damaged.returncode == 1
    assert f"{entry}: checksum mismatch" in damaged.stdout
