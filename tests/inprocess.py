"""The daemon's logic in the test's own process: a real store in a temporary
directory, real sources, real Pillow decodes, the engine, the tree and the
operations class, with no FUSE mount. Tests call what the kernel would."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyfuse3

from decodefs.common.config import Config, parse_config
from decodefs.common.decode import quiet_pillow_warnings
from decodefs.common.entry import EntryKey
from decodefs.common.source import SourceIndex, restat_originals, scan_source
from decodefs.daemon.background_warm import BackgroundWarm
from decodefs.daemon.engine import Engine, Handle
from decodefs.daemon.fs import DecodeFS
from decodefs.daemon.lifecycle import _readers_of
from decodefs.daemon.namespace import ROOT, Tree
from decodefs.daemon.stats import snapshot
from decodefs.store.store import Store

CTX = pyfuse3.RequestContext()


@dataclass
class InProcess:
    """One daemon's worth of layers over ``config.store``; ``close`` as a daemon would exit."""

    config: Config
    store: Store
    sources: dict[str, SourceIndex]
    engine: Engine
    tree: Tree
    ops: DecodeFS
    closed: bool = field(default=False)

    def key(self, version: str, size: int, uuid: str) -> EntryKey:
        return EntryKey(version, size, uuid)

    def index(self, version: str, uuid: str) -> int:
        index = self.sources[version].find(uuid)
        assert index is not None, uuid
        return index

    async def open(self, version: str, size: int, uuid: str, **flags: bool) -> Handle:
        return await self.engine.open(version, size, self.index(version, uuid), **flags)

    async def read_all(self, handle: Handle) -> bytes:
        return bytes(await self.engine.read(handle, 0, handle.length + 1))

    async def array(self, version: str, size: int, uuid: str, **flags: bool) -> bytes:
        """open, read every byte, release: what one reader of the file gets."""
        handle = await self.open(version, size, uuid, **flags)
        try:
            return await self.read_all(handle)
        finally:
            self.engine.release(handle)

    async def lookup_path(self, *names: str | bytes) -> pyfuse3.EntryAttributes:
        """The attributes of a path below the root, looked up one name at a time."""
        attrs = await self.ops.getattr(ROOT.ino, CTX)
        for name in names:
            raw = name if isinstance(name, bytes) else name.encode()
            attrs = await self.ops.lookup(attrs.st_ino, raw, CTX)
        return attrs

    def stats(self) -> dict[str, Any]:
        return snapshot(self.engine, self.sources)

    async def warm_in_background(self) -> None:
        """The daemon's background warm, run to its end."""
        await BackgroundWarm(self.engine, self.sources).run()

    def entry_path(self, version: str, size: int, uuid: str) -> Path:
        return Path(self.store.root) / EntryKey(version, size, uuid).relpath

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.close()
            self.store.close()


def start(
    base: Path,
    versions: dict[str, Path],
    *,
    store: Path | None = None,
    version_keys: dict[str, Any] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    store_clock: Callable[[], float] = time.time,
    engine_clock: Callable[[], float] | None = None,
    **top: Any,
) -> InProcess:
    """Wire the layers as daemon.serve does, from a config written as TOML would be.

    ``top`` holds top-level config keys, ``version_keys`` keys for every version,
    ``overrides`` keys for one version by its name.
    """
    # As helpers.write_config: the tests read any size (unlisted_sizes=None: the default).
    top.setdefault("unlisted_sizes", "owner")
    if top["unlisted_sizes"] is None:
        del top["unlisted_sizes"]
    # Everything the daemon's, unless a test asks for its originals' readers (or
    # access=None: the default, "originals" as root).
    top.setdefault("access", "owner")
    if top["access"] is None:
        del top["access"]
    raw: dict[str, Any] = {
        "store": str(store or base / "store"),
        "versions": {
            name: {"source": str(source), **(version_keys or {}), **(overrides or {}).get(name, {})}
            for name, source in versions.items()
        },
        **top,
    }
    config = parse_config(raw, base_dir=base)
    quiet_pillow_warnings()
    (base / "locks").mkdir(exist_ok=True)
    # Not the machine's /run/decodefs for the lock.
    st = Store.from_config(config, lock_dir=str(base / "locks"), clock=store_clock)
    st.open()
    try:
        index_cache = st.cache_dir("index")
        sources = {
            name: scan_source(name, v.source, v.extensions, v.duplicates, index_cache)
            for name, v in config.versions.items()
        }
        if config.access == "originals":  # as lifecycle.build: who may read each original
            for source in sources.values():
                restat_originals(source)
            st.readers = _readers_of(sources)
        if engine_clock is None:
            engine = Engine(config, sources, st)
        else:
            engine = Engine(config, sources, st, clock=engine_clock)
        status_files: dict[str, Callable[[], bytes]] = {
            "stats.json": lambda: json.dumps(snapshot(engine, sources)).encode(),
            "config.json": lambda: json.dumps(config.as_dict()).encode(),
        }
        tree = Tree(config, sources, list(status_files))
        ops = DecodeFS(tree, engine, status_files)
    except BaseException:
        st.close()
        raise
    return InProcess(config, st, sources, engine, tree, ops)
