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

Read when a timer fires on a held-up response (once per timeout), and when a
connection ends early (once per connection), never per chunk.

And what becomes of those bytes when the proxy gives up on the peer (`reset`): asyncio's
and uvloop's `abort()` drop only the transport's own buffer. The kernel still holds its
send queue (about 4 MB on loopback), and the close queues the FIN behind it: a peer that
takes nothing never sees the close (a stalled client kept the proxy's socket in
FIN-WAIT-1 for minutes, answering its zero-window probes; a backend that reads nothing
of a request body its client abandoned kept its connection for good). With SO_LINGER
(on, 0 s) set first, the close drops the queue and sends the peer a reset at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import sys
from typing import Any

_OUTQ: int | None = None
if sys.platform == "linux":
    import termios

    _OUTQ = termios.TIOCOUTQ

_INT = b"\0\0\0\0"
#: SO_LINGER on, for 0 s: the close sends a reset and drops what the kernel still holds.
_LINGER_NONE = struct.pack("ii", 1, 0)


def owed(transport: asyncio.WriteTransport) -> int:
    """Bytes written to `transport` that its peer has not acknowledged yet."""
    return transport.get_write_buffer_size() + unacknowledged(transport.get_extra_info("socket"))


def unacknowledged(sock: Any) -> int:
    """Bytes in the kernel's send queue of `sock` (a socket, asyncio's TransportSocket or
    uvloop's PseudoSocket): sent or not, not acknowledged by the peer; 0 where unknown."""
    if _OUTQ is None or sock is None:
        return 0
    try:
        queued = fcntl.ioctl(sock.fileno(), _OUTQ, _INT)
    except (OSError, ValueError):  # closed, or not a stream socket
        return 0
    return int.from_bytes(queued, sys.byteorder)


def drop_at_close(sock: Any) -> None:
    """The close of `sock` resets the connection and drops the kernel's send queue,
    instead of sending that queue and a FIN after it (see the module's docstring)."""
    if sock is None:
        return
    with contextlib.suppress(OSError, ValueError):  # closed already
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_NONE)


def reset(transport: asyncio.WriteTransport) -> None:
    """Abort `transport` with a reset: nothing more goes to its peer, the bytes the
    kernel still holds for it included, and the peer is told at once."""
    drop_at_close(transport.get_extra_info("socket"))
    transport.abort()


def close_or_reset(transport: asyncio.WriteTransport) -> None:
    """Close `transport`, or reset it where its peer has not taken every byte written to
    it yet: an upstream connection given up on before its answer was whole, while the
    backend still reads the request (its client left, or the first byte timed out, while
    the body went out). A close would send the rest first, and the FIN behind it, to a
    backend that may read slowly or not at all, running the request all the while."""
    if owed(transport):
        reset(transport)
    else:
        transport.close()


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
