"""decodefs beside what PyTorch users pick instead: live decode, LitData, WebDataset, FFCV.

One corpus of photo-like JPEGs at two sizes (--large of 4000x3000, --mid of
1440x1080), the same uint8 [224, 224, 3] arrays (decodefs's decode: Pillow,
the version's default settings), batch 64, 2 workers (processes for the
DataLoaders, threads for FFCV and decodefs's BatchLoader), shuffled, in one
run. The contenders: live decode in DataLoader workers (LiveDataset);
decodefs as an unmodified np.load dataset on the mount, MountDataset in a
DataLoader, and BatchLoader; LitData (optimize, StreamingDataLoader) as its
docs show it and with batch_decode=0; WebDataset (tar shards of .npy);
FFCV (.beton, RGBImageField raw and JPEG).

Each contender first does its one-time step (decodefs: ``decodefs warm`` of a
fresh store; LitData, WebDataset, FFCV: their write step, decode included;
live decode: none), then the epochs run interleaved, one round per epoch,
every contender once a round in a rotating order. Epoch 1 brings the files
into the page cache and hashes every array for the byte-for-byte check
against the live decode's epoch 1; epochs 2+ are timed (their median is the
rate) with every file in the page cache. DataLoader workers are persistent;
their PSS (from /proc/PID/smaps_rollup) is read in the middle of epoch 1 and
after the last round.

    flock /tmp/decodefs-heavy.lock .venv/bin/python scripts/bench_peers.py \\
        [--large 300] [--mid 1700] [--epochs 8] [--live-epochs 4] [--chart docs/peers.png]

Needs the peers extra (``pip install -e '.[peers]' torch==2.13.0``; FFCV apart,
see pyproject.toml); a peer that does not import is left out, named.
Corpora, stores, shards and peers-results.json live under /tmp/decodefs-bench.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from benchlib import DECODEFS, VERSION, WORK, BenchMount, ffcv_loader, ffcv_write, optional
from torch.utils.data import DataLoader, Dataset

from decodefs import read_array
from decodefs.client.reader import read_array_into
from decodefs.common.decode import DecodeSettings, decode_image
from decodefs.common.entry import EntryKey
from decodefs.common.npy import npy_file_size
from decodefs.common.protocol import TRAILER_SIZE
from decodefs.sample import make_sample_corpus
from decodefs.torch import BatchLoader, LiveDataset, MountDataset, collate_uint8

SIZE = 224
BATCH = 64
WORKERS = 2
Batch = tuple[torch.Tensor, torch.Tensor]  # uint8 [B, 224, 224, 3], int64 [B] corpus indices


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--large", type=int, default=300, help="4000x3000 (12 MP) originals")
    parser.add_argument("--mid", type=int, default=1700, help="1440x1080 (1.6 MP) originals")
    parser.add_argument("--epochs", type=int, default=8, help="rounds (epoch 1 included)")
    parser.add_argument("--live-epochs", type=int, default=4, help="live decode's epochs")
    parser.add_argument("--chart", type=Path, help="write a PNG chart here (needs matplotlib)")
    parser.add_argument(
        "--from-results", type=Path, help="only render a run's results JSON (table, --chart)"
    )
    args = parser.parse_args()
    if args.chart and importlib.util.find_spec("matplotlib") is None:
        parser.error("--chart needs matplotlib: pip install -e '.[peers]' torch==2.13.0")
    if args.from_results:
        results = json.loads(args.from_results.read_text())
        print(render(results))
        if args.chart:
            chart(results, args.chart)
        return
    if min(args.epochs, args.live_epochs) < 4:
        parser.error("--epochs and --live-epochs need 4 or more: epoch 1, then 3 timed")
    started = time.time()
    load_before = load()
    print(f"load before: {load_before}", flush=True)
    paths = corpus(args.large, args.mid)
    work = WORK / "peers-run"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    bench = BenchMount(paths[0].parents[2], [SIZE], store=work / "store")
    try:
        bench.mount()
        contenders = make_contenders(bench, paths, work)
        prepared: dict[str, Contender] = {}  # group -> the contender that did its step
        for c in contenders:
            if c.group in prepared:  # the same store or chunks as another contender
                c.one_time, c.shares = prepared[c.group].one_time, prepared[c.group].name
                continue
            print(f"{c.name}: one-time step ...", flush=True)
            t = time.perf_counter()
            c.prepare()
            c.one_time = time.perf_counter() - t if c.group else None
            prepared[c.group] = c
            print(f"  {c.one_time or 0:.1f} s", flush=True)
        run_rounds(contenders, args.epochs, args.live_epochs, len(paths))
        for c in contenders:
            c.read_pss()
        check_bytes(contenders, bench, paths)
        costs = breakdown(bench, [p.stem for p in paths], work)
        for c in contenders:
            c.disk = disk_bytes(c.files())
            c.resident = page_cache_bytes(c.files())
    finally:
        bench.remove()  # unmounts, and removes its run directory
    load_after = load()
    print(f"load after: {load_after}; {time.time() - started:.0f} s in all\n", flush=True)
    results = {
        "corpus": {"large": args.large, "mid": args.mid, "bytes": disk_bytes(paths)},
        "load_before": load_before,
        "load_after": load_after,
        "seconds": round(time.time() - started),
        "torch": torch.__version__,
        "versions": peer_versions(),
        "contenders": [c.result() for c in contenders],
        "breakdown_us": costs,
    }
    (WORK / "peers-results.json").write_text(json.dumps(results, indent=1))
    print(render(results))
    if args.chart:
        chart(results, args.chart)
    shutil.rmtree(work, ignore_errors=True)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def corpus(large: int, mid: int) -> list[Path]:
    """The originals, each size in two halves (two processes make them); kept for reuse."""
    root = WORK / f"peers-corpus-{large}-{mid}"
    jobs = [
        ("12mp-a", large // 2, 4000, 3000, 201),
        ("12mp-b", large - large // 2, 4000, 3000, 202),
        ("mid-a", mid // 2, 1440, 1080, 203),
        ("mid-b", mid - mid // 2, 1440, 1080, 204),
    ]
    print(f"corpus: {large} JPEGs of 4000x3000 and {mid} of 1440x1080 in {root}", flush=True)
    with Pool(WORKERS) as pool:
        made = pool.map(functools.partial(_make_part, root), jobs)
    return sorted((p for part in made for p in part), key=lambda p: p.stem)


def _make_part(root: Path, job: tuple[str, int, int, int, int]) -> list[Path]:
    name, count, width, height, seed = job
    return make_sample_corpus(root / "v" / name, count, width, height, seed=seed)


# -- contenders ---------------------------------------------------------------------------


@dataclass
class Contender:
    """One data path: its one-time step, its batches, where its bytes are, what it changed."""

    name: str
    change: str  # what a user changes in their dataset code
    group: str = ""  # contenders of one group share one one-time step; "" for none
    threads: bool = False  # loads in threads of the training process: no worker processes
    epochs: list[float] = field(default_factory=list)  # seconds per epoch, epoch 1 first
    counts: list[int] = field(default_factory=list)  # arrays per epoch
    digests: dict[int, bytes] = field(default_factory=dict)  # epoch 1: corpus index -> sha1
    pids: set[int] = field(default_factory=set)
    pss: int | None = None
    private: int | None = None
    one_time: float | None = None
    shares: str | None = None  # the contender whose one-time step this one reads
    equal: str = "?"
    disk: int = 0
    resident: int = 0
    _loader: Iterable[Any] | None = None

    def prepare(self) -> None:
        pass

    def loader(self) -> Iterable[Any]:
        raise NotImplementedError

    def batches(self) -> Iterator[Batch]:
        if self._loader is None:
            self._loader = self.loader()
        for images, labels in self._loader:
            yield images, labels.reshape(-1)

    def files(self) -> list[Path]:
        return []

    def read_pss(self) -> None:
        """The workers' PSS and private bytes summed, now; the last reading once they are gone."""
        readings = [memory(pid) for pid in self.pids]
        alive = [m for m in readings if m is not None]
        if alive:
            self.pss = sum(pss for pss, _ in alive)
            self.private = sum(private for _, private in alive)

    def result(self) -> dict[str, Any]:
        timed = [n / s for n, s in zip(self.counts[1:], self.epochs[1:], strict=True)]
        return {
            "name": self.name,
            "one_time_s": self.one_time,
            "one_time_shared_with": self.shares,
            "epoch1_per_s": self.counts[0] / self.epochs[0] if self.epochs else None,
            "timed_per_s": timed,
            "median_per_s": statistics.median(timed) if timed else None,
            "arrays_per_epoch": sorted(set(self.counts)),
            "disk_bytes": self.disk,
            "page_cache_bytes": self.resident,
            "worker_pss_bytes": None if self.threads else self.pss,
            "worker_private_bytes": None if self.threads else self.private,
            "workers": len(self.pids),
            "equal": self.equal,
            "change": self.change,
        }


