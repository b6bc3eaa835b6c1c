"""A byte pipe between two transports: what one side sends goes to the other, unchanged.

It knows nothing of WebSockets, nor of HTTP; its owner (proxy/server/tunnel/session.py)
hears every read after it went on (`Ends.seen`) and each side's end (`Ends.lost`).

- Holding: the client's bytes wait until `release()`, then go in the order they came. The
  client is read on meanwhile, so a client that leaves before the upstream answered is
  seen at once (and the upstream's connection closed); past `HOLD_BYTES` held its reading
  pauses until `release()`. The upstream's bytes pass `gate` while one is set (the
  owner's, for the answer's head): what it returns goes to the client.
- Backpressure both ways: when one side's write buffer passes its high-water mark,
  reading from the other side pauses until it drains (asyncio's pause/resume_writing).
- Sealing: `write_last` gives a side its last bytes; nothing read afterwards goes to it.
- The idle timer: no byte either way for the timeout, and no side taking bytes from its
  write buffer, calls the owner's `idle`.
- A half-close (`eof`): once the client's bytes flow (`release`), one side ending its
  sending (TCP FIN) is passed on to the other (`write_eof`), which may still answer: a
  WebSocket client that sends its close frame and shuts its sending gets the
  upstream's close frame back, as it would without the proxy. The pipe ends when the
  other side ends too (its FIN or its close), or `close_grace` after the FIN, whether
  the other side could be told (TLS: asyncio writes no EOF there) or not. A FIN
  still closes its side at once, as every FIN did, from a TLS side (asyncio's TLS
  transport does not stay half-open) and before `release` (before the 101 a FIN is an
  end: a client gone before the answer, a refusal whose body runs to the close).
- The end: `close()` closes both sides (buffered bytes are flushed first); a side that
  will not take its last bytes within `close_grace` is aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from time import perf_counter
from typing import Protocol, cast

from proxy.server.backlog import owed, reset
from proxy.server.deadline import Deadline

#: Client bytes held before the upstream's 101 beyond which the client is not read.
HOLD_BYTES = 64 * 1024


class Ends(Protocol):
    """What the pipe tells its owner."""

    def seen(self, from_client: bool, data: bytes, at: float) -> None:
        """A read from one side, after it went to the other (or was held back: sealed).

        `at` is the read's perf_counter(), taken before the bytes went on: a message is
        timed when the proxy had it, not when the process next ran after passing it on
        (a backend that answers within the gap would otherwise seem faster than it is)."""

    def lost(self, client_side: bool, exc: Exception | None) -> None:
        """One side's connection ended; `exc` what ended it, None for a clean close."""


