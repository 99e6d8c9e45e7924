"""Memory of N DataLoader workers over one corpus: one shared page-cache copy, or one each.

On generated photo-like JPEGs (--count), decoded to --size and stored by a
mounted daemon, N = 1, 2, 4 persistent (fork) workers run --epochs shuffled
epochs, then the PSS (proportional set size, from /proc/PID/smaps_rollup:
shared pages split between the processes that map them) of the workers and
of the training process is read while they are still alive:

  mount (MountDataset)              each worker reads arrays with read_array and keeps none;
                                    the store's files sit once in the kernel's page cache
  per-worker in-process cache       each worker loads every array into a list on first use
                                    ("cache the dataset in RAM"), so each holds its own copy
  in-process cache, filled before   the training process loads every array, then forks the
  the workers fork                  workers; they share its pages until something writes them

The page cache's copy of the store's files (fincore) is listed apart: it is
not any process's PSS, and it is one copy whatever N.

    .venv/bin/python scripts/bench_memory.py [--count 400] [--size 224] [--epochs 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from benchlib import VERSION, WORK, mounted
from torch.utils.data import DataLoader, Dataset

from decodefs import npy_file_size, read_array
from decodefs.sample import make_sample_corpus
from decodefs.torch import MountDataset, collate_uint8

Array = npt.NDArray[np.uint8]
WORKER_COUNTS = (1, 2, 4)


def worker_pid(uuid: str) -> int:
    """The target of every item: which process read it."""
    return os.getpid()


class WorkerCache(Dataset[tuple[Array, int]]):
    """Loads every array into a list the first time a process reads an item."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        self.cache: list[Array] | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Array, int]:
        if self.cache is None:
            self.cache = [read_array(p) for p in self.paths]
        return self.cache[index], os.getpid()


class ParentCache(Dataset[tuple[Array, int]]):
    """Loads every array into a list when it is made, in the training process."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.cache = [read_array(p) for p in paths]

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, index: int) -> tuple[Array, int]:
        return self.cache[index], os.getpid()


def pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def measure(
    make: Callable[[], Dataset[tuple[Any, int]]], workers: int, epochs: int
) -> tuple[int, int]:
    """(the workers' PSS summed, the training process's PSS) after ``epochs`` epochs."""
    gc.collect()
    dataset = make()
    loader = DataLoader(
        dataset,
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        num_workers=workers,
        persistent_workers=True,
        multiprocessing_context="fork",
        collate_fn=collate_uint8,
    )
    pids: set[int] = set()
    for _ in range(epochs):
        for _, readers in loader:
            pids.update(int(p) for p in readers)
    result = sum(pss_bytes(pid) for pid in pids), pss_bytes(os.getpid())
    del loader, dataset
    gc.collect()
    return result


def page_cache_bytes(files: Sequence[Path]) -> int:
    """How much of ``files`` is in the page cache now (fincore)."""
    output = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(line) for line in output.split())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=400, help="originals in the corpus")
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    source = WORK / f"memory-{args.count}-{args.width}x{args.height}"
    print(f"corpus: {args.count} JPEGs of {args.width}x{args.height}", file=sys.stderr)
    paths = make_sample_corpus(source, args.count, args.width, args.height, seed=3)
    uuids = sorted(p.stem for p in paths)
    rows: dict[str, dict[int, tuple[int, int]]] = {}
    with mounted(source, [args.size]) as bench:
        warm = subprocess.run(
            [sys.executable, "-m", "decodefs", "warm", bench.mountpoint, VERSION, str(args.size)],
            capture_output=True,
            text=True,
            check=True,
        )
        print(warm.stdout.strip(), file=sys.stderr)
        files = [str(bench.arrays(args.size) / f"{u}.npy") for u in uuids]
        entries = sorted(bench.store.glob(f"{VERSION}/{args.size}/*/*.npy"))
        contenders: dict[str, Callable[[], Dataset[tuple[Any, int]]]] = {
            "mount (MountDataset, read_array)": lambda: MountDataset(
                bench.mountpoint, VERSION, args.size, uuids, targets=worker_pid
            ),
            "in-process cache, filled in each worker": lambda: WorkerCache(files),
            "in-process cache, filled before the workers fork": lambda: ParentCache(files),
        }
        for name, make in contenders.items():
            rows[name] = {}
            for workers in WORKER_COUNTS:
                print(f"{name}, {workers} workers", file=sys.stderr)
                rows[name][workers] = measure(make, workers, args.epochs)
        cached = page_cache_bytes(entries)
    print(render(rows, cached, args))


def render(
    rows: dict[str, dict[int, tuple[int, int]]], cached: int, args: argparse.Namespace
) -> str:
    arrays = args.count * npy_file_size(args.size)

    def mib(n: int) -> str:
        return f"{n / 2**20:,.0f}"

    counts = " | ".join(f"N = {n}" for n in WORKER_COUNTS)
    lines = [
        f"corpus: {args.count} arrays of {args.size}x{args.size}x3 = {mib(arrays)} MiB; "
        f"{args.epochs} shuffled epochs, batch 16, fork workers; torch {torch.__version__}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "",
        f"| PSS of the workers, summed (MiB) | {counts} |",
        "| --- | " + " | ".join("---:" for _ in WORKER_COUNTS) + " |",
    ]
    for name, by_count in rows.items():
        lines.append(f"| {name} | " + " | ".join(mib(by_count[n][0]) for n in WORKER_COUNTS) + " |")
    lines += [
        "",
        f"| PSS of workers + training process (MiB) | {counts} |",
        "| --- | " + " | ".join("---:" for _ in WORKER_COUNTS) + " |",
    ]
    for name, by_count in rows.items():
        cells = " | ".join(mib(sum(by_count[n])) for n in WORKER_COUNTS)
        lines.append(f"| {name} | {cells} |")
    lines += [
        "",
        f"the store's {args.count} entry files in the page cache afterwards: {mib(cached)} MiB "
        "(one copy, shared by every reader, whatever N)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
