"""The engine in-process: single flight, the negative cache, fail-open, memory, pins,
verification, fingerprints, a store lost at runtime, warming. A real store in
tmp_path, real decodes; time, where it matters, is trio's MockClock."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing
from PIL import Image

from decodefs.common.decode import DecodeSettings, decode_image
from decodefs.common.npy import npy_bytes, npy_file_size
from decodefs.common.protocol import TRAILER_SIZE
from decodefs.daemon.admission import UserBusy
from decodefs.daemon.engine import OriginalNotFound, OriginalUndecodable
from tests.conftest import DaemonFactory, Tmpfs, needs_root
from tests.helpers import reference_npy, wait_for

SIZE = 64
ENTRY = npy_file_size(SIZE) + TRAILER_SIZE  # bytes of one stored entry
GRANT = 2 * npy_file_size(SIZE)  # what one decode takes from the memory budget
ARRAY = npy_file_size(SIZE)  # what one array in memory keeps of it


def uuids_of(originals: Path) -> list[str]:
    return sorted(p.stem for p in originals.iterdir())


def original(originals: Path, uuid: str) -> Path:
    return next(originals.glob(f"{uuid}.*"))


# -- single flight --------------------------------------------------------------------


async def test_concurrent_cold_opens_of_one_key_decode_once(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals})
    uuid = "chelsea-444"
    got: list[bytes] = []

    async def reader() -> None:
        got.append(await d.array("v1", SIZE, uuid))

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(reader)
    assert got == [reference_npy(original(originals, uuid), SIZE)] * 8
    stats = d.stats()
    assert stats["decodes"] == 1
    assert stats["coalesced"] == 7
    assert stats["misses"] == 8 and stats["hits"] == 0
    assert stats["store_entries"] == 1

    async with trio.open_nursery() as nursery:  # now stored: hits, no decode
        for _ in range(4):
            nursery.start_soon(reader)
    stats = d.stats()
    assert stats["decodes"] == 1 and stats["hits"] == 4 and stats["coalesced"] == 7


class DecodeWatch(trio.abc.Instrument):
    """The decode pool's counters after every task step (they change on the trio thread)."""

    def __init__(self, d: object) -> None:
        self.metrics = d.engine.metrics  # type: ignore[attr-defined]
        self.running: set[int] = set()
        self.queued: set[int] = set()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.running.add(self.metrics.inflight_decodes)
        self.queued.add(self.metrics.queued_decodes)


async def test_opens_of_different_keys_do_not_coalesce_and_share_a_bounded_pool(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals}, decode_workers=2)
    uuids = uuids_of(originals)[:4]
    got: dict[tuple[str, int], bytes] = {}
    watch = DecodeWatch(d)

    async def reader(uuid: str, size: int) -> None:
        got[uuid, size] = await d.array("v1", size, uuid)

    trio.lowlevel.add_instrument(watch)
    try:
        async with trio.open_nursery() as nursery:
            for uuid in uuids:
                for size in (SIZE, SIZE + 1):
                    nursery.start_soon(reader, uuid, size)
    finally:
        trio.lowlevel.remove_instrument(watch)
    for (uuid, size), data in got.items():
        assert data == reference_npy(original(originals, uuid), size)
    stats = d.stats()
    assert stats["decodes"] == stats["misses"] == 8 and stats["coalesced"] == 0
    # Two decodes at a time, the rest queued; both counters back to zero.
    assert watch.running == {0, 1, 2} and max(watch.queued) >= 1 and min(watch.queued) == 0
    assert stats["inflight_decodes"] == stats["queued_decodes"] == 0


async def test_opens_cancelled_while_queued_give_everything_back(
    daemons: DaemonFactory, large: list[Path]
) -> None:
    originals = large[0].parents[1]  # ~7 MP JPEGs: a decode lasts long enough to queue behind
    d = daemons({"v1": originals}, decode_workers=1)
    uuids = sorted(p.stem for p in large)
    async with trio.open_nursery() as nursery:
        for uuid in uuids:
            nursery.start_soon(d.array, "v1", SIZE, uuid)
        await wait_for(lambda: d.stats()["queued_decodes"] >= 3, what="opens queued")
        nursery.cancel_scope.cancel()  # as when the kernel interrupts the requests
    stats = d.stats()
    assert stats["queued_decodes"] == stats["inflight_decodes"] == 0
    assert d.engine.memory.used == 0 and d.engine.memory.waiting == 0
    assert not any(d.store.capacity.pinned(d.key("v1", SIZE, u)) for u in uuids)
    for path in large[:2]:  # and nothing is stuck: each opens as usual
        assert await d.array("v1", SIZE, path.stem) == reference_npy(path, SIZE)


