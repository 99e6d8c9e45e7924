"""One stats schema (stats_schema.STATS): stats.json, the Prometheus text, `decodefs stats
--all`, docs/operations.md's table and the counters behind them all name the same figures."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decodefs.cli.status import format_all_stats, format_stats
from decodefs.cluster.backends import open_backend
from decodefs.cluster.tier import L2Metrics, L2Tier
from decodefs.common.config import parse_config
from decodefs.common.metrics import Metrics, render_prometheus
from decodefs.common.source import scan_source
from decodefs.common.stats_schema import STATS
from decodefs.common.status import holder_figures
from decodefs.daemon.engine import Engine
from decodefs.daemon.stats import snapshot
from decodefs.store.store import Store

NAMES = {stat.name for stat in STATS}
PROMETHEUS_TYPES = {
    "counter": "counter",
    "counter by kind": "counter",
    "gauge": "gauge",
    "flag": "gauge",
    "state": "gauge",
    "per version": "gauge",
    "per version and size": "gauge",
    "text": "gauge",  # an info metric, in the text format: a gauge <name>_info of 1
    "histogram": "histogram",
}


@pytest.fixture
def full_snapshot(tmp_path: Path, photos_dir: Path) -> Iterator[dict[str, object]]:
    """What the daemon of a node with an L2 tier reports, after a decode, an error and a
    fetch: every figure there is."""
    config = parse_config(
        {
            "store": str(tmp_path / "store"),
            "l2": str(tmp_path / "l2"),
            "max_store_bytes": "1G",
            "versions": {"v1": {"source": str(photos_dir)}},
        },
        base_dir=tmp_path,
    )
    assert config.l2 is not None
    store = Store(config.store, config.fingerprints(), lock_dir=str(tmp_path))
    store.open()
    sources = {n: scan_source(n, v.source, v.extensions) for n, v in config.versions.items()}
    tier = L2Tier(open_backend(config.l2), config.l2, config.fingerprints())
    engine = Engine(config, sources, store, l2=tier)
    engine.metrics.errors["EIO"] += 1
    engine.metrics.decode_seconds.observe(0.1)
    tier.metrics.errors["timeout"] += 1
    try:
        yield snapshot(
            engine,
            sources,
            pid=os.getpid(),
            mountpoint="/mnt/decoded",
            version="0.1.0+g0123456789ab",
            log="/var/log/decodefs.log",
            started=engine.metrics.started,
            **holder_figures(
                {
                    "pid": 1,
                    "state": "serving",
                    "version": "0.1.0+g0123456789ab",
                    "started": 1.0,
                    "handovers": 2,
                    "crashes": 1,
                    "refused": 0,
                    "remounts": 0,
                    "eio_answers": 0,
                    "rss_bytes": 1 << 20,
                    "last_problem": "serving process 7 (#2, reload) killed by SIGKILL",
                    "decodes_before": 3,
                    "last_pause": 0.01,
                    "standby_pid": 2,
                    "longest_pause": 0.5,
                }
            ),
            mount_decodes=4,
        )
    finally:
        engine.close()
        store.close()


def test_stats_json_holds_every_figure_of_the_schema_and_no_other(
    full_snapshot: dict[str, object],
) -> None:
    assert set(full_snapshot) == NAMES
    assert len(NAMES) == len(STATS)  # no figure defined twice


def test_the_prometheus_text_has_one_family_per_figure_of_its_kind(
    full_snapshot: dict[str, object],
) -> None:
    text = render_prometheus(full_snapshot).decode()
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families == {
        stat.prometheus + ("_info" if stat.kind == "text" else ""): PROMETHEUS_TYPES[stat.kind]
        for stat in STATS
    }


def test_decodefs_stats_all_shows_every_figure_and_the_table_only_schema_names(
    full_snapshot: dict[str, object],
) -> None:
    shown = [line.split()[0] for line in format_all_stats(full_snapshot).splitlines()]
    assert shown == [stat.name for stat in STATS]
    format_stats(full_snapshot)  # every figure the summary reads is a schema name (asserted)


def test_the_operations_docs_table_names_every_figure_and_no_other() -> None:
    docs = (Path(__file__).parents[1] / "docs" / "operations.md").read_text()
    section = docs.split("## Status files", 1)[1].split("\n## ", 1)[0]
    documented: list[str] = []
    for line in section.splitlines():
        if line.startswith("| `"):
            documented += re.findall(r"`([a-z0-9_]+)`", line.split(" | ")[0])
    assert sorted(documented) == sorted(NAMES)


def test_the_counters_behind_the_figures_are_named_as_the_schema() -> None:
    kinds = {stat.name: stat.kind for stat in STATS}
    engine = [f.name for f in dataclasses.fields(Metrics) if f.metadata.get("figure", True)]
    l2 = [f"l2_{f.name}" for f in dataclasses.fields(L2Metrics)]
    for name in engine + l2:
        assert kinds.get(name) in ("counter", "gauge", "counter by kind", "histogram"), name


def test_prometheus_names_follow_its_naming_rules() -> None:
    """The unit last, a counter's _total after it (decodefs_served_bytes_total, not
    bytes_served_total); a base unit, plural."""
    for stat in STATS:
        name = stat.prometheus
        assert name.startswith("decodefs_") and not name.endswith("_total"), name
        if stat.unit in ("bytes", "seconds") and stat.kind != "per version and size":
            assert name.endswith(f"_{stat.unit}"), (stat.name, name)
        if stat.unit not in ("bytes", "seconds"):
            assert not name.endswith(("_bytes", "_seconds")), (stat.name, name)


def test_an_absent_limit_is_no_sample_not_a_zero(full_snapshot: dict[str, object]) -> None:
    def samples(snapshot: dict[str, object]) -> dict[str, float]:
        text = render_prometheus(snapshot).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    assert samples(full_snapshot)["decodefs_store_max_bytes"] == 1 << 30
    unlimited = samples({**full_snapshot, "store_max_bytes": None})
    assert "decodefs_store_max_bytes" not in unlimited
    assert unlimited["decodefs_served_bytes_total"] == full_snapshot["bytes_served"]
