"""The cluster's L2 tier in-process: engines over real stores in tmp_path, sharing a real
L2 (a POSIX directory, and SeaweedFS's S3), with real decodes. Time is trio's
MockClock where it matters (lease expiry, the breaker's backoff)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import trio
import trio.testing

from decodefs.cluster.backends import LEASES, L2Backend, L2Error, PosixL2, object_name, open_backend
from decodefs.cluster.breaker import CircuitBreaker
from decodefs.cluster.dask_warm import WarmSpec, publish_entry, warm_batch
from decodefs.cluster.leases import Claim, claim_name, claims, release, renew, take
from decodefs.cluster.tier import L2Miss, L2Tier, verify_object
from decodefs.common.config import ConfigError, parse_config
from decodefs.common.decode import decoder_fingerprint, quiet_pillow_warnings
from decodefs.common.entry import EntryKey, encode_trailer
from decodefs.common.metrics import render_prometheus
from decodefs.common.npy import npy_bytes
from decodefs.common.source import SourceIndex, scan_source
from decodefs.daemon.engine import Engine
from decodefs.daemon.stats import snapshot
from decodefs.store.store import Store
from tests.helpers import WAIT_SECONDS, reference_npy, wait_for
from tests.servers import S3_ENV, SeaweedFS, seaweed  # noqa: F401 - a fixture

pytestmark = pytest.mark.trio

SIZE = 32
# For tests that jump trio's MockClock by a lease (30 s) or less: an L2 call's deadline
# (2 x 60 + 1 s) is longer, so that a jump never ends a call under way.
MOCK_KEYS: dict[str, Any] = {"l2_lease_seconds": 30, "l2_timeout_seconds": 60}


# -- the harness --------------------------------------------------------------------


@dataclass
class Node:
    """One daemon's engine, store and L2 tier in this process (no mount)."""

    engine: Engine
    store: Store
    tier: L2Tier
    engine_sources: dict[str, SourceIndex]

    async def read(self, uuid: str, size: int = SIZE) -> bytes:
        index = self.engine_sources["v1"].find(uuid)
        assert index is not None, uuid
        handle = await self.engine.open("v1", size, index)
        try:
            return bytes(await self.engine.read(handle, 0, handle.length + 1))
        finally:
            self.engine.release(handle)

    def stats(self) -> dict[str, Any]:
        return snapshot(self.engine, self.engine_sources)


@dataclass
class Cluster:
    """Where the nodes of one test meet: an L2 and how to reach it."""

    base: Path
    source: Path
    l2: str  # the config's l2 value
    keys: dict[str, Any]  # other l2 config keys (l2_endpoint)

    def backend(self) -> L2Backend:
        config = parse_config(self._raw(self.base / "probe"), base_dir=self.base)
        assert config.l2 is not None
        return open_backend(config.l2)

    def _raw(self, base: Path, **keys: Any) -> dict[str, Any]:
        version = {"source": str(self.source), **keys.pop("version_keys", {})}
        return {
            "store": str(base / "store"),
            "versions": {"v1": version},
            "l2": self.l2,
            # The nodes read any size (as helpers.write_config: stored for the owner).
            "unlisted_sizes": "owner",
            **self.keys,
            **keys,
        }

    @contextlib.asynccontextmanager
    async def node(
        self, name: str, *, wall: Callable[[], float] = time.time, **keys: Any
    ) -> AsyncIterator[Node]:
        base = self.base / name
        base.mkdir()
        config = parse_config(self._raw(base, **keys), base_dir=base)
        assert config.l2 is not None
        fingerprints = config.fingerprints()
        store = Store.from_config(config, lock_dir=str(base))
        store.open()
        tier = L2Tier(open_backend(config.l2), config.l2, fingerprints, wall=wall)
        sources = {n: scan_source(n, v.source, v.extensions) for n, v in config.versions.items()}
        engine = Engine(config, sources, store, l2=tier)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(tier.run)
                yield Node(engine, store, tier, sources)
                nursery.cancel_scope.cancel()
        finally:
            engine.close()
            store.close()

    @contextlib.asynccontextmanager
    async def tier(
        self,
        name: str,
        *,
        wall: Callable[[], float] = time.time,
        backend: L2Backend | None = None,
        running: bool = True,
        **keys: Any,
    ) -> AsyncIterator[L2Tier]:
        """A node's L2 tier alone (no engine): the test's ``decode`` stands in for its
        engine's, and asks ``miss.claim()`` as the engine does once its decode can start.
        Without ``running``, the test starts its background tasks (``run``) itself."""
        base = self.base / name
        base.mkdir()
        config = parse_config(self._raw(base, **keys), base_dir=base)
        assert config.l2 is not None
        tier = L2Tier(
            backend or open_backend(config.l2), config.l2, config.fingerprints(), wall=wall
        )
        try:
            async with trio.open_nursery() as nursery:
                if running:
                    nursery.start_soon(tier.run)
                yield tier
                nursery.cancel_scope.cancel()
        finally:
            tier.close()


