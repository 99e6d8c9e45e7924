"""What the parts check a mount and a store against: the reference decode, checked reads
and their tally, and the store's files against its catalog. It mounts nothing."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import hashlib
import os
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from decodefs import DecodeError, decode_image, npy_file_size, npy_header, read_array
from tests.helpers import decodefs

from .harness import VERSION, Daemon

METHODS: Final = ("np.load", "open().read()", "read_array")


class Reference:
    """sha256 of the pixels ``decode_image`` gives an original at a size (None: DecodeError),
    computed once."""

    def __init__(self) -> None:
        self._digests: dict[tuple[str, int], str | None] = {}
        self._lock = threading.Lock()

    def digest(self, path: Path, size: int) -> str | None:
        key = (str(path), size)
        with self._lock:
            if key in self._digests:
                return self._digests[key]
        try:
            value: str | None = pixels_digest(decode_image(path, size))
        except DecodeError:
            value = None
        with self._lock:
            self._digests[key] = value
        return value

    def fill(self, paths: Sequence[Path], size: int, workers: int = 2) -> list[str | None]:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # Pillow drops the GIL
            return list(pool.map(lambda p: self.digest(p, size), paths))


def pixels_digest(array: npt.NDArray[np.uint8]) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def read_digest(method: str, path: str, size: int) -> str:
    """sha256 of the pixels read from ``path`` with ``method``. Raises OSError for a failed
    read, ValueError if the bytes are not the .npy file of a uint8 (size, size, 3) array."""
    if method == "open().read()":
        with open(path, "rb") as f:
            data = f.read()
        header = npy_header(size)
        if len(data) != npy_file_size(size) or not data.startswith(header):
            raise ValueError(f"{len(data)} bytes, not the .npy file of a {size} array")
        return hashlib.sha256(memoryview(data)[len(header) :]).hexdigest()
    array = np.load(path) if method == "np.load" else read_array(path)
    if array.shape != (size, size, 3) or array.dtype != np.uint8:
        raise ValueError(f"read {array.dtype}{array.shape}")
    return pixels_digest(array)


def errno_name(exc: OSError) -> str:
    """EIO, ENOENT, ...; the exception's class name if it carries no errno."""
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


@dataclass
class Tally:
    """Outcomes of checked reads: "ok", "wrong", or the error (an errno name, or the class
    of any other exception)."""

    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    examples: list[str] = field(default_factory=list)

    @property
    def reads(self) -> int:
        return sum(self.outcomes.values())

    @property
    def bad(self) -> int:
        return self.reads - self.outcomes["ok"]

    def check(self, method: str, path: Path, size: int, want: str | None) -> str:
        """Read ``path`` and count the outcome; ``want`` None: an error is expected, so any
        array read counts as "wrong"."""
        try:
            got = read_digest(method, str(path), size)
        except OSError as exc:
            outcome = errno_name(exc)
        except Exception as exc:
            outcome = type(exc).__name__
        else:
            outcome = "ok" if got == want else "wrong"
        self.outcomes[outcome] += 1
        if outcome != "ok" and len(self.examples) < 5:
            self.examples.append(f"{method} {path}: {outcome}")
        return outcome

    def summary(self) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in sorted(self.outcomes.items())) or "none"


def read_all(
    tally: Tally,
    daemon: Daemon,
    ref: Reference,
    originals: Sequence[Path],
    size: int,
    version: str = VERSION,
) -> None:
    """Read each original's array at ``size`` once, the methods taking turns."""
    for i, original in enumerate(originals):
        method = METHODS[i % len(METHODS)]
        tally.check(
            method, daemon.path(original.stem, size, version), size, ref.digest(original, size)
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The value below which a share ``q`` of ``values`` lies (nearest rank); 0 if none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the store, as a finished run must leave it -----------------------------------------


def store_files(store: Path, version: str = VERSION) -> set[tuple[str, int, str]]:
    """(version, size, uuid) of every entry file under the store."""
    found = set()
    for path in (store / version).glob("*/*/*.npy"):
        with contextlib.suppress(ValueError):
            found.add((version, int(path.parts[-3]), path.stem))
    return found


def catalog_rows(store: Path) -> set[tuple[str, int, str]]:
    """(version, size, uuid) of every row of the store's catalog."""
    db = sqlite3.connect(store / ".catalog.sqlite3", timeout=30)
    try:
        rows = db.execute("SELECT version, size, uuid FROM entries").fetchall()
    finally:
        db.close()
    return {(v, s, os.fsdecode(bytes(u))) for v, s, u in rows}


def temp_files(store: Path) -> int:
    """Files in the store's temp directory (writes not finished)."""
    with contextlib.suppress(FileNotFoundError):
        return len(os.listdir(store / ".tmp"))
    return 0


@dataclass(frozen=True)
class StoreAccount:
    """A store's entry files against its catalog rows (and the temp files left)."""

    files: int
    rows: int
    files_without_row: int  # breaks the capacity limit: the store holds what it does not count
    rows_without_file: int  # by design after a kill -9 (a row is synced before its rename)
    temp: int

    @classmethod
    def of(cls, store: Path) -> StoreAccount:
        files, rows = store_files(store), catalog_rows(store)
        return cls(len(files), len(rows), len(files - rows), len(rows - files), temp_files(store))


def verify_store(daemon: Daemon) -> tuple[int, str]:
    """`decodefs verify CONFIG`: (exit status, its summary line)."""
    result = decodefs("verify", daemon.config, timeout=600)
    lines = result.stdout.strip().splitlines()
    return result.returncode, lines[-1] if lines else result.stderr.strip()
