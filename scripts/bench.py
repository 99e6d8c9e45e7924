"""Side-by-side throughput of decodefs on one corpus, in one run.

Measures, on generated ~12 MP photo-like JPEGs:
  live decode        decode_image() in this process, one thread and a pool of `--workers`
  epoch 1 (misses)   np.load through a cold mount, `--workers` reader threads
  epoch 2 (hits)     np.load through the mount, one reader, page cache warm
  direct store       np.load of the same entries straight from the store directory
and prints a Markdown table of rates and the ratios that matter.

    .venv/bin/python scripts/bench.py [--count 24] [--size 224] [--workers N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import PIL

from decodefs import decode_image
from decodefs.sample import make_sample_corpus

DEFAULT_CORPUS = Path(tempfile.gettempdir()) / "decodefs-bench"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=24, help="originals in the corpus")
    parser.add_argument("--width", type=int, default=4000)
    parser.add_argument("--height", type=int, default=3000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="decode pool and readers"
    )
    parser.add_argument(
        "--hit-passes", type=int, default=40, help="passes over the corpus for hit rates"
    )
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_CORPUS)
    args = parser.parse_args()

    originals = args.work_dir / f"originals-{args.width}x{args.height}"
    print(
        f"corpus: {args.count} JPEGs of {args.width}x{args.height} under {originals}",
        file=sys.stderr,
    )
    paths = make_sample_corpus(originals, args.count, args.width, args.height, seed=1)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=args.work_dir))
    try:
        rows = measure(paths, originals, run_dir, args)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(render(rows, args))


def measure(
    paths: list[Path], originals: Path, run_dir: Path, args: argparse.Namespace
) -> dict[str, float]:
    size, workers = args.size, args.workers
    rates: dict[str, float] = {}

    for path in paths[:2]:  # warm the originals into the page cache, like epoch 1 will find them
        path.read_bytes()
    for path in paths:
        path.read_bytes()
    rates["live decode, 1 thread"] = rate(
        len(paths), lambda: [decode_image(p, size) for p in paths]
    )
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        rates[f"live decode, pool of {workers}"] = rate(
            len(paths), lambda: list(pool.map(lambda p: decode_image(p, size), paths))
        )

    mountpoint, store = run_dir / "mnt", run_dir / "store"
    mountpoint.mkdir()
    config = run_dir / "config.toml"
    config.write_text(
        f'store = "{store}"\ndecode_workers = {workers}\n'
        f'[versions.bench]\nsource = "{originals}"\nsizes = [{size}]\n'
    )
    decodefs = [sys.executable, "-m", "decodefs"]
    subprocess.run(
        [*decodefs, "mount", mountpoint, "--config", config, "--log-file", run_dir / "daemon.log"],
        check=True,
    )
    try:
        entries = [mountpoint / "bench" / str(size) / f"{p.stem}.npy" for p in paths]
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            rates[f"epoch 1 via mount (misses), {workers} readers"] = rate(
                len(entries), lambda: list(pool.map(np.load, entries))
            )
        load_all(entries)  # the first hit of each file in this mount fills the kernel's page cache
        rates["epoch 2 via mount (hits), np.load"] = rate(
            len(entries) * args.hit_passes,
            lambda: load_all(entries, args.hit_passes),
        )
        stored = [store / "bench" / str(size) / p.stem[:2] / f"{p.stem}.npy" for p in paths]
        load_all(stored)
        rates["direct store (np.load of the entry files)"] = rate(
            len(stored) * args.hit_passes,
            lambda: load_all(stored, args.hit_passes),
        )
        check = [
            np.array_equal(np.load(e), decode_image(p, size))
            for e, p in zip(entries[:3], paths, strict=False)
        ]
        assert all(check), "mount served different pixels than the live decode"
    finally:
        subprocess.run([*decodefs, "umount", mountpoint], check=False)
    return rates


def load_all(paths: list[Path], passes: int = 1) -> None:
    for _ in range(passes):
        for path in paths:
            np.load(path)


def rate(items: int, work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return items / (time.perf_counter() - started)


def render(rates: dict[str, float], args: argparse.Namespace) -> str:
    live = rates["live decode, 1 thread"]
    pool = rates[f"live decode, pool of {args.workers}"]
    epoch1 = rates[f"epoch 1 via mount (misses), {args.workers} readers"]
    hits = rates["epoch 2 via mount (hits), np.load"]
    direct = rates["direct store (np.load of the entry files)"]
    lines = [
        f"{args.count} JPEGs of {args.width}x{args.height} -> {args.size}x{args.size}; "
        f"{os.cpu_count()} cores; Python {platform.python_version()}, Pillow {PIL.__version__}, "
        f"numpy {np.__version__}",
        "",
        "| measurement | arrays/s |",
        "| --- | ---: |",
        *(f"| {name} | {value:,.1f} |" for name, value in rates.items()),
        "",
        "| ratio | value |",
        "| --- | ---: |",
        f"| epoch-2 hits via mount / live decode (1 thread) | {hits / live:,.0f}x |",
        f"| epoch-2 hits via mount / direct store np.load (FUSE tax) | {hits / direct:.2f}x |",
        f"| epoch-1 misses via mount / live decode pool of {args.workers} (daemon tax) "
        f"| {epoch1 / pool:.2f}x |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
