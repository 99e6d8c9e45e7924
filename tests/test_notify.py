"""The sd_notify protocol against a real unix datagram socket, and the watchdog's pings."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import trio
import trio.testing

from decodefs.daemon.lifecycle import _feed_watchdog
from decodefs.daemon.notify import ServiceNotifier


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


# -- the daemon's watchdog, in virtual time ------------------------------------------------


async def test_watchdog_pings_once_per_interval_only_while_the_probe_succeeds(
    notify_listener: tuple[socket.socket, str], autojump_clock: trio.testing.MockClock
) -> None:
    sock, path = notify_listener
    sock.setblocking(False)
    notifier = ServiceNotifier.from_environment({"NOTIFY_SOCKET": path})
    interval = 10.0
    # The probe's answer from each virtual time on (the mount: fine, stuck, failing).
    plan = [(0.0, "ok"), (35.0, "hang"), (75.0, "fail"), (105.0, "ok")]
    probed: list[tuple[float, str]] = []

    async def probe(mountpoint: str) -> None:
        assert mountpoint == "/mnt/decoded"
        now = trio.current_time() - start
        state = [s for t, s in plan if t <= now][-1]
        probed.append((now, state))
        if state == "hang":
            await trio.sleep_forever()  # a stuck loop or FUSE connection
        if state == "fail":
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    pings: list[float] = []
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_feed_watchdog, "/mnt/decoded", notifier, interval, probe)
        for step in range(14):
            await trio.sleep_until(start + step * interval + interval / 2)
            while True:
                try:
                    message = sock.recv(100)
                except BlockingIOError:
                    break
                assert message == b"WATCHDOG=1"
                pings.append(step * interval)  # sent within the half interval before
        nursery.cancel_scope.cancel()
    # A ping each interval while the probe answers; none while it hangs (each
    # hung probe is abandoned after an interval) or fails.
    assert pings == [0.0, 10.0, 20.0, 30.0, 110.0, 120.0, 130.0]
    assert [t for t, s in probed if s == "hang"] == [40.0, 60.0]
    assert [t for t, s in probed if s == "fail"] == [80.0, 90.0, 100.0]
