"""Reliability figures on real mounts, one markdown table per part.

  1 load      reader processes x random reads (np.load, open().read(), read_array) of
              small arrays, the store capped so that about 30% of reads are cold
  2 memory    processes each holding arrays open at max_size, stored and cold; one
              9000x9000 PNG: the daemon's RSS against its memory budgets; then the same
              opens of arrays the store does not take (--no-hostile-fallback: not those)
  3 kill      kill -9 of the daemon during `decodefs warm` and during a stream of misses,
              then `decodefs mount` on the same mount point: the store afterwards
  4 store     the store full, read-only at runtime (ext4 error), removed at runtime, and
              answering EIO (a fault-injecting FUSE filesystem under it)
  5 sources   the source directory unmounted and renamed at runtime
  6 fuzz      mutated JPEG and PNG originals through the mount vs the in-process decode
  7 security  another user, allow_other off and on; planted symlinks, a pre-created store

  .venv/bin/python scripts/reliability.py [--quick] [--parts 1,3] [--json FILE] [--output FILE]

Run it as root (it mounts tmpfs and ext4 file systems and runs commands as uid 65534).
It mounts daemons through the `decodefs` CLI, as a user would, in a run directory under
/tmp/decodefs-reliability; every mount, loop device and temporary directory it makes is
removed at the end of each part, pass or fail, also on Ctrl-C or SIGTERM. Exit status 1
if an invariant failed (each part lists them under "Problems").
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import hashlib
import io
import json
import multiprocessing
import os
import platform
import random
import re
import shutil
import signal
import sqlite3
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import numpy as np
import numpy.typing as npt
import PIL
import pyfuse3
import skimage.data
import trio
from PIL import Image

from decodefs import DecodeError, decode_image, npy_file_size, npy_header, read_array
from decodefs.fs import MAX_REQUEST_TASKS
from decodefs.mountinfo import mounts
from decodefs.protocol import TRAILER_SIZE
from decodefs.sample import make_sample_corpus

WORK: Final = Path(tempfile.gettempdir()) / "decodefs-reliability"
DECODEFS: Final = (sys.executable, "-m", "decodefs")
VERSION: Final = "v1"
NOBODY: Final = 65534
MIB: Final = 1 << 20
METHODS: Final = ("np.load", "open().read()", "read_array")
# A read that takes longer than this counts as a hang.
READ_TIMEOUT: Final = 60.0
# What the daemon may use beyond its two budgets (memory_cache_bytes, decode_memory_bytes):
# the interpreter and its libraries (~60 MiB idle), request buffers, and the copies of a
# decode's output that the budgets do not count (Pillow's RGBX image of the output size,
# the .npy bytes while they are built).
RSS_CONSTANT: Final = 256 * MIB
DEFAULT_MEMORY_CACHE: Final = 512 * MIB  # config.py's defaults, stated here
DEFAULT_DECODE_MEMORY: Final = 1024 * MIB
MAX_SIZE: Final = 4096
SKIMAGE_DATA: Final = Path(skimage.data.__file__).parent  # real photographs


@dataclass(frozen=True)
class Sizes:
    """How big each part runs; ``--quick`` is the test suite's version."""

    load_originals: int = 2000
    load_readers: int = 16
    load_reads: int = 10_000
    load_cold: float = 0.3
    hostile_processes: int = 64
    hostile_open: int = 30
    hostile_stored: int = 30
    hostile_cold: int = 60
    hostile_size: int = MAX_SIZE  # the configured max_size, which the opens use
    hostile_fallback: bool = True  # the same opens of arrays the store does not take
    big_png: int = 9000
    kill_trials: int = 20
    kill_originals: int = 500
    fault_reads: int = 100
    source_originals: int = 100
    fuzz_files: int = 10_000


QUICK: Final = Sizes(
    load_originals=100,
    load_readers=4,
    load_reads=150,
    hostile_processes=8,
    hostile_open=4,
    hostile_stored=3,
    hostile_cold=4,
    hostile_size=1024,
    hostile_fallback=True,
    big_png=2000,
    kill_trials=1,
    kill_originals=40,
    fault_reads=6,
    source_originals=16,
    fuzz_files=300,
)


# -- results ----------------------------------------------------------------------------


