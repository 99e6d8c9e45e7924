"""The checked copy against the bare copy into the same memory: what the check costs.

One thread, bench_loader.py's corpus (--count arrays of --size, stored, packed in one
file, every byte page-cached), the arrays in a fresh shuffled order each round, the
median of --rounds rounds in microseconds per array, of:

  packed copy        numpy's copy of the array out of the packed file (np.memmap): the
                     bare copy of FFCV's raw path, nothing checked
  entry copy         numpy's copy of the array out of its store entry, mapped (as the
                     batch reader maps a kept file), nothing checked
  checked, plain     the batch reader's copy of the entry (the compiled copy_checksum of
                     the build named): the entry's xxh3-64, computed in the copy's one pass
                     over the bytes, is compared with its trailer's; the row is written by
                     plain stores (rows at an odd address take them)
  checked, streamed  the same into rows on a cache line, which it writes past the CPU's
                     caches (non-temporal stores), as BatchLoader's reads do

each into the same three destinations: one row (stays in the CPU's L2 cache), one
batch of --batch rows (its last-level cache, where that holds a batch), and
BatchLoader's batch memory with one thread (its prefetch + 3 batches in turn, 5 by
default, which that cache does not hold). The checked copies by each build this CPU runs
(_batchread.BUILDS: for any CPU, AVX2, AVX-512); the table's ratio is to the packed
copy into the same memory.

    flock /tmp/decodefs-heavy.lock .venv/bin/python scripts/bench_copy.py \\
        [--count 2000] [--size 224] [--batch 64] [--rounds 7]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from benchlib import VERSION, loader_corpus

from decodefs.client import rows as row_readers
from decodefs.common.entry import EntryKey
from decodefs.common.npy import npy_header
from decodefs.common.protocol import TRAILER, TRAILER_SIZE
from decodefs.torch import BatchLoader, MountDataset

Array = npt.NDArray[np.uint8]
_CACHE_LINE = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not row_readers.BUILDS:
        raise SystemExit("bench_copy.py: the compiled reader did not build here")
    from decodefs.client import _batchread  # type: ignore[attr-defined]

    with loader_corpus(args.count, args.size) as (bench, keys, packed_path):
        dataset = MountDataset(bench.mountpoint, VERSION, args.size, keys)
        ring = BatchLoader(dataset, batch_size=args.batch, threads=1).prefetch + 3  # its memory
        entries = [bench.store / EntryKey(VERSION, args.size, key).relpath for key in keys]
        seeds = [EntryKey(VERSION, args.size, key).seed for key in keys]
        maps = []
        for path in entries:
            with open(path, "rb") as f:
                maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
    skip = len(npy_header(args.size))
    row_bytes = args.size * args.size * 3
    hashed = [memoryview(m)[: len(m) - TRAILER_SIZE] for m in maps]
    sums = [TRAILER.unpack(m[len(m) - TRAILER_SIZE :])[4] for m in maps]
    in_entry = [np.frombuffer(m, np.uint8, row_bytes, skip) for m in maps]
    packed = np.load(packed_path, mmap_mode="r").reshape(len(keys), row_bytes)
    for rows in (packed, *in_entry):  # every byte in the page cache before the first round
        rows.sum()

    shapes = {  # rows a batch, batches in turn
        "one row": (1, 1),
        "one batch": (args.batch, 1),
        f"{ring} batches": (args.batch, ring),
    }
    memory = {
        (name, odd): _rows(row_bytes, batch * turns, odd)
        for name, (batch, turns) in shapes.items()
        for odd in (False, True)
    }

    def bare(source: Callable[[int], Array], rows: Array) -> Callable[[list[int]], None]:
        def copy(order: list[int]) -> None:
            for n, i in enumerate(order):
                np.copyto(rows[n % len(rows)], source(i))

        return copy

    def checked(build: str, rows: Array) -> Callable[[list[int]], None]:
        def copy(order: list[int]) -> None:
            copy_checksum = _batchread.copy_checksum
            for n, i in enumerate(order):
                if copy_checksum(hashed[i], skip, seeds[i], rows[n % len(rows)], build) != sums[i]:
                    raise AssertionError(f"{entries[i]}: checksum")

        return copy

    contenders: dict[tuple[str, str], Callable[[list[int]], None]] = {}
    for name in shapes:
        rows = memory[name, False]
        contenders[name, "packed copy"] = bare(packed.__getitem__, rows)
        contenders[name, "entry copy"] = bare(in_entry.__getitem__, rows)
        for build in row_readers.BUILDS:
            contenders[name, f"checked ({build}), plain"] = checked(build, memory[name, True])
            contenders[name, f"checked ({build}), streamed"] = checked(build, rows)
    for copy in contenders.values():  # every check passes once before the rounds
        copy(list(range(len(keys))))
    us: dict[tuple[str, str], list[float]] = {c: [] for c in contenders}
    names = list(contenders)
    rng = np.random.default_rng(0)
    for _ in range(args.rounds):
        order = rng.permutation(len(keys)).tolist()
        for k in rng.permutation(len(names)).tolist():
            contender = names[k]
            started = time.perf_counter()
            contenders[contender](order)
            us[contender].append((time.perf_counter() - started) / len(order) * 1e6)
    print(
        f"\n{len(keys)} arrays of {args.size} ({row_bytes:,} bytes), one thread, "
        f"median of {args.rounds} rounds; checked builds: {', '.join(row_readers.BUILDS)}\n"
    )
    print("| into | copy | us / array | x packed copy | rounds (us) |")
    print("| --- | --- | ---: | ---: | --- |")
    for (name, kind), times in us.items():
        median = statistics.median(times)
        bound = statistics.median(us[name, "packed copy"])
        each = " ".join(f"{t:.2f}" for t in times)
        print(f"| {name} | {kind} | {median:.2f} | {bound / median:.2f}x | {each} |")


def _rows(row_bytes: int, count: int, odd: bool) -> Array:
    """``count`` rows, the first on a cache line (or one byte past one, if ``odd``)."""
    block = np.ones(count * row_bytes + 2 * _CACHE_LINE, np.uint8)  # faulted in
    start = -block.ctypes.data % _CACHE_LINE + int(odd)
    return block[start : start + count * row_bytes].reshape(count, row_bytes)


if __name__ == "__main__":
    main()
