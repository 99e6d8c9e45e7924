"""The read path and the page cache, in-process: READs served without a thread hop
(the bytes a verification or a write just had, or resident pages on the event
loop), a worker thread only when the pages are not resident, one page-cache
copy (the daemon drops the entry pages it brought in, never a direct reader's),
opens of stored arrays that need no disk (their first READ verifies), and short
or vanished entries. A real store in tmp_path (ext4 here; a tmpfs cannot read
without waiting, so the tests of residency say so and skip there; one test puts
its store on a tmpfs on purpose, where the daemon cannot look first), real
decodes, the drops' delays on trio's MockClock."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from decodefs.common.entry import EntryKey
from decodefs.daemon.entry_reads import Pages
from decodefs.store import pagecache
from decodefs.store.pagecache import (
    READ_DROP_DELAY,
    WRITTEN_DROP_DELAY,
    PendingDrops,
    drop,
    open_cached,
    read_resident,
)
from decodefs.store.pagecache import resident as pages_resident
from tests.conftest import DaemonFactory
from tests.helpers import WAIT_SECONDS, reference_npy
from tests.inprocess import InProcess

SIZE = 128
UUID = "chelsea-444"
OTHER = "coffee-webp"
PAGE = os.sysconf("SC_PAGE_SIZE")


def nowait_supported(directory: Path) -> bool:
    """Whether ``directory``'s filesystem answers RWF_NOWAIT reads (ext4, xfs: yes;
    tmpfs: no, and there the page cache is the storage, so nothing is dropped)."""
    probe = directory / ".nowait-probe"
    probe.write_bytes(b"x" * 4096)
    fd = os.open(probe, os.O_RDONLY)
    try:
        read_resident(fd, 0, 1)
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()
    return True


def resident(path: Path) -> bool:
    """Whether any of ``path``'s pages are in the page cache (fincore: mincore(2),
    which, unlike a read, brings nothing in)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(out) > 0


def evict_pages(path: Path) -> None:
    """Push ``path``'s pages out of the page cache (written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        drop(fd)
    finally:
        os.close(fd)
    assert not resident(path), f"{path}: its pages stayed in the page cache"


@pytest.fixture
def on_disk(tmp_path: Path) -> None:
    if not nowait_supported(tmp_path):
        pytest.skip(f"{tmp_path} is a tmpfs: its page cache is the store itself")


@pytest.fixture
def blind_store() -> Iterator[Path]:
    """A store's path on a tmpfs (/dev/shm, so no root is needed): there the daemon
    cannot look whether an entry's pages are resident before it reads them (no
    RWF_NOWAIT reads), and only what an open knows says whose they are."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip(f"{shm} is missing: no tmpfs to put a store on without root")
    base = Path(tempfile.mkdtemp(prefix="decodefs-test-", dir=shm))
    try:
        if nowait_supported(base):
            pytest.skip(f"{shm} answers RWF_NOWAIT reads: a store there can check residency")
        yield base / "store"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def clock() -> trio.testing.MockClock:
    """The engine's clock, moved by hand (the drops' delays)."""
    return trio.testing.MockClock()


async def stored(d: InProcess, *, evict: bool = True) -> Path:
    """Store UUID's array (a miss), let its written pages go (``evict``: a test of the
    page cache; a test of the entry alone runs on a tmpfs too), and give its path."""
    await d.array("v1", SIZE, UUID)
    path = d.entry_path("v1", SIZE, UUID)
    if evict:
        evict_pages(path)
    return path


def fresh(
    daemons: DaemonFactory, originals: Path, d: InProcess, clock: trio.testing.MockClock
) -> InProcess:
    """Another daemon on the same store: nothing verified yet in its life, nothing
    known of its entries. Its drops fall due on ``clock``."""
    d.close()
    return daemons({"v1": originals}, engine_clock=clock.current_time)


def reference(originals: Path) -> bytes:
    return reference_npy(next(originals.glob(f"{UUID}.*")), SIZE)


