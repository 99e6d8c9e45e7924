"""Mount life cycle: start-up, serving, signals, systemd, clean unmount.

``serve`` runs a mount in this process until it is unmounted or signalled
(spawn.py starts it in a detached child). This module wires the layers
together and starts what runs beside the requests, each object its own loops
(``Engine.run``); it holds no caching policy.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import trio

from ..cluster import L2Tier, open_backend
from ..common.advice import empty_version_warning, store_warning
from ..common.config import Config
from ..common.decode import quiet_pillow_warnings
from ..common.inodes import INODE_LAYOUT
from ..common.metrics import LogThrottle, render_prometheus
from ..common.mounts import MountError, find_mount, lazy_unmount
from ..common.protocol import (
    CONFIG_FILE,
    FAILED_FILE,
    METRICS_FILE,
    STATS_FILE,
    STORE_FILE,
    StoreStatus,
)
from ..common.source import scan_source
from ..common.version import package_version
from ..store import Store
from .background_warm import BackgroundWarm
from .debug import dump_on_sigusr1, stacks_on_sigusr1
from .direct_hits import DirectHits
from .engine import Engine
from .fs import DecodeFS, FuseMount, MountFailed
from .metrics_http import MetricsEndpoint
from .namespace import Tree, version_order
from .notify import ServiceNotifier
from .process import (
    log_destination,
    raise_open_file_limit,
    raise_readahead,
    return_large_allocations,
)
from .spawn import spawn
from .stats import snapshot

__all__ = ["serve", "spawn"]

log = logging.getLogger(__name__)

# After SIGTERM, how long readers holding an open file are still served.
SHUTDOWN_GRACE: Final = 10.0
# Then how long requests already running may take to finish before they are cancelled.
REQUESTS_GRACE: Final = 5.0


def serve(config: Config, mountpoint: str, on_ready: Callable[[], None] | None = None) -> None:
    """Mount and serve until unmounted or sent SIGTERM/SIGINT; then unmount cleanly. The
    caller has checked the mount point (common.mounts.prepare_mountpoint), before it
    loaded the daemon."""
    with stacks_on_sigusr1():
        _serve_mount(config, mountpoint, on_ready)


def _serve_mount(config: Config, mountpoint: str, on_ready: Callable[[], None] | None) -> None:
    mountpoint = os.path.abspath(mountpoint)
    log_place = log_destination()
    os.chdir("/")  # the daemon holds none of the user's directories (paths are absolute)
    notifier = ServiceNotifier.from_environment()
    warning = store_warning(config)
    if warning is not None:
        log.warning("%s", warning)
    quiet_pillow_warnings()
    raise_open_file_limit()
    return_large_allocations()
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
            return snapshot(
                engine,
                sources,
                pid=os.getpid(),
                mountpoint=mountpoint,
                version=package_version(),
                log=log_place,
                started=round(engine.metrics.started, 3),
            )

        status_files: dict[str, Callable[[], bytes]] = {
            STATS_FILE: lambda: _json(stats()),
            METRICS_FILE: lambda: render_prometheus(stats()),
            CONFIG_FILE: lambda: _json(config.as_dict()),
            STORE_FILE: status.to_json,  # what read_array() needs (client/discovery.py)
            FAILED_FILE: engine.failed.to_json,  # originals that failed to decode
        }
        tree = Tree(config, sources)  # lists protocol.STATUS_FILES, the keys above
        operations = DecodeFS(tree, engine, status_files)
        # Listening before the mount: a busy address is a user error, nothing mounted.
        metrics = None if config.metrics_address is None else MetricsEndpoint(
            config.metrics_address, stats
        )  # fmt: skip
        loops = _Loops(
            engine,
            BackgroundWarm(engine, sources),
            DirectHits(config, sources, store, engine.metrics),
            access_socket,
            metrics,
        )
        fuse = FuseMount(operations, mountpoint, allow_other=config.allow_other)
        try:
            fuse.mount()
        except MountFailed as exc:
            hint = mount_failure_hint(config.allow_other)
            raise MountError(f"cannot mount {mountpoint}: {exc} ({hint})") from exc
        try:
            trio.run(_serve, fuse, loops, mountpoint, on_ready, notifier)
        finally:
            fuse.close()
            engine.close()
            if metrics is not None:
                metrics.close()
    finally:
        store.close()
    log.info("unmounted %s", mountpoint)


def mount_failure_hint(allow_other: bool, device: str = "/dev/fuse") -> str:
    """Why a FUSE mount most likely failed for this user, and what to do about it."""
    if not os.path.exists(device):
        return f"{device} is missing: load the fuse module (`modprobe fuse`)"
    if os.geteuid() != 0 and not os.access(device, os.R_OK | os.W_OK):
        mode = stat.filemode(os.stat(device).st_mode)
        return (
            f"{device} ({mode}) cannot be opened by uid {os.geteuid()}: mount as root, or "
            f"let users open it as most systems do (`chmod 0666 {device}`)"
        )
    if allow_other and os.geteuid() != 0:
        return "allow_other needs 'user_allow_other' in /etc/fuse.conf when not root"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "fusermount3 is missing: install fuse3"
    return f"is {device} present and fusermount3 installed?"


@dataclass(frozen=True)
class _Loops:
    """What runs beside the request handlers for the daemon's life."""

    engine: Engine
    warm: BackgroundWarm  # started once the mount is live
    direct_hits: DirectHits
    access_socket: str | None  # where direct hits arrive (None: nowhere)
    metrics: MetricsEndpoint | None = None  # metrics_address's HTTP endpoint


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
        nursery.start_soon(dump_on_sigusr1)
        engine = loops.engine
        nursery.start_soon(_once_live, loops.warm, mountpoint, on_ready, notifier, nursery)
        nursery.start_soon(engine.run)
        if loops.access_socket is not None:
            nursery.start_soon(loops.direct_hits.receive, loops.access_socket)
        if loops.metrics is not None:
            nursery.start_soon(loops.metrics.serve)
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
    await trio.to_thread.run_sync(raise_readahead, mountpoint)
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


def _l2_tier(config: Config) -> L2Tier | None:
    """The cluster's shared tier, if the config names one (no call is made yet)."""
    if config.l2 is None:
        return None
    fingerprints = config.fingerprints()
    tier = L2Tier(open_backend(config.l2), config.l2, fingerprints)
    log.info("L2: %s (lease %g s)", tier.backend.description, config.l2.lease_seconds)
    return tier


def _json(value: object) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
