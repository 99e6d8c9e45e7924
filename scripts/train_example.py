"""Train a small CNN on CPU the same way over four data paths, side by side in one run.

On generated photo-like JPEGs (--count, --width x --height), decoded to --size:
  live decode          decodefs.torch.LiveDataset: decode_image in the DataLoader workers
  unmodified, mount    a user's own dataset for the sharded flash-cache layout
                       (<cache_dir>/<version>/<size>/<uu>/<uuid>.npy, np.load, else decode
                       and np.save), unchanged, with cache_dir = the mount (a cold store)
  MountDataset         decodefs.torch.MountDataset: read_array (a cold store of its own)
  unmodified, local    the same unmodified dataset over a plain local directory holding
                       the same .npy files (the reference: no FUSE, nothing to decode)
Every path trains a fresh model from one seed, on batches in one order, with
--workers DataLoader workers and the uint8 batch path (collate_uint8; the
batch is normalised after it reaches the training device). Prints each
epoch's seconds, the ratios, and the largest difference between the loss
curves (0: the same data, bit for bit).

    .venv/bin/python scripts/train_example.py [--count 300] [--size 128] [--epochs 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
from benchlib import VERSION, WORK, BenchMount
from torch import nn
from torch.utils.data import DataLoader, Dataset

from decodefs import decode_image
from decodefs.sample import make_sample_corpus
from decodefs.torch import LiveDataset, MountDataset, collate_uint8

SEED = 0
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


class ShardedCacheDataset(Dataset[tuple[torch.Tensor, int]]):
    """A team's own dataset, as they wrote it for their flash cache (not decodefs code):
    load <cache_dir>/<version>/<size>/<uu>/<uuid>.npy, or decode the original and save it."""

    def __init__(
        self,
        cache_dir: Path,
        version: str,
        size: int,
        originals: dict[str, Path],
        labels: dict[str, int],
        fallbacks: Synchronized[int],
    ) -> None:
        self.cache_dir = str(cache_dir)
        self.version = version
        self.size = size
        self.originals = originals
        self.labels = labels
        self.keys = sorted(originals)
        self.fallbacks = fallbacks

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
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
        return torch.from_numpy(array), self.labels[uuid]


def small_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, classes),
    )


def train(
    dataset: Dataset[tuple[Any, int]], classes: int, args: argparse.Namespace
) -> tuple[list[float], list[float]]:
    """(seconds of each epoch, loss of every batch) for one fresh model."""
    device = torch.device("cpu")  # the same code on "cuda": the batch is normalised there
    torch.manual_seed(SEED)
    model = small_cnn(classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(SEED),
        num_workers=args.workers,
        persistent_workers=True,
        collate_fn=collate_uint8,  # uint8 [N, H, W, 3], one copy, no per-sample conversion
        pin_memory=device.type == "cuda",
    )
    mean, std = MEAN.to(device), STD.to(device)
    seconds, losses = [], []
    for _ in range(args.epochs):
        started = time.perf_counter()
        for images, labels in loader:
            x = images.to(device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
            x = (x - mean) / std
            loss = nn.functional.cross_entropy(model(x), labels.to(device))
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            losses.append(loss.item())
        seconds.append(time.perf_counter() - started)
    del loader
    return seconds, losses


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=300, help="originals in the corpus")
    parser.add_argument("--width", type=int, default=1800)
    parser.add_argument("--height", type=int, default=1200)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    # A directory of exactly these originals: it is the version's source.
    source = WORK / f"train-{args.count}-{args.width}x{args.height}"
    print(f"corpus: {args.count} JPEGs of {args.width}x{args.height}", file=sys.stderr)
    paths = make_sample_corpus(source, args.count, args.width, args.height, seed=2)
    for path in paths:
        path.read_bytes()  # page-cached for every path alike
    originals = {p.stem: p for p in paths}
    # Four classes, by the folder each original is in (make_sample_corpus's batch-NN).
    labels = {p.stem: int(p.parent.name.split("-")[1]) for p in paths}
    uuids = sorted(originals)
    targets = [labels[u] for u in uuids]
    classes = len(set(targets))
    fallbacks: Synchronized[int] = torch.multiprocessing.get_context("fork").Value("i", 0)

    results: dict[str, tuple[list[float], list[float]]] = {}
    decodes: dict[str, int] = {}
    live = BenchMount(source, [args.size])  # only its config is used: no mount
    try:
        print("training: live decode", file=sys.stderr)
        dataset = LiveDataset(live.config, VERSION, args.size, uuids, targets)
        results["live decode (LiveDataset)"] = train(dataset, classes, args)
    finally:
        live.remove()

    for name in ("unmodified dataset, np.load via the mount", "MountDataset (read_array)"):
        bench = BenchMount(source, [args.size])
        try:
            bench.mount()
            print(f"training: {name}", file=sys.stderr)
            if name.startswith("unmodified"):
                on_mount = ShardedCacheDataset(
                    bench.mountpoint, VERSION, args.size, originals, labels, fallbacks
                )
                results[name] = train(on_mount, classes, args)
            else:
                by_reader = MountDataset(bench.mountpoint, VERSION, args.size, uuids, targets)
                results[name] = train(by_reader, classes, args)
                local = WORK / "train-local-cache"
                shutil.rmtree(local, ignore_errors=True)
                copy_arrays(bench.arrays(args.size), local / VERSION / str(args.size), uuids)
            decodes[name] = int(bench.stats()["decodes"])
        finally:
            bench.remove()

    print("training: unmodified dataset, np.load of a local directory", file=sys.stderr)
    plain = ShardedCacheDataset(
        WORK / "train-local-cache", VERSION, args.size, originals, labels, fallbacks
    )
    results["unmodified dataset, np.load of a local directory"] = train(plain, classes, args)
    shutil.rmtree(WORK / "train-local-cache", ignore_errors=True)
    print(render(results, decodes, fallbacks.value, args))
    if fallbacks.value:
        raise SystemExit("the unmodified dataset fell back to its own decode on the mount")


def copy_arrays(mounted: Path, local: Path, uuids: list[str]) -> None:
    """The same .npy files, in the sharded layout, on a plain local directory."""
    for uuid in uuids:
        target = local / uuid[:2] / f"{uuid}.npy"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((mounted / f"{uuid}.npy").read_bytes())


def render(
    results: dict[str, tuple[list[float], list[float]]],
    decodes: dict[str, int],
    fallbacks: int,
    args: argparse.Namespace,
) -> str:
    epochs = range(1, args.epochs + 1)
    lines = [
        f"corpus: {args.count} photo-like JPEGs of {args.width}x{args.height}, size {args.size}, "
        f"batch {args.batch}, {args.workers} DataLoader workers, {args.epochs} epochs; "
        f"torch {torch.__version__}, Pillow {PIL.__version__}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "",
        "| data path | " + " | ".join(f"epoch {e} (s)" for e in epochs) + " | final loss |",
        "| --- | " + " | ".join("---:" for _ in epochs) + " | ---: |",
    ]
    for name, (seconds, losses) in results.items():
        cells = " | ".join(f"{s:.2f}" for s in seconds)
        lines.append(f"| {name} | {cells} | {losses[-1]:.4f} |")

    def later(name: str) -> float:
        """The mean of epochs 2 and later: a warm store, a warm page cache."""
        return statistics.mean(results[name][0][1:]) if args.epochs > 1 else results[name][0][0]

    local = later("unmodified dataset, np.load of a local directory")
    mount = later("unmodified dataset, np.load via the mount")
    reader = later("MountDataset (read_array)")
    live = later("live decode (LiveDataset)")
    reference = results["live decode (LiveDataset)"][1]
    worst = max(
        max(abs(a - b) for a, b in zip(reference, losses, strict=True))
        for _, losses in results.values()
    )
    lines += [
        "",
        "| ratio (epochs 2+, time per epoch) | value |",
        "| --- | ---: |",
        f"| unmodified dataset via the mount / the same over a local directory | "
        f"{mount / local:.2f}x |",
        f"| MountDataset / unmodified dataset over a local directory | {reader / local:.2f}x |",
        f"| live decode / unmodified dataset via the mount | {live / mount:.1f}x |",
        f"| live decode / MountDataset | {live / reader:.1f}x |",
        "",
        f"largest difference between the loss curves ({len(reference)} batches each): {worst}",
        f"fallbacks to its own decode of the unmodified dataset on the mount: {fallbacks}",
        "daemon decodes: "
        + ", ".join(
            f"{name}: {count} for {args.count} originals" for name, count in decodes.items()
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
