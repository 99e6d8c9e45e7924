"""Read every array under a mounted <version>/<size>/ directory, epoch after epoch.

Epoch 1 decodes (np.load through the mount), epoch 2 reads stored arrays
(np.load, the kernel's page cache), epoch 3 uses decodefs.read_array. Prints
each epoch's time and rate, and checks that the arrays are exactly what
decodefs.decode_image returns for their originals (max |mount - live| == 0).

    python scripts/epochs.py MOUNT/v1/224 --originals DIR [--check N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

from decodefs import decode_image, read_array


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path, help="a <mount>/<version>/<size> directory")
    parser.add_argument(
        "--originals", type=Path, required=True, help="the version's source directory"
    )
    parser.add_argument(
        "--check", type=int, default=4, help="how many arrays to compare with a live decode"
    )
    args = parser.parse_args()

    files = sorted(args.directory.glob("*.npy"))
    if not files:
        raise SystemExit(f"no .npy files under {args.directory}")
    size = int(args.directory.name)
    epochs: list[tuple[str, Callable[[Path], npt.NDArray[np.uint8]]]] = [
        ("epoch 1, np.load   ", np.load),
        ("epoch 2, np.load   ", np.load),
        ("epoch 3, read_array", read_array),
    ]
    for label, load in epochs:
        started = time.perf_counter()
        for path in files:
            array = load(path)
            assert array.shape == (size, size, 3) and array.dtype == np.uint8, path
        seconds = time.perf_counter() - started
        rate = len(files) / seconds
        print(f"{label}: {len(files)} arrays in {seconds:7.3f} s  ({rate:9.1f} arrays/s)")

    originals = {p.stem: p for p in args.originals.rglob("*") if p.is_file()}
    worst = 0
    for path in files[: args.check]:
        live = decode_image(originals[path.stem], size)
        worst = max(worst, int(np.abs(np.load(path).astype(np.int16) - live).max()))
    print(f"max |mount - live decode| over {min(args.check, len(files))} arrays: {worst}")
    if worst:
        raise SystemExit("the mount served different pixels than the live decode")


if __name__ == "__main__":
    main()
