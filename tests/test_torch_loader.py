"""BatchLoader and MountDataset's batch reads on real mounts: bytes, order, faults, stopping.

The loader's batches are compared with a DataLoader's over the same MountDataset
in the same sampler order, and with the live decode; its faults are real (an
entry file unlinked or damaged in the store, a capacity that evicts, a daemon
restarted, killed or unmounted between two batches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, default_collate

from decodefs import class_labels, list_keys, read_array
from decodefs.client import batch, listing, rows
from decodefs.client.reader import locate
from decodefs.common.entry import EntryKey
from decodefs.common.inodes import Kind, Node
from decodefs.common.npy import npy_header
from decodefs.common.protocol import TRAILER_SIZE
from decodefs.sample import make_sample_corpus
from decodefs.store.changes import ChangeToken
from decodefs.torch import BatchLoader, LiveDataset, MountDataset, collate_uint8
from tests.conftest import MountFactory
from tests.helpers import Mount, decodefs, fuse_requests, wait_until

SIZE = 40
THREAD_PREFIX = "decodefs-batchloader"


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def batches(loader: Iterable[tuple[torch.Tensor, Any]]) -> list[tuple[torch.Tensor, Any]]:
    return [(images.clone(), targets) for images, targets in loader]


def assert_same_batches(
    got: list[tuple[torch.Tensor, Any]], want: list[tuple[torch.Tensor, Any]]
) -> None:
    assert [len(images) for images, _ in got] == [len(images) for images, _ in want]
    for (images, targets), (want_images, want_targets) in zip(got, want, strict=True):
        assert images.dtype == torch.uint8 and images.shape[1:] == (SIZE, SIZE, 3)
        assert torch.equal(images, want_images)
        if isinstance(want_targets, torch.Tensor):
            assert torch.equal(targets, want_targets)
        else:
            assert targets == want_targets


def store_of(mount: Mount) -> Path:
    return mount.config.parent / "store"


def entry_file(mount: Mount, key: str) -> Path:
    return store_of(mount) / EntryKey("v1", SIZE, key).relpath


def evict(mount: Mount, key: str) -> None:
    """``key``'s entry unlinked as the daemon evicts one: then a new change token."""
    entry_file(mount, key).unlink()
    root = os.open(store_of(mount), os.O_RDONLY | os.O_DIRECTORY)
    try:
        token = ChangeToken()
        token.open(root)
        token.close()
    finally:
        os.close(root)


def restart(mount: Mount) -> None:
    result = decodefs("umount", mount.mountpoint)
    assert result.returncode == 0, result.stderr
    assert mount.process is not None and mount.process.wait(timeout=30) == 0
    mount.start()


@pytest.fixture(params=["compiled", "python"])
def reader_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Batches read by the compiled reader, or by its pure-Python twin (where it did not
    build): datasets made in the test pick the one chosen here."""
    if request.param == "python":
        monkeypatch.setattr(rows, "compiled", None)
    elif rows.compiled is None:
        pytest.skip("the compiled reader did not build")
    return str(request.param)


def open_files() -> list[str]:
    """What this process's descriptors are open on (a deleted file's name ends " (deleted)")."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return links


def mirror_source(root: Path, photos: dict[str, Path]) -> Path:
    """A folder dataset whose file names repeat across class folders."""
    names = sorted(photos)
    for i, uuid in enumerate(names):
        folder = ["cat", "dog", "dog/puppies"][i % 3]
        path = root / folder / f"{i // 3:04d}{photos[uuid].suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(photos[uuid].read_bytes())
    return root


