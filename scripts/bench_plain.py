"""Plain readers when the store outgrows memory: the mount against the store's own files.

One run, one corpus: --count small photo-like JPEGs decoded to --size and stored
once by ``decodefs warm`` (kept under the bench directory and reused while
complete). Then, for each reader count (--readers) and memory limit (--limits:
none, or a multiple of the store's bytes), a memory cgroup (v1; cgroup v2's
``memory.max`` is the same knob) holds the daemon and the readers, and each
contender runs with the page cache dropped before it:

  direct      np.load of the store's entry files (what a local directory of .npy costs)
  read_array  decodefs.read_array through the mount (reads the store's files directly)
  minimal     np.load through a minimal pyfuse3 file system that reads the same files
              (hard links) in a worker thread per READ: the binding's own floor for
              this access pattern (scripts/minimalfs.py --from-disk)
  mount       np.load through the mount, as an unmodified dataset does

Each reads two epochs, every array once per epoch, in a fresh random order, split
across N reader processes started together: the first epoch is cold (a fresh
daemon: every first open verifies its entry), the second is what training lives
in. After the mount's epochs (no other contender read since the drop), the
group's page cache is read from memory.stat, and the READ requests per array
from the daemon's counters.

Last, warm hits (everything page-cached): plain np.load through the mount
against a minimal pyfuse3 file system (scripts/minimalfs.py) serving the same
bytes, and against the same minimal file system in a process that first
imported every module the daemon imports (--import-daemon: what a process of
the daemon's size costs the loop, with none of decodefs's handlers), in
--rounds rounds, each with fresh processes for all three (a process's
placement moves its rate by ~10% here), daemons and reader on one core, each
contender measured once first, once second and once last in a round (the
order alone moved a rate by a few percent).

    .venv/bin/python scripts/bench_plain.py [--count 8000] [--readers 2 8] [--limits none 1.5 0.5]

Run as root (cgroups, drop_caches). The store lives under /tmp/decodefs-bench.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import DECODEFS, VERSION, WORK, BenchMount, cgroup, drop_caches, page_cache_bytes

from decodefs import read_array
from decodefs.common.entry import EntryKey
from decodefs.common.npy import npy_file_size
from decodefs.common.protocol import TRAILER_SIZE
from decodefs.sample import make_sample_corpus

CONTENDERS = ("direct", "read_array", "minimal", "mount")


@dataclass
class Cell:
    readers: int
    limit: str
    contender: str
    cold: float  # arrays/s, first epoch
    warm: float  # arrays/s, second epoch
    cache_bytes: int | None = None  # the group's page cache after the mount's epochs
    reads_per_array: float | None = None  # READ requests per array, first epoch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=8000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--readers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--limits", nargs="+", default=["none", "1.5", "0.5"])
    parser.add_argument("--rounds", type=int, default=9, help="warm-hit rounds")
    parser.add_argument("--hit-files", type=int, default=300, help="arrays in a warm-hit round")
    parser.add_argument("--hits-only", action="store_true", help="only the warm hits")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_plain.py: run as root (memory cgroups, drop_caches)")
    started = time.time()
    print(f"load before: {load()}", flush=True)
    originals = WORK / f"plain-320x240-{args.count}"
    make_sample_corpus(originals, args.count, 320, 240, seed=16)
    store = filled_store(originals, args.size, args.count)
    store_bytes = args.count * (npy_file_size(args.size) + TRAILER_SIZE)
    print(f"store: {args.count} arrays of {args.size}, {store_bytes / 2**20:,.0f} MiB", flush=True)

    cells: list[Cell] = []
    for readers in [] if args.hits_only else args.readers:
        for limit in args.limits:
            cells += measure_cells(originals, store, args.size, readers, limit, store_bytes)
    hits = warm_hits(originals, store, args.size, args.rounds, args.hit_files)
    print(f"load after: {load()}; {time.time() - started:.0f} s in all\n", flush=True)
    print(report(cells, hits, store_bytes, args))


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


# -- the store ----------------------------------------------------------------------------


def filled_store(originals: Path, size: int, count: int) -> Path:
    """A store holding every original's array, made once with `decodefs warm`."""
    store = WORK / f"plain-store-{count}-{size}"
    bench = BenchMount(originals, [size], store=store)
    try:
        bench.mount()
        if bench.stats()["store_entries"] < count:
            print(f"filling {store} with decodefs warm ...", flush=True)
            subprocess.run([*DECODEFS, "warm", bench.mountpoint, VERSION, str(size)], check=True)
        assert bench.stats()["store_entries"] == count, bench.stats()["store_entries"]
    finally:
        bench.remove()  # the run directory; the store lives apart
    return store