class Live(Contender):
    def __init__(self, config: Path, uuids: Sequence[str]) -> None:
        super().__init__(
            "live decode (LiveDataset, DataLoader)",
            "none: the decode stays in __getitem__ (here decodefs.torch.LiveDataset)",
        )
        self.dataset = LiveDataset(config, VERSION, SIZE, uuids, targets=range(len(uuids)))

    def loader(self) -> Iterable[Any]:
        return data_loader(self.dataset, collate_uint8)


class NpyFiles(Dataset[tuple[torch.Tensor, int]]):
    """A user's own dataset of .npy files, unmodified: np.load, torch.from_numpy."""

    def __init__(self, root: str, uuids: Sequence[str]) -> None:
        self.root = root
        self.files = [f"{u}.npy" for u in uuids]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.load(os.path.join(self.root, self.files[i]))), i


class Decodefs(Contender):
    """The three decodefs paths share one store, filled once by ``decodefs warm``."""

    def __init__(
        self, name: str, change: str, bench: BenchMount, uuids: Sequence[str], threads: bool = False
    ) -> None:
        super().__init__(name, change, group="decodefs store", threads=threads)
        self.bench = bench
        self.keys = uuids

    def prepare(self) -> None:
        subprocess.run(
            [*DECODEFS, "warm", self.bench.mountpoint, VERSION, str(SIZE)],
            check=True,
            stdout=subprocess.DEVNULL,
        )

    def loader(self) -> Iterable[Any]:
        directory = str(self.bench.arrays(SIZE))
        if self.name.startswith("decodefs np.load"):
            return data_loader(NpyFiles(directory, self.keys), None)
        dataset = MountDataset(
            self.bench.mountpoint, VERSION, SIZE, self.keys, targets=range(len(self.keys))
        )
        if self.threads:
            return BatchLoader(dataset, batch_size=BATCH, shuffle=True, threads=WORKERS)
        return data_loader(dataset, collate_uint8)

    def files(self) -> list[Path]:
        return all_files(self.bench.store)