@pytest.fixture(params=["posix", "s3"])
def cluster(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    photos_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Cluster:
    """An empty L2 of each kind: a directory, and a bucket on SeaweedFS."""
    quiet_pillow_warnings()
    if request.param == "posix":
        (tmp_path / "shared").mkdir()
        return Cluster(tmp_path, photos_dir, str(tmp_path / "shared"), {})
    server: SeaweedFS = request.getfixturevalue("seaweed")
    for name, value in S3_ENV.items():  # boto3's default chain reads them
        monkeypatch.setenv(name, value)
    url = f"s3://{server.bucket()}/team/decoded"
    return Cluster(tmp_path, photos_dir, url, {"l2_endpoint": server.endpoint})


def entry_of(key: EntryKey, payload: bytes) -> bytes:
    return payload + encode_trailer(key, payload, decoder_fingerprint_v1().digest)


def decoder_fingerprint_v1() -> Any:
    from decodefs.common.decode import DecodeSettings

    return decoder_fingerprint(DecodeSettings())


def name_of(uuid: str, size: int = SIZE) -> str:
    return object_name(EntryKey("v1", size, uuid), decoder_fingerprint_v1().hex)


# -- the backends' contract ------------------------------------------------------------


async def test_objects_are_created_once_and_never_replaced(cluster: Cluster) -> None:
    backend = cluster.backend()
    assert backend.get("v1/x/1/ab/abc.npy", 100) is None
    assert backend.size("v1/x/1/ab/abc.npy") is None
    assert backend.create("v1/x/1/ab/abc.npy", b"first")
    assert not backend.create("v1/x/1/ab/abc.npy", b"second")
    assert backend.get("v1/x/1/ab/abc.npy", 100) == b"first"
    assert backend.get("v1/x/1/ab/abc.npy", 2) == b"fir"  # at most limit + 1 bytes
    assert backend.size("v1/x/1/ab/abc.npy") == 5
    # Racing creates of one name, from many threads at once: exactly one wins.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda i: backend.create("race/r.npy", b"%d" % i), range(16)))
    assert won.count(True) == 1
    assert backend.get("race/r.npy", 10) == b"%d" % won.index(True)
    backend.delete("v1/x/1/ab/abc.npy")
    backend.delete("v1/x/1/ab/abc.npy")  # absent: no error
    assert backend.get("v1/x/1/ab/abc.npy", 100) is None
    assert backend.create("v1/x/1/ab/abc.npy", b"third")  # a verified-bad one is replaced so


async def test_objects_are_listed_only_if_their_names_begin_with_the_prefix(
    cluster: Cluster,
) -> None:
    backend = cluster.backend()
    # Claims of two arrays whose names are as long, side by side (leases.py).
    wanted = ["v1/x/1/ab/ab0001.npy@1", "v1/x/1/ab/ab0001.npy@2"]
    others = ["v1/x/1/ab/ab0002.npy@1", "v1/x/1/ab/ab0001.npy", "v1/x/1/cd/ab0001.npy@1"]
    for name in wanted + others:
        assert backend.create(name, b"{}")
    assert backend.list("v1/x/1/ab/ab0001.npy@", 10) == wanted
    assert backend.list("v1/x/1/ab/ab0003.npy@", 10) == []
    assert backend.list("v1/x/1/ef/ab0001.npy@", 10) == []  # no such directory
    assert len(backend.list("v1/x/1/ab/ab0001.npy@", 1)) == 1  # at most the limit


async def test_a_posix_l2_follows_no_symlink_planted_in_it(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "v1").symlink_to(elsewhere)
    backend = PosixL2(root)
    with pytest.raises(L2Error) as caught:
        backend.create("v1/fp/32/ab/abc.npy", b"data")
    assert caught.value.kind in ("ELOOP", "ENOTDIR")
    assert os.listdir(elsewhere) == []
    (root / "obj.npy").symlink_to(tmp_path / "secret")
    (tmp_path / "secret").write_bytes(b"secret")
    assert backend.get("obj.npy", 100) == b""  # never the target's bytes: fails every check


# -- a node reads what another published ------------------------------------------------


async def test_a_second_node_reads_every_array_from_l2_without_decoding(
    cluster: Cluster, photos: dict[str, Path]
) -> None:
    async with cluster.node("a") as a:
        for uuid in photos:
            await a.read(uuid)
        await wait_for(lambda: a.stats()["l2_publishes"] == len(photos), what="A published all")
        assert a.stats()["decodes"] == a.stats()["l2_misses"] == len(photos)
    async with cluster.node("b") as b:
        for uuid, path in photos.items():
            assert await b.read(uuid) == reference_npy(path, SIZE), uuid
        stats = b.stats()
        assert stats["decodes"] == 0 and stats["misses"] == 0
        assert stats["l2_hits"] == stats["hits"] == stats["store_entries"] == len(photos)
        assert stats["l2_bytes_fetched"] == stats["store_bytes"]
        assert stats["l2_fetch_seconds"]["count"] == len(photos)
        for uuid in photos:  # later reads are local hits: L2 is not asked again
            await b.read(uuid)
        assert b.stats()["l2_fetch_seconds"]["count"] == len(photos)
        assert b.stats()["l2_publishes"] == 0
        metrics = render_prometheus(b.stats()).decode()
        assert f"decodefs_l2_hits_total {float(len(photos))}" in metrics
        assert 'decodefs_l2_state{state="closed"} 1.0' in metrics
        assert "decodefs_l2_fetch_seconds_bucket" in metrics


async def test_an_object_is_the_store_entry_under_the_decoder_fingerprint(
    cluster: Cluster, photos: dict[str, Path]
) -> None:
    uuid = sorted(photos)[0]
    async with cluster.node("a") as a:
        await a.read(uuid)
        await wait_for(lambda: a.stats()["l2_publishes"] == 1, what="published")
        local = (Path(a.store.root) / EntryKey("v1", SIZE, uuid).relpath).read_bytes()
    fingerprint = decoder_fingerprint_v1().hex
    assert name_of(uuid) == f"v1/{fingerprint}/{SIZE}/{uuid[:2]}/{uuid}.npy"
    assert cluster.backend().get(name_of(uuid), 1 << 20) == local  # byte for byte, trailer too


async def test_other_decode_settings_never_take_each_others_arrays(
    cluster: Cluster, photos: dict[str, Path]
) -> None:
    uuid = sorted(photos)[0]
    async with cluster.node("a") as a:
        await a.read(uuid)
        await wait_for(lambda: a.stats()["l2_publishes"] == 1, what="published")
    async with cluster.node("b", version_keys={"resample": "nearest"}) as b:
        nearest = await b.read(uuid)
        assert b.stats()["decodes"] == 1 and b.stats()["l2_hits"] == 0
        await wait_for(
            lambda: b.stats()["l2_publishes"] == 1, what="B published under its own name"
        )
    assert nearest != reference_npy(photos[uuid], SIZE)


# -- corrupt objects ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b, other: b[:-1000], id="truncated"),
        pytest.param(lambda b, other: b[:200] + bytes([b[200] ^ 1]) + b[201:], id="bit-flip"),
        pytest.param(lambda b, other: other, id="another-arrays-object"),
        pytest.param(lambda b, other: b[:-40], id="no-trailer"),
    ],
)
async def test_a_corrupt_object_is_never_served_and_is_replaced(
    cluster: Cluster, photos: dict[str, Path], damage: Callable[[bytes, bytes], bytes]
) -> None:
    uuid, neighbour = sorted(photos)[:2]
    async with cluster.node("a") as a:
        await a.read(uuid)
        await a.read(neighbour)
        await wait_for(lambda: a.stats()["l2_publishes"] == 2, what="published")
    backend = cluster.backend()
    good = backend.get(name_of(uuid), 1 << 20)
    other = backend.get(name_of(neighbour), 1 << 20)
    assert good is not None and other is not None
    backend.delete(name_of(uuid))  # how a damaged object can come to be there
    assert backend.create(name_of(uuid), damage(good, other))
    async with cluster.node("b") as b:
        assert await b.read(uuid) == reference_npy(photos[uuid], SIZE)
        stats = b.stats()
        assert stats["l2_corrupt"] == 1 and stats["decodes"] == 1 and stats["l2_hits"] == 0
        await wait_for(lambda: b.stats()["l2_publishes"] == 1, what="B published a good object")
    assert backend.get(name_of(uuid), 1 << 20) == good


