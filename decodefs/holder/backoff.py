"""When a serving process that died is started again: at once, unless it keeps dying.

A crash now and then (the OOM killer, a bug one request hits) is answered by
a new serving process at once, and the readers only pause. A process that
dies again and again soon after it starts (a broken upgrade, a config that no
longer loads, a request that kills every process it reaches) is started
again after a delay that doubles with each crash, up to a minute; while it
waits the holder answers EIO, so the mount stays up and each read fails
alone rather than the mount vanishing. Crashes older than the window are
forgotten, and so is every crash before one of a process that had served
well for a while (``forget``). The clock is injected; nothing else is done here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Final

__all__ = ["CrashBackoff"]

WINDOW: Final = 60.0  # seconds a crash counts towards a crash loop
HEALTHY: Final = 10.0  # seconds of serving after which a process's death is a one-off
FREE_CRASHES: Final = 2  # crashes in the window restarted at once
FIRST_DELAY: Final = 1.0
MAX_DELAY: Final = 60.0


class CrashBackoff:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._recent: deque[float] = deque()

    def crashed(self) -> float:
        """Note a crash now; how long to wait before starting a new serving process."""
        now = self._clock()
        self._recent.append(now)
        self._forget_before(now - WINDOW)
        beyond = len(self._recent) - FREE_CRASHES
        if beyond <= 0:
            return 0.0
        return float(min(FIRST_DELAY * 2.0 ** (beyond - 1), MAX_DELAY))

    def forget(self) -> None:
        """A process served well before it died: what came before is no crash loop."""
        self._recent.clear()

    @property
    def recent(self) -> int:
        """Crashes within the window, as of now."""
        self._forget_before(self._clock() - WINDOW)
        return len(self._recent)

    def _forget_before(self, cutoff: float) -> None:
        while self._recent and self._recent[0] < cutoff:
            self._recent.popleft()
