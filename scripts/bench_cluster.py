"""Cluster figures, side by side in one run: nodes sharing an L2 on SeaweedFS (S3).

two nodes   node A's epoch (cold: decodes), then node B's (fresh store, from L2):
            B's decodes, every array equal to A's, B's rate against A's
cold        two fresh nodes read the same originals at once: total decodes against
            the originals, with the lease (default) and without (l2_lease_seconds = 0)
warm        `decodefs warm --cluster` on a Dask LocalCluster of 2 workers against
            `decodefs warm` through one node's mount, each into an empty L2
paused      a fresh node reads one array at a time; L2 is paused (kill -STOP) for the
            middle third and resumed (kill -CONT) for the last: every array right, the
            worst time one read waited, decodes

Every node is a real daemon mounted through the CLI; SeaweedFS runs on loopback.

  .venv/bin/python scripts/bench_cluster.py [--count 200] [--size 224]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import PIL
from benchlib import DECODEFS, VERSION, WORK, BenchMount
from PIL import Image, ImageChops

from decodefs import decode_image, npy_bytes
from decodefs.sample import photo_like

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.servers import S3_ENV, SeaweedFS, seaweedfs_running  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=200, help="12 MP originals")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--readers", type=int, default=4, help="reader threads per node")
    args = parser.parse_args()
    os.environ.update(S3_ENV)  # the daemons' and workers' credentials, the standard AWS way
    corpus = make_corpus(WORK / f"cluster-crops-{args.count}", args.count)
    print(
        f"{os.cpu_count()} cores; Python {platform.python_version()}, Pillow {PIL.__version__}; "
        f"{args.count} originals of 4000x3000 at {args.size}\n",
        flush=True,
    )
    with seaweedfs_running(WORK / f"seaweedfs-{os.getpid()}") as server:
        print(two_nodes(server, corpus, args), flush=True)
        print(cold_at_once(server, corpus, args), flush=True)
        print(warm(server, corpus, args), flush=True)
        print(paused(server, corpus, args), flush=True)


def make_corpus(directory: Path, count: int) -> Path:
    """``count`` photo-like 12 MP JPEGs named as make_sample_corpus names them, made by
    two processes (~0.3 s each after ~3 s per base image); kept between runs."""
    rng = np.random.default_rng(0)
    names = [_uuid(rng) for _ in range(count)]
    todo = [(directory / f"batch-{i % 4:02d}" / f"{name}.jpg", i) for i, name in enumerate(names)]
    todo = [(path, i) for path, i in todo if not path.exists()]
    if todo:
        print(f"making {len(todo)} originals under {directory} ...", flush=True)
        started = time.perf_counter()
        with concurrent.futures.ProcessPoolExecutor(min(2, os.cpu_count() or 1)) as pool:
            list(pool.map(_make_one, todo, chunksize=8))
        print(f"made them in {time.perf_counter() - started:.0f} s", flush=True)
    return directory


def _uuid(rng: np.random.Generator) -> str:
    import uuid

    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


WIDTH, HEIGHT = 4000, 3000
MARGIN = 256  # the bases are this much larger than an original, each way
BASES = 4


@functools.cache
def _base(k: int) -> Image.Image:
    """Photo-like base ``k`` (smooth fields, hard edges, grain), made once per process."""
    return photo_like(np.random.default_rng([1, k]), WIDTH + MARGIN, HEIGHT + MARGIN)


@functools.cache
def _grain() -> Image.Image:
    """Sensor-like grain around 128, as large as a base."""
    shape = (HEIGHT + MARGIN, WIDTH + MARGIN, 3)
    return Image.fromarray(np.random.default_rng([2]).integers(118, 139, shape, dtype=np.uint8))


def original(i: int) -> Image.Image:
    """Original ``i``: a 4000x3000 crop of one of BASES base images at its own offset,
    maybe mirrored, with its own gain per channel and its own grain (a crop of the
    grain field at another offset). Every step runs in Pillow's C code: ~0.2 s."""
    rng = np.random.default_rng([0, i])
    x, y, gx, gy = (int(v) for v in rng.integers(0, MARGIN + 1, 4))
    image = _base(i % BASES).crop((x, y, x + WIDTH, y + HEIGHT))
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    gain = rng.uniform(0.8, 1.2, 3)
    image = image.point(
        np.minimum(np.arange(256) * gain[:, None], 255).astype(int).ravel().tolist()
    )
    grain = _grain().crop((gx, gy, gx + WIDTH, gy + HEIGHT))
    return ImageChops.add(image, grain, scale=1.0, offset=-128)  # clipped to 0-255


