"""One serving process as the holder sees it: started, spoken to, and reaped.

A serving process is ``python -P -m decodefs.daemon --channel N``: the code
installed now (never a checkout where the holder was started), in its own
process group (a terminal's Ctrl-C reaches the holder alone), from ``/``,
with the holder's standard error as its log. Its exit is seen through a pidfd.
This module knows how to start and address one; when and why is
supervisor.py's.
"""

from __future__ import annotations

import contextlib
import enum
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from ..common import channel
from ..common.channel import Message

__all__ = [
    "PREPARING_NICE",
    "Phase",
    "Purpose",
    "ServerProcess",
    "describe_exit",
    "server_command",
]

# The memory limit the holder sets itself (__main__.py), which its children must not keep.
_LIMITED: Final = (resource.RLIMIT_DATA,)


class Purpose(enum.Enum):
    """Why a serving process was started."""

    FIRST = "first"  # the mount's first: it answers the kernel's INIT
    RELOAD = "reload"
    RESTART = "restart"
    CRASH = "crash"  # its predecessor died: it re-sends what that one had read
    STANDBY = "standby"  # ready beside the one serving, to take over if that one dies


class Phase(enum.Enum):
    PREPARING = "preparing"  # loading the config, the store, the sources; replaying INIT
    PREPARED = "prepared"  # ready to serve, waiting for the connection
    SERVING = "serving"
    DRAINING = "draining"  # told to stop reading; answering what it had read
    GONE = "gone"


def server_command() -> list[str]:
    """The command line of a serving process (its channel's descriptor follows)."""
    return [sys.executable, "-P", "-m", "decodefs.daemon"]


class ServerProcess:
    def __init__(
        self,
        generation: int,
        purpose: Purpose,
        command: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.generation = generation
        self.purpose = purpose
        self.phase = Phase.PREPARING
        self.started = clock()
        self.started_wall = time.time()
        self.version: str | None = None
        self.failure: str | None = None  # why it said it cannot serve (FAILED)
        self.last_pong = self.started
        self.ping_sent: float | None = None
        self.said_drained = False
        self.paused_at: float | None = None  # when the switch to it stopped the reading
        self.served_at: float | None = None  # when it said it serves
        self.decodes = 0  # as it last said (PONG, DRAINED): the mount's count sums them
        self.told_alone = False  # PREVIOUS_GONE sent: no earlier server answers any more
        self.killed = False  # by the holder (hung, refused): its requests need re-sending
        self.exit_status: int | None = None
        ours, theirs = socket.socketpair(
            socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC
        )
        try:
            self.process = subprocess.Popen(
                [*command, "--channel", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                cwd="/",
                process_group=0,
                preexec_fn=_in_background if purpose in _SWITCHES else _restore_limits,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.channel = ours
        self.channel.setblocking(False)
        self.pid = self.process.pid
        self.pidfd = os.pidfd_open(self.pid)

    def __repr__(self) -> str:
        return f"serving process {self.pid} (#{self.generation}, {self.purpose.value})"

    def send(self, kind: str, fds: Sequence[int] = (), **fields: Any) -> bool:
        """Send a message; False if the process is gone (its exit is noticed apart)."""
        try:
            channel.send(self.channel, kind, fds, **fields)
        except (channel.ChannelClosed, BlockingIOError, OSError):
            return False
        return True

    def receive(self) -> Message | None:
        """The next message, None if none is waiting; ChannelClosed at its end."""
        try:
            return channel.receive(self.channel)
        except BlockingIOError:
            return None

    def to_foreground(self) -> None:
        """Give it the holder's priority back (it prepared in the background), before the
        switch to it pauses the reading: what it does next is what the readers wait on."""
        if os.geteuid() != 0:
            return
        wanted = os.getpriority(os.PRIO_PROCESS, 0)
        with contextlib.suppress(OSError):
            for thread in os.listdir(f"/proc/{self.pid}/task"):  # a nice value is a thread's
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, int(thread), wanted)

    def kill(self) -> None:
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)

    def reap(self) -> int:
        """Its exit status (after the pidfd said it exited): -signal, or the code."""
        self.exit_status = self.process.wait()
        self.phase = Phase.GONE
        return self.exit_status

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.pidfd)
        self.channel.close()

    @property
    def alive(self) -> bool:
        return self.phase is not Phase.GONE


def describe_exit(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
        return f"killed by signal {-status}"
    return f"exited with status {status}"


# A serving process that prepares while another serves gets the CPU the one serving
# leaves; it takes its place again just before the switch pauses the reading
# (ServerProcess.to_foreground). Only where it may: a nice value raised can be lowered
# again only by root.
PREPARING_NICE: Final = 10
_SWITCHES: Final = (Purpose.RELOAD, Purpose.RESTART, Purpose.STANDBY)  # another serves


def _in_background() -> None:
    _restore_limits()
    if os.geteuid() == 0:
        os.nice(PREPARING_NICE)


def _restore_limits() -> None:
    for limit in _LIMITED:
        _, hard = resource.getrlimit(limit)
        resource.setrlimit(limit, (hard, hard))
