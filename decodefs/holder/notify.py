"""systemd's service notification protocol (sd_notify(3)): READY, WATCHDOG, STOPPING, STATUS.

One datagram per message to the unix socket named by $NOTIFY_SOCKET ('@' for
the abstract namespace). Outside systemd (no NOTIFY_SOCKET) every call is a
no-op. Written out rather than imported: the protocol is a single datagram,
and the Python bindings either need libsystemd headers to build
(systemd-python) or are long unmaintained (sdnotify).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["ServiceNotifier"]

log = logging.getLogger(__name__)


class ServiceNotifier:
    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self._address = address
        self._watchdog_usec = watchdog_usec
        self._warned = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> ServiceNotifier:
        address = environ.get("NOTIFY_SOCKET") or None
        if address is not None and address.startswith("@"):
            address = "\0" + address[1:]
        watchdog: int | None = None
        usec, pid = environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
        if usec and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            watchdog = int(usec)
        return cls(address, watchdog)

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half of WATCHDOG_USEC, as systemd advises."""
        return None if self._watchdog_usec is None else self._watchdog_usec / 2e6

    def notify(self, *assignments: str) -> None:
        """Send e.g. notify("READY=1", "STATUS=serving /mnt/decoded")."""
        if self._address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall("\n".join(assignments).encode())
        except OSError as exc:
            if not self._warned:  # the service manager went away; say it once
                log.warning("cannot notify the service manager at %r: %s", self._address, exc)
                self._warned = True
