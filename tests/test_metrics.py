"""Prometheus rendering and the log throttle."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decodefs.metrics import Histogram, LogThrottle, render_prometheus


def snapshot() -> dict[str, object]:
    histogram = Histogram()
    for seconds in (0.004, 0.2, 0.2, 3.0):
        histogram.observe(seconds)
    return {
        "hits": 10, "misses": 4, "decodes": 5, "decode_errors": 1, "coalesced": 2,
        "corrupt_entries": 1, "evictions": 3, "store_write_errors": 0, "memory_fallbacks": 0,
        "background_decodes": 0, "warm_decodes": 0, "warm_not_stored": 0, "memory_waits": 0,
        "direct_hits": 0, "bytes_served": 12345, "memory_bytes": 0, "memory_limit_bytes": 1,
        "decode_memory_waits": 0, "unlisted_not_stored": 0, "decode_memory_bytes": 0,
        "decode_memory_limit_bytes": 1,
        "store_bytes": 999, "store_entries": 7,
        "inflight_decodes": 1, "queued_decodes": 2, "memory_cache_bytes": 0,
        "memory_cache_entries": 0, "uptime_seconds": 1.5, "store_writable": True,
        "errors": {"EIO": 1, "store_ENOSPC": 2},
        "versions": {"v1": {"originals": 11}},
        "decode_seconds": histogram.as_dict(),
    }  # fmt: skip


def test_prometheus_text_parses_with_every_figure() -> None:
    families = {
        f.name: f for f in text_string_to_metric_families(render_prometheus(snapshot()).decode())
    }
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[("decodefs_hits_total", ())] == 10
    assert samples[("decodefs_evictions_total", ())] == 3
    assert samples[("decodefs_bytes_served_total", ())] == 12345
    assert samples[("decodefs_store_bytes", ())] == 999
    assert samples[("decodefs_inflight_decodes", ())] == 1
    assert samples[("decodefs_errors_total", (("kind", "store_ENOSPC"),))] == 2
    assert samples[("decodefs_originals", (("version", "v1"),))] == 11
    assert families["decodefs_decode_seconds"].type == "histogram"
    assert samples[("decodefs_decode_seconds_bucket", (("le", "0.005"),))] == 1
    assert samples[("decodefs_decode_seconds_bucket", (("le", "0.25"),))] == 3
    assert samples[("decodefs_decode_seconds_bucket", (("le", "+Inf"),))] == 4
    assert samples[("decodefs_decode_seconds_count", ())] == 4
    assert samples[("decodefs_decode_seconds_sum", ())] == pytest.approx(3.404)


def test_repeated_errors_are_folded_not_dropped(caplog: pytest.LogCaptureFixture) -> None:
    throttle = LogThrottle(logging.getLogger("test"), interval=0.2)
    caplog.set_level(logging.WARNING)
    for _ in range(50):
        throttle.log(logging.WARNING, "enospc", "store full")
    throttle.log(logging.WARNING, "other", "something else")
    assert [r.getMessage() for r in caplog.records] == ["store full", "something else"]
    time.sleep(0.25)
    throttle.log(logging.WARNING, "enospc", "store full")
    assert "store full (and 49 more like it in the last" in caplog.records[-1].getMessage()
