"""PyTorch datasets over a decodefs mount, their live-decode twin, and uint8 batch paths.

The only module of decodefs that imports torch (the optional extra
``decodefs[torch]``); importing the rest of decodefs never does. Arrays come
from ``read_array`` (a stored array is read straight from the store, without
a FUSE request) or, for ``LiveDataset``, from ``decode_image`` with the
version's own settings, so the two give the same pixels; a MountDataset's
batches are read into batch tensors by the client's ``BatchReader`` (by
``BatchLoader``'s threads, with no worker process, or in DataLoader workers). Nothing here caches
arrays, talks to the daemon or knows the store's layout.

Every dataset keeps its per-item state in numpy arrays of bytes rather than
lists of Python strings, so forked DataLoader workers do not copy it page by
page as they touch reference counts (``ImageFolder`` keeps torchvision's
``samples`` list, for parity).
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import sys
import threading
import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

try:
    import torch
    from torch.utils.data import (
        BatchSampler,
        Dataset,
        RandomSampler,
        Sampler,
        SequentialSampler,
        default_collate,
        get_worker_info,
    )
    from torch.utils.data._utils.collate import collate_numpy_array_fn, default_collate_fn_map
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "decodefs.torch needs PyTorch: pip install torch (or decodefs's torch extra: "
        f"pip install -e '.[torch]' in its clone); the rest of decodefs works without it: {exc}"
    ) from exc

from .client import (
    BatchReader,
    failed_originals,
    flush_reports,
    missing_directory,
    read_array,
    read_array_into,
)
from .common.config import Config, load_config
from .common.decode import DecodeError, DecodeSettings, decode_image
from .common.names import ARRAY_SUFFIX, array_name, is_key
from .common.source import scan_source

__all__ = [
    "BatchLoader",
    "FailedItemWarning",
    "ImageFolder",
    "LiveDataset",
    "MountDataset",
    "collate_uint8",
]

Array: TypeAlias = npt.NDArray[np.uint8]
Targets: TypeAlias = Sequence[Any] | Callable[[str], Any] | None
Transform: TypeAlias = Callable[[Array], Any] | None
PathLike: TypeAlias = str | os.PathLike[str]


class FailedItemWarning(UserWarning):
    """An item left out of a batch (``skip_failed=True``): its original failed to decode."""


class _LeftOut:
    """``skip_failed``'s bookkeeping for one dataset: which read errors are an original
    that failed to decode (then the item is left out, with a warning), and how many
    were left out in this process.

    Through the mount, such a read is EIO and the mount's ``failed.json`` lists the
    key (the daemon lists a failure before it answers). Any other error (a mount
    that is gone, a daemon backing off: EIO too, but no listing) is raised as it is.
    """

    def __init__(self, owner: str, mountpoint: str | None, version: str) -> None:
        self.owner = owner
        self.mountpoint = mountpoint  # None: decoded here (LiveDataset), nothing to ask
        self.version = version
        self.count = 0

    def reason(self, key: str, exc: BaseException) -> str | None:
        """Why ``key``'s read raised ``exc`` because its original cannot be decoded; None
        if that is not why."""
        if self.mountpoint is None:
            return str(exc) if isinstance(exc, DecodeError) else None
        if not (isinstance(exc, OSError) and exc.errno == errno.EIO):
            return None
        try:
            listed = failed_originals(self.mountpoint, self.version)
        except (OSError, ValueError):
            return None
        for row in listed.failed:
            if row.key == key:
                return f"{row.path}: {row.reason}"
        return None

    def leave_out(self, key: str, exc: BaseException) -> bool:
        """Whether to leave ``key``'s item out of its batch (warning that it was)."""
        reason = self.reason(key, exc)
        if reason is None:
            return False
        self.count += 1
        listing = (
            f"; `decodefs failed {self.mountpoint} {self.version}` lists them"
            if self.mountpoint is not None
            else ""
        )
        warnings.warn(
            f"{self.owner}: left {key!r} of {self.version} out of its batch, its original "
            f"failed to decode ({reason}): {self.count} left out in this process{listing}",
            FailedItemWarning,
            stacklevel=3,
        )
        return True


def _leave_out_or_raise(left_out: _LeftOut | None, key: str, exc: BaseException) -> None:
    """Leave ``key``'s item out of its batch (``left_out`` warns of it), or raise ``exc``,
    which is not a failed original's (or nothing is to be left out)."""
    if left_out is None or not left_out.leave_out(key, exc):
        raise exc


