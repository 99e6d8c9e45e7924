"""`decodefs verify`: check every stored entry offline; report, and optionally remove, bad ones.

Works on a live store (read-only checks) or, with ``remove``, on a store no
daemon holds. It never discards a version wholesale, as the daemon does when
decode settings change: it reports such entries as stale, entry by entry.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from .catalog import Catalog
from .decode import npy_layout_problem
from .store import CATALOG_FILE, STALE, TRAILER_SIZE, EntryKey, check_entry, iter_entry_files

__all__ = ["VerifyReport", "recorded_digests", "verify_store"]


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    bad: dict[str, str] = field(default_factory=dict)  # path -> reason
    removed: int = 0

    @property
    def stale(self) -> int:
        return sum(1 for reason in self.bad.values() if reason == STALE)


class StoreBusy(Exception):
    """A daemon holds the store, so entries may not be removed now."""


def recorded_digests(root: Path) -> dict[str, bytes]:
    """version -> fingerprint digest, from the store's own .fingerprint.json markers."""
    digests = {}
    for marker in sorted(root.glob("*/.fingerprint.json")):
        try:
            recorded = json.loads(marker.read_text())
            digests[marker.parent.name] = bytes.fromhex(recorded["digest"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return digests


def verify_store(
    root: Path, digests: Mapping[str, bytes], remove: bool = False, progress: bool = True
) -> VerifyReport:
    """Check every entry of ``digests``' versions under ``root``."""
    report = VerifyReport()
    with _exclusive(root) if remove else _nothing():
        catalog = _catalog(root) if remove else None
        entries = list(iter_entry_files(str(root), digests))
        for key, path in tqdm(entries, unit="entry", disable=not progress, mininterval=0.5):
            report.checked += 1
            problem = _problem(key, path, digests[key.version])
            if problem is None:
                report.ok += 1
                continue
            report.bad[path] = problem
            if remove:
                try:
                    os.unlink(path)
                except OSError:
                    continue
                if catalog is not None:
                    catalog.remove(key.version, key.size, key.uuid)
                report.removed += 1
        if catalog is not None:
            catalog.close()
    return report


def _problem(key: EntryKey, path: str, digest: bytes) -> str | None:
    try:
        with open(path, "rb", buffering=0) as f:
            data = f.read()
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    payload = memoryview(data)[: len(data) - TRAILER_SIZE]
    return check_entry(key, data, digest) or npy_layout_problem(payload, key.size)


def _catalog(root: Path) -> Catalog | None:
    path = root / CATALOG_FILE
    return Catalog.open(str(path))[0] if path.exists() else None


@contextmanager
def _exclusive(root: Path) -> Iterator[None]:
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreBusy(
                f"a decodefs daemon is using {root}; stop it to remove entries "
                "(verify without --remove works while it runs)"
            ) from None
        yield
    finally:
        os.close(fd)


@contextmanager
def _nothing() -> Iterator[None]:
    yield
