"""Batches of stored arrays in a training process: the bare copy, DataLoader workers, BatchLoader.

One run, one corpus: --count photo-like JPEGs decoded to --size and stored once by
``decodefs warm`` (the corpus and store are kept under the bench directory and
reused while complete), every array page-cached before the first round. Then
--rounds rounds, each contender once per round in a fresh order (interleaved, so
a drift of the machine's load touches all alike), each reading --epochs shuffled
epochs of every array in batches of --batch:

  packed-N        the bare mechanism of FFCV's raw path: the same arrays packed into
                  one .npy file, np.memmap'd, each batch's rows gathered into one
                  reused uint8 tensor by torch.index_select with N torch threads
                  (--threads); nothing checked. Its one tensor stays in the CPU's
                  last-level cache where that holds a batch, and is never written to
                  memory: no loader that hands out its batches can do that
  packed-N-fresh  the same copy as issue 29 wrote it, torch.index_select(tensor, 0,
                  index): a new tensor for each batch, as fast as the allocator makes
                  it (the faults column: its memory from glibc's heap again, or each
                  page mapped afresh); the bound BatchLoader is held to, with the ring
  packed-N-ring   the same copy into one of prefetch + 3 = 2N + 3 batch tensors in turn
                  (BatchLoader's batch memory with N threads), as a loader that reads
                  ahead must (the batch in use is not written over; FFCV's epoch
                  iterator keeps batches_ahead + 2 = 5 slots):
                  the one tensor of packed-N stays in the CPU's last-level cache, these
                  do not
  ffcv-N          FFCV's raw path itself, where ffcv imports (docs/peers.md installs it):
                  the same arrays written once by its DatasetWriter (RGBImageField, raw;
                  kept under the bench directory), its Loader with N threads, shuffled
                  (OrderOption.RANDOM, os_cache), SimpleRGBImageDecoder and ToTensor
  constant        a DataLoader with --workers workers whose dataset returns one
                  constant array: the ceiling of any dataset in such a DataLoader
  mount-uint8     MountDataset in a DataLoader with --workers persistent workers and
                  collate_uint8 (what docs/pytorch.md shows)
  mount-default   the same with torch's default collate
  mount-stack     the same with a hand-written collate (torch.stack of from_numpy)
  threads-N       BatchLoader over the same MountDataset with N threads (--threads;
                  its compiled reader, when it built)
  threads-N-py    BatchLoader with N threads and the pure-Python reader
  reader-N        the dataset's BatchReader alone, no loader: N threads each read
                  every Nth shuffled batch into a batch of its own, by
                  BatchReader.read (what BatchLoader's threads call): the loader's
                  own cost is the difference (its batches, reused, are not
                  checked below: BatchLoader's come from the same reader)
  read_array      read_array of every array in one thread, nothing else
  litdata         LitData where it imports (``pip install -e '.[peers]' torch==2.13.0``):
                  the same arrays written once by litdata.optimize into chunks (kept
                  under the bench directory), StreamingDataset(shuffle=True) in a
                  StreamingDataLoader with --workers persistent workers, as its docs
                  show it; litdata-bd0 the same with batch_decode=0 (its fastest here)

With --work US, the training loop holds the GIL for US microseconds of Python after
each batch (a training step's own Python), as a loop that trains does: a loader
whose threads need the GIL meanwhile waits for it.

Reported: arrays/s of epochs 2+ (the median over rounds), each as a ratio to the
packed copies with as many threads (into one tensor, fresh ones, the ring; for
BatchLoader, the batch reader and FFCV) or to ``mount-uint8``, and the CPU
seconds per 1,000 arrays of the training process and its workers (user + system:
what the loading leaves of the cores for augmentation) and this process's page
faults per array that read nothing from disk (memory mapped afresh, as a new
batch tensor the allocator maps for each batch). Every contender's batches
are checked once against read_array's arrays.

Then cold first epochs (--cold originals, a fresh store for each contender, so
every read is a miss the daemon decodes, each mount settled first):
``mount-uint8`` and BatchLoader with each thread count, beside ``pool-N``,
decode_image of the same originals in a pool of one thread per core (the bare
decode's rate), and ``read-16``, read_array of every array by 16 threads (the
daemon's own rate when its decode pool never waits for a request), each with the
daemon's CPU per array (its serving process's user + system seconds).
``--rounds 0`` leaves out the warm epochs; ``--code DIR`` runs the cold epochs' daemon
from another checkout (a before and after of the daemon's cost per miss).
Last, with --memory 0.5 (as root, cgroup v1's memory controller, as
bench_plain.py), a store bigger than memory: this process moves into a memory
cgroup whose limit leaves the page cache 0.5x the store's bytes, and BatchLoader,
the packed copy and ``disk`` (every entry file read whole, shuffled, a batch of
them at a time by as many threads: the disk's rate for them) read --epochs
epochs, each made afresh (a BatchLoader knows no key and keeps no file) after a
drop of the page cache, in --memory-rounds rounds in a fresh order (the packed
copy, at a few hundred arrays/s, in the first alone).

    flock /tmp/decodefs-heavy.lock .venv/bin/python scripts/bench_loader.py \\
        [--count 2000] [--size 224] [--batch 64] [--workers 2] [--threads 1 2 N] [--work US] \\
        [--memory 0.5]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import importlib.util
import os
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
from benchlib import (
    CGROUP_ROOT,
    VERSION,
    WORK,
    BenchMount,
    cgroup,
    drop_caches,
    ffcv_loader,
    ffcv_write,
    loader_corpus,
    loader_originals,
    optional,
    page_cache_bytes,
)
from torch.utils.data import DataLoader, Dataset, default_collate

from decodefs import decode_image, list_keys, read_array
from decodefs.client import EXTENSION
from decodefs.client.rows import read_entries_py
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


def stack_collate(batch: Sequence[tuple[Any, Any]]) -> tuple[torch.Tensor, list[Any]]:
    """A collate a user writes by hand."""
    return torch.stack([torch.from_numpy(image) for image, _ in batch]), [t for _, t in batch]


class Packed:
    """FFCV raw's bare mechanism: one mapped file, each batch gathered by index_select
    into one of ``ring`` tensors in turn, or (``ring=0``) a new one."""

    def __init__(
        self, path: Path, keys: Sequence[str], batch: int, threads: int, seed: int, ring: int = 1
    ) -> None:
        self.array = np.load(path, mmap_mode="r")
        self.tensor = torch.from_numpy(np.lib.format.open_memmap(path, mode="r+"))
        self.keys = keys
        self.batch = batch
        self.threads = threads
        self.generator = torch.Generator().manual_seed(seed)
        shape = (batch, *self.tensor.shape[1:])
        self.outs = [torch.ones(shape, dtype=torch.uint8) for _ in range(ring)]  # faulted in
        self.turn = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        order = torch.randperm(len(self.keys), generator=self.generator)
        torch.set_num_threads(self.threads)
        try:
            for start in range(0, len(order), self.batch):
                index = order[start : start + self.batch]
                self.turn += 1
                if self.outs:
                    out = self.outs[self.turn % len(self.outs)][: len(index)]
                    torch.index_select(self.tensor, 0, index, out=out)
                else:
                    out = torch.index_select(self.tensor, 0, index)
                yield out, [self.keys[i] for i in index.tolist()]
                # As a training loop's: once the next batch is made, the loop holds only it.
                del out
        finally:
            torch.set_num_threads(1)


class ArraysByIndex:
    """The packed arrays as the indexed dataset FFCV's DatasetWriter takes: (array, index)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = len(np.load(path, mmap_mode="r"))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[npt.NDArray[np.uint8], int]:
        return np.array(np.load(self.path, mmap_mode="r")[index]), index