async def test_stats_report_every_figure(daemons: DaemonFactory, originals: Path) -> None:
    d = daemons({"v1": originals}, max_store_bytes="1M", memory_cache_bytes="2M")
    uuid = uuids_of(originals)[0]
    await d.array("v1", SIZE, uuid)
    await d.array("v1", SIZE, uuid)
    d.store.wait_for_usage()  # the catalog's fill scan runs in the background
    stats = d.stats()
    assert set(stats) == {
        "hits", "misses", "decodes", "decode_errors", "coalesced", "claim_waits",
        "corrupt_entries",
        "store_bytes", "store_entries", "store_usage_complete", "store_writable",
        "store_max_bytes", "evictions", "store_write_errors", "memory_fallbacks",
        "memory_cache_bytes", "memory_cache_entries", "memory_bytes", "memory_limit_bytes",
        "memory_waits", "memory_refills", "decode_memory_bytes", "decode_memory_limit_bytes",
        "decode_memory_waits", "unlisted_not_stored", "bytes_served", "inflight_decodes",
        "queued_decodes",
        "background_decodes", "warm_decodes", "warm_not_stored", "direct_hits", "errors",
        "store_reads_inline", "store_reads_threaded", "page_drops",
        "decode_seconds", "uptime_seconds", "versions", "store_by_size", "failed_originals",
        "failed_not_listed",
    }  # fmt: skip
    assert stats["store_usage_complete"] is True and stats["store_writable"] is True
    assert stats["store_max_bytes"] == 1 << 20 and stats["memory_limit_bytes"] == 2 << 20
    assert stats["hits"] == stats["misses"] == stats["decodes"] == 1
    assert stats["bytes_served"] == 2 * npy_file_size(SIZE)
    assert stats["decode_seconds"]["count"] == 1 and stats["decode_seconds"]["sum"] > 0
    assert stats["decode_seconds"]["buckets"]["+Inf"] == 1
    assert 0 <= stats["uptime_seconds"] < 600 and stats["errors"] == {}
    version = stats["versions"]["v1"]
    assert version["originals"] == len(uuids_of(originals))
    assert version["duplicates_left_out"] == version["symlinks_outside_source"] == 0
    assert version["fingerprint"]["settings"]["resample"] == "bilinear"


async def test_verifying_one_entry_never_vouches_for_another(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    # Enough originals that their verified bits span several bytes.
    source = tmp_path / "many"
    source.mkdir()
    rng = np.random.default_rng(5)
    for i in range(40):
        pixels = rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(source / f"m{i:02d}.png")
    uuids = sorted(p.stem for p in source.iterdir())
    first = daemons({"v1": source})
    for uuid in uuids:
        await first.array("v1", 16, uuid)
    first.close()
    for uuid in uuids:  # every stored entry damaged
        flip(first.entry_path("v1", 16, uuid), 200)
    d = daemons({"v1": source})
    for uuid in reversed(uuids):  # each open checks its own entry, whatever came before
        assert await d.array("v1", 16, uuid) == reference_npy(source / f"{uuid}.png", 16), uuid
    assert d.stats()["corrupt_entries"] == len(uuids)


async def test_an_entry_larger_than_a_read_piece_verifies_whole(
    daemons: DaemonFactory, originals: Path
) -> None:
    # 704 x 704 x 3 is past the 1 MiB pieces the check reads a file in.
    big = 704
    uuid = "hubble-original"
    first = daemons({"v1": originals})
    want = await first.array("v1", big, uuid)
    assert want == reference_npy(original(originals, uuid), big)
    first.close()
    d = daemons({"v1": originals})  # verified afresh in a new life: intact, a hit
    assert await d.array("v1", big, uuid) == want
    assert d.stats()["hits"] == 1 and d.stats()["corrupt_entries"] == d.stats()["decodes"] == 0
    d.close()
    flip(d.entry_path("v1", big, uuid), len(want) - 5)  # a bit in its last piece
    again = daemons({"v1": originals})
    assert await again.array("v1", big, uuid) == want
    assert again.stats()["corrupt_entries"] == 1


# -- the negative cache ----------------------------------------------------------------


async def test_a_bad_original_is_answered_from_the_negative_cache_until_it_expires(
    daemons: DaemonFactory, originals: Path, autojump_clock: trio.testing.MockClock
) -> None:
    broken = originals / "broken.jpg"
    broken.write_bytes(b"not yet an image")
    d = daemons({"v1": originals}, error_cache_seconds=10)

    with pytest.raises(OriginalUndecodable, match=r"broken\.jpg"):
        await d.open("v1", SIZE, "broken")
    assert d.stats()["decodes"] == d.stats()["decode_errors"] == 1

    shutil.copyfile(original(originals, "astronaut-baseline"), broken)  # fixed on disk
    await trio.sleep(9.9)
    with pytest.raises(OriginalUndecodable):  # still cached: no decode is tried
        await d.open("v1", SIZE, "broken")
    stats = d.stats()
    assert stats["decodes"] == 1 and stats["errors"]["EIO"] == 2

    await trio.sleep(0.2)  # past error_cache_seconds: tried again
    assert await d.array("v1", SIZE, "broken") == reference_npy(broken, SIZE)
    stats = d.stats()
    assert stats["decodes"] == 2 and stats["decode_errors"] == 1 and stats["misses"] == 1


async def test_a_failure_is_cached_per_key(
    daemons: DaemonFactory, originals: Path, autojump_clock: trio.testing.MockClock
) -> None:
    (originals / "broken.jpg").write_bytes(b"")
    d = daemons({"v1": originals}, error_cache_seconds=10)
    for size in (SIZE, SIZE + 1):
        with pytest.raises(OriginalUndecodable):
            await d.open("v1", size, "broken")
    assert d.stats()["decodes"] == 2  # another size is another key
    assert await d.array("v1", SIZE, "chelsea-444") == reference_npy(
        original(originals, "chelsea-444"), SIZE
    )


async def test_max_pixels_refuses_larger_originals(daemons: DaemonFactory, originals: Path) -> None:
    d = daemons({"v1": originals}, max_pixels=140_000)
    with pytest.raises(OriginalUndecodable, match="decompression bomb"):
        await d.open("v1", SIZE, "astronaut-baseline")  # 512 x 512
    assert await d.array("v1", SIZE, "chelsea-444") == reference_npy(  # 451 x 300
        original(originals, "chelsea-444"), SIZE
    )
    assert d.stats()["decode_errors"] == 1


async def test_an_original_deleted_after_the_scan_is_not_found(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals})
    original(originals, "coffee-webp").unlink()
    with pytest.raises(OriginalNotFound):
        await d.open("v1", SIZE, "coffee-webp")
    stats = d.stats()
    assert stats["errors"]["ENOENT"] == 1 and stats["decodes"] == 0
    assert d.engine.store.capacity.pinned(d.key("v1", SIZE, "coffee-webp")) is False


