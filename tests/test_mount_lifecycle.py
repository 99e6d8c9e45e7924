"""Mount life cycle through the real CLI: background mount, umount, signals, kill -9."""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import MountFactory
from tests.helpers import (
    decodefs,
    errno_of,
    interruptible,
    is_live_mount,
    is_mounted,
    reference_npy,
    unmount_quietly,
    wait_until,
    write_config,
)


@pytest.fixture
def mountpoint(tmp_path: Path) -> Iterator[Path]:
    """A mount point for daemons the CLI starts in the background; always cleared."""
    path = tmp_path / "cli-mnt"
    path.mkdir()
    try:
        yield path
    finally:
        pid = _pid_of(path)
        unmount_quietly(path)
        if pid:
            _wait_gone(pid)


def _pid_of(mountpoint: Path) -> int | None:
    try:
        value = json.loads((mountpoint / ".decodefs" / "stats.json").read_bytes())["pid"]
    except (OSError, ValueError, KeyError):
        return None
    return value if isinstance(value, int) else None


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie awaiting its reaper counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    wait_until(lambda: _gone(pid), timeout, f"daemon {pid} to exit")
    return True


def test_stats_and_metrics_name_the_version_serving_and_when_it_started(
    mounts: MountFactory, photos_dir: Path
) -> None:
    before = time.time()
    mount = mounts({"v1": photos_dir})
    stats = mount.stats()
    installed = decodefs("--version").stdout.split()[1]
    assert stats["version"] == installed  # the code installed now is the code serving
    assert before - 1 <= stats["started"] <= time.time()
    metrics = mount.path(".decodefs", "metrics").read_text()
    assert f'decodefs_build_info{{version="{installed}"}} 1.0' in metrics
    assert re.search(r"^decodefs_start_time_seconds \d", metrics, re.MULTILINE)
    table = decodefs("stats", mount.mountpoint).stdout
    assert f"decodefs {installed} (pid {stats['pid']}), started " in table