def _batch_items(
    dataset: Dataset[tuple[Any, Any]],
    indices: Sequence[int],
    key: Callable[[int], str],
    left_out: _LeftOut | None,
    size: int,
    target: Callable[[int], Any],
) -> list[tuple[Any, Any]]:
    """``[dataset[i] for i in indices]`` without the items ``left_out`` leaves out (then
    ``_Items``: what ``collate_uint8`` makes of the batch if nothing is left)."""
    if left_out is None:
        return [dataset[i] for i in indices]
    items = []
    for index in indices:
        try:
            items.append(dataset[index])
        except (OSError, DecodeError) as exc:
            _leave_out_or_raise(left_out, key(index), exc)
    return _Items(items, (size, size, 3), _no_targets(indices, target) if not items else [])


class _Items(list[tuple[Any, Any]]):
    """A batch's items, of ``shape`` arrays, some of which may have been left out
    (``skip_failed``): ``collate_uint8`` makes a batch of none an empty tensor, with
    ``no_targets`` (none of the type the whole batch's targets would have had)."""

    def __init__(
        self, items: list[tuple[Any, Any]], shape: tuple[int, ...], no_targets: Any
    ) -> None:
        super().__init__(items)
        self.shape = shape
        self.no_targets = no_targets

    def nothing(self) -> tuple[torch.Tensor, Any]:
        """The batch when every item was left out."""
        return torch.empty((0, *self.shape), dtype=torch.uint8), self.no_targets


def _no_targets(indices: Sequence[int], target: Callable[[int], Any]) -> Any:
    """What ``default_collate`` makes of none of the targets of ``indices``: an empty
    tensor of theirs, or an empty list."""
    collated = default_collate([target(i) for i in indices]) if indices else []
    return collated[:0] if isinstance(collated, torch.Tensor) else []


class _KeyDataset(Dataset[tuple[Any, Any]]):
    """What MountDataset and LiveDataset share: keys, targets, transform.

    A key is an original's file stem in the uuid layout (``0a1b2c``) or its path
    without the extension in the mirror layout (``cat/0001``): ``list_keys``
    lists them.
    """

    _left_out: _LeftOut | None = None  # skip_failed's, set by each dataset
    size: int  # of the arrays, set by each dataset

    def __init__(self, keys: Sequence[str], targets: Targets, transform: Transform) -> None:
        if isinstance(keys, str | bytes):
            raise TypeError("keys is a sequence of keys, not one string")
        names = [os.fsencode(k) for k in keys]
        for name in names:
            if not is_key(os.fsdecode(name)):
                raise ValueError(
                    f"{os.fsdecode(name)!r} is no key: a key is a file stem ('0a1b2c') or, "
                    "for a mirror version, a relative path without the extension "
                    "('cat/0001'); not empty, no NUL, no '.', '..' or empty path component"
                )
        # One bytes array, not a list of str: forked workers share it untouched.
        self._keys = np.array(names, dtype=np.bytes_)
        if targets is not None and not callable(targets) and len(targets) != len(names):
            raise ValueError(f"{len(targets)} targets for {len(names)} keys")
        self.targets = targets
        self.transform = transform

    def __len__(self) -> int:
        return len(self._keys)

    def key(self, index: int) -> str:
        """Item ``index``'s key."""
        return os.fsdecode(self._keys[index])

    def uuid(self, index: int) -> str:
        """``key(index)``, by its earlier name."""
        return self.key(index)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items")
        key = self.key(index)
        image: Any = self._array(index, key)
        if self.transform is not None:
            image = self.transform(image)
        return image, self._target(index, key)

    def target(self, index: int) -> Any:
        """Item ``index``'s target, without reading its array."""
        if self.targets is not None and not callable(self.targets):
            return self.targets[index]
        return self._target(index, self.key(index))

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """``[self[i] for i in indices]``, as a DataLoader asks for a batch; with
        ``skip_failed``, without the items whose originals failed to decode."""
        return _batch_items(self, indices, self.key, self._left_out, self.size, self.target)

    def _target(self, index: int, key: str) -> Any:
        if self.targets is None:
            return key
        if callable(self.targets):
            return self.targets(key)
        return self.targets[index]

    def _array(self, index: int, key: str) -> Array:
        raise NotImplementedError


def _keys_argument(
    dataset: str, keys: Sequence[str] | None, uuids: Sequence[str] | None
) -> Sequence[str]:
    """The keys a dataset was given: ``keys``, or ``uuids`` (their earlier name, still taken)."""
    if uuids is None:
        if keys is None:
            raise TypeError(f"{dataset}() missing 1 required argument: 'keys'")
        return keys
    if keys is not None:
        raise TypeError(f"{dataset}() takes keys or uuids (their earlier name), not both")
    return uuids


