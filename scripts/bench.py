"""Side-by-side throughput of decodefs on one corpus, in one run.

On generated ~12 MP photo-like JPEGs, decoded to --size:
  live decode        decode_image() in this process, one thread (and with draft = true)
  misses             a bare thread pool of decode_image(), then epoch 1 through a cold
                     mount (--workers reader threads) with the daemon's pool of that size,
                     at 1 and at --workers; --miss-rounds rounds, ratios the pairs' median
  hits               plain np.load through the mount, read_array() (the project's reader),
                     and np.load of the same entry files straight from the store; one
                     reader, then 4 reader processes
Hit rates are measured in interleaved rounds (direct, mount, read_array, direct, ...)
and reported as medians, so the ratios compare like with like on a noisy machine.

    .venv/bin/python scripts/bench.py [--count 24] [--size 224] [--workers N] [--miss-rounds 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import PIL
from benchlib import VERSION, WORK, mounted

from decodefs import DecodeSettings, decode_image, npy_bytes, read_array
from decodefs.sample import make_sample_corpus


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=24, help="originals in the corpus")
    parser.add_argument("--width", type=int, default=4000)
    parser.add_argument("--height", type=int, default=3000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--rounds", type=int, default=9, help="interleaved rounds of hit measurements"
    )
    parser.add_argument(
        "--readers", type=int, default=4, help="reader processes for the parallel figure"
    )
    parser.add_argument(
        "--miss-rounds", type=int, default=5, help="rounds of bare pool, then misses via mount"
    )
    args = parser.parse_args()

    originals = WORK / f"originals-{args.width}x{args.height}"
    print(
        f"corpus: {args.count} JPEGs of {args.width}x{args.height} under {originals}",
        file=sys.stderr,
    )
    paths = make_sample_corpus(originals, args.count, args.width, args.height, seed=1)
    for path in paths:
        path.read_bytes()  # page-cached for every contender alike
    rates: dict[str, float] = {}
    live(paths, args, rates)
    misses(paths, originals, args, rates)
    hits(paths, originals, args, rates)
    print(render(rates, args))


def live(paths: list[Path], args: argparse.Namespace, rates: dict[str, float]) -> None:
    rates["live decode, 1 thread"] = rate(
        len(paths), lambda: [decode_image(p, args.size) for p in paths]
    )
    draft = DecodeSettings(draft=True)  # the opt-in reduced-DCT decode (other pixels)
    rates["live decode, 1 thread, draft = true"] = rate(
        len(paths), lambda: [decode_image(p, args.size, draft) for p in paths]
    )


def misses(
    paths: list[Path], originals: Path, args: argparse.Namespace, rates: dict[str, float]
) -> None:
    """Per round and pool size: the bare pool, then epoch 1 through a fresh mount."""
    samples: dict[str, list[float]] = {}
    for _ in range(args.miss_rounds):
        for workers in sorted({1, args.workers}):
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                bare = rate(
                    len(paths),
                    functools.partial(decode_all, pool, paths, args.size),
                )
            with mounted(originals, [args.size], settings={"decode_workers": workers}) as bench:
                entries = [bench.arrays(args.size) / f"{p.stem}.npy" for p in paths]
                with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
                    mount = rate(len(entries), functools.partial(load_with, pool, entries))
            for name, value in (
                (f"bare decode pool of {workers}", bare),
                (f"misses via mount, daemon pool of {workers}", mount),
                (f"misses / bare, pool of {workers}", mount / bare),
            ):
                samples.setdefault(name, []).append(value)
    for name, values in samples.items():
        rates[name] = statistics.median(values)


def hits(
    paths: list[Path], originals: Path, args: argparse.Namespace, rates: dict[str, float]
) -> None:
    with mounted(originals, [args.size], settings={"decode_workers": args.workers}) as bench:
        entries = [str(bench.arrays(args.size) / f"{p.stem}.npy") for p in paths]
        stored = [
            str(bench.store / VERSION / str(args.size) / p.stem[:2] / f"{p.stem}.npy")
            for p in paths
        ]
        for path in entries:
            np.load(path)  # decode, store, and fill the mount's page cache
        for path in stored:
            np.load(path)
        read_array(entries[0])  # the reader's mount context
        contenders: dict[str, Callable[[], object]] = {
            "direct store, np.load": lambda: [np.load(p) for p in stored],
            "hits via mount, np.load": lambda: [np.load(p) for p in entries],
            "hits via mount, read_array": lambda: [read_array(p) for p in entries],
        }
        passes = max(1, 480 // len(entries))
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, work in contenders.items():
                samples[name].append(
                    rate(len(entries) * passes, functools.partial(repeat, work, passes))
                )
        for name, values in samples.items():
            rates[f"{name}, 1 reader"] = statistics.median(values)

        for name, files in [
            ("direct store, np.load", stored),
            ("hits via mount, np.load", entries),
        ]:
            rates[f"{name}, {args.readers} reader processes"] = parallel_rate(files, args.readers)
        check = [
            np.array_equal(read_array(e), decode_image(p, args.size))
            for e, p in zip(entries[:3], paths, strict=False)
        ]
        assert all(check), "the mount served different pixels than the live decode"


def repeat(work: Callable[[], object], times: int) -> None:
    for _ in range(times):
        work()


def decode_all(pool: concurrent.futures.Executor, paths: list[Path], size: int) -> None:
    list(pool.map(lambda p: npy_bytes(decode_image(p, size)), paths))


def load_with(pool: concurrent.futures.Executor, files: list[Path]) -> None:
    list(pool.map(np.load, files))


def parallel_rate(files: list[str], readers: int, seconds: float = 3.0) -> float:
    with multiprocessing.get_context("fork").Pool(readers) as pool:
        counts = pool.starmap(_load_for, [(files, seconds)] * readers)
    return sum(counts) / seconds


def _load_for(files: list[str], seconds: float) -> int:
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for path in files:
            np.load(path)
        count += len(files)
    return count


def rate(items: int, work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return items / (time.perf_counter() - started)


def render(rates: dict[str, float], args: argparse.Namespace) -> str:
    w, r = args.workers, args.readers
    live = rates["live decode, 1 thread"]
    direct = rates["direct store, np.load, 1 reader"]
    plain = rates["hits via mount, np.load, 1 reader"]
    own = rates["hits via mount, read_array, 1 reader"]
    ratios = [
        (
            "hits via mount, np.load / direct store np.load (the FUSE tax)",
            f"{plain / direct:.2f}x",
            ">= 0.35x",
        ),
        ("hits via mount, read_array / direct store np.load", f"{own / direct:.2f}x", ">= 0.9x"),
        (
            f"hits via mount, np.load, {r} reader processes",
            f"{rates[f'hits via mount, np.load, {r} reader processes']:,.0f}/s",
            ">= 5,000/s",
        ),
        ("epoch-2 hits (np.load) / live decode", f"{plain / live:,.0f}x", ">= 400x"),
        ("epoch-2 hits (read_array) / live decode", f"{own / live:,.0f}x", ">= 1000x"),
    ]
    for workers in sorted({1, w}):
        ratios.append(
            (
                f"misses via mount / bare decode pool, {workers} worker(s) (paired)",
                f"{rates.pop(f'misses / bare, pool of {workers}'):.2f}x",
                ">= 0.9x",
            )
        )
    if w > 1:
        scaling = (
            rates[f"misses via mount, daemon pool of {w}"]
            / rates["misses via mount, daemon pool of 1"]
        )
        bare_scaling = rates[f"bare decode pool of {w}"] / rates["bare decode pool of 1"]
        ratios.append(
            (
                f"miss scaling, {w} workers / 1 (bare pool: {bare_scaling:.2f}x)",
                f"{scaling:.2f}x",
                "with the cores",
            )
        )
    lines = [
        f"{args.count} JPEGs of {args.width}x{args.height} -> {args.size}x{args.size}; "
        f"{os.cpu_count()} cores; "
        f"Python {platform.python_version()}, Pillow {PIL.__version__}, numpy {np.__version__}; "
        f"hit rates: medians of {args.rounds} interleaved rounds; "
        f"misses: medians of {args.miss_rounds} rounds, each beside the bare pool",
        "",
        "| measurement | arrays/s |",
        "| --- | ---: |",
        *(f"| {name} | {value:,.1f} |" for name, value in rates.items()),
        "",
        "| figure | measured | target |",
        "| --- | ---: | ---: |",
        *(f"| {name} | {value} | {target} |" for name, value, target in ratios),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
