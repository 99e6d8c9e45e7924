"""Original image -> uint8 [size, size, 3] array, and the fingerprint of what made it.

Pure functions: no daemon state, no caching policy, no I/O beyond reading the
original. The daemon, the tests and a user's live training path all call
`decode_image`, so the mount serves exactly what it returns. The only room
of the vocabulary that imports Pillow; the ``.npy`` layout of an array is
npy.py's, the fingerprint's value fingerprint.py's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import IO, Final, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps, features

from .fingerprint import Fingerprint

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "DecodeError",
    "DecodeSettings",
    "decode_image",
    "decode_peak_bytes",
    "decoder_fingerprint",
    "image_dimensions",
    "quiet_pillow_warnings",
]

Fit = Literal["stretch", "crop", "pad"]
Resample = Literal["nearest", "box", "bilinear", "hamming", "bicubic", "lanczos"]
ImageSource = str | os.PathLike[str] | IO[bytes]

RESAMPLE_FILTERS: Final[Mapping[str, Image.Resampling]] = {
    "nearest": Image.Resampling.NEAREST,
    "box": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR,
    "hamming": Image.Resampling.HAMMING,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
FITS: Final = ("stretch", "crop", "pad")

# Pillow's own warning threshold; twice this, Image.open itself refuses.
DEFAULT_MAX_PIXELS: Final = 89_478_485

# Bump when the meaning of DecodeSettings changes in a way that changes pixels.
_DECODE_FORMAT: Final = 1


class DecodeError(Exception):
    """The original cannot be decoded (truncated, not an image, too large)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class DecodeSettings:
    """How an original becomes a square array; part of every cache key.

    The defaults are the common training-pipeline path:
    ``Image.open(p).convert("RGB").resize((size, size), Image.BILINEAR)``.

    - ``resample``: the Pillow filter used for every resize.
    - ``fit``: ``stretch`` resizes to (size, size) ignoring aspect ratio;
      ``crop`` scales the shorter side to ``size`` and center-crops, exactly as
      torchvision's ``Resize(size)`` + ``CenterCrop(size)`` on a PIL image;
      ``pad`` scales the longer side to ``size`` and letterboxes on black.
    - ``exif_transpose``: apply the EXIF orientation before anything else.
    - ``draft``: let JPEG decode at a reduced DCT scale (much faster for large
      photos, slightly different pixels); other formats ignore it.
    """

    resample: Resample = "bilinear"
    fit: Fit = "stretch"
    exif_transpose: bool = False
    draft: bool = False

    def __post_init__(self) -> None:
        if self.resample not in RESAMPLE_FILTERS:
            raise ValueError(f"resample must be one of {sorted(RESAMPLE_FILTERS)}")
        if self.fit not in FITS:
            raise ValueError(f"fit must be one of {list(FITS)}")


def decode_image(
    source: ImageSource,
    size: int,
    settings: DecodeSettings = DecodeSettings(),
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> npt.NDArray[np.uint8]:
    """Decode ``source`` into a C-contiguous uint8 array of shape (size, size, 3).

    Raises DecodeError for anything that is not a decodable image of at most
    ``max_pixels`` pixels. This is the one decode path of decodefs.
    """
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    with _as_decode_error(), Image.open(source) as im:
        width, height = im.size
        if width * height > max_pixels:
            raise DecodeError(
                f"decompression bomb: {width}x{height} is more than {max_pixels} pixels"
            )
        if settings.draft:
            im.draft("RGB", (size, size))
        image: Image.Image = im
        if settings.exif_transpose:
            image = ImageOps.exif_transpose(image)
        out = _fit(image.convert("RGB"), size, settings)
        array = np.asarray(out)
    if array.shape != (size, size, 3) or array.dtype != np.uint8:
        raise DecodeError(f"decoded to {array.dtype}{array.shape}, not uint8({size}, {size}, 3)")
    return np.ascontiguousarray(array)


def image_dimensions(source: ImageSource) -> tuple[int, int]:
    """(width, height) of an original from its header alone; DecodeError if it has none."""
    with _as_decode_error(), Image.open(source) as im:
        return im.size


@contextlib.contextmanager
def _as_decode_error() -> Iterator[None]:
    """Whatever a codec raises for an original, as DecodeError (MemoryError passes).

    A hostile or broken file can make any codec raise anything; none of it is a
    bug of ours, and the caller needs one type to map to EIO."""
    try:
        yield
    except (DecodeError, MemoryError):
        raise
    except Image.DecompressionBombError as exc:
        raise DecodeError(f"decompression bomb: {exc}") from exc
    except Exception as exc:
        raise DecodeError(f"{type(exc).__name__}: {exc}") from exc


def decode_peak_bytes(width: int, height: int) -> int:
    """The most memory ``decode_image`` takes for an original of this many pixels.

    Pillow holds every decoded pixel in 4 bytes (RGB as RGBX, palettes and
    16-bit images expanded), and ``convert("RGB")`` makes a second image of
    the same size before the resize, which is small next to them.
    """
    return 8 * width * height


def _fit(rgb: Image.Image, size: int, settings: DecodeSettings) -> Image.Image:
    resample = RESAMPLE_FILTERS[settings.resample]
    if settings.fit == "stretch":
        return rgb.resize((size, size), resample)
    width, height = rgb.size
    if settings.fit == "crop":
        # torchvision.transforms.functional.resize/center_crop semantics.
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(size * long / short)
        new_w, new_h = (size, new_long) if width <= height else (new_long, size)
        scaled = rgb.resize((new_w, new_h), resample)
        left = round((new_w - size) / 2.0)
        top = round((new_h - size) / 2.0)
        return scaled.crop((left, top, left + size, top + size))
    # pad: the longer side becomes `size`, centered on black.
    scale = size / max(width, height)
    new_w = max(1, round(width * scale))
    new_h = max(1, round(height * scale))
    canvas = Image.new("RGB", (size, size))
    canvas.paste(rgb.resize((new_w, new_h), resample), ((size - new_w) // 2, (size - new_h) // 2))
    return canvas


def decoder_fingerprint(settings: DecodeSettings, *, keys: str = "uuid") -> Fingerprint:
    """The fingerprint of arrays decoded with ``settings`` by this Pillow, stored
    under ``keys`` (a version's layout: which original a key names). The
    default leaves the layout out, so uuid versions keep the digests they had."""
    description: dict[str, object] = {
        "format": _DECODE_FORMAT,
        "settings": asdict(settings),
        "libraries": _decoder_libraries(),
    }
    if keys != "uuid":
        # "0001" is the stem of an original anywhere in a uuid version, but the
        # top-level 0001.jpg in a mirror: a changed layout must not serve one as the other.
        description["keys"] = keys
    return Fingerprint.of(description)


@functools.cache
def _decoder_libraries() -> dict[str, str | None]:
    """Versions of Pillow and every codec library that can change decoded pixels."""
    names = [
        "pil",
        "jpg",
        "libjpeg_turbo",
        "mozjpeg",
        "jpg_2000",
        "zlib",
        "zlib_ng",
        "libtiff",
        "webp",
        "avif",
    ]
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = features.version(name)
        except ValueError:  # a feature this Pillow does not know
            versions[name] = None
    return versions


def quiet_pillow_warnings() -> None:
    """For the daemon: ``max_pixels`` is the policy, so Pillow's own bomb warning is noise."""
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
