"""Adopting an existing cache against decoding the same arrays, side by side in one run.

On generated photo-like JPEGs (--count, --width x --height), each under --names
names (hard links: one source of count x names originals), decoded to --size:
  decode          decode_image of each distinct original in a pool of --workers threads,
                  the array np.save'd as a team's cache does (<cache>/<version>/<size>/
                  <uu>/<uuid>.npy): what rebuilding the cache, or a cold first epoch, costs
  adopt (move)    `decodefs adopt --move` of that cache into a fresh store on the same filesystem:
                  the files are the store user's alone, so each is moved (trailer appended,
                  renamed in)
  adopt (copy)    `decodefs adopt` (it copies by default) of a copy of that cache into another
                  fresh store
Each adopt runs as a user runs it (the command, start to end, index scan included,
on a cache flushed to disk first, as an old cache is),
once with --sample 1 (the import alone) and once with the default sample of 300
(capped at the corpus), whose decodes are the check's cost.

    .venv/bin/python scripts/bench_adopt.py [--count 300] [--size 224] [--workers N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import PIL
from benchlib import DECODEFS, VERSION, WORK, BenchMount

from decodefs import decode_image
from decodefs.sample import make_sample_corpus


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=300, help="originals in the corpus")
    parser.add_argument("--width", type=int, default=1800)
    parser.add_argument("--height", type=int, default=1200)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--names", type=int, default=10, help="names (hard links) per original")
    args = parser.parse_args()

    corpus = WORK / f"train-{args.count}-{args.width}x{args.height}"  # shared with train_example
    print(f"corpus: {args.count} JPEGs of {args.width}x{args.height}", file=sys.stderr)
    paths = make_sample_corpus(corpus, args.count, args.width, args.height, seed=2)
    for path in paths:
        path.read_bytes()  # page-cached for every contender alike
    run = Path(tempfile.mkdtemp(prefix="adopt-", dir=WORK))
    seconds: dict[str, float] = {}
    try:
        source = run / "originals"
        source.mkdir()
        names = {p: [f"{p.stem[:-2]}{i:02d}" for i in range(args.names)] for p in paths}
        for path, aliases in names.items():
            for alias in aliases:
                os.link(path, source / f"{alias}.jpg")
        cache = run / "cache"
        started = time.perf_counter()
        arrays = decode_all(paths, args.size, args.workers, cache, names)
        seconds["decode + np.save"] = time.perf_counter() - started
        write_aliases(arrays, cache, args.size, names)
        spare = run / "spare"
        shutil.copytree(cache, spare)
        for sample in (1, 300):
            for mode in ("move", "copy"):
                given = run / f"cache-{mode}-{sample}"
                shutil.copytree(spare, given)
                os.sync()  # an old cache is on disk, not dirty in memory
                label = f"adopt ({mode}), --sample {sample}"
                print(label, file=sys.stderr)
                seconds[label] = adopt(source, given, args.size, sample, mode == "copy")
        print(render(seconds, args))
    finally:
        shutil.rmtree(run, ignore_errors=True)


def decode_all(
    paths: list[Path], size: int, workers: int, cache: Path, names: dict[Path, list[str]]
) -> dict[Path, npt.NDArray[np.uint8]]:
    """Each distinct original decoded and saved under its first name, in a thread pool."""

    def one(path: Path) -> npt.NDArray[np.uint8]:
        array = decode_image(path, size)
        save(cache, size, names[path][0], array)
        return array

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return dict(zip(paths, pool.map(one, paths), strict=True))


def write_aliases(
    arrays: dict[Path, npt.NDArray[np.uint8]], cache: Path, size: int, names: dict[Path, list[str]]
) -> None:
    """The same array under the original's other names (the same pixels, as decode gives)."""
    for path, array in arrays.items():
        for alias in names[path][1:]:
            save(cache, size, alias, array)


def save(cache: Path, size: int, uuid: str, array: npt.NDArray[np.uint8]) -> None:
    target = cache / VERSION / str(size) / uuid[:2] / f"{uuid}.npy"
    target.parent.mkdir(parents=True, exist_ok=True)
    np.save(target, array)


def adopt(source: Path, cache: Path, size: int, sample: int, copy: bool) -> float:
    """Seconds of one `decodefs adopt` into a fresh store (checked: everything adopted)."""
    bench = BenchMount(source, [size])
    try:
        command = [
            *DECODEFS,
            "adopt",
            str(cache),
            VERSION,
            str(size),
            "--config",
            str(bench.config),
        ]
        command += ["--sample", str(sample), *([] if copy else ["--move"])]
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        elapsed = time.perf_counter() - started
        if result.returncode != 0:
            raise SystemExit(f"adopt failed: {result.stderr}")
        moved, copied = (
            int(re.findall(rf"([\d,]+) {word}", result.stdout)[0].replace(",", ""))
            for word in ("moved", "copied")
        )
        if (copied if copy else moved) == 0:
            raise SystemExit(f"adopt did not {'copy' if copy else 'move'}: {result.stdout}")
        return elapsed
    finally:
        bench.remove()


def render(seconds: dict[str, float], args: argparse.Namespace) -> str:
    entries = args.count * args.names
    decode_rate = args.count / seconds["decode + np.save"]
    lines = [
        f"corpus: {args.count} photo-like JPEGs of {args.width}x{args.height}, each under "
        f"{args.names} names ({entries:,} originals), decoded to {args.size}; decode pool of "
        f"{args.workers} threads; Pillow {PIL.__version__}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "",
        "| contender | entries | seconds | entries/s | vs decode |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| decode + np.save | {args.count:,} | {seconds['decode + np.save']:.2f} | "
        f"{decode_rate:,.1f} | 1.0x |",
    ]
    for name, value in seconds.items():
        if name.startswith("adopt"):
            rate = entries / value
            lines.append(
                f"| `decodefs {name[:5]}` {name[6:]}, the whole command | {entries:,} | "
                f"{value:.2f} | {rate:,.0f} | {rate / decode_rate:.0f}x |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
