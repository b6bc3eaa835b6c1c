"""Listeners whose backlog is full, for the proxy's connect timeout: connections they never
accept fill it, so the next connect waits (TCP: the kernel drops its SYN, and the client
sends it again until its timeout) or, to a Unix socket, fails at once with EAGAIN when
non-blocking (Linux net/unix/af_unix.c unix_stream_connect), where a blocking one waits."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

#: Connections that fill a backlog of none (Linux takes one more than the backlog asks).
FILLERS = 4


@contextlib.contextmanager
def full_backlog(address: Any, family: socket.AddressFamily = socket.AF_INET) -> Iterator[Any]:
    """A listener bound to `address` (("127.0.0.1", 0) for a free port, a path for a Unix
    socket) with its backlog full; yields the address it is bound to."""
    with socket.socket(family) as listener:
        listener.bind(address)
        listener.listen(0)
        bound = listener.getsockname()
        fillers = [socket.socket(family) for _ in range(FILLERS)]
        try:
            for filler in fillers:
                filler.setblocking(False)
                filler.connect_ex(bound)  # EINPROGRESS, or EAGAIN, past the first
            yield bound
        finally:
            for filler in fillers:
                filler.close()
