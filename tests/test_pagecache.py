"""The read path and the page cache, in-process: resident pages served on the event
loop, the worker thread only when they are not, one page-cache copy (the daemon
drops the entry pages it brought in, never a direct reader's), and short or
vanished entries. A real store in tmp_path (ext4 here; on a filesystem that
cannot read without waiting, tmpfs, the inline path does not exist and those
tests say so), real decodes, time on trio's MockClock where it matters."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import trio
import trio.testing

from decodefs.decode import npy_file_size
from decodefs.pagecache import EntryFiles, PendingDrops, drop, is_resident, read_resident
from decodefs.protocol import TRAILER_SIZE
from tests.conftest import DaemonFactory
from tests.helpers import reference_npy
from tests.inprocess import InProcess

SIZE = 128
UUID = "chelsea-444"


def nowait_supported(directory: Path) -> bool:
    """Whether ``directory``'s filesystem answers RWF_NOWAIT reads (ext4, xfs: yes;
    tmpfs: no, and there the page cache is the storage, so nothing is dropped)."""
    probe = directory / ".nowait-probe"
    probe.write_bytes(b"x" * 4096)
    fd = os.open(probe, os.O_RDONLY)
    try:
        return is_resident(fd) is not None
    finally:
        os.close(fd)
        probe.unlink()


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
        pytest.skip(f"{tmp_path} cannot read without waiting (tmpfs): no inline reads there")


async def stored(d: InProcess) -> Path:
    """Store UUID's array (a miss), let its written pages go, and give its entry path."""
    await d.array("v1", SIZE, UUID)
    path = d.entry_path("v1", SIZE, UUID)
    evict_pages(path)
    return path


def fresh(daemons: DaemonFactory, originals: Path, d: InProcess) -> InProcess:
    """Another daemon on the same store: nothing verified yet in its life."""
    d.close()
    return daemons({"v1": originals})


async def read_whole(d: InProcess) -> bytes:
    """open, read, release, as one plain reader of UUID's array."""
    return await d.array("v1", SIZE, UUID)


# -- the module's pieces ---------------------------------------------------------------