def entry_paths(store: Path, size: int, uuids: Sequence[str]) -> list[Path]:
    return [store / EntryKey(VERSION, size, uuid).relpath for uuid in uuids]


def linked_entries(store: Path, size: int, uuids: Sequence[str]) -> Path:
    """A flat directory of hard links to the store's entries: the same files, for
    minimalfs (one directory, as it serves)."""
    links = WORK / f"{store.name}-links"
    if not links.is_dir() or len(os.listdir(links)) != len(uuids):
        shutil.rmtree(links, ignore_errors=True)
        links.mkdir()
        for uuid, entry in zip(uuids, entry_paths(store, size, uuids), strict=True):
            os.link(entry, links / f"{uuid}.npy")
    return links


@contextlib.contextmanager
def minimal_mount(
    source: Path, mountpoint: Path, *, from_disk: bool, import_daemon: bool = False
) -> Iterator[subprocess.Popen[str]]:
    """scripts/minimalfs.py serving ``source`` at ``mountpoint`` (its process)."""
    mountpoint.mkdir(exist_ok=True)
    command = [sys.executable, str(Path(__file__).with_name("minimalfs.py"))]
    command += ["--from-disk"] if from_disk else []
    command += ["--import-daemon"] if import_daemon else []
    command += [str(source), str(mountpoint)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        yield process
    finally:
        subprocess.run(["umount", str(mountpoint)], check=False)
        process.wait()


# -- a memory cgroup for the daemon and the readers ------------------------------------


# -- epochs -------------------------------------------------------------------------------


def _read_slice(
    reader: Callable[[str], object], paths: Sequence[str], barrier: Any, out: Any
) -> None:
    barrier.wait()
    start = time.perf_counter()
    for path in paths:
        reader(path)
    out.put((start, time.perf_counter()))


def epoch(reader: Callable[[str], object], paths: Sequence[str], readers: int) -> float:
    """Every path once, in a fresh random order split across ``readers`` processes
    started together; arrays/s from the first start to the last end."""
    order = list(paths)
    random.shuffle(order)
    context = multiprocessing.get_context("fork")
    barrier, out = context.Barrier(readers), context.Queue()
    procs = [
        context.Process(target=_read_slice, args=(reader, order[i::readers], barrier, out))
        for i in range(readers)
    ]
    for proc in procs:
        proc.start()
    spans: list[tuple[float, float]] = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0, proc.exitcode
    return len(order) / (max(end for _, end in spans) - min(start for start, _ in spans))


def measure_cells(
    originals: Path, store: Path, size: int, readers: int, limit: str, store_bytes: int
) -> list[Cell]:
    limit_bytes = None if limit == "none" else int(float(limit) * store_bytes)
    cells = []
    with cgroup(limit_bytes) as group:
        bench = BenchMount(originals, [size], store=store)
        try:
            bench.mount()  # in the group: its daemon's memory and page cache count there
            uuids = sorted(p.name.removesuffix(".npy") for p in bench.arrays(size).iterdir())
            mounted = [str(bench.arrays(size) / f"{uuid}.npy") for uuid in uuids]
            direct = [str(p) for p in entry_paths(store, size, uuids)]
            links = linked_entries(store, size, uuids)
            for contender in CONTENDERS:
                if contender == "mount":  # a fresh daemon: its first opens verify
                    bench.unmount()
                    bench.mount()
                drop_caches()
                if contender == "direct":
                    cold, warm = (epoch(np.load, direct, readers) for _ in range(2))
                    cells.append(Cell(readers, limit, contender, cold, warm))
                elif contender == "read_array":
                    cold, warm = (epoch(read_array, mounted, readers) for _ in range(2))
                    cells.append(Cell(readers, limit, contender, cold, warm))
                elif contender == "minimal":
                    floor = bench.directory / "minimal"
                    with minimal_mount(links, floor, from_disk=True):
                        drop_caches()
                        files = [str(floor / f"{uuid}.npy") for uuid in uuids]
                        cold, warm = (epoch(np.load, files, readers) for _ in range(2))
                    cells.append(Cell(readers, limit, contender, cold, warm))
                else:
                    cold = epoch(np.load, mounted, readers)
                    stats = bench.stats()
                    reads = stats["store_reads_inline"] + stats["store_reads_threaded"]
                    warm = epoch(np.load, mounted, readers)
                    cells.append(
                        Cell(
                            readers, limit, contender, cold, warm,
                            cache_bytes=page_cache_bytes(group),
                            reads_per_array=reads / len(mounted),
                        )
                    )  # fmt: skip
                print(f"  {cells[-1]}", flush=True)
        finally:
            bench.remove()
    return cells


# -- warm hits against a minimal pyfuse3 file system -------------------------------------


def _pin(pid: int, cpu: int) -> None:
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), {cpu})


