"""Cluster figures, side by side in one run: three nodes on a network of their own.

Each node (n0, n1, n2) is a real daemon, mounted through the CLI inside a network
namespace of its own, with its readers there too; SeaweedFS (the L2) and a Dask
scheduler live in a fourth; veth pairs on a bridge join them (tests/netns.py,
removed at the end, even on failure). Readers: --readers threads a node, each
reading every array from its own place in the list, all nodes at once.

issue  the issue's scenario: 16 originals of 12 MP (PNG), one decode slot a node,
       l2_lease_seconds = 2, 16 readers a node (48 in all) cold at once: decodes, with
       this branch's daemons and with --baseline's (another checkout, e.g. main)
cold   3 fresh nodes read the same originals at once, cold, with --cold-workers decode
       slots each and l2_lease_seconds = --lease (the issue's setup): decodes per
       original with claims, without (l2_lease_seconds = 0), and with --baseline's
       daemons (another checkout, e.g. main) if given
epoch  3 fresh nodes read an epoch at once: decoding it (no L2), then from L2 (filled
       by cold): per node, seconds and arrays/s
cut    3 fresh nodes read an epoch from L2 at once; n1's link is cut (ip link set
       down) once it has read a third and restored at two thirds: n1's reads are
       right, its breaker opens and closes again, the others' decodes stay 0
warm   decodefs warm --cluster on 3 Dask workers (one in each node's namespace) vs
       decodefs warm through one node's mount, each into an empty L2

  .venv/bin/python scripts/bench_cluster.py [--count 120] [--size 224] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from tests.netns import Network, Readers, network, readers  # noqa: E402
from tests.servers import S3_ENV, Dask, SeaweedFS, dask_running, seaweedfs_running  # noqa: E402

NODES = ("n0", "n1", "n2")
Digests = dict[str, list[str]]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=120, help="12 MP originals")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--readers", type=int, default=8, help="reader threads per node")
    parser.add_argument("--lease", type=float, default=2.0, help="l2_lease_seconds (cold)")
    parser.add_argument("--cold-workers", type=int, default=1, help="decode_workers (cold)")
    parser.add_argument(
        "--baseline", type=Path, help="a checkout whose daemons run the cold phase too"
    )
    args = parser.parse_args()
    os.environ.update(S3_ENV)  # the daemons' and workers' credentials, the standard AWS way
    corpus = make_corpus(WORK / f"cluster-crops-{args.count}", args.count)
    pngs = make_corpus(WORK / "cluster-crops-png-16", 16, "png")
    print(
        f"{os.cpu_count()} cores; Python {platform.python_version()}, Pillow {PIL.__version__}; "
        f"{args.count} originals of 4000x3000 at {args.size}; {args.readers} readers a node; "
        f"load average {_load()} at the start\n",
        flush=True,
    )
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="cluster-", dir=WORK))  # SeaweedFS's, Dask's
    try:
        run(scratch, corpus, pngs, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"load average {_load()} at the end; {time.perf_counter() - started:.0f} s in all")


def run(scratch: Path, corpus: Path, pngs: Path, args: argparse.Namespace) -> None:
    with network("dfc", ("s3", *NODES)) as net:
        s3 = net.hosts["s3"]
        within = functools.partial(net.within, "s3")
        where = {"address": s3.address, "wrapper": s3.command(), "within": within}
        with seaweedfs_running(scratch / "seaweedfs", **where) as server:
            bench = Bench(net, server, corpus, args, scratch)
            try:
                print(bench.issue(pngs), flush=True)
                bucket, cold = bench.cold()
                print(cold, flush=True)
                print(bench.epoch(bucket), flush=True)
                print(bench.cut(bucket), flush=True)
                print(bench.warm(), flush=True)
            finally:
                bench.close()


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def make_corpus(directory: Path, count: int, extension: str = "jpg") -> Path:
    """``count`` photo-like 12 MP JPEGs (or PNGs) named as make_sample_corpus names them,
    made by two processes (~0.3 s each after ~3 s per base image); kept between runs."""
    rng = np.random.default_rng(0)
    names = [_uuid(rng) for _ in range(count)]
    todo = [
        (directory / f"batch-{i % 4:02d}" / f"{name}.{extension}", i)
        for i, name in enumerate(names)
    ]
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
    if path.suffix == ".png":
        original(i).save(tmp, format="PNG")
    else:
        original(i).save(tmp, format="JPEG", quality=90)
    tmp.rename(path)


# -- nodes --------------------------------------------------------------------------------


@dataclass
class Bench:
    net: Network
    server: SeaweedFS
    source: Path
    args: argparse.Namespace
    scratch: Path

    def __post_init__(self) -> None:
        self.names = sorted(f"{p.stem}.npy" for p in self.source.rglob("*.jpg"))
        self.mounts: list[BenchMount] = []
        # source -> name -> sha256 of the right array
        self.references: dict[Path, dict[str, str]] = {}

    def node(self, name: str, bucket: str | None, code: Path | None = None,
             source: Path | None = None, **keys: Any) -> BenchMount:  # fmt: skip
        """Node ``name``'s daemon (fresh store), started in its namespace."""
        settings: dict[str, Any] = dict(keys)
        if bucket is not None:
            settings |= {"l2": f"s3://{bucket}/decoded", "l2_endpoint": self.server.endpoint}
        mount = BenchMount(
            source or self.source, [self.args.size], settings=settings,
            wrapper=self.net.hosts[name].command(), code=code,
        )  # fmt: skip
        self.mounts.append(mount)
        mount.mount()
        return mount

    @contextlib.contextmanager
    def nodes(self, bucket: str | None, code: Path | None = None, source: Path | None = None,
              **keys: Any) -> Iterator[dict[str, BenchMount]]:  # fmt: skip
        started = {}
        try:
            for name in NODES:
                started[name] = self.node(name, bucket, code, source, **keys)
            yield started
        finally:
            for mount in started.values():
                mount.remove()
                self.mounts.remove(mount)

    def start_readers(self, nodes: dict[str, BenchMount], names: list[str] | None = None,
                      threads: int | None = None) -> contextlib.AbstractContextManager[
            list[Readers]]:  # fmt: skip
        groups = [(self.net.hosts[n], m.arrays(self.args.size)) for n, m in nodes.items()]
        return readers(groups, names or self.names, threads or self.args.readers)

    def epoch_at_once(self, nodes: dict[str, BenchMount], names: list[str] | None = None,
                      threads: int | None = None) -> dict[str, tuple[float, Digests]]:  # fmt: skip
        """Every node's readers read every array at once: node -> (seconds, digests)."""
        with self.start_readers(nodes, names, threads) as started:
            for group in started:
                group.go()
            return {n: g.result(3600) for n, g in zip(nodes, started, strict=True)}

    def right(self, digests: Digests, source: Path | None = None) -> int:
        """Reads whose bytes equal the right array's."""
        source = source or self.source
        if source not in self.references:
            self.references[source] = self._reference(digests, source)
        reference = self.references[source]
        return sum(d == reference[n] for n, reads in digests.items() for d in reads)

    def _reference(self, digests: Digests, source: Path) -> dict[str, str]:
        """The arrays of a first epoch, agreed on by every read, with a sample of 8
        checked against the decode function (the rest are compared read to read)."""
        reference = {}
        for name, reads in digests.items():
            assert len(set(reads)) == 1, f"reads of {name} differ"
            reference[name] = reads[0]
        paths = {p.stem: p for p in source.rglob("*.*")}
        for name in sorted(reference)[:8]:
            array = npy_bytes(decode_image(paths[name[: -len(".npy")]], self.args.size))
            assert hashlib.sha256(array).hexdigest() == reference[name], name
        return reference

    def close(self) -> None:
        for mount in self.mounts:
            mount.remove()

    # -- phases ---------------------------------------------------------------------------

    def issue(self, source: Path) -> str:
        """The issue's scenario, with this branch's daemons and --baseline's."""
        names = sorted(f"{p.stem}.npy" for p in source.rglob("*.png"))
        cases: list[tuple[str, Path | None]] = [("this branch", None)]
        baseline = self._baseline_label()
        if baseline is not None:
            cases.append((baseline, self.args.baseline))
        rows = []
        for label, code in cases:
            keys = {"decode_workers": 1, "l2_lease_seconds": 2}
            with self.nodes(self.server.bucket(), code, source, **keys) as nodes:
                started = time.perf_counter()
                seen = self.epoch_at_once(nodes, names, threads=len(names))
                seconds = time.perf_counter() - started
                stats = {name: m.stats() for name, m in nodes.items()}
            decodes = [stats[name]["decodes"] for name in NODES]
            right = sum(self.right(digests, source) for _, digests in seen.values())
            rows.append([
                label, len(names), " + ".join(map(str, decodes)), sum(decodes),
                f"**{sum(decodes) / len(names):.2f}**",
                f"{right} of {len(NODES) * len(names) ** 2}", seconds,
            ])  # fmt: skip
        return _table(
            f"The issue's scenario: {len(names)} originals of 12 MP (PNG), 3 nodes cold at "
            f"once, {len(names)} readers each, decode_workers = 1, l2_lease_seconds = 2",
            ["daemons", "originals", "decodes (n0 + n1 + n2)", "decodes", "decodes / original",
             "reads right", "s"],
            rows,
        )  # fmt: skip

    def _baseline_label(self) -> str | None:
        code = self.args.baseline
        if code is None:
            return None
        return f"{code.name}'s daemons"

    def cold(self) -> tuple[str, str]:
        """Three fresh nodes cold at once; the bucket of the first row (now full)."""
        a = self.args
        n = len(self.names)
        rows, full = [], ""
        cases: list[tuple[str, dict[str, Any], Path | None]] = [
            ("this branch (claims)", {"l2_lease_seconds": a.lease}, None),
            ("this branch, no claims (l2_lease_seconds = 0)", {"l2_lease_seconds": 0}, None),
        ]
        baseline = self._baseline_label()
        if baseline is not None:
            cases.append((baseline, {"l2_lease_seconds": a.lease}, a.baseline))
        for label, keys, code in cases:
            bucket = self.server.bucket()
            full = full or bucket
            with self.nodes(bucket, code, decode_workers=a.cold_workers, **keys) as nodes:
                started = time.perf_counter()
                seen = self.epoch_at_once(nodes)
                seconds = time.perf_counter() - started
                stats = {name: m.stats() for name, m in nodes.items()}
            decodes = [stats[name]["decodes"] for name in NODES]
            right = sum(self.right(digests) for _, digests in seen.values())
            waits = sum(s.get("l2_lease_waits", 0) for s in stats.values())
            timeouts = sum(s.get("l2_lease_timeouts", 0) for s in stats.values())
            rows.append([
                label, n, " + ".join(map(str, decodes)), f"**{sum(decodes) / n:.2f}**",
                waits, timeouts, f"{right} of {len(NODES) * a.readers * n}", seconds,
            ])  # fmt: skip
        table = _table(
            f"Three nodes cold at once, {a.readers} readers each, decode_workers = "
            f"{a.cold_workers}, l2_lease_seconds = {a.lease:g}",
            ["daemons", "originals", "decodes (n0 + n1 + n2)", "decodes / original",
             "claim waits", "waits run out", "reads right", "s"],
            rows,
        )  # fmt: skip
        return full, table

    def epoch(self, bucket: str) -> str:
        """An epoch decoded by each node, against one from L2, three nodes at once."""
        n = len(self.names)
        results = {}
        for label, l2 in (("decoding", None), ("from L2", bucket)):
            with self.nodes(l2) as nodes:
                seen = self.epoch_at_once(nodes)
                stats = {name: m.stats() for name, m in nodes.items()}
            results[label] = {
                name: (seconds, self.right(digests), stats[name]) for name, (seconds, digests)
                in seen.items()
            }  # fmt: skip
        rows = []
        for name in NODES:
            d_seconds, d_right, d_stats = results["decoding"][name]
            l_seconds, l_right, l_stats = results["from L2"][name]
            rows.append([
                name, d_stats["decodes"], d_seconds, n / d_seconds, l_stats["decodes"],
                l_stats["l2_hits"], l_seconds, n / l_seconds, f"**{d_seconds / l_seconds:.1f}x**",
                d_right == l_right == self.args.readers * n,
            ])  # fmt: skip
        fetch = results["from L2"]["n0"][2]["l2_fetch_seconds"]
        return _table(
            f"An epoch of {n} arrays on each of three fresh nodes at once: decoding it, "
            "then from L2",
            ["node", "decodes", "s", "arrays/s", "decodes (L2)", "L2 hits", "s (L2)",
             "arrays/s (L2)", "L2 / decoding", "all right"],
            rows,
            f"n0's mean L2 fetch {1000 * fetch['sum'] / max(1, fetch['count']):.1f} ms "
            "(verify and store included in the rate)",
        )  # fmt: skip

    def cut(self, bucket: str) -> str:
        """n1's link cut for the middle third of its epoch, the others reading too."""
        n = len(self.names)
        keys: dict[str, Any] = {"l2_timeout_seconds": 1, "l2_retry_seconds": 0.5}
        with self.nodes(bucket, **keys) as nodes:
            n1 = nodes["n1"]

            def progress() -> int:
                stats = n1.stats()
                return int(stats["hits"] + stats["misses"])

            with self.start_readers(nodes) as started:
                for group in started:
                    group.go()
                marks: dict[str, Any] = {}
                readers_n1 = started[list(nodes).index("n1")]
                _until(lambda: progress() >= n // 3, readers_n1)
                marks["cut"] = n1.stats()
                self.net.cut("n1")
                try:
                    _until(lambda: progress() >= 2 * n // 3, readers_n1)
                finally:
                    self.net.restore("n1")
                    restored = time.perf_counter()
                marks["restored"] = n1.stats()
                seen = {name: g.result(3600) for name, g in zip(nodes, started, strict=True)}
            # Once the epoch is read, nothing asks L2; arrays of other sizes do, until the
            # breaker's trial succeeds (if it had not yet).
            closed = n1.stats()
            probes = 0
            while closed["l2_state"] != "closed" and time.perf_counter() - restored < 300:
                size = self.args.size + 1 + probes
                (n1.mountpoint / VERSION / str(size) / self.names[0]).read_bytes()
                probes += 1
                closed = n1.stats()
            closed_after = time.perf_counter() - restored
            stats = {name: m.stats() for name, m in nodes.items()}
            stats["n1"]["decodes"] -= probes  # the epoch's own
        rows = []
        for name in NODES:
            s = stats[name]
            rows.append([
                name + (" (cut off)" if name == "n1" else ""), f"{self.right(seen[name][1])} of "
                f"{self.args.readers * n}", s["decodes"], s["l2_hits"], s["l2_breaker_opens"],
                s["l2_state"], dict(s["l2_errors"]) or "none",
            ])  # fmt: skip
        during = marks["restored"]["decodes"] - marks["cut"]["decodes"]
        after = stats["n1"]["decodes"] - marks["restored"]["decodes"]
        return _table(
            "An epoch from L2 on three fresh nodes at once; n1 cut off (ip link set down) "
            "from a third to two thirds of its reads (l2_timeout_seconds = 1, "
            "l2_retry_seconds = 0.5)",
            ["node", "reads right", "decodes", "L2 hits", "breaker opens", "breaker after",
             "L2 errors"],
            rows,
            f"n1 decoded {during} arrays while cut off, and {after} after the link came back "
            f"until its breaker's next try; that try closed it {closed_after:.1f} s after the "
            f"link came back ({probes} reads of other sizes after the epoch asked L2 meanwhile; "
            "not counted above)",
        )  # fmt: skip

    def warm(self) -> str:
        n = len(self.names)
        hosts = self.net.hosts
        bucket = self.server.bucket()
        config = self.scratch / "warm.toml"
        config.write_text(
            f'store = "{WORK}/unused"\nl2 = "s3://{bucket}/decoded"\n'
            f'l2_endpoint = "{self.server.endpoint}"\n'
            f'[versions.{VERSION}]\nsource = "{self.source}"\nsizes = [{self.args.size}]\n'
        )
        workers = [(hosts[name].command(), hosts[name].address) for name in NODES]
        scheduler = (hosts["s3"].command(), hosts["s3"].address)
        with dask_running(self.scratch / "dask", scheduler, workers) as dask:
            _wait_workers(dask, functools.partial(self.net.within, "s3"))
            started = time.perf_counter()
            command = [*DECODEFS, "warm", "--cluster", dask.address, VERSION]
            command += [str(self.args.size), "--config", str(config)]
            subprocess.run(hosts["n0"].command(*command), check=True, stdout=subprocess.DEVNULL)
            dask_seconds = time.perf_counter() - started
        dask_objects = sum(
            1 for k in self.server.objects(bucket, "decoded/") if "/.leases/" not in k
        )
        one = self.node("n0", self.server.bucket())
        try:
            started = time.perf_counter()
            command = [*DECODEFS, "warm", str(one.mountpoint), VERSION, str(self.args.size)]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            while one.stats()["l2_publish_queue"]:
                time.sleep(0.1)
            one_seconds = time.perf_counter() - started
            one_stats = one.stats()
        finally:
            one.remove()
            self.mounts.remove(one)
        return _table(
            f"Filling an empty L2 with {n} arrays",
            ["", "arrays in L2", "s", "arrays/s"],
            [
                [f"decodefs warm --cluster, {len(NODES)} Dask workers (one a node)",
                 dask_objects, dask_seconds, n / dask_seconds],
                ["decodefs warm through n0's mount (which publishes)", one_stats["l2_publishes"],
                 one_seconds, n / one_seconds],
            ],
            f"Dask / one node: {one_seconds / dask_seconds:.2f}x (all of them share this "
            "machine's cores)",
        )  # fmt: skip


def _until(condition: Callable[[], bool], group: Readers) -> None:
    while not condition():
        if group.done():
            return  # its epoch ran past the mark already
        time.sleep(0.02)


def _wait_workers(dask: Dask, within: Callable[[Callable[[], Any]], Any]) -> None:
    deadline = time.monotonic() + 120
    while dask.workers(within) < len(NODES):
        if time.monotonic() > deadline:
            raise SystemExit(f"the Dask workers did not start:\n{dask.log_tail()}")
        time.sleep(0.2)


# -- the corpus -------------------------------------------------------------------------------


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