def decode_one(paths: Sequence[Path], index: int) -> npt.NDArray[np.uint8]:
    """decodefs's decode with the version's settings (the bench config's defaults)."""
    return decode_image(paths[index], SIZE, DecodeSettings())


def litdata_item(paths: Sequence[Path], index: int) -> dict[str, Any]:
    return {"image": decode_one(paths, index), "index": index}


class LitData(Contender):
    """LitData as its docs show it, or with ``batch_decode`` set; both read one ``optimize``."""

    def __init__(
        self, module: ModuleType, paths: Sequence[Path], work: Path, batch_decode: int | None
    ) -> None:
        tuned = batch_decode is not None
        super().__init__(
            f"LitData{f', batch_decode={batch_decode}' if tuned else ''} (StreamingDataLoader)",
            "a write step, optimize(fn, inputs, dir), that holds the decode; "
            "StreamingDataset(dir) + StreamingDataLoader for the dataset and loader; "
            "re-run optimize when the originals or the size change"
            + (
                "; batch_decode=0 (the default decodes a window of items around each shuffled read)"
                if tuned
                else ""
            ),
            group="litdata chunks",
        )
        self.litdata = module
        self.paths = paths
        self.directory = work / "litdata"
        self.batch_decode = batch_decode

    def prepare(self) -> None:
        self.litdata.optimize(
            fn=functools.partial(litdata_item, self.paths),
            inputs=list(range(len(self.paths))),
            output_dir=str(self.directory),
            chunk_bytes="64MB",
            num_workers=WORKERS,
            verbose=False,
        )

    def loader(self) -> Iterable[Any]:
        tuning = {} if self.batch_decode is None else {"batch_decode": self.batch_decode}
        dataset = self.litdata.StreamingDataset(str(self.directory), shuffle=True, **tuning)
        loader: Iterable[Any] = self.litdata.StreamingDataLoader(
            dataset, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True
        )
        return loader

    def batches(self) -> Iterator[Batch]:
        if self._loader is None:
            self._loader = self.loader()
        for batch in self._loader:
            yield batch["image"], batch["index"]

    def files(self) -> list[Path]:
        return all_files(self.directory)


