"""How many bytes a connection still owes its peer: whether a peer that holds a response
up still reads it, however slowly, or stopped reading for good.

A transport's own write buffer is not enough to tell: it shrinks only when the kernel's
send queue has room for it again, and Linux reports a socket writable once the free
space is half of what is queued (`tcp_poll`, `sk_stream_is_writeable`), so a client
reading a few kilobytes a second can leave it unchanged for minutes. Every byte the peer
reads is acknowledged, which empties the kernel's queue at once: Linux's SIOCOUTQ
(`TIOCOUTQ`, tcp(7)) gives that queue, the bytes sent or not yet sent that the peer has
not acknowledged. The two together move whenever the peer takes a byte. Elsewhere, or
for a transport without a socket, the buffer alone is the answer.

Read when a timer fires on a held-up response (once per timeout), never per chunk.
"""

from __future__ import annotations

import asyncio
import fcntl
import sys

_OUTQ: int | None = None
if sys.platform == "linux":
    import termios

    _OUTQ = termios.TIOCOUTQ

_INT = b"\0\0\0\0"


def owed(transport: asyncio.WriteTransport) -> int:
    """Bytes written to `transport` that its peer has not acknowledged yet."""
    size = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if _OUTQ is None or sock is None:
        return size
    try:
        queued = fcntl.ioctl(sock.fileno(), _OUTQ, _INT)
    except (OSError, ValueError):  # closed, or not a stream socket
        return size
    return size + int.from_bytes(queued, sys.byteorder)


class Progress:
    """Whether a client that holds a response up still takes bytes, judged at each look
    of a timer (the wire's request timer, the ASGI relay's IdleTimer): it moved when the
    upstream was read since the look before (the client had room then) or it owes fewer
    bytes than at the look before. The first look only notes where things stand, so a
    stall is cut between one and two timeouts after it began."""

    __slots__ = ("moved", "owed")

    def __init__(self) -> None:
        self.moved = 0.0  # when a look last saw it move
        self.owed = 0  # what it owed at the last look

    def stalled_for(
        self, last_read: float, transport: asyncio.WriteTransport | None, now: float
    ) -> float:
        """Seconds since the client last moved; `transport` None where it is not known
        (another ASGI server): then only a read of the upstream counts."""
        owed_now = 0 if transport is None else owed(transport)
        if last_read > self.moved or owed_now < self.owed:
            self.moved = now
        self.owed = owed_now
        return now - self.moved
