"""Waiting on a condition with a deadline that says what it last saw, never a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T], done: Callable[[T], bool], timeout: float = 30.0, what: str = ""
) -> T:
    """Call ``probe`` until ``done`` holds for its value; that value, or AssertionError
    naming the last value seen after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout} s, still {value!r} ({what or 'waiting'})")
        time.sleep(0.02)