class WebDataset(Contender):
    SHARD = 250  # arrays per tar shard: 8 shards, 4 for each worker

    def __init__(self, module: ModuleType, paths: Sequence[Path], work: Path) -> None:
        super().__init__(
            "WebDataset (WebLoader)",
            "a write step into tar shards (ShardWriter) that holds the decode; "
            "a WebDataset pipeline (shard shuffle, shuffle(1000) buffer, decode, "
            "to_tuple, batched) for the dataset; no len() or random access",
            group="webdataset shards",
        )
        self.wds = module
        self.paths = paths
        self.directory = work / "webdataset"

    def prepare(self) -> None:
        self.directory.mkdir()
        pattern = str(self.directory / "shard-%04d.tar")
        with (
            Pool(WORKERS) as pool,
            self.wds.ShardWriter(pattern, maxcount=self.SHARD, verbose=0) as sink,
        ):
            decoded = pool.imap(functools.partial(decode_one, self.paths), range(len(self.paths)))
            for index, array in enumerate(decoded):
                sink.write({"__key__": self.paths[index].stem, "npy": array, "cls": index})

    def loader(self) -> Iterable[Any]:
        urls = sorted(str(p) for p in self.directory.glob("shard-*.tar"))
        dataset = (
            self.wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
            .shuffle(1000)
            .decode()
            .to_tuple("npy", "cls")
            .batched(BATCH)
        )
        loader: Iterable[Any] = self.wds.WebLoader(
            dataset, batch_size=None, num_workers=WORKERS, persistent_workers=True
        )
        return loader

    def files(self) -> list[Path]:
        return all_files(self.directory)


class FFCV(Contender):
    def __init__(self, config: Path, uuids: Sequence[str], mode: str, work: Path) -> None:
        jpeg = mode == "jpg"
        super().__init__(
            f"FFCV ({'JPEG' if jpeg else 'raw'}, Loader)",
            "a write step (DatasetWriter from an indexed dataset, here LiveDataset); "
            "its Loader with numba pipelines in place of the DataLoader"
            + ("; JPEG mode re-encodes every array (lossy)" if jpeg else ""),
            group=f"ffcv {mode}",
            threads=True,
        )
        self.dataset = LiveDataset(config, VERSION, SIZE, uuids, targets=range(len(uuids)))
        self.mode = mode
        self.path = work / f"ffcv-{mode}.beton"

    def prepare(self) -> None:
        ffcv_write(self.path, self.dataset, self.mode, SIZE, WORKERS)

    def loader(self) -> Iterable[Any]:
        result: Iterable[Any] = ffcv_loader(self.path, BATCH, WORKERS)
        return result

    def files(self) -> list[Path]:
        return [self.path]


