"""Mount life cycle: stale-mount recovery, start-up, serving, signals, clean unmount.

``serve`` runs a mount in this process until it is unmounted or signalled;
``spawn`` starts ``serve`` in a detached child and returns once the mount is
live. This module wires the layers together; it holds no caching policy.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

import trio

from .config import Config
from .decode import decoder_fingerprint, quiet_pillow_warnings
from .engine import Engine
from .fs import DecodeFS, FuseMount, MountFailed
from .inodes import INODE_LAYOUT
from .metrics import LogThrottle, render_prometheus
from .mountinfo import MountInfo, mounts
from .notify import ServiceNotifier
from .protocol import (
    ACCESS_REPORT_MAX,
    CONFIG_FILE,
    FS_TYPE,
    METRICS_FILE,
    STATS_FILE,
    STATUS_DIR,
    STORE_FILE,
    StoreStatus,
)
from .source import scan_source
from .store import Store
from .tree import Tree

__all__ = [
    "MountError",
    "MountInfo",
    "clear_stale",
    "find_mount",
    "prepare_mountpoint",
    "serve",
    "spawn",
    "unmount",
]

log = logging.getLogger(__name__)

_PROBE_TIMEOUT: Final = 5.0
# After SIGTERM, how long readers holding an open file are still served.
SHUTDOWN_GRACE: Final = 10.0


class MountError(Exception):
    """A mount point problem the user must resolve (already mounted, not a directory)."""


def find_mount(mountpoint: str | os.PathLike[str]) -> MountInfo | None:
    """The mount at exactly ``mountpoint``, from /proc/self/mountinfo.

    ``os.path.ismount`` is no use here: on a dead FUSE daemon its lstat fails
    with ENOTCONN and it answers False.
    """
    target = os.path.abspath(mountpoint)
    found = [m for m in mounts() if m.mountpoint == target]
    return found[-1] if found else None  # the last one listed is the one on top


def probe(mountpoint: str) -> str:
    """'live', 'stale' (daemon gone: ENOTCONN) or 'hung' (no answer in time)."""
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            os.statvfs(mountpoint)
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    # A daemon thread: a hung mount may never answer, and must not hold up exit.
    thread = threading.Thread(target=call, name="mount-probe", daemon=True)
    thread.start()
    thread.join(_PROBE_TIMEOUT)
    if not outcome:
        return "hung"
    error = outcome[0]
    if isinstance(error, OSError) and error.errno in (errno.ENOTCONN, errno.ECONNABORTED):
        return "stale"
    if error is not None:
        raise error
    return "live"


def prepare_mountpoint(mountpoint: str) -> None:
    """Make ``mountpoint`` ready to mount on: clear a dead decodefs mount, refuse a live one."""
    info = find_mount(mountpoint)
    if info is not None:
        state = probe(mountpoint) if info.fstype.startswith("fuse") else "live"
        if state == "stale":
            log.warning(
                "clearing stale mount at %s (%s): its daemon is gone "
                "(transport endpoint is not connected)",
                mountpoint,
                info.fstype,
            )
            _lazy_unmount(mountpoint)
        elif state == "hung":
            raise MountError(
                f"{mountpoint} is mounted ({info.fstype}) but does not answer; "
                f"run `decodefs umount --lazy {mountpoint}` once its daemon is stopped"
            )
        else:
            raise MountError(
                f"{mountpoint} is already mounted ({info.fstype} from {info.source}); "
                f"run `decodefs umount {mountpoint}` first"
            )
    if not os.path.isdir(mountpoint):
        raise MountError(f"mount point {mountpoint} is not a directory (create it first)")


def clear_stale(mountpoint: str) -> bool:
    """Clear ``mountpoint`` if its daemon is gone; leave anything else alone. True if cleared."""
    info = find_mount(mountpoint)
    if info is None or not info.fstype.startswith("fuse") or probe(mountpoint) != "stale":
        return False
    log.warning("clearing stale mount at %s (%s): its daemon is gone", mountpoint, info.fstype)
    _lazy_unmount(mountpoint)
    return True


def unmount(mountpoint: str, lazy: bool = False, wait: float = 30.0) -> None:
    """Unmount and wait for the daemon to exit (it releases the store lock).

    A lazy unmount returns at once: the daemon keeps serving files that are
    still open and exits when the last one is closed.
    """
    info = find_mount(mountpoint)
    if info is None:
        raise MountError(f"{mountpoint} is not mounted")
    pid = _daemon_pid(mountpoint) if info.fstype == FS_TYPE and not lazy else None
    command = ["fusermount3", "-u", *(["-z"] if lazy else []), mountpoint]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        detail = result.stderr.strip() or f"fusermount3 exited with {result.returncode}"
        hint = (
            ""
            if lazy
            else f" (close the files open there, or use `decodefs umount --lazy {mountpoint}`)"
        )
        raise MountError(f"cannot unmount {mountpoint}: {detail}{hint}")
    if pid is not None:
        deadline = time.monotonic() + wait
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def serve(config: Config, mountpoint: str, on_ready: Callable[[], None] | None = None) -> None:
    """Mount and serve until unmounted or sent SIGTERM/SIGINT; then unmount cleanly."""
    mountpoint = os.path.abspath(mountpoint)
    notifier = ServiceNotifier.from_environment()
    prepare_mountpoint(mountpoint)
    quiet_pillow_warnings()
    _raise_open_file_limit()
    store = Store(
        config.store,
        {name: decoder_fingerprint(v.decode) for name, v in config.versions.items()},
        max_bytes=config.max_store_bytes,
        min_free_fraction=config.min_free_fraction,
        shared=config.allow_other,
    )
    store.open()
    try:
        notifier.notify(f"STATUS=indexing originals for {mountpoint}")
        index_cache = store.cache_dir("index")
        sources = {
            name: scan_source(name, v.source, v.extensions, v.duplicates, index_cache)
            for name, v in config.versions.items()
        }
        engine = Engine(config, sources, store)
        access_socket = store.access_socket_path()
        status = StoreStatus(
            store=store.root,
            digests=store.digests(),
            version_order=engine.version_names,  # as inode numbers index them
            inode_layout=INODE_LAYOUT,
            min_size=config.min_size,
            max_size=config.max_size,
            access_socket=access_socket,
        )
        status_files: dict[str, Callable[[], bytes]] = {
            STATS_FILE: lambda: _json(
                {**engine.stats(), "pid": os.getpid(), "mountpoint": mountpoint}
            ),
            METRICS_FILE: lambda: render_prometheus(engine.stats()),
            CONFIG_FILE: lambda: _json(config.as_dict()),
            STORE_FILE: status.to_json,  # what read_array() needs (reader.py)
        }
        operations = DecodeFS(Tree(engine, list(status_files)), engine, status_files)
        fuse = FuseMount(operations, mountpoint, allow_other=config.allow_other)
        try:
            fuse.mount()
        except MountFailed as exc:
            hint = "is /dev/fuse present and fusermount3 installed?"
            if config.allow_other and os.geteuid() != 0:
                hint = "allow_other needs 'user_allow_other' in /etc/fuse.conf when not root"
            raise MountError(f"cannot mount {mountpoint}: {exc} ({hint})") from exc
        try:
            trio.run(_serve, fuse, engine, mountpoint, on_ready, notifier, access_socket)
        finally:
            fuse.close()
            engine.close()
    finally:
        store.close()
    log.info("unmounted %s", mountpoint)


async def _serve(
    fuse: FuseMount,
    engine: Engine,
    mountpoint: str,
    on_ready: Callable[[], None] | None,
    notifier: ServiceNotifier,
    access_socket: str | None,
) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, fuse, mountpoint, notifier)
        nursery.start_soon(_once_live, engine, mountpoint, on_ready, notifier, nursery)
        nursery.start_soon(engine.flush_accesses_forever)
        nursery.start_soon(engine.watch_store_forever)
        if access_socket is not None:
            nursery.start_soon(_receive_direct_hits, engine, access_socket)
        aborted = await fuse.serve()
        nursery.cancel_scope.cancel()
    if not aborted:
        return
    if find_mount(mountpoint) is not None:
        # Still mounted, so not an unmount: the connection was aborted under us.
        # Fail, so that a service manager restarts the daemon.
        raise ConnectionAbortedError(errno.ECONNABORTED, "the kernel aborted the FUSE connection")
    log.info("the unmount raced queued requests (the kernel said ECONNABORTED); nothing was lost")


async def _receive_direct_hits(engine: Engine, path: str) -> None:
    """Hits read_array() read straight from the store, reported by readers for LRU."""
    with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # left by an earlier daemon
            await sock.bind(path)
            os.chmod(path, 0o666)  # any reader may report; reports only order the LRU
        except OSError as exc:
            log.warning("cannot listen for direct hits at %s: %s", path, exc)
            return
        throttle = LogThrottle(log)
        try:
            while True:
                try:
                    engine.note_direct_hits(await sock.recv(ACCESS_REPORT_MAX))
                except Exception as exc:  # a report orders the LRU: never worth the daemon
                    throttle.log(logging.ERROR, "direct-hits", "direct-hit report: %r", exc)
                    await trio.sleep(0.1)  # a socket that keeps failing must not spin
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)


async def _stop_on_signal(fuse: FuseMount, mountpoint: str, notifier: ServiceNotifier) -> None:
    """SIGTERM/SIGINT: detach at once, let open files finish, then stop.

    The lazy unmount takes the mount out of the namespace (no new opens) while
    readers that already hold a file keep being served, for up to
    SHUTDOWN_GRACE seconds, so a service restart does not fail a read half-way.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s received; unmounting", signal.Signals(signum).name)
            break
    notifier.notify("STOPPING=1", f"STATUS=unmounting {mountpoint}")
    try:
        await trio.to_thread.run_sync(_lazy_unmount, mountpoint)
    except MountError as exc:
        log.warning("%s; stopping now", exc)
    else:
        await trio.sleep(SHUTDOWN_GRACE)
        log.warning("files still open after %.0f s; stopping anyway", SHUTDOWN_GRACE)
    fuse.stop()