def _make_one(job: tuple[Path, int]) -> None:
    path, i = job
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    original(i).save(tmp, format="JPEG", quality=90)
    tmp.rename(path)


# -- nodes --------------------------------------------------------------------------------


def node(source: Path, size: int, server: SeaweedFS, bucket: str, **keys: Any) -> BenchMount:
    settings = {"l2": f"s3://{bucket}/decoded", "l2_endpoint": server.endpoint, **keys}
    mount = BenchMount(source, [size], settings=settings)
    mount.mount()
    return mount


def epoch(mount: BenchMount, size: int, readers: int) -> tuple[float, dict[str, bytes]]:
    """Read every array through the mount with ``readers`` threads: seconds, arrays."""
    directory = mount.arrays(size)
    names = sorted(os.listdir(directory))
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(readers) as pool:
        data = dict(
            zip(names, pool.map(lambda n: (directory / n).read_bytes(), names), strict=True)
        )
    return time.perf_counter() - started, data


def wait_for(condition: Callable[[], bool], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("timed out waiting for the daemons")
        time.sleep(0.1)


def check(arrays: dict[str, bytes], source: Path, size: int, sample: int = 8) -> None:
    """A sample against the decode function; the caller compares the rest node to node."""
    paths = {p.stem: p for p in source.rglob("*.jpg")}
    for name in sorted(arrays)[:sample]:
        assert arrays[name] == npy_bytes(decode_image(paths[name[: -len(".npy")]], size)), name


def two_nodes(server: SeaweedFS, source: Path, args: argparse.Namespace) -> str:
    bucket = server.bucket()
    a = node(source, args.size, server, bucket)
    try:
        a_seconds, a_arrays = epoch(a, args.size, args.readers)
        check(a_arrays, source, args.size)
        wait_for(lambda: a.stats()["l2_publishes"] == len(a_arrays))
        a_stats = a.stats()
    finally:
        a.remove()
    b = node(source, args.size, server, bucket)
    try:
        b_seconds, b_arrays = epoch(b, args.size, args.readers)
        b_stats = b.stats()
    finally:
        b.remove()
    n = len(a_arrays)
    right = sum(b_arrays[k] == v for k, v in a_arrays.items())
    fetch = b_stats["l2_fetch_seconds"]
    return _table(
        f"Two nodes, {n} originals, {args.readers} reader threads each",
        ["node", "decodes", "L2 hits", "arrays right", "epoch s", "arrays/s"],
        [
            ["A (cold)", a_stats["decodes"], a_stats["l2_hits"], n, a_seconds, n / a_seconds],
            [
                "B (from L2)",
                b_stats["decodes"],
                b_stats["l2_hits"],
                right,
                b_seconds,
                n / b_seconds,
            ],
        ],
        f"B / A epoch rate: {a_seconds / b_seconds:.1f}x; mean L2 fetch "
        f"{1000 * fetch['sum'] / max(1, fetch['count']):.1f} ms",
    )


def cold_at_once(server: SeaweedFS, source: Path, args: argparse.Namespace) -> str:
    rows = []
    for label, keys in (
        ("with the lease", {}),
        ("without (l2_lease_seconds = 0)", {"l2_lease_seconds": 0}),
    ):
        bucket = server.bucket()
        nodes = [node(source, args.size, server, bucket, **keys) for _ in range(2)]
        try:
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                results = list(pool.map(lambda m: epoch(m, args.size, args.readers), nodes))
            seconds = time.perf_counter() - started
            stats = [m.stats() for m in nodes]
        finally:
            for m in nodes:
                m.remove()
        n = len(results[0][1])
        same = all(results[0][1][k] == v for k, v in results[1][1].items())
        decodes = sum(s["decodes"] for s in stats)
        waits = sum(s["l2_lease_waits"] for s in stats)
        rows.append([label, n, decodes, f"{decodes / n:.2f}", waits, same, seconds])
    return _table(
        "Two cold nodes reading the same originals at once",
        ["", "originals", "decodes", "decodes / original", "lease waits", "A == B", "s"],
        rows,
    )


def warm(server: SeaweedFS, source: Path, args: argparse.Namespace) -> str:
    from distributed import LocalCluster

    n = sum(1 for _ in source.rglob("*.jpg"))
    bucket = server.bucket()
    config = WORK / f"cluster-warm-{os.getpid()}.toml"
    config.write_text(
        f'store = "{WORK}/unused"\nl2 = "s3://{bucket}/decoded"\n'
        f'l2_endpoint = "{server.endpoint}"\n'
        f'[versions.{VERSION}]\nsource = "{source}"\nsizes = [{args.size}]\n'
    )
    with LocalCluster(  # type: ignore[no-untyped-call]
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
    ) as cluster:
        started = time.perf_counter()
        command = [*DECODEFS, "warm", "--cluster", cluster.scheduler_address, VERSION]
        subprocess.run([*command, str(args.size), "--config", str(config)], check=True)
        dask_seconds = time.perf_counter() - started
    dask_objects = len(server.objects(bucket, "decoded/"))
    one = node(source, args.size, server, server.bucket())
    try:
        started = time.perf_counter()
        subprocess.run([*DECODEFS, "warm", one.mountpoint, VERSION, str(args.size)], check=True)
        one_seconds = time.perf_counter() - started
        wait_for(lambda: one.stats()["l2_publish_queue"] == 0)
        one_stats = one.stats()
    finally:
        one.remove()
    return _table(
        f"Filling an empty L2 with {n} arrays",
        ["", "arrays in L2", "s", "arrays/s"],
        [
            [
                "decodefs warm --cluster, 2 Dask workers",
                dask_objects,
                dask_seconds,
                n / dask_seconds,
            ],
            ["decodefs warm, one node", one_stats["l2_publishes"], one_seconds, n / one_seconds],
        ],
        f"Dask / one node: {one_seconds / dask_seconds:.2f}x (both use this machine's cores)",
    )


def paused(server: SeaweedFS, source: Path, args: argparse.Namespace) -> str:
    bucket = server.bucket()
    paths = sorted(source.rglob("*.jpg"))
    a = node(source, args.size, server, bucket)
    try:
        epoch(a, args.size, args.readers)
        wait_for(lambda: a.stats()["l2_publish_queue"] == 0)
    finally:
        a.remove()
    b = node(source, args.size, server, bucket)
    rows = []
    try:
        third = len(paths) // 3
        phases = [("L2 up", paths[:third]), ("L2 paused (kill -STOP)", paths[third : 2 * third])]
        phases.append(("L2 resumed (kill -CONT)", paths[2 * third :]))
        for label, batch in phases:
            if label.startswith("L2 paused"):
                server.pause()
            elif label.startswith("L2 resumed"):
                server.resume()
            before = b.stats()
            worst, wrong, started = 0.0, 0, time.perf_counter()
            for path in batch:
                t = time.perf_counter()
                data = (b.arrays(args.size) / f"{path.stem}.npy").read_bytes()
                worst = max(worst, time.perf_counter() - t)
                wrong += data != npy_bytes(decode_image(path, args.size))
            after = b.stats()
            rows.append([
                label, len(batch), len(batch) - wrong, after["decodes"] - before["decodes"],
                after["l2_hits"] - before["l2_hits"], worst, time.perf_counter() - started,
                after["l2_state"],
            ])  # fmt: skip
    finally:
        server.resume()
        b.remove()
    return _table(
        "One node's epoch, one read at a time, L2 paused for the middle third "
        "(l2_timeout_seconds = 5, the default)",
        ["phase", "reads", "right", "decodes", "L2 hits", "worst read s", "phase s", "breaker"],
        rows,
    )


def _table(title: str, header: list[str], rows: list[list[Any]], note: str = "") -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
        return str(value)

    lines = [f"## {title}", "", "| " + " | ".join(header) + " |"]
    lines.append("| " + " | ".join("---" for _ in header) + " |")
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