def make_contenders(bench: BenchMount, paths: Sequence[Path], work: Path) -> list[Contender]:
    uuids = [p.stem for p in paths]
    contenders: list[Contender] = [
        Live(bench.config, uuids),
        Decodefs(
            "decodefs np.load on the mount (DataLoader)",
            "the dataset's root points at <mount>/<version>/224; nothing else",
            bench,
            uuids,
        ),
        Decodefs(
            "decodefs MountDataset (DataLoader)",
            "the dataset becomes MountDataset(mount, version, 224, keys) "
            "with collate_fn=collate_uint8",
            bench,
            uuids,
        ),
        Decodefs(
            "decodefs BatchLoader (threads)",
            "MountDataset as above; BatchLoader(dataset, batch_size=64, shuffle=True, "
            "threads=2) in place of the DataLoader; per-sample CPU transforms move to "
            "the device",
            bench,
            uuids,
            threads=True,
        ),
    ]
    litdata, webdataset = optional("litdata"), optional("webdataset")
    if litdata:
        contenders.append(LitData(litdata, paths, work, batch_decode=None))
        contenders.append(LitData(litdata, paths, work, batch_decode=0))
    if webdataset:
        contenders.append(WebDataset(webdataset, paths, work))
    ffcv = ("writer", "fields", "loader", "fields.decoders", "transforms")
    if all([optional(f"ffcv.{name}") for name in ffcv]):  # each one missing says so
        for mode in ("raw", "jpg"):
            contenders.append(FFCV(bench.config, uuids, mode, work))
    return contenders


def peer_versions() -> dict[str, str]:
    versions = {}
    for name in ("litdata", "webdataset", "ffcv", "numpy", "PIL"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = str(getattr(module, "__version__", "?"))
    return versions


def data_loader(
    dataset: Dataset[Any], collate: Callable[[list[Any]], Any] | None
) -> DataLoader[Any]:
    return DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=WORKERS,
        persistent_workers=True,
        collate_fn=collate,
    )


# -- epochs -------------------------------------------------------------------------------


def run_rounds(contenders: list[Contender], epochs: int, live_epochs: int, count: int) -> None:
    """One round per epoch, each contender once, the order rotating from round to round."""
    for round_ in range(epochs):
        order = contenders[round_ % len(contenders) :] + contenders[: round_ % len(contenders)]
        for c in order:
            if isinstance(c, Live) and round_ >= live_epochs:
                continue
            first = round_ == 0
            seconds, arrays = run_epoch(c, first, count)
            c.epochs.append(seconds)
            c.counts.append(arrays)
            print(
                f"epoch {round_ + 1} {c.name}: {arrays} arrays in {seconds:.2f} s "
                f"({arrays / seconds:,.0f}/s)",
                flush=True,
            )


def run_epoch(c: Contender, first: bool, count: int) -> tuple[float, int]:
    """Seconds and arrays of one epoch; in epoch 1, every array hashed and the workers found
    (the children that were not there before) and their PSS read, mid-epoch."""
    arrays = 0
    middle = count // BATCH // 2
    before = children() if first else set()
    start = time.perf_counter()
    for i, (images, labels) in enumerate(c.batches()):
        arrays += len(labels)
        if first:
            if images.dtype != torch.uint8 or tuple(images.shape[1:]) != (SIZE, SIZE, 3):
                raise SystemExit(f"{c.name}: batch of {images.dtype} {tuple(images.shape)}")
            for image, label in zip(images.numpy(), labels.tolist(), strict=True):
                c.digests[int(label)] = hashlib.sha1(image.tobytes()).digest()
            if i == middle:
                c.pids = children() - before
                c.read_pss()
    seconds = time.perf_counter() - start
    if first and len(c.digests) != count:
        raise SystemExit(f"{c.name}: epoch 1 gave {len(c.digests)} distinct arrays of {count}")
    return seconds, arrays


def children() -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(OSError):  # a task may end while it is listed
            found.update(int(p) for p in (task / "children").read_text().split())
    return found


def memory(pid: int) -> tuple[int, int] | None:
    """The process's PSS and its private bytes (USS), or None once it is gone."""
    fields = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("Pss", "Private_Clean", "Private_Dirty"):
                    fields[name] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    if "Pss" not in fields:
        return None  # a zombie has no mappings
    return fields["Pss"], fields["Private_Clean"] + fields["Private_Dirty"]


# -- where a stored array's time goes -----------------------------------------------------


