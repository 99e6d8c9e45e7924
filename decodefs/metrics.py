"""Counters and the decode-latency histogram; rendered as JSON and Prometheus text.

Updated only from the trio thread (the engine and fs layers), so no locks.
This module knows nothing of FUSE, the store layout or images.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["DECODE_SECONDS_BUCKETS", "Histogram", "LogThrottle", "Metrics", "render_prometheus"]

_THROTTLE_KINDS_MAX: Final = 10_000
DECODE_SECONDS_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram in the Prometheus sense."""

    buckets: tuple[float, ...] = DECODE_SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value

    def as_dict(self) -> dict[str, object]:
        cumulative, running = {}, 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True):
            running += n
            cumulative[bound] = running
        return {"count": self.count, "sum": round(self.sum, 6), "buckets": cumulative}


@dataclass
class Metrics:
    """What the daemon has done since it started. See docs/operations.md, "Status files"."""

    hits: int = 0  # opens served from a stored (or memory-cached) array
    misses: int = 0  # opens that needed a decode, including ones that joined another's
    decodes: int = 0  # decodes that ran, failed ones and rebuilds included
    decode_errors: int = 0  # originals that failed to decode
    coalesced: int = 0  # opens that waited on a decode already running for the same file
    corrupt_entries: int = 0  # stored entries that failed verification and were rebuilt
    store_write_errors: int = 0
    memory_fallbacks: int = 0  # decoded arrays kept in memory because the store refused them
    bytes_served: int = 0
    background_decodes: int = 0  # decodes the daemon's own background warm ran
    warm_decodes: int = 0  # decodes that warm requests (O_NONBLOCK opens, decodefs warm) ran
    warm_not_stored: int = 0  # warm requests whose array the store would not take
    memory_refills: int = 0  # reads of an open file whose array the memory cache had dropped
    unlisted_not_stored: int = 0  # arrays of unlisted sizes served from memory (unlisted_sizes)
    direct_hits: int = 0  # arrays readers read straight from the store (read_array) and reported
    store_reads_inline: int = 0  # READs served from resident store pages on the request loop
    store_reads_threaded: int = 0  # READs that went to a worker thread (pages not resident)
    page_drops: int = 0  # entry files whose pages the daemon brought in, then dropped
    inflight_decodes: int = 0  # decodes running in the pool (at most decode_workers)
    queued_decodes: int = 0  # decodes waiting for a pool slot
    errors: Counter[str] = field(default_factory=Counter)  # errno name -> count
    decode_seconds: Histogram = field(default_factory=Histogram)
    started: float = field(default_factory=time.time)


