"""Running as a service: systemd notify and watchdog, units, access, metrics."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decodefs.common.config import parse_config
from decodefs.common.stats_schema import STATS
from tests.conftest import MountFactory, needs_root
from tests.helpers import (
    decodefs,
    errno_of,
    is_live_mount,
    is_mounted,
    reference_npy,
    unmount_quietly,
    write_config,
)

REPO = Path(__file__).parents[1]


def receive_until(sock: socket.socket, wanted: str) -> list[str]:
    """Messages received up to and including the first containing ``wanted``."""
    messages = []
    while True:
        message = sock.recv(4096).decode()
        messages.append(message)
        if wanted in message.split("\n"):
            return messages


def test_notify_ready_watchdog_and_stopping(
    tmp_path: Path, photos_dir: Path, notify_listener: tuple[socket.socket, str]
) -> None:
    """Exactly what systemd is told, in order. The watchdog's timing (a ping per
    interval, none while the probe fails or hangs) is test_notify.py's, in virtual time."""
    sock, address = notify_listener
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    config = write_config(tmp_path / "config.toml", tmp_path / "store", {"v1": photos_dir})
    env = {**os.environ, "NOTIFY_SOCKET": address, "WATCHDOG_USEC": "200000"}
    log = open(tmp_path / "daemon.log", "wb")  # noqa: SIM115
    daemon = subprocess.Popen(
        [sys.executable, "-m", "decodefs", "mount", str(mountpoint), "--config", str(config), "-f"],
        env=env,
        stdout=log,
        stderr=log,
    )
    try:
        started = [m for m in receive_until(sock, "READY=1") if m != "WATCHDOG=1"]
        serving = f"READY=1\nSTATUS=serving {mountpoint}"
        assert started == [f"STATUS=starting {mountpoint}", serving]
        assert is_live_mount(mountpoint)  # READY=1 came only once the mount answers

        pings = [sock.recv(4096).decode() for _ in range(5)]
        assert pings == ["WATCHDOG=1"] * 5  # every 0.1 s: half of WATCHDOG_USEC

        # systemctl reload: SIGHUP (or ExecReload's `decodefs reload`) to the holder.
        daemon.send_signal(signal.SIGHUP)
        reloading = [m for m in receive_until(sock, "READY=1") if m != "WATCHDOG=1"]
        assert reloading == [f"RELOADING=1\nSTATUS=reload of {mountpoint}", serving]

        daemon.send_signal(signal.SIGTERM)
        *before, stopping = receive_until(sock, "STOPPING=1")
        assert set(before) <= {"WATCHDOG=1"}  # pings sent before the signal arrived
        assert stopping == f"STOPPING=1\nSTATUS=unmounting {mountpoint}"
        assert daemon.wait(timeout=30) == 0
        assert not is_mounted(mountpoint)
        sock.setblocking(False)
        after = []
        with contextlib.suppress(BlockingIOError):
            while True:
                after.append(sock.recv(4096).decode())
        # Nothing but pings until it exited (the lazily unmounted mount point still
        # answers the probe): no second READY, no STOPPING twice.
        assert set(after) <= {"WATCHDOG=1"}
    finally:
        daemon.kill()
        daemon.wait()
        log.close()
        unmount_quietly(mountpoint)


