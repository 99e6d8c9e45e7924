"""The store's change token (protocol.CHANGES_FILE): eight bytes the daemon rewrites, at
random, after it unlinks, replaces or gives other readers any entry file, so that a
reader holding entry files open (client/batch.py) learns whether any may have changed
from one read of 8 bytes per batch instead of a ``stat`` per file. A token that cannot
be written is emptied: a reader then stats every file. Knows the file, nothing of
entries or readers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

from ..common.protocol import CHANGES_FILE

__all__ = ["ChangeToken"]

log = logging.getLogger(__name__)


class ChangeToken:
    """The token file of one store directory, once opened; ``note`` after every change."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._lock = threading.Lock()

    def open(self, root: int, mode: int = 0o644) -> None:
        """Use (or make) the token file of the store directory ``root``, with a new token:
        a new serving process may not know what changed before it. Of ``mode`` (readable
        by whoever reads entries straight from the store), written by the daemon alone."""
        try:
            fd = os.open(
                CHANGES_FILE,
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                mode,
                dir_fd=root,
            )
        except OSError as exc:
            log.warning(
                "cannot open the store's %s (readers then stat each file): %s", CHANGES_FILE, exc
            )
            return
        try:
            os.fchmod(fd, mode)
        except OSError as exc:
            log.warning("cannot set the mode of the store's %s: %s", CHANGES_FILE, exc)
        with self._lock:
            old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)
        self.note()

    def note(self) -> None:
        """An entry file was unlinked, replaced or given other readers: a new token."""
        with self._lock:
            if self._fd is None:
                return
            try:
                os.pwrite(self._fd, os.urandom(8), 0)
            except OSError as exc:  # (a full tmpfs): no token, rather than an old one
                log.warning(
                    "cannot write the store's %s (readers stat each file): %s", CHANGES_FILE, exc
                )
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, 0)

    def close(self) -> None:
        """No more changes are noted here (the store is closed, or gone)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
