"""Part 2, memory: processes holding arrays open at max_size, stored and cold, and one huge
PNG, against the daemon's memory budgets. The opens of arrays the store does not take are
fallback.py's; this module knows no other part."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import multiprocessing
import os
import queue
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Final

from PIL import Image

from decodefs import decode_image, npy_file_size, npy_header
from decodefs.sample import make_sample_corpus
from tests.helpers import SKIMAGE_DATA, decodefs

from .checks import Reference, Tally
from .fallback import memory_fallback
from .harness import (
    BOUND_KIB,
    DEFAULT_DECODE_MEMORY,
    DEFAULT_MEMORY_CACHE,
    MAX_SIZE,
    MIB,
    RSS_CONSTANT,
    VERSION,
    Daemon,
    Harness,
    Part,
    Sampler,
    Sizes,
    mib,
)

_CHUNK: Final = 128 * 1024
# How close to idle the daemon's RSS must come back once a huge decode is done.
_GIVEN_BACK_KIB: Final = 64 * 1024


@dataclass(frozen=True)
class HoldJob:
    paths: list[str]
    seed: int


@dataclass
class HoldResult:
    held: int
    errors: list[str]
    chunks: list[tuple[str, int, str]]  # (path, offset, sha256 of the 128 KiB read there)
    slowest_open: float


def hostile_holder(
    job: HoldJob, opened: Queue[int], release: Event, results: Queue[HoldResult]
) -> None:
    """Open every path and read 128 KiB of each at a random offset, holding all of them
    open until told to let go."""
    rng = random.Random(job.seed)
    fds, errors, chunks, slowest = [], [], [], 0.0
    for path in job.paths:
        started = time.perf_counter()
        try:
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            offset = rng.randrange(os.fstat(fd).st_size // _CHUNK) * _CHUNK
            chunks.append((path, offset, hashlib.sha256(os.pread(fd, _CHUNK, offset)).hexdigest()))
        except OSError as exc:
            errors.append(f"{path}: {exc}")
        slowest = max(slowest, time.perf_counter() - started)
    opened.put(job.seed)
    release.wait(timeout=3600)
    for fd in fds:
        os.close(fd)
    results.put(HoldResult(len(fds), errors, chunks, slowest))


@dataclass
class HoldPhase:
    label: str
    opens: int
    held: int
    errors: list[str]
    wrong_chunks: int
    chunks: int
    peak_kib: int
    held_kib: int
    memory_bytes: int
    decode_memory_bytes: int
    memory_waits: int
    decode_memory_waits: int
    slowest_open: float
    hung: bool = False


def _gather(source: Queue[Any], count: int, deadline: float) -> list[Any]:
    """Up to ``count`` items from ``source``, waiting until the monotonic ``deadline``."""
    found: list[Any] = []
    while len(found) < count:
        try:
            found.append(source.get(timeout=max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            break
    return found


def hold_phase(
    d: Daemon,
    label: str,
    per_process: Sequence[Sequence[Path]],
    originals: Mapping[str, Path],
    size: int,
    deadline: float,
) -> HoldPhase:
    """Every process opens its arrays and holds them until all have; then all let go."""
    context = multiprocessing.get_context("fork")
    opened: Queue[int] = context.Queue()
    results: Queue[HoldResult] = context.Queue()
    release = context.Event()
    before = d.stats()
    d.reset_peak()
    holders = [
        context.Process(
            target=hostile_holder,
            args=(HoldJob([str(p) for p in paths], seed), opened, release, results),
            daemon=True,
        )
        for seed, paths in enumerate(per_process)
    ]
    for holder in holders:
        holder.start()
    with Sampler(d, stats=True) as sampler:
        end = time.monotonic() + deadline
        ready = _gather(opened, len(holders), end)
        held_kib = d.kib("VmRSS")
        hung = len(ready) < len(holders)
        if hung:
            d.kill9()  # the only way to free readers blocked in open (see docs)
        release.set()
        done: list[HoldResult] = _gather(results, len(holders), end + 60)
    for holder in holders:
        holder.join(timeout=10)
        if holder.is_alive():
            holder.kill()
    after = d.stats() if d.alive() else before
    # Check every chunk read against the reference decode (one original at a time).
    wrong = checked = 0
    by_original: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for r in done:
        for path, offset, digest in r.chunks:
            by_original[Path(path).stem].append((offset, digest))
    for uuid, reads in by_original.items():
        data = npy_header(size) + decode_image(originals[uuid], size).tobytes()
        for offset, digest in reads:
            checked += 1
            wrong += hashlib.sha256(data[offset : offset + _CHUNK]).hexdigest() != digest
    return HoldPhase(
        label=label,
        opens=sum(len(p) for p in per_process),
        held=sum(r.held for r in done),
        errors=[e for r in done for e in r.errors],
        wrong_chunks=wrong,
        chunks=checked,
        peak_kib=d.kib("VmHWM") if d.alive() else sampler.rss_kib,
        held_kib=held_kib,
        memory_bytes=sampler.memory_bytes,
        decode_memory_bytes=sampler.decode_memory_bytes,
        memory_waits=after["memory_waits"] - before["memory_waits"],
        decode_memory_waits=after["decode_memory_waits"] - before["decode_memory_waits"],
        slowest_open=max((r.slowest_open for r in done), default=0.0),
        hung=hung,
    )


def check_phase(part: Part, phase: HoldPhase) -> None:
    part.check(not phase.hung, f"{phase.label}: opens did not complete (hang)")
    part.check(not phase.errors, f"{phase.label}: {phase.errors[:3]}")
    part.check(phase.wrong_chunks == 0, f"{phase.label}: {phase.wrong_chunks} wrong reads")
    part.check(phase.chunks == phase.held, f"{phase.label}: {phase.chunks} of {phase.held} checked")
    part.check(phase.held == phase.opens, f"{phase.label}: {phase.held} of {phase.opens} held")
    part.check(
        phase.peak_kib <= BOUND_KIB, f"{phase.label}: peak RSS {mib(phase.peak_kib)} > bound"
    )


def big_png(path: Path, side: int) -> Path:
    """A side x side photograph (skimage's astronaut, scaled up), as a PNG."""
    astronaut = Image.open(SKIMAGE_DATA / "astronaut.png").convert("RGB")
    image = astronaut.resize((side, side), Image.Resampling.BILINEAR)
    image.save(path, compress_level=1)
    return path


def part_memory(h: Harness, sizes: Sizes) -> Part:
    part = Part("memory", "2. Memory under hostile opens")
    size = sizes.hostile_size
    count = sizes.hostile_stored + sizes.hostile_cold
    source = h.directory("memory-originals")
    paths = make_sample_corpus(source, count, 256, 192, seed=21)
    originals = {p.stem: p for p in paths}
    stored, cold = paths[: sizes.hostile_stored], paths[sizes.hostile_stored :]
    big_dir = h.directory("memory-big")
    big = big_png(big_dir / "big.png", sizes.big_png)
    d = h.daemon(
        "memory",
        {VERSION: source, "big": big_dir},
        sizes=[224],
        max_size=size,
        memory_cache_bytes=DEFAULT_MEMORY_CACHE,
        decode_memory_bytes=DEFAULT_DECODE_MEMORY,
    )
    d.mount()
    idle = d.kib("VmRSS")

    # One large original: Pillow's pixels take 8 bytes each while it decodes.
    d.reset_peak()
    tally = Tally()
    with Sampler(d) as sampler:
        tally.check("open().read()", d.path("big", 224, "big"), 224, Reference().digest(big, 224))
        big_peak = d.kib("VmHWM")
        sampler.mark()
        settled_at = time.monotonic()
        big_after = part.wait(sampler.settled, 30, "the daemon's RSS to settle after the PNG")
        settled_in = time.monotonic() - settled_at
    big_after = big_after or d.kib("VmRSS")

    uuids = "".join(f"{p.stem}\n" for p in stored)
    (h.root / "memory-stored.txt").write_text(uuids)
    warmed = decodefs(
        "warm", d.mountpoint, VERSION, size, "--keys", h.root / "memory-stored.txt", timeout=600
    )
    part.check(warmed.returncode == 0, f"decodefs warm failed: {warmed.stderr.strip()}")
    rng = random.Random(2)

    def choose(pool: Sequence[Path]) -> list[list[Path]]:
        """hostile_open arrays per process, from a random place in the pool on."""
        chosen = []
        for _ in range(sizes.hostile_processes):
            start = rng.randrange(len(pool))
            chosen.append(
                [
                    d.path(pool[(start + j) % len(pool)].stem, size)
                    for j in range(sizes.hostile_open)
                ]
            )
        return chosen

    deadline = 120 + 2.0 * count
    phases = [
        hold_phase(d, "stored entries", choose(stored), originals, size, deadline),
        hold_phase(d, "cold entries (decoded, stored)", choose(cold), originals, size, deadline),
    ]
    part.say(
        f"{sizes.hostile_processes} processes each open {sizes.hostile_open} arrays at "
        f"max_size = {size} (the default max_size is {MAX_SIZE}; "
        f"{npy_file_size(size) / MIB:.0f} MiB each; originals are JPEGs of "
        "256x192) and read 128 KiB of each at a random offset, holding all of them open until "
        "every process has opened its own; then all close. Stored: a pool of "
        f"{len(stored)} arrays stored beforehand; cold: a pool of {len(cold)} never read before "
        "(every process starts at a random place in the pool, so most arrays have several "
        "openers). Default budgets: memory_cache_bytes = 512 MiB, decode_memory_bytes = 1 GiB; "
        f"the bound is their sum plus {RSS_CONSTANT // MIB} MiB = {mib(BOUND_KIB)}. "
        f"Idle daemon after mounting: {mib(idle)}. Every 128 KiB read is compared with the "
        "same bytes of `decode_image` + the .npy header."
    )
    for phase in phases:
        check_phase(part, phase)
    part.table(
        ["opens of", "held open", "errors", "wrong reads", "RSS with all held", "peak RSS",
         "memory_bytes peak", "memory / decode memory waits", "slowest open"],
        [[p.label, f"{p.held:,} of {p.opens:,}", len(p.errors), f"{p.wrong_chunks} of {p.chunks:,}",
          mib(p.held_kib), mib(p.peak_kib), f"{p.memory_bytes / MIB:,.0f} MiB",
          f"{p.memory_waits:,} / {p.decode_memory_waits:,}", f"{p.slowest_open:.1f} s"]
         for p in phases],
    )  # fmt: skip
    peak_pixels = 8 * sizes.big_png**2
    part.table(
        [f"one PNG of {sizes.big_png}x{sizes.big_png} -> 224", "value"],
        [
            ["read through the mount", tally.summary()],
            ["decode memory it takes (8 bytes a pixel)", f"{peak_pixels / MIB:,.0f} MiB"],
            ["daemon RSS idle / peak / once steady (20 ms samples within 1 MiB)",
             f"{mib(idle)} / {mib(big_peak)} / {mib(big_after)} ({settled_in:.1f} s after)"],
        ],
    )  # fmt: skip
    part.check(tally.outcomes["ok"] == 1, f"big PNG: {tally.summary()}")
    part.check(big_peak <= BOUND_KIB, f"big PNG: peak {mib(big_peak)} above the bound")
    part.check(
        big_after <= idle + _GIVEN_BACK_KIB,
        f"big PNG: RSS stayed at {mib(big_after)} after the decode (idle {mib(idle)})",
    )
    errors_logged = d.errors_logged()
    part.check(not errors_logged, f"daemon logged errors: {errors_logged[:3]}")
    part.figures.update(
        idle_kib=idle,
        bound_kib=BOUND_KIB,
        big_peak_kib=big_peak,
        big_after_kib=big_after,
        phases=[dataclasses.asdict(p) for p in phases],
    )
    if sizes.hostile_fallback:
        memory_fallback(h, part, sizes, source, cold)
    return part
