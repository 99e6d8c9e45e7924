"""The metrics over HTTP (metrics_address): a Prometheus that is not root scrapes them,
live, with the names its rules want; a busy address is one error line, nothing mounted."""

from __future__ import annotations

import os
import socket
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MountFactory
from tests.helpers import as_nobody, decodefs, is_mounted, write_config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_prometheus_scrapes_the_live_figures_over_http(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    port = free_port()
    mount = mounts({"v1": photos_dir}, metrics_address=f"127.0.0.1:{port}")
    url = f"http://127.0.0.1:{port}/metrics"
    before = scrape(url)
    assert before[("decodefs_hits_total", ())] == 0
    assert ("decodefs_store_max_bytes", ()) not in before  # no limit: no sample
    key = sorted(photos)[0]
    data = mount.path("v1", "224", f"{key}.npy").read_bytes()
    after = scrape(url)
    assert after[("decodefs_misses_total", ())] == 1
    assert after[("decodefs_served_bytes_total", ())] == len(data)
    assert after[("decodefs_stored_bytes", (("size", "224"), ("version", "v1")))] > 0
    if os.geteuid() == 0:  # the collector need not be root, nor able to read the mount
        program = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
        result = as_nobody(sys.executable, "-c", program, timeout=60)
        assert result.returncode == 0, result.stderr
        assert b"decodefs_misses_total 1.0" in result.stdout


def test_a_busy_metrics_address_is_one_error_line_and_no_mount(
    tmp_path: Path, photos_dir: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = write_config(
            tmp_path / "c.toml",
            tmp_path / "store",
            {"v1": photos_dir},
            metrics_address=f"127.0.0.1:{port}",
        )
        (tmp_path / "mnt").mkdir()
        result = decodefs("mount", tmp_path / "mnt", "--config", config, "--foreground")
    assert result.returncode == 1, result.stderr
    assert f"decodefs: error: metrics_address 127.0.0.1:{port}: cannot listen there: " in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not is_mounted(tmp_path / "mnt")


@pytest.mark.parametrize("value", ["9464", "localhost", "1.2.3.4:0", "a b:80", "[::1]:99999"])
def test_a_metrics_address_that_is_none_is_named(tmp_path: Path, value: str) -> None:
    from decodefs.common.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match='metrics_address: expected "HOST:PORT"'):
        parse_config(
            {"store": "s", "metrics_address": value, "versions": {"v1": {"source": "."}}},
            base_dir=tmp_path,
        )
