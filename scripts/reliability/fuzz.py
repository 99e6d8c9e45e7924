"""Part 6, fuzz: seeded mutations of real JPEG and PNG originals read through the mount and
compared with the in-process decode_image. It knows no other part."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import io
import re
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
from PIL import Image

from decodefs import DecodeError, decode_image, npy_file_size, npy_header
from tests.helpers import SKIMAGE_DATA

from .checks import errno_name, pixels_digest
from .harness import BOUND_KIB, VERSION, Harness, Part, Sampler, Sizes, mib

# A read that takes longer than this counts as a hang.
READ_TIMEOUT: Final = 60.0
# What a read through the mount may give: decode_image's array, or EIO where it raises.
SAME: Final = "same array"
EIO_AS_DECODE_FAILS: Final = "EIO, as decode_image fails"
_SOF: Final = re.compile(rb"\xff[\xc0-\xc3\xc5-\xc7\xc9-\xcb\xcd-\xcf]")


def fuzz_seeds() -> list[tuple[str, str, bytes]]:
    """(name, extension, bytes) of real photographs, small, encoded as originals arrive."""
    photos: dict[str, Image.Image] = {
        name: Image.open(SKIMAGE_DATA / f"{name}.png")
        for name in ("astronaut", "coffee", "chelsea", "camera", "logo")
    }
    photos["rocket"] = Image.open(SKIMAGE_DATA / "rocket.jpg")
    for photo in photos.values():
        photo.thumbnail((160, 160))
    encodings: list[tuple[str, str, Image.Image, dict[str, Any]]] = [
        ("astronaut-baseline", "JPEG", photos["astronaut"], {"quality": 90}),
        ("coffee-progressive", "JPEG", photos["coffee"], {"quality": 85, "progressive": True}),
        ("chelsea-444", "JPEG", photos["chelsea"], {"quality": 95, "subsampling": 0}),
        ("camera-gray", "JPEG", photos["camera"], {"quality": 90}),
        ("rocket-cmyk", "JPEG", photos["rocket"].convert("CMYK"), {"quality": 90}),
        ("astronaut-rgb", "PNG", photos["astronaut"], {}),
        ("coffee-palette", "PNG", photos["coffee"].quantize(64), {}),
        ("camera-gray", "PNG", photos["camera"], {}),
        ("logo-alpha", "PNG", photos["logo"], {}),
        ("camera-16bit", "PNG", photos["camera"].convert("I;16"), {}),
    ]
    seeds = []
    for name, fmt, image, options in encodings:
        buffer = io.BytesIO()
        image.save(buffer, format=fmt, **options)
        seeds.append((name, "jpg" if fmt == "JPEG" else "png", buffer.getvalue()))
    return seeds


def mutate(
    data: bytes, extension: str, rng: np.random.Generator, others: Sequence[bytes]
) -> tuple[bytes, str]:
    """One seeded mutation of an original (or two or three, "several"): (the bytes, its kind)."""
    kinds = ["bytes", "bits", "truncate", "splice", "insert", "zero", "repeat", "dimensions"]
    kind = str(rng.choice([*kinds, "dimensions", "several"]))
    if kind != "several":
        return _mutate_once(data, kind, extension, rng, others), kind
    for _ in range(int(rng.integers(2, 4))):
        data = _mutate_once(data, str(rng.choice(kinds)), extension, rng, others)
    return data, kind


def _mutate_once(
    data: bytes, kind: str, extension: str, rng: np.random.Generator, others: Sequence[bytes]
) -> bytes:
    out = bytearray(data)
    n = max(1, len(out))
    if kind == "bytes":
        for _ in range(int(rng.integers(1, 17))):
            out[int(rng.integers(len(out)))] = int(rng.integers(256))
    elif kind == "bits":
        for _ in range(int(rng.integers(1, 9))):
            out[int(rng.integers(len(out)))] ^= 1 << int(rng.integers(8))
    elif kind == "truncate":
        del out[int(rng.integers(n)) :]
    elif kind == "splice":
        other = others[int(rng.integers(len(others)))]
        start, length = int(rng.integers(n)), int(rng.integers(1, 4096))
        at = int(rng.integers(max(1, len(other) - length)))
        out[start : start + length] = other[at : at + length]
    elif kind == "insert":
        at = int(rng.integers(n))
        out[at:at] = rng.integers(0, 256, int(rng.integers(1, 512)), dtype=np.uint8).tobytes()
    elif kind == "zero":
        start, length = int(rng.integers(n)), int(rng.integers(1, 2048))
        out[start : start + length] = bytes(len(out[start : start + length]))
    elif kind == "repeat":
        start = int(rng.integers(n))
        piece = out[start : start + int(rng.integers(1, 4096))]
        out[start:start] = piece * int(rng.integers(1, 4))
    else:
        return _mutate_dimensions(data, extension, rng)
    return bytes(out)


def _mutate_dimensions(data: bytes, extension: str, rng: np.random.Generator) -> bytes:
    """Another width and/or height in the header: zero, tiny, random or (one time in eight)
    huge: past max_pixels, or just under it."""
    out = bytearray(data)
    if extension == "jpg":
        found = _SOF.search(data)
        if found is None:
            return data
        offset = found.start() + 5  # marker, length (2), precision (1), then height, width
        fields, width, huge = [offset, offset + 2], 2, [9000, 9459, 16384, 65535]
    else:
        fields, width, huge = [16, 20], 4, [9000, 9459, 65536, 2**31 - 1, 2**32 - 1]
    for field_at in rng.permutation(fields)[: int(rng.integers(1, 3))]:
        if rng.random() < 0.125:
            value = int(rng.choice(huge))
        else:
            value = int(rng.choice([0, 1, 2, 7, 255, int(rng.integers(1, 4097))]))
        out[field_at : field_at + width] = value.to_bytes(width, "big")
    if extension == "png" and rng.random() < 0.7:  # Pillow checks the chunk's CRC: fix it, mostly
        out[29:33] = struct.pack(">I", zlib.crc32(bytes(out[12:29])))
    return bytes(out)


def mount_outcome(read: bytes | OSError, want: str | None, size: int) -> str:
    """What a read through the mount gave, against ``want`` (the sha256 of decode_image's
    pixels; None where it raises): SAME, EIO_AS_DECODE_FAILS, or a mismatch (an errno name,
    "DIFFERENT BYTES")."""
    if isinstance(read, OSError):
        name = errno_name(read)
        return EIO_AS_DECODE_FAILS if name == "EIO" and want is None else name
    header = npy_header(size)
    if len(read) != npy_file_size(size) or not read.startswith(header):
        return "DIFFERENT BYTES"
    got = hashlib.sha256(memoryview(read)[len(header) :]).hexdigest()
    return SAME if got == want else "DIFFERENT BYTES"


def write_fuzz_files(source: Path, count: int) -> list[tuple[Path, str]]:
    """``count`` originals under ``source``: the seeds, then seeded mutations of them."""
    seeds = fuzz_seeds()
    files: list[tuple[Path, str]] = []
    for i in range(count):
        name, extension, data = seeds[i % len(seeds)]
        rng = np.random.default_rng([6, i])
        kind = "unchanged"
        if i >= len(seeds):  # the first of each seed stays intact: the control
            data, kind = mutate(data, extension, rng, [s[2] for s in seeds])
        path = source / f"fz{i:05d}-{name}-{kind}.{extension}"
        path.write_bytes(data)
        files.append((path, kind))
    return files


def part_fuzz(h: Harness, sizes: Sizes) -> Part:
    part = Part("fuzz", "6. Fuzzed originals")
    size = 64
    source = h.directory("fuzz-originals")
    files = write_fuzz_files(source, sizes.fuzz_files)
    seeds = len(fuzz_seeds())

    # What decode_image says in this process, for every file.
    expected: dict[str, str | None] = {}
    other_exceptions: list[str] = []
    slowest_local = 0.0

    def local(path: Path) -> None:
        nonlocal slowest_local
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected[path.name] = pixels_digest(decode_image(path, size))
        except DecodeError:
            expected[path.name] = None
        except Exception as exc:  # decode_image promises DecodeError for a bad original
            expected[path.name] = None
            other_exceptions.append(f"{path.name}: {type(exc).__name__}: {exc}")
        slowest_local = max(slowest_local, time.perf_counter() - started)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(local, [p for p, _ in files]))

    d = h.daemon("fuzz", {VERSION: source}, sizes=[size])
    d.mount()
    idle = d.kib("VmRSS")
    d.reset_peak()
    outcomes: collections.Counter[str] = collections.Counter()
    mismatches: list[str] = []
    slowest, slowest_name = 0.0, ""
    lock = threading.Lock()

    def through_mount(path: Path) -> None:
        nonlocal slowest, slowest_name
        want = expected[path.name]
        started = time.perf_counter()
        read: bytes | OSError
        try:
            read = d.path(path.stem, size).read_bytes()
        except OSError as exc:
            read = exc
        outcome = mount_outcome(read, want, size)
        seconds = time.perf_counter() - started
        with lock:
            if seconds > slowest:
                slowest, slowest_name = seconds, path.name
            outcomes[outcome] += 1
            if outcome not in (SAME, EIO_AS_DECODE_FAILS):
                mismatches.append(f"{path.name}: mount {outcome}, decode_image "
                                  f"{'array' if want else 'DecodeError'}")  # fmt: skip

    started = time.monotonic()
    with Sampler(d) as sampler, concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(through_mount, path) for path, _ in files]
        for future in futures:
            try:
                future.result(timeout=READ_TIMEOUT + 600)
            except concurrent.futures.TimeoutError:
                part.check(False, "a read did not return: killing the daemon")
                d.kill9()
                break
    seconds = time.monotonic() - started
    alive = d.alive()
    deaths = outcomes["ENOTCONN"] + outcomes["ECONNABORTED"]
    peak = d.kib("VmHWM") if alive else sampler.rss_kib
    stats = d.stats() if alive else {}
    kinds = collections.Counter(kind for _, kind in files)
    decoded = sum(1 for v in expected.values() if v is not None)
    errors_logged = d.errors_logged()
    part.say(
        f"{len(files):,} originals: {seeds} real photographs from skimage.data "
        "(at most 160x160) encoded as JPEG (baseline, progressive, 4:4:4, gray, CMYK) and PNG "
        "(RGB, palette, gray, RGBA, 16-bit), the first of each left intact and every other one "
        "mutated from a seeded numpy RNG (reproducible: `np.random.default_rng([6, i])`): "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(kinds.items()))
        + '. "dimensions" rewrites the header\'s width and/or height (JPEG SOF, PNG IHDR '
        "with its CRC fixed 70% of the time) to 0, tiny, random, or one time in eight huge "
        "(past max_pixels, or just under it). Each "
        f"is read once through the mount at size {size} (two reader threads) and compared with "
        f"`decode_image` of the same file in this process ({decoded:,} decode, "
        f"{len(files) - decoded:,} raise DecodeError)."
    )
    part.table(
        ["figure", "value"],
        [
            ["outcomes through the mount",
             ", ".join(f"{k} {v:,}" for k, v in sorted(outcomes.items()))],
            ["mismatches with decode_image", f"{len(mismatches)}"],
            ["decode_image raising something other than DecodeError", f"{len(other_exceptions)}"],
            ["daemon deaths", f"{deaths}" + ("" if alive else " (the daemon is gone)")],
            [f"slowest read through the mount (hang bound {READ_TIMEOUT:.0f} s)",
             f"{slowest:.2f} s ({slowest_name})"],
            ["slowest decode_image in process", f"{slowest_local:.2f} s"],
            ["wall time", f"{seconds:.0f} s"],
            ["daemon RSS idle / peak (bound)", f"{mib(idle)} / {mib(peak)} ({mib(BOUND_KIB)})"],
            ["decode_errors / decode_memory_waits (stats)",
             f"{stats.get('decode_errors', '-')} / {stats.get('decode_memory_waits', '-')}"],
            ["ERROR lines in the daemon log", f"{len(errors_logged)}"],
        ],
    )  # fmt: skip
    if mismatches or other_exceptions:
        part.say("Mismatches: " + "; ".join((mismatches + other_exceptions)[:10]))
    part.check(sum(outcomes.values()) == len(files), f"{sum(outcomes.values())} reads counted")
    part.check(not mismatches, f"{len(mismatches)} mismatches, e.g. {mismatches[:3]}")
    part.check(not other_exceptions, f"decode_image raised: {other_exceptions[:3]}")
    part.check(deaths == 0 and alive, "the daemon died")
    part.check(slowest < READ_TIMEOUT, f"a read took {slowest:.0f} s")
    part.check(peak <= BOUND_KIB, f"peak RSS {mib(peak)} above the bound")
    part.check(not errors_logged, f"daemon logged errors: {errors_logged[:3]}")
    part.figures.update(
        files=len(files), outcomes=dict(outcomes), mismatches=len(mismatches),
        other_exceptions=len(other_exceptions), deaths=deaths, alive=alive,
        slowest_read=slowest, peak_kib=peak, bound_kib=BOUND_KIB,
    )  # fmt: skip
    return part