# -- fail open: a store that refuses -----------------------------------------------------


async def test_a_store_below_one_entry_serves_from_memory_and_counts_it(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals}, max_store_bytes=ENTRY - 1)
    uuids = uuids_of(originals)[:3]
    for uuid in uuids:
        assert await d.array("v1", SIZE, uuid) == reference_npy(original(originals, uuid), SIZE)
    stats = d.stats()
    assert stats["memory_fallbacks"] == stats["store_write_errors"] == 3
    assert stats["errors"]["store_ENOSPC"] == 3
    assert stats["store_entries"] == 0 and not list(Path(d.store.root).glob("v1/*/*/*.npy"))
    assert stats["memory_cache_entries"] == 3 and stats["memory_bytes"] == 3 * ARRAY

    for uuid in uuids:  # held in memory: hits, no decode
        assert await d.array("v1", SIZE, uuid) == reference_npy(original(originals, uuid), SIZE)
    stats = d.stats()
    assert stats["hits"] == 3 and stats["decodes"] == 3 and stats["memory_fallbacks"] == 3


@needs_root
async def test_a_full_store_serves_from_memory_and_counts_it(
    daemons: DaemonFactory, originals: Path, tmpfs: Tmpfs
) -> None:
    full = tmpfs("512k")
    d = daemons({"v1": originals}, store=full / "store")
    fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # take whatever room the store had left
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    uuids = uuids_of(originals)[:3]
    for uuid in uuids:
        assert await d.array("v1", SIZE, uuid) == reference_npy(original(originals, uuid), SIZE)
    stats = d.stats()
    assert stats["memory_fallbacks"] == stats["store_write_errors"] == 3
    assert stats["errors"]["store_ENOSPC"] == 3 and stats["store_entries"] == 0
    assert os.listdir(full / "store" / ".tmp") == []  # no torn temp file left


# -- the memory budget -------------------------------------------------------------------


class MemoryWatch(trio.abc.Instrument):
    """Checks the budget after every step of every task: the engine changes it only
    on the trio thread, so no moment is missed."""

    def __init__(self, d: object) -> None:
        self.memory = d.engine.memory  # type: ignore[attr-defined]
        self.peak = 0
        self.over: list[int] = []

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        used = self.memory.used
        self.peak = max(self.peak, used)
        if used > self.memory.limit:
            self.over.append(used)


@pytest.mark.parametrize("store_takes_them", [True, False])
async def test_cold_opens_wait_for_memory_instead_of_exceeding_the_budget(
    daemons: DaemonFactory, originals: Path, store_takes_them: bool
) -> None:
    d = daemons(
        {"v1": originals},
        memory_cache_bytes=2 * GRANT,  # two arrays in memory at a time
        **({} if store_takes_them else {"max_store_bytes": ENTRY - 1}),
    )
    uuids = uuids_of(originals)
    watch = MemoryWatch(d)
    got: dict[str, bytes] = {}

    async def reader(uuid: str) -> None:
        got[uuid] = await d.array("v1", SIZE, uuid)

    trio.lowlevel.add_instrument(watch)
    try:
        async with trio.open_nursery() as nursery:
            for uuid in uuids:
                nursery.start_soon(reader, uuid)
    finally:
        trio.lowlevel.remove_instrument(watch)
    assert watch.over == [] and 0 < watch.peak <= 2 * GRANT
    for uuid in uuids:
        assert got[uuid] == reference_npy(original(originals, uuid), SIZE), uuid
    stats = d.stats()
    # Arrays the store refused are dropped for newer ones while their readers wait to
    # read (four fit), and fetched again: that, not waiting on open files, is the cost.
    assert len(uuids) <= stats["decodes"] <= len(uuids) + stats["memory_refills"]
    assert stats["memory_refills"] == 0 or not store_takes_them
    # Every byte comes back: what is left is what the memory cache holds.
    assert d.engine.memory.used == stats["memory_cache_bytes"] == stats["memory_bytes"]
    assert (d.engine.memory.used == 0) == store_takes_them
    assert d.engine.memory.waiting == 0


