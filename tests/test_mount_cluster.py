"""Two daemons as the nodes of a cluster, each with its own store and mount, sharing one
L2: a bucket on SeaweedFS, or a directory on JuiceFS (each node through its own
JuiceFS client). Read through real mounts by real readers; the cluster warm on
a Dask LocalCluster of two workers."""

from __future__ import annotations

import concurrent.futures
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from decodefs.sample import make_sample_corpus
from tests.conftest import MountFactory
from tests.helpers import Mount, decodefs, reference_npy, write_bad_originals, write_config
from tests.servers import (  # noqa: F401 - fixtures
    S3_ENV,
    JuiceFS,
    SeaweedFS,
    juicefs,
    seaweed,
    seaweedfs_running,
    wait_for,
)

SIZE = 64


@dataclass
class Shared:
    """How each node names the one L2 of a test: config keys per node."""

    nodes: list[dict[str, Any]]
    env: dict[str, str]
    objects: Any  # () -> how many array objects L2 holds


def _s3(server: SeaweedFS) -> Shared:
    bucket = server.bucket()
    keys = {"l2": f"s3://{bucket}/decoded", "l2_endpoint": server.endpoint}

    def objects() -> int:
        return sum(1 for k in server.objects(bucket, "decoded/") if k.endswith(".npy"))

    return Shared([keys, keys, keys], S3_ENV, objects)


def _juicefs(volume: JuiceFS) -> Shared:
    name = f"l2-{secrets.token_hex(4)}"
    (volume.mounts[0] / name).mkdir()
    views = [volume.mounts[0] / name, volume.mounts[1] / name]

    def objects() -> int:
        return sum(1 for p in views[0].rglob("*.npy") if ".leases" not in p.parts)

    return Shared([{"l2": str(view)} for view in (*views, views[1])], {}, objects)


@pytest.fixture(params=["s3", "juicefs"])
def shared(request: pytest.FixtureRequest) -> Shared:
    if request.param == "s3":
        return _s3(request.getfixturevalue("seaweed"))
    return _juicefs(request.getfixturevalue("juicefs"))


def node(
    mounts: MountFactory, tmp_path: Path, source: Path, shared: Shared, i: int, **keys: Any
) -> Mount:
    return mounts(
        {"v1": source},
        name=f"node{i}",
        store=tmp_path / f"store{i}",
        env=shared.env,
        **shared.nodes[i],
        **keys,
    )


def read_all(mount: Mount, uuids: list[str]) -> dict[str, bytes]:
    return {u: mount.path("v1", str(SIZE), f"{u}.npy").read_bytes() for u in uuids}


def test_node_b_reads_every_array_node_a_decoded_without_decoding(
    mounts: MountFactory, tmp_path: Path, photos_dir: Path, photos: dict[str, Path], shared: Shared
) -> None:
    a = node(mounts, tmp_path, photos_dir, shared, 0)
    uuids = sorted(photos)
    assert read_all(a, uuids) == {u: reference_npy(photos[u], SIZE) for u in uuids}
    wait_for(lambda: a.stats()["l2_publishes"] == len(uuids), 60, "A published", a.stats)
    assert a.stats()["decodes"] == len(uuids)
    assert shared.objects() == len(uuids)

    b = node(mounts, tmp_path, photos_dir, shared, 1)
    assert read_all(b, uuids) == {u: reference_npy(photos[u], SIZE) for u in uuids}
    stats = b.stats()
    assert stats["decodes"] == 0, stats
    assert stats["l2_hits"] == stats["store_entries"] == len(uuids)
    assert stats["l2_publishes"] == 0 and stats["l2_errors"] == {}
    metrics = b.path(".decodefs", "metrics").read_text()
    assert f"decodefs_l2_hits_total {float(len(uuids))}" in metrics
    table = decodefs("stats", b.mountpoint).stdout
    assert f"(closed): {len(uuids)} hits, 0 misses, 0 published" in table


def test_nodes_cold_at_once_decode_each_original_once(
    mounts: MountFactory, tmp_path: Path, large: list[Path], shared: Shared
) -> None:
    source = large[0].parents[1]
    nodes = [node(mounts, tmp_path, source, shared, i) for i in (0, 1)]
    uuids = sorted(p.stem for p in large)
    # Two readers on each node read every array; the four readers of one array
    # start together (a barrier), so both nodes miss it at once.
    gates = {u: threading.Barrier(4) for u in uuids}

    def read(mount: Mount, uuid: str) -> tuple[str, bytes]:
        gates[uuid].wait(timeout=120)
        return uuid, mount.path("v1", str(SIZE), f"{uuid}.npy").read_bytes()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(read, n, u) for u in uuids for n in nodes for _ in range(2)]
        got = [job.result() for job in jobs]
    paths = {p.stem: p for p in large}
    for uuid, data in got:
        assert data == reference_npy(paths[uuid], SIZE), uuid
    stats = [n.stats() for n in nodes]
    decodes = sum(s["decodes"] for s in stats)
    # The claims' bound: one decode per original while L2 answers and no holder stalls.
    assert decodes == len(uuids), stats
    assert sum(s["l2_hits"] for s in stats) == len(uuids)
    assert sum(s["l2_lease_waits"] for s in stats) >= 1


@pytest.fixture
def own_seaweed(tmp_path: Path) -> Iterator[SeaweedFS]:
    """A SeaweedFS of this test's own: it is paused (kill -STOP) and resumed."""
    with seaweedfs_running(tmp_path / "seaweedfs") as server:
        yield server


