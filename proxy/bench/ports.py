"""One free loopback port, for the tests' servers and the benchmarks' processes.

The port is free when this returns, not reserved: the caller binds it soon after.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """`count` different free ports: each is held until all are picked, so the kernel
    cannot hand out one twice (two `free_port` calls in a row can return the same port
    when nothing has bound the first one yet)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()