async def test_open_files_hold_no_memory_so_an_open_never_waits_on_them(
    daemons: DaemonFactory, originals: Path
) -> None:
    # The store takes nothing and the budget fits one array. Files held open must not
    # keep their arrays' memory (a reader holding them while opening one more would
    # wait for its own close, and everyone's decodes behind it): the second open
    # reclaims the first array, and a read of the first fetches it again.
    d = daemons({"v1": originals}, memory_cache_bytes=ARRAY, max_store_bytes=ENTRY - 1)
    first, second = uuids_of(originals)[:2]
    held = await d.open("v1", SIZE, first)
    with trio.fail_after(30):
        other = await d.open("v1", SIZE, second)
    stats = d.stats()
    assert stats["memory_waits"] == 0 and stats["decodes"] == 2
    assert stats["memory_cache_entries"] == 1 and d.engine.memory.used == ARRAY
    assert await d.read_all(held) == reference_npy(original(originals, first), SIZE)
    assert d.stats()["memory_refills"] == 1 and d.stats()["decodes"] == 3
    assert await d.read_all(other) == reference_npy(original(originals, second), SIZE)
    assert d.stats()["memory_refills"] == 2 and d.stats()["decodes"] == 4
    d.engine.release(held)
    d.engine.release(other)
    assert d.engine.memory.used == ARRAY and d.engine.memory.waiting == 0
    assert not d.engine.store.capacity.pinned(d.key("v1", SIZE, first))


async def test_one_other_user_may_have_only_so_many_requests_waiting_for_decodes(
    daemons: DaemonFactory, originals: Path
) -> None:
    # Each waiting request holds one of the daemon's request tasks; past its share, a
    # user's next cold open is answered EAGAIN at once, and nobody else is affected.
    d = daemons({"v1": originals})
    d.engine.admission.per_user = 2
    hostile, other = 60001, 60002
    first, second, third, fourth = uuids_of(originals)[:4]
    blocker = await d.engine.decode_memory.acquire(d.engine.decode_memory.limit)
    got: dict[str, bytes] = {}

    async def read(uuid: str, uid: int | None) -> None:
        index = d.index("v1", uuid)
        handle = await d.engine.open("v1", SIZE, index, uid=uid)
        try:
            got[uuid] = await d.read_all(handle)
        finally:
            d.engine.release(handle)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, first, hostile)
        nursery.start_soon(read, second, hostile)
        await wait_for(lambda: d.engine.decode_memory.waiting == 2, what="two waiting decodes")
        # Refused at once: a third admitted would wait for the blocked decodes until
        # the test's timeout, so this says so by name instead.
        with trio.fail_after(10), pytest.raises(UserBusy):
            await d.engine.open("v1", SIZE, d.index("v1", third), uid=hostile)
        assert d.stats()["errors"]["EAGAIN"] == 1
        nursery.start_soon(read, third, other)  # another user still waits its turn
        nursery.start_soon(read, fourth, None)  # and so does the daemon's own
        await wait_for(lambda: d.engine.decode_memory.waiting == 4, what="all four waiting")
        d.engine.decode_memory.release(blocker)
    for uuid in (first, second, third, fourth):
        assert got[uuid] == reference_npy(original(originals, uuid), SIZE), uuid
    with trio.fail_after(30):  # the share was given back: the hostile user may ask again
        await read(fourth, hostile)
    assert got[fourth] == reference_npy(original(originals, fourth), SIZE)
    assert not any(
        d.engine.store.capacity.pinned(d.key("v1", SIZE, u)) for u in (first, second, third)
    )


async def test_a_refill_the_store_now_takes_is_read_from_the_store(
    daemons: DaemonFactory, originals: Path
) -> None:
    # Full when opened, room again when read (a reader freed space): the dropped array
    # is fetched again, stored this time, and the handle reads the file.
    d = daemons({"v1": originals}, memory_cache_bytes=ARRAY, max_store_bytes=ENTRY - 1)
    uuid = uuids_of(originals)[0]
    handle = await d.open("v1", SIZE, uuid)
    d.engine.store.capacity.max_bytes = 10 * ENTRY
    d.engine.memory_cache.discard(handle.memory_key)
    assert await d.read_all(handle) == reference_npy(original(originals, uuid), SIZE)
    assert d.entry_path("v1", SIZE, uuid).exists() and not handle.in_memory
    assert d.stats()["memory_refills"] == 1 and d.engine.memory.used == 0
    d.engine.release(handle)