def test_installed_units_pass_systemd_analyze_verify(tmp_path: Path, photos_dir: Path) -> None:
    root = tmp_path / "root"
    decodefs_command = Path(sys.executable).parent / "decodefs"

    def install() -> str:
        script = str(REPO / "scripts" / "install-service.sh")
        return subprocess.run(
            ["bash", script, "--root", str(root), "--decodefs", str(decodefs_command)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    assert "units in" in install()
    units = root / "etc" / "systemd" / "system"
    (units / "decodefs@demo.service").symlink_to("decodefs@.service")
    for unit in ["decodefs.service", "decodefs@demo.service"]:
        text = (units / unit).read_text()  # the instance is a link to the template
        assert f"ExecStart={decodefs_command} mount --mkdir --foreground" in text
        header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
        assert str(decodefs_command) not in header  # the comment still reads as written
        assert "StartLimitBurst=" in text
        assert "Type=notify" in text and "WatchdogSec=" in text and "Restart=on-failure" in text
        for hides_the_mount in [
            "ProtectSystem",
            "ProtectHome",
            "PrivateTmp",
            "PrivateDevices",
            "ProtectKernelTunables",
            "ReadOnlyPaths",
            "InaccessiblePaths",
            "TemporaryFileSystem",
            "PrivateMounts",
            "MountFlags",
        ]:
            assert f"\n{hides_the_mount}=" not in text, hides_the_mount
        checked = subprocess.run(
            ["systemd-analyze", "verify", str(units / unit)], capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stderr
        # Warnings too, but only about our units: other units on the machine, and
        # what this systemd version thinks of them, are not ours to judge.
        ours = [
            line
            for line in (checked.stdout + checked.stderr).splitlines()
            if "decodefs" in line or str(root) in line
        ]
        assert ours == [], checked.stderr

    # The example config is valid once its paths exist.
    example = tomllib.loads((root / "etc" / "decodefs" / "config.toml").read_text())
    example["store"] = str(tmp_path / "store")
    example["versions"]["v1"]["source"] = str(photos_dir)
    config = parse_config(example, base_dir=tmp_path)
    assert config.access == ("originals" if os.geteuid() == 0 else "owner")
    assert config.mountpoint == Path("/mnt/decoded")
    # A second install keeps the edited config and puts the example beside it.
    install()
    assert (root / "etc" / "decodefs" / "config.example.toml").exists()


@pytest.fixture
def shared_mountpoint(shared_tmp: Path) -> Iterator[Path]:
    """A mount point every user can reach, in this test's tmp_path; always unmounted."""
    mountpoint = shared_tmp / "mnt"
    mountpoint.mkdir()
    os.chmod(mountpoint, 0o755)
    try:
        yield mountpoint
    finally:
        unmount_quietly(mountpoint)


@needs_root
@pytest.mark.parametrize("access", ["everyone", "owner"])
def test_access_everyone_lets_other_users_read(
    tmp_path: Path,
    photos_dir: Path,
    photos: dict[str, Path],
    shared_mountpoint: Path,
    access: str,
) -> None:
    config = write_config(
        tmp_path / "config.toml", tmp_path / "store", {"v1": photos_dir}, access=access
    )
    assert (
        decodefs(
            "mount", shared_mountpoint, "--config", config, "--log-file", tmp_path / "log"
        ).returncode
        == 0
    )
    try:
        uuid_, original = next(iter(photos.items()))
        entry = shared_mountpoint / "v1" / "224" / f"{uuid_}.npy"
        as_nobody = [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "cat",
            str(entry),
        ]
        result = subprocess.run(as_nobody, capture_output=True, timeout=60)
        if access == "everyone":
            assert result.returncode == 0, result.stderr
            assert result.stdout == reference_npy(original, 224)
        else:
            assert result.returncode != 0 and b"Permission denied" in result.stderr
        # Root reads either way, and writes stay refused for everyone.
        assert entry.read_bytes() == reference_npy(original, 224)
        assert errno_of(open, entry, "r+b") == errno.EROFS
    finally:
        assert decodefs("umount", shared_mountpoint).returncode == 0


def test_mountpoint_from_the_config_and_umount_if_stale(
    mounts: MountFactory, tmp_path: Path, photos_dir: Path
) -> None:
    mountpoint = tmp_path / "from-config"
    mountpoint.mkdir()
    config = write_config(
        tmp_path / "c.toml", tmp_path / "store2", {"v1": photos_dir}, mountpoint=str(mountpoint)
    )
    try:
        assert (
            decodefs("umount", "--if-stale", "--config", config).returncode == 0
        )  # nothing there: fine
        assert decodefs("mount", "--config", config, "--log-file", tmp_path / "log").returncode == 0
        assert is_live_mount(mountpoint)
        assert decodefs("umount", "--if-stale", "--config", config).returncode == 0
        assert is_live_mount(mountpoint)  # a live mount is never touched
        assert decodefs("umount", "--config", config).returncode == 0
        assert not is_mounted(mountpoint)
    finally:
        unmount_quietly(mountpoint)

    created = tmp_path / "made" / "by" / "mount"
    config = write_config(
        tmp_path / "c3.toml", tmp_path / "store3", {"v1": photos_dir}, mountpoint=str(created)
    )
    try:
        assert (
            decodefs("mount", "--config", config, "--log-file", tmp_path / "log3").returncode == 1
        )
        assert (
            decodefs(
                "mount", "--mkdir", "--config", config, "--log-file", tmp_path / "log3"
            ).returncode
            == 0
        )
        assert is_live_mount(created)
    finally:
        unmount_quietly(created)

    mount = mounts({"v1": photos_dir})
    mount.kill9()
    result = decodefs("umount", "--if-stale", mount.mountpoint)
    assert result.returncode == 0 and "clearing stale mount" in result.stderr
    assert not is_mounted(mount.mountpoint)


def test_metrics_file_is_prometheus_text_agreeing_with_stats(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    for uuid_ in photos:
        mount.path("v1", "64", f"{uuid_}.npy").read_bytes()
    stats = mount.stats()
    assert set(stats) == {stat.name for stat in STATS if not stat.l2}  # the schema, no more
    text = mount.path(".decodefs", "metrics").read_text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for name in ["hits", "misses", "decodes", "evictions"]:
        assert samples[(f"decodefs_{name}_total", ())] == stats[name], name
    assert samples[("decodefs_served_bytes_total", ())] == stats["bytes_served"]
    assert samples[("decodefs_decodes_total", ())] == len(photos)
    assert samples[("decodefs_store_entries", ())] == stats["store_entries"] == len(photos)
    assert samples[("decodefs_store_bytes", ())] == stats["store_bytes"]
    assert samples[("decodefs_decode_seconds_count", ())] == len(photos)
    assert ("decodefs_memory_cache_bytes", ()) in samples
    assert ("decodefs_inflight_decodes", ()) in samples
    assert json.loads(mount.path(".decodefs", "stats.json").read_bytes())["decodes"] == len(photos)
    every = decodefs("stats", "--all", str(mount.mountpoint))  # the same figures, for people
    assert every.returncode == 0, every.stderr
    assert [line.split()[0] for line in every.stdout.splitlines()] == [
        stat.name for stat in STATS if not stat.l2
    ]
