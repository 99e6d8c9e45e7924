"""The channel between a mount's holder and one serving process: the messages, defined once.

One message per datagram of a ``SOCK_SEQPACKET`` socket pair: a JSON object
whose ``kind`` names it, with descriptors riding along (``SCM_RIGHTS``), as
the /dev/fuse connection and the store's lock travel. Byte strings (the
kernel's INIT and the reply to it) are base64. This module knows the wire and
the names; what each side does with a message is the holder's
(holder/supervisor.py) and the serving process's (daemon/server.py).

The life of a serving process, as the holder drives it:

    holder -> server   HELLO      what the mount is (the store lock, if one is held)
    server -> holder   BUILT      it loaded the config, the store and the sources
                       FAILED     why it cannot serve (a config that does not load...)
    holder -> server   INIT       the kernel's INIT (the first server's: once mounted)
    server -> holder   PREPARED   the reply to the replayed INIT; the store lock it took
    holder -> server   SERVE      the /dev/fuse descriptor: start answering the kernel
    server -> holder   SERVING
    holder -> server   PREVIOUS_GONE   no earlier server answers any more: apply the
                                  reload's invalidations (and re-send lost requests)
    server -> holder   APPLIED    what the reload changed
    holder -> server   DRAIN      stop reading requests, answer those read, exit
    server -> holder   DRAINED    every request it read is answered (then it exits);
                       or ENDED: the kernel ended the session (an unmount)
    holder -> server   HOLDER_STATUS   the holder's figures, for stats.json
    holder <-> server  PING / PONG
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

__all__ = [
    "APPLIED",
    "BUILT",
    "DRAIN",
    "DRAINED",
    "ENDED",
    "FAILED",
    "HELLO",
    "HOLDER_STATUS",
    "INIT",
    "MAX_MESSAGE",
    "PING",
    "PONG",
    "PREPARED",
    "PREVIOUS_GONE",
    "SERVE",
    "SERVING",
    "ChannelClosed",
    "Message",
    "decode_bytes",
    "encode_bytes",
    "receive",
    "send",
]

HELLO: Final = "hello"
BUILT: Final = "built"
INIT: Final = "init"
PREPARED: Final = "prepared"
FAILED: Final = "failed"
SERVE: Final = "serve"
SERVING: Final = "serving"
PREVIOUS_GONE: Final = "previous-gone"
APPLIED: Final = "applied"
DRAIN: Final = "drain"
DRAINED: Final = "drained"
ENDED: Final = "ended"
HOLDER_STATUS: Final = "holder-status"
PING: Final = "ping"
PONG: Final = "pong"

MAX_MESSAGE: Final = 1 << 16
_MAX_FDS: Final = 4


class ChannelClosed(Exception):
    """The other end is gone (its process exited, or closed the channel)."""


class Message(NamedTuple):
    kind: str
    fields: dict[str, Any]
    fds: list[int]  # received descriptors: the receiver owns (and must close) them

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def send(sock: socket.socket, kind: str, fds: Sequence[int] = (), **fields: Any) -> None:
    """One message; raises ChannelClosed if the other end is gone."""
    data = json.dumps({"kind": kind, **fields}, sort_keys=True).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"a {kind} message of {len(data)} bytes is over {MAX_MESSAGE}")
    try:
        if fds:
            socket.send_fds(sock, [data], list(fds))
        else:
            sock.send(data)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise ChannelClosed(str(exc)) from None


def receive(sock: socket.socket) -> Message:
    """The next message (blocking, unless the socket is not); ChannelClosed at the end.

    A datagram that is not a message of this protocol is a ValueError: the
    channel is private to two processes of one mount, so it means a bug."""
    try:
        data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, _MAX_FDS)
    except ConnectionResetError as exc:
        raise ChannelClosed(str(exc)) from None
    if not data and not fds:
        raise ChannelClosed("end of channel")
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ValueError("a message was cut short")
        value = json.loads(data)
        if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
            raise ValueError("not a message")
    except ValueError:
        _close_all(fds)
        raise
    kind = value.pop("kind")
    return Message(kind, value, list(fds))


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode_bytes(text: object) -> bytes:
    if not isinstance(text, str):
        raise ValueError("expected base64 text")
    return base64.b64decode(text, validate=True)


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