async def test_an_object_of_another_store_format_is_left_alone(
    cluster: Cluster, photos: dict[str, Path]
) -> None:
    uuid = sorted(photos)[0]
    key = EntryKey("v1", SIZE, uuid)
    payload = reference_npy(photos[uuid], SIZE)
    foreign = bytearray(entry_of(key, payload))
    foreign[-36] = 99  # the trailer's format field: written by another decodefs
    assert verify_object(key, bytes(foreign), decoder_fingerprint_v1().digest)[1]
    backend = cluster.backend()
    assert backend.create(name_of(uuid), bytes(foreign))
    async with cluster.node("b") as b:
        assert await b.read(uuid) == payload
        assert b.stats()["l2_errors"]["foreign_format"] >= 1 and b.stats()["l2_corrupt"] == 0
        assert b.stats()["decodes"] == 1
        await wait_for(
            lambda: b.stats()["l2_publish_exists"] == 1, what="B's publish found it there"
        )
    assert backend.get(name_of(uuid), 1 << 20) == bytes(foreign)


# -- leases ---------------------------------------------------------------------------------


async def test_nodes_cold_at_once_decode_each_array_once(
    cluster: Cluster, photos: dict[str, Path]
) -> None:
    async with cluster.node("a") as a, cluster.node("b") as b:
        got: dict[tuple[str, str], bytes] = {}

        async def read(node: Node, label: str, uuid: str) -> None:
            got[label, uuid] = await node.read(uuid)

        async with trio.open_nursery() as nursery:
            for uuid in photos:
                nursery.start_soon(read, a, "a", uuid)
                nursery.start_soon(read, b, "b", uuid)
        for (_, uuid), data in got.items():
            assert data == reference_npy(photos[uuid], SIZE), uuid
        decodes = a.stats()["decodes"] + b.stats()["decodes"]
        assert decodes == len(photos), (a.stats(), b.stats())
        assert a.stats()["l2_leases"] + b.stats()["l2_leases"] >= len(photos)
        assert a.stats()["l2_hits"] + b.stats()["l2_hits"] == len(photos)
        await wait_for(
            lambda: a.stats()["l2_publish_queue"] == b.stats()["l2_publish_queue"] == 0,
            what="flushed",
        )
    backend = cluster.backend()
    assert not any(claims(backend, name_of(u)) for u in photos)  # all let go


