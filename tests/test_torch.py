"""decodefs.torch on real mounts, in real DataLoader workers (fork and spawn).

Also what a user's own, unmodified dataset sees through the mount, and
ImageFolder's torchvision rules on a directory laid out as a mirror version.
"""

from __future__ import annotations

import gc
import io
import multiprocessing
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from decodefs import DecodeSettings, class_labels, decode_image, list_keys
from decodefs.torch import ImageFolder, LiveDataset, MountDataset, collate_uint8
from tests.conftest import MountFactory
from tests.helpers import Mount, decodefs, reference_npy, wait_until

SIZE = 40  # small: these tests are about processes and bytes, not decode speed


def workers(context: str) -> int:
    """Two forked workers; one spawned (each spawn imports torch afresh: seconds)."""
    return 2 if context == "fork" else 1


def label_of(uuid: str) -> int:
    """A target function at module level, so spawn workers can unpickle it."""
    return len(uuid)


def epoch(loader: Iterable[tuple[torch.Tensor, Any]]) -> dict[str, npt.NDArray[np.uint8]]:
    """uuid -> array for every item of one pass over a loader of (uint8 batch, uuids)."""
    arrays = {}
    for images, uuids in loader:
        assert images.dtype == torch.uint8 and images.shape[1:] == (SIZE, SIZE, 3)
        for image, uuid in zip(images, uuids, strict=True):
            arrays[uuid] = image.numpy().copy()
    return arrays


def reference(path: Path, size: int = SIZE) -> npt.NDArray[np.uint8]:
    array: npt.NDArray[np.uint8] = np.load(io.BytesIO(reference_npy(path, size)))
    return array


def restart(mount: Mount) -> None:
    """`decodefs umount` and `decodefs mount` of the same config, as a user would."""
    result = decodefs("umount", mount.mountpoint)
    assert result.returncode == 0, result.stderr
    assert mount.process is not None and mount.process.wait(timeout=30) == 0
    mount.start()


# -- MountDataset ----------------------------------------------------------------------


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_mount_dataset_in_workers_survives_a_daemon_restart(
    mounts: MountFactory,
    photos_dir: Path,
    photos: dict[str, Path],
    context: str,
    persistent: bool,
) -> None:
    mount = mounts({"v1": photos_dir})
    uuids = sorted(photos)
    dataset = MountDataset(mount.mountpoint, "v1", SIZE, uuids)
    loader = DataLoader(
        dataset,
        batch_size=4,
        num_workers=workers(context),
        collate_fn=collate_uint8,
        multiprocessing_context=context,
        persistent_workers=persistent,
    )
    first = epoch(loader)  # misses: the workers read through the mount, the daemon decodes
    assert mount.stats()["decodes"] == len(photos)

    restart(mount)
    second = epoch(loader)  # hits, straight from the store, for the new daemon too
    del loader  # shuts persistent workers down: they report their last hits as they exit
    gc.collect()

    for uuid in uuids:
        want = reference(photos[uuid])
        assert np.array_equal(first[uuid], want), uuid
        assert np.array_equal(second[uuid], want), uuid
    wait_until(lambda: mount.stats()["direct_hits"] >= len(uuids), what="the reports")
    stats = mount.stats()
    assert stats["direct_hits"] == len(uuids)  # every read reported, none lost at exit
    assert stats["hits"] == stats["misses"] == stats["decodes"] == 0  # no read reached it