class Pipe(Deadline):
    """Two connections: the client's (open before the pipe) and the upstream's."""

    def __init__(self, client: asyncio.Transport, ends: Ends, close_grace: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.client = client
        self.upstream: asyncio.Transport | None = None  # set once connected
        self.ends = ends
        self.close_grace = close_grace
        self.relayed = False  # some upstream byte reached the client
        # the upstream's bytes pass this while it is set; it returns what goes on now
        self.gate: Callable[[bytes], bytes] | None = None
        self.closed = False
        self.sealed: set[bool] = set()  # sides `write_last` wrote to (True: the client)
        self.ended: set[bool] = set()  # sides that sent their FIN and are kept open (`eof`)
        self._eof_written: set[bool] = set()  # sides given the other's FIN (`write_eof`)
        self._holding = True  # the client's bytes wait for `release`
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._paused: set[bool] = set()  # sides whose reading is paused (True: the client)
        self._full: set[bool] = set()  # sides whose write buffer is over its high-water mark
        self._last = perf_counter()
        self._waiting = (0, 0)  # what each side owed at the idle timer's last look
        Deadline.__init__(self)  # the idle timer: see start_idle
        self._idle_timeout = 0.0
        self._on_idle: Callable[[float], None] = _no_idle
        self._grace: asyncio.TimerHandle | None = None
        client.set_protocol(_Side(self, True))

    def upstream_protocol(self) -> asyncio.Protocol:
        """The protocol for the upstream's connection (its `connection_made` joins it)."""
        return _Side(self, False)

    def hold(self, data: bytes) -> None:
        """Client bytes read before the pipe: sent after `release`, before any later read."""
        self._keep(data)

    def release(self) -> None:
        """The client's bytes may go: the held ones first, then reading resumes."""
        self._holding = False
        held, self._held, self._held_bytes = self._held, [], 0
        if held:
            self.from_client(b"".join(held))
        self._resume(True)

    def _keep(self, data: bytes) -> None:
        self._held.append(data)
        self._held_bytes += len(data)
        if self._held_bytes > HOLD_BYTES:
            self._pause(True)  # until `release`

    def write_last(self, client_side: bool, data: bytes) -> None:
        """Write a side its last bytes: nothing read afterwards goes to it."""
        transport = self.client if client_side else self.upstream
        assert transport is not None
        if client_side not in self._eof_written:  # no write after write_eof
            transport.write(data)
        self.sealed.add(client_side)

    # -- the byte path ------------------------------------------------------------------

    def from_client(self, data: bytes) -> None:
        upstream = self.upstream
        if upstream is None or self._holding:
            self._keep(data)
            return
        self._last = at = perf_counter()
        if False not in self.sealed:
            upstream.write(data)
        self.ends.seen(True, data, at)

    def from_upstream(self, data: bytes) -> None:
        self._last = at = perf_counter()
        gate = self.gate
        out = data if gate is None else gate(data)
        if out and True not in self.sealed:
            self.client.write(out)
            self.relayed = True
        self.ends.seen(False, data, at)

    # -- a half-close ----------------------------------------------------------------------

    def eof(self, client_side: bool) -> bool:
        """One side sent its FIN: whether its transport stays open (what the other side
        still sends goes to it). The other side is told where its transport can say it,
        and given `close_grace` to answer and end."""
        transport = self.client if client_side else self.upstream
        other_side = not client_side
        other = self.upstream if client_side else self.client
        if (
            self.closed
            or self._holding  # before the 101: its connection_lost ends the handshake
            or other is None
            or other_side in self.ended  # both have ended: the pipe ends
            or other.is_closing()
            # asyncio closes a TLS side at its close_notify (or FIN) whatever we say, and
            # drops what is written to it after: docs/hostile-peers.md has the source
            or _tls(transport)
        ):
            return False
        self.ended.add(client_side)
        if other.can_write_eof():
            other.write_eof()
            self._eof_written.add(other_side)
        # The other side has close_grace to answer and end (a close frame's answer comes
        # at once): one that ignores the FIN holds the tunnel, and an upstream's
        # generation for a client gone, no longer than that, as nginx, which ends a
        # tunnel at either side's FIN, holds it not at all.
        self.later(lambda: self.ends.lost(client_side, None))
        return True

    # -- flow control -------------------------------------------------------------------

    def writes_full(self, client_side: bool, full: bool) -> None:
        """One side's write buffer passed its high-water mark (or drained below the low
        one): pause (resume) reading from the other side."""
        if full:
            self._full.add(client_side)
            self._pause(not client_side)
        else:
            self._full.discard(client_side)
            self._resume(not client_side)

    def holds_up(self, client_side: bool) -> bool:
        """Whether this side's write buffer is past its high-water mark, the other side's
        reading paused for it: when the pipe idles so, this side took nothing."""
        return client_side in self._full

    def _pause(self, client_side: bool) -> None:
        if client_side in self._paused:
            return
        transport = self.client if client_side else self.upstream
        if transport is not None and not transport.is_closing():
            self._paused.add(client_side)
            transport.pause_reading()

    def _resume(self, client_side: bool) -> None:
        if client_side not in self._paused or (not client_side) in self._full:
            return
        if client_side and self._holding:
            return  # the client's bytes wait for `release`
        transport = self.client if client_side else self.upstream
        self._paused.discard(client_side)
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    # -- the idle timer -----------------------------------------------------------------

    def start_idle(self, timeout: float, idle: Callable[[float], None]) -> None:
        """Call `idle(quiet seconds)` once no byte moved either way for `timeout`."""
        self._last = perf_counter()
        self._idle_timeout, self._on_idle = timeout, idle
        self.due_within(timeout)

    def time_left(self) -> float | None:
        if self.closed:
            return None
        upstream = self.upstream
        waiting = (owed(self.client), owed(upstream) if upstream is not None else 0)
        if waiting != self._waiting:
            # A side took bytes since the last look (or was given some): progress, not
            # idle. What a side owes staying as it was is a side that takes nothing (a
            # peer gone while its reading was paused, whose end is never read): it idles
            # out. The kernel's queue counts (proxy/server/backlog.py): a slow reader
            # moves it long before the transport's buffer.
            self._waiting = waiting
            self._last = perf_counter()
        quiet = perf_counter() - self._last
        if quiet >= self._idle_timeout:
            self._on_idle(quiet)
            return None
        return self._idle_timeout - quiet

    # -- the end ------------------------------------------------------------------------

    def later(self, then: Callable[[], None]) -> None:
        """Call `then` after close_grace (one such timer at a time: this replaces it)."""
        if self._grace is not None:
            self._grace.cancel()
        self._grace = self.loop.call_later(self.close_grace, then)

    def close(self) -> None:
        """Close both sides, once; a side still not taking its bytes after close_grace is cut."""
        self.closed = True
        self.cancel_deadline()
        if self._grace is not None:
            self._grace.cancel()
        for transport in (self.client, self.upstream):
            if transport is not None and not transport.is_closing():
                transport.close()
        self.later(self._abort_both)

    def _abort_both(self) -> None:
        self._grace = None
        for transport in (self.client, self.upstream):
            if transport is not None and transport.get_write_buffer_size():
                reset(transport)  # the kernel's queue for it dropped too (backlog.py)


def _no_idle(quiet: float) -> None:
    pass


def _tls(transport: asyncio.BaseTransport | None) -> bool:
    return transport is not None and transport.get_extra_info("sslcontext") is not None


class _Side(asyncio.Protocol):
    """One connection of a pipe; everything it hears goes to the pipe."""

    __slots__ = ("from_client", "pipe")

    def __init__(self, pipe: Pipe, from_client: bool) -> None:
        self.pipe = pipe
        self.from_client = from_client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Only the upstream's: the client's connection was open before the pipe.
        self.pipe.upstream = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        if self.from_client:
            self.pipe.from_client(data)
        else:
            self.pipe.from_upstream(data)

    def eof_received(self) -> bool | None:
        # False: the transport closes, and connection_lost ends the pipe
        return self.pipe.eof(self.from_client)

    def connection_lost(self, exc: Exception | None) -> None:
        self.pipe.ends.lost(self.from_client, exc)

    def pause_writing(self) -> None:
        self.pipe.writes_full(self.from_client, True)

    def resume_writing(self) -> None:
        self.pipe.writes_full(self.from_client, False)