def test_l2_paused_and_returning_mid_epoch_never_fails_a_read(
    mounts: MountFactory, tmp_path: Path, own_seaweed: SeaweedFS
) -> None:
    originals = make_sample_corpus(tmp_path / "originals", 24, 480, 360, seed=3)
    uuids = sorted(p.stem for p in originals)
    paths = {p.stem: p for p in originals}
    shared = _s3(own_seaweed)
    timeout = 1.0
    keys = {"l2_timeout_seconds": timeout, "l2_retry_seconds": 0.2}
    a = node(mounts, tmp_path, tmp_path / "originals", shared, 0, **keys)
    read_all(a, uuids)
    wait_for(lambda: a.stats()["l2_publishes"] == len(uuids), 60, "A published", a.stats)
    b = node(mounts, tmp_path, tmp_path / "originals", shared, 1, **keys)
    worst = 0.0

    def read(uuid: str) -> None:
        nonlocal worst
        started = time.monotonic()
        data = b.path("v1", str(SIZE), f"{uuid}.npy").read_bytes()
        worst = max(worst, time.monotonic() - started)
        assert data == reference_npy(paths[uuid], SIZE), uuid

    for uuid in uuids[:6]:  # L2 up: fetched
        read(uuid)
    assert b.stats()["l2_hits"] == 6 and b.stats()["decodes"] == 0
    own_seaweed.pause()
    try:
        for uuid in uuids[6:12]:  # L2 stopped: decoded here, each read waits a bounded time
            read(uuid)
        stats = b.stats()
        assert stats["l2_state"] == "open" and stats["decodes"] == 6, stats
        # At most one call's deadline (2 x the timeout + 1 s) and a decode.
        assert worst < 2 * timeout + 1 + 2, worst
    finally:
        own_seaweed.resume()
    rest = iter(uuids[12:])
    for uuid in rest:  # L2 back: once the breaker's trial succeeds, fetched again
        read(uuid)
        if b.stats()["l2_state"] == "closed":
            break
    for uuid in rest:
        read(uuid)
    stats = b.stats()
    assert stats["l2_state"] == "closed", stats
    assert stats["l2_hits"] > 6 and stats["decodes"] < len(uuids) - 6, stats
    assert stats["l2_errors"], stats
    assert "L2 s3://" in b.log_text() and "-> open" in b.log_text()


def test_cluster_warm_on_dask_fills_l2_then_a_fresh_node_reads_without_decoding(
    mounts: MountFactory,
    tmp_path: Path,
    photos: dict[str, Path],
    seaweed: SeaweedFS,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from distributed import LocalCluster

    source = tmp_path / "originals"
    shutil.copytree(next(iter(photos.values())).parents[2], source)
    bad = write_bad_originals(source / "bad", photos["astronaut-baseline"])
    for name, value in S3_ENV.items():  # the workers' credentials, the standard AWS way
        monkeypatch.setenv(name, value)
    shared = _s3(seaweed)
    config = write_config(
        tmp_path / "cluster.toml", tmp_path / "unused", {"v1": source}, **shared.nodes[0]
    )
    with LocalCluster(  # type: ignore[no-untyped-call]
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
    ) as cluster:
        address = cluster.scheduler_address
        result = decodefs("warm", "--cluster", address, "v1", str(SIZE), "--config", config)
        assert result.returncode == 1, result.stderr  # the bad originals are reported
        good = len(photos)
        assert f"warmed {good} of {good + len(bad)} arrays of v1/{SIZE}" in result.stdout
        assert "on 2 workers" in result.stdout
        assert f"{good} decoded, 0 already there" in result.stdout
        for uuid in bad:
            assert f"failed: {uuid}: " in result.stderr
        assert shared.objects() == good

        listing = tmp_path / "uuids.txt"
        listing.write_text("\n".join(sorted(photos)) + "\n")
        again = decodefs(
            "warm", "--cluster", address, "v1", str(SIZE), "--config", config, "--keys", listing
        )
        assert again.returncode == 0, again.stderr
        assert f"0 decoded, {good} already there" in again.stdout  # it resumes

    fresh = node(mounts, tmp_path, source, shared, 2)
    uuids = sorted(photos)
    assert read_all(fresh, uuids) == {u: reference_npy(photos[u], SIZE) for u in uuids}
    stats = fresh.stats()
    assert stats["decodes"] == 0 and stats["l2_hits"] == good, stats


def test_cluster_warm_reports_what_the_user_must_fix(tmp_path: Path, photos_dir: Path) -> None:
    no_l2 = write_config(tmp_path / "plain.toml", tmp_path / "store", {"v1": photos_dir})
    result = decodefs("warm", "--cluster", "tcp://127.0.0.1:1", "v1", "64", "--config", no_l2)
    assert result.returncode == 1
    assert f"decodefs: error: {no_l2}: no l2 to warm" in result.stderr
    config = write_config(
        tmp_path / "l2.toml", tmp_path / "store", {"v1": photos_dir}, l2=str(tmp_path)
    )
    result = decodefs("warm", "--cluster", "tcp://127.0.0.1:1", "v2", "64", "--config", config)
    assert "has no version 'v2' (it has: v1)" in result.stderr and result.returncode == 1
    result = decodefs("warm", "--cluster", "tcp://127.0.0.1:9", "v1", "64", "--config", config)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in result.stderr
