"""Photo-like sample JPEGs for the demo, the benchmark and the tests.

Smooth colour fields, soft-edged shapes and sensor-like grain: content that
costs a JPEG decoder and a resampler what real photographs cost, made from a
seed so every run sees the same corpus.
"""

from __future__ import annotations

import concurrent.futures
import os
import uuid
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageDraw, ImageFilter

__all__ = ["make_sample_corpus", "photo_like"]


def photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """One RGB image that encodes and decodes like a photograph.

    The fields and shapes are drawn and softened at a quarter of the size, then scaled
    up (which softens them as much as a blur of the full size did, in a fifth of the
    time); the grain is added at the full size, as a sensor's.
    """
    small = (max(width // 4, 1), max(height // 4, 1))
    coarse = rng.integers(0, 256, (height // 96 + 2, width // 96 + 2, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize(small, Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, x1 = sorted(rng.integers(0, small[0], 2).tolist())
        y0, y1 = sorted(rng.integers(0, small[1], 2).tolist())
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1, y1), fill=color)
        else:
            draw.rectangle((x0, y0, x1, y1), fill=color)
    image = image.filter(ImageFilter.GaussianBlur(radius=max(small) / 800))
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    # Grain from -12 to 12, the same in each channel: image + grain - 12, clipped.
    grain = Image.fromarray(rng.integers(0, 25, (height, width), dtype=np.uint8), "L")
    return ImageChops.add(image, Image.merge("RGB", (grain, grain, grain)), offset=-12)


def make_sample_corpus(
    directory: Path,
    count: int,
    width: int = 1600,
    height: int = 1200,
    seed: int = 0,
    quality: int = 90,
) -> list[Path]:
    """Write ``count`` JPEGs named <uuid>.jpg under a few subdirectories of ``directory``.

    Existing files of the same name are kept, so a re-run is cheap.
    """
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        name = uuid.UUID(bytes=rng.bytes(16), version=4)
        paths.append(directory / f"batch-{i % 4:02d}" / f"{name}.jpg")

    def write(i: int) -> None:
        path = paths[i]
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        image_rng = np.random.default_rng([seed, i])
        tmp = path.with_suffix(f".{i}.tmp")
        photo_like(image_rng, width, height).save(tmp, format="JPEG", quality=quality)
        tmp.rename(path)

    # One image per core at once: Pillow and numpy let go of the GIL for the heavy parts,
    # and each image has its own generator, so the corpus is the same.
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(write, range(count)))
    return paths