async def test_an_array_bigger_than_one_cached_reclaims_all_it_needs(
    daemons: DaemonFactory, originals: Path
) -> None:
    # The store takes nothing; the budget holds two size-64 arrays, and a size-128
    # array needs all of it: both cached ones must go.
    d = daemons({"v1": originals}, memory_cache_bytes=2 * GRANT, max_store_bytes=ENTRY - 1)
    first, second, big = uuids_of(originals)[:3]
    for uuid in (first, second):
        await d.array("v1", SIZE, uuid)
    assert d.stats()["memory_cache_entries"] == 2 and d.engine.memory.used == 2 * ARRAY
    with trio.fail_after(30):  # not waiting for a release that will never come
        data = await d.array("v1", 128, big)
    assert data == reference_npy(original(originals, big), 128)
    assert d.stats()["memory_cache_entries"] == 1
    assert d.engine.memory.used == npy_file_size(128)  # what it took beyond that came back


# -- capacity: pins and eviction ---------------------------------------------------------


async def test_an_open_handle_pins_its_entry_against_eviction(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals}, max_store_bytes=3 * ENTRY)
    pinned, *others = uuids_of(originals)
    handle = await d.open("v1", SIZE, pinned)  # the oldest entry from now on
    for uuid in others[:5]:  # each miss past three entries evicts the oldest unpinned one
        await d.array("v1", SIZE, uuid)
        assert d.entry_path("v1", SIZE, pinned).exists(), uuid
        assert d.stats()["store_bytes"] <= 3 * ENTRY
    assert d.stats()["evictions"] == 3
    assert await d.read_all(handle) == reference_npy(original(originals, pinned), SIZE)
    assert d.stats()["decodes"] == 6  # the pinned one was never decoded again
    d.engine.release(handle)

    await d.array("v1", SIZE, others[5])
    assert not d.entry_path("v1", SIZE, pinned).exists()  # unpinned, and oldest: gone
    assert d.stats()["evictions"] == 4
    before = d.stats()
    assert await d.array("v1", SIZE, pinned) == reference_npy(original(originals, pinned), SIZE)
    stats = d.stats()  # evicted, so no longer verified: a miss, decoded and stored again
    assert stats["decodes"] == 8 and stats["misses"] == before["misses"] + 1
    assert stats["hits"] == before["hits"] and d.entry_path("v1", SIZE, pinned).exists()


async def test_a_pin_lasts_until_the_last_handle_is_released(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals}, max_store_bytes=2 * ENTRY)
    held, *others = uuids_of(originals)
    first = await d.open("v1", SIZE, held)
    second = await d.open("v1", SIZE, held)  # another reader of the same file
    d.engine.release(first)
    for uuid in others[:3]:  # each evicts the oldest unpinned entry
        await d.array("v1", SIZE, uuid)
        assert d.entry_path("v1", SIZE, held).exists(), uuid
    assert await d.read_all(second) == reference_npy(original(originals, held), SIZE)
    d.engine.release(second)
    await d.array("v1", SIZE, others[3])
    assert not d.entry_path("v1", SIZE, held).exists()


async def test_hits_keep_an_entry_from_eviction(daemons: DaemonFactory, originals: Path) -> None:
    now = [1000.0]
    d = daemons({"v1": originals}, max_store_bytes=3 * ENTRY, store_clock=lambda: now[0])
    a, b, c, e = uuids_of(originals)[:4]
    for uuid in (a, b, c):
        now[0] += 1
        await d.array("v1", SIZE, uuid)
    now[0] += 1
    await d.array("v1", SIZE, a)  # a hit: a is now the most recent
    now[0] += 1
    await d.array("v1", SIZE, e)
    assert {p.stem for p in Path(d.store.root).glob("v1/*/*/*.npy")} == {a, c, e}


@pytest.mark.parametrize("limit", [3 * ENTRY, 3 * ENTRY - 1])
async def test_the_limit_holds_to_the_byte(
    daemons: DaemonFactory, originals: Path, limit: int
) -> None:
    d = daemons({"v1": originals}, max_store_bytes=limit)
    for uuid in uuids_of(originals):
        await d.array("v1", SIZE, uuid)
        on_disk = sum(p.stat().st_size for p in Path(d.store.root).glob("v1/*/*/*.npy"))
        assert on_disk == d.stats()["store_bytes"] <= limit
    fits = limit // ENTRY
    stats = d.stats()
    assert stats["store_entries"] == fits  # evicted just enough, not more
    assert stats["evictions"] == len(uuids_of(originals)) - fits
    assert stats["store_write_errors"] == 0


async def test_concurrent_misses_stay_within_the_limit_together(
    daemons: DaemonFactory, originals: Path
) -> None:
    # Each writer reserves its room first, so writers in threads at once do not
    # each find the same free space.
    d = daemons({"v1": originals}, max_store_bytes=3 * ENTRY, decode_workers=4)
    got: dict[tuple[str, int], bytes] = {}

    async def reader(uuid: str, size: int) -> None:
        got[uuid, size] = await d.array("v1", size, uuid)

    async with trio.open_nursery() as nursery:
        for uuid in uuids_of(originals):
            nursery.start_soon(reader, uuid, SIZE)
    for (uuid, size), data in got.items():
        assert data == reference_npy(original(originals, uuid), size)
    stats = d.stats()
    on_disk = sum(p.stat().st_size for p in Path(d.store.root).glob("v1/*/*/*.npy"))
    assert on_disk == stats["store_bytes"] <= 3 * ENTRY
    assert stats["store_entries"] + stats["evictions"] + stats["store_write_errors"] == len(got)


