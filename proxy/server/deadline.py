"""A deadline for a wait that restarts often: one loop timer, looked at when it fires.

A transport's read timeout arms a timer per read (about 3 µs a chunk). The data paths
instead note when their current wait began (a float of their own) and derive from
`Deadline`: when its timer fires, `time_left` acts on a wait that reached its limit and
says how long the current one has left (None: nothing to wait for, or it acted), and the
timer re-arms for the rest. One home for the idle, first-byte and body timers of the
wire's request (proxy/server/wire/connection.py), the ASGI relay's response
(proxy/server/exchange.py `IdleTimer`) and the WebSocket pipe (proxy/server/tunnel/pipe.py).

A base class, not an object the owner holds: an object holding the owner's bound method
would make a reference cycle per request, and a request's buffers would wait for the
garbage collector (a relay of 6 MiB events grew by 54 MiB that way).
"""

from __future__ import annotations

import asyncio

#: Loop timers may fire a little early: a wait is never looked at again sooner than this.
LEAST_DELAY = 0.001


class Deadline:
    __slots__ = ("deadline",)

    def __init__(self) -> None:
        self.deadline: asyncio.TimerHandle | None = None

    def time_left(self) -> float | None:
        """Act on a wait that reached its limit; else the seconds it has left (None:
        nothing to wait for)."""
        raise NotImplementedError

    def due_within(self, delay: float) -> None:
        """Look within `delay` seconds from now (a look due sooner stands)."""
        handle = self.deadline
        loop = asyncio.get_running_loop()
        if handle is not None:
            if handle.when() <= loop.time() + delay:
                return
            handle.cancel()
        self.deadline = loop.call_later(delay, self._fire)

    def cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _fire(self) -> None:
        self.deadline = None
        left = self.time_left()
        if left is not None:
            self.due_within(max(left, LEAST_DELAY))