async def dropper_settled(d: InProcess, drops: int) -> None:
    """Wait until ``drops`` page drops are counted, or until the dropper sleeps without
    them (a later drop's deadline pending, none being dropped). Checkpoints, never
    sleeps: trio's MockClock stands still while a drop's worker thread runs in real
    time, so the time a drop is seen at is the time it was due at."""
    await trio.testing.wait_all_tasks_blocked()  # the dropper took whatever was due
    deadline = time.monotonic() + WAIT_SECONDS
    while (seen := d.stats()["page_drops"]) < drops:
        if trio.lowlevel.current_statistics().seconds_to_next_deadline < math.inf:
            return  # asleep until a drop due later: none is under way
        assert time.monotonic() < deadline, f"waited for {drops} page drops; saw {seen}"
        await trio.lowlevel.checkpoint()


# -- the module's pieces ---------------------------------------------------------------


def test_read_resident_reads_only_what_is_in_the_page_cache(tmp_path: Path, on_disk: None) -> None:
    path = tmp_path / "f"
    data = os.urandom(200_000)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        # On the disk only: it would wait. (A page can come back between the eviction
        # and the read, on a loaded machine: evicted again, a few times at most.)
        for _ in range(20):
            evict_pages(path)
            if read_resident(fd, 0, len(data)) is None:
                break
        else:
            raise AssertionError("read_resident read pages the page cache did not hold")
        assert os.pread(fd, len(data), 0) == data  # read in (a miss starts a readahead too)
        assert read_resident(fd, 0, len(data)) == bytearray(data)
        assert read_resident(fd, 150_000, 100_000) == bytearray(data[150_000:])  # short: the end
        assert read_resident(fd, len(data), 10) == bytearray()
    finally:
        os.close(fd)


