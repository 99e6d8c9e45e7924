"""One serving process's layers, wired, and what runs beside its requests.

``build`` makes the store, the sources, the mount's numbers, the engine, the
tree and the operations for a serving process of a mount the holder keeps
(server.py drives it through its life); ``Serving`` starts what runs beside
the requests, each object its own loops (``Engine.run``). This module holds no
caching policy and speaks no channel.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, cast

import trio

from ..cluster import L2Tier, open_backend
from ..common.advice import empty_version_warning, store_warning
from ..common.config import Access, Config
from ..common.decode import quiet_pillow_warnings
from ..common.entry import EntryKey
from ..common.inodes import INODE_LAYOUT
from ..common.metrics import render_prometheus
from ..common.mounts import MountError
from ..common.protocol import (
    CONFIG_FILE,
    FAILED_FILE,
    METRICS_FILE,
    STATS_FILE,
    STORE_FILE,
    StoreStatus,
)
from ..common.readers import Readers
from ..common.source import SourceIndex, restat_originals, save_stamps, scan_source
from ..common.status import holder_figures
from ..common.version import package_version
from ..store import Store
from .background_warm import BackgroundWarm
from .carryover import mark_verified, read_verified, save_verified
from .direct_hits import DirectHits
from .engine import Engine
from .fs import DecodeFS, FuseSession
from .metrics_http import MetricsEndpoint
from .namespace import Tree
from .numbers import MountNumbers
from .process import (
    log_destination,
    raise_open_file_limit,
    raise_readahead,
    return_large_allocations,
)
from .reload import Reload, config_changes
from .stats import snapshot

__all__ = ["Serving", "build"]

log = logging.getLogger(__name__)

# How often what this process verified is written for the mount's next one.
CARRYOVER_SECONDS: Final = 10.0
_CONFIG_STATE: Final = "config.json"  # the config the mount's last serving process applied


@dataclass
class Serving:
    """Everything one serving process runs, built before it serves."""

    config: Config
    mountpoint: str
    store: Store
    sources: dict[str, SourceIndex]
    numbers: MountNumbers
    reload: Reload
    engine: Engine
    tree: Tree
    state_dir: str | None
    # Its predecessor died: originals changed in place (and their readers) are looked
    # for once it serves (in the background: a stat of each original, seconds at 370k),
    # not before (no reader waits on the dead one's requests meanwhile).
    check_originals_later: bool
    holder: dict[str, Any] = field(default_factory=dict)  # the holder's figures (stats.json)
    log_place: str = ""
    metrics: MetricsEndpoint | None = None  # metrics_address's HTTP endpoint, once listening
    _nursery: trio.Nursery | None = field(default=None, init=False, repr=False)
    operations: DecodeFS = field(init=False)  # made here, from the above
    session: FuseSession = field(init=False)

    def __post_init__(self) -> None:
        config, store = self.config, self.store
        status = StoreStatus(
            store=store.root,
            digests=store.digests(),
            version_order=self.numbers.version_order(),  # as inode numbers name versions
            inode_layout=INODE_LAYOUT,
            min_size=config.min_size,
            max_size=config.max_size,
            access_socket=store.access_socket_path(),
            mirrors=frozenset(n for n, v in config.versions.items() if v.layout == "mirror"),
        )
        status_files: dict[str, Callable[[], bytes]] = {
            STATS_FILE: lambda: _json(self.stats()),
            METRICS_FILE: lambda: render_prometheus(self.stats()),
            CONFIG_FILE: lambda: _json(config.as_dict()),
            STORE_FILE: status.to_json,  # what read_array() needs (client/discovery.py)
            FAILED_FILE: self.engine.failed.to_json,  # originals that failed to decode
        }
        self.operations = DecodeFS(self.tree, self.engine, status_files)
        self.operations.size_seen = self._size_seen
        self.session = FuseSession(self.operations)

    async def _size_seen(self, version: str, size: int) -> None:
        """A size directory looked up for the first time in the mount: recorded before the
        kernel may cache its pages (a reload must know to drop them)."""
        if self.numbers.note_size(version, size):
            await trio.to_thread.run_sync(self.numbers.save_size, version, size)

    @property
    def digests(self) -> dict[str, str]:
        return self.store.digests()

    def stats(self) -> dict[str, object]:
        before = self.holder.get("decodes_before", 0)
        return snapshot(
            self.engine,
            self.sources,
            pid=os.getpid(),
            mountpoint=self.mountpoint,
            version=package_version(),
            log=self.log_place,
            started=round(self.engine.metrics.started, 3),
            **holder_figures(self.holder),
            mount_decodes=(before if isinstance(before, int) else 0) + self.engine.metrics.decodes,
        )

    async def run_beside(self, nursery: trio.Nursery) -> None:
        """Start what runs beside the requests until the nursery is cancelled."""
        self._nursery = nursery
        nursery.start_soon(self.engine.run)
        if self.metrics is not None:
            nursery.start_soon(self.metrics.serve)
        access_socket = self.store.access_socket_path()
        if access_socket is not None:
            hits = DirectHits(self.config, self.sources, self.store, self.engine.metrics)
            nursery.start_soon(hits.receive, access_socket)
        if self.state_dir is not None:
            nursery.start_soon(self._carry_over_forever)

    async def once_live(self, nursery: trio.Nursery) -> None:
        """Once the kernel reaches this process: the readahead, then the background warm."""
        # A statvfs answered by our own handlers proves the kernel can reach us.
        await trio.to_thread.run_sync(os.statvfs, self.mountpoint)
        # After the kernel's INIT, which sets the readahead to what libfuse answered.
        await trio.to_thread.run_sync(raise_readahead, self.mountpoint)
        nursery.start_soon(BackgroundWarm(self.engine, self.sources).run)

    async def apply_reload(self) -> list[str]:
        """Once no earlier serving process of the mount answers: discard what decode
        settings changed, find originals changed in place (after a crash: now), tell
        the kernel what to forget, and serve the versions held; what changed."""
        unsettled = await trio.to_thread.run_sync(self.store.settle_versions)
        if unsettled:
            log.info("discarded the stored arrays of %s (decode settings changed)", unsettled)
        if self.check_originals_later:
            self.reload.changed, self.reload.readers_changed = await trio.to_thread.run_sync(
                changed_in_place, self.config, self.store, self.sources, self.numbers
            )
            for version, positions in self.reload.changed.items():
                keys = self.sources[version].keys
                for size in self._sizes_of(version):
                    for index in positions:
                        self.engine.known.not_stored(EntryKey(version, size, keys[index]), index)
        await trio.to_thread.run_sync(self.numbers.refresh_sizes)  # the last one's too
        kernel = (FuseSession.invalidate_entry, FuseSession.invalidate_inode)
        await trio.to_thread.run_sync(self.reload.invalidate, kernel)
        for source in self.sources.values():  # what changed is acted on: the next needn't
            await trio.to_thread.run_sync(save_stamps, source)
        await trio.to_thread.run_sync(self.numbers.save_applied)
        self.engine.release_held()
        value = (
            await trio.to_thread.run_sync(read_verified, self.state_dir) if self.state_dir else {}
        )
        mark_verified(value, self.engine.known, self.numbers, self.digests, self.reload.changed)
        if self.state_dir is not None:
            await trio.to_thread.run_sync(self._save_config)
        self._listen_for_metrics()
        return self.reload.describe()

    def _listen_for_metrics(self) -> None:
        """The metrics endpoint of a serving process that is not the mount's first: its
        address is free once the one before is gone (a problem is logged, not fatal)."""
        address = self.config.metrics_address
        if address is None or self.metrics is not None:
            return
        try:
            self.metrics = MetricsEndpoint(address, self.stats)
        except MountError as exc:
            log.warning("%s; no metrics over HTTP until the next reload", exc)
            return
        if self._nursery is not None:
            self._nursery.start_soon(self.metrics.serve)

    def close(self) -> None:
        """What this process holds beside the session, at its exit."""
        self.engine.close()
        if self.metrics is not None:
            self.metrics.close()
        self.store.close()

    def carry_over(self) -> None:
        """Write what this process verified, for the mount's next serving process."""
        if self.state_dir is not None:
            save_verified(self.state_dir, self.engine.known, self.numbers, self.digests)

    async def _carry_over_forever(self) -> None:
        while True:
            await trio.sleep(CARRYOVER_SECONDS)
            try:
                await trio.to_thread.run_sync(self.carry_over)
            except OSError as exc:
                log.warning("cannot write what was verified for the next serving process: %s", exc)

    def _sizes_of(self, version: str) -> set[int]:
        return {*self.config.versions[version].sizes, *self.numbers.sizes_seen(version)}

    def _save_config(self) -> None:
        assert self.state_dir is not None
        path = os.path.join(self.state_dir, _CONFIG_STATE)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.config.as_dict(), f, default=str)
        os.replace(tmp, path)


