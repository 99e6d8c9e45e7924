"""The run's harness: sizes, a part's report, a run directory with its mounts and daemons,
and a sampler of a daemon's memory. It knows no part and checks nothing about decodefs."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from decodefs.common.mounts import mounts
from tests.helpers import decodefs, is_mounted, unmount_quietly, wait_until

T = TypeVar("T")

REPO: Final = Path(__file__).resolve().parents[2]
WORK: Final = Path(tempfile.gettempdir()) / "decodefs-reliability"
DECODEFS: Final = (sys.executable, "-m", "decodefs")
VERSION: Final = "v1"
MIB: Final = 1 << 20
# What the daemon may use beyond its two budgets (memory_cache_bytes, decode_memory_bytes):
# the interpreter and its libraries (~60 MiB idle), request buffers, and the copies of a
# decode's output that the budgets do not count (Pillow's RGBX image of the output size,
# the .npy bytes while they are built).
RSS_CONSTANT: Final = 256 * MIB
DEFAULT_MEMORY_CACHE: Final = 512 * MIB  # config.py's defaults, stated here
DEFAULT_DECODE_MEMORY: Final = 1024 * MIB
BOUND_KIB: Final = (DEFAULT_MEMORY_CACHE + DEFAULT_DECODE_MEMORY + RSS_CONSTANT) // 1024
MAX_SIZE: Final = 4096
SETTLED: Final = 10  # samples (200 ms) of a steady RSS: see Sampler.settled


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


# -- a part's report ------------------------------------------------------------------


@dataclass
class Part:
    """One part's tables, its figures (for --json and the tests) and every broken invariant.

    An invariant goes through ``check`` (or ``wait``): a failed one is a problem, and any
    problem makes the run exit 1. A figure that is only shown checks nothing."""

    key: str
    title: str
    text: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    load: str = ""  # the 1-minute load average before and after: the machine is shared

    def check(self, ok: object, problem: str) -> bool:
        """Record ``problem`` unless ``ok``; whether it held."""
        if not ok:
            self.problems.append(problem)
        return bool(ok)

    def wait(self, predicate: Callable[[], T], timeout: float, what: str) -> T | None:
        """Wait for ``predicate`` (tests.helpers.wait_until); on timeout the part has a
        problem naming what it waited for and the last value seen, and this returns None."""
        try:
            return wait_until(predicate, timeout, what)
        except AssertionError as exc:
            self.problems.append(str(exc))
            return None

    def table(self, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        self.text.append(markdown_row(header))
        self.text.append(markdown_row(["---"] * len(header)))
        self.text += [markdown_row(row) for row in rows]
        self.text.append("")

    def say(self, *lines: str) -> None:
        self.text += [*lines, ""]

    def markdown(self) -> str:
        lines = [f"## {self.title}", "", *self.text]
        if self.problems:
            lines += ["Problems:", "", *(f"- {p}" for p in self.problems), ""]
        lines.append(f"({self.seconds:.0f} s; load average {self.load})")
        return "\n".join(lines)


def markdown_row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def mib(kib: int) -> str:
    return f"{kib / 1024:,.0f} MiB"


# -- the harness: a run directory, its mounts and its daemons ---------------------------


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
            unmount_quietly(Path(point))
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
        self.on_close(f"tmpfs {root}", lambda: unmount_quietly(root))
        return root

    def ext4(self, name: str, size: str) -> tuple[Path, Path]:
        """An ext4 on a loop device with errors=remount-ro: (its mount point, its image)."""
        image = self.root / f"{name}.img"
        root = self.directory(name)
        run("truncate", "-s", size, image)
        run("mkfs.ext4", "-q", "-F", image)
        run("mount", "-o", "loop,errors=remount-ro", image, root)
        self.on_close(f"ext4 {root}", lambda: unmount_quietly(root))
        return root, image

    def faultfs(self, name: str) -> tuple[Path, Path]:
        """A pass-through FUSE filesystem that answers EIO when told to (faultfs.py):
        (mount point, control file)."""
        backing = self.directory(f"{name}-backing")
        mountpoint = self.directory(name)
        control = self.root / f"{name}.control"
        control.write_text("none")
        process = subprocess.Popen(
            [sys.executable, "-m", "scripts.reliability.faultfs", backing, mountpoint, control],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def stop() -> None:
            unmount_quietly(mountpoint)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

        self.on_close(f"faultfs {mountpoint}", stop)
        wait_until(
            lambda: is_mounted(mountpoint) or process.poll() is not None,
            30,
            f"the fault-injecting filesystem at {mountpoint} to mount",
        )
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
        # The parts read sizes their versions do not list and count what is stored, as
        # they did before "memory" became the default: stored for the daemon's own user.
        # No standby serving process: no part kills a serving process alone, and each
        # would be one more process start per mount.
        self.settings = {"store": self.store, "unlisted_sizes": "owner", "standby": False}
        self.settings.update(settings)
        lines = [f"{k} = {toml(v)}" for k, v in self.settings.items()]
        for version, source in sources.items():
            lines += [f"[versions.{version}]", f"source = {toml(source)}"]
            lines += [f"{k} = {toml(v)}" for k, v in version_settings.items()]
        self.config.write_text("\n".join(lines) + "\n")
        self.pid: int | None = None  # the holder's
        self._serving: int | None = None

    def mount(self) -> str:
        """`decodefs mount`; returns what it said on stderr (e.g. that it cleared a stale mount)."""
        result = self.try_mount()
        found = re.search(r"daemon pid (\d+)", result.stdout)
        if result.returncode != 0 or found is None:
            raise HarnessError(f"decodefs mount failed: {result.stderr.strip()}")
        return result.stderr

    def try_mount(self) -> subprocess.CompletedProcess[str]:
        """`decodefs mount` as it went, mounted or refused."""
        result = decodefs(
            "mount", self.mountpoint, "--config", self.config, "--log-file", self.log, timeout=180
        )
        found = re.search(r"daemon pid (\d+)", result.stdout)
        if found is not None:
            self.pid = int(found[1])
        return result

    def stop(self) -> None:
        """`decodefs umount` (lazily if that fails); the daemon is gone afterwards."""
        if is_mounted(self.mountpoint):
            result = decodefs("umount", self.mountpoint, timeout=120)
            if result.returncode != 0:
                unmount_quietly(self.mountpoint)
        if self.pid is not None:
            pid = self.pid
            try:
                wait_until(lambda: gone(pid), 30, f"daemon {pid} to exit after unmounting")
            except AssertionError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                wait_until(lambda: gone(pid), 10, f"daemon {pid} to exit after SIGKILL")
        self.pid = None

    def kill9(self) -> None:
        pid = self.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: gone(pid), 30, f"daemon {pid} to exit after SIGKILL")
        self.pid = None

    def alive(self) -> bool:
        return self.pid is not None and not gone(self.pid)

    def path(self, uuid: str, size: int, version: str = VERSION) -> Path:
        return self.mountpoint / version / str(size) / f"{uuid}.npy"

    def entry(self, uuid: str, size: int, version: str = VERSION) -> Path:
        """Where the store keeps that array."""
        return self.store / version / str(size) / uuid[:2] / f"{uuid}.npy"

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.mountpoint / ".decodefs/stats.json").read_bytes())
        return data

    def serving_pid(self) -> int:
        """The serving process (``self.pid`` is the mount's holder, which reads no array):
        whose memory and descriptors the parts measure; asked again once it is gone."""
        if self._serving is None or gone(self._serving):
            self._serving = int(self.stats()["pid"])
        return self._serving

    def kib(self, name: str) -> int:
        """A figure of the serving process's /proc/<pid>/status in KiB (VmRSS, VmHWM)."""
        text = Path(f"/proc/{self.serving_pid()}/status").read_text()
        found = re.search(rf"^{name}:\s+(\d+) kB", text, re.MULTILINE)
        return int(found[1]) if found else 0

    def reset_peak(self) -> None:
        """Start VmHWM afresh (proc(5): clear_refs 5)."""
        Path(f"/proc/{self.serving_pid()}/clear_refs").write_text("5")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.serving_pid()}/fd"))

    def _log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_lines(self, pattern: str) -> list[str]:
        return [line for line in self._log_text().splitlines() if re.search(pattern, line)]

    def errors_logged(self) -> list[str]:
        """The log's ERROR and CRITICAL lines, and each traceback whole (one item from
        its first line to the exception it ends with): a report that fails on one
        says what was raised."""
        found: list[str] = []
        lines = self._log_text().splitlines()
        at = 0
        while at < len(lines):
            line = lines[at]
            at += 1
            if "Traceback" in line:
                block = [line]
                # Up to the next record of the log (each starts with its date).
                while at < len(lines) and not re.match(r"\d{4}-\d\d-\d\d ", lines[at]):
                    block.append(lines[at])
                    at += 1
                found.append("\n".join(block[:80]))
            elif re.search(r"\b(ERROR|CRITICAL)\b", line):
                found.append(line)
        return found


