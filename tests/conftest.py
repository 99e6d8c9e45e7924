"""Shared fixtures: real photographs, and real mounts that are always unmounted."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from decodefs.sample import make_sample_corpus
from tests import inprocess
from tests.helpers import Mount, write_config, write_photos

MountFactory = Callable[..., Mount]
DaemonFactory = Callable[..., inprocess.InProcess]
Tmpfs = Callable[[str], Path]  # size ("1m") -> the root of a fresh tmpfs

# Properties run against module-scoped trees; examples never sleep, so no deadline.
settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
# scripts/mutation.sh: fewer examples, each run alike, so a verdict is reproducible.
settings.register_profile(
    "mutation", parent=settings.get_profile("default"), derandomize=True, max_examples=25
)
settings.load_profile(os.environ.get("DECODEFS_HYPOTHESIS_PROFILE", "default"))

# Every test that needs root says so with this prefix, so that a run not as root ends
# with one line counting them (pytest_terminal_summary below) instead of passing quietly.
NEEDS_ROOT = "needs root"
RUN_AS_ROOT = "run them as root: sudo bash scripts/test.sh"


def needs_root_because(why: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(os.geteuid() != 0, reason=f"{NEEDS_ROOT}: {why}")


needs_root = needs_root_because("mounts a tmpfs or an ext4, or acts as another user")
LARGE_COUNT = 6


@pytest.fixture(scope="session")
def photos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """uuid -> path of real photographs in every encoding the issue names."""
    return write_photos(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="session")
def photos_dir(photos: dict[str, Path]) -> Path:
    return next(iter(photos.values())).parents[2]


@pytest.fixture(scope="session")
def large(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """~7 MP photo-like JPEGs: a decode takes long enough for readers to pile up."""
    return make_sample_corpus(tmp_path_factory.mktemp("large"), LARGE_COUNT, 3072, 2304, seed=7)


# Run by a child of the test session: once the session's end of the pipe closes
# (at its end, or when a timeout ends it with os._exit and no teardown runs),
# lazily unmount whatever is still mounted under the session's directories
# (argv[1:]), deepest first, so no daemon or tmpfs outlives the run; then remove
# the shared directory (argv[2]).
_REAPER = """
import shutil, subprocess, sys
bases = [b.rstrip("/") + "/" for b in sys.argv[1:]]
sys.stdin.buffer.read()
with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
    found = [(line.split()[4], line.split(" - ")[1].split()[0]) for line in f]
left = sorted((m for m in found if m[0].startswith(tuple(bases))), key=lambda m: -len(m[0]))
for point, fstype in left:
    command = ["fusermount3", "-u", "-z"] if fstype.startswith("fuse") else ["umount", "-l"]
    subprocess.run([*command, point], capture_output=True, check=False)
    print("decodefs tests: unmounted", point, "left mounted by the run", file=sys.stderr)
shutil.rmtree(sys.argv[2], ignore_errors=True)
"""


@pytest.fixture(scope="session", autouse=True)
def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This session's directory that every user may search (pytest's own are its
    user's alone, and another pytest session resets their modes at its start).

    Also: every mount under it or the session's temporary directories is
    unmounted at the end, even one a test left behind because the run was cut
    short (a timeout ends it with os._exit)."""
    shared = Path(tempfile.mkdtemp(prefix="decodefs-tests-"))
    os.chmod(shared, 0o711)
    reaper = subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(tmp_path_factory.getbasetemp()), str(shared)],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a Ctrl-C of the run must not stop it first
    )
    try:
        yield shared
    finally:
        assert reaper.stdin is not None
        reaper.stdin.close()
        reaper.wait(timeout=60)


def _make_factory(base: Path, created: list[Mount]) -> MountFactory:
    def make(
        versions: dict[str, Path],
        *,
        name: str = "mnt",
        store: Path | None = None,
        expect_errors: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        wrapper: tuple[str, ...] = (),
        **config: Any,
    ) -> Mount:
        # A standby serving process is one more process start per mount: the tests of
        # crashes ask for one.
        config.setdefault("standby", False)
        config_path = write_config(
            base / f"{name}.toml", store or base / "store", versions, **config
        )
        mount = Mount(
            base / name, config_path, base / f"{name}.log", env or {}, expect_errors, list(wrapper)
        )
        created.append(mount)
        return mount.start()

    return make


def _teardown(created: list[Mount]) -> None:
    problems = []
    for mount in created:
        mount.stop()
        problems += mount.unexpected_log_lines()
    assert not problems, "unexpected errors in daemon logs:\n" + "\n".join(problems)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[MountFactory]:
    """Start real daemons; every one is unmounted at the end, pass or fail."""
    created: list[Mount] = []
    try:
        yield _make_factory(tmp_path, created)
    finally:
        _teardown(created)


