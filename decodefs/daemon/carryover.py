"""What a serving process leaves the next one of its mount: the entries it verified.

Every entry is checked before it is first served in the mount's life, not
in each serving process's: a reload or restart would otherwise verify every
array again, and its first epoch would read the store twice. A serving
process writes what it verified to the mount's state directory now and then
and when it drains; the next one takes it, by inode number (positions move
when originals come and go), for versions decoded as they were. Knows the
known bits and the numbers; not how an entry is checked.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import secrets
from collections.abc import Collection, Mapping
from typing import Final

import numpy as np

from ..common.trusted import CREATE_FLAGS, DIRECTORY_FLAGS, READ_FLAGS
from .known import KnownEntries
from .numbers import MountNumbers

__all__ = ["mark_verified", "read_verified", "save_verified"]

log = logging.getLogger(__name__)

_FILE: Final = "verified.json"


def save_verified(
    state_dir: str, known: KnownEntries, numbers: MountNumbers, digests: Mapping[str, str]
) -> None:
    """Write which entries this process knows verified (blocking: a worker thread)."""
    value: dict[str, dict[str, object]] = {}
    for (version, size), bitmap in list(known.verified.items()):
        version_numbers = numbers.versions.get(version)
        if version_numbers is None:
            continue
        by_position = np.unpackbits(np.frombuffer(bitmap.bits, np.uint8), bitorder="little")
        positions = np.flatnonzero(by_position[: len(version_numbers.key_numbers)])
        if not len(positions):
            continue
        key_numbers = np.frombuffer(version_numbers.key_numbers, np.int64)
        by_number = np.zeros(len(version_numbers.key_positions), np.uint8)
        by_number[key_numbers[positions]] = 1
        entry = value.setdefault(version, {"digest": digests.get(version), "sizes": {}})
        packed = np.packbits(by_number, bitorder="little").tobytes()
        entry["sizes"][str(size)] = base64.b64encode(packed).decode()  # type: ignore[index]
    _write(state_dir, value)


def read_verified(state_dir: str) -> dict[str, object]:
    """What the mount's last serving process wrote it verified (blocking: a worker
    thread); nothing if it cannot be read."""
    try:
        return _read(state_dir)
    except (OSError, ValueError) as exc:
        log.warning("not taking what the last serving process verified: %s", exc)
        return {}


def mark_verified(
    value: Mapping[str, object],
    known: KnownEntries,
    numbers: MountNumbers,
    digests: Mapping[str, str],
    stale: Mapping[str, Collection[int]] | None = None,
) -> int:
    """Mark verified (and stored) what ``read_verified`` found, for the versions decoded
    as then (on the trio thread: the bits are its); ``stale``: positions, by version,
    not to take (their originals changed). How many it marked."""
    stale = stale or {}
    marked = 0
    for version, entry in value.items():
        version_numbers = numbers.versions.get(version)
        if version_numbers is None or not isinstance(entry, dict):
            continue
        if entry.get("digest") != digests.get(version):
            continue  # decoded another way since: nothing verified then holds
        key_positions = np.frombuffer(version_numbers.key_positions, np.int64)
        skip = np.fromiter(stale.get(version, ()), np.int64)
        for size_name, text in dict(entry.get("sizes", {})).items():
            try:
                size = int(size_name)
                by_number = np.unpackbits(
                    np.frombuffer(base64.b64decode(text, validate=True), np.uint8),
                    bitorder="little",
                )[: len(key_positions)]
            except (ValueError, TypeError):
                continue
            positions = key_positions[np.flatnonzero(by_number)]
            positions = positions[positions >= 0]
            if len(skip):
                positions = np.setdiff1d(positions, skip)
            verified = known.verified_map(version, size)
            stored = known.stored_map(version, size)
            for bitmap in (verified, stored):
                bits = np.unpackbits(np.frombuffer(bitmap.bits, np.uint8), bitorder="little")
                bits[positions] = 1
                bitmap.bits[:] = np.packbits(bits, bitorder="little").tobytes()
            marked += len(positions)
    return marked


def _read(state_dir: str) -> dict[str, object]:
    directory = os.open(state_dir, DIRECTORY_FLAGS)
    try:
        fd = os.open(_FILE, READ_FLAGS, dir_fd=directory)
    except FileNotFoundError:
        return {}
    finally:
        os.close(directory)
    with open(fd, "rb") as f:
        value = json.loads(f.read())
    if not isinstance(value, dict):
        raise ValueError(f"{_FILE} is not an object")
    return value


def _write(state_dir: str, value: dict[str, dict[str, object]]) -> None:
    directory = os.open(state_dir, DIRECTORY_FLAGS)
    tmp = f".{_FILE}.{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | CREATE_FLAGS, 0o600, dir_fd=directory)
        with open(fd, "w", encoding="utf-8") as f:
            json.dump(value, f)
        os.replace(tmp, _FILE, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=directory)
        raise
    finally:
        os.close(directory)