class MountDataset(_KeyDataset):
    """``(image, target)`` for each key, read from ``<mountpoint>/<version>/<size>/``.

    ``keys`` are the keys to read (``decodefs.list_keys`` lists a version's):
    file stems, or for a mirror version relative paths such as ``cat/0001``
    (``uuids=``, their earlier name, is still taken).

    ``image`` is the array the mount serves: a writable, C-contiguous uint8
    ``[size, size, 3]`` numpy array (HWC, RGB), read with ``read_array``, or
    whatever ``transform`` makes of that array. torchvision's ``ToTensor()``
    and ``v2.ToImage()`` take it as it is; transforms that want a PIL image
    need ``Image.fromarray`` first. ``target`` is ``targets[i]`` for a
    sequence, ``targets(key)`` for a callable (a module-level function, so
    spawn workers can unpickle it), or the key itself without ``targets``.

    Works in DataLoader workers (fork or spawn, persistent or not), and across
    a restart of the daemon between epochs: ``read_array`` notices the new
    mount. A key the version does not have raises FileNotFoundError when it
    is read; a mount point, version or size the mount does not have raises
    FileNotFoundError here, naming which.

    An item whose original cannot be decoded raises OSError (EIO) when read.
    With ``skip_failed=True``, a batch (``__getitems__``, as a DataLoader reads
    one, and ``BatchLoader``'s) leaves such an item out instead, with a
    ``FailedItemWarning`` naming it and counting those left out: the batch has
    fewer items. Only an original the mount lists as failed (``decodefs
    failed``) is left out; any other error is raised. ``dataset[i]`` alone
    still raises: to leave such keys out of the dataset itself, filter them
    with ``decodefs.failed_keys``.
    """

    def __init__(
        self,
        mountpoint: PathLike,
        version: str,
        size: int,
        keys: Sequence[str] | None = None,
        targets: Targets = None,
        transform: Transform = None,
        *,
        uuids: Sequence[str] | None = None,
        open_entries: int | None = None,
        skip_failed: bool = False,
    ) -> None:
        super().__init__(_keys_argument("MountDataset", keys, uuids), targets, transform)
        self.size = _check_size(size)
        self.directory = os.path.join(os.fspath(mountpoint), version, str(size))
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(missing_directory(os.fspath(mountpoint), version, size))
        self.skip_failed = skip_failed
        if skip_failed:
            self._left_out = _LeftOut("MountDataset", os.fspath(mountpoint), version)
        if open_entries is not None and (
            isinstance(open_entries, bool) or not isinstance(open_entries, int) or open_entries < 0
        ):
            raise ValueError(f"open_entries is a number of files (0 or more), not {open_entries!r}")
        self.open_entries = open_entries
        self._reader: BatchReader | None = None  # made in each process that reads a batch

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader"] = None  # its descriptors are this process's (spawn workers make theirs)
        return state

    def batch_reader(self) -> BatchReader:
        """The reader of this dataset's batches in this process (client.BatchReader)."""
        reader = self._reader
        if reader is None:
            reader = self._reader = BatchReader(
                self.directory, self._keys, self.size, self.open_entries
            )
        return reader

    def path(self, index: int) -> str:
        return self._path(self.key(index))

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, array_name(key))

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """``[self[i] for i in indices]``, as a DataLoader asks for a batch: without a
        ``transform``, the batch's arrays are read (``batch_reader``) straight into
        the rows of one uint8 tensor allocated for the batch. In a worker whose
        batches ``collate_uint8`` or torch's ``default_collate`` pass on, that
        tensor is in shared memory and becomes the batch, uncopied; in one whose
        collate copies (a hand-written ``torch.stack``), it is memory of the
        worker's own, used again once the collate let go of it."""
        if self.transform is not None:
            return super().__getitems__(indices)
        for index in indices:
            if not -len(self) <= index < len(self):
                raise IndexError(f"index {index} out of range for {len(self)} items")
        images = _worker_batches.tensor((len(indices), self.size, self.size, 3))
        rows = images.numpy()
        failed = set()
        for p in self.batch_reader().read(indices, rows):  # the misses, through the mount
            try:
                read_array_into(self.path(indices[p]), rows[p])
            except OSError as exc:
                _leave_out_or_raise(self._left_out, self.key(indices[p]), exc)
                failed.add(p)
        items = [
            (_row_of(rows, images, p), self.target(i))
            for p, i in enumerate(indices)
            if p not in failed
        ]
        no_targets = _no_targets(indices, self.target) if not items else []
        return _worker_batches.made(_Rows(items, images, no_targets))

    def _array(self, index: int, key: str) -> Array:
        return read_array(self._path(key))


