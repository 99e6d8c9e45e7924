"""Three nodes of a cluster on a real network: each node's daemon, mount and readers in a
network namespace of its own, SeaweedFS (the L2) in another, all joined by veth
pairs on a bridge (tests/netns.py). The namespaces are made and removed here."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from decodefs.sample import make_sample_corpus
from tests.conftest import MountFactory, needs_root_because
from tests.helpers import Mount, reference_npy, write_config
from tests.netns import Network, network, readers
from tests.servers import S3_ENV, SeaweedFS, dask_running, seaweedfs_running, wait_for

pytestmark = [
    needs_root_because("network namespaces"),
    pytest.mark.skipif(
        not (shutil.which("ip") and shutil.which("nsenter")), reason="needs ip and nsenter"
    ),
]

SIZE = 64
LEASE = 0.5  # seconds: shorter than a node's misses queue for its one decode slot
# The warm's claims are renewed from a Dask worker through S3 calls over the veth: on a
# loaded 2-core box a renewal can outlast half of LEASE, the claim runs out and a node
# decodes the array again (as a lease allows: it is what a dead holder looks like). The
# warm test is of one decode per original, not of takeovers: its lease outlasts the load.
WARM_LEASE = 10.0
NODES = ("n0", "n1", "n2")


@dataclass
class Lan:
    net: Network
    server: SeaweedFS

    def node(self, mounts: MountFactory, tmp_path: Path, name: str, source: Path, bucket: str,
             **keys: Any) -> Mount:  # fmt: skip
        """Node ``name``'s daemon, started in its namespace; its mount is everyone's."""
        return mounts(
            {"v1": source},
            name=name,
            store=tmp_path / f"store-{name}",
            env=S3_ENV,
            wrapper=tuple(self.net.hosts[name].command()),
            l2=f"s3://{bucket}/decoded",
            l2_endpoint=self.server.endpoint,
            **keys,
        )


@pytest.fixture(scope="module")
def lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lan]:
    with network("dfc", ("s3", *NODES)) as net:
        s3 = net.hosts["s3"]
        with seaweedfs_running(
            tmp_path_factory.mktemp("seaweedfs-lan"),
            address=s3.address,
            wrapper=s3.command(),
            within=lambda fn: net.within("s3", fn),
        ) as server:
            yield Lan(net, server)


def expected_digests(originals: list[Path]) -> dict[str, str]:
    return {f"{p.stem}.npy": hashlib.sha256(reference_npy(p, SIZE)).hexdigest() for p in originals}


def read_in_namespaces(lan: Lan, nodes: dict[str, Mount], names: list[str], threads: int
                       ) -> dict[str, dict[str, list[str]]]:  # fmt: skip
    """Every node's readers, in its namespace, read ``names`` at once: what each node's saw."""
    groups = [(lan.net.hosts[label], m.path("v1", str(SIZE))) for label, m in nodes.items()]
    with readers(groups, names, threads) as started:
        for group in started:  # every reader is up before any reads
            group.go()
        return {label: group.result(90)[1] for label, group in zip(nodes, started, strict=True)}


def test_three_nodes_cold_at_once_on_a_network_decode_each_original_once(
    mounts: MountFactory, tmp_path: Path, lan: Lan, large: list[Path]
) -> None:
    # The scenario, smaller: one decode slot per node and a lease shorter than
    # the time each node's misses queue for it (7 MP originals, 8 readers a node).
    originals, source = large, large[0].parents[1]
    bucket = lan.server.bucket()
    keys = {"decode_workers": 1, "l2_lease_seconds": LEASE}
    nodes = {n: lan.node(mounts, tmp_path, n, source, bucket, **keys) for n in NODES}
    names = sorted(f"{p.stem}.npy" for p in originals)
    seen = read_in_namespaces(lan, nodes, names, threads=8)
    expected = expected_digests(originals)
    for label, digests in seen.items():
        assert digests == {name: [expected[name]] * 8 for name in names}, label
    stats = {label: mount.stats() for label, mount in nodes.items()}
    decodes = {label: s["decodes"] for label, s in stats.items()}
    assert sum(decodes.values()) == len(originals), stats  # one per original, cluster-wide
    assert sum(s["l2_hits"] for s in stats.values()) == 2 * len(originals)
    assert all(s["l2_errors"] == {} and s["l2_breaker_opens"] == 0 for s in stats.values())


def test_a_node_cut_off_mid_epoch_reads_right_while_the_others_do_not_decode(
    mounts: MountFactory, tmp_path: Path, lan: Lan
) -> None:
    originals = make_sample_corpus(tmp_path / "originals", 24, 480, 360, seed=12)
    paths = {f"{p.stem}.npy": p for p in originals}
    names = sorted(paths)
    bucket = lan.server.bucket()
    source = tmp_path / "originals"
    keys = {"l2_timeout_seconds": 0.5, "l2_retry_seconds": 0.2}
    warm = lan.node(mounts, tmp_path, "n0", source, bucket, **keys)
    for name in names:
        warm.path("v1", str(SIZE), name).read_bytes()
    wait_for(lambda: warm.stats()["l2_publishes"] == len(names), 60, "n0 published", warm.stats)
    # Fresh stores on n1 and n2 read the epoch from L2; n1 is cut off for its middle third.
    # (A FUSE read never touches the network: these readers need no namespace.)
    cut = lan.node(mounts, tmp_path, "n1", source, bucket, **keys)
    other = lan.node(mounts, tmp_path, "n2", source, bucket, **keys)

    def read(mount: Mount, name: str) -> None:
        data = mount.path("v1", str(SIZE), name).read_bytes()
        assert data == reference_npy(paths[name], SIZE), name

    third = len(names) // 3
    for name in names[:third]:
        read(cut, name)
        read(other, name)
    assert cut.stats()["decodes"] == other.stats()["decodes"] == 0
    lan.net.cut("n1")
    try:
        for name in names[third : 2 * third]:
            read(cut, name)  # decoded there, after at most one call's deadline
            read(other, name)
        during = cut.stats()
        # Open, or half-open where reading the third outlasted the breaker's pause (a
        # loaded machine): either way it opened, and no read waited on the cut link.
        assert during["l2_state"] in ("open", "half-open"), during
        assert during["l2_breaker_opens"] >= 1 and during["decodes"] == third, during
    finally:
        lan.net.restore("n1")
    # The breaker tries again only for a miss once its pause is over: read arrays of new
    # sizes (each a miss that asks L2, when let) until it has closed.
    sizes = iter(range(SIZE + 1, SIZE + 3000))

    def closed_after_a_read() -> bool:
        size = next(sizes)
        data = cut.path("v1", str(size), names[0]).read_bytes()
        assert data == reference_npy(paths[names[0]], size), size
        return bool(cut.stats()["l2_state"] == "closed")

    wait_for(closed_after_a_read, 60, "n1's breaker to close with its link back", cut.stats)
    before = cut.stats()
    for name in names[2 * third :]:
        read(cut, name)
        read(other, name)
    after = cut.stats()
    assert after["decodes"] == before["decodes"], after  # from L2 again
    assert after["l2_breaker_opens"] >= 1 and after["l2_state"] == "closed", after
    assert other.stats()["decodes"] == 0 and other.stats()["l2_hits"] == len(names)
    assert warm.stats()["decodes"] == len(names)  # n0's count did not move either
    assert "-> open" in cut.log_text() and "-> closed" in cut.log_text()


def test_a_cluster_warm_on_workers_in_the_namespaces_racing_two_nodes_decodes_once(
    mounts: MountFactory, tmp_path: Path, lan: Lan, large: list[Path]
) -> None:
    originals, source = large, large[0].parents[1]
    names = sorted(f"{p.stem}.npy" for p in originals)
    bucket = lan.server.bucket()
    l2 = {"l2": f"s3://{bucket}/decoded", "l2_endpoint": lan.server.endpoint}
    keys = {"l2_lease_seconds": WARM_LEASE}
    config = write_config(tmp_path / "warm.toml", tmp_path / "unused", {"v1": source}, **keys, **l2)
    nodes = {n: lan.node(mounts, tmp_path, n, source, bucket, **keys) for n in ("n1", "n2")}
    hosts = lan.net.hosts
    workers = [(hosts[n].command(), hosts[n].address) for n in NODES]
    scheduler = (hosts["s3"].command(), hosts["s3"].address)
    with dask_running(tmp_path / "dask", scheduler, workers) as dask:

        def workers_up() -> bool:
            return dask.workers(lambda fn: lan.net.within("s3", fn)) == len(NODES)

        wait_for(workers_up, 60, "three Dask workers", dask.log_tail)
        # The warm's client runs on n0; the nodes' readers start once it has begun.
        command = [sys.executable, "-m", "decodefs", "warm", "--cluster", dask.address]
        command += ["v1", str(SIZE), "--config", str(config)]
        warm = subprocess.Popen(
            hosts["n0"].command(*command),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **S3_ENV},
        )
        try:
            wait_for(
                lambda: warm.poll() is not None or lan.server.objects(bucket, "decoded/"),
                60,
                "the warm's first claim",
            )
            seen = read_in_namespaces(lan, nodes, names, threads=8)
            out, err = warm.communicate(timeout=120)
        finally:
            if warm.poll() is None:
                warm.kill()
                warm.wait()
    assert warm.returncode == 0, err
    assert f"on {len(NODES)} workers" in out, out
    warmed = int(out.split(": ")[-1].split(" decoded")[0].replace(",", ""))
    expected = expected_digests(originals)
    for label, digests in seen.items():
        assert digests == {name: [expected[name]] * 8 for name in names}, label
    decodes = {label: mount.stats()["decodes"] for label, mount in nodes.items()}
    assert warmed + sum(decodes.values()) == len(originals), (out, decodes)
    objects = lan.server.objects(bucket, "decoded/")
    assert sum(1 for k in objects if ".leases/" not in k) == len(originals)