def test_a_mount_started_beside_a_clone_runs_the_installed_package_from_the_root(
    tmp_path: Path, photos_dir: Path
) -> None:
    beside = tmp_path / "home"
    (beside / "decodefs").mkdir(parents=True)  # a clone of decodefs: no __init__.py at its top
    (beside / "decodefs" / "README.md").write_text("a clone\n")
    config = write_config(tmp_path / "config.toml", tmp_path / "store", {"v1": photos_dir})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    command = str(Path(sys.executable).parent / "decodefs")  # as a user runs it
    try:
        mounted = subprocess.run(
            [command, "mount", str(mnt), "--config", str(config)],
            cwd=beside,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert mounted.returncode == 0, mounted.stderr
        pid = json.loads((mnt / ".decodefs" / "stats.json").read_bytes())["pid"]
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        assert Path(mnt, "v1").is_dir()
        unmounted = subprocess.run(
            [command, "umount", str(mnt)], cwd=beside, capture_output=True, text=True, timeout=120
        )
        assert unmounted.returncode == 0, unmounted.stderr
    finally:
        unmount_quietly(mnt)


def closed_pipe() -> int:
    """The write end of a pipe nobody reads any more (as `| head -1` leaves it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


def test_output_to_a_closed_pipe_ends_quietly_and_the_mount_stays(
    tmp_path: Path, photos_dir: Path
) -> None:
    config = write_config(tmp_path / "config.toml", tmp_path / "store", {"v1": photos_dir})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    pipe = closed_pipe()
    # Buffered, as a user's terminal runs it: the closed pipe shows when the output is
    # flushed (PYTHONUNBUFFERED, set on some machines, hid it: exit 120 and noise).
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        for args in (("mount", mnt, "--config", config), ("stats", mnt)):
            result = subprocess.run(
                [sys.executable, "-m", "decodefs", *map(str, args)],
                stdout=pipe,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
                env=buffered,
            )
            assert result.returncode == 141, (args, result.stderr)  # 128 + SIGPIPE
            assert result.stderr == "", (args, result.stderr)  # no traceback, no noise
            assert is_live_mount(mnt)  # the mount was made, and stays
    finally:
        os.close(pipe)
        unmount_quietly(mnt)


@pytest.mark.parametrize(
    ("stop", "status"),
    [(signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)],
    ids=["ctrl-c", "kill-9"],
)
def test_a_mount_command_stopped_while_its_mount_starts_leaves_no_mount(
    tmp_path: Path, photos_dir: Path, stop: signal.Signals, status: int
) -> None:
    """Ctrl-C stops the daemon it started; a command killed outright cannot, so the
    daemon, finding nobody to tell that the mount is live, unmounts by itself."""
    config = write_config(tmp_path / "config.toml", tmp_path / "store", {"v1": photos_dir})
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    command = [sys.executable, "-m", "decodefs", "mount", str(mnt), "--config", str(config)]
    parent = subprocess.Popen(
        [*command, "--log-file", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=interruptible,
    )
    try:
        # The parent waits for the daemon's word once the log exists and the daemon runs.
        child = wait_until(
            lambda: log.exists() and _daemon_of(mnt, parent.pid), what="the daemon started"
        )
        parent.send_signal(stop)
        assert parent.wait(timeout=60) == status
        wait_until(lambda: not _cmdline(str(child)), what="the daemon stopped")
        assert not is_mounted(mnt)
        assert "Traceback" not in log.read_text(errors="replace")
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in os.listdir("/proc"):  # a daemon left running, if the test failed
            if pid.isdigit() and f"{mnt}\0".encode() in _cmdline(pid):
                os.kill(int(pid), signal.SIGKILL)
        unmount_quietly(mnt)


def test_a_daemon_that_dies_before_its_mount_is_live_shows_its_own_log_lines_only(
    tmp_path: Path, photos_dir: Path
) -> None:
    config = write_config(tmp_path / "config.toml", tmp_path / "store", {"v1": photos_dir})
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    log.write_text("a line of an earlier run\n")
    command = [sys.executable, "-m", "decodefs", "mount", str(mnt), "--config", str(config)]
    parent = subprocess.Popen(
        [*command, "--log-file", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        daemon = wait_until(lambda: _daemon_of(mnt, parent.pid), what="the daemon started")
        assert daemon is not None
        os.kill(daemon, signal.SIGKILL)
        _, stderr = parent.communicate(timeout=60)
        assert parent.returncode == 1, stderr
        assert "daemon exited with status -9 before the mount was live" in stderr, stderr
        assert "earlier run" not in stderr  # the log's lines of this daemon alone
    finally:
        if parent.poll() is None:
            parent.kill()
        unmount_quietly(mnt)


def _daemon_of(mountpoint: Path, parent: int) -> int | None:
    """The daemon that the `decodefs mount` ``parent`` started for ``mountpoint``, once
    it runs; None before."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != parent and f"{mountpoint}\0".encode() in _cmdline(pid):
            return int(pid)
    return None


def _cmdline(pid: str) -> bytes:
    """A process's command line; nothing for one that is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_background_mount_returns_once_live_and_umount_waits_for_the_daemon(
    tmp_path: Path, mountpoint: Path, photos_dir: Path, photos: dict[str, Path]
) -> None:
    empty = tmp_path / "empty"  # a source that holds nothing (wrong path, wrong extensions)
    empty.mkdir()
    versions = {"v1": photos_dir, "wrong": empty}
    config = write_config(tmp_path / "config.toml", tmp_path / "store", versions)
    result = decodefs(
        "mount", mountpoint, "--config", config, "--log-file", tmp_path / "daemon.log"
    )
    assert result.returncode == 0, result.stderr
    # What it serves, per version, and the store; a version with nothing to serve is a warning.
    first = sorted(photos)[0]
    assert result.stdout.splitlines()[1:] == [
        f"  v1     {len(photos)} originals from {photos_dir}, sizes 224: "
        f"{mountpoint}/v1/224/<uuid>.npy (uuid layout, e.g. {first}.npy)",
        f"  wrong  0 originals from {empty}, sizes 224: {mountpoint}/wrong/224/<uuid>.npy "
        "(uuid layout)",
        f"  store {tmp_path / 'store'}: 0 B in 0 arrays",
    ], result.stdout
    assert result.stderr == (
        f"decodefs: warning: version wrong serves nothing: 0 originals under {empty} (files "
        "ending in bmp, jpeg, jpg, png, tif, tiff, webp, any case, found recursively); check "
        "versions.wrong.source and extensions\n"
    )
    assert f"mounted {mountpoint}" in result.stdout
    # Live the moment the command returns: no polling.
    uuid, path = next(iter(photos.items()))
    assert (mountpoint / "v1" / "224" / f"{uuid}.npy").read_bytes() == reference_npy(path, 224)
    pid = _pid_of(mountpoint)
    assert pid is not None

    table = decodefs("stats", mountpoint)
    assert table.returncode == 0
    assert "misses" in table.stdout and "hit ratio" in table.stdout and "evictions" in table.stdout
    assert json.loads(decodefs("stats", mountpoint, "--json").stdout)["decodes"] == 1

    result = decodefs("umount", mountpoint)
    assert result.returncode == 0, result.stderr
    assert not is_mounted(mountpoint)
    assert _gone(pid)  # umount already waited for it
    log = (tmp_path / "daemon.log").read_text()
    assert "mounted" in log and "unmounted" in log and "ERROR" not in log


def test_kill_9_then_mount_recovers_the_stale_mount_and_keeps_the_store(
    mounts: MountFactory,
    mountpoint: Path,
    photos_dir: Path,
    photos: dict[str, Path],
    tmp_path: Path,
) -> None:
    mount = mounts({"v1": photos_dir})
    for uuid in photos:
        mount.path("v1", "224", f"{uuid}.npy").read_bytes()
    mount.kill9()  # the holder: its serving process dies with it, and the mount is lost

    # The kernel keeps the dead mount; anything that reaches the daemon fails (a
    # request sent in the instant the serving process was dying: ECONNABORTED).
    assert is_mounted(mount.mountpoint)
    wait_until(lambda: errno_of(os.statvfs, mount.mountpoint) == errno.ENOTCONN)
    assert errno_of(os.listdir, mount.mountpoint) == errno.ENOTCONN

    log = tmp_path / "restart.log"
    result = decodefs("mount", mount.mountpoint, "--config", mount.config, "--log-file", log)
    assert result.returncode == 0, result.stderr + log.read_text()
    try:
        for uuid, path in photos.items():
            assert mount.path("v1", "224", f"{uuid}.npy").read_bytes() == reference_npy(path, 224)
        stats = mount.stats()
        assert stats["decodes"] == 0 and stats["hits"] == len(photos)
        assert "decodefs: clearing stale mount" in result.stderr
    finally:
        assert decodefs("umount", mount.mountpoint).returncode == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_unmounts_cleanly_and_exits_zero(
    mounts: MountFactory, photos_dir: Path, signum: signal.Signals
) -> None:
    mount = mounts({"v1": photos_dir})
    assert mount.process is not None
    mount.process.send_signal(signum)
    assert mount.process.wait(timeout=30) == 0
    assert not is_mounted(mount.mountpoint)
    assert f"{signum.name} received; unmounting" in mount.log_text()


def test_sigterm_detaches_but_finishes_reads_already_open(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    assert mount.process is not None
    uuid, original = next(iter(photos.items()))
    with open(mount.path("v1", "224", f"{uuid}.npy"), "rb", buffering=0) as busy:
        head = busy.read(100)
        mount.process.send_signal(signal.SIGTERM)
        wait_until(lambda: not is_mounted(mount.mountpoint), 10, "the mount to leave the namespace")
        assert mount.process.poll() is None  # but still serving the open file
        assert head + busy.read() == reference_npy(original, 224)
    assert mount.process.wait(timeout=30) == 0  # exits once the last file is closed


def test_a_live_mount_is_not_mounted_over(mounts: MountFactory, photos_dir: Path) -> None:
    mount = mounts({"v1": photos_dir})
    for extra in ([], ["--foreground"]):
        result = decodefs("mount", mount.mountpoint, "--config", mount.config, *extra)
        assert result.returncode == 1
        assert "is already mounted" in result.stderr and "decodefs umount" in result.stderr
    assert os.listdir(mount.path("v1")) == ["224"]  # the first mount is untouched


def test_user_errors_are_one_line(tmp_path: Path, photos_dir: Path, mountpoint: Path) -> None:
    config = write_config(tmp_path / "config.toml", tmp_path / "store", {"v1": photos_dir})
    cases = [
        (("mount", tmp_path / "absent", "--config", config), "mount point"),
        (("mount", mountpoint, "--config", tmp_path / "absent.toml"), "no such config file"),
        (("umount", mountpoint), "is not mounted"),
        (("stats", mountpoint), "is not a decodefs mount"),
    ]
    for args, message in cases:
        result = decodefs(*args)
        assert result.returncode == 1, args
        assert result.stderr.startswith("decodefs: error: ") and message in result.stderr, (
            result.stderr
        )
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_duplicate_uuids_stop_the_mount_with_the_reason(tmp_path: Path, mountpoint: Path) -> None:
    source = tmp_path / "originals"
    (source / "a").mkdir(parents=True)
    (source / "b").mkdir()
    (source / "a" / "x.jpg").write_bytes(b"1")
    (source / "b" / "x.png").write_bytes(b"2")
    config = write_config(tmp_path / "config.toml", tmp_path / "store", {"v1": source})
    for extra in ([], ["--foreground"]):
        result = decodefs(
            "mount", mountpoint, "--config", config, "--log-file", tmp_path / "log", *extra
        )
        assert result.returncode == 1
        assert "versions.v1.source: 1 uuid(s) have more than one original" in result.stderr
        assert result.stderr.count("\n") == 1
        assert not is_mounted(mountpoint)


def test_one_daemon_per_store(mounts: MountFactory, photos_dir: Path, mountpoint: Path) -> None:
    mount = mounts({"v1": photos_dir})
    result = decodefs(
        "mount", mountpoint, "--config", mount.config, "--log-file", mountpoint.parent / "2.log"
    )
    assert result.returncode == 1
    assert "in use by another decodefs daemon" in result.stderr
    assert not is_mounted(mountpoint)


def test_umount_refuses_while_files_are_open_unless_lazy(
    tmp_path: Path, mountpoint: Path, photos_dir: Path
) -> None:
    config = write_config(tmp_path / "config.toml", tmp_path / "store", {"v1": photos_dir})
    assert (
        decodefs("mount", mountpoint, "--config", config, "--log-file", tmp_path / "log").returncode
        == 0
    )
    pid = _pid_of(mountpoint)
    assert pid is not None
    with open(next((mountpoint / "v1" / "224").iterdir()), "rb") as busy:
        busy.read(10)
        result = decodefs("umount", mountpoint)
        assert result.returncode == 1
        assert "busy" in result.stderr and "--lazy" in result.stderr
        assert is_mounted(mountpoint)
        assert decodefs("umount", "--lazy", mountpoint).returncode == 0
        assert not is_mounted(mountpoint)
        busy.read()  # the reader holding the file is not cut off
    assert _wait_gone(pid)


def test_a_hung_daemon_is_reported_not_waited_on_forever(
    mounts: MountFactory, photos_dir: Path
) -> None:
    mount = mounts({"v1": photos_dir})
    serving = mount.stats()["pid"]
    os.kill(serving, signal.SIGSTOP)  # the serving process: the holder answers nothing
    try:
        started = time.monotonic()
        result = decodefs("mount", mount.mountpoint, "--config", mount.config)
        assert result.returncode == 1
        assert "does not answer" in result.stderr
        assert time.monotonic() - started < 60  # the probe gives up; it does not hang
    finally:
        os.kill(serving, signal.SIGCONT)
    assert os.listdir(mount.path("v1")) == ["224"]  # and the daemon was left alone


def test_unmounting_right_after_a_burst_of_closes_is_a_clean_exit(
    mounts: MountFactory, tmp_path: Path
) -> None:
    # Queued RELEASE requests at unmount make some kernels end the session with
    # ECONNABORTED instead of ENODEV; the daemon must still exit 0, quietly.
    originals = tmp_path / "small"
    originals.mkdir()
    for i in range(200):
        Image.new("RGB", (12, 12), (i, 0, 0)).save(originals / f"s{i:03d}.png")
    mount = mounts({"v1": originals}, sizes=[16])
    for _ in range(3):
        files = [open(entry, "rb") for entry in mount.path("v1", "16").iterdir()]  # noqa: SIM115
        for f in files:
            f.read()
        for f in files:
            f.close()
        assert mount.stop() == 0
        assert not mount.unexpected_log_lines()
        mount.start()


def test_sigusr1_logs_every_threads_stack_and_the_trio_tasks_and_keeps_serving(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    assert mount.process is not None
    uuid, original = next(iter(photos.items()))
    target = mount.path("v1", "224", f"{uuid}.npy")
    target.read_bytes()  # threads of the pools exist now

    def dumped(log: str, times: int) -> bool:
        return (
            log.count("Current thread 0x") >= times  # faulthandler: the thread that got it
            and log.count("SIGUSR1: every thread's stack is above") >= times
            and "task decodefs.daemon.server._serve" in log
            and "task decodefs.daemon.server._from_holder at " in log  # where it waits
        )

    process = mount.process
    assert process is not None
    for times in (1, 2):  # the handler stays installed
        process.send_signal(signal.SIGUSR1)
        wait_until(
            functools.partial(
                lambda n: process.poll() is not None or dumped(mount.log_text(), n), times
            ),
            what=f"dump #{times} (or the daemon's exit)",
        )
        assert process.poll() is None, mount.log_text()
    log = mount.log_text()
    assert "Thread 0x" in log and 'File "' in log  # other threads' stacks, with their files
    assert re.search(
        r"^  task decodefs\.daemon\.server\._serve", log, re.MULTILINE
    )  # nested under <init>
    assert "SIGUSR1: the holder: " in log  # the holder passed it on to the serving process
    assert re.search(r"^    task pyfuse", log, re.MULTILINE)  # pyfuse3's request tasks
    # Still serving, a new decode included.
    assert target.read_bytes() == reference_npy(original, 224)
    assert mount.path("v1", "96", f"{uuid}.npy").read_bytes() == reference_npy(original, 96)
    assert mount.process.poll() is None
