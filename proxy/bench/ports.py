"""Free loopback ports, for the tests' servers and the benchmarks' processes.

A port is free when it is returned, not reserved: the caller binds it soon after, and a
server such as vLLM binds only after minutes of loading. Two things could take it in
between, both common when several test processes run at once (pytest-xdist):

- an outgoing connection of any process on the machine: the kernel gives each one a local
  port from its ephemeral range (`ip_local_port_range`, 32768-60999 by default);
- another process picking the same port.

So ports are picked below the ephemeral range, where no connection is ever given one, and
each process walks its own sequence from a random start, so two processes pick the same
port only if one walks into a port the other picked and has not yet bound. Where the
ephemeral range leaves too little room below it, the kernel picks (bind to port 0).
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
from pathlib import Path

#: The ephemeral range's file on Linux; elsewhere the kernel picks.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: The lowest port picked: well above the well-known and registered servers' ports that a
#: test machine may run (Prometheus 9090, Grafana 3000, the Docker daemon's 2375).
FLOOR = 10_000
#: Fewer ports than this below the ephemeral range: the kernel picks instead.
MIN_SPAN = 2_000


def _span() -> int:
    """How many ports lie between FLOOR and the ephemeral range (0: let the kernel pick)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    return low - FLOOR if low - FLOOR >= MIN_SPAN else 0


class _Walk:
    """This process's sequence of candidate ports: from a random start, one after another,
    so the same process never returns one port twice while others are left (a forked
    child starts a sequence of its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._next: itertools.count[int] = itertools.count()
        self.span = _span()

    def candidate(self) -> int:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._next = itertools.count(random.randrange(self.span or 1))
            return FLOOR + next(self._next) % self.span


_walk = _Walk()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    (port,) = free_ports(1)
    return port


def free_ports(count: int) -> list[int]:
    """`count` different ports on 127.0.0.1 that nothing listens on right now."""
    if not _walk.span:
        return _kernel_picks(count)
    picked: list[int] = []
    for _ in range(_walk.span):
        port = _walk.candidate()
        if port not in picked and _bindable(port):
            picked.append(port)
            if len(picked) == count:
                return picked
    raise OSError(f"no {count} free ports below the ephemeral range")


def _kernel_picks(count: int) -> list[int]:
    # Each is held until all are picked, so the kernel cannot hand out one twice.
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()
