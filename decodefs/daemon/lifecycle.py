"""Mount life cycle: stale-mount recovery, start-up, serving, signals, clean unmount.

``serve`` runs a mount in this process until it is unmounted or signalled;
``spawn`` starts ``serve`` in a detached child and returns once the mount is
live. SIGUSR1 makes a running daemon log every thread's stack and its trio
task tree, for a daemon that seems stuck. This module wires the layers
together and runs the daemon's periodic loops (the LRU flush, the store
check); it holds no caching policy.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import faulthandler
import json
import logging
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio

from ..cluster import L2Tier, open_backend
from ..common.config import Config
from ..common.decode import quiet_pillow_warnings
from ..common.inodes import INODE_LAYOUT
from ..common.metrics import LogThrottle, render_prometheus
from ..common.mounts import MountError, find_mount, lazy_unmount, mounts, prepare_mountpoint
from ..common.protocol import (
    CONFIG_FILE,
    FS_TYPE,
    METRICS_FILE,
    STATS_FILE,
    STORE_FILE,
    StoreStatus,
)
from ..common.source import scan_source
from ..store import Store
from .background_warm import BackgroundWarm
from .direct_hits import DirectHits
from .engine import Engine
from .fs import DecodeFS, FuseMount, MountFailed
from .namespace import Tree, version_order
from .notify import ServiceNotifier
from .stats import snapshot

__all__ = [
    "ACCESS_FLUSH_SECONDS",
    "STORE_CHECK_SECONDS",
    "empty_version_warning",
    "flush_accesses_forever",
    "serve",
    "spawn",
    "store_warning",
    "watch_store_forever",
]

log = logging.getLogger(__name__)

# The mount's readahead: an array of up to 591x591 (1 MiB) arrives in one READ request.
READAHEAD_KB: Final = 1024
_M_MMAP_THRESHOLD: Final = -3  # glibc's mallopt parameter (malloc.h)
# After SIGTERM, how long readers holding an open file are still served.
SHUTDOWN_GRACE: Final = 10.0
# Then how long requests already running may take to finish before they are cancelled.
REQUESTS_GRACE: Final = 5.0
# How often hits' access times go to the catalog (LRU), and the store is checked.
ACCESS_FLUSH_SECONDS: Final = 30.0
STORE_CHECK_SECONDS: Final = 5.0


def serve(
    config: Config,
    mountpoint: str,
    on_ready: Callable[[], None] | None = None,
    nonempty: bool = False,
) -> None:
    """Mount and serve until unmounted or sent SIGTERM/SIGINT; then unmount cleanly."""
    with _stacks_on_sigusr1():
        _serve_mount(config, mountpoint, on_ready, nonempty)


def _serve_mount(
    config: Config, mountpoint: str, on_ready: Callable[[], None] | None, nonempty: bool
) -> None:
    mountpoint = os.path.abspath(mountpoint)
    notifier = ServiceNotifier.from_environment()
    prepare_mountpoint(mountpoint, nonempty)
    warning = store_warning(config)
    if warning is not None:
        log.warning("%s", warning)
    quiet_pillow_warnings()
    _raise_open_file_limit()
    _return_large_allocations()
    store = Store.from_config(config)
    store.open()
    try:
        notifier.notify(f"STATUS=indexing originals for {mountpoint}")
        index_cache = store.cache_dir("index")
        sources = {
            name: scan_source(
                name, v.source, v.extensions, v.duplicates, index_cache, layout=v.layout
            )
            for name, v in config.versions.items()
        }
        for name, index in sources.items():
            if not len(index):
                log.warning("%s", empty_version_warning(config, name))
        engine = Engine(config, sources, store, l2=_l2_tier(config))
        access_socket = store.access_socket_path()
        status = StoreStatus(
            store=store.root,
            digests=store.digests(),
            version_order=version_order(config),  # as inode numbers index them
            inode_layout=INODE_LAYOUT,
            min_size=config.min_size,
            max_size=config.max_size,
            access_socket=access_socket,
            mirrors=frozenset(n for n, v in config.versions.items() if v.layout == "mirror"),
        )

        def stats() -> dict[str, object]:
            return snapshot(engine, sources, pid=os.getpid(), mountpoint=mountpoint)

        status_files: dict[str, Callable[[], bytes]] = {
            STATS_FILE: lambda: _json(stats()),
            METRICS_FILE: lambda: render_prometheus(stats()),
            CONFIG_FILE: lambda: _json(config.as_dict()),
            STORE_FILE: status.to_json,  # what read_array() needs (reader.py)
        }
        tree = Tree(config, sources)  # lists protocol.STATUS_FILES, the keys above
        operations = DecodeFS(tree, engine, status_files)
        loops = _Loops(
            engine,
            BackgroundWarm(engine, sources),
            DirectHits(config, sources, store, engine.metrics),
            access_socket,
        )
        fuse = FuseMount(operations, mountpoint, allow_other=config.allow_other)
        try:
            fuse.mount()
        except MountFailed as exc:
            hint = "is /dev/fuse present and fusermount3 installed?"
            if config.allow_other and os.geteuid() != 0:
                hint = "allow_other needs 'user_allow_other' in /etc/fuse.conf when not root"
            raise MountError(f"cannot mount {mountpoint}: {exc} ({hint})") from exc
        try:
            trio.run(_serve, fuse, loops, mountpoint, on_ready, notifier)
        finally:
            fuse.close()
            engine.close()
    finally:
        store.close()
    log.info("unmounted %s", mountpoint)


@dataclass(frozen=True)
class _Loops:
    """What runs beside the request handlers for the daemon's life."""

    engine: Engine
    warm: BackgroundWarm  # started once the mount is live
    direct_hits: DirectHits
    access_socket: str | None  # where direct hits arrive (None: nowhere)