class FFCVRaw:
    """FFCV's raw path: its .beton written once from the packed arrays, its Loader."""

    def __init__(
        self, packed: Path, keys: Sequence[str], args: argparse.Namespace, threads: int
    ) -> None:
        path = WORK / f"loader-ffcv-raw-{len(keys)}-{args.size}.beton"
        if not path.exists():
            partial = path.with_suffix(".partial")
            ffcv_write(partial, ArraysByIndex(packed), "raw", args.size, args.workers)
            partial.rename(path)
        self.keys = keys
        self.loader = ffcv_loader(path, args.batch, threads)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        for images, labels in self.loader:
            yield images, [self.keys[i] for i in labels.reshape(-1).tolist()]


class Readers:
    """The batch reader without a loader: ``threads`` threads each reading every
    ``threads``-th batch of a shuffled epoch into one batch of its own (reused)."""

    def __init__(self, dataset: MountDataset, batch: int, threads: int, seed: int) -> None:
        self.reader = dataset.batch_reader()
        self.count = len(dataset)
        self.batch = batch
        self.threads = threads
        self.rng = np.random.default_rng(seed)
        shape = (batch, dataset.size, dataset.size, 3)
        self.rows = [torch.empty(shape, dtype=torch.uint8) for _ in range(threads)]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        order = self.rng.permutation(self.count)
        starts = list(range(0, self.count, self.batch))

        def read(k: int) -> int:
            rows = self.rows[k].numpy()
            for start in starts[k :: self.threads]:
                index = order[start : start + self.batch]
                misses = self.reader.read(index, rows[: len(index)])
                assert not misses, "reader-N reads a store holding every array"
            return len(starts[k :: self.threads])

        with ThreadPoolExecutor(self.threads) as threads:
            list(threads.map(read, range(self.threads)))
        for start in starts:  # the epoch's batches, counted (their rows were reused)
            yield self.rows[0][: len(order[start : start + self.batch])], []


