"""A bad image is a list, not a crash, for training too: datasets and BatchLoader made
with ``skip_failed=True`` leave out of their batches the items whose originals failed
to decode (listed by the mount), each with a warning that counts them; without it, or
for any other error, the read raises as before.

Real mounts, real bad originals (truncated, not an image), real decodes.
"""

from __future__ import annotations

import errno
import io
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from decodefs import DecodeError
from decodefs.torch import (
    BatchLoader,
    FailedItemWarning,
    ImageFolder,
    LiveDataset,
    MountDataset,
    collate_uint8,
)
from tests.conftest import MountFactory
from tests.helpers import reference_npy, write_bad_originals, write_config

SIZE = 32
BAD = ("bad-text", "bad-truncated")


@pytest.fixture
def corpus(tmp_path: Path, photos: dict[str, Path]) -> Path:
    """Five good originals and two bad ones, flat; the keys sort bad ones among good."""
    root = tmp_path / "originals"
    root.mkdir()
    for uuid, path in list(photos.items())[:5]:
        shutil.copy(path, root / f"{uuid}{path.suffix}")
    bad = write_bad_originals(tmp_path / "bad", next(iter(photos.values())))
    for key in BAD:
        shutil.copy(bad[key], root / bad[key].name)
    return root


def pixels(original: Path) -> Any:
    return np.load(io.BytesIO(reference_npy(original, SIZE)))


def originals_by_key(root: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(root.iterdir())}


def keys_of(root: Path) -> list[str]:
    return sorted(originals_by_key(root))


def assert_good_items_in_order(
    got: list[tuple[torch.Tensor, Any]], root: Path, batch_size: int
) -> None:
    """The batches hold every good item, in the keys' order, with its pixels; the batches
    holding a bad item are that much smaller."""
    by_key = originals_by_key(root)
    keys = keys_of(root)
    want_sizes = [
        sum(key not in BAD for key in keys[i : i + batch_size])
        for i in range(0, len(keys), batch_size)
    ]
    assert [len(images) for images, _ in got] == want_sizes
    seen = [key for _, targets in got for key in targets]
    assert seen == [key for key in keys if key not in BAD]
    images = torch.cat([images for images, _ in got])
    for image, key in zip(images, seen, strict=True):
        assert np.array_equal(image.numpy(), pixels(by_key[key])), key


def left_out_keys(caught: list[warnings.WarningMessage], before: int = 0) -> list[str]:
    """The keys the warnings name; each warning counts them, from ``before`` on."""
    found = []
    for warning in caught:
        assert warning.category is FailedItemWarning, warning
        text = str(warning.message)
        found.append(next(key for key in BAD if f"'{key}'" in text))
        assert f"{before + len(found)} left out in this process" in text, text
    return found


def test_a_dataloader_and_batch_loader_leave_failed_items_out_with_a_warning(
    mounts: MountFactory, corpus: Path
) -> None:
    mount = mounts({"v1": corpus}, version_sizes=[SIZE])
    keys = keys_of(corpus)
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, keys, skip_failed=True)
    loader = DataLoader(dataset, batch_size=3, collate_fn=collate_uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [(images.clone(), targets) for images, targets in loader]
    assert_good_items_in_order(got, corpus, 3)
    assert sorted(left_out_keys(caught)) == sorted(BAD)
    reason = next(str(w.message) for w in caught if "'bad-text'" in str(w.message))
    assert f"({corpus / 'bad-text.jpg'}: " in reason and "cannot identify image" in reason
    assert f"`decodefs failed {mount.mountpoint} v1` lists them" in reason

    # BatchLoader, over the same dataset: the same batches, warned of the same way
    # (the bad ones are misses every epoch: a failure is never stored).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_threads = [(images.clone(), targets) for images, targets in
                        BatchLoader(dataset, batch_size=3, threads=2)]  # fmt: skip
    assert_good_items_in_order(from_threads, corpus, 3)
    assert sorted(left_out_keys(caught, before=len(BAD))) == sorted(BAD)

    # In DataLoader workers too (each warns on its own stderr).
    workers = DataLoader(dataset, batch_size=2, collate_fn=collate_uint8, num_workers=2)
    assert_good_items_in_order([(i.clone(), t) for i, t in workers], corpus, 2)

    # A batch made only of bad items is empty, not an error: no images, and targets of
    # the type the batch's would have had (ints: a tensor; keys: a list).
    for targets_given, no_targets in (([7, 8], torch.empty(0, dtype=torch.int64)), (None, [])):
        only_bad = MountDataset(
            mount.mountpoint, "v1", SIZE, list(BAD), targets=targets_given, skip_failed=True
        )
        plain = DataLoader(only_bad, batch_size=2, collate_fn=collate_uint8)
        threads = BatchLoader(only_bad, batch_size=2)
        for each in (plain, threads):
            with pytest.warns(FailedItemWarning):
                (images, targets), *rest = list(each)
            assert rest == [] and images.shape == (0, SIZE, SIZE, 3)
            assert type(targets) is type(no_targets) and len(targets) == 0
            if isinstance(no_targets, torch.Tensor):
                assert isinstance(targets, torch.Tensor) and targets.dtype == no_targets.dtype


