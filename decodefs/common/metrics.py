"""Counters and the decode-latency histogram; a stats snapshot rendered as Prometheus text.

Updated only from the trio thread (the engine and fs layers), so no locks.
This module knows nothing of FUSE, the store layout or images.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from .stats_schema import STATS, Stat

__all__ = [
    "DECODE_SECONDS_BUCKETS",
    "Histogram",
    "LogThrottle",
    "Metrics",
    "figures",
    "render_prometheus",
    "stats_families",
]

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
    """What the daemon has done since it started: each field is the figure of
    stats_schema.STATS of the same name (tests/test_stats.py checks it). See
    docs/operations.md, "Status files"."""

    hits: int = 0  # opens served from a stored (or memory-cached) array
    misses: int = 0  # opens that needed a decode, including ones that joined another's
    decodes: int = 0  # decodes that ran, failed ones and rebuilds included
    decode_errors: int = 0  # originals that failed to decode
    coalesced: int = 0  # opens that waited on a decode already running for the same file
    claim_waits: int = 0  # misses that waited while another serving process decoded the array
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
    started: float = field(default_factory=time.time, metadata={"figure": False})


def figures(counters: object, prefix: str = "") -> dict[str, object]:
    """A counters dataclass (Metrics, cluster.L2Metrics) as stats.json figures: each field
    under its name (after ``prefix``), a Counter as a dict, a Histogram as its dict."""
    result: dict[str, object] = {}
    for f in fields(counters):  # type: ignore[arg-type]
        if f.metadata.get("figure", True):
            value = getattr(counters, f.name)
            if isinstance(value, Histogram):
                value = value.as_dict()
            elif isinstance(value, Counter):
                value = dict(value)
            result[prefix + f.name] = value
    return result


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


class _StatsCollector(Collector):
    """Prometheus families from one stats snapshot (the dict behind stats.json), one per
    figure of stats_schema.STATS that the snapshot holds."""

    def __init__(self, stats: Mapping[str, Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        return stats_families(self._stats)


def stats_families(stats: Mapping[str, Any]) -> Iterator[Metric]:
    """The Prometheus families of a stats snapshot: one per figure of stats_schema.STATS
    that it holds."""
    for stat in STATS:
        if stat.name in stats:
            yield _family(stat, stats[stat.name])


def _family(stat: Stat, value: Any) -> Metric:
    name, documentation = stat.prometheus, stat.help
    if stat.kind == "counter":
        return CounterMetricFamily(name, documentation, value=value)
    if stat.kind == "gauge":
        if value is None:  # no such limit: no sample, not a 0 that would read as one
            return GaugeMetricFamily(name, documentation)
        return GaugeMetricFamily(name, documentation, value=value)
    if stat.kind == "flag":
        return GaugeMetricFamily(name, documentation, value=int(bool(value)))
    if stat.kind == "text":
        return InfoMetricFamily(name, documentation, value={stat.name: str(value)})
    if stat.kind == "state":
        family = GaugeMetricFamily(name, documentation, labels=["state"])
        for state in stat.states:
            family.add_metric([state], int(value == state))
        return family
    if stat.kind == "counter by kind":
        counts = CounterMetricFamily(name, documentation, labels=["kind"])
        for kind, count in sorted(value.items()):
            counts.add_metric([kind], count)
        return counts
    if stat.kind == "histogram":
        return HistogramMetricFamily(
            name, documentation, buckets=list(value["buckets"].items()), sum_value=value["sum"]
        )
    if stat.kind == "per version and size":
        family = GaugeMetricFamily(name, documentation, labels=["version", "size"])
        for version, sizes in sorted(value.items()):
            for size, usage in sorted(sizes.items(), key=lambda item: int(item[0])):
                family.add_metric([version, str(size)], usage["bytes"])
        return family
    assert stat.kind == "per version", stat
    family = GaugeMetricFamily(name, documentation, labels=["version"])
    for version, info in sorted(value.items()):
        family.add_metric([version], info["originals"])
    return family


def render_prometheus(stats: Mapping[str, Any]) -> bytes:
    """The Prometheus text exposition format of a stats snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats))
    return generate_latest(registry)
