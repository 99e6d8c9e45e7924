"""The per-user admission limit: how many requests of one user may wait for decodes at once.

One user's flood of cold opens must never take the request tasks that every
other request (hits, closes, stats) needs: past ``per_user`` waiting requests
of that user, the next is refused at once (UserBusy, which the fs layer answers
EAGAIN). The daemon's own user is never limited. Runs on the trio thread only;
it knows nothing of decodes, the store or FUSE.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Iterator
from typing import Final

from ..common.metrics import LogThrottle, Metrics

__all__ = ["WAITING_PER_USER", "Admission", "UserBusy"]

log = logging.getLogger(__name__)

# Requests of one other user that may wait for a decode at once: a quarter of the
# daemon's request tasks (fs.MAX_REQUEST_TASKS, 512), so that one user's flood of cold
# opens can never take the tasks every other request (hits, closes, stats) needs.
WAITING_PER_USER: Final = 128


class UserBusy(Exception):
    """Another user already has WAITING_PER_USER requests waiting for decodes (EAGAIN)."""


class Admission:
    """Counts each user's requests waiting for a decode; refuses past ``per_user``."""

    def __init__(self, metrics: Metrics, per_user: int = WAITING_PER_USER) -> None:
        self.per_user = per_user
        self._metrics = metrics
        self._waiting_by: collections.Counter[int] = collections.Counter()
        self._throttle = LogThrottle(log)

    @contextlib.contextmanager
    def waiting(self, uid: int | None) -> Iterator[None]:
        """Count a request of ``uid`` (None: the daemon's own user) waiting for a decode;
        past ``per_user`` of that user's, raise UserBusy at once instead."""
        if uid is None:
            yield
            return
        if self._waiting_by[uid] >= self.per_user:
            self._metrics.errors["EAGAIN"] += 1
            self._throttle.log(
                logging.WARNING,
                f"busy-{uid}",
                "uid %d already has %d requests waiting for decodes; answering EAGAIN",
                uid,
                self._waiting_by[uid],
            )
            raise UserBusy(uid)
        self._waiting_by[uid] += 1
        try:
            yield
        finally:
            self._waiting_by[uid] -= 1
            if not self._waiting_by[uid]:
                del self._waiting_by[uid]
