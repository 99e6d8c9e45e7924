"""Service figures, side by side in one run: warm throughput and eviction under a miss stream.

warm        the bare decode function in a thread pool of N, vs `decodefs warm --jobs N`
            through a cold mount, vs the daemon's background warm, on ~12 MP JPEGs
eviction    a stream of misses from 4 readers into a store capped at max_store_bytes:
            peak bytes on disk (sampled every few ms) against the cap, and the miss
            rate against the same stream into an uncapped store

  .venv/bin/python scripts/bench_service.py [--count 24] [--workers N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import PIL
from benchlib import DECODEFS, VERSION, WORK, BenchMount, mounted

from decodefs import decode_image, npy_bytes
from decodefs.common.npy import npy_file_size
from decodefs.common.protocol import TRAILER_SIZE
from decodefs.sample import make_sample_corpus


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--count", type=int, default=24, help="12 MP originals for the warm figures"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--stream", type=int, default=400, help="small originals in the miss stream"
    )
    parser.add_argument(
        "--cap-entries", type=int, default=50, help="max_store_bytes, in 224 entries"
    )
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    print(
        f"{os.cpu_count()} cores; Python {platform.python_version()}, Pillow {PIL.__version__}\n",
        flush=True,
    )
    print(warm_table(args))
    print()
    print(eviction_table(args))


def warm_table(args: argparse.Namespace) -> str:
    originals = WORK / "originals-4000x3000"
    paths = make_sample_corpus(originals, args.count, 4000, 3000, seed=1)
    for path in paths:
        path.read_bytes()  # page-cached for every contender alike
    workers = args.workers

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda p: npy_bytes(decode_image(p, 224)), paths))
    bare = len(paths) / (time.perf_counter() - started)

    with mounted(originals, [224], settings={"decode_workers": workers}) as bench:
        started = time.perf_counter()
        result = run(*DECODEFS, "warm", bench.mountpoint, VERSION, "224", "--jobs", str(workers))
        cli = len(paths) / (time.perf_counter() - started)
        assert f"warmed {len(paths)} of {len(paths)}" in result, result

    with mounted(
        originals, [224], settings={"decode_workers": workers}, version_settings={"warm": True}
    ) as bench:
        started = time.perf_counter()
        while bench.stats()["background_decodes"] < len(paths):
            time.sleep(0.05)  # each poll is a request the daemon answers between decodes
        background = len(paths) / (time.perf_counter() - started)

    return "\n".join(
        [
            f"Warm: {len(paths)} JPEGs of 4000x3000 -> 224, {workers} workers",
            "",
            row("contender", "arrays/s", "vs bare pool"),
            row("---", "---:", "---:"),
            row(f"bare decode function, thread pool of {workers}", f"{bare:.1f}", "1.00x"),
            row(
                f"`decodefs warm --jobs {workers}` through the mount",
                f"{cli:.1f}",
                f"{cli / bare:.2f}x",
            ),
            row("background warm, readers idle", f"{background:.1f}", f"{background / bare:.2f}x"),
        ]
    )


def eviction_table(args: argparse.Namespace) -> str:
    originals = WORK / f"originals-stream-{args.stream}"
    make_sample_corpus(originals, args.stream, 640, 480, seed=2)
    entry = npy_file_size(224) + TRAILER_SIZE
    cap = args.cap_entries * entry
    # Usage is read with one statvfs of a private tmpfs: a glob of the entry files
    # is not atomic and double-counts an entry evicted and replaced mid-glob.
    # max_store_bytes counts file sizes; pages round each entry up, and the
    # store's two marker files take a page each.
    bound = cap + args.cap_entries * 4096 + 2 * 4096
    lines = [
        f"Eviction: {args.stream} cold misses (640x480 -> 224) from 4 reader threads; cap "
        f"{cap:,} bytes ({args.cap_entries} entries of {entry:,}), {bound:,} with page rounding",
        "",
        row("store", "misses/s", "vs uncapped", "peak on disk", "at end", "evictions", "errors"),
        row("---", *["---:"] * 6),
    ]
    uncapped_rate = peak = 0.0
    for label, limit in [("uncapped", None), (f"capped at {args.cap_entries} entries", cap)]:
        with (
            private_tmpfs() as fs,
            mounted(
                originals,
                [224],
                store=fs / "store",
                settings={"decode_workers": args.workers}
                | ({} if limit is None else {"max_store_bytes": limit}),
            ) as bench,
        ):
            peak, seconds = stream_misses(bench, fs, readers=4)
            rate = args.stream / seconds
            uncapped_rate = uncapped_rate or rate
            info = bench.stats()
            lines.append(
                row(
                    label,
                    f"{rate:.1f}",
                    f"{rate / uncapped_rate:.2f}x",
                    f"{peak:,}",
                    f"{entries_on_disk(fs, bench.store):,}",
                    f"{info['evictions']:,}",
                    f"{info['store_write_errors']:,}",
                )
            )
    held = "held at every sample" if peak <= bound else "EXCEEDED"
    lines += ["", f"Capped peak on disk / bound: {peak / bound:.3f} (the cap {held})."]
    return "\n".join(lines)


def stream_misses(bench: BenchMount, fs: Path, readers: int) -> tuple[int, float]:
    """Read every array once from ``readers`` threads; (peak bytes of entries on disk, seconds)."""
    store = bench.store
    entries = sorted(bench.arrays(224).iterdir())
    stop = threading.Event()
    peak = [0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], entries_on_disk(fs, store))

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(readers) as pool:
            list(pool.map(lambda p: p.read_bytes(), entries))
    finally:
        seconds = time.perf_counter() - started
        stop.set()
        sampler.join()
    return peak[0], seconds


def entries_on_disk(fs: Path, store: Path) -> int:
    """Bytes of entries on ``fs``: used blocks less the catalog's and temp files' blocks."""
    vfs = os.statvfs(fs)
    used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
    for path in [*store.glob(".catalog*"), *store.glob(".tmp/*")]:
        with contextlib.suppress(FileNotFoundError):
            used -= path.stat().st_blocks * 512
    return used


@contextmanager
def private_tmpfs() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="fs-", dir=WORK))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1g", "decodefs-bench", str(root)], check=True
    )
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
        shutil.rmtree(root, ignore_errors=True)


def row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def run(*command: object) -> str:
    return subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, check=True
    ).stdout


if __name__ == "__main__":
    main()
