"""The sd_notify protocol against a real unix datagram socket, and the watchdog's pings."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from decodefs.holder.notify import ServiceNotifier


def test_messages_reach_the_socket(notify_listener: tuple[socket.socket, str]) -> None:
    sock, path = notify_listener
    notifier = ServiceNotifier.from_environment({"NOTIFY_SOCKET": path})
    notifier.notify("READY=1", "STATUS=serving /mnt/decoded")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving /mnt/decoded"


def test_abstract_socket_names() -> None:
    name = f"decodefs-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        ServiceNotifier.from_environment({"NOTIFY_SOCKET": "@" + name}).notify("WATCHDOG=1")
        assert sock.recv(100) == b"WATCHDOG=1"


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    mine = str(os.getpid())
    assert ServiceNotifier.from_environment({"WATCHDOG_USEC": "3000000"}).watchdog_interval == 1.5
    env = {"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": mine}
    assert ServiceNotifier.from_environment(env).watchdog_interval == 1.5
    other = {"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}  # meant for another process
    assert ServiceNotifier.from_environment(other).watchdog_interval is None
    assert ServiceNotifier.from_environment({}).watchdog_interval is None


def test_outside_systemd_nothing_happens_and_a_gone_manager_is_not_fatal(tmp_path: Path) -> None:
    ServiceNotifier.from_environment({}).notify("READY=1")
    gone = ServiceNotifier.from_environment({"NOTIFY_SOCKET": str(tmp_path / "absent.sock")})
    gone.notify("READY=1")
    gone.notify("STOPPING=1")
