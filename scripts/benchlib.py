"""What the benchmark scripts share: their work directory and a daemon run through the CLI.

A ``BenchMount`` is a fresh run directory under WORK holding a config for one
version named ``bench``, its mount point and (unless given) its store. It is
mounted and unmounted with ``decodefs mount`` / ``decodefs umount``, as a user
would, as often as a benchmark needs; ``mounted`` does it once and cleans up.
``loader_corpus`` is the corpus bench_loader.py and bench_copy.py share: originals,
a filled store and the same arrays packed in one file, all kept between runs.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import numpy as np

from decodefs import list_keys, read_array
from decodefs.sample import make_sample_corpus

__all__ = [
    "DECODEFS",
    "VERSION",
    "WORK",
    "BenchMount",
    "ffcv_loader",
    "ffcv_write",
    "loader_corpus",
    "loader_originals",
    "mounted",
    "optional",
]

WORK: Final = Path(tempfile.gettempdir()) / "decodefs-bench"
DECODEFS: Final = [sys.executable, "-m", "decodefs"]
VERSION: Final = "bench"


class BenchMount:
    def __init__(
        self,
        source: Path,
        sizes: Sequence[int],
        store: Path | None = None,
        settings: Mapping[str, object] | None = None,
        version_settings: Mapping[str, object] | None = None,
        wrapper: Sequence[str] = (),
        code: Path | None = None,
    ) -> None:
        """``settings``: top-level config keys; ``version_settings``: keys of the version;
        ``wrapper``: what the mount command runs under (e.g. nsenter into a network
        namespace); ``code``: another checkout whose decodefs the daemon runs."""
        WORK.mkdir(parents=True, exist_ok=True)
        self.wrapper = list(wrapper)
        self.code = code
        self.directory = Path(tempfile.mkdtemp(prefix="run-", dir=WORK))
        self.mountpoint = self.directory / "mnt"
        self.mountpoint.mkdir()
        self.store = store or self.directory / "store"
        self.config = self.directory / "config.toml"
        top = {"store": self.store, **(settings or {})}
        self.standby = bool(top.get("standby", True))
        version = {"source": source, "sizes": list(sizes), **(version_settings or {})}
        self.config.write_text(
            "".join(f"{k} = {_toml(v)}\n" for k, v in top.items())
            + f"[versions.{VERSION}]\n"
            + "".join(f"{k} = {_toml(v)}\n" for k, v in version.items())
        )

    def mount(self, *, settle: bool = True) -> None:
        """``decodefs mount``; then, if ``settle``, wait until the mount settled."""
        log = self.directory / "daemon.log"
        subprocess.run(
            [
                *self.wrapper,
                *DECODEFS,
                *("mount", self.mountpoint, "--config", self.config, "--log-file", log),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            # The command is the checkout's (`python -m` looks in the working directory
            # first); its daemon starts from / with -P, and finds the checkout through
            # PYTHONPATH (which -P keeps).
            cwd=self.code,
            env={**os.environ, "PYTHONPATH": str(self.code)} if self.code else None,
        )
        if settle:
            self.settle()

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until the mount serves with its standby ready (one is configured): while a
        standby prepares (at nice 10) it takes CPU, and reads code from the disk, that
        whatever the benchmark times first would be measured with."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.stats()
            if (stats.get("standby_pid") or not self.standby) and stats.get(
                "holder_state"
            ) == "serving":
                return
            time.sleep(0.05)
        raise RuntimeError(f"the mount at {self.mountpoint} did not settle in {timeout:.0f} s")

    def unmount(self) -> None:
        subprocess.run([*DECODEFS, "umount", self.mountpoint], check=False, capture_output=True)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = json.loads(
            (self.mountpoint / ".decodefs" / "stats.json").read_bytes()
        )
        return stats

    def arrays(self, size: int) -> Path:
        """The mount's directory of the version's arrays of ``size``."""
        return self.mountpoint / VERSION / str(size)

    def remove(self) -> None:
        """Unmount if mounted, and delete the run directory (and a store inside it)."""
        self.unmount()
        shutil.rmtree(self.directory, ignore_errors=True)


@contextmanager
def mounted(
    source: Path,
    sizes: Sequence[int],
    store: Path | None = None,
    settings: Mapping[str, object] | None = None,
    version_settings: Mapping[str, object] | None = None,
) -> Iterator[BenchMount]:
    """A fresh BenchMount, mounted; unmounted and removed afterwards."""
    bench = BenchMount(source, sizes, store, settings, version_settings)
    try:
        bench.mount()
        yield bench
    finally:
        bench.remove()


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))  # a basic TOML string: JSON escapes are TOML escapes


# -- memory cgroups (cgroup v1), for stores bigger than memory ---------------------------

CGROUP_ROOT: Final = Path("/sys/fs/cgroup/memory")


@contextmanager
def cgroup(limit_bytes: int | None) -> Iterator[Path]:
    """This process (and so every process it starts) in a fresh memory cgroup."""
    group = CGROUP_ROOT / f"decodefs-bench-{os.getpid()}"
    group.mkdir()
    try:
        if limit_bytes is not None:
            (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        (group / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield group
        finally:
            (CGROUP_ROOT / "cgroup.procs").write_text(str(os.getpid()))
    finally:
        for _ in range(100):  # its daemon may take a moment to leave it
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def page_cache_bytes(group: Path) -> int:
    for line in (group / "memory.stat").read_text().splitlines():
        name, value = line.split()
        if name == "total_cache":
            return int(value)
    raise RuntimeError(f"no total_cache in {group}/memory.stat")


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def loader_originals(count: int) -> Path:
    """Where bench_loader.py's ``count`` originals are made and kept."""
    return WORK / f"loader-originals-{count}"


