"""The daemon's stats snapshot, the content of stats.json: every figure of the stats schema.

Gathered from the engine's counters and memory budgets, the store's usage, the
sources and the L2 tier; it reads them and decides nothing. What each figure
means, its kind and unit are stats_schema.STATS's; metrics.py renders the same
snapshot as Prometheus text.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from ..common.metrics import figures
from ..common.source import SourceIndex
from ..store import Discarded
from .engine import Engine

__all__ = ["snapshot"]


def snapshot(
    engine: Engine, sources: Mapping[str, SourceIndex], **daemon: object
) -> dict[str, object]:
    """What the daemon has done and holds now; ``daemon``: the figures only the daemon
    knows (``pid``, ``mountpoint``, ``version``, ``log``, ``started``)."""
    store, usage = engine.store, engine.store.usage()
    memory, decode_memory = engine.memory, engine.decode_memory
    by_size: dict[str, dict[str, dict[str, int]]] = {}
    for (version, size), held in sorted(store.usage_by_size().items()):
        by_size.setdefault(version, {})[str(size)] = {"entries": held.entries, "bytes": held.bytes}
    return {
        **figures(engine.metrics),
        "store_bytes": usage.bytes,
        "store_entries": usage.entries,
        "store_by_size": by_size,
        "store_usage_complete": usage.complete,
        "store_writable": store.writable,
        "store_max_bytes": engine.config.max_store_bytes,
        "evictions": usage.evictions,
        "memory_cache_bytes": engine.memory_cache.bytes,
        "memory_cache_entries": len(engine.memory_cache),
        "memory_bytes": memory.used,
        "memory_limit_bytes": memory.limit,
        "memory_waits": memory.waits,
        "decode_memory_bytes": decode_memory.used,
        "decode_memory_limit_bytes": decode_memory.limit,
        "decode_memory_waits": decode_memory.waits,
        "failed_originals": len(engine.failed),
        "failed_not_listed": engine.failed.not_listed,
        **(engine.l2.stats() if engine.l2 is not None else {}),
        "uptime_seconds": round(time.time() - engine.metrics.started, 3),
        "versions": {
            name: {
                "originals": len(source),
                "layout": source.layout,
                "duplicates_left_out": len(source.duplicates),
                "symlinks_outside_source": source.symlinks_outside,
                "fingerprint": store.fingerprint_description(name),
                **_discarded(store.discarded.get(name)),
            }
            for name, source in sources.items()
        },
        **daemon,
    }


def _discarded(discarded: Discarded | None) -> dict[str, object]:
    """A version's ``discarded`` figure: its stored arrays thrown away at start because
    another fingerprint made them (none if they were not)."""
    if discarded is None:
        return {}
    return {
        "discarded": {
            "entries": discarded.entries,
            "bytes": discarded.bytes,
            "was": dict(discarded.was),
            "now": dict(discarded.now),
        }
    }