async def _serve(
    fuse: FuseMount,
    loops: _Loops,
    mountpoint: str,
    on_ready: Callable[[], None] | None,
    notifier: ServiceNotifier,
) -> None:
    stopping = trio.Event()  # set once a signal asked us to stop
    serving = trio.CancelScope()  # cancelled if requests outlast the grace after a signal
    aborted = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, fuse, mountpoint, notifier, stopping, serving)
        nursery.start_soon(_dump_on_sigusr1)
        engine = loops.engine
        nursery.start_soon(_once_live, loops.warm, mountpoint, on_ready, notifier, nursery)
        nursery.start_soon(flush_accesses_forever, engine)
        nursery.start_soon(watch_store_forever, engine)
        nursery.start_soon(engine.reads.drop_forever)
        nursery.start_soon(engine.note_stored)
        if engine.l2 is not None:
            nursery.start_soon(engine.l2.run)  # publishes to the cluster's L2
        if loops.access_socket is not None:
            nursery.start_soon(loops.direct_hits.receive, loops.access_socket)
        with serving:
            aborted = await fuse.serve()
        nursery.cancel_scope.cancel()
    if find_mount(mountpoint) is not None and not stopping.is_set():
        # Still mounted, and nobody asked us to stop: not an unmount, so the
        # connection was aborted under us (libfuse may or may not say so).
        # Fail, so that a service manager restarts the daemon.
        raise ConnectionAbortedError(errno.ECONNABORTED, "the kernel aborted the FUSE connection")
    if aborted:
        log.info("the unmount raced queued requests (the kernel said ECONNABORTED); nothing lost")


async def flush_accesses_forever(engine: Engine, interval: float = ACCESS_FLUSH_SECONDS) -> None:
    """Write hits' access times to the catalog every ``interval``, for LRU eviction."""
    while True:
        await trio.sleep(interval)
        await engine.flush_accesses()


async def watch_store_forever(engine: Engine, interval: float = STORE_CHECK_SECONDS) -> None:
    """Notice a store removed at runtime, and use it again once it is made again."""
    while True:
        await trio.sleep(interval)
        await engine.check_store()


