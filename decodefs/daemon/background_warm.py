"""The daemon's background warm: decode and store the sizes of versions with ``warm = true``.

This module chooses what to warm (each configured size of each such version,
the originals the store's catalog does not list) and how many at once; the
engine decodes each array (``Engine.warm_one``) on its low-priority pool, so
readers' decodes always come first, and never evicts for it. The warm stops
for good once the store takes no more without evicting what readers use. It
knows nothing of FUSE or of how an array is decoded or stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping

import trio

from ..common.source import SourceIndex
from .engine import Engine

__all__ = ["BackgroundWarm"]

log = logging.getLogger(__name__)


class BackgroundWarm:
    def __init__(self, engine: Engine, sources: Mapping[str, SourceIndex]) -> None:
        self._engine = engine
        self._sources = sources
        self._stopped = False

    async def run(self) -> None:
        """Warm every configured size of every ``warm`` version, one after the other;
        stops for a store that cannot take more without evicting what readers use."""
        engine = self._engine
        config, store = engine.config, engine.store
        versions = [v for v in config.versions.values() if v.warm]
        if not versions:
            return
        if not store.writable:
            log.warning("background warm: the store is not writable; not warming")
            return
        for version in versions:
            for size in version.sizes:
                stored = await trio.to_thread.run_sync(store.stored_keys, version.name, size)
                todo = iter(
                    i for i, key in enumerate(self._sources[version.name].keys) if key not in stored
                )
                started, before = time.monotonic(), engine.metrics.background_decodes
                async with trio.open_nursery() as nursery:
                    # Twice the pool's threads: a thread never idles while its
                    # worker does store I/O between decodes.
                    for _ in range(2 * config.decode_workers):
                        nursery.start_soon(self._worker, version.name, size, todo)
                if self._stopped:
                    log.info(
                        "background warm of %s/%d stops: the store takes no more without "
                        "evicting what readers use",
                        version.name,
                        size,
                    )
                    return
                log.info(
                    "background warm: %s/%d done, %d decoded in %.0f s",
                    version.name,
                    size,
                    engine.metrics.background_decodes - before,
                    time.monotonic() - started,
                )

    async def _worker(self, version: str, size: int, todo: Iterator[int]) -> None:
        for index in todo:  # shared by the workers: each index is taken once
            if self._stopped:
                return
            if not await self._engine.warm_one(version, size, index):
                self._stopped = True  # the others finish what they started, then stop
                return