class LiveDataset(_KeyDataset):
    """``MountDataset``'s twin without the mount: each item decoded in the reading process.

    ``config`` is the daemon's config file (or a loaded ``Config``) in place of
    the mount point: the originals are those the daemon indexes for
    ``version`` (the same scan rules and layout: mirror keys such as
    ``cat/0001`` too), decoded with ``decode_image`` and the version's
    ``DecodeSettings`` and ``max_pixels``, so ``max |mount - live| == 0``.
    The source is scanned once, here; a key that is not an original of the
    version raises KeyError now. Reading an item raises
    FileNotFoundError if its original is gone (the mount says ENOENT) and
    decodefs.DecodeError if it cannot be decoded (the mount says EIO); with
    ``skip_failed=True`` a batch leaves the latter out, as MountDataset's does.
    """

    def __init__(
        self,
        config: PathLike | Config,
        version: str,
        size: int,
        keys: Sequence[str] | None = None,
        targets: Targets = None,
        transform: Transform = None,
        *,
        uuids: Sequence[str] | None = None,
        skip_failed: bool = False,
    ) -> None:
        super().__init__(_keys_argument("LiveDataset", keys, uuids), targets, transform)
        self.size = _check_size(size)
        self.skip_failed = skip_failed
        if skip_failed:
            self._left_out = _LeftOut("LiveDataset", None, version)
        loaded = config if isinstance(config, Config) else load_config(Path(config))
        if version not in loaded.versions:
            raise KeyError(
                f"version {version!r} is not in the config ({', '.join(loaded.versions)})"
            )
        settings = loaded.versions[version]
        index = scan_source(
            version,
            settings.source,
            settings.extensions,
            settings.duplicates,
            layout=settings.layout,
        )
        relpaths = []
        for i in range(len(self)):
            position = index.find(self.key(i))
            if position is None:
                raise KeyError(f"{self.key(i)!r} is not an original of version {version!r}")
            relpaths.append(os.fsencode(index.relpaths[position]))
        self.settings: DecodeSettings = settings.decode
        self.max_pixels = loaded.max_pixels
        self.root = index.root
        self._relpaths = np.array(relpaths, dtype=np.bytes_)

    def original(self, index: int) -> str:
        """The original's real path, checked as the daemon checks it before a decode."""
        path = os.path.join(self.root, os.fsdecode(self._relpaths[index]))
        real = os.path.realpath(path)
        if not real.startswith(self.root.rstrip(os.sep) + os.sep) or not os.path.isfile(real):
            raise FileNotFoundError(f"{path} no longer exists inside the source")
        return real

    def _array(self, index: int, key: str) -> Array:
        return decode_image(
            self.original(index), self.size, self.settings, max_pixels=self.max_pixels
        )