def _daemon_pid(bench: BenchMount) -> int:
    pid: int = bench.stats()["pid"]
    return pid


def _loop(paths: Sequence[Path], loops: int) -> float:
    started = time.perf_counter()
    for _ in range(loops):
        for path in paths:
            np.load(path)
    return loops * len(paths) / (time.perf_counter() - started)


@dataclass
class HitRound:
    """Warm hits/s of one round: the mount, the minimal file system, and the minimal
    file system in a process with the daemon's imports."""

    mount: float
    minimal: float
    minimal_imports: float


def warm_hits(originals: Path, store: Path, size: int, rounds: int, count: int) -> list[HitRound]:
    """Hits/s per round, each round with fresh processes for all three."""
    flat = WORK / f"{store.name}-flat-{count}"
    uuids = sorted(p.stem for p in originals.rglob("*.jpg"))[:count]
    if not flat.is_dir() or sorted(p.stem for p in flat.iterdir()) != uuids:
        shutil.rmtree(flat, ignore_errors=True)
        flat.mkdir(parents=True)
        for uuid, entry in zip(uuids, entry_paths(store, size, uuids), strict=True):
            (flat / f"{uuid}.npy").write_bytes(entry.read_bytes()[:-TRAILER_SIZE])
    cpu = min(os.sched_getaffinity(0))
    here = os.sched_getaffinity(0)
    results = []
    try:
        os.sched_setaffinity(0, {cpu})
        for _ in range(rounds):
            bench = BenchMount(originals, [size], store=store)
            plain_mnt, heavy_mnt = bench.directory / "minimal", bench.directory / "heavy"
            try:
                with (
                    minimal_mount(flat, plain_mnt, from_disk=False) as plain,
                    minimal_mount(flat, heavy_mnt, from_disk=False, import_daemon=True) as heavy,
                ):
                    bench.mount()
                    ours = [bench.arrays(size) / f"{uuid}.npy" for uuid in uuids]
                    theirs = [plain_mnt / f"{uuid}.npy" for uuid in uuids]
                    heavies = [heavy_mnt / f"{uuid}.npy" for uuid in uuids]
                    for pid in (_daemon_pid(bench), plain.pid, heavy.pid):
                        _pin(pid, cpu)
                    contenders = (ours, theirs, heavies)
                    for paths in contenders:
                        _loop(paths, 1)  # verified, and page-cached
                    rates: list[list[float]] = [[], [], []]
                    for turn in range(3):  # each contender once first, once second, once last
                        for i in (turn, turn + 1, turn + 2):
                            rates[i % 3].append(_loop(contenders[i % 3], 3))
            finally:
                bench.remove()
            medians = [statistics.median(r) for r in rates]
            results.append(HitRound(*medians))
            print(
                f"  warm hits: mount {medians[0]:,.0f}/s, minimal {medians[1]:,.0f}/s, "
                f"minimal with the daemon's imports {medians[2]:,.0f}/s",
                flush=True,
            )
    finally:
        os.sched_setaffinity(0, here)
    return results


