"""The holder: keeps one mount's FUSE connection while serving processes come and go.

It mounts, then starts, replaces and restarts serving processes on the one
connection, and never answers a request itself but with EIO (while a crash
loop is backed off). A switch (a reload, a restart, a crash) goes:

1. a new serving process prepares while the old one serves: it loads the
   config and the sources, and replays the kernel's INIT to its own libfuse;
   its reply must be the first one's, byte for byte, or it is refused;
2. the old one stops reading requests and answers those it read; then the
   new one is given the connection, and first has the kernel send again any
   request read but not answered (libfuse drops one it reads as it stops):
   readers pause for as long as the old one's last requests take;
3. once the old one is gone the new one applies what changed (invalidating
   the kernel's names and pages).

Concurrency: one thread, one epoll loop; every handler runs to completion and
nothing blocks but the mount and unmount commands. Knows the channel and the
kernel's wire, never the config, the store, decoding or pyfuse3.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from ..common import channel
from ..common.mounts import MountError, find_mount, lazy_unmount
from ..common.runtime import holder_socket_path
from ..common.startlog import HeldLog
from ..common.version import package_version
from .backoff import HEALTHY, CrashBackoff
from .control import listen
from .kernel import FuseConnection, KernelError, answer_with_eio, mount_failure_hint
from .loop import EventLoop
from .notify import ServiceNotifier
from .requests import Request, Requests, reply
from .servers import Phase, Purpose, ServerProcess, describe_exit, server_command
from .state import MountState

__all__ = ["Holder", "HolderSettings"]

log = logging.getLogger(__name__)

# A serving process must be ready to serve within this (a first scan of a large source).
PREPARE_TIMEOUT: Final = 600.0
# How long an old serving process may take to answer what it had read, once told to stop
# reading (readers wait meanwhile); then it is killed, and its requests are sent again
# to the new one (a decode that was running is done again there).
DRAIN_TIMEOUT: Final = 10.0
# A serving process is asked for a sign of life this often, and replaced if none comes.
PING_INTERVAL: Final = 5.0
PING_TIMEOUT: Final = 30.0
# How often the holder looks whether the kernel ended the connection when nothing told it
# (a serving process reports it, and exits; this is for one that is hung or absent).
CONNECTION_CHECK: Final = 1.0
# After SIGTERM, how long readers holding an open file are still served.
SHUTDOWN_GRACE: Final = 10.0
# Then how long requests already running may take before the serving processes are killed.
REQUESTS_GRACE: Final = 5.0


@dataclass(frozen=True)
class HolderSettings:
    mountpoint: str  # absolute
    config: str  # the config file every serving process reads
    log_level: str | None = None  # overrides the config's, in every serving process
    access: str = "owner"  # config.Access: who may read (decides allow_other)
    ready_fd: int | None = None  # told "ready" once the mount is live, or the error
    command: tuple[str, ...] = field(default_factory=lambda: tuple(server_command()))

    @property
    def allow_other(self) -> bool:
        """The mount option: other users' processes may reach the mount ("owner": none)."""
        return self.access != "owner"