async def _once_live(
    engine: Engine,
    mountpoint: str,
    on_ready: Callable[[], None] | None,
    notifier: ServiceNotifier,
    nursery: trio.Nursery,
) -> None:
    # A statvfs answered by our own handlers proves the kernel can reach us.
    await trio.to_thread.run_sync(os.statvfs, mountpoint)
    log.info("mounted %s", mountpoint)
    notifier.notify("READY=1", f"STATUS=serving {mountpoint}")
    if on_ready is not None:
        on_ready()
    interval = notifier.watchdog_interval
    if interval is not None:
        nursery.start_soon(_feed_watchdog, mountpoint, notifier, interval)
    nursery.start_soon(engine.warm_in_background)


async def _statvfs_through(mountpoint: str) -> None:
    """A request that must make it through the mount to our own handlers."""
    await trio.to_thread.run_sync(os.statvfs, mountpoint, abandon_on_cancel=True)


async def _feed_watchdog(
    mountpoint: str,
    notifier: ServiceNotifier,
    interval: float,
    probe: Callable[[str], Awaitable[object]] = _statvfs_through,
) -> None:
    """WATCHDOG=1 each interval, but only after a request made it through the mount.

    A stuck event loop or a wedged FUSE connection stops the pings (a probe
    that fails sends none either), and systemd restarts the service.
    """
    throttle = LogThrottle(log)
    while True:
        with trio.move_on_after(interval):
            try:
                await probe(mountpoint)
            except OSError as exc:
                throttle.log(logging.WARNING, "watchdog", "watchdog probe failed: %s", exc)
            else:
                notifier.notify("WATCHDOG=1")
        await trio.sleep(interval)