async def test_a_waiter_decodes_itself_once_the_holders_lease_runs_out(
    cluster: Cluster, photos: dict[str, Path], mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.rate = 1.0  # real speed (worker threads), but jumps at will

    def wall() -> float:
        return 1_000_000.0 + trio.current_time()

    uuid = sorted(photos)[0]
    backend = cluster.backend()
    # A node that took the lease and died: it never publishes, never lets go.
    dead = Claim(claim_name(name_of(uuid), 1), 1, "dead", wall() + 30)
    assert backend.create(dead.name, dead.body())
    async with cluster.node("b", wall=wall, **MOCK_KEYS) as b:
        result: list[bytes] = []

        async def reader() -> None:
            result.append(await b.read(uuid))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await wait_for(lambda: b.tier.metrics.lease_waits == 1, what="B waits for the lease")
            assert b.stats()["decodes"] == 0
            mock_clock.jump(30)  # the lease runs out
        assert result == [reference_npy(photos[uuid], SIZE)]
        assert b.stats()["decodes"] == 1 and b.stats()["l2_lease_timeouts"] == 1
        assert trio.current_time() < 45  # waited for the lease, not much more


async def test_a_waiter_takes_the_holders_array_as_soon_as_it_is_published(
    cluster: Cluster, photos: dict[str, Path]
) -> None:
    uuid = sorted(photos)[0]
    backend = cluster.backend()
    lease = claim_name(name_of(uuid), 1)
    assert backend.create(lease, Claim(lease, 1, "slow", time.time() + 60).body())
    async with cluster.node("b") as b:
        result: list[bytes] = []

        async def reader() -> None:
            result.append(await b.read(uuid))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await wait_for(lambda: b.tier.metrics.lease_waits == 1, what="B waits for the lease")
            key = EntryKey("v1", SIZE, uuid)
            payload = reference_npy(photos[uuid], SIZE)
            await trio.to_thread.run_sync(backend.create, name_of(uuid), entry_of(key, payload))
            await trio.to_thread.run_sync(backend.delete, lease)
        assert result == [reference_npy(photos[uuid], SIZE)]
        assert b.stats()["decodes"] == 0 and b.stats()["l2_hits"] == 1


async def test_an_expired_lease_is_taken_over_with_the_next_term(
    cluster: Cluster, photos: dict[str, Path]
) -> None:
    uuid = sorted(photos)[0]
    backend = cluster.backend()
    dead = Claim(claim_name(name_of(uuid), 1), 1, "dead", time.time() - 5)
    assert backend.create(dead.name, dead.body())
    async with cluster.node("b") as b:
        assert await b.read(uuid) == reference_npy(photos[uuid], SIZE)
        assert b.stats()["l2_leases"] == 1 and b.stats()["l2_lease_waits"] == 0
        await wait_for(lambda: b.stats()["l2_publish_queue"] == 0, what="published")
    # B claimed term 2 and let go of it; the dead node's claim is its own to remove.
    assert claims(backend, name_of(uuid)) == [dead]


async def test_a_lease_running_out_for_three_waiting_nodes_at_once_is_taken_over_by_one(
    cluster: Cluster, photos: dict[str, Path], mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.rate = 1.0  # real speed (worker threads), but jumps at will

    def wall() -> float:
        return 1_000_000.0 + trio.current_time()

    uuid = sorted(photos)[0]
    backend = cluster.backend()
    dead = Claim(claim_name(name_of(uuid), 1), 1, "dead", wall() + 30)
    assert backend.create(dead.name, dead.body())
    keys: dict[str, Any] = {"wall": wall, **MOCK_KEYS}
    async with (
        cluster.node("a", **keys) as a,
        cluster.node("b", **keys) as b,
        cluster.node("c", **keys) as c,
    ):
        nodes = [a, b, c]
        got: list[bytes] = []

        async def read(node: Node) -> None:
            got.append(await node.read(uuid))

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(read, node)
            await wait_for(
                lambda: all(n.tier.metrics.lease_waits == 1 for n in nodes),
                what="all three wait for the dead node's claim",
            )
            mock_clock.jump(30)  # it runs out for all three at the same instant
        assert got == [reference_npy(photos[uuid], SIZE)] * 3
        stats = [n.stats() for n in nodes]
        assert sum(s["decodes"] for s in stats) == 1, stats  # one took the next term ...
        assert sum(s["l2_hits"] for s in stats) == 2, stats  # ... the others its array
        # (One that claims after the winner let go finds the array: a claim, not a decode.)
        await wait_for(
            lambda: sum(n.stats()["l2_publish_queue"] for n in nodes) == 0, what="flushed"
        )
    assert claims(backend, name_of(uuid)) == [dead]  # the winner let go of its own


class Obtained(NamedTuple):
    data: bytes | memoryview  # the .npy bytes
    decoded: bool  # decoded here; else fetched from L2


Decode = Callable[[L2Miss], Awaitable[bytes | None]]


async def drive_miss(tier: L2Tier, key: EntryKey, decode: Decode) -> Obtained:
    """A local miss driven through ``tier`` the way the engine drives one
    (Engine._obtain): ``decode`` asks ``miss.claim()`` once it can start."""
    miss = tier.miss(key)
    payload = await miss.lookup()
    while payload is None:
        try:
            data = await decode(miss)
        except BaseException:
            miss.failed()
            raise
        if data is not None:
            miss.decoded(data)
            return Obtained(data, decoded=True)
        payload = await miss.wait()
    return Obtained(payload, decoded=False)


def slow_decoder(
    payload: bytes, finish: dict[str, trio.Event], decoding: list[str]
) -> Callable[[str], Decode]:
    """Decodes for tiers alone: each claims as the engine's would, then runs until the
    test lets it finish (a decode slower than the lease)."""

    def decoder(label: str) -> Decode:
        async def decode(miss: L2Miss) -> bytes | None:
            if not await miss.claim():
                return None
            decoding.append(label)
            await finish[label].wait()
            return payload

        return decode

    return decoder


async def test_a_holder_renews_its_claim_while_it_decodes_past_the_lease(
    cluster: Cluster, photos: dict[str, Path], mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.rate = 1.0

    def wall() -> float:
        return 1_000_000.0 + trio.current_time()

    uuid = sorted(photos)[0]
    key, name = EntryKey("v1", SIZE, uuid), name_of(uuid)
    payload = reference_npy(photos[uuid], SIZE)
    backend = cluster.backend()
    finish, decoding = {"a": trio.Event()}, list[str]()
    decoder = slow_decoder(payload, finish, decoding)
    async with (
        cluster.tier("a", wall=wall, **MOCK_KEYS) as a,
        cluster.tier("b", wall=wall, **MOCK_KEYS) as b,
    ):
        got: list[Any] = []

        async def obtain(tier: L2Tier, label: str) -> None:
            got.append(await drive_miss(tier, key, decoder(label)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(obtain, a, "a")
            await wait_for(lambda: decoding == ["a"], what="A decodes")
            nursery.start_soon(obtain, b, "b")
            await wait_for(lambda: b.metrics.lease_waits == 1, what="B waits for A's claim")
            for renewals in (1, 2, 3):  # A decodes for three leases and more
                looked = b.metrics.fetch_seconds.count
                mock_clock.jump(16)  # past half the lease: A renews
                # (Each wait ends within its iteration: the loop variables are current.)
                await wait_for(
                    lambda: a.metrics.lease_renewals == renewals,  # noqa: B023
                    what="A renewed",
                )
                await wait_for(
                    lambda: b.metrics.fetch_seconds.count >= looked + 2,  # noqa: B023
                    what="B looked again (and found A's claim renewed)",
                )
                assert [c.holder for c in claims(backend, name)] == [a._node]
            finish["a"].set()
        assert decoding == ["a"]  # B never decoded
        assert [o.decoded for o in got] == [True, False]
        assert b.metrics.lease_waits == 1 and b.metrics.lease_timeouts == 0
        await wait_for(
            lambda: a.stats()["l2_publish_queue"] == b.stats()["l2_publish_queue"] == 0,
            what="claims let go",
        )
    assert claims(backend, name) == []


async def test_a_holder_finishing_after_its_lease_ran_out_lets_go_of_its_own_claim_only(
    cluster: Cluster, photos: dict[str, Path], mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.rate = 1.0

    def wall() -> float:
        return 1_000_000.0 + trio.current_time()

    uuid = sorted(photos)[0]
    key, name = EntryKey("v1", SIZE, uuid), name_of(uuid)
    payload = reference_npy(photos[uuid], SIZE)
    backend = cluster.backend()
    finish, decoding = {"a": trio.Event(), "b": trio.Event()}, list[str]()
    decoder = slow_decoder(payload, finish, decoding)
    # A stalls (its background tasks do not run: as if paused), so its claim runs out.
    async with (
        cluster.tier("a", wall=wall, running=False, **MOCK_KEYS) as a,
        cluster.tier("b", wall=wall, **MOCK_KEYS) as b,
    ):
        done: dict[str, bool] = {}

        async def obtain(label: str, tier: L2Tier) -> None:
            obtained = await drive_miss(tier, key, decoder(label))
            assert obtained.data == payload
            done[label] = obtained.decoded

        def held() -> list[tuple[int, str]]:
            return [(c.term, c.holder) for c in claims(backend, name)]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(obtain, "a", a)
            await wait_for(lambda: decoding == ["a"], what="A decodes")
            nursery.start_soon(obtain, "b", b)
            await wait_for(lambda: b.metrics.lease_waits == 1, what="B waits for A's claim")
            mock_clock.jump(30)  # A's claim runs out while A still decodes
            await wait_for(lambda: decoding == ["a", "b"], what="B took it over")
            assert [term for term, _ in held()] == [1, 2]
            nursery.start_soon(a.run)  # A comes back: it finds its claim lost, ...
            finish["a"].set()  # ... finishes, publishes, and lets go of term 1 only
            await wait_for(lambda: "a" in done and a.metrics.publishes == 1, what="A done")
            await wait_for(lambda: len(held()) == 1, what="A let go")
            assert held() == [(2, b._node)]  # B's claim stands
            finish["b"].set()
            await wait_for(lambda: "b" in done, what="B done")
            nursery.cancel_scope.cancel()  # A's run
        assert done == {"a": True, "b": True}  # past the lease, both decoded (the bound)
        await wait_for(lambda: b.stats()["l2_publish_queue"] == 0, what="B let go")
        assert b.metrics.publish_exists == 1
    assert held() == []
    assert backend.get(name, 1 << 20) == entry_of(key, payload)


# -- claims, step by step ----------------------------------------------------------------------


async def test_claims_are_taken_by_term_and_only_their_holder_removes_them(
    cluster: Cluster,
) -> None:
    backend = cluster.backend()
    name = name_of("claimed")
    first = take(backend, name, "a", now=100.0, seconds=10)
    assert first == Claim(claim_name(name, 1), 1, "a", 110.0)
    assert take(backend, name, "b", now=105.0, seconds=10) == first  # live: B defers to A
    # A's claim ran out: B and C both saw it so; B creates term 2 first, C finds it live.
    second = take(backend, name, "b", now=111.0, seconds=10)
    assert second == Claim(claim_name(name, 2), 2, "b", 121.0)
    assert take(backend, name, "c", now=111.5, seconds=10) == second
    release(backend, first)  # A, finishing late, lets go of its own term
    assert claims(backend, name) == [second]
    # A hole at term 1 while term 2 is live: whoever creates term 1 finds term 2 and
    # defers to it, removing its own claim.
    assert take(backend, name, "d", now=112.0, seconds=10) == second
    assert claims(backend, name) == [second]
    # B renews: term 3 for B, then its term 2 let go.
    third = renew(backend, second, now=116.0, seconds=10)
    assert third == Claim(claim_name(name, 3), 3, "b", 126.0)
    assert claims(backend, name) == [third] and third.array == name
    assert take(backend, name, "c", now=122.0, seconds=10) == third
    # Renewed too late: C took it over (with term 1, free again); B's renewal finds it lost.
    fourth = take(backend, name, "c", now=127.0, seconds=10)
    assert fourth == Claim(claim_name(name, 1), 1, "c", 137.0)
    assert renew(backend, third, now=127.5, seconds=10) is None
    release(backend, third)
    assert claims(backend, name) == [fourth]
    release(backend, fourth)
    assert claims(backend, name) == []
    assert take(backend, name, "e", now=200.0, seconds=10) == Claim(
        claim_name(name, 1), 1, "e", 210.0
    )


async def test_claims_that_cannot_be_read_count_as_expired_and_litter_is_ignored(
    cluster: Cluster,
) -> None:
    backend = cluster.backend()
    name = name_of("littered")
    assert backend.create(claim_name(name, 1), b"not json")  # a holder died while writing
    assert backend.create(f"{claim_name(name, 1)}.npy@7", b"another array's name")
    assert backend.create(f".leases/{name}@01", b"{}")  # not a term
    assert [(c.term, c.live(0.0)) for c in claims(backend, name)] == [(1, False)]
    assert take(backend, name, "a", now=100.0, seconds=10) == Claim(
        claim_name(name, 2), 2, "a", 110.0
    )


# -- a burst on a busy L2 -----------------------------------------------------------------


class BusyL2(PosixL2):
    """A healthy shared directory whose every call takes a while, as over a network."""

    delay = 0.005

    def get(self, name: str, limit: int) -> bytes | None:
        time.sleep(self.delay)
        return super().get(name, limit)

    def create(self, name: str, data: bytes | memoryview) -> bool:
        time.sleep(self.delay)
        return super().create(name, data)


class StallingL2(PosixL2):
    """A shared directory whose fetches of arrays hang once told to, as a network call
    that never answers, until the test lets them go on."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.stall = threading.Event()
        self.stalled = threading.Event()
        self.go_on = threading.Event()

    def get(self, name: str, limit: int) -> bytes | None:
        if self.stall.is_set() and not name.startswith(LEASES):  # an array, not a claim
            self.stalled.set()
            self.go_on.wait(WAIT_SECONDS)
        return super().get(name, limit)


async def test_a_claim_whose_decode_is_cancelled_while_it_looks_again_is_let_go(
    tmp_path: Path, photos_dir: Path
) -> None:
    (tmp_path / "shared").mkdir()
    cluster = Cluster(tmp_path, photos_dir, str(tmp_path / "shared"), {})
    backend = StallingL2(tmp_path / "shared")
    key = EntryKey("v1", SIZE, "cancelled")
    try:
        async with cluster.tier("a", backend=backend, **MOCK_KEYS) as tier:
            miss = tier.miss(key)
            assert await miss.lookup() is None

            async def decode() -> None:  # as the engine's: a decode that fails lets go
                try:
                    await miss.claim()
                except BaseException:
                    miss.failed()
                    raise

            backend.stall.set()  # the claim is taken; the look for the array after it hangs
            async with trio.open_nursery() as nursery:
                nursery.start_soon(decode)
                await wait_for(backend.stalled.is_set, what="the look after the claim")
                assert len(claims(backend, name_of("cancelled"))) == 1
                nursery.cancel_scope.cancel()  # the reader went away meanwhile
            backend.go_on.set()
            await wait_for(
                lambda: claims(backend, name_of("cancelled")) == [], what="the claim let go"
            )
    finally:
        backend.go_on.set()


async def test_a_burst_of_500_misses_on_a_busy_l2_never_opens_the_breaker(
    tmp_path: Path, photos_dir: Path, photos: dict[str, Path]
) -> None:
    (tmp_path / "shared").mkdir()
    cluster = Cluster(tmp_path, photos_dir, str(tmp_path / "shared"), {})
    payload = reference_npy(next(iter(photos.values())), SIZE)
    # One L2 thread, each call 5 ms: the last of 500 fetches waits ~2.5 s for its thread,
    # more than a call's deadline (2 x 0.05 + 1 s). Only time spent on L2 counts.
    keys: dict[str, Any] = {"l2_workers": 1, "l2_timeout_seconds": 0.05, "l2_lease_seconds": 0}
    async with cluster.tier("a", backend=BusyL2(tmp_path / "shared"), **keys) as tier:

        async def decode(miss: L2Miss) -> bytes:
            return payload

        async def miss(i: int) -> None:
            obtained = await drive_miss(tier, EntryKey("v1", SIZE, f"burst-{i:03d}"), decode)
            assert obtained.decoded and obtained.data == payload

        async with trio.open_nursery() as nursery:
            for i in range(500):
                nursery.start_soon(miss, i)
        stats: dict[str, Any] = tier.stats()
        assert stats["l2_misses"] == 500 and stats["l2_bypassed"] == 0, stats
        assert stats["l2_errors"] == {} and stats["l2_breaker_opens"] == 0, stats
        assert stats["l2_state"] == "closed"
        assert stats["l2_fetch_seconds"]["count"] == 500  # every one was asked


# -- the cluster warm against readers --------------------------------------------------------


def warm_spec(cluster: Cluster) -> WarmSpec:
    config = parse_config(cluster._raw(cluster.base / "warm"), base_dir=cluster.base)
    assert config.l2 is not None
    version = config.versions["v1"]
    return WarmSpec(
        l2=config.l2,
        version="v1",
        size=SIZE,
        settings=version.decode,
        layout=version.layout,
        max_pixels=config.max_pixels,
        fingerprint_hex=version.fingerprint().hex,
    )


async def test_a_cluster_warm_racing_with_a_reader_decodes_each_array_once(
    cluster: Cluster, photos: dict[str, Path]
) -> None:
    spec = warm_spec(cluster)
    items = [(uuid, str(path)) for uuid, path in sorted(photos.items())]
    async with cluster.node("a") as a:
        got: dict[str, bytes] = {}
        warmed: list[Any] = []

        async def read(uuid: str) -> None:
            got[uuid] = await a.read(uuid)

        async def warm() -> None:
            warmed.append(await trio.to_thread.run_sync(warm_batch, spec, items))

        async with trio.open_nursery() as nursery:  # the warm and the reader start together
            nursery.start_soon(warm)
            for uuid in photos:
                nursery.start_soon(read, uuid)
        for uuid, path in photos.items():
            assert got[uuid] == reference_npy(path, SIZE), uuid
        [result] = warmed
        assert result.failed == {}
        assert result.decoded + result.skipped == len(photos)
        assert result.decoded + a.stats()["decodes"] == len(photos), (result, a.stats())
        await wait_for(lambda: a.stats()["l2_publish_queue"] == 0, what="A let go")
    backend = cluster.backend()
    assert not any(claims(backend, name_of(u)) for u in photos)


async def test_the_cluster_warm_replaces_only_an_object_it_has_just_found_bad(
    cluster: Cluster, photos: dict[str, Path]
) -> None:
    backend = cluster.backend()
    digest = decoder_fingerprint_v1().digest
    uuid = sorted(photos)[0]
    key, name = EntryKey("v1", SIZE, uuid), name_of(uuid)
    good = entry_of(key, reference_npy(photos[uuid], SIZE))
    assert publish_entry(backend, key, name, good, digest) == "created"
    assert publish_entry(backend, key, name, good, digest) == "kept"  # never deleted
    foreign = bytearray(good)
    foreign[-36] = 99  # another decodefs format's: not ours to judge
    backend.delete(name)
    assert backend.create(name, bytes(foreign))
    assert publish_entry(backend, key, name, good, digest) == "kept"
    assert backend.get(name, 1 << 20) == bytes(foreign)
    backend.delete(name)
    assert backend.create(name, good[:200] + bytes([good[200] ^ 1]) + good[201:])
    assert publish_entry(backend, key, name, good, digest) == "replaced"
    assert backend.get(name, 1 << 20) == good
    # A warm over an object of the wrong length: decoded and replaced.
    backend.delete(name)
    assert backend.create(name, good[:-100])
    result = await trio.to_thread.run_sync(
        warm_batch, warm_spec(cluster), [(uuid, str(photos[uuid]))]
    )
    assert (result.decoded, result.skipped, result.failed) == (1, 0, {})
    assert backend.get(name, 1 << 20) == good


# -- L2 failing: reads never fail, never wait past a bound ---------------------------------------


@pytest.fixture
def unreachable(tmp_path: Path) -> Iterator[str]:
    """An S3 endpoint with nothing listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield f"http://127.0.0.1:{port}"


@pytest.fixture
def silent() -> Iterator[str]:
    """An S3 endpoint that accepts connections and never answers (a hung server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_an_unreachable_l2_means_local_decodes_and_the_breaker_opens(
    tmp_path: Path, photos_dir: Path, photos: dict[str, Path], unreachable: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    cluster = Cluster(tmp_path, photos_dir, "s3://bucket/p", {"l2_endpoint": unreachable})
    async with cluster.node("a") as a:
        for uuid, path in photos.items():
            assert await a.read(uuid) == reference_npy(path, SIZE)
        stats = a.stats()
        assert stats["decodes"] == len(photos)
        assert stats["l2_errors"]["unreachable"] >= 3
        assert stats["l2_state"] == "open" and stats["l2_breaker_opens"] == 1
        assert stats["l2_bypassed"] >= len(photos) - 3  # once open, L2 is not asked


async def test_a_silent_l2_costs_a_read_at_most_its_timeout(
    tmp_path: Path, photos_dir: Path, photos: dict[str, Path], silent: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    keys = {"l2_endpoint": silent, "l2_timeout_seconds": 0.5}
    cluster = Cluster(tmp_path, photos_dir, "s3://bucket/p", keys)
    async with cluster.node("a") as a:
        worst = 0.0
        for uuid, path in photos.items():
            started = time.monotonic()
            assert await a.read(uuid) == reference_npy(path, SIZE)
            worst = max(worst, time.monotonic() - started)
        stats = a.stats()
        assert stats["l2_errors"]["timeout"] >= 3 and stats["l2_state"] == "open"
        assert worst < 0.5 + 3.0, worst  # one timeout, plus a decode on a busy machine


async def test_the_breaker_tries_again_after_its_backoff_and_closes(
    tmp_path: Path, photos_dir: Path, photos: dict[str, Path], mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.rate = 1.0
    shared = tmp_path / "not-mounted-yet"
    cluster = Cluster(tmp_path, photos_dir, str(shared), {"l2_retry_seconds": 10})
    uuids = sorted(photos)
    async with cluster.node("a") as a:
        for uuid in uuids[:4]:
            await a.read(uuid)
        # Open after 3 failures in a row (a read's publish, queued meanwhile, may fail too)
        assert a.stats()["l2_state"] == "open" and a.stats()["l2_errors"]["ENOENT"] >= 3
        shared.mkdir()  # L2 is back
        await a.read(uuids[4])
        assert a.stats()["l2_state"] == "open"  # not asked before the backoff has passed
        mock_clock.jump(10)
        await a.read(uuids[5])
        assert a.stats()["l2_state"] == "closed" and a.stats()["l2_breaker_opens"] == 1
        # The array read while the breaker was open may be published too, if its turn
        # in the publish queue comes once the breaker has closed (a slow filesystem).
        await wait_for(lambda: a.stats()["l2_publishes"] >= 1, what="published again")


async def test_a_full_publish_queue_drops_publishes_and_lets_go_of_leases(
    cluster: Cluster, photos: dict[str, Path]
) -> None:
    async with cluster.node("a", l2_publish_queue_bytes=1) as a:
        for uuid, path in photos.items():
            assert await a.read(uuid) == reference_npy(path, SIZE)
        await wait_for(lambda: a.stats()["l2_publish_queue"] == 0, what="leases let go")
        assert a.stats()["l2_publish_dropped"] == len(photos)
        assert a.stats()["l2_publishes"] == 0
    backend = cluster.backend()
    assert not any(claims(backend, name_of(u)) for u in photos)


# -- the breaker alone --------------------------------------------------------------------------


async def test_breaker_opens_after_failures_in_a_row_and_backs_off() -> None:
    now = [0.0]
    changes: list[tuple[str, str]] = []
    breaker = CircuitBreaker(
        lambda: now[0],
        threshold=3,
        first_backoff=1,
        max_backoff=4,
        on_change=lambda a, b, why: changes.append((a, b)),
    )
    breaker.failure("x")
    breaker.success()  # not in a row
    breaker.failure("x")
    breaker.failure("x")
    assert breaker.allow() and breaker.failures == 2
    breaker.failure("x")
    assert str(breaker.state) == "open" and not breaker.allow() and breaker.retry_in == 1
    now[0] = 1.0
    assert breaker.allow() and str(breaker.state) == "half-open"
    assert not breaker.allow()  # one trial at a time
    breaker.failure("y")
    assert str(breaker.state) == "open" and breaker.backoff == 2
    for expected in (4, 4):  # doubles up to max_backoff
        now[0] += breaker.backoff
        assert breaker.allow()
        breaker.failure("y")
        assert breaker.backoff == expected
    now[0] += 4
    assert breaker.allow()
    breaker.abandon()  # a cancelled trial frees the slot
    assert breaker.allow()
    breaker.success()
    assert str(breaker.state) == "closed" and breaker.backoff == 1 and breaker.failures == 0
    assert changes[:3] == [("closed", "open"), ("open", "half-open"), ("half-open", "open")]
    assert changes[-1] == ("half-open", "closed")
    assert breaker.opened == 4


# -- config ----------------------------------------------------------------------------------------


def _parse(tmp_path: Path, **keys: Any) -> Any:
    (tmp_path / "src").mkdir(exist_ok=True)
    raw = {"store": "store", "versions": {"v1": {"source": "src"}}, **keys}
    return parse_config(raw, base_dir=tmp_path)


async def test_l2_keys_have_defaults_and_are_validated(tmp_path: Path) -> None:
    assert _parse(tmp_path).l2 is None
    l2 = _parse(tmp_path, l2="s3://team-bucket/decoded/", l2_endpoint="http://s3:8333").l2
    assert (l2.bucket, l2.prefix, l2.url) == ("team-bucket", "decoded", "s3://team-bucket/decoded")
    assert (l2.timeout_seconds, l2.lease_seconds, l2.retry_seconds, l2.workers) == (5, 10, 1, 8)
    assert l2.publish_queue_bytes == 256 << 20
    posix = _parse(tmp_path, l2="shared/l2", l2_lease_seconds=0).l2
    assert posix.url == str(tmp_path / "shared/l2") and not posix.is_s3
    assert posix.lease_seconds == 0
    config = _parse(tmp_path, l2="s3://abc")
    assert config.as_dict()["l2"]["url"] == "s3://abc"
    assert "l2" not in _parse(tmp_path).as_dict()
    with pytest.raises(ConfigError) as caught:
        _parse(
            tmp_path,
            l2="s3://ab/x",
            l2_endpoint="s3.example.com",
            l2_region="",
            l2_timeout_seconds=0,
            l2_lease_seconds=-1,
            l2_workers=0,
            l2_publish_queue_bytes="lots",
            l2_retry_second=1,
        )
    problems = caught.value.problems
    assert any(p.startswith("l2: 'ab' is not an S3 bucket name") for p in problems)
    assert any(p.startswith("l2_endpoint: expected a URL") for p in problems)
    assert any(p.startswith("l2_region: expected a region name") for p in problems)
    assert "l2_timeout_seconds: must be more than 0" in problems
    assert any(p.startswith("l2_lease_seconds: expected a non-negative number") for p in problems)
    assert "l2_workers: 0 is outside 1..256" in problems
    assert any(p.startswith("l2_publish_queue_bytes:") for p in problems)
    assert "l2_retry_second: unknown key (did you mean 'l2_retry_seconds'?)" in problems
    with pytest.raises(ConfigError) as caught:
        _parse(tmp_path, l2_endpoint="http://s3:8333")
    assert caught.value.problems == ("l2_endpoint: set without l2 (the shared tier it configures)",)
    with pytest.raises(ConfigError) as caught:
        _parse(tmp_path, l2="/data/l2", l2_endpoint="http://s3:8333")
    assert caught.value.problems == ("l2_endpoint: only for an l2 of the form s3://bucket/prefix",)
    with pytest.raises(ConfigError) as caught:
        _parse(tmp_path, l2="gs://bucket/x")
    assert caught.value.problems[0].startswith("l2: 'gs://bucket/x': expected")


async def test_importing_decodefs_needs_neither_boto3_nor_dask() -> None:
    code = (
        "import sys, decodefs, decodefs.daemon.engine, decodefs.cluster.tier\n"
        "import decodefs.daemon.lifecycle, decodefs.cli.commands\n"
        "loaded = [m for m in ('boto3', 'botocore', 'dask', 'distributed') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = await trio.run_process([sys.executable, "-c", code], capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode()


async def test_verify_object_runs_the_local_stores_checks() -> None:
    key = EntryKey("v1", 8, "abc")
    payload = npy_bytes(np.zeros((8, 8, 3), dtype=np.uint8))
    digest = decoder_fingerprint_v1().digest
    good = payload + encode_trailer(key, payload, digest)
    assert verify_object(key, good, digest) == (None, False)
    assert verify_object(EntryKey("v1", 8, "abd"), good, digest)[0] is not None
    assert verify_object(key, good, b"\0" * 16)[0] == "decoded with other settings or libraries"
    wrong_size = EntryKey("v1", 9, "abc")
    assert verify_object(wrong_size, good, digest)[0] is not None