def litdata_item(packed: Path, keys: Sequence[str], index: int) -> dict[str, Any]:
    return {"image": np.load(packed, mmap_mode="r")[index].copy(), "key": keys[index]}


class LitData:
    """LitData's loader over the same arrays, in chunks written once by its optimize."""

    def __init__(
        self,
        module: Any,
        packed: Path,
        keys: Sequence[str],
        args: argparse.Namespace,
        **tuning: int,
    ) -> None:
        directory = WORK / f"loader-litdata-{len(keys)}-{args.size}"
        if not (directory / "index.json").exists():
            shutil.rmtree(directory, ignore_errors=True)
            module.optimize(
                fn=functools.partial(litdata_item, packed, keys),
                inputs=list(range(len(keys))),
                output_dir=str(directory),
                chunk_bytes="64MB",
                num_workers=args.workers,
                verbose=False,
            )
        dataset = module.StreamingDataset(str(directory), shuffle=True, **tuning)
        self.loader = module.StreamingDataLoader(
            dataset, batch_size=args.batch, num_workers=args.workers, persistent_workers=True
        )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        for batch in self.loader:
            yield batch["image"], batch["key"]


_SATURATING: Final = 16
_SATURATED: Final = f"read-{_SATURATING}"


class Saturating:
    """As many misses asked for at once as the daemon takes: ``read_array`` of every
    array by 16 threads (the daemon's rate when its decode pool never waits)."""

    def __init__(self, dataset: MountDataset, batch: int) -> None:
        self.paths = [dataset.path(i) for i in range(len(dataset))]
        self.batch = batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        with ThreadPoolExecutor(_SATURATING) as readers:
            read = list(readers.map(read_array, self.paths))
        for start in range(0, len(read), self.batch):
            yield torch.empty((len(read[start : start + self.batch]), 0)), []