class LogThrottle:
    """Logs the first event of a kind, then at most one line per interval.

    The line after a quiet spell says how many events were folded into it, so
    a flood of identical errors (a full disk) is visible without drowning the
    journal.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def log(self, level: int, kind: str, msg: str, *args: object, exc_info: bool = False) -> None:
        """Log ``msg % args`` unless a line of ``kind`` went out within the interval;
        ``exc_info``: with the traceback of the exception being handled."""
        now = self._clock()
        if len(self._last) > _THROTTLE_KINDS_MAX:  # kinds may be per entry; stay bounded
            self._last = {k: t for k, t in self._last.items() if now - t < self._interval}
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._suppressed[kind] += 1
            return
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            msg += " (and %d more like it in the last %.0f s)"
            args = (*args, suppressed, now - last if last is not None else 0.0)
        self._logger.log(level, msg, *args, exc_info=exc_info)


# stats.json key -> help text. Counters get the conventional _total suffix.
_COUNTERS: Final = {
    "hits": "Opens served from a stored or memory-held array",
    "misses": "Opens that needed a decode, including ones that joined another's",
    "decodes": "Decodes that ran, failed ones and rebuilds included",
    "decode_errors": "Originals that failed to decode",
    "coalesced": "Opens that joined a decode already running for the same file",
    "corrupt_entries": "Stored entries that failed verification and were rebuilt",
    "evictions": "Stored entries evicted to stay within the capacity limits",
    "store_write_errors": "Arrays the store refused (full, read-only, at its limit)",
    "memory_fallbacks": "Arrays kept in memory because the store refused them",
    "background_decodes": "Decodes run by the daemon's own background warm",
    "warm_decodes": "Decodes that warm requests (decodefs warm, O_NONBLOCK opens) ran",
    "warm_not_stored": "Warm requests whose array the store would not take",
    "memory_waits": "Decodes that waited for the memory budget",
    "memory_refills": "Reads of an open file whose array the memory cache had dropped",
    "decode_memory_waits": "Decodes that waited for decode memory",
    "unlisted_not_stored": "Arrays of sizes no version lists, served from memory to other users",
    "direct_hits": "Arrays read_array() read straight from the store, as reported by readers",
    "bytes_served": "Bytes delivered in READ replies",
    "store_reads_inline": "READs served from resident store pages on the request loop",
    "store_reads_threaded": "READs of the store served by a worker thread",
    "page_drops": "Entry files whose page cache the daemon brought in, then dropped",
}
_GAUGES: Final = {
    "store_bytes": "Bytes of stored entries",
    "store_entries": "Stored entries",
    "inflight_decodes": "Decodes running in the pool",
    "queued_decodes": "Decodes waiting for a pool slot",
    "memory_cache_bytes": "Bytes of arrays held in memory because the store refused them",
    "memory_cache_entries": "Arrays held in memory because the store refused them",
    "memory_bytes": "Bytes of arrays in memory: decodes in flight and arrays served from memory",
    "memory_limit_bytes": "The budget for arrays in memory (memory_cache_bytes)",
    "decode_memory_bytes": "Bytes that decodes running now may take (decode_peak_bytes)",
    "decode_memory_limit_bytes": "The budget for decodes running at once (decode_memory_bytes)",
    "uptime_seconds": "Seconds since the daemon started",
}


class _StatsCollector(Collector):
    """Prometheus families from one stats snapshot (the dict behind stats.json)."""

    def __init__(self, stats: Mapping[str, Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        for name, documentation in _COUNTERS.items():
            yield CounterMetricFamily(f"decodefs_{name}", documentation, value=stats[name])
        for name, documentation in _GAUGES.items():
            yield GaugeMetricFamily(f"decodefs_{name}", documentation, value=stats[name])
        yield GaugeMetricFamily(
            "decodefs_store_writable",
            "1 if the store accepts new entries",
            value=int(stats["store_writable"]),
        )
        errors = CounterMetricFamily(
            "decodefs_errors", "Errors answered or met, by kind", labels=["kind"]
        )
        for kind, count in sorted(stats["errors"].items()):
            errors.add_metric([kind], count)
        yield errors
        originals = GaugeMetricFamily("decodefs_originals", "Originals indexed", labels=["version"])
        for version, info in sorted(stats["versions"].items()):
            originals.add_metric([version], info["originals"])
        yield originals
        latency = stats["decode_seconds"]
        yield HistogramMetricFamily(
            "decodefs_decode_seconds",
            "Time to decode, resize and serialize one array",
            buckets=list(latency["buckets"].items()),
            sum_value=latency["sum"],
        )
        if "l2" in stats:
            yield from _l2_families(stats)


# -- the cluster's L2 tier (cluster.py), present only when `l2` is configured -------------

_L2_COUNTERS: Final = {
    "l2_hits": "Arrays fetched from L2 and verified instead of decoded",
    "l2_misses": "Arrays L2 could not give (absent, bad or unreachable), decoded here",
    "l2_bypassed": "Arrays decoded without asking L2 while its circuit breaker was open",
    "l2_leases": "Claims this node took to decode an array",
    "l2_lease_renewals": "Claims this node renewed while decoding and publishing",
    "l2_lease_waits": "Times this node waited for another node's claim",
    "l2_lease_timeouts": "Claim waits that ran out before the holder published",
    "l2_publishes": "Objects this node created in L2",
    "l2_publish_exists": "Publishes that found the object in L2 already",
    "l2_publish_dropped": "Publishes given up (queue full, L2 failing)",
    "l2_corrupt": "L2 objects that failed verification (never served; replaced)",
    "l2_bytes_fetched": "Bytes of verified objects fetched from L2",
    "l2_breaker_opens": "Times the L2 circuit breaker opened",
}
_L2_GAUGES: Final = {
    "l2_publish_queue": "Arrays waiting to be published to L2",
    "l2_publish_queue_bytes": "Bytes of arrays waiting to be published to L2",
}


def _l2_families(stats: Mapping[str, Any]) -> Iterator[Metric]:
    for name, documentation in _L2_COUNTERS.items():
        yield CounterMetricFamily(f"decodefs_{name}", documentation, value=stats[name])
    for name, documentation in _L2_GAUGES.items():
        yield GaugeMetricFamily(f"decodefs_{name}", documentation, value=stats[name])
    state = GaugeMetricFamily(
        "decodefs_l2_state", "1 for the L2 circuit breaker's current state", labels=["state"]
    )
    for name in ("closed", "open", "half-open"):
        state.add_metric([name], int(stats["l2_state"] == name))
    yield state
    errors = CounterMetricFamily("decodefs_l2_errors", "Failed L2 calls, by kind", labels=["kind"])
    for kind, count in sorted(stats["l2_errors"].items()):
        errors.add_metric([kind], count)
    yield errors
    latency = stats["l2_fetch_seconds"]
    yield HistogramMetricFamily(
        "decodefs_l2_fetch_seconds",
        "Time of one L2 fetch (a GET, found or not)",
        buckets=list(latency["buckets"].items()),
        sum_value=latency["sum"],
    )


def render_prometheus(stats: Mapping[str, Any]) -> bytes:
    """The Prometheus text exposition format of a stats snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats))
    return generate_latest(registry)
