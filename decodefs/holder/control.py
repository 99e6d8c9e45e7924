"""The holder's control socket: `decodefs reload`, `restart` and `stats` ask, the holder answers.

A unix stream socket at common.runtime.holder_socket_path(mountpoint), in a
directory that is the holder's user's alone; a peer that is neither root nor
that user is refused (``SO_PEERCRED``) before it is read. One request per
connection: a JSON line ``{"command": ...}``; one JSON line answers it, when
the work is done (a reload answers once the new serving process has applied
it). This module knows the socket and the framing, not what a command does.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from typing import Any, Final

from ..common.runtime import holder_socket_path
from ..common.trusted import open_trusted_dir

__all__ = [
    "COMMANDS",
    "ControlConnection",
    "ControlError",
    "HolderUnreachable",
    "ask_holder",
    "listen",
]

COMMANDS: Final = ("reload", "restart", "status")
_MAX_REQUEST: Final = 4096
_PEERCRED: Final = struct.Struct("3i")  # pid, uid, gid


class ControlError(Exception):
    """The holder could not do what was asked (its answer says why)."""


class HolderUnreachable(Exception):
    """No holder answers for that mount point (none runs, or it belongs to another user)."""


def listen(mountpoint: str) -> socket.socket:
    """The listening control socket of the mount at ``mountpoint``. Raises
    HolderUnreachable's opposite, FileExistsError, if a live holder listens there."""
    path = holder_socket_path(mountpoint)
    directory = os.path.dirname(path)
    os.close(open_trusted_dir(directory, create_mode=0o700))  # checked: this user's alone
    with contextlib.suppress(HolderUnreachable):
        ask_holder(mountpoint, "status", timeout=2.0)
        raise FileExistsError(f"a holder already answers for {mountpoint} at {path}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a dead holder's
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(16)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class ControlConnection:
    """One accepted connection: its peer, and the request once read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        pid, uid, _ = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        self.peer_pid, self.peer_uid = pid, uid
        self.allowed = uid in (0, os.geteuid())

    def read_request(self) -> dict[str, Any] | None:
        """The request, once a whole line has arrived (None: not yet). Raises ValueError
        for one that is too long or not a request, EOFError if the peer left."""
        chunk = self.sock.recv(_MAX_REQUEST)
        if not chunk:
            raise EOFError
        self.buffer += chunk
        if b"\n" not in self.buffer:
            if len(self.buffer) >= _MAX_REQUEST:
                raise ValueError("request too long")
            return None
        value = json.loads(self.buffer.split(b"\n", 1)[0])
        if not isinstance(value, dict) or value.get("command") not in COMMANDS:
            raise ValueError("not a request")
        return value

    def answer(self, value: dict[str, Any]) -> None:
        """Send the one answer and close (a peer that left is no error)."""
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(5.0)
            self.sock.sendall(json.dumps(value).encode() + b"\n")
        except OSError:
            pass
        finally:
            self.sock.close()


def ask_holder(
    mountpoint: str, command: str, *, timeout: float = 600.0, uid: int | None = None
) -> dict[str, Any]:
    """Ask the holder of ``mountpoint`` (of user ``uid``: default, this process's own;
    root's holder for root) to do ``command``; its answer. Raises HolderUnreachable,
    or ControlError with the holder's reason."""
    path = holder_socket_path(mountpoint, uid)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(json.dumps({"command": command}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise HolderUnreachable(f"no holder answers at {path}: {exc.strerror}") from None
        except PermissionError:
            raise HolderUnreachable(f"{path} belongs to another user") from None
        except TimeoutError:
            raise ControlError(
                f"the holder did not answer {command!r} within {timeout:g} s"
            ) from None
    if not data:
        raise HolderUnreachable(f"the holder at {path} closed the connection without an answer")
    answer = json.loads(data)
    if not isinstance(answer, dict):
        raise ControlError("the holder's answer is not an object")
    if not answer.get("ok"):
        raise ControlError(str(answer.get("error", "the holder refused")))
    return answer