# -- verification and rebuild ------------------------------------------------------------


def flip(path: Path, offset: int, bit: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))


async def test_damaged_entries_are_found_on_first_open_rebuilt_and_never_served(
    daemons: DaemonFactory, originals: Path
) -> None:
    first = daemons({"v1": originals})
    uuids = uuids_of(originals)
    for uuid in uuids:
        await first.array("v1", SIZE, uuid)
    first.close()

    def entry(uuid: str) -> Path:
        return first.entry_path("v1", SIZE, uuid)

    flipped, truncated, trailerless, swapped, emptied = uuids[:5]
    flip(entry(flipped), 128 + 1000, 0x10)  # one payload bit
    entry(truncated).write_bytes(entry(truncated).read_bytes()[: ENTRY // 2])
    entry(trailerless).write_bytes(entry(trailerless).read_bytes()[:-TRAILER_SIZE])
    shutil.copyfile(entry(uuids[-1]), entry(swapped))  # another key's intact entry
    entry(emptied).write_bytes(b"")

    d = daemons({"v1": originals})  # the next daemon life
    for uuid in uuids:
        assert await d.array("v1", SIZE, uuid) == reference_npy(original(originals, uuid), SIZE)
    stats = d.stats()
    assert stats["corrupt_entries"] == 5 and stats["decodes"] == 5
    assert stats["hits"] == len(uuids) - 5 and stats["misses"] == 5
    for uuid in uuids[:5]:  # rebuilt on disk too
        assert entry(uuid).read_bytes()[:-TRAILER_SIZE] == reference_npy(
            original(originals, uuid), SIZE
        )


async def test_an_intact_entry_of_another_layout_is_rebuilt_never_served(
    daemons: DaemonFactory, originals: Path
) -> None:
    """A valid trailer and checksum around a payload that is not this size's uint8
    .npy: only the layout check stands between it and a reader."""
    uuid = "camera-gray"
    first = daemons({"v1": originals})
    forged = bytearray(npy_bytes(np.zeros((SIZE, SIZE, 3), np.uint8)))
    at = forged.index(b"|u1")
    forged[at : at + 3] = b"|i1"
    first.store.write(first.key("v1", SIZE, uuid), bytes(forged))
    first.close()
    d = daemons({"v1": originals})
    assert await d.array("v1", SIZE, uuid) == reference_npy(original(originals, uuid), SIZE)
    assert d.stats()["corrupt_entries"] == 1 and d.stats()["decodes"] == 1


async def test_a_recheck_verifies_an_entry_verified_earlier(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals})
    uuid = "rocket-cmyk"
    want = reference_npy(original(originals, uuid), SIZE)
    assert await d.array("v1", SIZE, uuid) == want  # stored and verified in this life
    assert await d.array("v1", SIZE, uuid) == want
    flip(d.entry_path("v1", SIZE, uuid), 200)
    assert await d.array("v1", SIZE, uuid, recheck=True) == want
    stats = d.stats()
    assert stats["corrupt_entries"] == 1 and stats["decodes"] == 2
    assert d.entry_path("v1", SIZE, uuid).read_bytes()[:-TRAILER_SIZE] == want
    assert await d.array("v1", SIZE, uuid, recheck=True) == want  # intact: a plain hit
    assert d.stats()["corrupt_entries"] == 1 and d.stats()["decodes"] == 2


# -- decode settings: the fingerprint ------------------------------------------------------


async def test_entries_of_other_decode_settings_are_discarded_and_never_served(
    daemons: DaemonFactory, originals: Path
) -> None:
    uuids = uuids_of(originals)[:3]
    first = daemons({"v1": originals})
    for uuid in uuids:
        await first.array("v1", SIZE, uuid)
    first.close()

    nearest = daemons({"v1": originals}, version_keys={"resample": "nearest"})
    # Discarded when the store opens, before anything is read: not found corrupt later.
    assert nearest.stats()["store_entries"] == 0
    assert not list(Path(nearest.store.root).glob("v1/*/*/*.npy"))
    settings = DecodeSettings(resample="nearest")
    for uuid in uuids:
        data = await nearest.array("v1", SIZE, uuid)
        assert data == npy_bytes(decode_image(original(originals, uuid), SIZE, settings))
        assert data != reference_npy(original(originals, uuid), SIZE)
    stats = nearest.stats()
    assert stats["decodes"] == 3 and stats["hits"] == 0 and stats["corrupt_entries"] == 0


async def test_an_entry_with_another_fingerprint_in_its_trailer_is_rebuilt(
    daemons: DaemonFactory, originals: Path
) -> None:
    """The version's marker lost, so nothing was discarded: each entry's own trailer
    still keeps an old array from being served as new."""
    uuid = "coffee-progressive"
    first = daemons({"v1": originals})
    await first.array("v1", SIZE, uuid)
    first.close()
    (Path(first.store.root) / "v1" / ".fingerprint.json").unlink()
    other = daemons({"v1": originals}, version_keys={"fit": "crop"})
    # Without its marker nothing says what the old entries were: they stay until read.
    assert other.entry_path("v1", SIZE, uuid).exists()
    data = await other.array("v1", SIZE, uuid)
    assert data == npy_bytes(
        decode_image(original(originals, uuid), SIZE, DecodeSettings(fit="crop"))
    )
    assert other.stats()["corrupt_entries"] == 1 and other.stats()["decodes"] == 1


# -- a store removed at runtime -------------------------------------------------------------


async def test_a_store_removed_at_runtime_fails_open_and_is_used_again_once_made(
    daemons: DaemonFactory, originals: Path, tmp_path: Path
) -> None:
    parent = tmp_path / "flash"
    d = daemons({"v1": originals}, store=parent / "store")
    stored, fresh, later = uuids_of(originals)[:3]
    await d.array("v1", SIZE, stored)
    assert d.stats()["store_entries"] == 1

    shutil.rmtree(parent)
    parent.write_bytes(b"")  # and nothing can make it again yet
    await d.engine.upkeep.check_store()
    stats = d.stats()
    assert stats["store_writable"] is False
    assert stats["store_entries"] == stats["store_bytes"] == 0
    for uuid in (stored, fresh):  # both decoded (again), served from memory
        assert await d.array("v1", SIZE, uuid) == reference_npy(original(originals, uuid), SIZE)
    stats = d.stats()
    assert stats["decodes"] == 3 and stats["memory_fallbacks"] == 2
    assert stats["store_write_errors"] == 2 and stats["errors"]["store_EROFS"] == 2

    parent.unlink()
    await d.engine.upkeep.check_store()  # made again, empty
    stats = d.stats()
    assert stats["store_writable"] is True and stats["store_entries"] == 0
    assert await d.array("v1", SIZE, later) == reference_npy(original(originals, later), SIZE)
    assert d.entry_path("v1", SIZE, later).exists()
    assert d.stats()["store_entries"] == 1 and d.stats()["store_bytes"] == ENTRY


async def test_the_store_watch_notices_a_removal_each_interval(
    daemons: DaemonFactory, originals: Path, autojump_clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals})
    uuid = uuids_of(originals)[0]
    await d.array("v1", SIZE, uuid)
    generation = d.store.generation
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.engine.upkeep.watch_store_forever, 5.0)
        await trio.sleep(1)
        shutil.rmtree(d.store.root)
        await trio.sleep(3.9)  # the watch has not looked yet
        assert not os.path.exists(d.store.root) and d.store.generation == generation
        await wait_for(lambda: d.store.generation != generation, what="the watch to notice")
        await wait_for(lambda: d.stats()["store_writable"], what="the store made again")
        assert trio.current_time() >= 5.0
        nursery.cancel_scope.cancel()
    assert os.path.isdir(d.store.root)
    # Nothing verified before is trusted: the entry is gone, so it is decoded again.
    assert await d.array("v1", SIZE, uuid) == reference_npy(original(originals, uuid), SIZE)
    assert d.stats()["decodes"] == 2 and d.entry_path("v1", SIZE, uuid).exists()