class Sampler:
    """The daemon's VmRSS (every 20 ms) and descriptors, and optionally its memory
    counters from stats.json, sampled on a thread while the block runs."""

    def __init__(self, daemon: Daemon, stats: bool = False) -> None:
        self._daemon = daemon
        self._stats = stats
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.samples = 0
        self.rss_kib = 0
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=SETTLED)
        self._mark = 0
        self.fds = 0
        self.memory_bytes = 0
        self.decode_memory_bytes = 0

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def mark(self) -> None:
        """From now on: ``settled`` looks only at samples taken after this."""
        self._mark = self.samples

    def settled(self, within_kib: int = 1024) -> int:
        """The RSS once the last SETTLED samples since ``mark`` lie within ``within_kib`` of
        each other (the daemon stopped giving memory back); 0 until then."""
        return steady([rss for tick, rss in list(self._recent) if tick >= self._mark], within_kib)

    def _run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                rss = self._daemon.kib("VmRSS")
                self.rss_kib = max(self.rss_kib, rss)
                self._recent.append((tick, rss))
                if tick % 10 == 0:
                    self.fds = max(self.fds, self._daemon.fds())
                if self._stats and tick % 10 == 5:
                    stats = self._daemon.stats()
                    self.memory_bytes = max(self.memory_bytes, stats["memory_bytes"])
                    self.decode_memory_bytes = max(
                        self.decode_memory_bytes, stats["decode_memory_bytes"]
                    )
            tick += 1
            self.samples = tick
            self._stop.wait(0.02)  # the sampling interval (pacing, not synchronisation)


