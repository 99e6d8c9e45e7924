"""Bytes through the mount: exactly np.save of the reference decode, for any client."""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import subprocess
import sys
from pathlib import Path

import numpy as np

from decodefs import DecodeSettings, decode_image, npy_bytes
from tests.conftest import MountFactory
from tests.helpers import reference_npy

SIZES = (224, 57)


def test_every_photo_is_byte_exact_and_epoch_two_is_all_hits(
    mounts: MountFactory, photos: dict[str, Path], photos_dir: Path, tmp_path: Path
) -> None:
    mount = mounts({"v1": photos_dir})
    expected = {
        (uuid, size): reference_npy(path, size) for uuid, path in photos.items() for size in SIZES
    }

    for (uuid, size), want in expected.items():  # epoch 1: plain open().read()
        assert mount.path("v1", str(size), f"{uuid}.npy").read_bytes() == want, (uuid, size)
    stats = mount.stats()
    assert stats["misses"] == stats["decodes"] == len(expected)
    assert stats["decode_errors"] == 0

    for (uuid, size), want in expected.items():  # epoch 2: np.load, both layouts
        array = np.load(mount.path("v1", str(size), f"{uuid}.npy"))
        assert array.dtype == np.uint8 and array.shape == (size, size, 3)
        assert npy_bytes(array) == want
        assert mount.path("v1", str(size), uuid[:2], f"{uuid}.npy").read_bytes() == want
    stats = mount.stats()
    assert stats["decodes"] == len(expected)
    assert stats["hits"] == 2 * len(expected)  # np.load and read_bytes: two opens each

    # Other languages' readers see the same bytes: coreutils cmp and sha256sum.
    for (uuid, size), want in list(expected.items())[:4]:
        reference = tmp_path / f"{uuid}-{size}.npy"
        reference.write_bytes(want)
        served = mount.path("v1", str(size), f"{uuid}.npy")
        subprocess.run(["cmp", str(reference), str(served)], check=True)
        digest = subprocess.run(
            ["sha256sum", str(served)], capture_output=True, text=True, check=True
        )
        assert digest.stdout.split()[0] == hashlib.sha256(want).hexdigest()


def test_other_processes_read_the_same_bytes(
    mounts: MountFactory, photos: dict[str, Path], photos_dir: Path
) -> None:
    mount = mounts({"v1": photos_dir})
    paths = [str(mount.path("v1", "224", f"{uuid}.npy")) for uuid in photos]
    # A separate interpreter memory-maps the arrays, as a numpy user on the box would.
    script = (
        "import sys, numpy as np\n"
        "for p in sys.argv[1:]: print(p, int(np.load(p, mmap_mode='r').astype(np.int64).sum()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *paths], capture_output=True, text=True, check=True
    )
    sums = dict(line.split() for line in result.stdout.splitlines())
    for uuid, path in photos.items():
        want = np.load(io.BytesIO(reference_npy(path, 224))).astype(np.int64).sum()
        assert int(sums[str(mount.path("v1", "224", f"{uuid}.npy"))]) == want
    # DataLoader-style worker processes, each reading a slice of the corpus.
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        digests = dict(zip(paths, pool.map(_sha256_of, paths), strict=True))
    for uuid, path in photos.items():
        assert (
            digests[str(mount.path("v1", "224", f"{uuid}.npy"))]
            == hashlib.sha256(reference_npy(path, 224)).hexdigest()
        )


def _sha256_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_small_reads_at_odd_offsets(
    mounts: MountFactory, photos: dict[str, Path], photos_dir: Path
) -> None:
    mount = mounts({"v1": photos_dir})
    uuid, path = "chelsea-444", photos["chelsea-444"]
    want = reference_npy(path, 224)
    with open(mount.path("v1", "224", f"{uuid}.npy"), "rb", buffering=0) as f:
        pieces = []
        while chunk := f.read(4093):
            pieces.append(chunk)
        assert b"".join(pieces) == want
        f.seek(len(want) - 10)
        assert f.read(100) == want[-10:]
        f.seek(len(want) + 5)
        assert f.read(10) == b""


def test_decode_settings_are_per_version(
    mounts: MountFactory, photos: dict[str, Path], photos_dir: Path
) -> None:
    source = photos_dir
    mount = mounts({"plain": source, "cropped": source})
    # The config helper applies version_ keys to every version; write the crop one by hand.
    text = mount.config.read_text().replace(
        "[versions.cropped]\n", '[versions.cropped]\nfit = "crop"\nresample = "bicubic"\n'
    )
    mount.stop()
    mount.config.write_text(text)
    mount.start()
    settings = DecodeSettings(fit="crop", resample="bicubic")
    for uuid, path in photos.items():
        assert mount.path("cropped", "96", f"{uuid}.npy").read_bytes() == npy_bytes(
            decode_image(path, 96, settings)
        )
        assert mount.path("plain", "96", f"{uuid}.npy").read_bytes() == reference_npy(path, 96)


def test_remount_serves_stored_arrays_without_decoding(
    mounts: MountFactory, photos: dict[str, Path], photos_dir: Path
) -> None:
    mount = mounts({"v1": photos_dir})
    for uuid in photos:
        mount.path("v1", "224", f"{uuid}.npy").read_bytes()
    assert mount.stats()["decodes"] == len(photos)
    assert mount.stop() == 0

    mount.start()
    for uuid, path in photos.items():
        assert mount.path("v1", "224", f"{uuid}.npy").read_bytes() == reference_npy(path, 224)
    stats = mount.stats()
    assert stats["decodes"] == 0 and stats["misses"] == 0
    assert stats["hits"] == len(photos)
    assert stats["corrupt_entries"] == 0
    # The catalog was kept: usage is complete at once, and exact.
    assert stats["store_usage_complete"] is True
    assert stats["store_entries"] == len(photos)