# -- the access flush ---------------------------------------------------------------------


def last_access(d: object, uuid: str) -> float:
    path = Path(d.store.root) / ".catalog.sqlite3"  # type: ignore[attr-defined]
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
        row = db.execute(
            "SELECT last_access FROM entries WHERE version = 'v1' AND size = ? AND uuid = ?",
            (SIZE, os.fsencode(uuid)),
        ).fetchone()
    assert row is not None, uuid
    return float(row[0])


async def test_hits_reach_the_catalog_at_the_next_flush(
    daemons: DaemonFactory, originals: Path, autojump_clock: trio.testing.MockClock
) -> None:
    now = [1000.0]  # the store's wall clock, for last-access times
    d = daemons({"v1": originals}, store_clock=lambda: now[0])
    uuid = uuids_of(originals)[0]
    await d.array("v1", SIZE, uuid)  # written at 1000
    now[0] = 2000.0
    await d.array("v1", SIZE, uuid)  # a hit at 2000
    assert last_access(d, uuid) == 1000.0
    # Started after the reads: while a task waits for a worker thread, the mock
    # clock would jump straight to the flush.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.engine.upkeep.flush_accesses_forever, 30.0)
        await trio.sleep(29.9)
        assert last_access(d, uuid) == 1000.0  # not before the interval
        await wait_for(lambda: last_access(d, uuid) == 2000.0, what="the flush")
        assert trio.current_time() >= 30.0
        nursery.cancel_scope.cancel()


# -- warming ------------------------------------------------------------------------------


async def test_a_warm_request_the_store_refuses_still_serves_and_is_counted(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals}, max_store_bytes=ENTRY - 1)
    uuid = uuids_of(originals)[0]
    data = await d.array("v1", SIZE, uuid, warm=True)
    assert data == reference_npy(original(originals, uuid), SIZE)
    stats = d.stats()
    assert stats["warm_not_stored"] == 1 and stats["warm_decodes"] == 1
    assert stats["background_decodes"] == 0 and stats["decodes"] == 1
    assert stats["errors"]["store_EDQUOT"] == 1 and stats["store_write_errors"] == 1
    assert stats["memory_fallbacks"] == 0  # counts reads
    # Kept in memory like any array the store did not take, which the budget may reclaim.
    assert stats["memory_cache_entries"] == 1 and d.engine.memory.used == ARRAY
    assert stats["hits"] == stats["misses"] == 0  # a warm is not a read