def spawn(config_path: Path, mountpoint: str, log_file: Path, log_level: str | None) -> int:
    """Start a detached daemon and return its pid once the mount is live.

    The child reports readiness through a pipe; if it exits first, the tail of
    its log explains why and MountError carries it.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    read_end, write_end = os.pipe()
    command = [
        sys.executable, "-m", "decodefs", "mount", mountpoint,
        "--config", str(config_path), "--foreground", "--ready-fd", str(write_end),
    ]  # fmt: skip
    if log_level:
        command += ["--log-level", log_level]
    with open(log_file, "ab") as log_stream:
        child = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_stream,
            stderr=log_stream,
            pass_fds=(write_end,),
            start_new_session=True,
        )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as ready:
        message = ready.read()  # EOF when the child exits or closes the fd
    if message.startswith(b"ready"):
        return child.pid
    code = child.wait()
    if message.startswith(b"error: "):
        raise MountError(message[len(b"error: ") :].decode(errors="replace"))
    raise MountError(
        f"daemon exited with status {code} before the mount was live:\n{_tail(log_file)}"
    )


def _raise_open_file_limit() -> None:
    """Many readers at once must not run the daemon out of descriptors (soft limit 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # an unlimited hard limit cannot be the soft one
        log.debug("open-file limit stays %d: %s", soft, exc)
    else:
        log.debug("open-file limit raised from %d to %d", soft, hard)


def _daemon_pid(mountpoint: str) -> int | None:
    try:
        with open(os.path.join(mountpoint, STATUS_DIR, STATS_FILE), "rb") as f:
            pid = json.load(f).get("pid")
    except (OSError, ValueError):
        return None
    return pid if isinstance(pid, int) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (tests) counts as gone.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _lazy_unmount(mountpoint: str) -> None:
    result = subprocess.run(
        ["fusermount3", "-u", "-z", mountpoint], capture_output=True, text=True, check=False
    )
    if result.returncode != 0 and find_mount(mountpoint) is not None:
        raise MountError(f"cannot clear stale mount {mountpoint}: {result.stderr.strip()}")


def _json(value: object) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"