# -- the report -----------------------------------------------------------------------------


def report(
    cells: list[Cell], hits: list[HitRound], store_bytes: int, args: argparse.Namespace
) -> str:
    def get(readers: int, limit: str, contender: str) -> Cell:
        return next(
            c for c in cells if (c.readers, c.limit, c.contender) == (readers, limit, contender)
        )

    lines = []
    for readers in [] if args.hits_only else args.readers:
        heads = " | ".join(f"limit {lim}: epoch 1 (cold) | epoch 2" for lim in args.limits)
        lines += [
            f"### {readers} readers",
            "",
            f"| contender | {heads} |",
            "| --- |" + " ---: | ---: |" * len(args.limits),
        ]
        for contender in CONTENDERS:
            row = []
            for limit in args.limits:
                cell, direct = get(readers, limit, contender), get(readers, limit, "direct")
                if contender == "direct":
                    row += [f"{cell.cold:,.0f}/s", f"{cell.warm:,.0f}/s"]
                else:
                    row += [
                        f"{cell.cold:,.0f}/s ({cell.cold / direct.cold:.2f}x)",
                        f"{cell.warm:,.0f}/s ({cell.warm / direct.warm:.2f}x)",
                    ]
            lines.append(f"| {contender} | " + " | ".join(row) + " |")
        lines.append("")
        mount = [get(readers, limit, "mount") for limit in args.limits]
        caches = [f"limit {m.limit}: {(m.cache_bytes or 0) / store_bytes:.2f}x" for m in mount]
        reads = [f"{m.reads_per_array or 0:.2f}" for m in mount]
        lines.append(
            "mount: page cache of the group after its epochs / store bytes: "
            + ", ".join(caches)
            + "; READ requests per array in epoch 1: "
            + ", ".join(reads)
        )
        floor = []
        for lim in args.limits:
            ours, theirs = get(readers, lim, "mount"), get(readers, lim, "minimal")
            floor.append(
                f"limit {lim}: {ours.cold / theirs.cold:.2f}x / {ours.warm / theirs.warm:.2f}x"
            )
        lines.append("mount / minimal pyfuse3 (epoch 1 / epoch 2): " + ", ".join(floor))
        if "none" in args.limits and "1.5" in args.limits:
            none, mid = get(readers, "none", "mount"), get(readers, "1.5", "mount")
            lines.append(f"mount epoch 2 at 1.5x / no limit: {mid.warm / none.warm:.2f}x")
        lines.append("")

    def ratio(values: Iterable[float]) -> str:
        v = list(values)
        return f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" if v else "-"

    def rate(values: Iterable[float]) -> str:
        v = list(values)
        return f"{statistics.median(v):,.0f}/s" if v else "-"

    lines += [
        f"warm hits, plain np.load (median of {len(hits)} rounds; lowest-highest round):",
        f"- mount / minimal pyfuse3 = {ratio(h.mount / h.minimal for h in hits)}",
        "- minimal with the daemon's imports / minimal = "
        + ratio(h.minimal_imports / h.minimal for h in hits),
        "- mount / minimal with the daemon's imports = "
        + ratio(h.mount / h.minimal_imports for h in hits),
        f"- mount {rate(h.mount for h in hits)}, minimal {rate(h.minimal for h in hits)}, "
        f"minimal with the daemon's imports {rate(h.minimal_imports for h in hits)}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