async def test_a_warm_request_stores_and_is_no_background_decode(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals})
    uuid = uuids_of(originals)[0]
    handle = await d.open("v1", SIZE, uuid, warm=True)
    d.engine.release(handle)
    stats = d.stats()
    assert stats["warm_decodes"] == 1 and stats["background_decodes"] == 0
    assert stats["warm_not_stored"] == 0 and stats["store_entries"] == 1
    assert await d.array("v1", SIZE, uuid) == reference_npy(original(originals, uuid), SIZE)
    assert d.stats()["hits"] == 1 and d.stats()["decodes"] == 1


async def test_the_background_warm_decodes_configured_versions_only(
    daemons: DaemonFactory, originals: Path, photos_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = daemons(
        {"warmed": originals, "cold": photos_dir},
        sizes=[32, 48],
        overrides={"warmed": {"warm": True}},
    )
    uuids = uuids_of(originals)
    caplog.set_level(logging.INFO, logger="decodefs.daemon.background_warm")
    await d.warm_in_background()
    done = [r.getMessage() for r in caplog.records if "background warm" in r.getMessage()]
    assert [m.split(" in ")[0] for m in done] == [
        f"background warm: warmed/32 done, {len(uuids)} decoded",
        f"background warm: warmed/48 done, {len(uuids)} decoded",
    ]
    stats = d.stats()
    assert stats["background_decodes"] == stats["decodes"] == 2 * len(uuids)
    assert stats["warm_decodes"] == 0 and stats["store_entries"] == 2 * len(uuids)
    assert stats["hits"] == stats["misses"] == 0
    assert not list(Path(d.store.root).glob("cold/*/*/*.npy"))
    for uuid in uuids:
        assert await d.array("warmed", 48, uuid) == reference_npy(original(originals, uuid), 48)
    assert d.stats()["hits"] == len(uuids) and d.stats()["decodes"] == 2 * len(uuids)
    await d.array("cold", 48, uuids[0])
    assert d.stats()["background_decodes"] == 2 * len(uuids)  # a reader's decode is not one


async def test_the_background_warm_stops_rather_than_evict(
    daemons: DaemonFactory, originals: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = daemons(
        {"v1": originals},
        max_store_bytes=3 * ENTRY,
        sizes=[SIZE],
        version_keys={"warm": True},
        decode_workers=2,
    )
    first = uuids_of(originals)[-1]
    await d.array("v1", SIZE, first)  # a reader's entry
    caplog.set_level(logging.INFO, logger="decodefs.daemon.background_warm")
    await d.warm_in_background()
    stats = d.stats()
    assert stats["store_entries"] == 3 and stats["evictions"] == 0
    # Every decode it ran was stored, or refused rather than evict: at most one
    # per warm task (two per decode worker) that checked for room at once.
    refused = stats["errors"]["store_EDQUOT"]
    assert stats["background_decodes"] == 2 + refused and refused <= 4
    assert stats["warm_decodes"] == 0 and stats["memory_cache_entries"] == 0
    assert "background warm of v1/64 stops" in caplog.text
    assert "done" not in caplog.text
    assert d.entry_path("v1", SIZE, first).exists()


async def test_the_background_warm_skips_originals_that_just_failed_and_survives_new_ones(
    daemons: DaemonFactory, originals: Path, autojump_clock: trio.testing.MockClock
) -> None:
    (originals / "broken.jpg").write_bytes(b"not an image")
    (originals / "broken-too.jpg").write_bytes(b"")
    d = daemons({"v1": originals}, sizes=[SIZE], version_keys={"warm": True})
    with pytest.raises(OriginalUndecodable):
        await d.open("v1", SIZE, "broken")  # a reader met it first: cached
    await d.warm_in_background()  # meets the other itself, and goes on
    stats = d.stats()
    good = len(uuids_of(originals)) - 2
    assert stats["decode_errors"] == 2 and stats["decodes"] == good + 2
    assert stats["background_decodes"] == stats["store_entries"] == good


# -- the index cache, as the daemon uses it ---------------------------------------------


async def test_a_second_start_reuses_the_index_and_serves_the_same_arrays(
    daemons: DaemonFactory, originals: Path
) -> None:
    old = os.stat(originals).st_mtime - 60  # trust the directory's mtime
    os.utime(originals, (old, old))
    first = daemons({"v1": originals})
    assert not first.sources["v1"].from_cache
    first.close()
    again = daemons({"v1": originals})
    assert again.sources["v1"].from_cache
    assert list(again.sources["v1"].keys) == uuids_of(originals)
    uuid = uuids_of(originals)[3]
    assert await again.array("v1", SIZE, uuid) == reference_npy(original(originals, uuid), SIZE)
    again.close()
    (originals / "new.png").write_bytes(original(originals, "logo-alpha").read_bytes())
    changed = daemons({"v1": originals})
    assert not changed.sources["v1"].from_cache and "new" in changed.sources["v1"].keys