@dataclass(frozen=True)
class MountFacts:
    """What the holder says of the mount a serving process is started for."""

    state_dir: str | None  # the mount's state directory (numbers, what was verified)
    first: bool  # the mount's first serving process: it answers the kernel's INIT
    crash_restart: bool  # its predecessor died: originals are checked once it serves
    held_lock: int | None  # the store lock an earlier serving process held
    holder_pid: int | None = None
    access: str | None = None  # the mount's config.Access (changed only by a remount)


def build(config: Config, mountpoint: str, facts: MountFacts) -> Serving:
    """Everything a serving process runs, before it serves: the store (sharing the lock
    an earlier serving process of the mount held), the sources (originals changed in
    place found now, unless its predecessor crashed: then once it serves), the
    mount's numbers, the engine, the tree and the operations."""
    log_place = log_destination()
    changed_config = _config_changes(config, facts)
    if facts.access is not None and facts.access != config.access:
        config = dataclasses.replace(config, access=cast(Access, facts.access))
    _tune_process(config)
    store = Store.from_config(config)
    store.open(facts.held_lock, facts.holder_pid)
    try:
        sources = _scan(config, store)
        if config.access == "originals":
            store.readers = _readers_of(sources)
        digests = store.digests()
        numbers, changes = MountNumbers.load(facts.state_dir, sources, digests, first=facts.first)
        engine = Engine(config, sources, store, l2=_l2_tier(config))
        if not facts.first:
            engine.hold(changes.redecoded)  # until no earlier process serves them
        reload = Reload(numbers, changes, sources, config=changed_config)
        reload.directories_have_readers = config.access == "originals" and not facts.first
        reload.directories_seen = not facts.first
        # The first serving process listens before the mount (a busy address is the user's
        # error, nothing mounted); a later one once the one before is gone.
        metrics = None
        if facts.first and config.metrics_address is not None:
            metrics = MetricsEndpoint(config.metrics_address, lambda: serving.stats())
        # Who may read each original is known before the mount serves: an original not
        # looked at yet is root's alone. After a crash, once it serves (its readers as the
        # cached index says until then).
        later = facts.crash_restart
        if not later:
            reload.changed, reload.readers_changed = changed_in_place(
                config, store, sources, numbers
            )
            if facts.first:
                reload.readers_changed = {}  # the kernel has seen no attributes yet
        if facts.state_dir is not None and not facts.first:
            verified = read_verified(facts.state_dir)
            mark_verified(verified, engine.known, numbers, digests, reload.changed)
    except BaseException:
        store.close()
        raise
    serving = Serving(
        config=config,
        mountpoint=mountpoint,
        store=store,
        sources=sources,
        numbers=numbers,
        reload=reload,
        engine=engine,
        tree=Tree(config, sources, numbers=numbers),  # lists protocol.STATUS_FILES
        state_dir=facts.state_dir,
        check_originals_later=later,
        log_place=log_place,
        metrics=metrics,
    )
    return serving