def test_targets_a_sequence_a_callable_or_the_uuid(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    uuids = sorted(photos)[:3]
    by_list = MountDataset(mount.mountpoint, "v1", SIZE, uuids, targets=[7, 8, 9])
    by_function = MountDataset(mount.mountpoint, "v1", SIZE, uuids, targets=label_of)
    plain = MountDataset(mount.mountpoint, "v1", SIZE, uuids, transform=torch.from_numpy)
    assert [by_list[i][1] for i in range(3)] == [7, 8, 9]
    assert [by_function[i][1] for i in range(3)] == [len(u) for u in uuids]
    image, target = plain[-1]
    assert target == uuids[-1] and isinstance(image, torch.Tensor)
    assert np.array_equal(image.numpy(), reference(photos[uuids[-1]]))
    array = by_list[0][0]  # what transforms get: HWC uint8, writable, C-contiguous
    assert array.dtype == np.uint8 and array.shape == (SIZE, SIZE, 3)
    assert array.flags.writeable and array.flags.c_contiguous
    assert by_list.path(0) == str(mount.path("v1", str(SIZE), f"{uuids[0]}.npy"))
    with pytest.raises(ValueError, match="2 targets for 3 keys"):
        MountDataset(mount.mountpoint, "v1", SIZE, uuids, targets=[1, 2])
    with pytest.raises(FileNotFoundError, match=r"has no version 'v9' \(it has: v1\)"):
        MountDataset(mount.mountpoint, "v9", SIZE, uuids)
    with pytest.raises(FileNotFoundError, match=r"v1 has no size 5000: .* \(8 to 4096\)"):
        MountDataset(mount.mountpoint, "v1", 5000, uuids)
    with pytest.raises(FileNotFoundError, match="is not a decodefs mount"):
        MountDataset(mount.mountpoint.parent, "v1", SIZE, uuids)
    for bad in ["", "../v1/x", "a//b", "a/./b", "x\0"]:
        with pytest.raises(ValueError, match="is no key"):
            MountDataset(mount.mountpoint, "v1", SIZE, [bad])
    with pytest.raises(FileNotFoundError):
        MountDataset(mount.mountpoint, "v1", SIZE, ["no-such-uuid"])[0]


def test_datasets_take_keys_by_name_and_by_their_earlier_name_uuids(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    keys = sorted(photos)[:2]
    for dataset in [
        MountDataset(mount.mountpoint, "v1", SIZE, keys=keys),
        MountDataset(mount.mountpoint, "v1", SIZE, uuids=keys),
        LiveDataset(mount.config, "v1", SIZE, keys=keys),
        LiveDataset(mount.config, "v1", SIZE, uuids=keys),
    ]:
        assert [dataset.key(i) for i in range(len(dataset))] == keys
        assert [dataset.key(i) for i in range(len(dataset))] == keys
        assert np.array_equal(dataset[1][0], reference(photos[keys[1]]))
    with pytest.raises(TypeError, match="missing 1 required argument: 'keys'"):
        MountDataset(mount.mountpoint, "v1", SIZE)
    with pytest.raises(TypeError, match="takes keys or uuids"):
        LiveDataset(mount.config, "v1", SIZE, keys, uuids=keys)


# -- LiveDataset: the A/B twin ---------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "context"),
    [
        ({}, "fork"),
        ({"version_fit": "crop", "version_resample": "bicubic"}, "spawn"),
    ],
    ids=["default-fork", "crop-bicubic-spawn"],
)
def test_mount_and_live_decode_are_equal_in_workers(
    mounts: MountFactory,
    photos_dir: Path,
    photos: dict[str, Path],
    settings: dict[str, str],
    context: str,
) -> None:
    mount = mounts({"v1": photos_dir}, **settings)
    uuids = sorted(photos)
    results = {}
    for name, dataset in [
        ("mount", MountDataset(mount.mountpoint, "v1", SIZE, uuids)),
        ("live", LiveDataset(mount.config, "v1", SIZE, uuids)),
    ]:
        loader = DataLoader(
            dataset,
            batch_size=3,
            num_workers=workers(context),
            collate_fn=collate_uint8,
            multiprocessing_context=context,
        )
        results[name] = epoch(loader)
    assert sorted(results["mount"]) == sorted(results["live"]) == uuids
    worst = max(
        int(np.abs(results["mount"][u].astype(np.int16) - results["live"][u]).max()) for u in uuids
    )
    assert worst == 0  # max |mount - live| over every photograph
    decode = DecodeSettings(
        fit=settings.get("version_fit", "stretch"),  # type: ignore[arg-type]
        resample=settings.get("version_resample", "bilinear"),  # type: ignore[arg-type]
    )
    for uuid in uuids:  # the version's own settings, not the defaults
        assert np.array_equal(results["live"][uuid], decode_image(photos[uuid], SIZE, decode))


def test_live_dataset_refuses_what_the_version_does_not_have(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    with pytest.raises(KeyError, match="'no-such-uuid' is not an original of version 'v1'"):
        LiveDataset(mount.config, "v1", SIZE, [*sorted(photos), "no-such-uuid"])
    with pytest.raises(KeyError, match="version 'v2' is not in the config"):
        LiveDataset(mount.config, "v2", SIZE, sorted(photos))


# -- the uint8 batch path --------------------------------------------------------------


def test_collate_uint8_stacks_once_and_refuses_what_it_cannot_stack() -> None:
    rng = np.random.default_rng(0)
    items = [(rng.integers(0, 256, (5, 5, 3), dtype=np.uint8), i) for i in range(4)]
    images, targets = collate_uint8(items)
    assert images.dtype == torch.uint8 and images.shape == (4, 5, 5, 3)
    assert np.array_equal(images.numpy(), np.stack([a for a, _ in items]))
    assert torch.equal(targets, torch.arange(4))
    normalised = images.permute(0, 3, 1, 2).float().div_(255)  # what the device then does
    assert normalised.shape == (4, 3, 5, 5) and float(normalised.max()) <= 1.0

    tensors = [(torch.from_numpy(a), "x") for a, _ in items]  # uint8 HWC tensors too
    assert torch.equal(collate_uint8(tensors)[0], images)
    with pytest.raises(TypeError, match=r"uint8 \[H, W, 3\] arrays, got float32"):
        collate_uint8([(np.zeros((5, 5, 3), np.float32), 0)])
    with pytest.raises(TypeError, match="got uint8"):
        collate_uint8([(torch.zeros(3, 5, 5, dtype=torch.uint8), 0)])  # already CHW
    with pytest.raises(ValueError, match="shapes"):
        collate_uint8([(np.zeros((5, 5, 3), np.uint8), 0), (np.zeros((6, 5, 3), np.uint8), 0)])
    if torch.accelerator.is_available():
        assert collate_uint8(items, pin_memory=True)[0].is_pinned()
    else:  # this machine: torch itself refuses to pin without an accelerator
        with pytest.raises(RuntimeError, match="pin"):
            collate_uint8(items, pin_memory=True)


class _Arrays(Dataset[tuple[npt.NDArray[np.uint8], int]]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> tuple[npt.NDArray[np.uint8], int]:
        return np.full((4, 4, 3), index, np.uint8), index


def _pinned_collate(batch: list[tuple[Any, Any]]) -> tuple[torch.Tensor, Any]:
    return collate_uint8(batch, pin_memory=True)


def test_collate_uint8_in_workers_builds_batches_in_shared_memory() -> None:
    loader = DataLoader(_Arrays(), batch_size=3, num_workers=1, collate_fn=collate_uint8)
    batches = list(loader)
    assert [int(b[0][:, 0, 0, 0].sum()) for b in batches] == [0 + 1 + 2, 3 + 4 + 5]
    assert all(b[0].is_shared() for b in batches)  # no copy on the way to this process
    pinned = DataLoader(_Arrays(), batch_size=3, num_workers=1, collate_fn=_pinned_collate)
    with pytest.raises(ValueError, match="pass pin_memory=True to the DataLoader"):
        list(pinned)


# -- a user's own dataset, unmodified ---------------------------------------------------


class ShardedCacheDataset(Dataset[tuple[torch.Tensor, str]]):
    """A team's own dataset for the sharded flash-cache layout, as users write it
    (not decodefs code): load the cached array, else decode the original and cache it."""

    def __init__(
        self,
        cache_dir: str | Path,
        version: str,
        size: int,
        originals: dict[str, Path],
        fallbacks: Synchronized[int],
    ) -> None:
        self.cache_dir = str(cache_dir)
        self.version = version
        self.size = size
        self.originals = originals
        self.keys = sorted(originals)
        self.fallbacks = fallbacks

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
        uuid = self.keys[index]
        path = os.path.join(self.cache_dir, self.version, str(self.size), uuid[:2], f"{uuid}.npy")
        if os.path.exists(path):
            array = np.load(path)
        else:
            array = decode_image(self.originals[uuid], self.size)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            np.save(path, array)
            with self.fallbacks.get_lock():
                self.fallbacks.value += 1
        return torch.from_numpy(array), uuid


def _tensors(dataset: Dataset[tuple[torch.Tensor, str]]) -> dict[str, npt.NDArray[np.uint8]]:
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
    return {
        u: t.numpy().copy() for images, uuids in loader for t, u in zip(images, uuids, strict=True)
    }


def test_an_unmodified_sharded_cache_dataset_runs_on_the_mount(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path], tmp_path: Path
) -> None:
    fallbacks: Synchronized[int] = multiprocessing.get_context("fork").Value("i", 0)
    # Its own cache, empty: it falls back to decoding and fills it (the counter works).
    local = ShardedCacheDataset(tmp_path / "cache", "v1", SIZE, photos, fallbacks)
    _tensors(local)
    assert fallbacks.value == len(photos)
    assert (tmp_path / "cache" / "v1" / str(SIZE)).is_dir()

    mount = mounts({"v1": photos_dir})
    fallbacks.value = 0
    on_mount = ShardedCacheDataset(mount.mountpoint, "v1", SIZE, photos, fallbacks)
    cold = _tensors(on_mount)  # cold store: the daemon decodes behind np.load
    after_cold = mount.stats()
    warm = _tensors(on_mount)
    after_warm = mount.stats()
    assert fallbacks.value == 0  # never its own decode, never a write
    assert after_cold["misses"] == after_cold["decodes"] == len(photos)
    assert after_warm["hits"] - after_cold["hits"] == len(photos)  # epoch 2: every read a hit
    assert after_warm["misses"] == len(photos) and after_warm["decodes"] == len(photos)
    live = LiveDataset(mount.config, "v1", SIZE, sorted(photos))
    for i, uuid in enumerate(live.key(i) for i in range(len(live))):
        assert np.array_equal(cold[uuid], live[i][0]), uuid
        assert np.array_equal(warm[uuid], live[i][0]), uuid


# -- ImageFolder: torchvision's rules over a mirror-shaped tree -------------------------


def expected_folder(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """torchvision's documented ImageFolder rules, written another way: classes are the
    sorted directories under root (links followed); a class's files are those whose
    lower-cased name ends in .npy, ordered by (directory path, name), found by a
    recursive listing that follows links."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    samples = []
    for index, name in enumerate(classes):
        found = sorted(_npy_files(str(root / name)))
        samples += [(os.path.join(d, f), index) for d, f in found]
    return classes, samples


def _npy_files(directory: str) -> list[tuple[str, str]]:
    """(directory, name) of every file under ``directory`` whose lower-cased name ends
    in .npy, listing recursively and following links."""
    found = []
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if os.path.isdir(path):
            found += _npy_files(path)
        elif entry.lower().endswith(".npy"):
            found.append((directory, entry))
    return found


def write_tree(root: Path, files: Iterable[str]) -> dict[str, npt.NDArray[np.uint8]]:
    arrays = {}
    for i, relative in enumerate(files):
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        array = np.full((8, 8, 3), i, np.uint8)
        with open(path, "wb") as f:
            np.save(f, array)
        arrays[str(path.resolve())] = array
    return arrays


def test_image_folder_follows_torchvision_rules(tmp_path: Path) -> None:
    root = tmp_path / "mnt" / "v1" / "8"
    arrays = write_tree(
        root,
        [
            "cat/0001.npy",
            "cat/0002.npy",
            "cat/nested/0001.npy",  # the same name as above, one level down
            "cat/nested/deeper/a photo.npy",
            "cat/nested-b/0001.npy",  # '-' sorts before '/': after nested/, before nested/deeper/
            "dog/0001.npy",  # the same name in another class
            "dog/IMG_0003.npy",
            "dog/img_0002.npy",  # upper case sorts first
            "dog/SHOUTING.NPY",  # kept: the extension test is on the lower-cased name
            "Zebra crossing/x.npy",  # a class name with a space and a capital
            "stray.npy",  # not in a class
        ],
    )
    (root / "dog" / "notes.txt").write_text("not an array")
    (root / "empty class" / "sub").mkdir(parents=True)  # only an empty folder inside
    (root / "linked").symlink_to(root / "dog", target_is_directory=True)
    (root / "cat" / "link-to-zebra").symlink_to(root / "Zebra crossing")

    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes empty class"):
        ImageFolder(tmp_path / "mnt", "v1", 8)
    folder = ImageFolder(tmp_path / "mnt", "v1", 8, allow_empty=True)
    classes, samples = expected_folder(root)
    assert folder.classes == classes == ["Zebra crossing", "cat", "dog", "empty class", "linked"]
    assert folder.class_to_idx == {name: i for i, name in enumerate(classes)}
    assert folder.samples == samples and folder.imgs == samples
    assert folder.targets == [t for _, t in samples]
    assert [os.path.relpath(p, root) for p, _ in folder.samples if "cat" in p][:3] == [
        "cat/0001.npy",
        "cat/0002.npy",
        "cat/link-to-zebra/x.npy",
    ]
    for i, (path, target) in enumerate(folder.samples):
        image, got = folder[i]
        assert got == target
        assert np.array_equal(image, arrays[str(Path(path).resolve())])

    flipped = ImageFolder(
        tmp_path / "mnt",
        "v1",
        8,
        transform=lambda a: a[:, ::-1],
        target_transform=lambda t: -t,
        allow_empty=True,
    )
    assert flipped[0][1] == -samples[0][1]
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder"):
        ImageFolder.find_classes(str(root / "cat" / "nested" / "deeper"))


# torchvision's IMG_EXTENSIONS; every default extension of a decodefs version is one.
TORCHVISION_IMAGES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def torchvision_image_folder(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """torchvision's ImageFolder over the original tree, by its documented rules:
    classes = sorted directories under root; each class's files from a sorted
    os.walk(followlinks=True), names sorted, kept when the lower-cased name ends in
    one of IMG_EXTENSIONS. Samples as (path relative to root without extension, class)."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    samples = []
    for index, name in enumerate(classes):
        for directory, _, names in sorted(os.walk(root / name, followlinks=True)):
            for file in sorted(names):
                if file.lower().endswith(TORCHVISION_IMAGES):
                    stem = os.path.splitext(os.path.join(directory, file))[0]
                    samples.append((os.path.relpath(stem, root), index))
    return classes, samples


def test_image_folder_over_a_mirror_mount_is_torchvisions_over_the_originals(
    mounts: MountFactory, photos: dict[str, Path], tmp_path: Path
) -> None:
    source = tmp_path / "classes"
    names = sorted(photos)
    layout = {  # repeated names across classes, nesting, upper case, spaces, an empty class
        "cat/0001": names[0],
        "cat/0002": names[1],
        "cat/nested/0001": names[2],
        "dog/0001": names[3],
        "dog/IMG 0003": names[4],
        "dog/deep/er/img_0002": names[5],
        "Zebra crossing/0001": names[6],
    }
    for key, uuid in layout.items():
        original = photos[uuid]
        suffix = original.suffix.upper() if "IMG" in key else original.suffix
        path = source / f"{key}{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(original.read_bytes())
    (source / "empty class").mkdir()
    mount = mounts({"v1": source}, version_layout="mirror", sizes=[SIZE])

    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes empty class"):
        ImageFolder(mount.mountpoint, "v1", SIZE)
    folder = ImageFolder(mount.mountpoint, "v1", SIZE, allow_empty=True)
    classes, samples = torchvision_image_folder(source)
    root = mount.path("v1", str(SIZE))
    got = [(os.path.relpath(p, root)[: -len(".npy")], t) for p, t in folder.samples]
    assert folder.classes == classes == ["Zebra crossing", "cat", "dog", "empty class"]
    assert got == samples and folder.targets == [t for _, t in samples]
    assert mount.stats()["decodes"] == 0  # finding the samples decoded nothing
    loader = DataLoader(folder, batch_size=3, num_workers=2, collate_fn=collate_uint8)
    images = [image for batch, _ in loader for image in batch.numpy()]
    for (key, _), image in zip(samples, images, strict=True):
        want = decode_image(next(source.glob(f"{glob_escape(key)}.*")), SIZE)
        assert np.array_equal(image, want), key

    # The same folder dataset by its keys, through the mount and live: equal, item by item.
    keys = list_keys(mount.mountpoint, "v1")
    assert keys == sorted(layout)
    key_classes, labels = class_labels(keys)
    assert key_classes == ["Zebra crossing", "cat", "dog"]  # a class is a folder with a key
    through = MountDataset(mount.mountpoint, "v1", SIZE, keys, targets=labels)
    live = LiveDataset(mount.config, "v1", SIZE, keys, targets=labels)
    for i, key in enumerate(keys):
        (mounted, label), (decoded, live_label) = through[i], live[i]
        assert np.array_equal(mounted, decoded), key
        assert label == live_label == key_classes.index(key.split("/")[0])
    with pytest.raises(ValueError, match="key 'top' is in no class folder"):
        class_labels(["cat/0001", "top"])


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


# -- decodefs without torch --------------------------------------------------------------


def test_decodefs_imports_without_torch() -> None:
    script = textwrap.dedent(
        """
        import importlib, importlib.abc, pkgutil, sys

        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoTorch())
        import decodefs
        for module in pkgutil.walk_packages(decodefs.__path__, "decodefs."):
            if module.name != "decodefs.torch" and not module.name.endswith("__main__"):
                importlib.import_module(module.name)
        assert "torch" not in sys.modules
        try:
            import decodefs.torch
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("decodefs.torch imported without torch")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "decodefs.torch needs PyTorch: pip install torch" in result.stdout
