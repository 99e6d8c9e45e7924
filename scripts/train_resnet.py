"""Train a ResNet-50-shaped network from four data paths; images/s and how busy the device was.

The network is defined here (no torchvision): ResNet-50's shape (a 7x7 stem,
bottleneck stages of 3, 4, 6 and 3 blocks, expansion 4), --width channels in
the first stage (64 is ResNet-50; the default 8 keeps a CPU run short). Each
path trains a fresh copy from one seed, --epochs epochs of at most --steps
steps, batches of --batch uint8 images normalised on the device:

  live     LiveDataset in a DataLoader (--workers workers decode the originals)
  npload   a plain np.load dataset over <mount>/<version>/<size>/ in a DataLoader
  mount    MountDataset in a DataLoader with collate_uint8
  batch    BatchLoader over the same MountDataset (--workers threads)

Per epoch: images/s, and the busy fraction: the time in training steps (forward,
backward, optimizer step; synchronised on CUDA) over the epoch's time, the rest
being the wait for the next batch and its copy to the device. --device cuda
runs the same on a GPU, with pinned batches and non_blocking copies.

Reads an existing mount (--mount, --config, --version), or makes one: --count
photo-like JPEGs (kept under /tmp/decodefs-bench) mounted for the run.

    .venv/bin/python scripts/train_resnet.py [--device cpu|cuda] [--width 8] [--epochs 2] \\
        [--steps 20] [--batch 32] [--size 128] [--workers 2] [--count 400]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from decodefs import list_keys
from decodefs.torch import BatchLoader, LiveDataset, MountDataset, collate_uint8

SEED = 0
CLASSES = 10
PATHS = ("live", "npload", "mount", "batch")
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(inputs, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, out, 1, stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet50Shape(nn.Module):
    """ResNet-50's layout; ``width`` 64 is ResNet-50 itself."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(3, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        ]
        inputs = width
        for stage, blocks in enumerate((3, 4, 6, 3)):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(Bottleneck(inputs, width * 2**stage, stride))
                inputs = width * 2**stage * Bottleneck.expansion
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class NpLoadDataset(Dataset[tuple[torch.Tensor, int]]):
    """What a user writes for a directory of .npy files: np.load, nothing else."""

    def __init__(self, directory: str, keys: list[str], targets: list[int]) -> None:
        self.paths = [os.path.join(directory, f"{key}.npy") for key in keys]
        self.targets = targets

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.load(self.paths[index])), self.targets[index]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda when a GPU is present")
    parser.add_argument("--width", type=int, default=8, help="64 is ResNet-50")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="at most, per epoch")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers, or threads")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--mount", type=Path, help="an existing mount (with --config, --version)")
    parser.add_argument("--config", type=Path)
    parser.add_argument("--version", default="bench")
    parser.add_argument("--count", type=int, default=400, help="JPEGs, without --mount")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    with _mounted(args) as (mountpoint, config, version):
        keys = list_keys(mountpoint, version, args.size)
        targets = [i % CLASSES for i in range(len(keys))]
        print(
            f"{len(keys)} images of {args.size}, batch {args.batch}, width {args.width}, "
            f"{args.workers} workers, device {device}; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        print("| path | epoch | images/s | busy |\n| --- | ---: | ---: | ---: |", flush=True)
        for name in args.paths:
            loader = _loader(name, mountpoint, config, version, keys, targets, args, device)
            _train(name, loader, args, device)


def _loader(
    name: str,
    mountpoint: Path,
    config: Path,
    version: str,
    keys: list[str],
    targets: list[int],
    args: argparse.Namespace,
    device: torch.device,
) -> Iterable[tuple[torch.Tensor, Any]]:
    pin = device.type == "cuda"
    generator = torch.Generator().manual_seed(SEED)
    if name == "batch":
        dataset = MountDataset(mountpoint, version, args.size, keys, targets=targets)
        return BatchLoader(
            dataset,
            batch_size=args.batch,
            shuffle=True,
            threads=args.workers,
            pin_memory=pin,
            generator=generator,
        )
    data: Dataset[Any]
    collate: Any = collate_uint8
    if name == "live":
        data = LiveDataset(config, version, args.size, keys, targets=targets)
    elif name == "mount":
        data = MountDataset(mountpoint, version, args.size, keys, targets=targets)
    else:
        data = NpLoadDataset(str(mountpoint / version / str(args.size)), keys, targets)
        collate = None  # torch's default collate, as such a dataset is usually used
    return DataLoader(
        data,
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        collate_fn=collate,
        pin_memory=pin,
        generator=generator,
    )


def _train(
    name: str,
    loader: Iterable[tuple[torch.Tensor, Any]],
    args: argparse.Namespace,
    device: torch.device,
) -> None:
    torch.manual_seed(SEED)
    model = ResNet50Shape(args.width, CLASSES).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    for epoch in range(1, args.epochs + 1):
        images_seen, busy = 0, 0.0
        started = time.perf_counter()
        batches: Iterator[tuple[torch.Tensor, Any]] = iter(loader)
        for _ in range(args.steps):
            batch = next(batches, None)
            if batch is None:
                break
            images, labels = batch
            x = images.to(device, non_blocking=True).permute(0, 3, 1, 2).float()
            x = (x - mean) / std
            y = torch.as_tensor(labels).to(device, non_blocking=True)
            step = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            busy += time.perf_counter() - step
            images_seen += len(images)
        with contextlib.suppress(AttributeError):
            batches.close()  # type: ignore[attr-defined]  # a BatchLoader epoch's threads end
        del batches
        seconds = time.perf_counter() - started
        print(
            f"| {name} | {epoch} | {images_seen / seconds:,.1f} | {busy / seconds:.2f} |",
            flush=True,
        )


@contextlib.contextmanager
def _mounted(args: argparse.Namespace) -> Iterator[tuple[Path, Path, str]]:
    if args.mount is not None:
        if args.config is None:
            raise SystemExit("train_resnet.py: --mount needs --config (for the live decode)")
        yield args.mount, args.config, args.version
        return
    from benchlib import VERSION, WORK, BenchMount  # the benchmarks' own mount

    from decodefs.sample import make_sample_corpus

    originals = WORK / f"train-originals-{args.count}"
    make_sample_corpus(originals, args.count, 640, 480, seed=29)
    bench = BenchMount(originals, [args.size])
    try:
        bench.mount()
        yield bench.mountpoint, bench.config, VERSION
    finally:
        bench.remove()


if __name__ == "__main__":
    main()