def _tune_process(config: Config) -> None:
    os.chdir("/")  # the daemon holds none of the user's directories (paths are absolute)
    warning = store_warning(config)
    if warning is not None:
        log.warning("%s", warning)
    quiet_pillow_warnings()
    raise_open_file_limit()
    return_large_allocations()


def _scan(config: Config, store: Store) -> dict[str, SourceIndex]:
    """Every version's originals (from the index cached in the store while unchanged)."""
    cache = store.cache_dir("index")
    sources = {
        name: scan_source(name, v.source, v.extensions, v.duplicates, cache, layout=v.layout)
        for name, v in config.versions.items()
    }
    for name, index in sources.items():
        if not len(index):
            log.warning("%s", empty_version_warning(config, name))
    return sources


def _config_changes(config: Config, facts: MountFacts) -> list[str]:
    """The config keys changed since the mount's last serving process applied its config."""
    changed = config_changes(_saved_config(facts.state_dir), config.as_dict())
    if facts.access is not None and facts.access != config.access:
        changed.append(
            f"access stays {facts.access!r} until a remount "
            "(it decides the mount's options: decodefs umount, then mount)"
        )
    return changed


def changed_in_place(
    config: Config, store: Store, sources: dict[str, SourceIndex], numbers: MountNumbers
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Originals whose size or mtime changed since the index last saw them, and those
    whose readers changed (owner, group, mode, or a directory above), by version
    (blocking): the stored arrays of the first (every size the mount has seen) are
    removed; those of the second get their new readers (access = "originals")."""
    changed, readers_changed = {}, {}
    for version, source in sources.items():
        found = restat_originals(source, save=False)  # saved once acted on: apply_reload
        sizes = {*config.versions[version].sizes, *numbers.sizes_seen(version)}
        if found.changed:
            changed[version] = found.changed
            _remove_entries(store, version, source, found.changed, sizes)
        if found.readers_changed and config.access == "originals":
            readers_changed[version] = found.readers_changed
            keys = source.keys
            store.share_all(version, sizes, [keys[i] for i in found.readers_changed])
    return changed, readers_changed


def _readers_of(sources: dict[str, SourceIndex]) -> Callable[[EntryKey], Readers | None]:
    """Who may read the original of a store entry (None: a key the sources do not have)."""

    def readers(key: EntryKey) -> Readers | None:
        source = sources.get(key.version)
        index = source.find(key.key) if source is not None else None
        return source.readers(index) if source is not None and index is not None else None

    return readers


def _remove_entries(
    store: Store, version: str, source: SourceIndex, positions: list[int], sizes: set[int]
) -> None:
    """Remove the stored arrays of originals changed in place (blocking)."""
    for index in positions:
        for size in sizes:
            store.remove_if_present(EntryKey(version, size, source.keys[index]))
    log.info("version %s: %d originals changed in place; their arrays are decoded again",
             version, len(positions))  # fmt: skip


def _saved_config(state_dir: str | None) -> dict[str, Any] | None:
    if state_dir is None:
        return None
    try:
        with open(os.path.join(state_dir, _CONFIG_STATE), encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


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
