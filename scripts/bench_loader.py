"""Batches of stored arrays in a training process: DataLoader workers against BatchLoader threads.

One run, one corpus: --count photo-like JPEGs decoded to --size and stored once by
``decodefs warm`` (the corpus and store are kept under the bench directory and
reused while complete), every array page-cached before the first round. Then
--rounds rounds, each contender once per round in a fresh order (interleaved, so
a drift of the machine's load touches all alike), each reading --epochs shuffled
epochs of every array in batches of --batch:

  constant     a DataLoader with --workers workers whose dataset returns one
               constant array: the ceiling of any dataset in such a DataLoader
  mount        MountDataset in a DataLoader with --workers persistent workers and
               collate_uint8 (what docs/pytorch.md shows)
  threads-N    BatchLoader over the same MountDataset with N threads (--threads)
  read_array   read_array of every array in one thread, nothing else

Reported: arrays/s of epochs 2+ (the median over rounds), and each as a ratio to
``mount``. Every contender's batches are checked once against read_array's arrays.

Then cold first epochs (--cold originals, a fresh store for each contender, so
every read is a miss the daemon decodes): ``mount`` and BatchLoader with each
thread count, to show how misses scale with threads.

    flock /tmp/decodefs-heavy.lock .venv/bin/python scripts/bench_loader.py \\
        [--count 2000] [--size 224] [--batch 64] [--workers 2] [--threads 1 2 4 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from benchlib import DECODEFS, VERSION, WORK, BenchMount
from torch.utils.data import DataLoader, Dataset

from decodefs import list_keys, read_array
from decodefs.sample import make_sample_corpus
from decodefs.torch import BatchLoader, MountDataset, collate_uint8

Epoch = Callable[[], int]  # reads one epoch, returns the number of arrays


class Constant(Dataset[tuple[npt.NDArray[np.uint8], str]]):
    """The ceiling: a dataset that reads nothing."""

    def __init__(self, count: int, size: int) -> None:
        self.count = count
        self.array = np.zeros((size, size, 3), np.uint8)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[npt.NDArray[np.uint8], str]:
        return self.array, "constant"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--epochs", type=int, default=3, help="per contender and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", type=int, default=300, help="originals of the cold epochs")
    args = parser.parse_args()
    torch.set_num_threads(1)

    originals = WORK / f"loader-originals-{args.count}"
    make_sample_corpus(originals, args.count, 640, 480, seed=20)
    store = WORK / f"loader-store-{args.count}"
    bench = BenchMount(originals, [args.size], store=store)
    try:
        bench.mount()
        keys = list_keys(bench.mountpoint, VERSION, args.size)
        assert len(keys) == args.count, f"{len(keys)} keys for {args.count} originals"
        if bench.stats()["store_entries"] < args.count:
            print(f"filling {store} with decodefs warm ...", flush=True)
            subprocess.run(
                [*DECODEFS, "warm", bench.mountpoint, VERSION, str(args.size)], check=True
            )
        run(bench, keys, args)
    finally:
        bench.remove()  # the store is outside the run directory: kept for the next run
    cold(originals, args)


def cold(originals: Path, args: argparse.Namespace) -> None:
    """A first epoch over a fresh store, per contender: every array a miss."""
    names = sorted(originals.rglob("*.jpg"))[: args.cold]
    subset = WORK / f"loader-cold-{args.cold}"
    if not subset.exists():
        subset.mkdir()
        for path in names:
            (subset / path.name).hardlink_to(path)  # a symlink out of the source is no original
    rates = {}
    for name in ["mount", *(f"threads-{n}" for n in args.threads)]:
        bench = BenchMount(subset, [args.size])  # its store in its own run directory
        try:
            bench.mount()
            keys = list_keys(bench.mountpoint, VERSION, args.size)
            dataset = MountDataset(bench.mountpoint, VERSION, args.size, keys)
            loader: Iterable[tuple[torch.Tensor, Any]]
            if name == "mount":
                loader = DataLoader(
                    dataset,
                    batch_size=args.batch,
                    num_workers=args.workers,
                    collate_fn=collate_uint8,
                )
            else:
                threads = int(name.removeprefix("threads-"))
                loader = BatchLoader(dataset, batch_size=args.batch, threads=threads)
            started = time.perf_counter()
            arrays = _epoch_of(loader)()
            rates[name] = arrays / (time.perf_counter() - started)
            assert bench.stats()["decodes"] == len(keys)
        finally:
            bench.remove()
    print(f"\ncold first epoch, {args.cold} arrays (every one decoded by the daemon)\n")
    print(f"| {'contender':<12} | {'arrays/s':>9} | {'x mount':>7} |")
    print(f"| {'-' * 12} | {'-' * 9}: | {'-' * 7}: |")
    for name, rate in rates.items():
        print(f"| {name:<12} | {rate:>9,.0f} | {rate / rates['mount']:>6.2f}x |")


def run(bench: BenchMount, keys: list[str], args: argparse.Namespace) -> None:
    dataset = MountDataset(bench.mountpoint, VERSION, args.size, keys)
    paths = [dataset.path(i) for i in range(len(dataset))]
    want = {key: read_array(path) for key, path in zip(keys, paths, strict=True)}  # page-cached
    generator = torch.Generator().manual_seed(0)

    def workers(data: Dataset[Any]) -> DataLoader[Any]:
        return DataLoader(
            data,
            batch_size=args.batch,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=True,
            collate_fn=collate_uint8,
            generator=generator,
        )

    loaders: dict[str, Iterable[tuple[torch.Tensor, Any]]] = {
        "constant": workers(Constant(len(keys), args.size)),
        "mount": workers(dataset),
    }
    for n in args.threads:
        loaders[f"threads-{n}"] = BatchLoader(
            dataset, batch_size=args.batch, shuffle=True, threads=n, generator=generator
        )
    for name, loader in loaders.items():  # right bytes, and the workers started
        if name != "constant":
            for images, batch_keys in loader:
                for image, key in zip(images.numpy(), batch_keys, strict=True):
                    assert np.array_equal(image, want[key]), (name, key)

    epochs: dict[str, Epoch] = {name: _epoch_of(loader) for name, loader in loaders.items()}
    epochs["read_array"] = lambda: sum(1 for path in paths if read_array(path) is not None)
    rates: dict[str, list[float]] = {name: [] for name in epochs}
    rng = np.random.default_rng(1)
    print("uptime before:", _uptime(), flush=True)
    for round_ in range(args.rounds):
        for name in rng.permutation(list(epochs)):
            epoch = epochs[str(name)]
            epoch()  # the first: settles the workers' and threads' start
            started = time.perf_counter()
            arrays = sum(epoch() for _ in range(args.epochs - 1))
            rates[str(name)].append(arrays / (time.perf_counter() - started))
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print("uptime after:", _uptime())
    base = statistics.median(rates["mount"])
    print(
        f"\n{len(keys)} arrays of {args.size}, batch {args.batch}, {args.workers} workers, "
        f"{os.cpu_count()} CPUs; epochs 2..{args.epochs}, median of {args.rounds} rounds\n"
    )
    print(f"| {'contender':<12} | {'arrays/s':>9} | {'x mount':>7} | rounds (arrays/s) |")
    print(f"| {'-' * 12} | {'-' * 9}: | {'-' * 7}: | ----------------- |")
    for name in epochs:
        rate = statistics.median(rates[name])
        each = " ".join(f"{r:,.0f}" for r in rates[name])
        print(f"| {name:<12} | {rate:>9,.0f} | {rate / base:>6.2f}x | {each} |")


def _epoch_of(loader: Iterable[tuple[torch.Tensor, Any]]) -> Epoch:
    def epoch() -> int:
        return sum(len(images) for images, _ in loader)

    return epoch


def _uptime() -> str:
    if shutil.which("uptime") is None:
        return str(os.getloadavg())
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


if __name__ == "__main__":
    main()