@contextmanager
def loader_corpus(count: int, size: int) -> Iterator[tuple[BenchMount, list[str], Path]]:
    """bench_loader.py's corpus: ``count`` originals mounted, its store holding every array of
    ``size`` (filled once by decodefs warm) and the arrays packed in one file; the
    originals, store and packed file are kept under the bench directory for the next run."""
    originals = loader_originals(count)
    make_sample_corpus(originals, count, 640, 480, seed=20)
    bench = BenchMount(originals, [size], store=WORK / f"loader-store-{count}")
    try:
        bench.mount()
        keys = list_keys(bench.mountpoint, VERSION, size)
        assert len(keys) == count, f"{len(keys)} keys for {count} originals"
        if bench.stats()["store_entries"] < count:
            print(f"filling {bench.store} with decodefs warm ...", flush=True)
            subprocess.run([*DECODEFS, "warm", bench.mountpoint, VERSION, str(size)], check=True)
        yield bench, keys, pack(bench, keys, size)
    finally:
        bench.remove()  # the store is outside the run directory: kept


def pack(bench: BenchMount, keys: list[str], size: int) -> Path:
    """The arrays in one .npy file, in key order (kept beside the store)."""
    path = WORK / f"loader-packed-{len(keys)}-{size}.npy"
    if not path.exists():
        partial = path.with_suffix(".partial")
        out = np.lib.format.open_memmap(partial, "w+", np.uint8, (len(keys), size, size, 3))
        for i, key in enumerate(keys):
            out[i] = read_array(bench.arrays(size) / f"{key}.npy")
        out.flush()
        del out
        partial.rename(path)
    return path


def ffcv_write(path: Path, dataset: Any, mode: str, size: int, workers: int) -> None:
    """A .beton at ``path`` of ``dataset``'s (array, int) items, written by FFCV's
    DatasetWriter: an "image" RGBImageField in ``mode`` ("raw" or "jpg") and a "label"."""
    fields, writer = (importlib.import_module(f"ffcv.{name}") for name in ("fields", "writer"))
    written = {
        "image": fields.RGBImageField(write_mode=mode, max_resolution=size),
        "label": fields.IntField(),
    }
    writer.DatasetWriter(str(path), written, num_workers=workers).from_indexed_dataset(dataset)


def ffcv_loader(path: Path, batch: int, workers: int) -> Any:
    """FFCV's Loader over ``ffcv_write``'s .beton, shuffled, as its docs show it: batches of
    (uint8 images [N, H, W, 3], labels [N, 1]), read by ``workers`` threads."""
    loader, decoders, transforms = (
        importlib.import_module(f"ffcv.{name}")
        for name in ("loader", "fields.decoders", "transforms")
    )
    return loader.Loader(
        str(path),
        batch_size=batch,
        num_workers=workers,
        order=loader.OrderOption.RANDOM,
        drop_last=False,
        os_cache=True,
        pipelines={
            "image": [decoders.SimpleRGBImageDecoder(), transforms.ToTensor()],
            "label": [decoders.IntDecoder(), transforms.ToTensor()],
        },
    )


def optional(name: str) -> ModuleType | None:
    """A peer's module if it imports here; else None, and the reason is printed."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        print(f"{name}: not installed here, left out ({exc})", flush=True)
        return None
