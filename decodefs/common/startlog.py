"""A mount's log lines held back until it is live: a mistake is one line, not a log.

The holder and the mount's first serving process hold their log records from
the moment they start until the mount is live, then write them all (the
journal keeps everything); if the mount never becomes live, they are dropped
and the one reason is said instead (``decodefs: error: ...``). Knows logging,
nothing of mounts.
"""

from __future__ import annotations

import logging
import sys
from logging.handlers import MemoryHandler
from typing import Final

__all__ = ["HeldLog", "log_format"]

LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_HELD_MAX: Final = 10_000  # records held; more than that are written as they come


def log_format() -> logging.Formatter:
    return logging.Formatter(LOG_FORMAT)


class HeldLog:
    """The root logger's records, held (``hold=True``) until ``release`` or ``drop``."""

    def __init__(self, level: str, *, hold: bool) -> None:
        self._stream = logging.StreamHandler(sys.stderr)
        self._stream.setFormatter(log_format())
        root = logging.getLogger()
        root.setLevel(level.upper())
        self._held: MemoryHandler | None = None
        if hold:
            # flushLevel above CRITICAL: nothing is written before release().
            self._held = MemoryHandler(_HELD_MAX, logging.CRITICAL + 1, self._stream)
            root.addHandler(self._held)
        else:
            root.addHandler(self._stream)

    def release(self) -> None:
        """Write what was held, and from now on write as records come."""
        held, self._held = self._held, None
        if held is not None:
            root = logging.getLogger()
            root.addHandler(self._stream)
            root.removeHandler(held)
            held.flush()
            held.close()

    def drop(self) -> None:
        """Forget what was held (the one reason is said instead); write from now on."""
        held, self._held = self._held, None
        if held is not None:
            root = logging.getLogger()
            held.buffer.clear()
            root.addHandler(self._stream)
            root.removeHandler(held)
            held.close()
