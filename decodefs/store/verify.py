"""`decodefs verify`: check every stored entry offline; report, and optionally remove, bad ones.

Works on a live store (read-only checks) or, with ``remove``, on a store no
daemon holds. It never discards a version wholesale, as the daemon does when
decode settings change: it reports such entries as stale, entry by entry.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..common.entry import STALE, EntryKey, check_entry_file
from ..common.trusted import READ_FLAGS, opened_directory
from .catalog import Catalog
from .changes import ChangeToken
from .fingerprints import recorded_digest
from .store import CATALOG_FILE, StoreInUse, lock_store
from .walk import iter_entries

__all__ = ["StoreBusy", "VerifyReport", "recorded_digests", "verify_store"]


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

    def __init__(self, message: str, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid  # the pid holding the store's lock, if known


def recorded_digests(root: Path) -> dict[str, bytes]:
    """version -> fingerprint digest, from the store's own .fingerprint.json markers."""
    digests = {}
    with opened_directory(root) as fd:
        with os.scandir(fd) as it:
            versions = [
                e.name for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            ]
        for version in sorted(versions):
            digest = recorded_digest(fd, version)
            if digest is not None:
                digests[version] = digest
    return digests


def verify_store(
    root: Path, digests: Mapping[str, bytes], remove: bool = False, progress: bool = True
) -> VerifyReport:
    """Check every entry of ``digests``' versions under ``root``."""
    report = VerifyReport()
    with opened_directory(root) as fd, _exclusive(fd) if remove else contextlib.nullcontext():
        catalog = _catalog(root) if remove else None
        entries = [key for key, _ in iter_entries(fd, digests)]
        for key in tqdm(entries, unit="entry", disable=not progress, mininterval=0.5):
            report.checked += 1
            problem = _problem(fd, key, digests[key.version])
            if problem is None:
                report.ok += 1
                continue
            report.bad[str(root / key.relpath)] = problem
            if remove:
                try:
                    os.unlink(key.relpath, dir_fd=fd)
                except OSError:
                    continue
                if catalog is not None:
                    catalog.remove(key.version, key.size, key.key)
                report.removed += 1
        if catalog is not None:
            catalog.close()
        if report.removed:  # for readers still holding entry files of an earlier mount
            token = ChangeToken()
            token.open(fd)
            token.close()
    return report


def _problem(root: int, key: EntryKey, digest: bytes) -> str | None:
    try:
        fd = os.open(key.relpath, READ_FLAGS, dir_fd=root)
        try:
            checked = check_entry_file(fd, key, digest)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    return None if checked.ok else checked.reason


def _catalog(root: Path) -> Catalog | None:
    path = root / CATALOG_FILE
    return Catalog.open(str(path))[0] if path.exists() else None


@contextmanager
def _exclusive(root: int) -> Iterator[None]:
    try:
        lock = lock_store(root)
    except StoreInUse as exc:
        raise StoreBusy(
            "a decodefs daemon is using the store; stop it to remove entries "
            "(verify without --remove works while it runs)",
            exc.holder_pid,
        ) from None
    try:
        yield
    finally:
        os.close(lock)
