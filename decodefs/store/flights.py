"""Claims of a key's decode among the processes that use one store: one decode per key.

Within a process the engine's single-flight map keeps one task per key; while
two serving processes of one mount overlap (one finishing what it had read,
the next already answering), a key both are asked for must still be decoded
once. A claim is a POSIX record lock on one byte, at an offset hashed from
the key, of a file beside the store's lock: it conflicts with other processes
only, and goes with its process if that dies. Knows keys and that file, not
entries or decoding.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Final

import xxhash

from ..common.entry import EntryKey

__all__ = ["FlightClaims"]

# Record lock offsets are signed 64-bit: 62 bits of the key's hash, collisions aside.
_OFFSET_BITS: Final = 62


class FlightClaims:
    """This process's claims on keys of one store, through its own descriptor of the file."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd  # None: no file (a store without a lock): every claim succeeds

    @classmethod
    def beside(cls, lock_fd: int | None) -> FlightClaims:
        """The claims file next to the store's lock file (``<lock>.flights``), opened by
        this process (record locks belong to processes, not descriptors)."""
        if lock_fd is None:
            return cls(None)
        path = os.readlink(f"/proc/self/fd/{lock_fd}") + ".flights"
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        return cls(os.open(path, flags, 0o600))

    def claim(self, key: EntryKey) -> bool:
        """Claim ``key``; False if another process holds it (never waits)."""
        if self._fd is None:
            return True
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _offset(key))
        except (BlockingIOError, PermissionError):
            return False
        return True

    def release(self, key: EntryKey) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _offset(key))

    def close(self) -> None:
        # Closing any descriptor of the file drops every record lock of this process on
        # it: done once, at the end.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _offset(key: EntryKey) -> int:
    return xxhash.xxh3_64_intdigest(os.fsencode(str(key))) >> (64 - _OFFSET_BITS)
