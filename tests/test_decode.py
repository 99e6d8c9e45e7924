"""The one decode function: exact pixels, exact .npy bytes, clear failures."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL
import pytest
from PIL import Image, ImageOps, _imaging

from decodefs import DecodeError, DecodeSettings, decode_image, npy_bytes, npy_file_size, npy_header
from decodefs.common.decode import decoder_fingerprint
from decodefs.daemon.process import IMAGE_BLOCK_BYTES, IMAGE_BLOCKS_KEPT, reuse_image_memory
from decodefs.sample import make_sample_corpus
from tests.helpers import SKIMAGE_DATA, png_header_only, reference_npy, write_bad_originals


@pytest.mark.parametrize("size", [8, 224, 333])
def test_default_decode_is_the_training_pipeline_path(photos: dict[str, Path], size: int) -> None:
    for uuid, path in photos.items():
        got = npy_bytes(decode_image(path, size))
        assert got == reference_npy(path, size), uuid


def test_npy_bytes_are_numpy_save_bytes() -> None:
    rng = np.random.default_rng(0)
    for size in [1, 8, 9, 99, 100, 224, 1000, 4096]:
        array = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        np.save(buffer, array)
        assert npy_bytes(array) == buffer.getvalue()
        assert npy_file_size(size) == len(buffer.getvalue())
        assert buffer.getvalue().startswith(npy_header(size))


def test_npy_bytes_rejects_other_shapes() -> None:
    with pytest.raises(ValueError, match="uint8"):
        npy_bytes(np.zeros((4, 5, 3), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        npy_bytes(np.zeros((4, 4, 3), np.float32))


def test_decode_accepts_a_file_object(photos: dict[str, Path]) -> None:
    path = photos["astronaut-baseline"]
    with open(path, "rb") as f:
        assert np.array_equal(decode_image(f, 64), decode_image(path, 64))


def test_resample_setting(photos: dict[str, Path]) -> None:
    path = photos["coffee-progressive"]
    got = decode_image(path, 96, DecodeSettings(resample="lanczos"))
    want = np.asarray(Image.open(path).convert("RGB").resize((96, 96), Image.Resampling.LANCZOS))
    assert np.array_equal(got, want)
    assert not np.array_equal(got, decode_image(path, 96))


def test_crop_is_torchvision_resize_then_center_crop(photos: dict[str, Path]) -> None:
    # torchvision.transforms.functional: resize(img, 96) keeps the aspect ratio
    # with the long side int(96 * long / short); center_crop rounds the offsets.
    path = photos["coffee-progressive"]  # 600 x 400, landscape
    image = Image.open(path).convert("RGB")
    scaled = image.resize((int(96 * 600 / 400), 96), Image.Resampling.BILINEAR)
    left = round((scaled.width - 96) / 2.0)
    want = np.asarray(scaled.crop((left, 0, left + 96, 96)))
    assert np.array_equal(decode_image(path, 96, DecodeSettings(fit="crop")), want)


def test_pad_letterboxes_on_black(photos: dict[str, Path]) -> None:
    path = photos["coffee-progressive"]  # 600 x 400 -> 96 x 64 centered
    got = decode_image(path, 96, DecodeSettings(fit="pad"))
    assert got.shape == (96, 96, 3)
    assert not got[:16].any() and not got[80:].any()
    inner = np.asarray(Image.open(path).convert("RGB").resize((96, 64), Image.Resampling.BILINEAR))
    assert np.array_equal(got[16:80], inner)


def test_exif_transpose(tmp_path: Path) -> None:
    image = Image.open(SKIMAGE_DATA / "chelsea.png").convert("RGB")  # landscape
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    path = tmp_path / "rotated.jpg"
    image.save(path, quality=90, exif=exif)
    got = decode_image(path, 64, DecodeSettings(exif_transpose=True))
    want = np.asarray(
        ImageOps.exif_transpose(Image.open(path))
        .convert("RGB")
        .resize((64, 64), Image.Resampling.BILINEAR)
    )
    assert np.array_equal(got, want)
    assert not np.array_equal(got, decode_image(path, 64))


def test_draft_uses_reduced_dct_decode(tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    Image.open(SKIMAGE_DATA / "astronaut.png").convert("RGB").resize((2048, 2048)).save(
        path, quality=90
    )
    reference = Image.open(path)
    reference.draft("RGB", (64, 64))
    assert reference.size < (2048, 2048)  # the decoder really scaled down
    want = np.asarray(reference.convert("RGB").resize((64, 64), Image.Resampling.BILINEAR))
    got = decode_image(path, 64, DecodeSettings(draft=True))
    assert np.array_equal(got, want)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_bad_originals_raise_decode_error_with_a_reason(
    tmp_path: Path, photos: dict[str, Path]
) -> None:
    reasons = {}
    for uuid, path in write_bad_originals(tmp_path, photos["astronaut-baseline"]).items():
        with pytest.raises(DecodeError) as info:
            decode_image(path, 32)
        reasons[uuid] = info.value.reason
    assert "truncated" in reasons["bad-truncated"]
    assert "cannot identify" in reasons["bad-empty"]
    assert "cannot identify" in reasons["bad-text"]
    assert "decompression bomb" in reasons["bad-bomb"]
    assert "decompression bomb" in reasons["bad-bigger-than-max-pixels"]


def test_max_pixels_is_configurable(tmp_path: Path) -> None:
    path = tmp_path / "wide.png"
    path.write_bytes(png_header_only(2000, 1000))
    with pytest.raises(DecodeError, match="2000x1000 is more than 1000000 pixels"):
        decode_image(path, 32, max_pixels=1_000_000)


def test_fingerprint_covers_settings_and_libraries() -> None:
    default = decoder_fingerprint(DecodeSettings())
    assert default == decoder_fingerprint(DecodeSettings())
    assert default.digest != decoder_fingerprint(DecodeSettings(resample="bicubic")).digest
    assert default.digest != decoder_fingerprint(DecodeSettings(draft=True)).digest
    libraries = default.description["libraries"]
    assert isinstance(libraries, dict)
    assert libraries["pil"] == PIL.__version__
    assert "libjpeg_turbo" in libraries and "zlib" in libraries


def test_invalid_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="resample"):
        DecodeSettings(resample="cubic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fit"):
        DecodeSettings(fit="zoom")  # type: ignore[arg-type]


_DAEMON_DECODES = """
import resource, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import numpy as np
from decodefs.common.decode import decode_image
from decodefs.daemon.process import return_large_allocations
paths = sorted(Path(sys.argv[1]).rglob("*.jpg"))
before = [decode_image(p, 224) for p in paths]
return_large_allocations()  # as the daemon starts
pool = ThreadPoolExecutor(2)  # its decode pool
list(pool.map(lambda p: decode_image(p, 224), paths))  # what is kept, is kept from here on
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
after = list(pool.map(lambda p: decode_image(p, 224), paths * 4))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
assert all(np.array_equal(a, b) for a, b in zip(before * 4, after))
print(faults / len(after))
"""


def test_the_daemons_decodes_reuse_image_memory_instead_of_faulting_it_in(
    tmp_path: Path,
) -> None:
    """With the daemon's allocation tuning, a 640x480 decode's images (1.2 MiB each in
    Pillow) come from kept blocks: a few dozen page faults a decode, not the ~600 of
    one fresh mapping per image, and the same arrays."""
    make_sample_corpus(tmp_path, 5, 640, 480, seed=3)
    done = subprocess.run(
        [sys.executable, "-c", _DAEMON_DECODES, str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert float(done.stdout) < 250  # ~90 measured; ~640 without the kept blocks


def test_kept_image_memory_is_bounded_after_a_large_decode(tmp_path: Path) -> None:
    """A large original's image is many blocks of at most IMAGE_BLOCK_BYTES, of which
    IMAGE_BLOCKS_KEPT stay: its memory goes back to the system."""
    [path] = make_sample_corpus(tmp_path, 1, 3000, 2000, seed=4)
    size, kept = _imaging.get_block_size(), _imaging.get_blocks_max()
    try:
        reuse_image_memory()
        _imaging.reset_stats()
        decode_image(path, 224)
        stats = _imaging.get_stats()
        assert _imaging.get_block_size() == IMAGE_BLOCK_BYTES
        assert stats["allocated_blocks"] > IMAGE_BLOCKS_KEPT  # it did take many blocks
        assert stats["blocks_cached"] <= IMAGE_BLOCKS_KEPT
    finally:
        _imaging.set_block_size(size)
        _imaging.set_blocks_max(kept)