def test_read_resident_reads_only_what_is_in_the_page_cache(tmp_path: Path, on_disk: None) -> None:
    path = tmp_path / "f"
    data = os.urandom(200_000)
    path.write_bytes(data)
    evict_pages(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_resident(fd, 0, len(data)) is None  # on the disk only: it would wait
        assert os.pread(fd, len(data), 0) == data  # read in (a miss starts a readahead too)
        assert read_resident(fd, 0, len(data)) == bytearray(data)
        assert read_resident(fd, 150_000, 100_000) == bytearray(data[150_000:])  # short: the end
        assert read_resident(fd, len(data), 10) == bytearray()
    finally:
        os.close(fd)


def test_entry_files_keep_a_bounded_number_open_and_close_what_they_let_go(
    tmp_path: Path,
) -> None:
    paths = []
    for i in range(3):
        paths.append(tmp_path / str(i))
        paths[-1].write_bytes(bytes([i]) * 10)
    files: EntryFiles[str] = EntryFiles(2)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    for i, fd in enumerate(fds):
        files.keep(str(i), fd)
    assert len(files) == 2
    with pytest.raises(OSError) as closed:  # the least recently kept was closed
        os.fstat(fds[0])
    assert closed.value.errno == errno.EBADF
    assert files.read_resident("0", 0, 10) is None
    assert files.read_resident("2", 0, 10) in (None, bytes([2]) * 10)  # tmpfs: None
    again = os.open(paths[2], os.O_RDONLY)
    files.keep("2", again)  # replaces: the older one is closed
    with pytest.raises(OSError):
        os.fstat(fds[2])
    files.discard("1")
    with pytest.raises(OSError):
        os.fstat(fds[1])
    files.clear()
    assert len(files) == 0
    with pytest.raises(OSError):
        os.fstat(again)


def test_pending_drops_are_due_at_once_when_read_and_after_the_delay_when_written() -> None:
    drops: PendingDrops[str] = PendingDrops(written_delay=2.0)
    assert drops.next_due() is None
    drops.add("w", 10.0, written=True)
    assert drops.next_due() == 12.0
    assert drops.due(11.9) == []
    drops.add("r", 11.0, written=False)
    drops.add("r", 11.5, written=False)
    assert drops.next_due() == float("-inf")
    assert drops.due(11.9) == ["r"]  # once, however often it was added
    assert drops.due(12.0) == ["w"] and len(drops) == 0


# -- the engine's read path ------------------------------------------------------------


async def test_first_open_verifies_and_the_read_comes_from_those_pages_inline(
    daemons: DaemonFactory, originals: Path, on_disk: None
) -> None:
    d = daemons({"v1": originals})
    path = await stored(d)
    d = fresh(daemons, originals, d)
    data = await read_whole(d)
    assert data == reference_npy(next(originals.glob(f"{UUID}.*")), SIZE)
    stats = d.stats()
    # The check read the entry once; the read found those pages: no second disk read.
    assert stats["store_reads_inline"] == 1 and stats["store_reads_threaded"] == 0
    assert stats["hits"] == 1 and stats["decodes"] == 0
    await d.engine.drop_due_pages()  # the pages it brought in go once served
    assert stats["page_drops"] == 0 and d.stats()["page_drops"] == 1
    assert not resident(path)


async def test_pages_not_resident_are_read_in_a_thread_then_dropped(
    daemons: DaemonFactory, originals: Path, on_disk: None
) -> None:
    d = daemons({"v1": originals})
    path = await stored(d)
    d = fresh(daemons, originals, d)
    handle = await d.open("v1", SIZE, UUID)  # verified: its pages are in
    evict_pages(path)  # ... and gone again before the read, as under memory pressure
    data = await d.read_all(handle)
    d.engine.release(handle)
    assert data == reference_npy(next(originals.glob(f"{UUID}.*")), SIZE)
    stats = d.stats()
    assert stats["store_reads_inline"] == 0 and stats["store_reads_threaded"] == 1
    assert not resident(path)  # dropped by the read that brought it in


async def test_a_direct_readers_pages_are_left_in_the_page_cache(
    daemons: DaemonFactory, originals: Path, on_disk: None
) -> None:
    d = daemons({"v1": originals})
    path = await stored(d)
    d = fresh(daemons, originals, d)
    path.read_bytes()  # read_array reads the store's file: its pages are someone's
    data = await read_whole(d)
    assert data == reference_npy(next(originals.glob(f"{UUID}.*")), SIZE)
    await d.engine.drop_due_pages()
    assert d.stats()["page_drops"] == 0 and resident(path)
    # A verified hit whose pages are resident: read, and left alone too.
    second = await d.open("v1", SIZE, UUID)
    assert await d.read_all(second) == data
    d.engine.release(second)
    await d.engine.drop_due_pages()
    assert resident(path) and d.stats()["page_drops"] == 0


async def test_a_written_entry_is_read_inline_and_dropped_after_its_writeback(
    daemons: DaemonFactory, originals: Path, on_disk: None
) -> None:
    clock = trio.testing.MockClock()
    d = daemons({"v1": originals}, engine_clock=clock.current_time)
    data = await read_whole(d)  # a miss: decoded, written, read from its pages
    assert data == reference_npy(next(originals.glob(f"{UUID}.*")), SIZE)
    stats = d.stats()
    assert stats["decodes"] == 1 and stats["store_reads_inline"] == 1
    path = d.entry_path("v1", SIZE, UUID)
    await d.engine.drop_due_pages()
    assert d.stats()["page_drops"] == 0  # not yet: written pages drop once written back
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # the writeback, without waiting for the device's own pace
    os.close(fd)
    clock.jump(2.0)
    await d.engine.drop_due_pages()
    assert d.stats()["page_drops"] == 1 and not resident(path)


async def test_a_warm_request_drops_what_it_wrote(
    daemons: DaemonFactory, originals: Path, on_disk: None
) -> None:
    clock = trio.testing.MockClock()
    d = daemons({"v1": originals}, engine_clock=clock.current_time)
    handle = await d.open("v1", SIZE, UUID, warm=True)  # decodefs warm: never read
    d.engine.release(handle)
    path = d.entry_path("v1", SIZE, UUID)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    clock.jump(2.0)
    await d.engine.drop_due_pages()
    assert d.stats()["page_drops"] == 1 and not resident(path)


async def test_a_short_entry_is_rebuilt_not_served(daemons: DaemonFactory, originals: Path) -> None:
    d = daemons({"v1": originals})
    path = await stored(d)
    d = fresh(daemons, originals, d)
    handle = await d.open("v1", SIZE, UUID)  # verified whole, kept open
    os.truncate(path, 1000)  # then cut short behind the daemon's back
    evict_pages(path)
    data = await d.read_all(handle)
    d.engine.release(handle)
    assert data == reference_npy(next(originals.glob(f"{UUID}.*")), SIZE)  # never the short bytes
    assert d.stats()["decodes"] == 1  # rebuilt


async def test_an_entry_removed_after_its_open_is_still_read_right(
    daemons: DaemonFactory, originals: Path
) -> None:
    expected = reference_npy(next(originals.glob(f"{UUID}.*")), SIZE)
    d = daemons({"v1": originals})
    path = await stored(d)
    d = fresh(daemons, originals, d)
    handle = await d.open("v1", SIZE, UUID)
    path.unlink()  # a kept entry: its verified bytes are still there to read
    assert await d.read_all(handle) == expected
    d.engine.release(handle)
    d = fresh(daemons, originals, d)  # now nothing is kept open: the read finds no file
    await d.array("v1", SIZE, UUID)
    handle = await d.open("v1", SIZE, UUID)
    d.store.close_kept(handle.key)
    d.entry_path("v1", SIZE, UUID).unlink()
    assert await d.read_all(handle) == expected  # fetched again, never an error
    d.engine.release(handle)
    assert d.stats()["decodes"] == 2


async def test_an_evicted_entry_closes_its_kept_descriptor_first(
    daemons: DaemonFactory, originals: Path
) -> None:
    # Room for one entry: each miss evicts the last. A kept descriptor must not keep
    # an evicted entry's blocks on the disk (the limit counts what the disk holds).
    d = daemons({"v1": originals}, max_store_bytes=npy_file_size(SIZE) + TRAILER_SIZE)
    uuids = sorted(p.stem for p in originals.iterdir())[:3]
    for uuid in uuids:
        await d.array("v1", SIZE, uuid)
    assert d.stats()["evictions"] == 2
    assert len(d.store.files) == 1
    deleted = [
        target
        for link in Path("/proc/self/fd").iterdir()
        if (target := _readlink(link)).endswith("(deleted)") and d.store.root in target
    ]
    assert deleted == []


def _readlink(link: Path) -> str:
    try:
        return os.readlink(link)
    except OSError:
        return ""