class Holder:
    def __init__(
        self,
        settings: HolderSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        notifier: ServiceNotifier | None = None,
        log: HeldLog | None = None,
    ) -> None:
        self.settings = settings
        self._log = log  # held until the mount is live (startlog.py)
        self._clock = clock
        self._notifier = notifier or ServiceNotifier.from_environment()
        self._backoff = CrashBackoff(clock)
        self._loop = EventLoop(clock)
        self._requests = Requests(self._loop, self._switch, self.status)
        self._servers: list[ServerProcess] = []
        self.current: ServerProcess | None = None  # the one given the connection last
        self.pending: ServerProcess | None = None  # one preparing to replace it
        self.standby: ServerProcess | None = None  # one ready to take over if it dies
        self._want_standby = False  # the config says so (standby = true)
        self._previous: ServerProcess | None = None  # the one the current replaced, draining
        self._fuse: FuseConnection | None = None
        self._state: MountState | None = None
        self._control: socket.socket | None = None
        self._lock_fds: list[int] = []  # the store's lock, passed from server to server
        self._generation = 0
        self._eio = False
        self._lost_requests = False  # a serving process died with requests unanswered
        self._ready_told = False
        self._stopping = False
        self._ended = False  # the kernel ended the connection
        self._done = False
        self.exit_status = 0
        self.started = time.time()
        self.counts = {
            "handovers": 0,
            "crashes": 0,
            "refused": 0,
            "remounts": 0,
            "eio_answers": 0,
            "decodes_before": 0,  # decodes of the serving processes gone, as each last said
        }
        self.last_problem: str | None = None
        # The last and the longest pause of a switch: from the old process told to stop
        # reading (or found dead) until the new one serves (seconds).
        self.pauses = (0.0, 0.0)
        self._crashed_at: float | None = None
        self._wakeup_r, self._wakeup_w = socket.socketpair()

    # -- the loop -------------------------------------------------------------------

    def run(self) -> int:
        """Mount, serve through serving processes until unmounted or stopped; the exit status."""
        self._install_signals()
        try:
            self._state = MountState.create()
            self._control = listen(self.settings.mountpoint)
            control = self._control
            self._loop.watch(control.fileno(), lambda _: self._requests.accept(control))
            self._notifier.notify(f"STATUS=starting {self.settings.mountpoint}")
            self._start(Purpose.FIRST)  # mounted once it is built: a mistake mounts nothing
            self._loop.every("ping", PING_INTERVAL, self._ping)
            interval = self._notifier.watchdog_interval
            if interval is not None:
                self._loop.every("watchdog", interval, lambda: self._notifier.notify("WATCHDOG=1"))
            while not self._done:
                self._step()
        except (FileExistsError, OSError) as exc:
            self._fail_start(str(exc))
        finally:
            self._cleanup()
        return self.exit_status

    def _step(self) -> None:
        self._loop.step()
        self._check_done()

    # -- the mount --------------------------------------------------------------------

    def _mount(self) -> None:
        self._fuse = FuseConnection.mount(
            self.settings.mountpoint, allow_other=self.settings.allow_other
        )
        # The descriptor is watched only while the holder answers EIO itself (_set_eio):
        # in an epoll set, every request would wake the holder (see FuseConnection.ended).
        self._loop.every("connection", CONNECTION_CHECK, self._check_connection)
        log.info(
            "mounted %s (FUSE protocol %s, mount %s)",
            self.settings.mountpoint,
            self._fuse.init.protocol,
            self._state.mount_id if self._state else "?",
        )

    def _on_fuse(self, mask: int) -> None:
        assert self._fuse is not None
        if mask & (select.EPOLLERR | select.EPOLLHUP):
            self._connection_ended()
            return
        if self._eio and mask & select.EPOLLIN:
            try:
                opcode = answer_with_eio(self._fuse.fd)
            except OSError as exc:
                if exc.errno == errno.ENODEV:
                    self._connection_ended()
                    return
                raise
            if opcode is not None:
                self.counts["eio_answers"] += 1

    def _check_connection(self) -> None:
        """End the mount's life here if the kernel has ended the connection."""
        if self._fuse is not None and not self._ended and self._fuse.ended():
            self._connection_ended()

    def _set_eio(self, on: bool) -> None:
        if self._fuse is None or self._eio == on or self._ended:
            return
        self._eio = on
        if not on:
            self._loop.unwatch(self._fuse.fd)
        else:
            self._loop.watch(self._fuse.fd, self._on_fuse)
            log.error("no serving process: every request of %s is answered EIO until one "
                      "starts", self.settings.mountpoint)  # fmt: skip

    def _connection_ended(self) -> None:
        if self._ended:
            return
        self._ended = True
        assert self._fuse is not None
        self._loop.unwatch(self._fuse.fd)
        self._loop.cancel("connection")
        if not self._stopping and find_mount(self.settings.mountpoint) is not None:
            # Still mounted, and nobody asked us to stop: the connection was aborted
            # under us. Fail, so that a service manager mounts again.
            log.error("the kernel aborted the FUSE connection of %s", self.settings.mountpoint)
            self.exit_status = 1
        else:
            log.info("%s was unmounted", self.settings.mountpoint)
        self._stopping = True
        self._requests.answer_all("the mount ended")
        for server in self._servers:
            if server.phase in (Phase.PREPARING, Phase.PREPARED):
                server.kill()  # it never served: nothing of it is needed
        self._loop.at("kill-servers", REQUESTS_GRACE, self._kill_all)

    # -- serving processes ---------------------------------------------------------------

    def _start(self, purpose: Purpose, requests: list[Request] | None = None) -> ServerProcess:
        assert self._state is not None
        self._generation += 1
        server = ServerProcess(self._generation, purpose, self.settings.command, self._clock)
        self._servers.append(server)
        if purpose is Purpose.STANDBY:
            self.standby = server
        else:
            self.pending = server
        self._requests.wait_for(server.pid, list(requests or []))
        self._loop.watch(server.channel.fileno(), lambda _: self._on_message(server))
        self._loop.watch(server.pidfd, lambda _: self._on_exit(server))
        sent = server.send(
            channel.HELLO,
            self._lock_fds,
            first=purpose is Purpose.FIRST,
            purpose=purpose.value,
            generation=server.generation,
            mountpoint=self.settings.mountpoint,
            config=self.settings.config,
            log_level=self.settings.log_level,
            access=self.settings.access,
            state_dir=self._state.path,
            mount_id=self._state.mount_id,
            holder=self.status(),
        )
        if not sent:
            server.kill()
        self._loop.at(
            f"prepare-{server.pid}", PREPARE_TIMEOUT, lambda: self._prepare_timeout(server)
        )
        log.info("started %s", server)
        return server

    def _on_message(self, server: ServerProcess) -> None:
        try:
            message = server.receive()
        except channel.ChannelClosed:
            self._loop.unwatch(server.channel.fileno())
            return
        except ValueError as exc:
            log.error("%s sent a message this holder does not understand (%s); killing it",
                      server, exc)  # fmt: skip
            server.kill()
            return
        if message is None:
            return
        try:
            self._dispatch(server, message)
        finally:
            for fd in message.fds:
                if fd not in self._lock_fds:
                    os.close(fd)

    def _dispatch(self, server: ServerProcess, message: channel.Message) -> None:
        kind = message.kind
        if kind == channel.BUILT:
            self._on_built(server)
        elif kind == channel.PREPARED:
            self._on_prepared(server, message)
        elif kind == channel.FAILED:
            server.failure = str(message.get("error", "no reason given"))
            log.error("%s cannot serve: %s", server, server.failure)
        elif kind == channel.SERVING:
            self._on_serving(server, message)
        elif kind == channel.APPLIED:
            if server is self.current:
                self._loop.at("standby", 0.0, self._ensure_standby)  # after this handler
            changes = message.get("changes") or []
            self._answer(
                server, {"ok": True, "changes": changes, "server": self._server_status(server)}
            )
        elif kind == channel.DRAINED:
            server.said_drained = True
            server.decodes = int(message.get("decodes", server.decodes))
            if server is self._previous and self.pending is not None:
                self._serve(self.pending, resend=True)  # whatever the old one dropped
        elif kind == channel.PONG:
            server.last_pong = self._clock()
            server.ping_sent = None
            server.decodes = int(message.get("decodes", server.decodes))
        elif kind == channel.ENDED:
            # The kernel ended the session (an unmount or an abort).
            server.decodes = int(message.get("decodes", server.decodes))
            self._check_connection()

    def _on_built(self, server: ServerProcess) -> None:
        """It is ready for the kernel's INIT: mount first if this is the mount's first."""
        if server.phase is not Phase.PREPARING or self._stopping:
            server.kill()
            return
        if self._fuse is None:
            try:
                self._mount()
            except KernelError as exc:
                server.kill()
                hint = mount_failure_hint(self.settings.allow_other)
                self._fail_start(f"cannot mount {self.settings.mountpoint}: {exc} ({hint})")
                return
        assert self._fuse is not None
        server.send(channel.INIT, init=channel.encode_bytes(self._fuse.init.data))

    def _on_prepared(self, server: ServerProcess, message: channel.Message) -> None:
        assert self._fuse is not None
        self._loop.cancel(f"prepare-{server.pid}")
        if server.phase is not Phase.PREPARING or self._stopping:
            server.kill()
            return
        server.phase = Phase.PREPARED
        server.version = str(message.get("version", "?"))
        reply = channel.decode_bytes(message.get("init_reply"))
        if self._fuse.init_reply is None:
            self._fuse.answer_init(reply)
        elif reply != self._fuse.init_reply:
            self._refuse(
                server,
                "its libfuse answers the kernel's INIT differently from the one the mount "
                "began with (another libfuse, or other session options)",
            )
            return
        if message.fds:
            self._keep_lock(message.fds[0])
        self._want_standby = bool(message.get("standby"))
        if server is self.standby:
            log.info("%s is ready to take over", server)
            self._status_changed()
            return
        old = self.current
        server.to_foreground()
        # From here until it serves, nobody reads requests (after a crash: since then).
        crashed = server.purpose is Purpose.CRASH and self._crashed_at is not None
        server.paused_at = self._crashed_at if crashed else self._clock()
        if old is not None and old.alive and old.phase is Phase.SERVING:
            old.phase = Phase.DRAINING
            self._previous = old
            if not old.send(channel.DRAIN):
                return  # it is going: its exit is seen apart, and then this one serves
            self._loop.at(f"drain-{old.pid}", DRAIN_TIMEOUT,
                     lambda: self._stuck(old, "to answer what it had read"))  # fmt: skip
        else:
            self._serve(server, resend=self._lost_requests)

    def _serve(self, server: ServerProcess, *, resend: bool) -> None:
        assert self._fuse is not None
        if server.phase is not Phase.PREPARED:
            return
        if self._previous is not None:
            self._loop.cancel(f"drain-{self._previous.pid}")
        self._set_eio(False)
        server.phase = Phase.SERVING
        self.current, self.pending = server, None
        if resend:
            self._lost_requests = False
        server.send(channel.SERVE, [self._fuse.fd], resend=resend)

    def _on_serving(self, server: ServerProcess, message: channel.Message) -> None:
        server.last_pong = server.served_at = self._clock()
        if server.purpose is not Purpose.FIRST:
            self.counts["handovers"] += 1
            paused = server.last_pong - (server.paused_at or server.started)
            self.pauses = (round(paused, 4), round(max(paused, self.pauses[1]), 4))
        resend_problem = message.get("resend_problem")
        log.info("%s serves %s (decodefs %s)", server, self.settings.mountpoint, server.version)
        if server.purpose is Purpose.FIRST and not self._ready_told:
            self._tell_ready()
        if resend_problem:  # requests an earlier process read would wait for good
            self._remount(
                f"requests read by the serving process before cannot be sent again: "
                f"{resend_problem}"
            )
            return
        if self._previous is None or not self._previous.alive:
            self._previous_gone(server)
        self._status_changed()

    def _previous_gone(self, server: ServerProcess, resend: bool = False) -> None:
        self._previous = None
        if server.alive and server.phase is Phase.SERVING and (resend or not server.told_alone):
            server.told_alone = True
            server.send(channel.PREVIOUS_GONE, resend=resend)

    def _stuck(self, server: ServerProcess, what: str) -> None:
        if not server.alive:
            return
        log.error("%s did not manage %s in time; killing it", server, what)
        server.kill()

    def _on_exit(self, server: ServerProcess) -> None:
        self._loop.unwatch(server.pidfd)
        self._loop.unwatch(server.channel.fileno())
        status = server.reap()
        server.close()
        self._servers.remove(server)
        self.counts["decodes_before"] += server.decodes
        self._loop.cancel_matching(f"-{server.pid}")
        self._check_connection()  # a serving process ends when the connection does
        how = describe_exit(status)
        if self._stopping:
            log.info("%s %s", server, how)
        elif server is self.standby:
            self.standby = None
            reason = server.failure or how
            if server.killed:
                log.info("%s %s", server, how)
            else:  # tried again at the next switch, not in a loop
                log.warning("%s %s; no standby until the next switch", server, reason)
            self._status_changed()
        elif server is self._previous:
            self._handed_over(server, how)
        elif server is self.current:
            self._crashed(server, how)
        elif server is self.pending:
            self._failed_to_start(server, how)
        else:
            log.info("%s %s", server, how)
        self._answer(server, {"ok": False, "error": f"the serving process {how}"})
        self._status_changed()

    def _handed_over(self, server: ServerProcess, how: str) -> None:
        """The serving process that a switch replaced is gone."""
        self._previous = None
        pending = self.pending
        if pending is not None and pending.phase is Phase.PREPARED:
            # Gone before it said it had answered all it read: the new one re-sends.
            if not server.said_drained:
                log.error("%s %s during a switch; %s takes over", server, how, pending)
            self.current = None
            self._serve(pending, resend=True)
            return
        log.info("%s has handed over and %s", server, how)
        if self.current is not None:
            self._previous_gone(self.current)

    def _crashed(self, server: ServerProcess, how: str) -> None:
        self.current = None
        self._lost_requests = True
        self._crashed_at = now = self._clock()
        if server.said_drained and self.pending is None:  # SIGTERM: it stopped on its own
            log.info("%s stopped on its own; another takes over the connection", server)
            self._take_over()
            return
        self.counts["crashes"] += 1
        if server.served_at is not None and now - server.served_at >= HEALTHY:
            self._backoff.forget()  # it served well: a one-off, not a loop
        delay = self._backoff.crashed()
        self.last_problem = f"{server} {how}"
        if self.pending is not None:  # a switch under way: the new one re-sends
            log.error("%s %s during a switch; %s takes over", server, how, self.pending)
            return
        if delay == 0:
            log.error("%s %s; another takes over the connection", server, how)
            self._take_over()
        else:
            log.error("%s %s (%d crashes in the last minute); the next starts in %.0f s",
                      server, how, self._backoff.recent, delay)  # fmt: skip
            self._set_eio(True)
            self._loop.at("restart", delay, self._start_after_crash)

    def _failed_to_start(self, server: ServerProcess, how: str) -> None:
        self.pending = None
        reason = server.failure or f"it {how} before it was ready"
        self._answer(server, {"ok": False, "error": reason})
        if self.current is not None:
            log.error("%s did not take over (%s); %s keeps serving", server, reason, self.current)
            self._run_queued()
            return
        if not self._ready_told and server.purpose is Purpose.FIRST:
            self._fail_start(reason)
            return
        self.last_problem = reason
        self.counts["crashes"] += 1
        delay = max(self._backoff.crashed(), 1.0)  # never a busy loop of failing starts
        log.error("%s: %s; the next starts in %.0f s", server, reason, delay)
        self._set_eio(True)
        self._loop.at("restart", delay, self._start_after_crash)

    def _ensure_standby(self) -> None:
        """A serving process ready to take over, if the config wants one and none is."""
        current = self.current
        if (
            self._want_standby
            and self.standby is None
            and self.pending is None
            and not self._stopping
            and current is not None
            and current.phase is Phase.SERVING
        ):
            self._start(Purpose.STANDBY)

    def _drop_standby(self) -> None:
        standby, self.standby = self.standby, None
        if standby is not None:
            standby.kill()

    def _start_after_crash(self) -> None:
        if not self._stopping:
            self._take_over()

    def _take_over(self) -> None:
        """No serving process: the standby takes the connection over (in milliseconds),
        else a new one is started (a process's start)."""
        standby = self.standby
        if standby is None or standby.phase is not Phase.PREPARED:
            self._start(Purpose.CRASH)
            return
        log.info("%s takes over", standby)
        self.standby, self.pending = None, standby
        standby.purpose = Purpose.CRASH
        standby.paused_at = self._crashed_at
        standby.to_foreground()
        self._serve(standby, resend=True)

    def _prepare_timeout(self, server: ServerProcess) -> None:
        if server.phase is Phase.PREPARING:
            server.failure = f"not ready to serve within {PREPARE_TIMEOUT:.0f} s"
            self._stuck(server, "to get ready")

    def _refuse(self, server: ServerProcess, why: str) -> None:
        """The new serving process cannot take the connection over: fall back to a plain
        remount (readers of the old mount see errors), as the mount's start would."""
        self.counts["refused"] += 1
        server.kill()
        change = f"could not hand over ({why}): mounted afresh instead"
        self._answer(server, {"ok": True, "changes": [change]})
        self._remount(why)

    def _remount(self, why: str) -> None:
        """The connection cannot be handed on: end it and mount afresh (readers see errors)."""
        assert self._fuse is not None and self._state is not None
        log.error("remounting %s: %s", self.settings.mountpoint, why)
        self.counts["remounts"] += 1
        self.last_problem = f"remounted: {why}"
        for server in list(self._servers):
            server.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.process.wait(timeout=30)  # its store lock goes with it
        self._loop.unwatch(self._fuse.fd)
        self._loop.cancel("connection")
        with contextlib.suppress(MountError):
            lazy_unmount(self.settings.mountpoint)
        self._fuse.close()
        self._eio = False
        self._close_locks()
        self._state.remove()
        self._state = MountState.create()
        self.current = self.pending = self._previous = self.standby = None
        self._lost_requests = False
        self._fuse = None  # the new first serving process mounts once it is built
        self._start(Purpose.FIRST)

    def _keep_lock(self, fd: int) -> None:
        self._close_locks()
        self._lock_fds = [fd]

    def _close_locks(self) -> None:
        for fd in self._lock_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lock_fds = []

    def _ping(self) -> None:
        server = self.current
        if server is None or server.phase is not Phase.SERVING:
            return
        now = self._clock()
        if now - server.last_pong > PING_TIMEOUT:
            log.error(
                "%s has not answered for %.0f s; replacing it", server, now - server.last_pong
            )
            server.kill()
            return
        server.send(channel.PING)

    def _kill_all(self) -> None:
        for server in self._servers:
            log.warning("%s still running %.0f s after the mount ended; killing it",
                        server, REQUESTS_GRACE)  # fmt: skip
            server.kill()

    # -- requests ----------------------------------------------------------------------

    def _switch(self, request: Request) -> None:
        """Start a serving process for a reload or restart (after one under way)."""
        if self._stopping or self._fuse is None:
            reply(request, {"ok": False, "error": "the mount is stopping"})
            return
        if self.pending is not None or not self._ready_told:
            self._requests.queued.append(request)
            return
        self._loop.cancel("restart")  # asked while backing off: now, not later
        self._drop_standby()  # it was made from the config and code being replaced
        purpose = Purpose.RESTART if request.command == "restart" else Purpose.RELOAD
        log.info("%s of %s asked", request.command, self.settings.mountpoint)
        status = f"STATUS={request.command} of {self.settings.mountpoint}"
        self._notifier.notify("RELOADING=1", status)
        self._start(purpose, [request])

    def _run_queued(self) -> None:
        """The switch under way is over: start the next asked, for all asked meanwhile
        (each new serving process reads the config as it is then)."""
        queued, self._requests.queued = self._requests.queued, []
        if not queued:
            return
        self._switch(queued[0])
        server = self.pending
        for request in queued[1:]:
            if server is not None:
                self._requests.wait_for(server.pid, [request])
            else:
                reply(request, {"ok": False, "error": "the mount is stopping"})

    def _answer(self, server: ServerProcess, value: dict[str, Any]) -> None:
        requests = self._requests.answer(server.pid, value)
        if requests:  # the reload is over, done or not: systemd waits for READY=1
            status = f"STATUS=serving {self.settings.mountpoint}"
            if not value.get("ok"):
                status += f" (the last {requests[0].command} failed: {value.get('error')})"
            self._notifier.notify("READY=1", status)
        if server is not self.pending:
            self._run_queued()

    # -- life ---------------------------------------------------------------------------

    def _tell_ready(self) -> None:
        self._ready_told = True
        if self._log is not None:
            self._log.release()
        log.info("%s is live", self.settings.mountpoint)
        self._notifier.notify("READY=1", f"STATUS=serving {self.settings.mountpoint}")
        fd = self.settings.ready_fd
        if fd is not None:
            try:
                os.write(fd, b"ready\n")
            except BrokenPipeError:
                # The command that asked for this mount is gone before it heard that
                # the mount is live (Ctrl-C): the mount is not wanted.
                log.warning("the command that started this mount is gone; unmounting")
                self._stop("the command that started it is gone")
            finally:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._run_queued()

    def _fail_start(self, reason: str) -> None:
        """The mount never became live: say why to whoever started it, and end."""
        if self._log is not None and not self._ready_told:
            self._log.drop()  # the one line below says it
        else:
            log.error("cannot serve %s: %s", self.settings.mountpoint, reason)
        self.exit_status = 1
        if self._fuse is not None:  # mounted, and never served: leave no dead mount behind
            with contextlib.suppress(MountError):
                lazy_unmount(self.settings.mountpoint)
        fd = self.settings.ready_fd
        if fd is None:  # in the foreground: the user is at this terminal
            print(f"decodefs: error: {reason}", file=sys.stderr, flush=True)
        elif not self._ready_told:
            with contextlib.suppress(OSError):
                os.write(fd, f"error: {reason}".encode())
        self._stopping = True
        self._done = True
        for server in self._servers:
            server.kill()
            with contextlib.suppress(Exception):
                server.process.wait(timeout=10)

    def _install_signals(self) -> None:
        self._wakeup_r.setblocking(False)
        self._wakeup_w.setblocking(False)
        signal.set_wakeup_fd(self._wakeup_w.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(signum, lambda *_: None)  # the wakeup fd carries it to the loop
        self._loop.watch(self._wakeup_r.fileno(), self._on_signals)

    def _on_signals(self, _: int) -> None:
        try:
            data = self._wakeup_r.recv(64)
        except BlockingIOError:
            return
        for signum in data:
            if signum == signal.SIGHUP:
                self._switch(Request("reload", None))
            elif signum in (signal.SIGTERM, signal.SIGINT):
                self._stop(f"{signal.Signals(signum).name} received")
            elif signum == signal.SIGUSR1:  # where a stuck mount is stuck: ask them all
                log.warning("SIGUSR1: the holder: %s; passed on to serving processes %s",
                            self.status(), [s.pid for s in self._servers])  # fmt: skip
                for server in self._servers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(server.pid, signal.SIGUSR1)

    def _stop(self, why: str) -> None:
        """Detach at once, let open files finish, then stop the serving processes."""
        if self._stopping:
            return
        self._stopping = True
        log.info("%s; unmounting %s", why, self.settings.mountpoint)
        self._notifier.notify("STOPPING=1", f"STATUS=unmounting {self.settings.mountpoint}")
        self._requests.answer_all("the mount is stopping")
        for server in list(self._servers):
            if server.phase in (Phase.PREPARING, Phase.PREPARED):
                server.kill()
        try:
            lazy_unmount(self.settings.mountpoint)
        except MountError as exc:
            log.warning("%s; stopping now", exc)
            self._drain_all()
            return
        self._loop.at("grace", SHUTDOWN_GRACE, self._grace_over)

    def _grace_over(self) -> None:
        if self._servers:
            log.warning("files still open after %.0f s; stopping anyway", SHUTDOWN_GRACE)
        self._drain_all()

    def _drain_all(self) -> None:
        for server in self._servers:
            if server.phase is Phase.SERVING:
                server.phase = Phase.DRAINING
                server.send(channel.DRAIN)
        self._loop.at("kill-servers", REQUESTS_GRACE, self._kill_all)

    def _check_done(self) -> None:
        grace_over = self._loop.pending("grace") is None
        if self._stopping and not self._servers and (self._ended or grace_over):
            self._done = True

    def _cleanup(self) -> None:
        for server in list(self._servers):
            server.kill()
            with contextlib.suppress(Exception):
                server.process.wait(timeout=10)
            server.close()
        self._requests.answer_all("the mount ended")
        self._requests.close()
        if self._control is not None:
            self._control.close()
            with contextlib.suppress(OSError):
                os.unlink(holder_socket_path(self.settings.mountpoint))
        self._close_locks()
        if self._fuse is not None:
            self._fuse.close()
        if self._state is not None:
            self._state.remove()
        signal.set_wakeup_fd(-1)

    # -- status --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What stats.json's ``holder`` and `decodefs stats` show of the holder."""
        current = self.current
        if self._stopping:
            state = "stopping"
        elif self._eio:
            state = "backing off"
        elif self.pending is not None:
            state = "switching"
        elif current is not None and current.phase is Phase.SERVING:
            state = "serving"
        else:
            state = "starting"
        restart = self._loop.pending("restart")
        return {
            "pid": os.getpid(),
            "version": package_version(),
            "started": round(self.started, 3),
            "mount_id": self._state.mount_id if self._state else None,
            "state": state,
            "serving_pid": current.pid if current is not None else None,
            "standby_pid": self.standby.pid if self.standby is not None else None,
            "generation": self._generation,
            **self.counts,
            "recent_crashes": self._backoff.recent,
            "next_start_in": None if restart is None else round(restart, 1),
            "last_problem": self.last_problem,
            "last_pause": self.pauses[0],
            "longest_pause": self.pauses[1],
            "rss_bytes": _rss_bytes(),
            "socket": holder_socket_path(self.settings.mountpoint),
            "config": self.settings.config,
        }

    def _server_status(self, server: ServerProcess) -> dict[str, Any]:
        return {"pid": server.pid, "version": server.version, "generation": server.generation}

    def _status_changed(self) -> None:
        server = self.current
        if server is not None and server.phase is Phase.SERVING:
            server.send(channel.HOLDER_STATUS, holder=self.status())


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
