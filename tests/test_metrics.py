"""Prometheus rendering and the log throttle."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decodefs.common.metrics import Histogram, LogThrottle, render_prometheus


def snapshot() -> dict[str, object]:
    histogram = Histogram()
    for seconds in (0.004, 0.2, 0.2, 3.0):
        histogram.observe(seconds)
    return {
        "hits": 10, "misses": 4, "decodes": 5, "decode_errors": 1, "coalesced": 2,
        "corrupt_entries": 1, "evictions": 3, "store_write_errors": 0, "memory_fallbacks": 0,
        "background_decodes": 0, "warm_decodes": 0, "warm_not_stored": 0, "memory_waits": 0,
        "memory_refills": 0, "store_reads_inline": 0, "store_reads_threaded": 0, "page_drops": 0,
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
    assert samples[("decodefs_served_bytes_total", ())] == 12345
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
    now = [100.0]
    throttle = LogThrottle(logging.getLogger("test"), interval=30.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING)
    for _ in range(50):
        throttle.log(logging.WARNING, "enospc", "store full")
        now[0] += 0.5  # 25 s in all: within the interval
    throttle.log(logging.WARNING, "other", "something else")
    assert [r.getMessage() for r in caplog.records] == ["store full", "something else"]
    now[0] = 130.0  # the interval since the first line has passed
    throttle.log(logging.WARNING, "enospc", "store full")
    assert caplog.records[-1].getMessage() == ("store full (and 49 more like it in the last 30 s)")
    throttle.log(logging.WARNING, "enospc", "store full")  # a new interval began
    assert len(caplog.records) == 3


def test_folded_lines_can_carry_the_traceback(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    throttle = LogThrottle(logging.getLogger("test"), interval=30.0, clock=lambda: now[0])
    caplog.set_level(logging.ERROR)
    for i in range(1000):
        try:
            raise KeyError(f"bug {i}")
        except KeyError:
            throttle.log(logging.ERROR, "bug", "handler failed", exc_info=True)
    assert len(caplog.records) == 1
    assert caplog.records[0].exc_info is not None
    assert "KeyError: 'bug 0'" in caplog.text and caplog.text.count("Traceback") == 1
    now[0] = 31.0
    try:
        raise KeyError("bug 1000")
    except KeyError:
        throttle.log(logging.ERROR, "bug", "handler failed", exc_info=True)
    assert (
        caplog.records[-1].getMessage() == "handler failed (and 999 more like it in the last 31 s)"
    )
    assert "KeyError: 'bug 1000'" in caplog.text
