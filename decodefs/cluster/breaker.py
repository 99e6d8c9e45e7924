"""A circuit breaker: after repeated failures, stop calling for a while, then try once.

States: ``closed`` (calls go through; ``threshold`` failures in a row open
it), ``open`` (no calls until the backoff has passed; it doubles with each
failed trial, up to ``max_backoff``), ``half-open`` (one trial call at a
time; its success closes the breaker, its failure opens it again). Time comes
from an injectable clock, so tests drive it. Not thread-safe: call it from
one thread (the trio thread). This module knows nothing of what is called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Literal

__all__ = ["CircuitBreaker", "State"]

State = Literal["closed", "open", "half-open"]
CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half-open"


class CircuitBreaker:
    def __init__(
        self,
        clock: Callable[[], float],
        *,
        threshold: int = 3,
        first_backoff: float = 1.0,
        max_backoff: float = 60.0,
        on_change: Callable[[State, State, str], None] | None = None,
    ) -> None:
        self._clock = clock
        self.threshold = threshold
        self.first_backoff = first_backoff
        self.max_backoff = max(first_backoff, max_backoff)
        self._on_change = on_change
        self.state: State = CLOSED
        self.failures = 0  # in a row
        self.opened = 0  # how often it opened
        self.backoff = first_backoff
        self._retry_at = 0.0
        self._trial = False  # a half-open trial call is under way

    def allow(self) -> bool:
        """Whether a call may go ahead now; the caller reports how it went with
        ``success``, ``failure`` or (neither: cancelled) ``abandon``."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if self._clock() < self._retry_at:
                return False
            self._change(HALF_OPEN, f"trying again after {self.backoff:g} s")
        if self._trial:
            return False
        self._trial = True
        return True

    @property
    def retry_in(self) -> float:
        """Seconds until an open breaker lets a trial call through (0 unless open)."""
        return max(0.0, self._retry_at - self._clock()) if self.state == OPEN else 0.0

    def success(self) -> None:
        self.failures = 0
        self._trial = False
        if self.state != CLOSED:
            self.backoff = self.first_backoff
            self._change(CLOSED, "a call succeeded")

    def failure(self, reason: str) -> None:
        self.failures += 1
        if self.state == HALF_OPEN:
            self._trial = False
            self.backoff = min(self.backoff * 2, self.max_backoff)
            self._open(f"the trial failed ({reason})")
        elif self.state == CLOSED and self.failures >= self.threshold:
            self._open(f"{self.failures} failures in a row, the last: {reason}")

    def abandon(self) -> None:
        """A call that was let through ended without an outcome (cancelled)."""
        self._trial = False

    def _open(self, why: str) -> None:
        self._retry_at = self._clock() + self.backoff
        self.opened += 1
        self._change(OPEN, f"{why}; next try in {self.backoff:g} s")

    def _change(self, state: State, why: str) -> None:
        previous, self.state = self.state, state
        if self._on_change is not None:
            self._on_change(previous, state, why)