async def _stop_on_signal(
    fuse: FuseMount,
    mountpoint: str,
    notifier: ServiceNotifier,
    stopping: trio.Event,
    serving: trio.CancelScope,
) -> None:
    """SIGTERM/SIGINT: detach at once, let open files finish, then stop.

    The lazy unmount takes the mount out of the namespace (no new opens) while
    readers that already hold a file keep being served, for up to
    SHUTDOWN_GRACE seconds, so a service restart does not fail a read half-way.
    Requests still running REQUESTS_GRACE seconds after that are cancelled
    (pyfuse3 waits for its request tasks), so nothing keeps the daemon alive.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s received; unmounting", signal.Signals(signum).name)
            break
    stopping.set()
    notifier.notify("STOPPING=1", f"STATUS=unmounting {mountpoint}")
    try:
        await trio.to_thread.run_sync(lazy_unmount, mountpoint)
    except MountError as exc:
        log.warning("%s; stopping now", exc)
    else:
        await trio.sleep(SHUTDOWN_GRACE)
        log.warning("files still open after %.0f s; stopping anyway", SHUTDOWN_GRACE)
    fuse.stop()
    await trio.sleep(REQUESTS_GRACE)
    log.warning("requests still running %.0f s after stopping; cancelling them", REQUESTS_GRACE)
    serving.cancel()


@contextlib.contextmanager
def _stacks_on_sigusr1() -> Iterator[None]:
    """SIGUSR1 dumps every thread's stack, for the whole life of ``serve``.

    faulthandler answers it from its C signal handler, which works even while
    the main thread is stuck in a system call or a C library holding the GIL:
    a stuck daemon still shows where it is stuck. While the trio loop runs,
    _dump_on_sigusr1 chains trio's handler behind it to add the task tree.
    SIG_IGN underneath means the signal never kills the daemon in the instant
    one handler hands over to the other.
    """
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    try:
        yield
    finally:
        faulthandler.unregister(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, previous)


async def _dump_on_sigusr1() -> None:
    """SIGUSR1 in the loop: faulthandler dumps the threads' stacks at once, then this
    task logs the trio task tree (when the loop gets to it: not if the loop is stuck)."""
    # trio restores the handler it replaced when the receiver closes, and that
    # must be a Python-level one, which faulthandler's is not: so faulthandler
    # steps aside (to SIG_IGN) while trio installs its handler, then registers
    # again in front of it, chaining to it.
    faulthandler.unregister(signal.SIGUSR1)
    try:
        with trio.open_signal_receiver(signal.SIGUSR1) as signals:
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
            try:
                async for _ in signals:
                    log.warning(
                        "SIGUSR1: every thread's stack is above; the trio tasks:\n%s",
                        "\n".join(_task_tree()),
                    )
            finally:
                faulthandler.unregister(signal.SIGUSR1)
    finally:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def _task_tree() -> list[str]:
    """One line per trio task, indented by nesting: its name and where it waits.

    Where = the innermost frame of its await chain outside trio itself (the
    line of our code, or pyfuse3's, that awaits), else the innermost one.
    """
    trio_dir = os.path.dirname(trio.__file__) + os.sep
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        frames = list(task.iter_await_frames())
        ours = [f for f in frames if not f[0].f_code.co_filename.startswith(trio_dir)]
        where = ""
        if frames:
            frame, lineno = (ours or frames)[-1]
            code = frame.f_code
            where = f" at {code.co_filename}:{lineno} in {code.co_name}"
        lines.append(f"{'  ' * depth}task {task.name}{where}")
        for nursery in task.child_nurseries:
            for child in sorted(nursery.child_tasks, key=lambda t: t.name):
                walk(child, depth + 1)

    root = trio.lowlevel.current_root_task()
    if root is not None:
        walk(root, 0)
    return lines


async def _once_live(
    warm: BackgroundWarm,
    mountpoint: str,
    on_ready: Callable[[], None] | None,
    notifier: ServiceNotifier,
    nursery: trio.Nursery,
) -> None:
    # A statvfs answered by our own handlers proves the kernel can reach us.
    await trio.to_thread.run_sync(os.statvfs, mountpoint)
    # After the kernel's INIT, which sets the readahead to what libfuse answered.
    await trio.to_thread.run_sync(_raise_readahead, mountpoint)
    log.info("mounted %s", mountpoint)
    notifier.notify("READY=1", f"STATUS=serving {mountpoint}")
    if on_ready is not None:
        on_ready()
    interval = notifier.watchdog_interval
    if interval is not None:
        nursery.start_soon(_feed_watchdog, mountpoint, notifier, interval)
    nursery.start_soon(warm.run)


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


def spawn(
    config_path: Path,
    mountpoint: str,
    log_file: Path,
    log_level: str | None,
    nonempty: bool = False,
) -> int:
    """Start a detached daemon and return its pid once the mount is live.

    The child reports readiness through a pipe; if it exits first, the tail of
    its log explains why and MountError carries it.
    """
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_stream = open(log_file, "ab")  # noqa: SIM115 - closed below, once the child has it
    except OSError as exc:
        raise MountError(f"log file {log_file} cannot be written: {exc.strerror}") from None
    read_end, write_end = os.pipe()
    command = [
        sys.executable, "-m", "decodefs", "mount", mountpoint,
        "--config", str(config_path), "--foreground", "--ready-fd", str(write_end),
    ]  # fmt: skip
    if log_level:
        command += ["--log-level", log_level]
    if nonempty:
        command.append("--nonempty")
    with log_stream:
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
    tail = "\n".join(f"    {line}" for line in _tail(log_file).splitlines())
    raise MountError(
        f"daemon exited with status {code} before the mount was live; {log_file} ends:\n{tail}"
    )


def _l2_tier(config: Config) -> L2Tier | None:
    """The cluster's shared tier, if the config names one (no call is made yet)."""
    if config.l2 is None:
        return None
    fingerprints = config.fingerprints()
    tier = L2Tier(open_backend(config.l2), config.l2, fingerprints)
    log.info("L2: %s (lease %g s)", tier.backend.description, config.l2.lease_seconds)
    return tier


def empty_version_warning(config: Config, version: str) -> str:
    """What a user should hear about a version whose source holds no original."""
    settings = config.versions[version]
    extensions = ", ".join(sorted(settings.extensions))
    return (
        f"version {version} serves nothing: 0 originals under {settings.source} "
        f"(files ending in {extensions}, any case, found recursively); check "
        f"versions.{version}.source and extensions"
    )


def store_warning(config: Config) -> str | None:
    """Why the store will fail open from the start (read-only, full, cannot be created), or None.

    Not an error: the daemon then serves every array the store lacks from
    memory, but the user should hear of it when mounting, not in a log.
    """
    existing = config.store
    while not os.path.isdir(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        vfs = os.statvfs(existing)
    except OSError:
        return None  # cannot tell; the daemon logs what it finds
    smallest = min((s for v in config.versions.values() for s in v.sizes), default=config.min_size)
    if vfs.f_flag & os.ST_RDONLY:
        reason = "is on a read-only filesystem"
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = "is not writable by this user"
    elif vfs.f_bavail * vfs.f_frsize < 3 * smallest * smallest or vfs.f_favail == 0:
        reason = "is on a full filesystem"
    else:
        return None
    where = f"store {config.store}"
    if existing != config.store:
        where += f" cannot be created: {existing}"
    return (
        f"{where} {reason}; arrays not already stored will be decoded and served "
        "from memory (memory_cache_bytes)"
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


def _return_large_allocations() -> None:
    """Give the memory of a large decode back to the system when it is freed.

    glibc serves allocations above a threshold with their own mmap and unmaps
    them on free, but raises that threshold (up to 32 MiB) each time such a
    block is freed, after which Pillow's 16 MiB image blocks come from the
    heap and stay with the process: one 9000x9000 decode left the daemon at
    ~660 MiB. A fixed threshold of 1 MiB (mallopt disables the adjustment)
    returns them at once, measured back to ~40 MiB, for one mmap per large
    block, which is nothing next to a decode.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20) != 1:
            log.debug("mallopt(M_MMAP_THRESHOLD) refused; large decodes may stay resident")
    except (OSError, AttributeError) as exc:  # not glibc
        log.debug("cannot set malloc's mmap threshold: %s", exc)


def _raise_readahead(mountpoint: str) -> None:
    """Let the kernel read an array ahead in one READ request (READAHEAD_KB), not in
    pieces of its default 128 KiB: each request is a round trip through the daemon.

    The mount's readahead is its backing device's (/sys/class/bdi/MAJOR:MINOR), which
    FUSE caps at INIT to what libfuse answers (the kernel's default); only root may
    raise it, once the mount is live. Found through the mount table.
    """
    ours = [m for m in mounts() if m.mountpoint == mountpoint and m.fstype == FS_TYPE]
    if not ours:
        return
    major, minor = ours[-1].device
    path = f"/sys/class/bdi/{major}:{minor}/read_ahead_kb"
    try:
        with open(path, "r+", encoding="ascii") as f:
            if int(f.read()) < READAHEAD_KB:
                f.seek(0)
                f.write(str(READAHEAD_KB))
    except (OSError, ValueError) as exc:
        log.debug("cannot raise the readahead of %s (%s): %s", mountpoint, path, exc)


def _json(value: object) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"
