"""One serving process of a mount the holder keeps: ``python -P -m decodefs.daemon --channel N``.

It is told what the mount is (HELLO), gets ready while an earlier serving
process may still serve (the config, the store, the sources, the kernel's INIT
replayed: PREPARED), is given the connection (SERVE), and serves until told
to stop reading (DRAIN: it answers what it had read, then exits) or until the
kernel ends the session (an unmount). SIGTERM drains it the same way; the
holder starts another. Whatever goes wrong before it serves is one FAILED line
for the holder to pass on. The messages are common/channel.py's; the layers
are lifecycle.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any, Final

import trio

from ..common import channel
from ..common.config import ConfigError, load_config
from ..common.mounts import MountError, store_holder_hint
from ..common.source import SourceError
from ..common.startlog import HeldLog
from ..common.version import package_version
from ..store import StoreError, StoreInUse
from .debug import dump_on_sigusr1, stacks_on_sigusr1
from .fs import InitReplayFailed
from .lifecycle import MountFacts, Serving, build
from .numbers import NumbersLost

__all__ = ["main"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG: Final = 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decodefs.daemon")
    parser.add_argument("--channel", type=int, required=True)
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.channel)
    sock.setblocking(True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the holder decides when the mount stops
    _die_with_parent()
    try:
        hello = channel.receive(sock)
    except (channel.ChannelClosed, ValueError):
        return 2
    for fd in hello.fds[1:]:
        os.close(fd)
    held_lock = hello.fds[0] if hello.fds else None
    # The mount's first serving process holds its log until the mount is live: a
    # mistake found while it builds is the one line the holder says (startlog.py).
    held = HeldLog(hello.get("log_level") or "info", hold=bool(hello.get("first")))
    with stacks_on_sigusr1():
        return _serve_process(sock, hello, held_lock, held)


def _serve_process(
    sock: socket.socket, hello: channel.Message, held_lock: int | None, held: HeldLog
) -> int:
    mountpoint = str(hello.get("mountpoint"))
    purpose = str(hello.get("purpose"))
    try:
        config = load_config(Path(str(hello.get("config"))))
        if hello.get("log_level") is None:
            logging.getLogger().setLevel(config.log_level.upper())
        facts = MountFacts(
            state_dir=hello.get("state_dir"),
            first=bool(hello.get("first")),
            crash_restart=purpose == "crash",  # (a standby checks them as it starts)
            held_lock=held_lock,
            holder_pid=os.getppid(),
            access=_mount_access(hello),
        )
        serving = build(config, mountpoint, facts)
    except StoreInUse as exc:
        hint = store_holder_hint(exc.holder_pid) if exc.holder_pid else ""
        _fail(sock, f"{exc}{hint}", held)
        return 2
    except (ConfigError, StoreError, SourceError, NumbersLost, MountError, OSError) as exc:
        _fail(sock, str(exc), held)
        return 2
    serving.holder = dict(hello.get("holder") or {})
    try:
        channel.send(sock, channel.BUILT)
        init = channel.receive(sock)
        if init.kind != channel.INIT:
            log.info("not asked to serve (%s); exiting", init.kind)
            return 0
        reply = serving.session.replay_init(channel.decode_bytes(init.get("init")),
                                            serving.config.allow_other)  # fmt: skip
        store = serving.store
        lock = [store.lock_fd] if store.lock_taken and store.lock_fd is not None else []
        channel.send(
            sock,
            channel.PREPARED,
            lock,
            init_reply=channel.encode_bytes(reply),
            standby=config.standby,
            version=package_version(),
        )
        log.info("ready to serve %s (%s)", mountpoint, purpose)
        message = channel.receive(sock)
        if message.kind != channel.SERVE or not message.fds:
            log.info("not asked to serve (%s); exiting", message.kind)
            return 0
        serving.session.adopt(message.fds[0])
        problem = serving.session.resend() if message.get("resend") else None
        if problem is not None:
            log.error("requests read by the serving process that died are lost: %s", problem)
        elif message.get("resend"):
            log.info("asked the kernel to send again what the last serving process had read")
        sock.setblocking(False)
        held.release()  # the holder reads on: it says the mount is live
        trio.run(_serve, serving, sock, problem)
    except InitReplayFailed as exc:
        _fail(sock, str(exc), held)
        return 2
    except channel.ChannelClosed:
        log.info("the holder is gone; exiting")
    finally:
        if serving.session.started:
            serving.session.close()
        serving.close()
    return 0


class _Life:
    """What the channel asked of this process, read by its tasks."""

    def __init__(self) -> None:
        self.draining = False


async def _serve(serving: Serving, sock: socket.socket, resend_problem: str | None) -> None:
    life = _Life()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_from_holder, serving, sock, life, nursery)
        nursery.start_soon(_drain_on_sigterm, serving, sock, life)
        nursery.start_soon(dump_on_sigusr1)
        await serving.run_beside(nursery)
        nursery.start_soon(_once_live, serving, sock, resend_problem, nursery)
        await serving.session.serve()
        # Every request read is answered: the next serving process may read now.
        decodes = serving.engine.metrics.decodes  # for the mount's count (the holder sums)
        _tell(sock, channel.DRAINED if life.draining else channel.ENDED, decodes=decodes)
        nursery.cancel_scope.cancel()
    if serving.state_dir is not None:
        try:
            serving.carry_over()  # what it verified, for the next (it takes it once we exit)
        except OSError as exc:
            log.warning("cannot write what was verified for the next serving process: %s", exc)
    log.info("%s; exiting", "drained" if life.draining else "the kernel ended the session")


async def _once_live(
    serving: Serving, sock: socket.socket, resend_problem: str | None, nursery: trio.Nursery
) -> None:
    await serving.once_live(nursery)
    _tell(sock, channel.SERVING, resend_problem=resend_problem)


async def _from_holder(
    serving: Serving, sock: socket.socket, life: _Life, nursery: trio.Nursery
) -> None:
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            message = channel.receive(sock)
        except BlockingIOError:
            continue
        except (channel.ChannelClosed, ValueError):
            log.warning("the holder is gone; the mount is lost with it. Stopping")
            _stop_reading(serving, life)
            return
        for fd in message.fds:
            os.close(fd)
        kind = message.kind
        if kind == channel.PING:
            _tell(sock, channel.PONG, decodes=serving.engine.metrics.decodes)
        elif kind == channel.HOLDER_STATUS:
            serving.holder = dict(message.get("holder") or {})
        elif kind == channel.DRAIN:
            _stop_reading(serving, life)
        elif kind == channel.PREVIOUS_GONE:
            nursery.start_soon(_alone, serving, sock, bool(message.get("resend")))


async def _alone(serving: Serving, sock: socket.socket, resend: bool) -> None:
    """No earlier serving process answers any more: apply the reload."""
    if resend:
        problem = serving.session.resend()
        if problem is not None:
            log.error("requests read by a serving process that is gone are lost: %s", problem)
    try:
        changes = await serving.apply_reload()
    except Exception as exc:  # the switch is done: what it could not apply is said
        log.exception("applying the reload failed")
        _tell(sock, channel.APPLIED, changes=[f"not all applied: {exc}"])
        return
    for line in changes:
        log.info("reload: %s", line)
    _tell(sock, channel.APPLIED, changes=changes)


async def _drain_on_sigterm(serving: Serving, sock: socket.socket, life: _Life) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            log.info("SIGTERM received: answering what was read, then exiting (the holder "
                     "starts another serving process)")  # fmt: skip
            _stop_reading(serving, life)
            return


def _stop_reading(serving: Serving, life: _Life) -> None:
    if not life.draining:
        life.draining = True
        serving.session.stop_reading()


def _tell(sock: socket.socket, kind: str, **fields: Any) -> None:
    with contextlib.suppress(channel.ChannelClosed, OSError):
        channel.send(sock, kind, **fields)


def _fail(sock: socket.socket, error: str, held: HeldLog) -> None:
    """Say why to the holder (which says it to the user, or logs it): one line."""
    held.drop()
    _tell(sock, channel.FAILED, error=error)


def _die_with_parent() -> None:
    """Be killed if the holder dies: the mount is lost then, and a serving process left
    behind would keep a dead mount's connection open."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the holder died before the prctl: nobody to serve for
        os._exit(0)


def _mount_access(hello: channel.Message) -> str | None:
    """The ``access`` the mount was made with (its holder's; a holder of a release before
    ``access`` said ``allow_other``), or None if the hello says neither."""
    access = hello.get("access")
    if isinstance(access, str):
        return access
    if hello.get("allow_other") is not None:
        return "everyone" if hello.get("allow_other") else "owner"
    return None