def test_resident_counts_every_page_a_range_touches(tmp_path: Path) -> None:
    """No eviction needed: a file's hole is no page in the page cache (nothing reads
    it in), a written page is one."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 3 * PAGE)  # three pages long, all hole: none is resident
        if pages_resident(fd, 0, 1) is None:
            pytest.skip("this kernel has no cachestat(2) (Linux 6.5): resident() cannot say")
        assert pages_resident(fd, 0, 3 * PAGE) is False
        assert pages_resident(fd, 0, 1) is False  # less than a page, none of it resident
        assert pages_resident(fd, PAGE + 10, 100) is False
        os.pwrite(fd, b"x" * PAGE, 0)  # the first page written: in the page cache
        assert pages_resident(fd, 0, PAGE) is True
        assert pages_resident(fd, 10, 100) is True
        assert pages_resident(fd, PAGE, 100) is False  # in the second page: still a hole
        assert pages_resident(fd, 100, PAGE) is False  # the end of the first, the second's start
        assert pages_resident(fd, PAGE - 1, 2) is False  # a byte of each
        assert pages_resident(fd, 0, 3 * PAGE) is False
    finally:
        os.close(fd)


def test_open_cached_stays_beneath_its_directory_and_follows_no_symlink(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f").write_bytes(b"entry")
    (tmp_path / "outside").write_bytes(b"secret")
    (root / "link").symlink_to(root / "a" / "f")
    (root / "a" / "up").symlink_to(tmp_path)
    directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.stat(root / "a" / "f")  # its names are in the caches now
        fd = open_cached(directory, "a/f", os.O_RDONLY)
        assert fd is not None
        assert os.read(fd, 10) == b"entry"
        os.close(fd)
        for relpath in ("link", "a/up/outside", "../outside", "/etc/passwd", "a/missing"):
            assert open_cached(directory, relpath, os.O_RDONLY) is None, relpath
    finally:
        os.close(directory)


def test_pending_drops_fall_due_after_their_delay_each_once() -> None:
    drops: PendingDrops[str] = PendingDrops(read_delay=0.5, written_delay=2.0)
    assert drops.next_due() is None
    drops.add("w", 10.0, written=True)
    assert drops.next_due() == 12.0
    drops.add("r", 11.0, written=False)
    drops.add("r", 11.2, written=False)
    assert drops.next_due() == 11.5
    assert drops.due(11.4) == []
    assert drops.due(11.7) == ["r"]  # once, however often it was added
    assert drops.next_due() == 12.0 and drops.due(11.9) == []
    assert drops.due(12.0) == ["w"] and len(drops) == 0 and drops.next_due() is None


# -- the engine's read path ------------------------------------------------------------


async def test_a_verified_entry_is_read_from_the_checks_bytes_and_its_pages_go_at_once(
    daemons: DaemonFactory, originals: Path, on_disk: None, clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals})
    path = await stored(d)
    d = fresh(daemons, originals, d, clock)
    handle = await d.open("v1", SIZE, UUID)  # verified: its bytes kept for its READs
    assert not resident(path) and d.stats()["page_drops"] == 1  # so its pages are not
    assert await d.read_all(handle) == reference(originals)
    d.engine.release(handle)
    stats = d.stats()
    # The check read the entry once; the READ came from those bytes: no second read.
    assert stats["store_reads_inline"] == 1 and stats["store_reads_threaded"] == 0
    assert stats["hits"] == 1 and stats["decodes"] == 0
    clock.jump(WRITTEN_DROP_DELAY)
    await d.engine.reads.drop_due()
    assert d.stats()["page_drops"] == 1  # nothing left to drop


async def test_resident_pages_are_read_on_the_event_loop(
    daemons: DaemonFactory, originals: Path, on_disk: None, clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals})
    path = await stored(d)
    d = fresh(daemons, originals, d, clock)
    await d.array("v1", SIZE, UUID)  # verified in this life; what that read in is gone
    assert d.stats()["page_drops"] == 1 and not resident(path)
    path.read_bytes()  # a direct reader (read_array) holds its pages
    before = d.stats()["store_reads_inline"]
    assert await d.array("v1", SIZE, UUID) == reference(originals)  # a verified hit
    stats = d.stats()
    assert stats["store_reads_inline"] == before + 1 and stats["store_reads_threaded"] == 0
    clock.jump(WRITTEN_DROP_DELAY)
    await d.engine.reads.drop_due()
    assert resident(path) and d.stats()["page_drops"] == 1  # the direct reader's stay


async def test_pages_not_resident_are_read_in_a_thread_then_dropped(
    daemons: DaemonFactory, originals: Path, on_disk: None, clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals})
    path = await stored(d)
    d = fresh(daemons, originals, d, clock)
    await d.array("v1", SIZE, UUID)  # verified in this life
    evict_pages(path)  # ... and gone from memory, as under memory pressure
    assert await d.array("v1", SIZE, UUID) == reference(originals)
    stats = d.stats()
    assert stats["store_reads_threaded"] == 1 and stats["page_drops"] == 2
    assert not resident(path)  # dropped by the read that brought it in


async def test_a_direct_readers_pages_are_left_in_the_page_cache(
    daemons: DaemonFactory, originals: Path, on_disk: None, clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals})
    path = await stored(d)
    d = fresh(daemons, originals, d, clock)
    path.read_bytes()  # read_array reads the store's file: its pages are someone's
    assert await d.array("v1", SIZE, UUID) == reference(originals)
    clock.jump(WRITTEN_DROP_DELAY)
    await d.engine.reads.drop_due()
    assert d.stats()["page_drops"] == 0 and resident(path)
    second = await d.open("v1", SIZE, UUID)  # a verified hit, read from those pages
    assert await d.read_all(second) == reference(originals)
    d.engine.release(second)
    clock.jump(WRITTEN_DROP_DELAY)
    await d.engine.reads.drop_due()
    assert d.stats()["page_drops"] == 0 and resident(path)


async def test_where_residency_cannot_be_checked_the_open_says_whose_the_pages_are(
    blind_store: Path, daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals}, store=blind_store)
    key = d.key("v1", SIZE, UUID)
    handle = await d.open("v1", SIZE, UUID)  # a miss: this daemon writes the entry
    assert await d.read_all(handle) == reference(originals)  # from the bytes it wrote
    entry = d.store.open_cached(key)  # the event loop's try: a tmpfs cannot answer it
    assert entry is not None
    try:
        with pytest.raises(OSError) as refused:
            pagecache.read_resident(entry, 0, handle.length)
        assert pagecache.nowait_unsupported(refused.value), "the store could look"
    finally:
        os.close(entry)
    # The kernel asks again (its pages of the mount's file went): the entry's pages are
    # the daemon's own, read in a thread and dropped.
    assert await d.read_all(handle) == reference(originals)
    d.engine.release(handle)
    stats = d.stats()
    assert (stats["store_reads_threaded"], stats["page_drops"]) == (1, 1)
    # A verified hit: the pages may be a direct reader's (read_array): read, left alone.
    assert await d.array("v1", SIZE, UUID) == reference(originals)
    stats = d.stats()
    assert (stats["store_reads_threaded"], stats["page_drops"]) == (2, 1)


async def test_a_drop_due_sooner_than_the_one_awaited_wakes_the_dropper(
    daemons: DaemonFactory, originals: Path, autojump_clock: trio.testing.MockClock
) -> None:
    earlier = daemons({"v1": originals})
    await earlier.array("v1", SIZE, OTHER)  # stored by an earlier daemon
    earlier.close()
    d = daemons({"v1": originals})
    await d.array("v1", SIZE, UUID)  # a miss: its written pages are due to go in 2 s
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.engine.reads.drop_forever)
        await trio.testing.wait_all_tasks_blocked()  # asleep until the written pages are due
        # An open that read OTHER's entry in from the disk is released: due in 0.5 s.
        d.engine.reads.release(d.key("v1", SIZE, OTHER), Pages.READ_IN)
        await trio.sleep_until(start + READ_DROP_DELAY + 0.01)
        await dropper_settled(d, drops=1)
        assert d.stats()["page_drops"] == 1, "the pages read in were not dropped at 0.5 s"
        await trio.sleep_until(start + WRITTEN_DROP_DELAY + 0.01)
        await dropper_settled(d, drops=2)
        assert d.stats()["page_drops"] == 2  # and the written ones after theirs
        nursery.cancel_scope.cancel()


async def test_a_written_entry_is_read_from_memory_and_dropped_after_its_writeback(
    daemons: DaemonFactory, originals: Path, on_disk: None, clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals}, engine_clock=clock.current_time)
    assert await d.array("v1", SIZE, UUID) == reference(originals)  # a miss
    stats = d.stats()
    assert stats["decodes"] == 1 and stats["store_reads_inline"] == 1  # not read back
    path = d.entry_path("v1", SIZE, UUID)
    clock.jump(READ_DROP_DELAY)
    await d.engine.reads.drop_due()
    assert d.stats()["page_drops"] == 0  # not yet: written pages drop once written back
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # the writeback, without waiting for the device's own pace
    os.close(fd)
    clock.jump(WRITTEN_DROP_DELAY)
    await d.engine.reads.drop_due()
    assert d.stats()["page_drops"] == 1 and not resident(path)


async def test_a_warm_request_drops_what_it_wrote(
    daemons: DaemonFactory, originals: Path, on_disk: None, clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals}, engine_clock=clock.current_time)
    handle = await d.open("v1", SIZE, UUID, warm=True)  # decodefs warm: never read
    d.engine.release(handle)
    path = d.entry_path("v1", SIZE, UUID)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    clock.jump(WRITTEN_DROP_DELAY)
    await d.engine.reads.drop_due()
    assert d.stats()["page_drops"] == 1 and not resident(path)


async def test_a_stored_array_opens_with_no_disk_and_its_first_read_verifies(
    daemons: DaemonFactory, originals: Path, clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals}, version_keys={"sizes": [SIZE]})
    path = await stored(d, evict=False)  # about the entry, not its pages
    d.close()
    d = daemons({"v1": originals}, version_keys={"sizes": [SIZE]})
    await d.engine.known.note_stored()  # what the catalog says is stored
    data = bytearray(path.read_bytes())
    data[500] ^= 0x04  # damaged after it was written
    path.write_bytes(bytes(data))
    handle = await d.open("v1", SIZE, UUID)
    assert handle.unverified and d.stats()["corrupt_entries"] == 0  # the open checked nothing
    assert await d.read_all(handle) == reference(originals)  # never the damaged bytes
    d.engine.release(handle)
    stats = d.stats()
    assert stats["corrupt_entries"] == 1 and stats["decodes"] == 1  # found by the READ, rebuilt
    # Rebuilt and verified: the next open is a plain hit, and its bytes the right ones.
    handle = await d.open("v1", SIZE, UUID)
    assert not handle.unverified
    assert await d.read_all(handle) == reference(originals)
    d.engine.release(handle)


async def test_an_open_of_a_stored_array_whose_entry_is_gone_reads_it_right(
    daemons: DaemonFactory, originals: Path, clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals}, version_keys={"sizes": [SIZE]})
    path = await stored(d, evict=False)  # about the entry, not its pages
    d.close()
    d = daemons({"v1": originals}, version_keys={"sizes": [SIZE]})
    await d.engine.known.note_stored()
    path.unlink()  # the catalog still says stored
    assert await d.array("v1", SIZE, UUID) == reference(originals)
    assert d.stats()["decodes"] == 1 and path.exists()  # decoded and stored again


async def test_a_short_entry_is_rebuilt_not_served(
    daemons: DaemonFactory, originals: Path, clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals})
    path = await stored(d, evict=False)  # about the entry, not its pages
    d = fresh(daemons, originals, d, clock)
    await d.array("v1", SIZE, UUID)  # verified in this life
    handle = await d.open("v1", SIZE, UUID)
    os.truncate(path, 1000)  # then cut short behind the daemon's back
    assert await d.read_all(handle) == reference(originals)  # never the short bytes
    d.engine.release(handle)
    assert d.stats()["decodes"] == 1  # rebuilt


async def test_an_entry_removed_after_its_open_is_still_read_right(
    daemons: DaemonFactory, originals: Path, clock: trio.testing.MockClock
) -> None:
    d = daemons({"v1": originals})
    path = await stored(d, evict=False)  # about the entry, not its pages
    d = fresh(daemons, originals, d, clock)
    handle = await d.open("v1", SIZE, UUID)  # verified: its bytes are kept for its READs
    path.unlink()
    assert await d.read_all(handle) == reference(originals)
    d.engine.release(handle)
    assert d.stats()["decodes"] == 0
    handle = await d.open("v1", SIZE, UUID)  # a verified hit: nothing kept for it now
    assert await d.read_all(handle) == reference(originals)  # fetched again, no error
    d.engine.release(handle)
    assert d.stats()["decodes"] == 1


async def test_an_array_bigger_than_the_room_for_fresh_bytes_is_read_from_its_file(
    daemons: DaemonFactory, originals: Path, on_disk: None, clock: trio.testing.MockClock
) -> None:
    size = 2048  # 12 MiB: the check reads it in pieces, and keeps none of it
    d = daemons({"v1": originals}, engine_clock=clock.current_time)
    want = reference_npy(next(originals.glob(f"{UUID}.*")), size)
    assert await d.array("v1", size, UUID) == want
    path = d.entry_path("v1", size, UUID)
    evict_pages(path)
    d = fresh(daemons, originals, d, clock)
    handle = await d.open("v1", size, UUID)
    got = bytearray()
    while piece := await d.engine.read(handle, len(got), 1 << 20):  # the kernel's READs
        got += piece
    d.engine.release(handle)
    assert bytes(got) == want
    assert d.stats()["decodes"] == 0 and d.engine.reads.fresh_bytes == 0
    clock.jump(READ_DROP_DELAY)
    await d.engine.reads.drop_due()
    assert not resident(path)
    assert EntryKey("v1", size, UUID).relpath in str(path)