class BatchLoader:
    """Batches of a ``MountDataset``'s arrays, read by threads: no worker processes.

    Iterating yields ``(images, targets)`` as a ``DataLoader`` over ``dataset``
    with ``collate_fn=collate_uint8`` would, in the order ``sampler`` gives
    (or ``shuffle``'s, or the dataset's): ``images`` a ``torch.uint8`` tensor
    ``[N, size, size, 3]`` (HWC, RGB), ``targets`` the items' targets through
    ``default_collate`` (a tensor of ints, a list of keys, ...). Every batch
    has ``batch_size`` items but the last, which has fewer unless ``drop_last``.

    Threads read each batch straight into a tensor for it (pinned if
    ``pin_memory``; unpinned memory is used again once nothing refers to it),
    by the dataset's ``batch_reader``: the arrays the store holds by one call
    that reads and checks them without the GIL, each checked and reported to
    the daemon as ``read_array`` does; a miss, or an entry that fails its check,
    through the mount (the daemon decodes it), on one of ``2 * threads``
    threads as soon as the batch's first pass found it. The same bytes as
    ``MountDataset``. ``threads`` (default: the CPUs, at least 2) read batches
    side by side. The next ``prefetch`` batches (default: 2 per thread, as a
    ``DataLoader`` with ``prefetch_factor=2`` and as many workers keeps) are
    read while the current one is used. A read
    that fails (a key the version lacks, a mount that is gone) raises its
    error when its batch is due, and stops the epoch's threads; so does
    leaving the loop (``break``, an exception, KeyboardInterrupt) once the
    iterator is closed or collected. A dataset made with ``skip_failed=True``
    has its items whose originals failed to decode left out of their batches
    (warned of, as the dataset's own batches are): such a batch is smaller.

    Transforms stay with ``MountDataset`` in a ``DataLoader``: a dataset with a
    ``transform`` is refused. The batches are meant to be moved to the device
    and normalised there, ``images.to(device).permute(0, 3, 1, 2).float().div_(255)``.
    ``set_epoch`` is passed to a sampler that has it (``DistributedSampler``).
    """

    def __init__(
        self,
        dataset: MountDataset,
        *,
        batch_size: int,
        shuffle: bool = False,
        sampler: Sampler[int] | Iterable[int] | None = None,
        drop_last: bool = False,
        threads: int | None = None,
        prefetch: int | None = None,
        pin_memory: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(dataset, MountDataset):
            raise TypeError(f"BatchLoader reads a MountDataset, not {type(dataset).__name__}")
        if dataset.transform is not None:
            raise ValueError(
                "BatchLoader serves the arrays as stored: use the MountDataset with its "
                "transform in a DataLoader, or transform each batch on the device"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size is a positive integer, not {batch_size!r}")
        if sampler is not None and shuffle:
            raise ValueError("BatchLoader takes a sampler or shuffle=True, not both")
        threads = _default_threads() if threads is None else threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads is a positive integer, not {threads!r}")
        prefetch = 2 * threads if prefetch is None else prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch is a number of batches (0 or more), not {prefetch!r}")
        if pin_memory and not torch.accelerator.is_available():
            warnings.warn(
                "BatchLoader(pin_memory=True): no accelerator, so batches are not pinned",
                stacklevel=2,
            )
            pin_memory = False
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.threads = threads
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self._memory = _BatchMemory((batch_size, dataset.size, dataset.size, 3), prefetch + 3)
        if sampler is None:
            sampler = (
                RandomSampler(dataset, generator=generator)
                if shuffle
                else SequentialSampler(dataset)
            )
        self.sampler = sampler
        self._batches = BatchSampler(sampler, batch_size, drop_last)
        self._keys: list[str] | None = None  # the dataset's keys as str, once they are targets

    def __len__(self) -> int:
        return len(self._batches)

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` to the sampler (a ``DistributedSampler`` shuffles by it)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __iter__(self) -> Generator[tuple[torch.Tensor, Any], None, None]:
        # Threads per epoch: when the epoch ends, or its iterator is closed, no
        # thread of it is left. The sampler is drawn from in this thread only.
        reads = _Reads(self.threads)
        pending: deque[_Batch] = deque()
        batches = iter(self._batches)
        try:
            while True:
                while len(pending) <= self.prefetch:
                    indices = next(batches, None)
                    if indices is None:
                        break
                    pending.append(self._start(reads, indices))
                if not pending:
                    return
                yield pending.popleft().result()
        finally:
            reads.close()
            flush_reports()  # the daemon's LRU order sees the epoch's hits now

    def _start(self, reads: _Reads, indices: list[int]) -> _Batch:
        if self.pin_memory:  # torch's pinned allocator keeps and reuses pinned blocks itself
            size = self.dataset.size
            images = torch.empty((len(indices), size, size, 3), dtype=torch.uint8, pin_memory=True)
        else:
            images = self._memory.tensor(len(indices))
        reading = reads.submit(self.dataset, indices, images.numpy())
        return _Batch(self.dataset, indices, images, self._targets(indices), reading)

    def _targets(self, indices: list[int]) -> Any:
        """The batch's targets as ``default_collate`` makes them. A dataset without
        targets has its keys as targets: decoded once per loader, not once per batch."""
        dataset = self.dataset
        if dataset.targets is not None:
            return default_collate([dataset.target(i) for i in indices])
        keys = self._keys
        if keys is None:
            keys = self._keys = [os.fsdecode(key) for key in dataset._keys.tolist()]
        return [keys[i] for i in indices]  # default_collate leaves a list of str as it is


class _Reads:
    """One epoch's reading threads.

    A batch is read by one call of the dataset's BatchReader (``threads`` of
    them at once), which holds the GIL only for its Python work per batch:
    threads reading batches side by side run their copies in parallel. Each miss
    the call names is handed at once, before the batch's entries not in the page
    cache are read, to a pool of its own of twice as many threads: they only
    wait for the daemon, and twice its decode pool's worth of requests keeps
    that pool busy while finished arrays are read back.
    """

    def __init__(self, threads: int) -> None:
        name = "decodefs-batchloader"
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._misses = ThreadPoolExecutor(2 * threads, thread_name_prefix=f"{name}-miss")
        self._stop = threading.Event()

    def submit(
        self, dataset: MountDataset, indices: list[int], rows: Array
    ) -> Future[list[tuple[int, Future[None]]]]:
        # The rows go in a list each read empties: the pool's work item holds its
        # arguments a moment after the result is out, and a view of a batch's block
        # held there would keep _BatchMemory from handing the block out again.
        return self._pool.submit(self._read, dataset, indices, [rows])

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._misses.shutdown(wait=True, cancel_futures=True)

    def _read(
        self, dataset: MountDataset, indices: list[int], held: list[Array]
    ) -> list[tuple[int, Future[None]]]:
        """The batch's hits read; its misses being read (their rows, and their reads)."""
        rows = held.pop()
        misses: list[tuple[int, Future[None]]] = []
        if self._stop.is_set():
            return misses

        def miss(p: int) -> None:
            if not self._stop.is_set():
                path = dataset.path(indices[p])
                misses.append((p, self._misses.submit(self._read_miss, path, [rows[p]])))

        dataset.batch_reader().read(indices, rows, on_miss=miss)
        return misses

    def _read_miss(self, path: str, held: list[Array]) -> None:
        row = held.pop()
        if not self._stop.is_set():
            read_array_into(path, row)


class _BatchMemory:
    """Batch tensors over memory that is used again once nothing else refers to it.

    A fresh batch's pages cost a page fault each as the reads fill them (about
    as much as the reads themselves): up to ``keep`` blocks of a full batch are
    kept, and a block is handed out again only when this object holds its
    only reference, so no tensor the caller kept (or a view of it) ever sees
    its bytes change. A tensor made by ``torch.from_numpy`` refers to its block
    for as long as it or any view of it lives. Each block starts on a cache
    line, as torch's own allocations do: the compiled reader copies into rows
    so aligned past the CPU's cache.
    """

    def __init__(self, shape: tuple[int, ...], keep: int) -> None:
        self._shape = shape
        self._bytes = math.prod(shape)
        self._keep = keep
        # Each block owns its memory (every view of it refers to it), beside its rows
        # starting on a cache line (a view: one more reference to the block).
        self._blocks: list[tuple[Array, Array]] = []

    def tensor(self, rows: int) -> torch.Tensor:
        for block, aligned in self._blocks:
            if sys.getrefcount(block) == 4:  # the tuple's, the view's, the loop's, the argument's
                return torch.from_numpy(aligned[:rows])
        block = np.empty(self._bytes + _CACHE_LINE, np.uint8)
        start = -block.ctypes.data % _CACHE_LINE
        aligned = block[start : start + self._bytes].reshape(self._shape)
        if len(self._blocks) < self._keep:
            self._blocks.append((block, aligned))
        return torch.from_numpy(aligned[:rows])


_CACHE_LINE: Final = 64


class _Batch:
    """A batch being read: its items, its tensor, and the reads that fill it."""

    def __init__(
        self,
        dataset: MountDataset,
        indices: list[int],
        images: torch.Tensor,
        targets: Any,
        reads: Future[list[tuple[int, Future[None]]]],
    ) -> None:
        self.dataset = dataset
        self.indices = indices
        self.targets = targets
        self.images = images
        self.reads = reads

    def result(self) -> tuple[torch.Tensor, Any]:
        failed = []
        for row, miss in self.reads.result():  # raises what a read raised
            try:
                miss.result()
            except OSError as exc:
                key = self.dataset.key(self.indices[row])
                _leave_out_or_raise(self.dataset._left_out, key, exc)
                failed.append(row)
        if not failed:
            return self.images, self.targets
        kept = [row for row in range(len(self.indices)) if row not in failed]
        images = self.images[kept]  # a copy
        if self.images.is_pinned():
            images = images.pin_memory()
        if not kept:
            return images, _no_targets(self.indices, self.dataset.target)
        return images, default_collate([self.dataset.target(self.indices[row]) for row in kept])


class _WorkerBatches:
    """Where ``MountDataset.__getitems__`` reads a batch, by what became of the last one.

    In a DataLoader worker whose collate is ``collate_uint8`` or torch's
    ``default_collate`` (``_Row``), the batch tensor goes to the training process
    as it is: it is made in shared memory. A collate that copies (a hand-written
    ``torch.stack``) makes its own shared
    batch: reading into shared memory first would cost a fresh allocation and
    its page faults per batch for nothing, so after a batch that was not passed
    on uncopied, batches are read into memory of the worker's own, used again
    once nothing refers to it (``_BatchMemory``). In the training process
    (``num_workers=0``) a batch is a plain tensor either way.
    """

    def __init__(self) -> None:
        self.passed = True  # the last batch made here was passed on uncopied (or none was made)
        self._memory: dict[tuple[int, ...], _BatchMemory] = {}

    def tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        if get_worker_info() is None or self.passed:
            return _batch_tensor(shape)
        memory = self._memory.get(shape)
        if memory is None:
            if len(self._memory) >= _SHAPES_KEPT:  # a batch of another size (the last)
                self._memory.clear()
            memory = self._memory[shape] = _BatchMemory(shape, 2)
        return memory.tensor(shape[0])

    def made(self, rows: _Rows) -> _Rows:
        self.passed = get_worker_info() is None
        return rows

    def after_fork(self) -> None:
        self.passed = True
        self._memory = {}


_SHAPES_KEPT: Final = 2  # batch shapes with memory kept in a worker (the full and the last)
_worker_batches = _WorkerBatches()
os.register_at_fork(after_in_child=_worker_batches.after_fork)


def _default_threads() -> int:
    return max(2, len(os.sched_getaffinity(0)))


def collate_uint8(
    batch: Sequence[tuple[Any, Any]], *, pin_memory: bool = False
) -> tuple[torch.Tensor, Any]:
    """``(images, targets)``: the batch's HWC uint8 images stacked into one
    ``torch.uint8`` tensor ``[N, H, W, 3]``, and its targets as ``default_collate``
    makes them (a tensor of ints, a list of keys, ...).

    Each image is copied once, into a tensor allocated for the whole batch (in
    a DataLoader worker, in shared memory, so it reaches the training process
    without another copy), and nothing is converted per sample: normalise on
    the device, ``images.to(device).permute(0, 3, 1, 2).float().div_(255)``.
    ``pin_memory`` pins the batch when collating in the training process
    (``num_workers=0``); with workers, pass ``pin_memory=True`` to the
    DataLoader, which pins each batch as it arrives.
    """
    if isinstance(batch, _Items) and not batch:  # every item left out (skip_failed)
        return batch.nothing()
    if not batch:
        raise ValueError("collate_uint8 needs at least one item")
    images = [_hwc_uint8(item[0]) for item in batch]
    shape = images[0].shape
    for image in images:
        if image.shape != shape:
            raise ValueError(f"images of shapes {shape} and {image.shape} in one batch")
    if get_worker_info() is not None and pin_memory:
        raise ValueError(
            "collate_uint8(pin_memory=True) runs in a DataLoader worker: pass "
            "pin_memory=True to the DataLoader instead, which pins in the training process"
        )
    targets = default_collate([item[1] for item in batch])
    if isinstance(batch, _Rows) and batch.intact() and not pin_memory and batch.shared():
        _worker_batches.passed = True
        return batch.images, targets  # read into one batch tensor already: no copy
    out = _batch_tensor((len(images), *shape), pin_memory)
    np.stack(images, out=out.numpy())
    return out, targets


def _batch_tensor(shape: tuple[int, ...], pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised uint8 tensor for a batch: in a DataLoader worker in shared
    memory (as default_collate makes it), so it reaches the training process
    without a copy; else pinned if asked."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=pin_memory)
    storage = torch.UntypedStorage._new_shared(math.prod(shape))  # type: ignore[no-untyped-call]
    _populate(storage.data_ptr(), storage.nbytes())
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


_MADV_POPULATE_WRITE: Final = 23  # <linux/mman.h>, Linux 5.14 and later
_libc: Final = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_populating = True  # until the kernel says it cannot


def _populate(address: int, length: int) -> None:
    """Fault in fresh shared memory's pages for writing, in one system call.

    A new shared-memory batch (one per batch in a DataLoader worker: the
    training process may hold the last one) would otherwise take a page
    fault per 4 KiB page as the reads fill it, which costs more than the
    reads (docs/peers.md: 3.7 ms against 2.3 ms for a batch of 64 at 224).
    Nothing is done on a kernel without ``MADV_POPULATE_WRITE``; the pages
    then fault in as before.
    """
    global _populating
    if not _populating or length == 0:
        return
    start = address - address % mmap.PAGESIZE
    if _libc.madvise(start, address + length - start, _MADV_POPULATE_WRITE) != 0:
        _populating = ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS)


class _Row(np.ndarray):
    """A row of a batch tensor as ``MountDataset.__getitems__`` hands it out: a numpy
    array in every other way. torch's ``default_collate``, given a batch's rows in
    order, passes the batch tensor on as the batch, uncopied, as ``collate_uint8``
    does (registered in ``default_collate_fn_map``, torch's documented way to teach
    it a type); a copy or a slice of a row is a plain array to it."""

    batch: tuple[torch.Tensor, int]  # the batch tensor, and this row's place in it


def _row_of(rows: Array, images: torch.Tensor, position: int) -> Array:
    row: _Row = rows[position].view(_Row)
    row.batch = (images, position)
    return row


def _collate_rows(batch: Sequence[Any], *, collate_fn_map: Any = None) -> torch.Tensor:
    """``default_collate`` of images that are ``_Row``s: the batch tensor if they are
    all of its rows, in order, and it may leave the process as it is; else a copy."""
    images = _whole_batch(batch)
    if images is not None:
        _worker_batches.passed = True
        return images
    out: torch.Tensor = collate_numpy_array_fn(batch, collate_fn_map=collate_fn_map)
    return out


def _whole_batch(batch: Sequence[Any]) -> torch.Tensor | None:
    first = getattr(batch[0], "batch", None)
    if first is None or len(batch) != len(first[0]):
        return None
    images: torch.Tensor = first[0]
    for p, row in enumerate(batch):
        place = getattr(row, "batch", None)
        if place is None or place[0] is not images or place[1] != p:
            return None
    if get_worker_info() is not None and not images.is_shared():  # type: ignore[no-untyped-call]
        return None  # memory the worker uses again: default_collate copies it
    return images


default_collate_fn_map[_Row] = _collate_rows


class _Rows(_Items):
    """``MountDataset.__getitems__``'s items, whose arrays are the rows of ``images``
    in order: unless something replaced or left out an item, ``collate_uint8``
    passes ``images`` on as the batch."""

    def __init__(self, items: list[tuple[Any, Any]], images: torch.Tensor, no_targets: Any) -> None:
        super().__init__(items, tuple(images.shape[1:]), no_targets)
        self.images = images
        self._arrays = [item[0] for item in items]

    def shared(self) -> bool:
        """Whether ``images`` may leave the process as it is (not memory used again)."""
        return get_worker_info() is None or bool(self.images.is_shared())  # type: ignore[no-untyped-call]

    def intact(self) -> bool:
        """Whether the items are still the rows of ``images``, every one, in order."""
        return len(self) == len(self._arrays) == len(self.images) and all(
            item[0] is array for item, array in zip(self, self._arrays, strict=True)
        )


def _hwc_uint8(image: object) -> Array:
    array = image.numpy() if isinstance(image, torch.Tensor) else image
    if not (
        isinstance(array, np.ndarray)
        and array.dtype == np.uint8
        and array.ndim == 3
        and array.shape[2] == 3
    ):
        what = (
            f"{array.dtype}{tuple(array.shape)}" if isinstance(array, np.ndarray) else type(image)
        )
        raise TypeError(
            f"collate_uint8 stacks uint8 [H, W, 3] arrays, got {what}; "
            "a transform that makes float CHW tensors wants default_collate"
        )
    return array


class ImageFolder(Dataset[tuple[Any, Any]]):
    """torchvision's ``ImageFolder`` over a ``layout = "mirror"`` version of the mount.

    The mirror layout shows ``<mount>/<version>/<size>/<class>/.../<name>.npy``
    for each original ``<class>/.../<name>.<ext>`` of the source, and every
    non-hidden source directory, empty ones too. ``classes``,
    ``class_to_idx``, ``samples`` (path in the mount, class index) and
    ``targets`` follow torchvision's rules, applied to the mount's names:
    classes are the sorted names of the directories directly under
    ``<mount>/<version>/<size>`` (links followed); each class's files are
    found by a sorted ``os.walk(followlinks=True)``, each directory's names
    sorted, kept when ``name.lower().endswith(".npy")``. A class folder with
    no file raises FileNotFoundError unless ``allow_empty``. Items are
    ``(array, class_index)``, the array read with ``read_array`` (HWC uint8),
    then ``transform`` and ``target_transform`` applied. ``skip_failed=True``
    leaves the items whose originals failed to decode out of batches, as
    MountDataset's does.
    """

    extensions = (ARRAY_SUFFIX,)

    def __init__(
        self,
        mountpoint: PathLike,
        version: str,
        size: int,
        transform: Transform = None,
        target_transform: Callable[[int], Any] | None = None,
        *,
        allow_empty: bool = False,
        skip_failed: bool = False,
    ) -> None:
        self.size = _check_size(size)
        self.root = os.path.join(os.fspath(mountpoint), version, str(size))
        self.skip_failed = skip_failed
        self._left_out = (
            _LeftOut("ImageFolder", os.fspath(mountpoint), version) if skip_failed else None
        )
        self.transform = transform
        self.target_transform = target_transform
        self.classes, self.class_to_idx = self.find_classes(self.root)
        self.samples = self.make_dataset(self.root, self.class_to_idx, allow_empty=allow_empty)
        self.imgs = self.samples
        self.targets = [target for _, target in self.samples]

    @staticmethod
    def find_classes(directory: str) -> tuple[list[str], dict[str, int]]:
        classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {name: i for i, name in enumerate(classes)}

    @classmethod
    def make_dataset(
        cls, directory: str, class_to_idx: dict[str, int], *, allow_empty: bool = False
    ) -> list[tuple[str, int]]:
        samples = []
        found = set()
        for name in sorted(class_to_idx):
            index = class_to_idx[name]
            class_dir = os.path.join(directory, name)
            if not os.path.isdir(class_dir):
                continue
            for root, _, names in sorted(os.walk(class_dir, followlinks=True)):
                for file_name in sorted(names):
                    if file_name.lower().endswith(cls.extensions):
                        samples.append((os.path.join(root, file_name), index))
                        found.add(name)
        empty = set(class_to_idx) - found
        if empty and not allow_empty:
            raise FileNotFoundError(
                f"Found no valid file for the classes {', '.join(sorted(empty))}. "
                f"Supported extensions are: {', '.join(cls.extensions)}"
            )
        return samples

    def __len__(self) -> int:
        return len(self.samples)

    def key(self, index: int) -> str:
        """Item ``index``'s key: its path below the size's folder, without ``.npy``."""
        relative = os.path.relpath(self.samples[index][0], self.root)
        return relative[: -len(ARRAY_SUFFIX)]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """``[self[i] for i in indices]``, as a DataLoader asks for a batch; with
        ``skip_failed``, without the items whose originals failed to decode."""
        return _batch_items(self, indices, self.key, self._left_out, self.size, self._target)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image: Any = read_array(self.samples[index][0])
        if self.transform is not None:
            image = self.transform(image)
        return image, self._target(index)

    def _target(self, index: int) -> Any:
        target = self.samples[index][1]
        return target if self.target_transform is None else self.target_transform(target)


def _check_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    return size
