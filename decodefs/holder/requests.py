"""Reloads and restarts asked of the holder: read off the control socket (or SIGHUP), queued
while a switch is under way, and answered once a serving process applied them, or failed.

Knows the control connections and who waits for which serving process; when a switch
starts, and what it does, is supervisor.py's.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .control import ControlConnection
from .loop import EventLoop

__all__ = ["Request", "Requests"]

log = logging.getLogger(__name__)


@dataclass
class Request:
    """A reload or restart asked for, answered once a serving process applied it."""

    command: str  # "reload" or "restart"
    connection: ControlConnection | None  # None: SIGHUP (the answer goes to the log)


class Requests:
    def __init__(
        self,
        loop: EventLoop,
        on_switch: Callable[[Request], None],
        status: Callable[[], dict[str, Any]],
    ) -> None:
        self._loop = loop
        self._on_switch = on_switch  # a reload or restart to start (or queue)
        self._status = status
        self._reading: dict[int, ControlConnection] = {}
        self._waiting: dict[int, list[Request]] = {}  # serving process pid -> its requests
        self.queued: list[Request] = []  # asked while a switch was under way

    def accept(self, control: socket.socket) -> None:
        """A connection on the control socket: refused unless root's or the owner's."""
        try:
            sock, _ = control.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        connection = ControlConnection(sock)
        if not connection.allowed:
            log.warning("refused a control request from uid %d (pid %d)",
                        connection.peer_uid, connection.peer_pid)  # fmt: skip
            connection.answer({"ok": False, "error": "only root or the mount's owner may ask"})
            return
        self._reading[sock.fileno()] = connection
        self._loop.watch(sock.fileno(), lambda _: self._read(connection))

    def _read(self, connection: ControlConnection) -> None:
        try:
            request = connection.read_request()
        except (OSError, ValueError, EOFError) as exc:
            self._forget(connection)
            if isinstance(exc, EOFError):
                connection.sock.close()
            else:
                connection.answer({"ok": False, "error": f"bad request: {exc}"})
            return
        if request is None:
            return  # the rest of the line is still to come
        self._forget(connection)
        if request["command"] == "status":
            connection.answer({"ok": True, "holder": self._status()})
        else:
            self._on_switch(Request(request["command"], connection))

    def _forget(self, connection: ControlConnection) -> None:
        self._reading.pop(connection.sock.fileno(), None)
        self._loop.unwatch(connection.sock.fileno())

    def wait_for(self, pid: int, requests: list[Request]) -> None:
        """``requests`` are answered by the serving process ``pid``."""
        self._waiting.setdefault(pid, []).extend(requests)

    def answer(self, pid: int, value: dict[str, Any]) -> list[Request]:
        """Answer the requests waiting for ``pid``; those answered."""
        requests = self._waiting.pop(pid, [])
        for request in requests:
            reply(request, value)
        return requests

    def answer_all(self, error: str) -> None:
        """Every request waiting or queued fails with ``error`` (the mount is stopping)."""
        for pid in list(self._waiting):
            self.answer(pid, {"ok": False, "error": error})
        for request in self.queued:
            reply(request, {"ok": False, "error": error})
        self.queued = []

    def close(self) -> None:
        for connection in self._reading.values():
            connection.sock.close()
        self._reading.clear()


def reply(request: Request, value: dict[str, Any]) -> None:
    """Send a request its answer (SIGHUP's goes to the log)."""
    if request.connection is not None:
        request.connection.answer(value)
    elif value.get("ok"):
        log.info(
            "%s applied: %s", request.command, "; ".join(value.get("changes") or ["no change"])
        )
    else:
        log.error("%s failed: %s", request.command, value.get("error"))