def steady(samples: Sequence[int], within_kib: int, count: int = SETTLED) -> int:
    """The last of ``samples`` if the last ``count`` of them lie within ``within_kib`` of
    each other; 0 if they do not, or if there are fewer."""
    recent = samples[-count:]
    if len(recent) < count or max(recent) - min(recent) > within_kib:
        return 0
    return recent[-1]


# -- commands and processes -----------------------------------------------------------


def run(*command: object, timeout: float = 300) -> str:
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise HarnessError(f"{' '.join(map(str, command))}: {result.stderr.strip()}")
    return result.stdout


def mounts_under(root: Path) -> list[str]:
    """Mount points below ``root``, deepest first."""
    prefix = os.path.abspath(root) + "/"
    found = [m.mountpoint for m in mounts() if m.mountpoint.startswith(prefix)]
    return sorted(found, key=len, reverse=True)


def task_states(pid: int) -> list[str]:
    """The state letter ("R", "S", "D", "Z", ...) of every thread of ``pid``; [] once the
    process is gone."""
    states = []
    with contextlib.suppress(FileNotFoundError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
                states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


def gone(pid: int) -> bool:
    """Whether every thread of ``pid`` has exited. A zombie leader whose other threads still
    wait in the kernel (state D, on a FUSE request) is not gone."""
    return all(state in ("Z", "X") for state in task_states(pid))


def toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return json.dumps(str(value))