@pytest.mark.parametrize("layout", ["uuid", "mirror"])
def test_batches_are_mount_datasets_in_the_samplers_order_with_misses_among_hits(
    mounts: MountFactory,
    photos_dir: Path,
    photos: dict[str, Path],
    tmp_path: Path,
    layout: str,
    reader_kind: str,
) -> None:
    if layout == "mirror":
        source = mirror_source(tmp_path / "classes", photos)
        mount = mounts({"v1": source}, version_layout="mirror")
        keys = list_keys(mount.mountpoint, "v1")
        _, targets = class_labels(keys)
    else:
        mount = mounts({"v1": photos_dir})
        keys = sorted(photos)
        targets = list(range(100, 100 + len(keys)))
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys, targets=targets)
    order = [int(i) for i in np.random.default_rng(5).permutation(len(keys))]
    stored = order[::2]  # hits at even places of the order: each batch of 4 has misses inside
    for index in stored:
        read_array(dataset.path(index))
    assert mount.stats()["store_entries"] == len(stored)

    loader = BatchLoader(dataset, batch_size=4, sampler=order, threads=2)
    assert len(loader) == 3  # 11 arrays: 4, 4 and a last batch of 3
    got = batches(loader)
    assert not loader_threads()  # the epoch's threads ended with it
    stats = mount.stats()
    assert stats["misses"] == stats["decodes"] == len(keys)  # each miss decoded once, by the mount
    wait_until(lambda: mount.stats()["direct_hits"] == len(stored), 10, "the epoch's reports")

    want = batches(DataLoader(dataset, batch_size=4, sampler=order, collate_fn=collate_uint8))
    assert_same_batches(got, want)
    live = LiveDataset(mount.config, "v1", SIZE, keys, targets=targets)
    for position, index in enumerate(order):  # and the live decode's pixels, in that order
        images, _ = got[position // 4]
        assert np.array_equal(images[position % 4].numpy(), live[index][0]), keys[index]

    dropped = BatchLoader(dataset, batch_size=4, sampler=order, drop_last=True, threads=3)
    assert len(dropped) == 2
    assert_same_batches(batches(dropped), want[:2])


def test_shuffle_a_distributed_sampler_and_what_the_loader_refuses(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)[:10]
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys)
    seen: list[str] = []
    for rank in range(2):
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=2, rank=rank, shuffle=True, seed=3
        )
        loader = BatchLoader(dataset, batch_size=2, sampler=sampler, threads=2)
        loader.set_epoch(7)  # passed on: the order is the sampler's for epoch 7
        assert len(loader) == 3
        got = [key for _, batch_keys in loader for key in batch_keys]
        reference: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=2, rank=rank, shuffle=True, seed=3
        )
        reference.set_epoch(7)
        assert got == [keys[i] for i in reference]
        seen += got
    assert sorted(seen) == keys  # the two ranks cover the set once

    shuffled = BatchLoader(
        dataset, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    order = [key for _, batch_keys in shuffled for key in batch_keys]
    assert sorted(order) == keys and order != keys
    plain = [key for _, batch_keys in BatchLoader(dataset, batch_size=3) for key in batch_keys]
    assert plain == keys  # no sampler, no shuffle: the dataset's order

    pinning = torch.accelerator.is_available()
    with contextlib.nullcontext() if pinning else pytest.warns(UserWarning, match="no accelerator"):
        pinned = BatchLoader(dataset, batch_size=4, pin_memory=True)
    images, _ = next(iter(pinned))
    assert images.is_pinned() == pinning
    assert np.array_equal(images[0].numpy(), read_array(dataset.path(0)))

    with pytest.raises(ValueError, match="serves the arrays as stored"):
        BatchLoader(
            MountDataset(mount.mountpoint, "v1", SIZE, keys, transform=torch.from_numpy),
            batch_size=2,
        )
    with pytest.raises(ValueError, match="batch_size is a positive integer"):
        BatchLoader(dataset, batch_size=0)
    with pytest.raises(ValueError, match="threads is a positive integer"):
        BatchLoader(dataset, batch_size=2, threads=0)
    with pytest.raises(ValueError, match="a sampler or shuffle=True, not both"):
        BatchLoader(dataset, batch_size=2, sampler=[0, 1], shuffle=True)
    with pytest.raises(TypeError, match="reads a MountDataset, not list"):
        BatchLoader([1, 2], batch_size=2)  # type: ignore[arg-type]


def test_an_entry_evicted_or_damaged_mid_epoch_is_read_through_the_mount(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], reader_kind: str
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys)
    want = batches(BatchLoader(dataset, batch_size=4))  # stores every array
    assert mount.stats()["decodes"] == len(keys)

    loader = BatchLoader(dataset, batch_size=4, prefetch=0, threads=2)  # reads a batch when due
    epoch = iter(loader)
    got = [next(epoch)]
    evict(mount, keys[5])  # while the epoch runs: batch 2 misses it
    damaged = entry_file(mount, keys[9])  # and batch 3's entry fails its checksum
    data = bytearray(damaged.read_bytes())
    data[200] ^= 0x01
    damaged.write_bytes(bytes(data))
    got += [(images.clone(), targets) for images, targets in epoch]
    assert_same_batches(got, want)
    stats = mount.stats()
    assert stats["misses"] == len(keys) + 1  # the evicted one, decoded again by the mount
    assert stats["corrupt_entries"] == 1  # the daemon checked the damaged one again (O_SYNC)
    # The next epoch reads every array stored again (a rebuilt entry the daemon has not
    # written back yet may be read through it, as a hit): the rebuilt entries are new
    # files, opened anew, and the kept descriptors of the old ones were closed.
    wait_until(lambda: mount.stats()["direct_hits"] == len(keys) - 2, 10, "the reports")
    before = mount.stats()
    assert_same_batches(batches(loader), want)

    def served() -> int:
        stats = mount.stats()
        return int(stats["direct_hits"] + stats["hits"])

    want_served = before["direct_hits"] + before["hits"] + len(keys)
    wait_until(lambda: served() == want_served, 10, "the second epoch's reports")
    after = mount.stats()
    assert (after["misses"], after["decodes"]) == (before["misses"], before["decodes"])
    store = str(store_of(mount))
    kept = [link for link in open_files() if link.startswith(store) and ".npy" in link]
    stored = {str(entry_file(mount, key)) for key in keys}
    assert len(kept) == dataset.batch_reader().kept >= len(keys) - 1  # within the default bound
    assert set(kept) <= stored  # the entries' current files: no evicted or replaced one

    # A store that holds 4 arrays: every epoch evicts as it goes, and stays right.
    entry = len(npy_header(SIZE)) + SIZE * SIZE * 3 + TRAILER_SIZE
    small = mounts(
        {"v1": photos_dir},
        name="small",
        store=store_of(mount).parent / "small-store",
        max_store_bytes=4 * entry,
    )
    small_dataset = MountDataset(small.mountpoint, "v1", SIZE, keys)
    for _ in range(2):
        assert_same_batches(batches(BatchLoader(small_dataset, batch_size=4)), want)
    assert small.stats()["evictions"] >= len(keys)


