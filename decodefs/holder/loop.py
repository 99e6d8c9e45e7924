"""The holder's one event loop: descriptors watched with epoll, and named timers.

Every handler runs to completion on the one thread; nothing here blocks but the
wait for the next event. Knows descriptors and deadlines, not what they mean.
"""

from __future__ import annotations

import contextlib
import select
import time
from collections.abc import Callable

__all__ = ["EventLoop"]

Handler = Callable[[int], None]  # called with the epoll event mask


class EventLoop:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._epoll = select.epoll()
        self._handlers: dict[int, Handler] = {}
        self._timers: dict[str, tuple[float, Callable[[], None]]] = {}

    def watch(self, fd: int, handler: Handler, events: int = select.EPOLLIN) -> None:
        """Call ``handler`` when ``fd`` has ``events`` (0: errors and hang-ups only)."""
        self._epoll.register(fd, events)
        self._handlers[fd] = handler

    def modify(self, fd: int, events: int) -> None:
        self._epoll.modify(fd, events)

    def unwatch(self, fd: int) -> None:
        if self._handlers.pop(fd, None) is not None:
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(fd)

    def at(self, name: str, delay: float, action: Callable[[], None]) -> None:
        """Run ``action`` in ``delay`` seconds (replacing the timer of that name)."""
        self._timers[name] = (self.clock() + delay, action)

    def every(self, name: str, interval: float, action: Callable[[], None]) -> None:
        """Run ``action`` every ``interval`` seconds until the timer ``name`` is cancelled
        (by the action too) or replaced."""

        def tick() -> None:
            self.at(name, interval, tick)  # first: the action may cancel it
            action()

        self.at(name, interval, tick)

    def cancel(self, name: str) -> None:
        self._timers.pop(name, None)

    def cancel_matching(self, suffix: str) -> None:
        for name in [n for n in self._timers if n.endswith(suffix)]:
            del self._timers[name]

    def pending(self, name: str) -> float | None:
        """Seconds until the timer ``name`` fires, or None if there is none."""
        timer = self._timers.get(name)
        return None if timer is None else max(0.0, timer[0] - self.clock())

    def step(self) -> None:
        """Wait for the next event or timer (at most a minute), and handle what is due."""
        now = self.clock()
        due = min((deadline for deadline, _ in self._timers.values()), default=now + 60)
        try:
            events = self._epoll.poll(max(0.0, due - now))
        except InterruptedError:
            events = []
        for fd, mask in events:
            handler = self._handlers.get(fd)
            if handler is not None:
                handler(mask)
        now = self.clock()
        for name, (deadline, action) in list(self._timers.items()):
            # Still the same timer (a handler above may have replaced or cancelled it).
            if deadline <= now and self._timers.get(name, (None,))[0] == deadline:
                del self._timers[name]
                action()

    def close(self) -> None:
        self._epoll.close()