@pytest.fixture
def public_mounts() -> Iterator[MountFactory]:
    """Like `mounts`, in a temporary directory every user may traverse (pytest's
    tmp_path is root's alone), for tests that read as another user."""
    base = Path(tempfile.mkdtemp(prefix="decodefs-public-"))
    os.chmod(base, 0o755)
    created: list[Mount] = []
    try:
        yield _make_factory(base, created)
    finally:
        try:
            _teardown(created)
        finally:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def module_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MountFactory]:
    """Like `mounts`, shared by the tests of one module (read-only checks)."""
    created: list[Mount] = []
    try:
        yield _make_factory(tmp_path_factory.mktemp("module-mount"), created)
    finally:
        _teardown(created)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[DaemonFactory]:
    """Start the daemon's layers in this process (tests/inprocess.py): call with the
    versions (name -> source) and config keys; each one is closed at the end."""
    started: list[inprocess.InProcess] = []

    def start(versions: dict[str, Path], **config: Any) -> inprocess.InProcess:
        daemon = inprocess.start(tmp_path, versions, **config)
        started.append(daemon)
        return daemon

    try:
        yield start
    finally:
        for daemon in started:
            daemon.close()


@pytest.fixture
def originals(tmp_path: Path, photos: dict[str, Path]) -> Path:
    """A private copy of the photos, flat, for tests that change originals."""
    root = tmp_path / "originals"
    root.mkdir()
    for path in photos.values():
        shutil.copy(path, root / path.name)
    return root


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    """Mount a tmpfs of a given size ("1m") under tmp_path; all are unmounted at the end."""
    mounted: list[Path] = []

    def make(size: str) -> Path:
        root = tmp_path / f"tmpfs-{len(mounted)}"
        root.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "decodefs-test", str(root)], check=True
        )
        mounted.append(root)
        return root

    try:
        yield make
    finally:
        for root in mounted:  # (one a test unmounted itself is said to be "not mounted")
            subprocess.run(["umount", "-l", str(root)], check=False, capture_output=True)


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount a fresh ext4 of a given size ("16M") from a loop device, with
    errors=remount-ro (a real filesystem that can fail read-only at runtime:
    see ``fail_read_only``); all are unmounted at the end."""
    mounted: list[Path] = []

    def make(size: str) -> Path:
        image = tmp_path / f"ext4-{len(mounted)}.img"
        root = tmp_path / f"ext4-{len(mounted)}"
        root.mkdir()
        subprocess.run(["truncate", "-s", size, str(image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(root)], check=True)
        mounted.append(root)
        return root

    try:
        yield make
    finally:
        for root in mounted:
            subprocess.run(["umount", "-l", str(root)], check=False)


def fail_read_only(root: Path) -> None:
    """Make the ext4 mounted at ``root`` hit an error, so the kernel turns it read-only
    under whoever is writing to it, as a failing flash device does."""
    source = subprocess.run(
        ["findmnt", "-n", "-o", "SOURCE", str(root)], capture_output=True, text=True, check=True
    ).stdout.strip()
    Path("/sys/fs/ext4", os.path.basename(source), "trigger_fs_error").write_text("1")


@pytest.fixture
def shared_tmp(shared_root: Path) -> Iterator[Path]:
    """An empty directory every user may reach, for this test alone; removed after it
    (fixtures that mount in it unmount first)."""
    for directory in shared_root.parents:
        if not os.stat(directory).st_mode & 0o001:
            pytest.skip(f"{directory} is not searchable by other users (set TMPDIR)")
    shared = Path(tempfile.mkdtemp(dir=shared_root))
    os.chmod(shared, 0o755)
    try:
        yield shared
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture
def notify_listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A unix datagram socket standing in for systemd's NOTIFY_SOCKET: (socket, path)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(60)
    try:
        yield sock, path
    finally:
        sock.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line at the end of a run not as root: how many tests were skipped for it, and why."""
    line = root_skips_line(terminalreporter.stats.get("skipped", []))
    if line:
        terminalreporter.write_line(line, yellow=True, bold=True)


def root_skips_line(skipped: list[pytest.TestReport]) -> str | None:
    whys: Counter[str] = Counter()
    for report in skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        if f"{NEEDS_ROOT}: " in reason:
            whys[reason.split(f"{NEEDS_ROOT}: ", 1)[1]] += 1
    if not whys:
        return None
    count = sum(whys.values())
    because = "; ".join(f"{why} ({n})" for why, n in sorted(whys.items()))
    return f"decodefs: {count} tests skipped for needing root ({because}); {RUN_AS_ROOT}"