def breakdown(bench: BenchMount, uuids: Sequence[str], work: Path) -> dict[str, float]:
    """Microseconds per array in one thread, every file in the page cache, in a shuffled
    order: what BatchLoader does for a hit, its parts, and FFCV raw's floor (a copy out
    of one mapped file)."""
    order = np.random.default_rng(0).permutation(len(uuids))
    paths = [str(bench.arrays(SIZE) / f"{uuids[i]}.npy") for i in order]
    entries = [str(bench.store / EntryKey(VERSION, SIZE, uuids[i]).relpath) for i in order]
    keys = [EntryKey(VERSION, SIZE, uuids[i]) for i in order]
    row = np.empty((SIZE, SIZE, 3), dtype=np.uint8)
    header = bytearray(npy_file_size(SIZE) - row.nbytes)
    trailer = bytearray(TRAILER_SIZE)
    flat = work / "flat.u8"  # every array back to back, as in one .beton of raw pixels
    with open(flat, "wb") as f:
        for entry in entries:
            with open(entry, "rb") as e:
                f.write(e.read()[len(header) : len(header) + row.nbytes])
    mapped = np.memmap(flat, dtype=np.uint8, mode="r", shape=(len(uuids), SIZE, SIZE, 3))

    def preadv(entry: str) -> None:
        fd = os.open(entry, os.O_RDONLY)
        try:
            os.preadv(fd, [header, row.data, trailer], 0)
        finally:
            os.close(fd)

    def checksum(i: int) -> None:
        hasher = keys[i].hasher()
        hasher.update(header)
        hasher.update(row.data)

    def stat(path: str) -> None:
        os.lstat(path)

    def copy(i: int) -> None:
        row[...] = mapped[i]

    parts: dict[str, tuple[Callable[[Any], None], Sequence[Any]]] = {
        "read_array_into (BatchLoader's read of a hit)": (
            lambda p: read_array_into(p, row),
            paths,
        ),
        "os.lstat of the path on the mount": (stat, paths),
        "open + preadv + close of the entry file": (preadv, entries),
        "the entry's checksum (xxh3-64, key-seeded)": (checksum, range(len(uuids))),
        "a copy out of one mapped file (FFCV raw)": (copy, range(len(uuids))),
    }
    costs = {}
    for name, (fn, items) in parts.items():
        for _ in range(2):  # the first pass warms the caches; the second is timed
            start = time.perf_counter()
            for item in items:
                fn(item)
            costs[name] = (time.perf_counter() - start) / len(items) * 1e6
    flat.unlink()
    return costs


# -- the byte-for-byte check, bytes on disk -----------------------------------------------


def check_bytes(contenders: list[Contender], bench: BenchMount, paths: Sequence[Path]) -> None:
    """Every array of each contender's epoch 1 against the live decode's epoch 1; where
    they differ, how much, against the store's arrays (equal to the live decode)."""
    live = next(c for c in contenders if isinstance(c, Live)).digests
    for c in contenders:
        differ = [i for i, digest in c.digests.items() if live[i] != digest]
        if not differ:
            c.equal = f"yes, all {len(c.digests)}"
            continue
        worst = 0
        total = 0.0
        for images, labels in c.batches():
            for image, label in zip(images.numpy(), labels.tolist(), strict=True):
                path = bench.arrays(SIZE) / f"{paths[int(label)].stem}.npy"
                diff = np.abs(image.astype(np.int16) - read_array(path).astype(np.int16))
                worst = max(worst, int(diff.max()))
                total += float(diff.mean())
        c.equal = (
            f"no: {len(differ)} of {len(c.digests)} differ; max |diff| {worst}, "
            f"mean |diff| {total / len(paths):.2f}"
        )


def all_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def disk_bytes(files: Sequence[Path]) -> int:
    return sum(p.stat().st_blocks * 512 for p in files)