@dataclass
class Part:
    """One part's tables, its figures (for --json and the tests) and any broken invariant."""

    key: str
    title: str
    text: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    load: str = ""  # the 1-minute load average before and after: the machine is shared

    def expect(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        self.text.append(_row(header))
        self.text.append(_row(["---"] * len(header)))
        self.text += [_row(row) for row in rows]
        self.text.append("")

    def say(self, *lines: str) -> None:
        self.text += [*lines, ""]

    def markdown(self) -> str:
        lines = [f"## {self.title}", "", *self.text]
        if self.problems:
            lines += ["Problems:", "", *(f"- {p}" for p in self.problems), ""]
        lines.append(f"({self.seconds:.0f} s; load average {self.load})")
        return "\n".join(lines)


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


# -- the harness: a run directory, its mounts and its daemons -----------------------------


class HarnessError(Exception):
    """The set-up failed (not a finding about decodefs)."""


class Harness:
    """A run directory and everything made in it, undone in reverse order by ``close``."""

    def __init__(self, keep: bool = False) -> None:
        WORK.mkdir(parents=True, exist_ok=True)
        st = WORK.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise HarnessError(
                f"{WORK} must belong to uid {os.geteuid()} and be writable by no one else"
            )
        os.chmod(WORK, 0o755)  # other users traverse it in part 7
        self.root = Path(tempfile.mkdtemp(prefix="run-", dir=WORK))
        os.chmod(self.root, 0o755)
        self.keep = keep
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def on_close(self, what: str, undo: Callable[[], None]) -> None:
        self._undo.append((what, undo))

    def close(self) -> list[str]:
        """Undo everything; what could not be undone cleanly."""
        failures = []
        while self._undo:
            what, undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:
                failures.append(f"cleanup of {what}: {exc!r}")
        for point in mounts_under(self.root):
            failures.append(f"{point} was still mounted at the end")
            unmount_lazily(point)
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        return failures

    def directory(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def tmpfs(self, name: str, size: str) -> Path:
        root = self.directory(name)
        run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "decodefs-rel", root)
        self.on_close(f"tmpfs {root}", lambda: unmount_lazily(root))
        return root

    def ext4(self, name: str, size: str) -> tuple[Path, Path]:
        """An ext4 on a loop device with errors=remount-ro: (its mount point, its image)."""
        image = self.root / f"{name}.img"
        root = self.directory(name)
        run("truncate", "-s", size, image)
        run("mkfs.ext4", "-q", "-F", image)
        run("mount", "-o", "loop,errors=remount-ro", image, root)
        self.on_close(f"ext4 {root}", lambda: unmount_lazily(root))
        return root, image

    def faultfs(self, name: str) -> tuple[Path, Path]:
        """A pass-through FUSE filesystem that answers EIO when told to: (mount point,
        control file). Write "read", "write" or "read,write" to the control file to fail
        those calls on *.npy files; "none" to stop."""
        backing = self.directory(f"{name}-backing")
        mountpoint = self.directory(name)
        control = self.root / f"{name}.control"
        control.write_text("none")
        process = subprocess.Popen(
            [sys.executable, __file__, "_faultfs", str(backing), str(mountpoint), str(control)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def stop() -> None:
            unmount_lazily(mountpoint)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

        self.on_close(f"faultfs {mountpoint}", stop)
        if not wait_until(lambda: is_mounted(mountpoint) or process.poll() is not None, 30):
            raise HarnessError("the fault-injecting filesystem did not mount")
        if process.poll() is not None:
            raise HarnessError(f"faultfs exited: {process.stdout.read() if process.stdout else ''}")
        return mountpoint, control

    def daemon(
        self,
        name: str,
        sources: Mapping[str, Path],
        *,
        store: Path | None = None,
        version_settings: Mapping[str, object] | None = None,
        **settings: object,
    ) -> Daemon:
        daemon = Daemon(self.directory(name), sources, store, settings, version_settings or {})
        self.on_close(f"daemon {name}", daemon.stop)
        return daemon


class Daemon:
    """A decodefs daemon mounted and unmounted with the CLI, as a user would."""

    def __init__(
        self,
        directory: Path,
        sources: Mapping[str, Path],
        store: Path | None,
        settings: Mapping[str, object],
        version_settings: Mapping[str, object],
    ) -> None:
        self.directory = directory
        self.mountpoint = directory / "mnt"
        self.mountpoint.mkdir(exist_ok=True)
        self.store = store or directory / "store"
        self.config = directory / "config.toml"
        self.log = directory / "daemon.log"
        self.settings = {"store": self.store, **settings}
        lines = [f"{k} = {toml(v)}" for k, v in self.settings.items()]
        for version, source in sources.items():
            lines += [f"[versions.{version}]", f"source = {toml(source)}"]
            lines += [f"{k} = {toml(v)}" for k, v in version_settings.items()]
        self.config.write_text("\n".join(lines) + "\n")
        self.pid: int | None = None

    def mount(self) -> str:
        """`decodefs mount`; returns what it said on stderr (e.g. that it cleared a stale mount)."""
        result = subprocess.run(
            [*DECODEFS, "mount", str(self.mountpoint), "--config", str(self.config),
             "--log-file", str(self.log)],
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        found = re.search(r"daemon pid (\d+)", result.stdout)
        if result.returncode != 0 or found is None:
            raise HarnessError(f"decodefs mount failed: {result.stderr.strip()}")
        self.pid = int(found[1])
        return result.stderr

    def stop(self) -> None:
        """`decodefs umount` (lazily if that fails); the daemon is gone afterwards."""
        if is_mounted(self.mountpoint):
            result = subprocess.run(
                [*DECODEFS, "umount", str(self.mountpoint)],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            if result.returncode != 0:
                unmount_lazily(self.mountpoint)
        if self.pid is not None and not wait_gone(self.pid, 30):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            wait_gone(self.pid, 10)
        self.pid = None

    def kill9(self) -> None:
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        if not wait_gone(self.pid, 30):
            raise HarnessError(f"daemon {self.pid} survived SIGKILL")
        self.pid = None

    def alive(self) -> bool:
        return self.pid is not None and not wait_gone(self.pid, 0)

    def path(self, uuid: str, size: int, version: str = VERSION) -> Path:
        return self.mountpoint / version / str(size) / f"{uuid}.npy"

    def entry(self, uuid: str, size: int, version: str = VERSION) -> Path:
        """Where the store keeps that array."""
        return self.store / version / str(size) / uuid[:2] / f"{uuid}.npy"

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.mountpoint / ".decodefs/stats.json").read_bytes())
        return data

    def kib(self, name: str) -> int:
        """A figure of /proc/<pid>/status in KiB (VmRSS, VmHWM)."""
        text = Path(f"/proc/{self.pid}/status").read_text()
        found = re.search(rf"^{name}:\s+(\d+) kB", text, re.MULTILINE)
        return int(found[1]) if found else 0

    def reset_peak(self) -> None:
        """Start VmHWM afresh (proc(5): clear_refs 5)."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def log_lines(self, pattern: str) -> list[str]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return [line for line in text.splitlines() if re.search(pattern, line)]

    def errors_logged(self) -> list[str]:
        return self.log_lines(r"\b(ERROR|CRITICAL)\b|Traceback")


class Sampler:
    """The daemon's VmRSS (every 20 ms) and descriptors, and optionally its memory
    counters from stats.json, sampled on a thread while the block runs."""

    def __init__(self, daemon: Daemon, stats: bool = False) -> None:
        self._daemon = daemon
        self._stats = stats
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.rss_kib = 0
        self.fds = 0
        self.memory_bytes = 0
        self.decode_memory_bytes = 0

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.rss_kib = max(self.rss_kib, self._daemon.kib("VmRSS"))
                if tick % 10 == 0:
                    self.fds = max(self.fds, self._daemon.fds())
                if self._stats and tick % 10 == 5:
                    stats = self._daemon.stats()
                    self.memory_bytes = max(self.memory_bytes, stats["memory_bytes"])
                    self.decode_memory_bytes = max(
                        self.decode_memory_bytes, stats["decode_memory_bytes"]
                    )
            tick += 1
            self._stop.wait(0.02)


def run(*command: object, timeout: float = 300) -> str:
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise HarnessError(f"{' '.join(map(str, command))}: {result.stderr.strip()}")
    return result.stdout


def decodefs(*args: object, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DECODEFS, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False
    )


def is_mounted(path: Path) -> bool:
    target = os.path.abspath(path)
    return any(m.mountpoint == target for m in mounts())


def mounts_under(root: Path) -> list[str]:
    prefix = os.path.abspath(root) + "/"
    return sorted((m.mountpoint for m in mounts() if m.mountpoint.startswith(prefix)), key=len)[
        ::-1
    ]


def unmount_lazily(path: Path | str) -> None:
    for _ in range(5):
        if not is_mounted(Path(path)):
            return
        fstype = next((m.fstype for m in mounts() if m.mountpoint == os.path.abspath(path)), "")
        command = ["fusermount3", "-u", "-z"] if fstype.startswith("fuse") else ["umount", "-l"]
        subprocess.run([*command, str(path)], capture_output=True, check=False)


def wait_gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` has exited (a zombie counts) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state == "Z":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            if condition():
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return json.dumps(str(value))


def mib(kib: int) -> str:
    return f"{kib / 1024:,.0f} MiB"


def errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


def store_files(store: Path, version: str = VERSION) -> set[tuple[str, int, str]]:
    """(version, size, uuid) of every entry file under the store."""
    found = set()
    for path in (store / version).glob("*/*/*.npy"):
        with contextlib.suppress(ValueError):
            found.add((version, int(path.parts[-3]), path.stem))
    return found


def catalog_rows(store: Path) -> set[tuple[str, int, str]]:
    db = sqlite3.connect(store / ".catalog.sqlite3", timeout=30)
    try:
        rows = db.execute("SELECT version, size, uuid FROM entries").fetchall()
    finally:
        db.close()
    return {(v, s, os.fsdecode(bytes(u))) for v, s, u in rows}


def temp_files(store: Path) -> int:
    with contextlib.suppress(FileNotFoundError):
        return len(os.listdir(store / ".tmp"))
    return 0


def verify_store(daemon: Daemon) -> tuple[int, str]:
    """`decodefs verify CONFIG`: (exit status, its summary line)."""
    result = decodefs("verify", daemon.config)
    lines = result.stdout.strip().splitlines()
    return result.returncode, lines[-1] if lines else result.stderr.strip()


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the reference: what decode_image gives, and reading through the mount -----------------


class Reference:
    """sha256 of the pixels ``decode_image`` gives an original at a size (None: DecodeError),
    computed once."""

    def __init__(self) -> None:
        self._digests: dict[tuple[str, int], str | None] = {}
        self._lock = threading.Lock()

    def digest(self, path: Path, size: int) -> str | None:
        key = (str(path), size)
        with self._lock:
            if key in self._digests:
                return self._digests[key]
        try:
            value: str | None = pixels_digest(decode_image(path, size))
        except DecodeError:
            value = None
        with self._lock:
            self._digests[key] = value
        return value

    def fill(self, paths: Sequence[Path], size: int, workers: int = 2) -> list[str | None]:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # Pillow drops the GIL
            return list(pool.map(lambda p: self.digest(p, size), paths))


def pixels_digest(array: npt.NDArray[np.uint8]) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def read_digest(method: str, path: str, size: int) -> str:
    """sha256 of the pixels read from ``path`` with ``method``. Raises OSError for a failed
    read, ValueError if the bytes are not the .npy file of a uint8 (size, size, 3) array."""
    if method == "open().read()":
        with open(path, "rb") as f:
            data = f.read()
        header = npy_header(size)
        if len(data) != npy_file_size(size) or not data.startswith(header):
            raise ValueError(f"{len(data)} bytes, not the .npy file of a {size} array")
        return hashlib.sha256(memoryview(data)[len(header) :]).hexdigest()
    array = np.load(path) if method == "np.load" else read_array(path)
    if array.shape != (size, size, 3) or array.dtype != np.uint8:
        raise ValueError(f"read {array.dtype}{array.shape}")
    return pixels_digest(array)


@dataclass
class Tally:
    """Outcomes of checked reads: "ok", "wrong", or the error (an errno name)."""

    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    examples: list[str] = field(default_factory=list)

    @property
    def reads(self) -> int:
        return sum(self.outcomes.values())

    @property
    def bad(self) -> int:
        return self.reads - self.outcomes["ok"]

    def check(self, method: str, path: Path, size: int, want: str | None) -> str:
        """Read ``path`` and count the outcome; ``want`` None: an error is expected."""
        try:
            got = read_digest(method, str(path), size)
        except OSError as exc:
            outcome = errno_name(exc)
        except Exception as exc:
            outcome = type(exc).__name__
        else:
            outcome = "ok" if got == want else "wrong"
        self.outcomes[outcome] += 1
        if outcome != "ok" and len(self.examples) < 5:
            self.examples.append(f"{method} {path}: {outcome}")
        return outcome

    def summary(self) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in sorted(self.outcomes.items())) or "none"


def read_all(
    tally: Tally,
    daemon: Daemon,
    ref: Reference,
    originals: Sequence[Path],
    size: int,
    version: str = VERSION,
) -> None:
    """Read each original's array at ``size`` once, the methods taking turns."""
    for i, original in enumerate(originals):
        method = METHODS[i % len(METHODS)]
        tally.check(
            method, daemon.path(original.stem, size, version), size, ref.digest(original, size)
        )


# == 1. load ==============================================================================


@dataclass(frozen=True)
class LoadJob:
    directory: str
    uuids: list[str]
    digests: list[str | None]
    size: int
    reads: int
    seed: int
    start_at: float


@dataclass
class LoadResult:
    methods: dict[str, int]
    outcomes: dict[str, int]
    examples: list[str]
    latencies: list[float]
    finished: float


def load_reader(job: LoadJob, results: Queue[LoadResult]) -> None:
    """One reader process: random arrays, each read with a random method, each checked."""
    rng = random.Random(job.seed)
    tally = Tally()
    methods: collections.Counter[str] = collections.Counter()
    latencies = []
    while time.time() < job.start_at:
        time.sleep(0.005)
    for _ in range(job.reads):
        i = rng.randrange(len(job.uuids))
        method = METHODS[rng.randrange(len(METHODS))]
        started = time.perf_counter()
        tally.check(method, Path(job.directory, f"{job.uuids[i]}.npy"), job.size, job.digests[i])
        latencies.append(time.perf_counter() - started)
        methods[method] += 1
    results.put(
        LoadResult(dict(methods), dict(tally.outcomes), tally.examples, latencies, time.time())
    )


def part_load(h: Harness, sizes: Sizes) -> Part:
    part = Part("load", "1. Load")
    size = 64
    source = h.directory("load-originals")
    paths = make_sample_corpus(source, sizes.load_originals, 256, 192, seed=11)
    uuids = [p.stem for p in paths]
    digests = Reference().fill(paths, size)
    entry = npy_file_size(size) + TRAILER_SIZE
    stored = round(len(paths) * (1 - sizes.load_cold))
    d = h.daemon("load", {VERSION: source}, sizes=[size], max_store_bytes=stored * entry)
    d.mount()
    warm_list = h.root / "load-warm.txt"
    warm_list.write_text("".join(f"{u}\n" for u in uuids[:stored]))
    warmed = decodefs("warm", d.mountpoint, VERSION, size, "--uuids", warm_list)
    part.expect(warmed.returncode == 0, f"decodefs warm failed: {warmed.stderr.strip()}")

    before = d.stats()
    rss_before, fds_before = d.kib("VmRSS"), d.fds()
    d.reset_peak()
    context = multiprocessing.get_context("fork")
    results: Queue[LoadResult] = context.Queue()
    start_at = time.time() + 0.5
    readers = [
        context.Process(
            target=load_reader,
            args=(
                LoadJob(
                    str(d.mountpoint / VERSION / str(size)),
                    uuids,
                    digests,
                    size,
                    sizes.load_reads,
                    seed,
                    start_at,
                ),
                results,
            ),
            daemon=True,
        )
        for seed in range(sizes.load_readers)
    ]
    for reader in readers:
        reader.start()
    finished: list[LoadResult] = []
    with Sampler(d) as sampler:
        deadline = time.monotonic() + 60 + 0.05 * sizes.load_reads * sizes.load_readers
        while len(finished) < len(readers) and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                finished.append(results.get(timeout=1))
    if len(finished) < len(readers):
        part.problems.append(f"{len(readers) - len(finished)} readers did not finish (a hang?)")
        d.kill9()
        return part
    for reader in readers:
        reader.join(timeout=30)
    seconds = max(r.finished for r in finished) - start_at
    # Readers have exited: every descriptor a request opened must be closed again.
    wait_until(lambda: d.fds() <= fds_before, 10)
    after = d.stats()
    peak, rss_after, fds_after = d.kib("VmHWM"), d.kib("VmRSS"), d.fds()
    verify_status, verify_line = verify_store(d)

    outcomes: collections.Counter[str] = collections.Counter()
    methods: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    examples: list[str] = []
    for r in finished:
        outcomes.update(r.outcomes)
        methods.update(r.methods)
        latencies += r.latencies
        examples += r.examples
    reads = sum(outcomes.values())
    misses = after["misses"] - before["misses"]
    wrong = outcomes["wrong"]
    errors = reads - outcomes["ok"] - wrong
    bound = DEFAULT_MEMORY_CACHE + DEFAULT_DECODE_MEMORY + RSS_CONSTANT
    part.figures.update(
        reads=reads, errors=errors, wrong=wrong, misses=misses, cold_share=misses / max(1, reads),
        rss_before_kib=rss_before, rss_peak_kib=peak, rss_after_kib=rss_after,
        fds_before=fds_before, fds_peak=sampler.fds, fds_after=fds_after,
        verify_status=verify_status, seconds=seconds,
        daemon_errors_logged=len(d.errors_logged()),
    )  # fmt: skip
    part.say(
        f"{sizes.load_readers} reader processes x {sizes.load_reads:,} random reads of "
        f"{len(paths):,} originals (photo-like JPEGs of 256x192) at size {size}, each read with "
        "np.load, open().read() or read_array at random and compared with the sha256 of "
        "`decode_image`'s array. The store is capped at "
        f"{stored:,} entries ({100 * stored / len(paths):.0f}% of the arrays, warmed first), so "
        "the least recently used entries are evicted and read cold again: the share of cold "
        "reads below is measured, not set."
    )
    part.table(
        ["figure", "value"],
        [
            ["reads", f"{reads:,} ({', '.join(f'{m} {n:,}' for m, n in sorted(methods.items()))})"],
            ["errors", f"{errors:,}"],
            ["wrong arrays", f"{wrong:,}"],
            ["cold reads (misses: a decode ran or was joined)",
             f"{misses:,} ({100 * misses / max(1, reads):.1f}% of reads)"],
            ["decodes, evictions", f"{after['decodes'] - before['decodes']:,}, "
             f"{after['evictions'] - before['evictions']:,}"],
            ["wall time, reads/s", f"{seconds:.1f} s, {reads / max(seconds, 1e-9):,.0f}/s"],
            ["read latency p50 / p99 / max",
             f"{1e3 * percentile(latencies, 0.5):.2f} / {1e3 * percentile(latencies, 0.99):.1f}"
             f" / {1e3 * max(latencies, default=0):.0f} ms"],
            ["daemon RSS before / peak (VmHWM) / after",
             f"{mib(rss_before)} / {mib(peak)} / {mib(rss_after)}"],
            ["daemon open descriptors before / peak / after",
             f"{fds_before} / {sampler.fds} / {fds_after}"],
            ["`decodefs verify` afterwards", f"exit {verify_status}: {verify_line}"],
            ["ERROR lines in the daemon log", f"{len(d.errors_logged())}"],
        ],
    )  # fmt: skip
    part.expect(errors == 0, f"{errors} reads failed, e.g. {examples[:3]}")
    part.expect(wrong == 0, f"{wrong} arrays were wrong, e.g. {examples[:3]}")
    part.expect(fds_after <= fds_before, f"descriptors grew from {fds_before} to {fds_after}")
    part.expect(peak * 1024 <= bound, f"peak RSS {mib(peak)} above {bound / MIB:.0f} MiB")
    part.expect(verify_status == 0, f"decodefs verify: {verify_line}")
    part.expect(not d.errors_logged(), f"daemon logged errors: {d.errors_logged()[:3]}")
    return part


# == 2. memory under hostile opens ========================================================

_CHUNK: Final = 128 * 1024


@dataclass(frozen=True)
class HoldJob:
    paths: list[str]
    seed: int


@dataclass
class HoldResult:
    held: int
    errors: list[str]
    chunks: list[tuple[str, int, str]]  # (path, offset, sha256 of the 128 KiB read there)
    slowest_open: float


def hostile_holder(
    job: HoldJob, opened: Queue[int], release: Event, results: Queue[HoldResult]
) -> None:
    """Open every path and read 128 KiB of each at a random offset, holding all of them
    open until told to let go."""
    rng = random.Random(job.seed)
    fds, errors, chunks, slowest = [], [], [], 0.0
    for path in job.paths:
        started = time.perf_counter()
        try:
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            offset = rng.randrange(os.fstat(fd).st_size // _CHUNK) * _CHUNK
            chunks.append((path, offset, hashlib.sha256(os.pread(fd, _CHUNK, offset)).hexdigest()))
        except OSError as exc:
            errors.append(f"{path}: {exc}")
        slowest = max(slowest, time.perf_counter() - started)
    opened.put(job.seed)
    release.wait(timeout=3600)
    for fd in fds:
        os.close(fd)
    results.put(HoldResult(len(fds), errors, chunks, slowest))


@dataclass
class HoldPhase:
    label: str
    opens: int
    held: int
    errors: list[str]
    wrong_chunks: int
    chunks: int
    peak_kib: int
    held_kib: int
    memory_bytes: int
    decode_memory_bytes: int
    memory_waits: int
    decode_memory_waits: int
    slowest_open: float
    hung: bool = False


def hold_phase(
    d: Daemon,
    label: str,
    per_process: Sequence[Sequence[Path]],
    originals: Mapping[str, Path],
    size: int,
    deadline: float,
) -> HoldPhase:
    """Every process opens its arrays and holds them until all have; then all let go."""
    context = multiprocessing.get_context("fork")
    opened: Queue[int] = context.Queue()
    results: Queue[HoldResult] = context.Queue()
    release = context.Event()
    before = d.stats()
    d.reset_peak()
    holders = [
        context.Process(
            target=hostile_holder,
            args=(HoldJob([str(p) for p in paths], seed), opened, release, results),
            daemon=True,
        )
        for seed, paths in enumerate(per_process)
    ]
    for holder in holders:
        holder.start()
    ready = 0
    with Sampler(d, stats=True) as sampler:
        end = time.monotonic() + deadline
        while ready < len(holders) and time.monotonic() < end:
            with contextlib.suppress(Exception):
                opened.get(timeout=1)
                ready += 1
        held_kib = d.kib("VmRSS")
        hung = ready < len(holders)
        if hung:
            d.kill9()  # the only way to free readers blocked in open (see docs)
        release.set()
        done: list[HoldResult] = []
        while len(done) < len(holders) and time.monotonic() < end + 60:
            with contextlib.suppress(Exception):
                done.append(results.get(timeout=1))
    for holder in holders:
        holder.join(timeout=10)
        if holder.is_alive():
            holder.kill()
    after = d.stats() if d.alive() else before
    # Check every chunk read against the reference decode (one original at a time).
    wrong = checked = 0
    by_original: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for r in done:
        for path, offset, digest in r.chunks:
            by_original[Path(path).stem].append((offset, digest))
    for uuid, reads in by_original.items():
        data = npy_header(size) + decode_image(originals[uuid], size).tobytes()
        for offset, digest in reads:
            checked += 1
            wrong += hashlib.sha256(data[offset : offset + _CHUNK]).hexdigest() != digest
    return HoldPhase(
        label=label,
        opens=sum(len(p) for p in per_process),
        held=sum(r.held for r in done),
        errors=[e for r in done for e in r.errors],
        wrong_chunks=wrong,
        chunks=checked,
        peak_kib=d.kib("VmHWM") if d.alive() else sampler.rss_kib,
        held_kib=held_kib,
        memory_bytes=sampler.memory_bytes,
        decode_memory_bytes=sampler.decode_memory_bytes,
        memory_waits=after["memory_waits"] - before["memory_waits"],
        decode_memory_waits=after["decode_memory_waits"] - before["decode_memory_waits"],
        slowest_open=max((r.slowest_open for r in done), default=0.0),
        hung=hung,
    )


def big_png(path: Path, side: int) -> Path:
    """A side x side photograph (skimage's astronaut, scaled up), as a PNG."""
    astronaut = Image.open(SKIMAGE_DATA / "astronaut.png").convert("RGB")
    image = astronaut.resize((side, side), Image.Resampling.BILINEAR)
    image.save(path, compress_level=1)
    return path


def part_memory(h: Harness, sizes: Sizes) -> Part:
    part = Part("memory", "2. Memory under hostile opens")
    size = sizes.hostile_size
    count = sizes.hostile_stored + sizes.hostile_cold
    source = h.directory("memory-originals")
    paths = make_sample_corpus(source, count, 256, 192, seed=21)
    originals = {p.stem: p for p in paths}
    stored, cold = paths[: sizes.hostile_stored], paths[sizes.hostile_stored :]
    big_dir = h.directory("memory-big")
    big = big_png(big_dir / "big.png", sizes.big_png)
    d = h.daemon(
        "memory",
        {VERSION: source, "big": big_dir},
        sizes=[224],
        max_size=size,
        memory_cache_bytes=DEFAULT_MEMORY_CACHE,
        decode_memory_bytes=DEFAULT_DECODE_MEMORY,
    )
    d.mount()
    bound_kib = (DEFAULT_MEMORY_CACHE + DEFAULT_DECODE_MEMORY + RSS_CONSTANT) // 1024
    idle = d.kib("VmRSS")

    # One large original: Pillow's pixels take 8 bytes each while it decodes.
    d.reset_peak()
    tally = Tally()
    tally.check("open().read()", d.path("big", 224, "big"), 224, Reference().digest(big, 224))
    big_peak = d.kib("VmHWM")
    time.sleep(1)
    big_after = d.kib("VmRSS")

    uuids = "".join(f"{p.stem}\n" for p in stored)
    (h.root / "memory-stored.txt").write_text(uuids)
    warmed = decodefs("warm", d.mountpoint, VERSION, size, "--uuids", h.root / "memory-stored.txt")
    part.expect(warmed.returncode == 0, f"decodefs warm failed: {warmed.stderr.strip()}")
    rng = random.Random(2)

    def choose(pool: Sequence[Path]) -> list[list[Path]]:
        """hostile_open arrays per process, from a random place in the pool on."""
        chosen = []
        for _ in range(sizes.hostile_processes):
            start = rng.randrange(len(pool))
            chosen.append(
                [
                    d.path(pool[(start + j) % len(pool)].stem, size)
                    for j in range(sizes.hostile_open)
                ]
            )
        return chosen

    deadline = 120 + 2.0 * count
    phases = [
        hold_phase(d, "stored entries", choose(stored), originals, size, deadline),
        hold_phase(d, "cold entries (decoded, stored)", choose(cold), originals, size, deadline),
    ]
    part.say(
        f"{sizes.hostile_processes} processes each open {sizes.hostile_open} arrays at "
        f"max_size = {size} (the default max_size is {MAX_SIZE}; "
        f"{npy_file_size(size) / MIB:.0f} MiB each; originals are JPEGs of "
        "256x192) and read 128 KiB of each at a random offset, holding all of them open until "
        "every process has opened its own; then all close. Stored: a pool of "
        f"{len(stored)} arrays stored beforehand; cold: a pool of {len(cold)} never read before "
        "(every process starts at a random place in the pool, so most arrays have several "
        "openers). Default budgets: memory_cache_bytes = 512 MiB, decode_memory_bytes = 1 GiB; "
        f"the bound is their sum plus {RSS_CONSTANT // MIB} MiB = {bound_kib // 1024:,} MiB. "
        f"Idle daemon after mounting: {mib(idle)}. Every 128 KiB read is compared with the "
        "same bytes of `decode_image` + the .npy header."
    )
    rows: list[list[object]] = []
    for phase in phases:
        rows.append(
            [
                phase.label,
                f"{phase.held:,} of {phase.opens:,}",
                len(phase.errors),
                f"{phase.wrong_chunks} of {phase.chunks:,}",
                mib(phase.held_kib),
                mib(phase.peak_kib),
                f"{phase.memory_bytes / MIB:,.0f} MiB",
                f"{phase.memory_waits:,} / {phase.decode_memory_waits:,}",
                f"{phase.slowest_open:.1f} s",
            ]
        )
        part.expect(not phase.hung, f"{phase.label}: opens did not complete (hang)")
        part.expect(not phase.errors, f"{phase.label}: {phase.errors[:3]}")
        part.expect(phase.wrong_chunks == 0, f"{phase.label}: {phase.wrong_chunks} wrong reads")
        part.expect(phase.held == phase.opens, f"{phase.label}: {phase.held} of {phase.opens} held")
        part.expect(
            phase.peak_kib <= bound_kib, f"{phase.label}: peak RSS {mib(phase.peak_kib)} > bound"
        )
    part.table(
        ["opens of", "held open", "errors", "wrong reads", "RSS with all held", "peak RSS",
         "memory_bytes peak", "memory / decode memory waits", "slowest open"],
        rows,
    )  # fmt: skip
    peak_pixels = 8 * sizes.big_png**2
    part.table(
        ["one PNG of " f"{sizes.big_png}x{sizes.big_png} -> 224", "value"],
        [
            ["read through the mount", tally.summary()],
            ["decode memory it takes (8 bytes a pixel)", f"{peak_pixels / MIB:,.0f} MiB"],
            ["daemon RSS idle / peak / 1 s after",
             f"{mib(idle)} / {mib(big_peak)} / {mib(big_after)}"],
        ],
    )  # fmt: skip
    part.expect(tally.bad == 0, f"big PNG: {tally.summary()}")
    part.expect(big_peak <= bound_kib, f"big PNG: peak {mib(big_peak)} above the bound")
    part.expect(
        big_after <= idle + 64 * 1024, f"big PNG: RSS stayed at {mib(big_after)} after the decode"
    )
    part.expect(not d.errors_logged(), f"daemon logged errors: {d.errors_logged()[:3]}")
    part.figures.update(
        idle_kib=idle,
        bound_kib=bound_kib,
        big_peak_kib=big_peak,
        big_after_kib=big_after,
        phases=[dataclasses.asdict(p) for p in phases],
    )
    if sizes.hostile_fallback:
        memory_fallback(h, part, sizes, source, cold)
    return part


_FLOOD_THREADS: Final = MAX_REQUEST_TASKS + 100  # more than the daemon's request tasks
_FLOOD: Final = """
import os, sys, threading, time
def hold(path):
    try:
        os.open(path, os.O_RDONLY)
    except OSError:
        pass
for i in range(int(sys.argv[1])):
    threading.Thread(target=hold, args=(sys.argv[2 + i % (len(sys.argv) - 2)],)).start()
time.sleep(3600)
"""
_HOLDER: Final = """
import os, sys
fds = []
for path in sys.argv[1:]:
    try:
        fds.append(os.open(path, os.O_RDONLY))
        print("opened", flush=True)
    except OSError as exc:
        print("error", exc.errno, flush=True)
sys.stdin.readline()
"""


def memory_fallback(
    h: Harness, part: Part, sizes: Sizes, source: Path, cold: Sequence[Path]
) -> None:
    """The hostile opens again, of arrays the store does not take: another user's reads of
    a size no version lists (allow_other on), served from memory and held while open."""
    size = sizes.hostile_size
    d = h.daemon("memory-fallback", {VERSION: source}, sizes=[224], max_size=size, allow_other=True)
    d.mount()
    fit = DEFAULT_MEMORY_CACHE // (2 * npy_file_size(size))
    hit = cold[-2]
    d.path(hit.stem, 224).read_bytes()  # stored: a hit from now on
    holders = []
    for i in range(sizes.hostile_processes):
        chosen = [d.path(cold[(i + j) % len(cold)].stem, size) for j in range(sizes.hostile_open)]
        command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                   sys.executable, "-c", _HOLDER, *map(str, chosen)]  # fmt: skip
        holders.append(
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
    opened = [0] * len(holders)

    def count(i: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            opened[i] += line.startswith("opened")

    readers = [
        threading.Thread(target=count, args=(i, p), daemon=True) for i, p in enumerate(holders)
    ]
    for reader in readers:
        reader.start()
    total = sizes.hostile_processes * sizes.hostile_open
    last, quiet_since = -1, time.monotonic()
    while sum(opened) < total and time.monotonic() - quiet_since < 30:
        if sum(opened) != last:
            last, quiet_since = sum(opened), time.monotonic()
        time.sleep(0.2)
    held = sum(opened)
    stats = d.stats()
    # Someone else's cold read of a listed size, meanwhile.
    innocent: list[str] = []
    other = cold[-1]

    def read_listed() -> None:
        try:
            d.path(other.stem, 224).read_bytes()
            innocent.append("returned")
        except OSError as exc:
            innocent.append(errno_name(exc))

    bystander = threading.Thread(target=read_listed, daemon=True)
    started = time.monotonic()
    bystander.start()
    bystander.join(timeout=15)
    bystander_result = innocent[0] if innocent else "still blocked after 15 s"
    # More blocked opens than the daemon has request tasks: one process of uid 65534.
    flood = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         sys.executable, "-c", _FLOOD, str(_FLOOD_THREADS),
         *(str(d.path(p.stem, size)) for p in cold)],
        stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    holders.append(flood)
    time.sleep(10)
    hit_result = timed_read(d.path(hit.stem, 224), 10)
    stats_result = timed_read(d.mountpoint / ".decodefs/stats.json", 10)
    try:
        flooded = d.stats()
    except OSError:
        flooded = {}
    eagain = flooded.get("errors", {}).get("EAGAIN", 0)
    for process in holders:
        process.kill()
    time.sleep(2)
    stuck = [p.pid for p in holders if not wait_gone(p.pid, 0)]
    states = collections.Counter(process_state(pid) for pid in stuck)
    assert d.pid is not None
    os.kill(d.pid, signal.SIGTERM)
    stopped = wait_gone(d.pid, 25)
    if not stopped:
        d.kill9()  # the only way out: every blocked request then fails
    bystander.join(timeout=30)
    for process in holders:
        process.wait(timeout=30)
    waited = time.monotonic() - started
    part.say(
        "The same opens of arrays the store does not take: uid 65534 reads a size no version "
        f'lists ({size}; allow_other on, unlisted_sizes = "owner"), which the daemon serves '
        "from its memory cache (which the budget may reclaim: an open file holds none of it). "
        f"{sizes.hostile_processes} processes "
        f"open {sizes.hostile_open} arrays each from a pool of {len(cold)}; a decode takes "
        f"2 x {npy_file_size(size) / MIB:.0f} MiB of the 512 MiB memory budget, so {fit} run at "
        "once, and the memory cache keeps twice as many."
    )
    part.table(
        ["arrays the store does not take", "value"],
        [
            ["opens done (waiting up to 30 s without progress)", f"{held:,} of {total:,}"],
            ["stats: memory_bytes / memory_waits",
             f"{stats['memory_bytes'] / MIB:,.0f} MiB / {stats['memory_waits']:,}"],
            ["root's read of another array at a listed size (224), meanwhile",
             bystander_result],
            [f"then {_FLOOD_THREADS} more threads of uid 65534 open such arrays: root's read of "
             "a stored array (224)", hit_result],
            ["stats after the flood: memory_refills / errors.EAGAIN",
             f"{flooded.get('memory_refills', '-')} / {eagain}"],
            ["... and of `.decodefs/stats.json`", stats_result],
            ["holders after kill -9 (2 s later)",
             f"{len(stuck)} of {len(holders)} still there"
             + (f" (state {', '.join(sorted(states))})" if stuck else "")],
            ["the daemon after SIGTERM", "exited" if stopped else "still running after 25 s; "
             "killed with SIGKILL, which freed every blocked reader"],
        ],
    )  # fmt: skip
    part.expect(held == total, f"arrays the store does not take: {held} of {total} opens done")
    part.expect(bystander_result == "returned", f"a bystander's cold read: {bystander_result}")
    for what, result in (("a stored array", hit_result), ("stats.json", stats_result)):
        part.expect(result.startswith("returned"), f"while flooded, {what}: {result}")
    part.expect(not stuck, f"{len(stuck)} holders still there after kill -9")
    part.expect(stopped, "the daemon did not exit on SIGTERM")
    part.expect(not d.errors_logged(), f"daemon logged errors: {d.errors_logged()[:3]}")
    part.figures["fallback"] = {
        "opened": held, "total": total, "fit": fit, "bystander": bystander_result,
        "stuck_after_kill": len(stuck), "stopped_on_sigterm": stopped, "seconds": waited,
        "hit_while_flooded": hit_result, "stats_while_flooded": stats_result,
    }  # fmt: skip
    part.expect(
        held == total,
        f"arrays the store does not take: {total - held} opens blocked for good once {fit} "
        "arrays were held (hold-and-wait on the memory budget: docs/reliability.md, defect 1)",
    )
    part.expect(bystander_result == "returned", f"another reader's cold read: {bystander_result}")
    part.expect(stopped, "the daemon did not stop on SIGTERM")
    part.expect(
        hit_result.startswith("returned"),
        f"with {_FLOOD_THREADS} opens blocked, a stored array's read: {hit_result}",
    )


def timed_read(path: Path, timeout: float) -> str:
    """Read ``path`` on a thread: how long it took, or that it had not returned in time."""
    outcome: list[str] = []

    def read() -> None:
        started = time.monotonic()
        try:
            path.read_bytes()
            outcome.append(f"returned in {time.monotonic() - started:.2f} s")
        except OSError as exc:
            outcome.append(errno_name(exc))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer in {timeout:.0f} s"


def process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


# == 3. kill -9 ===========================================================================


@dataclass
class KillTrial:
    kind: str
    size: int
    decodes_before_kill: int
    stored_at_kill: int
    temp_left: int
    rows_without_file_at_kill: int
    files_without_row_at_kill: int
    cleared_stale: bool
    temp_after_restart: int
    verify_status: int
    verify_line: str
    reads: Tally
    corrupt_entries: int
    rows_without_file_after: int
    files_without_row_after: int


def miss_stream(d: Daemon, originals: Sequence[Path], size: int, stop: threading.Event) -> None:
    """Read every array of ``size`` in order from two threads until the daemon dies."""
    todo = iter(originals)
    lock = threading.Lock()

    def reader() -> None:
        while not stop.is_set():
            with lock:
                original = next(todo, None)
            if original is None:
                return
            try:
                d.path(original.stem, size).read_bytes()
            except OSError:
                return  # the daemon is gone

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)


class Work:
    """`decodefs warm` or a stream of misses at one size, until done or the daemon dies."""

    def __init__(self, d: Daemon, kind: str, size: int, paths: Sequence[Path]) -> None:
        self._daemon, self._size = d, size
        self._warm: subprocess.Popen[bytes] | None = None
        self._stream: threading.Thread | None = None
        if kind == "warm":
            self._warm = subprocess.Popen(
                [*DECODEFS, "warm", str(d.mountpoint), VERSION, str(size), "--jobs", "2"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            self._stream = threading.Thread(
                target=miss_stream, args=(d, paths, size, threading.Event()), daemon=True
            )
            self._stream.start()

    def until_decoded(self, count: int, since: int) -> bool:
        """Wait until the daemon has run ``count`` decodes more than ``since``."""
        return wait_until(lambda: self._daemon.stats()["decodes"] - since >= count, 120, 0.005)

    def wait(self) -> None:
        if self._warm is not None:
            self._warm.wait(timeout=600)
        if self._stream is not None:
            self._stream.join(timeout=600)


def kill_trial(
    d: Daemon, kind: str, size: int, paths: Sequence[Path], ref: Reference, rng: random.Random
) -> KillTrial:
    """Start a warm or a miss stream at ``size``, kill -9 the daemon once it has decoded a
    random number of the arrays (and a random 0-50 ms more), restart it on the same mount
    point and check the store."""
    since = d.stats()["decodes"]
    decodes = rng.randrange(1, len(paths))
    work = Work(d, kind, size, paths)
    work.until_decoded(decodes, since)
    time.sleep(rng.uniform(0, 0.05))
    d.kill9()
    work.wait()
    files, rows = store_files(d.store), catalog_rows(d.store)
    stored_at_kill = sum(1 for f in files if f[1] == size)
    temp_left = temp_files(d.store)
    said = d.mount()
    temp_after = temp_files(d.store)
    verify_status, verify_line = verify_store(d)
    tally = Tally()
    ref.fill(paths, size)
    read_all(tally, d, ref, paths, size)
    corrupt = d.stats()["corrupt_entries"]
    files_after, rows_after = store_files(d.store), catalog_rows(d.store)
    return KillTrial(
        kind=kind,
        size=size,
        decodes_before_kill=decodes,
        stored_at_kill=stored_at_kill,
        temp_left=temp_left,
        rows_without_file_at_kill=len(rows - files),
        files_without_row_at_kill=len(files - rows),
        cleared_stale="clearing stale mount" in said,
        temp_after_restart=temp_after,
        verify_status=verify_status,
        verify_line=verify_line,
        reads=tally,
        corrupt_entries=corrupt,
        rows_without_file_after=len(rows_after - files_after),
        files_without_row_after=len(files_after - rows_after),
    )


def part_kill(h: Harness, sizes: Sizes) -> Part:
    part = Part("kill", "3. kill -9")
    source = h.directory("kill-originals")
    paths = make_sample_corpus(source, sizes.kill_originals, 256, 192, seed=31)
    ref = Reference()
    d = h.daemon("kill", {VERSION: source}, sizes=[64])
    d.mount()
    rng = random.Random(3)
    trials: list[KillTrial] = []
    size = 8
    for kind in ("warm", "misses"):
        for _ in range(sizes.kill_trials):
            trials.append(kill_trial(d, kind, size, paths, ref, rng))
            size += 1
    final_status, final_line = verify_store(d)
    files, rows = store_files(d.store), catalog_rows(d.store)
    part.say(
        f"{sizes.kill_trials} trials each: `kill -9` of the daemon at a random moment during "
        f"`decodefs warm MNT v1 SIZE --jobs 2` of {len(paths)} originals (JPEGs of 256x192) or "
        "during a stream of misses of them from two reader threads: once the daemon has run a "
        f"random number (1 to {len(paths) - 1}) of the decodes, plus 0-50 ms, so that every "
        "kill lands in the middle of the work, wherever a write happens to be. Each trial uses "
        "a size not "
        "read before, so it starts cold, and the store keeps every earlier trial's entries. "
        "Then `decodefs mount` on the same mount point, `decodefs verify CONFIG`, and a read "
        "of every array of the trial's size compared with `decode_image`. Catalog: the rows of "
        "`<store>/.catalog.sqlite3` (table `entries`) against the `*.npy` files under "
        "`<store>/v1/`."
    )
    rows_out: list[list[object]] = []
    for kind in ("warm", "misses"):
        mine = [t for t in trials if t.kind == kind]
        if not mine:
            continue
        stored = sorted(t.stored_at_kill for t in mine)
        rows_out.append(
            [
                f"during {'`decodefs warm`' if kind == 'warm' else 'a stream of misses'}",
                len(mine),
                f"{min(t.decodes_before_kill for t in mine)}-"
                f"{max(t.decodes_before_kill for t in mine)} decodes in",
                f"{stored[0]}/{stored[len(stored) // 2]}/{stored[-1]} of {len(paths)}",
                sum(t.cleared_stale for t in mine),
                sum(t.temp_left for t in mine),
                sum(t.temp_after_restart for t in mine),
                sum(t.verify_status != 0 for t in mine),
                f"{sum(t.reads.bad for t in mine)} of {sum(t.reads.reads for t in mine):,}",
                sum(t.corrupt_entries for t in mine),
                f"{sum(t.rows_without_file_at_kill for t in mine)} / "
                f"{sum(t.files_without_row_at_kill for t in mine)}",
                f"{sum(t.rows_without_file_after for t in mine)} / "
                f"{sum(t.files_without_row_after for t in mine)}",
            ]
        )
    part.table(
        ["kill -9", "trials", "killed after", "entries at kill (min/median/max)",
         "restarts that cleared the stale mount", "temp files left by the kills",
         "temp files after restart", "`verify` failures", "arrays read wrong or failed",
         "corrupt entries found", "catalog rows without a file / files without a row, at kill",
         "the same, after the reads"],
        rows_out,
    )  # fmt: skip
    part.say(
        f"After all trials: `decodefs verify` exit {final_status} ({final_line}); catalog "
        f"{len(rows):,} rows, {len(files):,} files, {len(rows - files)} rows without a file, "
        f"{len(files - rows)} files without a row."
    )
    for t in trials:
        part.expect(t.cleared_stale, f"{t.kind} size {t.size}: restart did not clear a stale mount")
        part.expect(t.temp_after_restart == 0, f"{t.kind} size {t.size}: temp files after restart")
        part.expect(t.verify_status == 0, f"{t.kind} size {t.size}: verify: {t.verify_line}")
        part.expect(t.reads.bad == 0, f"{t.kind} size {t.size}: {t.reads.examples}")
        part.expect(t.corrupt_entries == 0, f"{t.kind} size {t.size}: corrupt entries served")
        part.expect(
            t.files_without_row_at_kill == 0 and t.files_without_row_after == 0,
            f"{t.kind} size {t.size}: entry files without a catalog row",
        )
    part.expect(final_status == 0, f"final verify: {final_line}")
    part.expect(not d.errors_logged(), f"daemon logged errors: {d.errors_logged()[:3]}")
    part.figures.update(
        trials=len(trials),
        temp_after_restart=sum(t.temp_after_restart for t in trials),
        verify_failures=sum(t.verify_status != 0 for t in trials),
        bad_reads=sum(t.reads.bad for t in trials),
        corrupt_entries=sum(t.corrupt_entries for t in trials),
        files_without_row=sum(
            t.files_without_row_at_kill + t.files_without_row_after for t in trials
        ),
        rows_without_file_at_kill=sum(t.rows_without_file_at_kill for t in trials),
        rows_without_file_final=len(rows - files),
        killed_mid_work=sum(0 < t.stored_at_kill < len(paths) for t in trials),
    )
    return part


# == 4. store faults ======================================================================


@dataclass
class FaultCase:
    key: str
    label: str
    store: Path
    inject: Callable[[Daemon], None]
    restore: Callable[[Daemon], None]
    injected: Callable[[], str] = lambda: ""


@dataclass
class FaultOutcome:
    fault: str
    during: Tally
    writable_during: bool
    errors: dict[str, int]
    memory_fallbacks: int
    injected: str
    recovered_in: float | None
    stored_after: int
    bad_after: int
    corrupt_entries: int
    verify_status: int
    errors_logged: int

    def row(self, n: int) -> list[object]:
        recovered = "NOT RECOVERED" if self.recovered_in is None else f"{self.recovered_in:.1f} s"
        return [
            self.fault,
            f"{self.during.reads:,}",
            f"{self.during.bad}" + (f" ({self.during.summary()})" if self.during.bad else ""),
            "yes" if self.writable_during else "no",
            ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "-",
            f"{self.memory_fallbacks:,}",
            self.injected or "-",
            recovered,
            f"{self.stored_after} of {n}",
            self.bad_after,
            self.corrupt_entries,
            f"exit {self.verify_status}",
            self.errors_logged,
        ]


def fault_case(
    h: Harness, case: FaultCase, source: Path, paths: Sequence[Path], ref: Reference, n: int
) -> FaultOutcome:
    """Reads during one fault and after it is undone; whether the store came back."""
    d = h.daemon(f"faults-{case.key}", {VERSION: source}, store=case.store, sizes=[64])
    d.mount()
    hits, fresh = paths[:n], paths[n:]
    # Stored, but never read: nothing of them is in the page cache, so reading them
    # during the fault reads the store.
    warm_list = d.directory / "hits.txt"
    warm_list.write_text("".join(f"{p.stem}\n" for p in hits))
    warmed = decodefs("warm", d.mountpoint, VERSION, 64, "--uuids", warm_list)
    if warmed.returncode != 0:
        raise HarnessError(f"decodefs warm: {warmed.stderr.strip()}")
    case.inject(d)
    during = Tally()
    read_all(during, d, ref, hits, 64)  # stored before the fault
    read_all(during, d, ref, fresh[:n], 65)  # misses during the fault
    read_all(during, d, ref, fresh[:n], 65)  # ... read again
    stats = d.stats()
    case.restore(d)
    # Recovered: the daemon says the store is writable, and a new array lands in it.
    started = time.monotonic()
    recovered_in: float | None = None
    after = Tally()
    for original in fresh[n:]:
        after.check("open().read()", d.path(original.stem, 66), 66, ref.digest(original, 66))
        if d.stats()["store_writable"] and d.entry(original.stem, 66).exists():
            recovered_in = time.monotonic() - started
            break
        if time.monotonic() - started > 30:
            break
        time.sleep(0.25)
    read_all(after, d, ref, paths[:n], 67)
    stored_after = sum(d.entry(p.stem, 67).exists() for p in paths[:n])
    read_all(after, d, ref, hits, 64)
    corrupt = d.stats()["corrupt_entries"]
    verify_status, _ = verify_store(d)
    d.stop()
    return FaultOutcome(
        fault=case.label,
        during=during,
        writable_during=stats["store_writable"],
        errors=stats["errors"],
        memory_fallbacks=stats["memory_fallbacks"],
        injected=case.injected(),
        recovered_in=recovered_in,
        stored_after=stored_after,
        bad_after=after.bad,
        corrupt_entries=corrupt,
        verify_status=verify_status,
        errors_logged=len(d.errors_logged()),
    )


def part_store(h: Harness, sizes: Sizes) -> Part:
    part = Part("store", "4. Store faults")
    n = sizes.fault_reads
    source = h.directory("faults-originals")
    paths = make_sample_corpus(source, 3 * n + 40, 256, 192, seed=41)
    ref = Reference()

    full_fs = h.tmpfs("faults-full-fs", "16m")

    def fill(_: Daemon) -> None:
        subprocess.run(["dd", "if=/dev/zero", f"of={full_fs}/filler", "bs=64k"],
                       capture_output=True, check=False)  # fmt: skip

    def unfill(_: Daemon) -> None:
        (full_fs / "filler").unlink()

    ro_fs, ro_image = h.ext4("faults-ro-fs", "64M")

    def fail_read_only(_: Daemon) -> None:
        device = run("findmnt", "-n", "-o", "SOURCE", ro_fs).strip()
        Path("/sys/fs/ext4", os.path.basename(device), "trigger_fs_error").write_text("1")

    def replace_read_only(_: Daemon) -> None:
        # ext4 refuses remount,rw once its journal is aborted: as an admin would, unmount,
        # check a copy of the image, and mount it again at the same place.
        unmount_lazily(ro_fs)
        fixed = ro_image.with_suffix(".fixed.img")
        shutil.copyfile(ro_image, fixed)
        subprocess.run(["e2fsck", "-fy", str(fixed)], capture_output=True, check=False)
        run("mount", "-o", "loop,errors=remount-ro", fixed, ro_fs)

    removed_parent = h.directory("faults-removed-parent")

    def remove(d: Daemon) -> None:
        subprocess.run(["rm", "-rf", str(d.store)], check=True)

    eio_fs, control = h.faultfs("faults-eio-fs")
    counts = h.root / "faults-eio-fs.control.counts"

    def eio_on(_: Daemon) -> None:
        control.write_text("read,write")

    def eio_off(_: Daemon) -> None:
        control.write_text("none")

    def eio_counts() -> str:
        with contextlib.suppress(OSError, ValueError):
            injected = json.loads(counts.read_text())
            return ", ".join(f"{v:,} {k}s" for k, v in sorted(injected.items()))
        return ""

    cases = [
        FaultCase("full", "full (16 MiB tmpfs filled by another file)", full_fs / "store",
                  fill, unfill),
        FaultCase("ro", "read-only at runtime (ext4 error, errors=remount-ro)", ro_fs / "store",
                  fail_read_only, replace_read_only),
        FaultCase("removed", "removed at runtime (`rm -rf` of the store)",
                  removed_parent / "store", remove, lambda _: None),
        FaultCase("eio", "EIO from the device (reads and writes of entries, fault-injecting "
                  "FUSE filesystem under the store)", eio_fs / "store", eio_on, eio_off,
                  injected=eio_counts),
    ]  # fmt: skip
    outcomes: list[FaultOutcome] = []
    for case in cases:
        try:
            outcomes.append(fault_case(h, case, source, paths, ref, n))
        except HarnessError as exc:
            part.problems.append(f"{case.label}: set-up failed: {exc}")
    part.say(
        f"Each fault on its own daemon and store: {n} arrays are stored first (`decodefs warm`, "
        "which reads nothing, so none of them is in the page cache); during the fault those "
        f"{n} are read (stored hits, read from the store) along with {n} new arrays, "
        "twice (misses, then memory hits); the fault is then undone, and the store counts as "
        "recovered once stats say `store_writable` and a new array's entry file exists; then "
        f"{n} more new arrays are read and must all be stored, and the first {n} are read "
        "again. Reads take turns with np.load, open().read() and read_array, each compared "
        "with `decode_image`."
    )
    part.table(
        ["fault", "reads during", "wrong or failed during", "store_writable during",
         "errors counted (stats)", "memory fallbacks", "EIO injected",
         "recovered (writable, new entry) after", "new arrays stored after",
         "wrong or failed after", "corrupt entries rebuilt", "`verify` after",
         "ERROR lines logged"],
        [o.row(n) for o in outcomes],
    )  # fmt: skip
    part.say(
        "The ext4 store is made read-only by `echo 1 > /sys/fs/ext4/<loop>/trigger_fs_error` "
        "(errors=remount-ro). ext4 refuses `mount -o remount,rw` once its journal is aborted, "
        "so it comes back as an admin would bring it back: `umount -l`, e2fsck of (a copy of) "
        "the image, mount again at the same path; the daemon takes it as a store replaced "
        "under it. Entries written shortly before the error were never synced and come back "
        "empty: they are the corrupt entries rebuilt. The `rm -rf` store is made again at "
        "once, because the first write after it fails with ENOENT and checks the store; "
        "otherwise the check runs every 5 s (STORE_CHECK_SECONDS). The ERROR lines are the "
        "daemon saying the store was removed or replaced."
    )
    part.say(
        'This kernel has no device-mapper (`dmsetup targets`: "/dev/mapper/control: open '
        'failed: No such device"; no dm `error` or `flakey` target) and no block-layer fault '
        "injection (no `fail_make_request` in debugfs, no `make-it-fail` in sysfs), so I/O "
        "errors come from a pass-through FUSE filesystem (pyfuse3, in this script) mounted "
        "under the store, which answers EIO to read and write requests on `*.npy` files "
        "(entries and temp files) while the fault is on. It fails the data path the way a "
        "failing device does; it does not fail the catalog's fsync or metadata operations."
    )
    for o in outcomes:
        part.expect(o.during.bad == 0, f"{o.fault}: {o.during.summary()} during the fault")
        part.expect(o.recovered_in is not None, f"{o.fault}: the store did not recover")
        part.expect(o.stored_after == n, f"{o.fault}: {o.stored_after} of {n} stored after")
        part.expect(o.bad_after == 0, f"{o.fault}: reads failed or were wrong after the fault")
        part.expect(o.verify_status == 0, f"{o.fault}: verify failed after")
    part.figures["cases"] = {
        o.fault: {
            "bad_during": o.during.bad,
            "recovered_in": o.recovered_in,
            "stored_after": o.stored_after,
            "bad_after": o.bad_after,
            "verify_status": o.verify_status,
        }
        for o in outcomes
    }
    return part


# -- the fault-injecting filesystem ------------------------------------------------------

P = ParamSpec("P")
R = TypeVar("R")


def _errno_of_oserror(
    handler: Callable[Concatenate[FaultFS, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[FaultFS, P], Coroutine[Any, Any, R]]:
    @functools.wraps(handler)
    async def wrapper(self: FaultFS, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await handler(self, *args, **kwargs)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    return wrapper


class FaultFS(pyfuse3.Operations):
    """Passes everything through to ``backing``; answers EIO to reads and/or writes of
    ``*.npy`` files while the control file says so ("read", "write", "read,write")."""

    def __init__(self, backing: str, control: str) -> None:
        super().__init__()
        self._backing = backing
        self._control = control
        self._paths: dict[int, str] = {pyfuse3.ROOT_INODE: backing}
        self._files: dict[int, str] = {}  # fh (the backing descriptor) -> path
        self._mode: tuple[str, ...] = ()
        self._checked = 0.0
        self.injected: collections.Counter[str] = collections.Counter()

    def _fault(self, operation: str, path: str) -> None:
        now = time.monotonic()
        if now - self._checked > 0.02:
            self._checked = now
            try:
                self._mode = tuple(Path(self._control).read_text().strip().split(","))
            except OSError:
                self._mode = ()
            Path(self._control + ".counts").write_text(json.dumps(self.injected))
        if operation in self._mode and path.endswith(".npy"):
            self.injected[operation] += 1
            raise pyfuse3.FUSEError(errno.EIO)

    def _attributes(self, path: str) -> pyfuse3.EntryAttributes:
        st = os.lstat(path)
        inode = pyfuse3.ROOT_INODE if path == self._backing else st.st_ino
        self._paths[inode] = path
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = inode
        entry.generation = 0
        entry.entry_timeout = entry.attr_timeout = 0
        entry.st_mode, entry.st_nlink = st.st_mode, st.st_nlink
        entry.st_uid, entry.st_gid, entry.st_rdev = st.st_uid, st.st_gid, st.st_rdev
        entry.st_size, entry.st_blksize, entry.st_blocks = st.st_size, st.st_blksize, st.st_blocks
        entry.st_atime_ns, entry.st_mtime_ns = st.st_atime_ns, st.st_mtime_ns
        entry.st_ctime_ns = st.st_ctime_ns
        return entry

    def _child(self, parent: int, name: bytes) -> str:
        return os.path.join(self._paths[parent], os.fsdecode(name))

    @_errno_of_oserror
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._attributes(self._child(parent_inode, name))

    @_errno_of_oserror
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attributes(self._paths[inode])

    @_errno_of_oserror
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        path = self._paths[inode]
        if fields.update_mode:
            os.chmod(path, stat.S_IMODE(attr.st_mode), follow_symlinks=False)
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            os.chown(path, uid, gid, follow_symlinks=False)
        if fields.update_size:
            os.truncate(path, attr.st_size)
        if fields.update_atime or fields.update_mtime:
            st = os.lstat(path)
            atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
            os.utime(path, ns=(atime, mtime), follow_symlinks=False)
        return self._attributes(path)

    @_errno_of_oserror
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return os.fsencode(os.readlink(self._paths[inode]))

    @_errno_of_oserror
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return inode

    @_errno_of_oserror
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        path = self._paths[fh]
        names = sorted(os.listdir(path))
        for i in range(start_id, len(names)):
            try:
                attributes = self._attributes(os.path.join(path, names[i]))
            except FileNotFoundError:
                continue
            if not pyfuse3.readdir_reply(token, os.fsencode(names[i]), attributes, i + 1):
                return

    async def releasedir(self, fh: int) -> None:
        pass

    @_errno_of_oserror
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name)
        os.mkdir(path, stat.S_IMODE(mode) & ~ctx.umask)
        os.chown(path, ctx.uid, ctx.gid, follow_symlinks=False)
        return self._attributes(path)

    @_errno_of_oserror
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        os.rmdir(self._child(parent_inode, name))

    @_errno_of_oserror
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        os.unlink(self._child(parent_inode, name))

    @_errno_of_oserror
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        if flags:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old = self._child(parent_inode_old, name_old)
        new = self._child(parent_inode_new, name_new)
        os.rename(old, new)
        for table in (self._paths, self._files):
            for key, path in list(table.items()):
                if path == old or path.startswith(old + "/"):
                    table[key] = new + path[len(old) :]

    @_errno_of_oserror
    async def create(
        self,
        parent_inode: int,
        name: bytes,
        mode: int,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = self._child(parent_inode, name)
        fd = os.open(path, flags | os.O_CREAT, stat.S_IMODE(mode) & ~ctx.umask)
        os.fchown(fd, ctx.uid, ctx.gid)
        self._files[fd] = path
        return pyfuse3.FileInfo(fh=fd), self._attributes(path)

    @_errno_of_oserror
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        path = self._paths[inode]
        fd = os.open(path, flags & ~os.O_CREAT)
        self._files[fd] = path
        return pyfuse3.FileInfo(fh=fd)

    @_errno_of_oserror
    async def read(self, fh: int, off: int, size: int) -> bytes:
        self._fault("read", self._files[fh])
        return os.pread(fh, size, off)

    @_errno_of_oserror
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self._fault("write", self._files[fh])
        return os.pwrite(fh, buf, off)

    async def flush(self, fh: int) -> None:
        pass

    @_errno_of_oserror
    async def fsync(self, fh: int, datasync: bool) -> None:
        os.fsync(fh)

    @_errno_of_oserror
    async def release(self, fh: int) -> None:
        self._files.pop(fh, None)
        os.close(fh)

    @_errno_of_oserror
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        vfs = os.statvfs(self._backing)
        data = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):  # fmt: skip
            setattr(data, name, getattr(vfs, name))
        return data


def faultfs_main(backing: str, mountpoint: str, control: str) -> None:
    """Serve FaultFS until unmounted (``reliability.py _faultfs BACKING MOUNTPOINT CONTROL``)."""
    operations = FaultFS(backing, control)
    pyfuse3.init(operations, mountpoint, set(pyfuse3.default_options) | {"fsname=faultfs"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)
        Path(control + ".counts").write_text(json.dumps(operations.injected))


# == 5. sources ===========================================================================


def part_sources(h: Harness, sizes: Sizes) -> Part:
    part = Part("sources", "5. Sources vanishing at runtime")
    n = sizes.source_originals
    corpus = make_sample_corpus(h.directory("sources-corpus"), 2 * n, 256, 192, seed=51)
    ref = Reference()
    rows: list[list[object]] = []
    for scenario in ("unmounted", "renamed"):
        if scenario == "unmounted":
            source = h.tmpfs("sources-fs", "64m")
        else:
            source = h.directory("sources-dir")
        for path in corpus:
            shutil.copy(path, source / path.name)
        originals = [source / p.name for p in corpus]
        d = h.daemon(f"sources-{scenario}", {VERSION: source}, sizes=[64])
        d.mount()
        stored, cold = originals[:n], originals[n:]
        before = Tally()
        read_all(before, d, ref, stored, 64)
        moved = source.with_name(source.name + ".moved")
        if scenario == "unmounted":
            run("umount", "-l", source)  # what is left is the empty directory below it
        else:
            source.rename(moved)
        lines_before = len(d.log_lines(r"WARNING"))
        hits = Tally()
        for _ in range(3):
            read_all(hits, d, ref, stored, 64)
        misses = Tally()
        for _ in range(3):  # every cold array asked three times
            for original in cold:
                misses.check("open().read()", d.path(original.stem, 64), 64, None)
        stats = d.stats()
        alive = d.alive()
        warnings_logged = d.log_lines(r"WARNING")[lines_before:]
        # Put it back: misses are decoded again.
        if scenario == "unmounted":
            run("mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "decodefs-rel", source)
            for path in corpus:
                shutil.copy(path, source / path.name)
        else:
            moved.rename(source)
        back = Tally()
        read_all(back, d, ref, cold, 64)
        rows.append(
            [
                f"source {scenario}",
                f"{hits.outcomes['ok']:,} of {hits.reads:,}",
                misses.summary(),
                f"{len(warnings_logged)} for {misses.reads:,} failed reads",
                ", ".join(f"{k} {v}" for k, v in sorted(stats["errors"].items())) or "-",
                "yes" if alive else "NO",
                f"{back.outcomes['ok']} of {back.reads}",
                len(d.errors_logged()),
            ]
        )
        part.figures[scenario] = {
            "hits_ok": hits.outcomes["ok"], "hits": hits.reads, "misses": dict(misses.outcomes),
            "log_lines": len(warnings_logged), "alive": alive, "back_ok": back.outcomes["ok"],
            "sample_lines": warnings_logged[:3],
        }  # fmt: skip
        part.expect(hits.bad == 0, f"{scenario}: stored arrays not served: {hits.examples}")
        part.expect(
            set(misses.outcomes) <= {"ENOENT", "EIO"}, f"{scenario}: misses {misses.summary()}"
        )
        part.expect(alive, f"{scenario}: the daemon died")
        part.expect(
            len(warnings_logged) <= 3, f"{scenario}: {len(warnings_logged)} log lines (a flood)"
        )
        part.expect(back.bad == 0, f"{scenario}: misses not decoded once the source is back")
        part.expect(not d.errors_logged(), f"daemon logged errors: {d.errors_logged()[:3]}")
        d.stop()
    part.say(
        f"{n} arrays are read (stored) first; then the source directory is unmounted (a tmpfs, "
        "`umount -l`: the empty directory below shows) or renamed; the stored arrays are read "
        f"three times and {n} arrays never read before three times each; then the source is "
        "put back and those are read again. Reads of stored arrays take turns with np.load, "
        "open().read() and read_array."
    )
    part.table(
        ["while the source is gone", "stored arrays served right", "cold reads", "WARNING lines "
         "logged", "errors counted (stats)", "daemon alive", "cold arrays right once back",
         "ERROR lines logged"],
        rows,
    )  # fmt: skip
    return part


# == 6. fuzzed originals ==================================================================

_SOF: Final = re.compile(rb"\xff[\xc0-\xc3\xc5-\xc7\xc9-\xcb\xcd-\xcf]")


def fuzz_seeds() -> list[tuple[str, str, bytes]]:
    """(name, extension, bytes) of real photographs, small, encoded as originals arrive."""
    photos: dict[str, Image.Image] = {
        name: Image.open(SKIMAGE_DATA / f"{name}.png")
        for name in ("astronaut", "coffee", "chelsea", "camera", "logo")
    }
    photos["rocket"] = Image.open(SKIMAGE_DATA / "rocket.jpg")
    for photo in photos.values():
        photo.thumbnail((160, 160))
    encodings: list[tuple[str, str, Image.Image, dict[str, Any]]] = [
        ("astronaut-baseline", "JPEG", photos["astronaut"], {"quality": 90}),
        ("coffee-progressive", "JPEG", photos["coffee"], {"quality": 85, "progressive": True}),
        ("chelsea-444", "JPEG", photos["chelsea"], {"quality": 95, "subsampling": 0}),
        ("camera-gray", "JPEG", photos["camera"], {"quality": 90}),
        ("rocket-cmyk", "JPEG", photos["rocket"].convert("CMYK"), {"quality": 90}),
        ("astronaut-rgb", "PNG", photos["astronaut"], {}),
        ("coffee-palette", "PNG", photos["coffee"].quantize(64), {}),
        ("camera-gray", "PNG", photos["camera"], {}),
        ("logo-alpha", "PNG", photos["logo"], {}),
        ("camera-16bit", "PNG", photos["camera"].convert("I;16"), {}),
    ]
    seeds = []
    for name, fmt, image, options in encodings:
        buffer = io.BytesIO()
        image.save(buffer, format=fmt, **options)
        seeds.append((name, "jpg" if fmt == "JPEG" else "png", buffer.getvalue()))
    return seeds


def mutate(
    data: bytes, extension: str, rng: np.random.Generator, others: Sequence[bytes]
) -> tuple[bytes, str]:
    """One seeded mutation of an original (or two or three, "several"): (the bytes, its kind)."""
    kinds = ["bytes", "bits", "truncate", "splice", "insert", "zero", "repeat", "dimensions"]
    kind = str(rng.choice([*kinds, "dimensions", "several"]))
    if kind != "several":
        return _mutate_once(data, kind, extension, rng, others), kind
    for _ in range(int(rng.integers(2, 4))):
        data = _mutate_once(data, str(rng.choice(kinds)), extension, rng, others)
    return data, kind


def _mutate_once(
    data: bytes, kind: str, extension: str, rng: np.random.Generator, others: Sequence[bytes]
) -> bytes:
    out = bytearray(data)
    n = max(1, len(out))
    if kind == "bytes":
        for _ in range(int(rng.integers(1, 17))):
            out[int(rng.integers(len(out)))] = int(rng.integers(256))
    elif kind == "bits":
        for _ in range(int(rng.integers(1, 9))):
            out[int(rng.integers(len(out)))] ^= 1 << int(rng.integers(8))
    elif kind == "truncate":
        del out[int(rng.integers(n)) :]
    elif kind == "splice":
        other = others[int(rng.integers(len(others)))]
        start, length = int(rng.integers(n)), int(rng.integers(1, 4096))
        at = int(rng.integers(max(1, len(other) - length)))
        out[start : start + length] = other[at : at + length]
    elif kind == "insert":
        at = int(rng.integers(n))
        out[at:at] = rng.integers(0, 256, int(rng.integers(1, 512)), dtype=np.uint8).tobytes()
    elif kind == "zero":
        start, length = int(rng.integers(n)), int(rng.integers(1, 2048))
        out[start : start + length] = bytes(len(out[start : start + length]))
    elif kind == "repeat":
        start = int(rng.integers(n))
        piece = out[start : start + int(rng.integers(1, 4096))]
        out[start:start] = piece * int(rng.integers(1, 4))
    else:
        return _mutate_dimensions(data, extension, rng)
    return bytes(out)


def _mutate_dimensions(data: bytes, extension: str, rng: np.random.Generator) -> bytes:
    """Another width and/or height in the header: zero, tiny, random or (one time in eight)
    huge: past max_pixels, or just under it."""
    out = bytearray(data)
    if extension == "jpg":
        found = _SOF.search(data)
        if found is None:
            return data
        offset = found.start() + 5  # marker, length (2), precision (1), then height, width
        fields, width, huge = [offset, offset + 2], 2, [9000, 9459, 16384, 65535]
    else:
        fields, width, huge = [16, 20], 4, [9000, 9459, 65536, 2**31 - 1, 2**32 - 1]
    for field_at in rng.permutation(fields)[: int(rng.integers(1, 3))]:
        if rng.random() < 0.125:
            value = int(rng.choice(huge))
        else:
            value = int(rng.choice([0, 1, 2, 7, 255, int(rng.integers(1, 4097))]))
        out[field_at : field_at + width] = value.to_bytes(width, "big")
    if extension == "png" and rng.random() < 0.7:  # Pillow checks the chunk's CRC: fix it, mostly
        out[29:33] = struct.pack(">I", zlib.crc32(bytes(out[12:29])))
    return bytes(out)


def part_fuzz(h: Harness, sizes: Sizes) -> Part:
    part = Part("fuzz", "6. Fuzzed originals")
    size = 64
    seeds = fuzz_seeds()
    source = h.directory("fuzz-originals")
    files: list[tuple[Path, str]] = []
    for i in range(sizes.fuzz_files):
        name, extension, data = seeds[i % len(seeds)]
        rng = np.random.default_rng([6, i])
        kind = "unchanged"
        if i >= len(seeds):  # the first of each seed stays intact: the control
            data, kind = mutate(data, extension, rng, [s[2] for s in seeds])
        path = source / f"fz{i:05d}-{name}-{kind}.{extension}"
        path.write_bytes(data)
        files.append((path, kind))

    # What decode_image says in this process, for every file.
    expected: dict[str, str | None] = {}
    other_exceptions: list[str] = []
    slowest_local = 0.0

    def local(path: Path) -> None:
        nonlocal slowest_local
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected[path.name] = pixels_digest(decode_image(path, size))
        except DecodeError:
            expected[path.name] = None
        except Exception as exc:  # decode_image promises DecodeError for a bad original
            expected[path.name] = None
            other_exceptions.append(f"{path.name}: {type(exc).__name__}: {exc}")
        slowest_local = max(slowest_local, time.perf_counter() - started)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(local, [p for p, _ in files]))

    d = h.daemon("fuzz", {VERSION: source}, sizes=[size])
    d.mount()
    idle = d.kib("VmRSS")
    d.reset_peak()
    outcomes: collections.Counter[str] = collections.Counter()
    mismatches: list[str] = []
    deaths = 0
    slowest, slowest_name = 0.0, ""
    lock = threading.Lock()

    def through_mount(item: tuple[Path, str]) -> None:
        nonlocal deaths, slowest, slowest_name
        path, _ = item
        want = expected[path.name]
        started = time.perf_counter()
        try:
            with open(d.path(path.stem, size), "rb") as f:
                data = f.read()
            header = npy_header(size)
            ok = len(data) == npy_file_size(size) and data.startswith(header)
            got: str | None = hashlib.sha256(data[len(header) :]).hexdigest() if ok else "bad npy"
            outcome = "same array" if got == want else "DIFFERENT BYTES"
        except OSError as exc:
            got, outcome = None, errno_name(exc)
            if outcome == "EIO" and want is None:
                outcome = "EIO, as decode_image fails"
        seconds = time.perf_counter() - started
        with lock:
            if seconds > slowest:
                slowest, slowest_name = seconds, path.name
            outcomes[outcome] += 1
            if outcome not in ("same array", "EIO, as decode_image fails"):
                mismatches.append(f"{path.name}: mount {outcome}, decode_image "
                                  f"{'array' if want else 'DecodeError'}")  # fmt: skip
            if outcome in ("ENOTCONN", "ECONNABORTED"):
                deaths += 1

    started = time.monotonic()
    with Sampler(d) as sampler, concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(through_mount, item) for item in files]
        for future in futures:
            try:
                future.result(timeout=READ_TIMEOUT + 600)
            except concurrent.futures.TimeoutError:
                part.problems.append("a read did not return: killing the daemon")
                d.kill9()
                break
    seconds = time.monotonic() - started
    alive = d.alive()
    peak = d.kib("VmHWM") if alive else sampler.rss_kib
    stats = d.stats() if alive else {}
    bound_kib = (DEFAULT_MEMORY_CACHE + DEFAULT_DECODE_MEMORY + RSS_CONSTANT) // 1024
    kinds = collections.Counter(kind for _, kind in files)
    decoded = sum(1 for v in expected.values() if v is not None)
    part.say(
        f"{len(files):,} originals: {len(seeds)} real photographs from skimage.data "
        "(at most 160x160) encoded as JPEG (baseline, progressive, 4:4:4, gray, CMYK) and PNG "
        "(RGB, palette, gray, RGBA, 16-bit), the first of each left intact and every other one "
        "mutated from a seeded numpy RNG (reproducible: `np.random.default_rng([6, i])`): "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(kinds.items()))
        + '. "dimensions" rewrites the header\'s width and/or height (JPEG SOF, PNG IHDR '
        "with its CRC fixed 70% of the time) to 0, tiny, random, or one time in eight huge "
        "(past max_pixels, or just under it). Each "
        f"is read once through the mount at size {size} (two reader threads) and compared with "
        f"`decode_image` of the same file in this process ({decoded:,} decode, "
        f"{len(files) - decoded:,} raise DecodeError)."
    )
    part.table(
        ["figure", "value"],
        [
            ["outcomes through the mount",
             ", ".join(f"{k} {v:,}" for k, v in sorted(outcomes.items()))],
            ["mismatches with decode_image", f"{len(mismatches)}"],
            ["decode_image raising something other than DecodeError", f"{len(other_exceptions)}"],
            ["daemon deaths", f"{deaths}" + ("" if alive else " (the daemon is gone)")],
            ["slowest read through the mount (hang bound 60 s)",
             f"{slowest:.2f} s ({slowest_name})"],
            ["slowest decode_image in process", f"{slowest_local:.2f} s"],
            ["wall time", f"{seconds:.0f} s"],
            ["daemon RSS idle / peak (bound)",
             f"{mib(idle)} / {mib(peak)} ({bound_kib // 1024:,} MiB)"],
            ["decode_errors / decode_memory_waits (stats)",
             f"{stats.get('decode_errors', '-')} / {stats.get('decode_memory_waits', '-')}"],
            ["ERROR lines in the daemon log", f"{len(d.errors_logged())}"],
        ],
    )  # fmt: skip
    if mismatches or other_exceptions:
        part.say("Mismatches: " + "; ".join((mismatches + other_exceptions)[:10]))
    part.expect(not mismatches, f"{len(mismatches)} mismatches, e.g. {mismatches[:3]}")
    part.expect(not other_exceptions, f"decode_image raised: {other_exceptions[:3]}")
    part.expect(deaths == 0 and alive, "the daemon died")
    part.expect(slowest < READ_TIMEOUT, f"a read took {slowest:.0f} s")
    part.expect(peak <= bound_kib, f"peak RSS {mib(peak)} above the bound")
    part.expect(not d.errors_logged(), f"daemon logged errors: {d.errors_logged()[:3]}")
    part.figures.update(
        files=len(files), outcomes=dict(outcomes), mismatches=len(mismatches),
        other_exceptions=len(other_exceptions), deaths=deaths, alive=alive,
        slowest_read=slowest, peak_kib=peak, bound_kib=bound_kib,
    )  # fmt: skip
    return part


# == 7. security ==========================================================================

_READ_ARRAY: Final = (
    "import sys; from decodefs import read_array; "
    "sys.stdout.buffer.write(read_array(sys.argv[1]).tobytes())"
)


def as_nobody(*command: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *map(str, command)],
        capture_output=True,
        timeout=120,
        check=False,
    )


def outcome_of(result: subprocess.CompletedProcess[bytes], want: bytes | None = None) -> str:
    """Whether it worked ("yes", and whether the bytes are right) or the error it met."""
    if result.returncode == 0:
        if want is None:
            return "yes"
        return "yes, right bytes" if result.stdout == want else "yes, WRONG BYTES"
    text = result.stderr.decode(errors="replace")
    for needle, name in (
        ("Permission denied", "EACCES"),
        ("PermissionError", "EACCES"),
        ("Read-only file system", "EROFS"),
        ("Operation not permitted", "EPERM"),
        ("No such file", "ENOENT"),
    ):
        if needle in text:
            return f"no: {name}"
    return f"no: {text.strip().splitlines()[-1] if text.strip() else result.returncode}"


def part_security(h: Harness, sizes: Sizes) -> Part:
    part = Part("security", "7. Security: another local user (uid 65534)")
    source = h.directory("security-originals")
    paths = make_sample_corpus(source, 3, 256, 192, seed=71)
    ref = {p.stem: decode_image(p, 64) for p in paths}
    stored, cold, other = (p.stem for p in paths)
    columns: dict[bool, dict[str, str]] = {}
    for allow_other in (False, True):
        d = h.daemon(
            f"security-{allow_other}", {VERSION: source}, sizes=[64], allow_other=allow_other
        )
        d.mount()
        d.path(stored, 64).read_bytes()  # stored by root
        want_npy = {u: npy_header(64) + a.tobytes() for u, a in ref.items()}
        entry = d.entry(stored, 64)
        entries_before = d.stats()["store_entries"]
        unlisted = outcome_of(as_nobody("cat", d.path(other, 100)), want_npy_100(paths, other))
        entries_after = d.stats()["store_entries"]
        if unlisted.startswith("yes"):
            unlisted += ", stored" if entries_after > entries_before else ", not stored"
        cells = {
            "list the mount (`ls MNT`)": outcome_of(as_nobody("ls", d.mountpoint)),
            "read a stored array (`cat`)": outcome_of(
                as_nobody("cat", d.path(stored, 64)), want_npy[stored]
            ),
            "read a cold array (`cat`; decoded for them)": outcome_of(
                as_nobody("cat", d.path(cold, 64)), want_npy[cold]
            ),
            "`read_array` of a stored array": outcome_of(
                as_nobody(sys.executable, "-c", _READ_ARRAY, d.path(stored, 64)),
                ref[stored].tobytes(),
            ),
            "read `.decodefs/stats.json`": outcome_of(
                as_nobody("cat", d.mountpoint / ".decodefs/stats.json")
            ),
            "read a size no version lists (100)": unlisted,
            "list the store (`ls STORE`)": outcome_of(as_nobody("ls", d.store)),
            "read a store entry file (`cat`)": outcome_of(as_nobody("cat", entry)),
            "list `STORE/.index`": outcome_of(as_nobody("ls", d.store / ".index")),
            "create a file in the mount": outcome_of(
                as_nobody("touch", d.mountpoint / VERSION / "64" / "new.npy")
            ),
            "append to an array": outcome_of(
                as_nobody("sh", "-c", f"echo x >> '{d.path(stored, 64)}'")
            ),
            "remove an array": outcome_of(as_nobody("rm", "-f", d.path(stored, 64))),
            "make a directory in the mount": outcome_of(
                as_nobody("mkdir", d.mountpoint / VERSION / "x")
            ),
            "create a file in the store": outcome_of(
                as_nobody("touch", d.store / VERSION / "planted")
            ),
            "plant a symlink in the store": outcome_of(
                as_nobody("ln", "-s", "/etc", d.store / VERSION / "64" / "zz")
            ),
            "append to a store entry file": outcome_of(
                as_nobody("sh", "-c", f"echo x >> '{entry}'")
            ),
        }
        intact = entry.read_bytes()[: len(want_npy[stored])] == want_npy[stored]
        cells["the store entry afterwards"] = "intact" if intact else "CHANGED"
        columns[allow_other] = cells
        part.expect(not d.errors_logged(), f"daemon logged errors: {d.errors_logged()[:3]}")
        d.stop()
    actions = list(columns[False])
    part.say(
        "Each action is run with `setpriv --reuid=65534 --regid=65534 --clear-groups`, against "
        "a root daemon mounted with allow_other off and on (the store's modes follow it: "
        "0700/0600 off, 0755/0644 on)."
    )
    part.table(
        ["as uid 65534", "allow_other = false", "allow_other = true"],
        [[a, columns[False][a], columns[True][a]] for a in actions],
    )
    writes = [a for a in actions if a.split()[0] in ("create", "append", "remove", "make", "plant")]
    for allow_other, cells in columns.items():
        for action in writes:
            part.expect(
                cells[action].startswith("no"), f"allow_other={allow_other}: {action} succeeded"
            )
        part.expect(cells["the store entry afterwards"] == "intact", "a store entry changed")
        for action in actions:
            part.expect("WRONG" not in cells[action], f"{action}: wrong bytes")
    off, on = columns[False], columns[True]
    part.expect(off["read a stored array (`cat`)"].startswith("no"), "allow_other off: read")
    part.expect(off["read a store entry file (`cat`)"].startswith("no"), "allow_other off: store")
    part.expect(on["read a stored array (`cat`)"] == "yes, right bytes", "allow_other on: read")
    part.expect(
        on["`read_array` of a stored array"] == "yes, right bytes", "allow_other on: read_array"
    )
    part.figures["columns"] = {str(k): v for k, v in columns.items()}

    refusals = security_refusals(h, source)
    part.say(
        "Stores prepared by someone else: `decodefs mount` (as root) of a config whose store "
        "is set up as below, each next to a directory of root's that holds one file (the "
        "victim)."
    )
    part.table(["store set-up", "exit", "what it said", "mounted", "victim"], refusals)
    for row in refusals:
        part.expect(row[1] == 1, f"{row[0]}: exit {row[1]}")
        part.expect(row[3] == "no", f"{row[0]}: it mounted")
        part.expect(row[4] == "untouched", f"{row[0]}: the victim changed")
    part.figures["refusals"] = [[str(c) for c in row] for row in refusals]
    return part


def want_npy_100(paths: Sequence[Path], uuid: str) -> bytes:
    original = next(p for p in paths if p.stem == uuid)
    return npy_header(100) + decode_image(original, 100).tobytes()


def security_refusals(h: Harness, source: Path) -> list[list[object]]:
    def precreated(base: Path, victim: Path) -> Path:
        store = base / "store"
        store.mkdir()
        (store / ".tmp").symlink_to(victim)
        (store / VERSION).symlink_to(victim)
        for path in (store, store / ".tmp", store / VERSION):
            os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
        return store

    def symlinked(base: Path, victim: Path) -> Path:
        store = base / "store"
        store.symlink_to(victim)
        os.chown(store, NOBODY, NOBODY, follow_symlinks=False)
        return store

    def planted(base: Path, victim: Path) -> Path:
        store = base / "store"
        store.mkdir(mode=0o700)
        (store / VERSION).symlink_to(victim)
        return store

    def world_writable(base: Path, victim: Path) -> Path:
        store = base / "store"
        store.mkdir()
        os.chmod(store, 0o777)
        return store

    def open_parent(base: Path, victim: Path) -> Path:
        parent = base / "shared"
        parent.mkdir()
        os.chmod(parent, 0o777)  # not sticky: anyone may swap what is in it
        return parent / "store"

    setups: list[tuple[str, Callable[[Path, Path], Path]]] = [
        ("pre-created by uid 65534 in a sticky directory, `.tmp` and `v1` symlinks to the victim",
         precreated),
        ("the store path is a symlink of uid 65534 to the victim", symlinked),
        ("root's store with a symlink planted in it (`v1` -> the victim)", planted),
        ("root's store, mode 0777", world_writable),
        ("under a directory anyone may write to (0777, not sticky)", open_parent),
    ]  # fmt: skip
    rows: list[list[object]] = []
    for i, (label, setup) in enumerate(setups):
        base = h.directory(f"refuse-{i}")
        os.chmod(base, 0o1777)  # like /tmp
        victim = h.directory(f"refuse-{i}-victim")
        (victim / "precious").write_text("keep me")
        store = setup(base, victim)
        d = h.daemon(f"refuse-{i}-daemon", {VERSION: source}, store=store, sizes=[64])
        result = decodefs("mount", d.mountpoint, "--config", d.config, "--log-file", d.log)
        line = (result.stderr.strip().splitlines() or ["(nothing)"])[0]
        line = line.replace(str(h.root), "RUN")
        mounted = is_mounted(d.mountpoint)
        if mounted:
            found = re.search(r"daemon pid (\d+)", result.stdout)
            d.pid = int(found[1]) if found else None
        rows.append(
            [
                label,
                result.returncode,
                f"`{line}`",
                "YES" if mounted else "no",
                "untouched" if os.listdir(victim) == ["precious"] else "CHANGED",
            ]
        )
    return rows


# == main =================================================================================

PARTS: Final[dict[str, Callable[[Harness, Sizes], Part]]] = {
    "1": part_load,
    "2": part_memory,
    "3": part_kill,
    "4": part_store,
    "5": part_sources,
    "6": part_fuzz,
    "7": part_security,
}


def machine() -> str:
    kernel = platform.release()
    return (
        f"{os.cpu_count()} cores, kernel {kernel}, Python {platform.python_version()}, "
        f"Pillow {PIL.__version__}, numpy {np.__version__}, pyfuse3 {pyfuse3.__version__}"
    )


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "_faultfs":
        faultfs_main(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the short version (the test suite's)")
    parser.add_argument("--parts", default=",".join(PARTS), help="e.g. 1,3 (default: all)")
    parser.add_argument("--json", type=Path, help="write every part's figures here")
    parser.add_argument("--output", type=Path, help="write the markdown here too")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    for f in dataclasses.fields(Sizes):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, type=type(f.default), default=None)
    args = parser.parse_args()
    base = QUICK if args.quick else Sizes()
    sizes = dataclasses.replace(
        base, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)
                 if getattr(args, f.name) is not None}
    )  # fmt: skip
    if os.geteuid() != 0:
        parser.error("run it as root (it mounts file systems and runs commands as uid 65534)")
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")

    def stop(signum: int, _: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through every cleanup

    signal.signal(signal.SIGTERM, stop)
    command = " ".join(["scripts/reliability.py", *sys.argv[1:]])
    header = [
        "# decodefs reliability figures",
        "",
        f"`{command}` on {time.strftime('%Y-%m-%d')}; {machine()}.",
        f"Sizes: {dataclasses.asdict(sizes)}",
        "",
    ]
    print("\n".join(header), flush=True)
    report: dict[str, Any] = {
        "command": command,
        "machine": machine(),
        "sizes": dataclasses.asdict(sizes),
        "parts": {},
    }
    markdown = list(header)
    failed = False
    for key in chosen:
        started, load = time.monotonic(), os.getloadavg()[0]
        harness = Harness(keep=args.keep)
        report.setdefault("run_directories", []).append(str(harness.root))
        try:
            part = PARTS[key](harness, sizes)
        except Exception:
            part = Part(key, f"{key}. (crashed)", problems=[traceback.format_exc()])
        finally:
            cleanup = harness.close()
        part.problems += cleanup
        part.seconds = time.monotonic() - started
        part.load = f"{load:.1f} -> {os.getloadavg()[0]:.1f}"
        failed = failed or bool(part.problems)
        text = part.markdown()
        print(text + "\n", flush=True)
        markdown.append(text + "\n")
        report["parts"][part.key] = {
            "title": part.title,
            "figures": part.figures,
            "problems": part.problems,
            "seconds": part.seconds,
            "markdown": text,
        }
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str))
        if args.output:
            args.output.write_text("\n".join(markdown))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