def test_without_skip_failed_or_for_another_error_the_read_raises(
    mounts: MountFactory, corpus: Path
) -> None:
    mount = mounts({"v1": corpus}, version_sizes=[SIZE])
    keys = keys_of(corpus)
    plain = MountDataset(mount.mountpoint, "v1", SIZE, keys)
    with pytest.raises(OSError) as raised:
        list(DataLoader(plain, batch_size=3, collate_fn=collate_uint8))
    assert raised.value.errno == errno.EIO
    with pytest.raises(OSError) as raised:
        list(BatchLoader(plain, batch_size=3))
    assert raised.value.errno == errno.EIO

    # A key the version does not have is ENOENT, not a failed decode: raised.
    skipping = MountDataset(mount.mountpoint, "v1", SIZE, [*keys, "no-such-key"], skip_failed=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FailedItemWarning)
        with pytest.raises(FileNotFoundError):
            list(DataLoader(skipping, batch_size=3, collate_fn=collate_uint8))
        with pytest.raises(FileNotFoundError):
            list(BatchLoader(skipping, batch_size=3))
    # One item alone has no batch to be left out of.
    with pytest.raises(OSError):
        skipping[keys.index(BAD[0])]


def test_image_folder_and_live_dataset_leave_failed_items_out(
    mounts: MountFactory, corpus: Path, tmp_path: Path
) -> None:
    folders = tmp_path / "folders"
    for i, original in enumerate(sorted(corpus.iterdir())):
        target = folders / ("cat" if i % 2 else "dog") / original.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(original, target)
    mount = mounts({"v1": folders}, version_sizes=[SIZE], version_layout="mirror")
    dataset = ImageFolder(mount.mountpoint, "v1", SIZE, skip_failed=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [item for batch in DataLoader(dataset, batch_size=3, collate_fn=list)
               for item in batch]  # fmt: skip
    good = [(p, c) for p, c in dataset.samples if Path(p).stem not in BAD]
    assert len(got) == len(good) == 5
    for (image, label), (path, class_index) in zip(got, good, strict=True):
        assert label == class_index
        original = next(folders.glob(f"*/{Path(path).stem}.*"))
        assert np.array_equal(image, pixels(original))
    assert len(caught) == 2 and all(w.category is FailedItemWarning for w in caught)
    bad = [i for i, (path, _) in enumerate(dataset.samples) if Path(path).stem in BAD]
    with pytest.warns(FailedItemWarning):
        images, labels = collate_uint8(dataset.__getitems__(bad))
    assert images.shape == (0, SIZE, SIZE, 3) and labels.dtype == torch.int64 and not len(labels)
    assert any("'dog/bad-text'" in str(w.message) or "'cat/bad-text'" in str(w.message)
               for w in caught)  # fmt: skip

    # LiveDataset decodes here: a DecodeError is what it leaves out.
    config = write_config(tmp_path / "live.toml", tmp_path / "store", {"v1": corpus})
    keys = keys_of(corpus)
    live = LiveDataset(config, "v1", SIZE, keys, skip_failed=True)
    with pytest.warns(FailedItemWarning, match="1 left out in this process"):
        batch = live.__getitems__([keys.index(BAD[0]), keys.index(keys[0])])
    assert [key for _, key in batch] == [keys[0]]
    with pytest.warns(FailedItemWarning):
        images, none = collate_uint8(live.__getitems__([keys.index(key) for key in BAD]))
    assert images.shape == (0, SIZE, SIZE, 3) and none == []  # keys: a list
    with pytest.raises(DecodeError):
        LiveDataset(config, "v1", SIZE, keys).__getitems__([keys.index(BAD[0])])