def page_cache_bytes(files: Sequence[Path]) -> int:
    """How much of ``files`` is in the page cache now (fincore)."""
    total = 0
    for start in range(0, len(files), 500):
        output = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES"]
            + [str(p) for p in files[start : start + 500]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        total += sum(int(line) for line in output.split())
    return total


# -- output -------------------------------------------------------------------------------


def render(results: dict[str, Any]) -> str:
    rows = results["contenders"]
    lits = [r for r in rows if r["name"].startswith("LitData")]
    lit_row = max(lits, key=lambda r: r["median_per_s"], default=None)
    lit = lit_row["median_per_s"] if lit_row else None

    def per_round(r: dict[str, Any]) -> str:
        """The median of the ratios to the faster LitData within each round: two
        epochs a few seconds apart, so a drift of the machine's load cancels."""
        if lit_row is None:
            return "-"
        pairs = zip(r["timed_per_s"], lit_row["timed_per_s"], strict=False)
        return f"{statistics.median(a / b for a, b in pairs):.2f}x"

    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**20:,.0f}"

    lines = [
        "| contender | one-time step (s) | epochs 2+ (arrays/s, median) | x the faster LitData "
        "| x it within a round (median) | range | bytes on disk (MiB) "
        "| PSS of the workers (private), MiB | equal to live decode | what the user changed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        one_time = "-" if r["one_time_s"] is None else f"{r['one_time_s']:.1f}"
        if r["one_time_shared_with"]:
            one_time = f"({one_time}: the same step)"
        timed = r["timed_per_s"]
        pss = (
            "none (threads)"
            if r["worker_pss_bytes"] is None
            else f"{mib(r['worker_pss_bytes'])} ({mib(r['worker_private_bytes'])})"
        )
        ratio = f"{r['median_per_s'] / lit:.2f}x" if lit else "-"
        lines.append(
            f"| {r['name']} | {one_time} | {r['median_per_s']:,.0f} | {ratio} | {per_round(r)} "
            f"| {min(timed):,.0f}-{max(timed):,.0f} | {mib(r['disk_bytes'])} | {pss} "
            f"| {r['equal']} | {r['change']} |"
        )
    corpus = results["corpus"]
    lines += [
        "",
        f"corpus: {corpus['large']} JPEGs of 4000x3000 and {corpus['mid']} of 1440x1080, "
        f"{mib(corpus['bytes'])} MiB; load before {results['load_before']}, after "
        f"{results['load_after']}; {results['seconds']} s; torch {results['torch']}; "
        + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
        "page cache after the run (MiB of each contender's files): "
        + ", ".join(f"{r['name']} {mib(r['page_cache_bytes'])}" for r in rows),
    ]
    lines += [
        "",
        "| one thread, per stored array | us |",
        "| --- | ---: |",
        *(f"| {name} | {us:.0f} |" for name, us in results["breakdown_us"].items()),
    ]
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path) -> None:
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    rows = results["contenders"][::-1]
    names = [r["name"] for r in rows]
    figure, (rate, once) = plt.subplots(
        1, 2, figsize=(10, 0.45 * len(rows) + 1.2), sharey=True, width_ratios=(3, 2)
    )
    rate.barh(names, [r["median_per_s"] for r in rows], color="tab:blue")
    rate.set_xscale("log")
    rate.set_xlim(right=max(r["median_per_s"] for r in rows) * 5)  # room for the labels
    rate.set_xlabel("epochs 2+, arrays/s (median; log scale)")
    for y, r in enumerate(rows):
        rate.text(r["median_per_s"], y, f" {r['median_per_s']:,.0f}", va="center", fontsize=8)
    once.barh(
        names,
        [r["one_time_s"] or 0 for r in rows],
        color=["white" if r["one_time_shared_with"] else "tab:orange" for r in rows],
        edgecolor="tab:orange",
        hatch=["//" if r["one_time_shared_with"] else "" for r in rows],
    )
    once.set_xlabel("one-time step (s)\nhatched: the same step as above")
    figure.suptitle(
        f"{results['corpus']['large']} x 12 MP + {results['corpus']['mid']} x 1.6 MP JPEGs "
        "-> uint8 224, batch 64, 2 workers, page cache warm",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    print(f"chart: {path}", flush=True)


if __name__ == "__main__":
    main()
