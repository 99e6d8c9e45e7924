"""fit = "crop" is torchvision's Resize(size) + CenterCrop(size) on a PIL image.

The reference below is written from torchvision's documented behaviour with
Pillow alone (torchvision is not a dependency): Resize(int) scales the
shorter side to ``size`` and the longer one to ``int(size * long / short)``,
skipping the resize when nothing changes; CenterCrop takes
``round((side - size) / 2.0)`` from the top and left (Python's round:
halves to even). Odd sizes and extreme aspect ratios are where such formulas
go wrong.
"""

from __future__ import annotations

import io

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from decodefs import DecodeSettings, decode_image

SHAPES = [
    (1, 1000),
    (999, 1),
    (7, 5),
    (5, 7),
    (10, 3),
    (3, 10),
    (301, 299),
    (299, 301),
    (224, 224),
    (3, 3),
]
SIZES = [3, 223, 224, 225]
FILTERS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


def torchvision_resize_center_crop(
    image: Image.Image, size: int, resample: Image.Resampling
) -> npt.NDArray[np.uint8]:
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
    if (new_w, new_h) != (width, height):
        image = image.resize((new_w, new_h), resample)
    top = round((new_h - size) / 2.0)
    left = round((new_w - size) / 2.0)
    return np.asarray(image.crop((left, top, left + size, top + size)))


def png(width: int, height: int, seed: int) -> bytes:
    noise = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="PNG")  # lossless: the pixels are the noise
    return buffer.getvalue()


@pytest.mark.parametrize(("width", "height"), SHAPES, ids=[f"{w}x{h}" for w, h in SHAPES])
def test_crop_is_resize_then_center_crop(width: int, height: int) -> None:
    data = png(width, height, seed=width * 10_000 + height)
    # At 1 x 1000 the scaled image is 225 x 225,000 pixels: one filter is enough there.
    extreme = max(width, height) >= 100 * min(width, height)
    filters = {"bilinear": FILTERS["bilinear"]} if extreme else FILTERS
    for resample, pil_filter in filters.items():
        settings = DecodeSettings(fit="crop", resample=resample)  # type: ignore[arg-type]
        for size in SIZES:
            got = decode_image(io.BytesIO(data), size, settings)
            want = torchvision_resize_center_crop(
                Image.open(io.BytesIO(data)).convert("RGB"), size, pil_filter
            )
            assert got.shape == want.shape == (size, size, 3)
            assert np.array_equal(got, want), (resample, size)


def test_crop_rounds_offsets_half_to_even() -> None:
    # 7x5 at size 3: the long side becomes int(3 * 7 / 5) = 4, so the left offset
    # is round(0.5) = 0 (not 1); at 5x7 the top offset likewise.
    data = png(7, 5, seed=1)
    scaled = Image.open(io.BytesIO(data)).convert("RGB").resize((4, 3), Image.Resampling.BILINEAR)
    got = decode_image(io.BytesIO(data), 3, DecodeSettings(fit="crop"))
    assert np.array_equal(got, np.asarray(scaled)[:, 0:3])
    assert not np.array_equal(got, np.asarray(scaled)[:, 1:4])
