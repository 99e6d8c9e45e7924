"""The metrics over HTTP at ``metrics_address``, for a Prometheus that is not root.

prometheus_client's own HTTP server answers in its threads; each scrape takes one
stats snapshot on the trio thread (the counters are that thread's alone), so a
scrape is as consistent as a read of ``/.decodefs/metrics``. Knows the snapshot
function and the address; not the engine, not FUSE.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import trio
from prometheus_client import start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from ..common.config import metrics_host_port
from ..common.metrics import stats_families
from ..common.mounts import MountError

__all__ = ["MetricsEndpoint"]

log = logging.getLogger(__name__)


class MetricsEndpoint:
    """Listens at once (a busy address is the user's error, before the mount); answers
    scrapes once ``serve`` runs on the trio thread, and nothing before."""

    def __init__(self, address: str, stats: Callable[[], Mapping[str, Any]]) -> None:
        host, port = metrics_host_port(address)
        self.address = address
        self._collector = _SnapshotCollector(stats)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)
        try:
            self._server, self._thread = start_http_server(
                port, host or "0.0.0.0", registry=registry
            )
        except OSError as exc:
            raise MountError(
                f"metrics_address {address}: cannot listen there: {exc.strerror or exc}"
            ) from None

    async def serve(self) -> None:
        """Answer scrapes until cancelled (a task of the daemon's nursery)."""
        self._collector.token = trio.lowlevel.current_trio_token()
        log.info("metrics at http://%s/metrics", self.address)
        try:
            await trio.sleep_forever()
        finally:
            self._collector.token = None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _SnapshotCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = stats
        self.token: trio.lowlevel.TrioToken | None = None

    def collect(self) -> Iterator[Metric]:
        token = self.token
        if token is None:
            return  # not serving yet, or any more
        try:
            snapshot = trio.from_thread.run_sync(self._stats, trio_token=token)
        except trio.RunFinishedError:
            return
        yield from stats_families(snapshot)