class Disk:
    """The disk's rate for these files: every entry file read whole, shuffled, a batch
    of them at a time by as many threads (as deep a queue as a batch's reads ahead)."""

    def __init__(self, files: list[Path], batch: int) -> None:
        self.files = files
        self.batch = batch
        self.rng = np.random.default_rng(3)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[str]]]:
        order = self.rng.permutation(len(self.files)).tolist()
        with ThreadPoolExecutor(self.batch) as readers:
            for start in range(0, len(order), self.batch):
                paths = [self.files[i] for i in order[start : start + self.batch]]
                sizes = list(readers.map(lambda p: len(p.read_bytes()), paths))
                yield torch.empty((len(sizes), 0)), [str(p) for p in paths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    cpus = len(os.sched_getaffinity(0))
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, 2, cpus}))
    parser.add_argument("--epochs", type=int, default=3, help="per contender and round")
    parser.add_argument("--rounds", type=int, default=3, help="0: no warm epochs")
    parser.add_argument("--cold", type=int, default=300, help="originals of the cold epochs")
    parser.add_argument("--memory", type=_fraction, help="page cache for a store this times bigger")
    parser.add_argument("--memory-rounds", type=int, default=3, help="rounds of --memory")
    parser.add_argument("--code", type=Path, help="the cold epochs' daemon from this checkout")
    parser.add_argument("--only", nargs="+", help="run only these contenders")
    parser.add_argument(
        "--work", type=int, default=0, help="us of the training loop's own Python per batch"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("batch reads:", EXTENSION or "pure Python", flush=True)

    with loader_corpus(args.count, args.size) as (bench, keys, packed):
        if args.rounds:
            run(bench, keys, packed, args)
        if args.memory is not None:
            small_memory(bench, keys, packed, bench.store, args)
    if args.cold:
        cold(loader_originals(args.count), args)


def cold(originals: Path, args: argparse.Namespace) -> None:
    """A first epoch over a fresh store, per contender: every array a miss."""
    names = sorted(originals.rglob("*.jpg"))[: args.cold]
    subset = WORK / f"loader-cold-{args.cold}"
    if not subset.exists():
        subset.mkdir()
        for path in names:
            (subset / path.name).hardlink_to(path)  # a symlink out of the source is no original
    rates = {}
    daemon_ms: dict[str, float] = {}  # the serving process's CPU per array
    pool = len(os.sched_getaffinity(0))  # the daemon's decode pool: one thread per core
    started = time.perf_counter()
    with ThreadPoolExecutor(pool) as decoders:
        arrays = sum(1 for _ in decoders.map(lambda p: decode_image(p, args.size), names))
    rates[f"pool-{pool}"] = arrays / (time.perf_counter() - started)
    # Each store is removed after the last contender: on ext4 without a journal (this
    # machine's /tmp), a file created within seconds of another's deletion costs the
    # kernel a scan past the deleted inodes (~1.5 ms per miss), which no store that
    # keeps its files pays.
    used: list[BenchMount] = []
    try:
        for name in [_SATURATED, "mount-uint8", *(f"threads-{n}" for n in args.threads)]:
            bench = BenchMount(subset, [args.size], code=args.code)  # a store of its own
            used.append(bench)
            rates[name], daemon_ms[name] = _cold_epoch(bench, name, args)
    finally:
        for bench in used:
            bench.remove()
    print(
        f"\ncold first epoch, {args.cold} arrays (every one decoded by the daemon; pool-N: "
        f"decode_image of the same originals in N threads, the bare decode's rate; "
        f"{_SATURATED}: read_array by {_SATURATING} threads, the daemon's own rate when "
        f"its decode pool never waits for a request)\n"
    )
    print(
        f"| {'contender':<12} | {'arrays/s':>9} | x pool-{pool} | x {_SATURATED} "
        f"| x mount | daemon CPU ms / array |"
    )
    print(f"| {'-' * 12} | {'-' * 9}: | ---: | ---: | ---: | ---: |")
    for name, rate in rates.items():
        cpu = f"{daemon_ms[name]:.1f}" if name in daemon_ms else "-"
        print(
            f"| {name:<12} | {rate:>9,.0f} | {rate / rates[f'pool-{pool}']:.2f}x "
            f"| {rate / rates[_SATURATED]:.2f}x | {rate / rates['mount-uint8']:.2f}x | {cpu} |"
        )


def _cold_epoch(bench: BenchMount, name: str, args: argparse.Namespace) -> tuple[float, float]:
    """Contender ``name``'s first epoch on ``bench`` (mounted here, unmounted after): its
    arrays/s, and the daemon's CPU ms per array."""
    try:
        bench.mount()
        keys = list_keys(bench.mountpoint, VERSION, args.size)
        dataset = MountDataset(bench.mountpoint, VERSION, args.size, keys)
        loader: Iterable[tuple[torch.Tensor, Any]]
        if name == _SATURATED:
            loader = Saturating(dataset, args.batch)
        elif name == "mount-uint8":
            loader = DataLoader(
                dataset,
                batch_size=args.batch,
                num_workers=args.workers,
                collate_fn=collate_uint8,
            )
        else:
            threads = int(name.removeprefix("threads-"))
            loader = BatchLoader(dataset, batch_size=args.batch, threads=threads)
        daemon = _process_cpu_seconds(bench.stats()["pid"])
        started = time.perf_counter()
        arrays = _epoch_of(loader)()
        rate = arrays / (time.perf_counter() - started)
        stats = bench.stats()
        assert stats["decodes"] == len(keys)
        return rate, (_process_cpu_seconds(stats["pid"]) - daemon) / arrays * 1000
    finally:
        bench.unmount()


def loaders(
    dataset: MountDataset, keys: list[str], packed: Path, args: argparse.Namespace
) -> dict[str, Iterable[tuple[torch.Tensor, Any]]]:
    generator = torch.Generator().manual_seed(0)

    def workers(data: Dataset[Any], collate: Callable[..., Any]) -> DataLoader[Any]:
        return DataLoader(
            data,
            batch_size=args.batch,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=True,
            collate_fn=collate,
            generator=generator,
        )

    batch_loaders = {
        n: BatchLoader(dataset, batch_size=args.batch, shuffle=True, threads=n, generator=generator)
        for n in args.threads
    }
    made: dict[str, Iterable[tuple[torch.Tensor, Any]]] = {}
    for n, loader in batch_loaders.items():
        made[f"packed-{n}"] = Packed(packed, keys, args.batch, n, seed=n)
        made[f"packed-{n}-fresh"] = Packed(packed, keys, args.batch, n, seed=n, ring=0)
        made[f"packed-{n}-ring"] = Packed(packed, keys, args.batch, n, seed=n, ring=_ring(loader))
    if optional("ffcv.loader") is not None:  # installed as docs/peers.md says
        for n in args.threads:
            if not args.only or f"ffcv-{n}" in args.only:
                made[f"ffcv-{n}"] = FFCVRaw(packed, keys, args, n)
    made["constant"] = workers(Constant(len(keys), args.size), collate_uint8)
    made["mount-uint8"] = workers(dataset, collate_uint8)
    made["mount-default"] = workers(dataset, default_collate)
    made["mount-stack"] = workers(dataset, stack_collate)
    for n, loader in batch_loaders.items():
        made[f"threads-{n}"] = loader
        made[f"reader-{n}"] = Readers(dataset, args.batch, n, seed=n)
    py = MountDataset(dataset.directory.rsplit("/", 2)[0], VERSION, args.size, keys)
    py._reader = None
    reader = py.batch_reader()
    reader._read_rows = read_entries_py  # the pure-Python twin
    two = min(2, max(args.threads))
    made[f"threads-{two}-py"] = BatchLoader(
        py, batch_size=args.batch, shuffle=True, threads=two, generator=generator
    )
    litdata = importlib.util.find_spec("litdata")  # the peers extra
    if litdata is not None and (not args.only or {"litdata", "litdata-bd0"} & set(args.only)):
        module = importlib.import_module("litdata")
        made["litdata"] = LitData(module, packed, keys, args)
        made["litdata-bd0"] = LitData(module, packed, keys, args, batch_decode=0)
    if args.only:
        made = {name: loader for name, loader in made.items() if name in args.only}
    return made


def _ring(loader: BatchLoader) -> int:
    """The batches of memory ``loader`` keeps (``prefetch + 3``, docs/pytorch.md)."""
    return loader.prefetch + 3


_BY_THREADS: Final = ("threads-", "packed-", "reader-", "ffcv-")  # named <kind>-<threads>...


def run(bench: BenchMount, keys: list[str], packed: Path, args: argparse.Namespace) -> None:
    dataset = MountDataset(bench.mountpoint, VERSION, args.size, keys)
    paths = [dataset.path(i) for i in range(len(dataset))]
    want = {key: read_array(path) for key, path in zip(keys, paths, strict=True)}  # page-cached
    made = loaders(dataset, keys, packed, args)
    for name, loader in made.items():  # right bytes, and the workers started
        if name != "constant" and not name.startswith("reader-"):
            for images, batch_keys in loader:
                for image, key in zip(images.numpy(), batch_keys, strict=True):
                    assert np.array_equal(image, want[key]), (name, key)

    epochs = {name: _epoch_of(loader, args.work) for name, loader in made.items()}
    if not args.only or "read_array" in args.only:
        epochs["read_array"] = lambda: sum(1 for path in paths if read_array(path) is not None)
    rates: dict[str, list[float]] = {name: [] for name in epochs}
    cpu: dict[str, list[float]] = {name: [] for name in epochs}
    faults: dict[str, list[float]] = {name: [] for name in epochs}  # this process's, per array
    rng = np.random.default_rng(1)
    print("uptime before:", _uptime(), flush=True)
    for round_ in range(args.rounds):
        for name in rng.permutation(list(epochs)):
            epoch = epochs[str(name)]
            epoch()  # the first: settles the workers' and threads' start
            started, cpu_started, faults_started = time.perf_counter(), _cpu_seconds(), _faults()
            arrays = sum(epoch() for _ in range(args.epochs - 1))
            rates[str(name)].append(arrays / (time.perf_counter() - started))
            cpu[str(name)].append((_cpu_seconds() - cpu_started) / arrays * 1000)
            faults[str(name)].append((_faults() - faults_started) / arrays)
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print("uptime after:", _uptime())
    print(
        f"\n{len(keys)} arrays of {args.size}, batch {args.batch}, {args.workers} workers, "
        f"{os.cpu_count()} CPUs; epochs 2..{args.epochs}, median of {args.rounds} rounds; "
        f"the training loop's own Python per batch: {args.work} us\n"
    )
    print(
        f"| {'contender':<14} | {'arrays/s':>9} | {'x packed':>8} | {'x fresh':>7} "
        f"| {'x ring':>6} | {'x mount':>7} | CPU s / 1,000 | faults / array | rounds (arrays/s) |"
    )
    print(
        f"| {'-' * 14} | {'-' * 9}: | {'-' * 8}: | {'-' * 7}: | {'-' * 6}: | {'-' * 7}: "
        "| ------------: | -------------: | --- |"
    )
    base = statistics.median(rates["mount-uint8"]) if "mount-uint8" in rates else None
    for name in epochs:
        rate = statistics.median(rates[name])
        threads = name.split("-")[1] if name.startswith(_BY_THREADS) else None
        x_one, x_fresh, x_ring = (
            _times(rate, rates.get(f"packed-{threads}{copy}")) for copy in ("", "-fresh", "-ring")
        )
        x_mount = f"{rate / base:.2f}x" if base else "-"
        each = " ".join(f"{r:,.0f}" for r in rates[name])
        print(
            f"| {name:<14} | {rate:>9,.0f} | {x_one:>8} | {x_fresh:>7} | {x_ring:>6} "
            f"| {x_mount:>7} | {statistics.median(cpu[name]):>13.3f} "
            f"| {statistics.median(faults[name]):>14.1f} | {each} |"
        )


def _times(rate: float, bound: list[float] | None) -> str:
    """``rate`` as a ratio to the median of ``bound``'s rounds (none: "-")."""
    return f"{rate / statistics.median(bound):.2f}x" if bound else "-"


def small_memory(
    bench: BenchMount, keys: list[str], packed: Path, store: Path, args: argparse.Namespace
) -> None:
    """A store bigger than memory: BatchLoader, the packed copy and the disk's own rate in
    a memory cgroup, --memory-rounds rounds in a fresh order (the packed copy, at a
    few hundred arrays/s, in the first alone), each contender made afresh."""
    if os.geteuid() != 0 or not CGROUP_ROOT.is_dir():
        print("\n--memory: skipped (needs root and cgroup v1's memory controller)")
        return
    entry_bytes = sum(p.stat().st_size for p in store.rglob("*.npy"))
    room = int(args.memory * entry_bytes)
    gc.collect()  # the loaders of the rounds let go of their kept (mapped) entry files:
    # mapped pages are never dropped, and these were charged outside the group
    two = min(2, max(args.threads))
    files = sorted(store.rglob("*.npy"))

    def batch_loader() -> BatchLoader:  # a reader of its own: no kept file, no key known
        dataset = MountDataset(bench.mountpoint, VERSION, args.size, keys)
        return BatchLoader(dataset, batch_size=args.batch, shuffle=True, threads=two)

    makers: dict[str, Callable[[], Iterable[tuple[torch.Tensor, Any]]]] = {
        f"threads-{two}": batch_loader,
        f"packed-{two}": lambda: Packed(packed, keys, args.batch, two, seed=7),
        "disk": lambda: Disk(files, args.batch),
    }
    rates: dict[str, list[list[float]]] = {name: [] for name in makers}
    rng = np.random.default_rng(2)
    ring = _ring(batch_loader())  # made here: nothing of it charged to the group
    with cgroup(None) as group:
        usage = int((group / "memory.usage_in_bytes").read_text())
        # This process's own memory was charged elsewhere (cgroup v1 charges what is
        # allocated after the move): the limit is the page cache's room and the batch
        # memory BatchLoader keeps (prefetch 2 per thread + 3 batches) or Packed's one.
        batches = (args.batch * args.size * args.size * 3) * ring
        (group / "memory.limit_in_bytes").write_text(str(usage + room + batches))
        for round_ in range(args.memory_rounds):
            for name in rng.permutation(list(makers)).tolist():
                if name.startswith("packed-") and round_ > 0:
                    continue
                loader = makers[name]()
                drop_caches()
                epoch = _epoch_of(loader)
                each = []
                for _ in range(args.epochs):
                    started = time.perf_counter()
                    arrays = epoch()
                    each.append(arrays / (time.perf_counter() - started))
                rates[name].append(each)
                del loader, epoch
                gc.collect()  # its kept entry files closed: mapped pages are never dropped
        cache = page_cache_bytes(group)
    print(
        f"\nstore {entry_bytes / 2**20:,.0f} MiB, page cache room {room / 2**20:,.0f} MiB "
        f"({args.memory}x; the group's page cache at the end: {cache / 2**20:,.0f} MiB), "
        f"each contender made afresh after a drop of the page cache, "
        f"{args.memory_rounds} rounds\n"
    )
    disk = statistics.median(each[0] for each in rates["disk"])
    print(
        f"| {'contender':<12} | epoch 1, median | x disk | epochs 2..{args.epochs}, median "
        f"| epochs 1..{args.epochs} per round, arrays/s |"
    )
    print(f"| {'-' * 12} | ---: | ---: | ---: | --- |")
    for name, runs in rates.items():
        first = statistics.median(each[0] for each in runs)
        later = [rate for each in runs for rate in each[1:]]
        print(
            f"| {name:<12} | {first:,.0f} | {first / disk:.2f}x "
            f"| {statistics.median(later) if later else 0:,.0f} "
            f"| {'; '.join(' '.join(f'{r:,.0f}' for r in each) for each in runs)} |"
        )


def _process_cpu_seconds(pid: int) -> float:
    """Another process's user + system seconds (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _faults() -> int:
    """This process's page faults so far that read nothing from disk (memory mapped afresh)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its live children (the workers)."""
    pids = [os.getpid()]
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _fraction(value: str) -> float:
    """--memory: more than 0 (no page cache at all leaves no room for the process)."""
    fraction = float(value)
    if not fraction > 0:
        raise argparse.ArgumentTypeError(f"a fraction of the store above 0, not {value}")
    return fraction


def _epoch_of(loader: Iterable[tuple[torch.Tensor, Any]], work_us: int = 0) -> Epoch:
    """An epoch of ``loader``, each batch followed by ``work_us`` of the loop's own Python."""

    def epoch() -> int:
        arrays = 0
        for images, _ in loader:
            arrays += len(images)
            if work_us:
                _hold_the_gil(work_us)
        return arrays

    return epoch


def _hold_the_gil(microseconds: int) -> None:
    """Python that runs ``microseconds`` without a blocking call (a training step's own)."""
    end = time.perf_counter() + microseconds / 1e6
    while time.perf_counter() < end:
        pass


def _uptime() -> str:
    if shutil.which("uptime") is None:
        return str(os.getloadavg())
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


if __name__ == "__main__":
    main()