def test_kept_files_stay_within_the_bound_and_close_with_the_mount(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], reader_kind: str
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys, open_entries=3)
    want = batches(BatchLoader(dataset, batch_size=4))  # stores every array
    store = str(store_of(mount))

    def open_entries() -> int:
        return sum(1 for link in open_files() if link.startswith(store) and link.endswith(".npy"))

    for _ in range(2):
        assert_same_batches(batches(BatchLoader(dataset, batch_size=4, threads=3)), want)
        assert dataset.batch_reader().kept == 3 and open_entries() == 3
    # Entries evicted while no batch reads their keys: batches of other keys find their
    # kept files (a batch of N arrays looks at N keys' in turn) and close them.
    kept_keys = [k for k in keys if str(entry_file(mount, k)) in open_files()]
    assert len(kept_keys) == 3
    for key in kept_keys:
        evict(mount, key)

    def evicted_open() -> int:
        return sum(1 for link in open_files() if link.startswith(store) and "(deleted)" in link)

    assert evicted_open() == 3
    others = [i for i, k in enumerate(keys) if k not in kept_keys][:4]
    rows = np.zeros((len(others), SIZE, SIZE, 3), np.uint8)
    for _ in range(len(keys) // len(others) + 1):
        dataset.batch_reader().read(others, rows)
    assert evicted_open() == 0
    assert_same_batches(batches(BatchLoader(dataset, batch_size=4)), want)  # decoded again
    restart(mount)  # another daemon: the files kept for the last one are closed
    # One thread: a call holds room for every file it may keep until it ends, and the
    # evicted keys' batch, read beside another, would keep fewer than the bound.
    assert_same_batches(batches(BatchLoader(dataset, batch_size=4, threads=1)), want)
    assert open_entries() == 3
    none = MountDataset(mount.mountpoint, "v1", SIZE, keys, open_entries=0)
    assert_same_batches(batches(BatchLoader(none, batch_size=4)), want)
    assert none.batch_reader().kept == 0 and open_entries() == 3
    dataset.batch_reader().close()
    assert open_entries() == 0
    dropped = MountDataset(mount.mountpoint, "v1", SIZE, keys, open_entries=3)
    assert_same_batches(batches(BatchLoader(dropped, batch_size=4)), want)
    assert open_entries() == 3
    del dropped
    gc.collect()
    assert open_entries() == 0  # a reader let go of closes its files
    with pytest.raises(ValueError, match="open_entries is a number"):
        MountDataset(mount.mountpoint, "v1", SIZE, keys, open_entries=-1)


def test_a_daemon_restarted_between_epochs(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    loader = BatchLoader(MountDataset(mount.mountpoint, "v1", SIZE, keys), batch_size=4)
    first = batches(loader)
    restart(mount)
    second = batches(loader)
    assert_same_batches(second, first)
    wait_until(lambda: mount.stats()["direct_hits"] == len(keys), 10, "the epoch's reports")
    stats = mount.stats()  # the new daemon's: every array read straight from the store
    assert stats["hits"] == stats["misses"] == stats["decodes"] == 0


def test_each_batch_finds_the_mount_by_the_stat_its_reads_take_with_them(
    mounts: MountFactory,
    photos_dir: Path,
    photos: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    reader_kind: str,
) -> None:
    first = mounts({"v1": photos_dir})
    keys = sorted(photos)
    dataset = MountDataset(first.mountpoint, "v1", SIZE, keys)
    want = batches(BatchLoader(dataset, batch_size=len(keys)))  # every array stored, kept
    reader = dataset.batch_reader()
    found_anew: list[batch._Serving | None] = []
    begin = batch.BatchReader._begin

    def counted(self: batch.BatchReader) -> batch._Serving | None:
        found_anew.append(begin(self))
        return found_anew[-1]

    monkeypatch.setattr(batch.BatchReader, "_begin", counted)
    rows = np.zeros((len(keys), SIZE, SIZE, 3), np.uint8)
    assert reader.read(range(len(keys)), rows) == []
    assert found_anew == []  # the same mount: told by the first pass's own stat
    assert torch.equal(torch.from_numpy(rows), want[0][0])
    first.stop()  # another daemon on the same path, with a store of its own (empty)
    second = mounts({"v1": photos_dir}, store=tmp_path / "another-store")
    assert second.mountpoint == first.mountpoint
    assert reader.read(range(len(keys)), rows) == list(range(len(keys)))  # its misses
    assert len(found_anew) == 1 and found_anew[0] is not None
    assert found_anew[0].mount.store == str(tmp_path / "another-store")
    assert not [link for link in open_files() if link.startswith(str(store_of(first)))]


def test_a_first_pass_counts_as_the_mounts_only_if_its_stats_say_so(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    reader = MountDataset(mount.mountpoint, "v1", SIZE, sorted(photos)).batch_reader()
    serving = reader._begin()
    assert serving is not None
    try:
        st, root = os.stat(reader.directory), os.stat(mount.mountpoint)
        looked = rows.Looked(1, st.st_dev, st.st_ino, root.st_dev, root.st_mtime_ns, 0, 0, 0)
        assert reader._still_serving(serving, looked)
        for other in (
            looked._replace(stated=0),  # a stat failed
            looked._replace(device=st.st_dev + 1),  # no mount known on that device
            looked._replace(inode=st.st_ino + 1),  # another directory at the path
            looked._replace(root_device=root.st_dev + 1),  # the root on another mount
            looked._replace(root_mtime_ns=root.st_mtime_ns + 1),  # a later mount, same device
        ):
            assert not reader._still_serving(serving, other), other
        retired = dataclasses.replace(serving, retired=True)  # another thread let go of it
        assert not reader._still_serving(retired, looked)
    finally:
        reader._end(serving)


@pytest.mark.parametrize("how", ["killed", "unmounted"])
def test_a_mount_that_vanishes_mid_epoch_raises_and_stops_the_threads(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], how: str
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    loader = BatchLoader(
        MountDataset(mount.mountpoint, "v1", SIZE, keys), batch_size=4, prefetch=0, threads=2
    )
    epoch = iter(loader)
    next(epoch)  # cold: read through the mount
    if how == "killed":
        mount.kill9()
        expected: type[OSError] = OSError
    else:
        result = decodefs("umount", mount.mountpoint)
        assert result.returncode == 0, result.stderr
        expected = FileNotFoundError
    with pytest.raises(expected) as raised:
        next(epoch)
    if how == "killed":  # ECONNABORTED: its request was pending as the connection ended
        assert raised.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    assert str(mount.mountpoint) in str(raised.value)  # names the path it could not read
    assert not loader_threads()
    with pytest.raises(StopIteration):
        next(epoch)  # the epoch is over


class _InterruptingSampler:
    """Gives ``count`` indices, then raises KeyboardInterrupt as Ctrl-C would."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self) -> Iterator[int]:
        yield from range(self.count)
        raise KeyboardInterrupt

    def __len__(self) -> int:
        return self.count + 1


def test_keyboard_interrupt_stops_the_threads(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys)
    interrupted = BatchLoader(dataset, batch_size=2, sampler=_InterruptingSampler(7), threads=3)
    seen = 0
    with pytest.raises(KeyboardInterrupt):  # inside the loader, while batches are being read
        for images, _ in interrupted:
            seen += len(images)
            assert loader_threads()
    assert seen < 7 and not loader_threads()

    loader = BatchLoader(dataset, batch_size=2, threads=3)
    with pytest.raises(KeyboardInterrupt):  # in the training loop, batches in flight
        for _ in loader:
            raise KeyboardInterrupt
    assert not loader_threads()
    for _ in loader:  # a break, then the iterator collected
        break
    wait_until(lambda: not loader_threads(), 10, "the threads of an abandoned epoch to end")
    assert sum(len(images) for images, _ in loader) == len(keys)  # and it reads again


# -- MountDataset's batch reads in a DataLoader -------------------------------------------


def test_a_dataloader_batch_is_read_into_one_tensor_and_passed_on_uncopied(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys, targets=list(range(len(keys))))
    items = dataset.__getitems__([3, -1, 0])
    for (array, target), index in zip(items, [3, len(keys) - 1, 0], strict=True):
        assert np.array_equal(array, dataset[index][0]) and target == index
        assert array.flags.writeable and array.flags.c_contiguous
    images, targets = collate_uint8(items)
    assert images.data_ptr() == items[0][0].ctypes.data  # the rows read into: no copy
    assert torch.equal(targets, torch.tensor([3, len(keys) - 1, 0]))
    assert default_collate(items)[0].data_ptr() == images.data_ptr()  # torch's too
    assert all(isinstance(array, np.ndarray) for array, _ in items)
    items[1] = (items[1][0].copy(), items[1][1])  # a collate_fn may replace an item: copied
    copied, _ = collate_uint8(items)
    assert copied.data_ptr() != images.data_ptr() and torch.equal(copied, images)
    copied, _ = default_collate(items)
    assert copied.data_ptr() != images.data_ptr() and torch.equal(copied, images)
    with pytest.raises(IndexError):
        dataset.__getitems__([0, len(keys)])
    transformed = MountDataset(mount.mountpoint, "v1", SIZE, keys, transform=torch.from_numpy)
    assert isinstance(transformed.__getitems__([0])[0][0], torch.Tensor)  # item by item

    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate_uint8)
    for (images, targets), (want, want_targets) in zip(
        loader, BatchLoader(dataset, batch_size=4), strict=True
    ):
        assert images.is_shared()  # read in the worker into shared memory
        assert torch.equal(images, want) and torch.equal(targets, want_targets)


def stack_collate(batch: list[tuple[Any, Any]]) -> tuple[torch.Tensor, list[Any]]:
    """What a user writes by hand."""
    return torch.stack([torch.from_numpy(image) for image, _ in batch]), [t for _, t in batch]


@pytest.mark.parametrize("collate", [default_collate, stack_collate])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_dataloader_with_a_collate_that_copies_gets_every_batch_right(
    mounts: MountFactory,
    photos_dir: Path,
    photos: dict[str, Path],
    collate: Any,
    context: str,
) -> None:
    # After its first batch, a worker reads into memory of its own, used again once the
    # collate let go: batches the training process holds are never overwritten.
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys, targets=list(range(len(keys))))
    want = batches(BatchLoader(dataset, batch_size=2))
    loader = DataLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        collate_fn=collate,
        multiprocessing_context=context,
        persistent_workers=True,
    )
    for _ in range(2):  # the second epoch: every batch read into reused memory
        held = list(loader)
        for (images, targets), (want_images, want_targets) in zip(held, want, strict=True):
            assert torch.equal(images, want_images)
            assert [int(t) for t in targets] == want_targets.tolist()


def test_batch_memory_is_used_again_only_once_nothing_refers_to_it(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys)
    loader = BatchLoader(dataset, batch_size=2, prefetch=1, threads=2)
    kept = [(images, images.permute(0, 3, 1, 2), images.numpy()) for images, _ in loader]
    copies = [images.clone() for images, _, _ in kept]
    for _ in range(2):
        for _ in loader:  # epochs that drop their batches at once: memory used again
            pass
    for (images, view, array), copy in zip(kept, copies, strict=True):
        assert torch.equal(images, copy)  # what the caller kept was never overwritten
        assert torch.equal(view, copy.permute(0, 3, 1, 2)) and np.array_equal(array, copy)
    pointers = set()
    for images, _ in loader:
        pointers.add(images.data_ptr())
        assert images.data_ptr() % 64 == 0  # rows on cache lines, copied into past the cache
        del images
    assert len(pointers) <= 1 + 1 + 1  # one batch used, one read ahead, one being filled
    assert len({images.data_ptr() for images, _, _ in kept}) == len(kept)


def test_threads_do_not_outlive_a_failed_read(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = [*sorted(photos)[:5], "no-such-key", *sorted(photos)[5:]]
    loader = BatchLoader(MountDataset(mount.mountpoint, "v1", SIZE, keys), batch_size=4)
    with pytest.raises(FileNotFoundError, match=r"no-such-key\.npy"):
        for _ in loader:
            pass
    assert not loader_threads()
    assert os.path.ismount(mount.mountpoint)


def _resident_kib(address: int) -> int:
    """The resident KiB of the mapping of this process that holds ``address``."""
    with open("/proc/self/smaps", encoding="ascii") as f:
        inside = False
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_workers_fresh_batch_memory_is_faulted_in_at_once() -> None:
    # What _batch_tensor does in a DataLoader worker, on a fresh shared storage.
    import decodefs.torch as decodefs_torch

    nbytes = 64 * 224 * 224 * 3
    untouched = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    assert _resident_kib(untouched.data_ptr()) == 0
    fresh = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
    decodefs_torch._populate(fresh.data_ptr(), fresh.nbytes())
    assert _resident_kib(fresh.data_ptr()) * 1024 >= nbytes


@pytest.mark.parametrize("layout", ["uuid", "mirror"])
def test_a_readers_first_batch_lists_the_directory_instead_of_a_lookup_per_key(
    mounts: MountFactory, tmp_path: Path, layout: str
) -> None:
    originals = tmp_path / "originals"
    make_sample_corpus(originals, 48, 64, 48, seed=11)
    if layout == "mirror":
        photos = {path.stem: path for path in originals.rglob("*.jpg")}
        mount = mounts({"v1": mirror_source(tmp_path / "classes", photos)}, version_layout="mirror")
    else:
        mount = mounts({"v1": originals})
    keys = list_keys(mount.mountpoint, "v1")
    assert len(keys) == 48
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys)
    want = [read_array(dataset.path(i)) for i in range(len(keys))]  # each stored
    restart(mount)  # a new daemon, and a kernel that knows none of the names yet

    fresh = MountDataset(mount.mountpoint, "v1", SIZE, keys)
    rows = np.zeros((len(keys), SIZE, SIZE, 3), np.uint8)
    with fuse_requests(mount.mountpoint) as requests:
        assert fresh.batch_reader().read(range(len(keys)), rows) == []  # every one a hit
    assert requests["FUSE_READDIRPLUS"] >= 1, requests
    assert requests["FUSE_LOOKUP"] <= 5, requests  # the version's, the size's, the folders'
    for i, array in enumerate(want):
        assert np.array_equal(rows[i], array), keys[i]
    assert mount.stats()["misses"] == 0


@pytest.mark.parametrize("version", ["v1", "v2"])  # version ids 1 and 2 in inode numbers
def test_the_keys_a_listing_names_are_taken_as_a_lookup_takes_them(
    mounts: MountFactory,
    photos_dir: Path,
    photos: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    version: str,
) -> None:
    mount = mounts({"v1": photos_dir, "v2": photos_dir})
    keys = sorted(photos)
    lacking = "00000000-0000-4000-8000-000000000000"  # a key the version does not have
    dataset = MountDataset(mount.mountpoint, version, SIZE, [*keys, lacking])
    reader = dataset.batch_reader()
    looked_up = _counting_lookups(monkeypatch)
    serving = reader._begin()
    assert serving is not None
    try:
        assert reader._list(serving)
        assert not reader._list(serving)  # once per mount
    finally:
        reader._end(serving)
    assert looked_up == [dataset.path(len(keys))]  # the lacking key's alone
    assert (reader._verified == serving.generation).tolist() == [True] * len(keys) + [False]
    for i, key in enumerate(keys):  # each as reader.locate finds it
        found = locate(dataset.path(i))
        assert found is not None and found[1] == EntryKey(version, SIZE, key)
        assert reader._seeds[i] == found[1].seed


def test_a_listing_of_another_directory_than_the_readers_names_no_key(
    mounts: MountFactory,
    photos_dir: Path,
    photos: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys)
    reader = dataset.batch_reader()
    looked_up = _counting_lookups(monkeypatch)
    serving = reader._begin()
    assert serving is not None
    try:  # as if the directory found were another one (a new mount's, say)
        other = dataclasses.replace(serving, directory_ino=serving.directory_ino + 1)
        assert reader._list(other)
    finally:
        reader._end(serving)
    assert sorted(looked_up) == sorted(dataset.path(i) for i in range(len(keys)))
    assert (reader._verified == other.generation).all()  # each by its own lookup


def _counting_lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths BatchReader looks up one by one (reader.locate) from now on."""
    looked_up: list[str] = []

    def counted(path: str) -> Any:
        looked_up.append(path)
        return locate(path)

    monkeypatch.setattr(batch, "locate", counted)
    return looked_up


def test_a_listed_name_is_an_array_only_if_its_inode_number_says_so() -> None:
    entry = Node(Kind.ENTRY, version=1, size=SIZE, number=7).ino
    assert listing.names_entry(entry, 1, SIZE)
    assert not listing.names_entry(entry, 2, SIZE)  # another version's
    assert not listing.names_entry(entry, 1, SIZE + 1)  # another size's
    assert not listing.names_entry(Node(Kind.FOLDER, 1, SIZE, 7).ino, 1, SIZE)
    assert not listing.names_entry(Node(Kind.SIZE, 1, SIZE).ino, 1, SIZE)
    assert not listing.names_entry(2**63 - 1, 1, SIZE)  # no kind a node has


def test_listed_names_are_found_among_the_keys_by_their_whole_name() -> None:
    wanted = np.array([b"ab", b"abc", b"b"], dtype="S3")  # sorted
    names = ["abc.npy", "b.npy", "abcd.npy", "ab", "zz.npy", "a.npy", "ab.npy.npy", "ab.npy"]
    inos = list(range(100, 100 + len(names)))
    # Each hit: its key's place among the sorted keys, and the name's inode number. Not
    # "abcd" (cut to the keys' width it would be "abc"), nor a name with no ".npy".
    positions, numbers = listing.among(wanted, names, inos)
    assert sorted(zip(positions, numbers, strict=True)) == [(0, 107), (1, 100), (2, 101)]
    assert listing.among(wanted[:0], names, inos) == ([], [])


def test_a_listing_stops_at_its_budget_and_goes_into_folders(tmp_path: Path) -> None:
    for folder in ["", "cat/", "dog/", "dog/puppies/"]:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        for i in range(5):
            (tmp_path / f"{folder}{i}.npy").touch()
    (tmp_path / "link.npy").symlink_to(tmp_path / "0.npy")
    everything = 4 * 5 + 3 + 1  # the files, the folders and the symlink

    def listed_in(directory: Path, budget: int, ours: bool = True) -> tuple[int, dict[str, int]]:
        files: dict[str, int] = {}

        def found(names: list[str], inos: list[int]) -> None:
            files.update(zip(names, inos, strict=True))

        return listing.list_below(str(directory), budget, lambda st: ours, found), files

    # The regular files directly in the directory, by their inode numbers.
    assert listed_in(tmp_path, 1000) == (
        everything,
        {f"{i}.npy": (tmp_path / f"{i}.npy").stat().st_ino for i in range(5)},
    )
    listed, files = listed_in(tmp_path, 7)
    assert listed == 7 and len(files) <= 6
    assert listed_in(tmp_path / "missing", 1000) == (0, {})
    # Another directory than the one meant: listed (the kernel keeps it), nothing named.
    assert listed_in(tmp_path, 1000, ours=False) == (everything, {})


def test_read_stored_rows_reads_the_hits_and_names_the_misses(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    from decodefs.client.reader import read_stored_rows

    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    paths = [mount.path("v1", str(SIZE), f"{key}.npy") for key in keys]
    stored = set(range(0, len(keys), 3))
    for i in stored:
        read_array(paths[i])
    rows = np.zeros((len(keys), SIZE, SIZE, 3), np.uint8)
    misses = read_stored_rows(paths, rows)
    assert misses == [i for i in range(len(keys)) if i not in stored]
    assert mount.stats()["misses"] == len(stored)  # no miss was read through the mount
    for i in stored:
        assert np.array_equal(rows[i], read_array(paths[i])), keys[i]
    assert not rows[misses].any()
    with pytest.raises(ValueError, match="paths for"):
        read_stored_rows(paths, rows[1:])


def test_the_training_script_trains_from_every_path(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    # A smoke test of scripts/train_resnet.py on CPU: every path trains, every epoch says
    # its rate and how busy the device was (its figures are the benchmark's, not the test's).
    mount = mounts({"v1": photos_dir})
    script = Path(__file__).parents[1] / "scripts" / "train_resnet.py"
    result = subprocess.run(
        [
            sys.executable, str(script),
            "--mount", str(mount.mountpoint), "--config", str(mount.config), "--version", "v1",
            "--size", "32", "--width", "2", "--epochs", "2", "--steps", "2", "--batch", "4",
            "--workers", "1",
        ],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line.strip("| ").split(" | ") for line in result.stdout.splitlines()]
    seen = {(row[0], row[1]): float(row[3]) for row in rows if len(row) == 4 and row[1].isdigit()}
    assert sorted(seen) == [(p, e) for p in ["batch", "live", "mount", "npload"] for e in "12"]
    assert all(0 < busy <= 1 for busy in seen.values()), seen
    assert mount.stats()["decodes"] == len(photos)  # the mount's paths decoded each once


class Recorded(list[int]):
    """A sampler's order that counts how many of its indices were drawn."""

    drawn = 0

    def __iter__(self) -> Iterator[int]:
        for index in super().__iter__():
            self.drawn += 1
            yield index


@pytest.mark.parametrize(("threads", "prefetch", "ahead"), [(2, None, 4), (3, None, 6), (2, 1, 1)])
def test_the_batches_read_ahead_are_two_per_thread_unless_said(
    mounts: MountFactory,
    photos_dir: Path,
    photos: dict[str, Path],
    threads: int,
    prefetch: int | None,
    ahead: int,
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)
    assert len(keys) > 1 + ahead
    order = Recorded(range(len(keys)))
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys)
    loader = BatchLoader(dataset, batch_size=1, sampler=order, threads=threads, prefetch=prefetch)
    iterator = iter(loader)
    try:
        next(iterator)
        assert order.drawn == 1 + ahead  # the batch in use, and those read meanwhile
    finally:
        iterator.close()
    assert not loader_threads()
