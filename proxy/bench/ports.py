"""Free loopback ports, for the tests' servers and the benchmarks' processes.

A port is free when it is returned, not reserved: the caller binds it soon after, and a
server such as vLLM binds only after minutes of loading. Two things could take it in
between, both common when several test processes run at once (pytest-xdist):

- an outgoing connection of any process on the machine: the kernel gives each one a local
  port from its ephemeral range (`ip_local_port_range`, 32768-60999 by default);
- another process picking the same port.

So ports are picked below the ephemeral range, where no connection is ever given one, and
within the range `TOKENPROBE_PORTS` ("low-high") names where one is given: the tests give
each parallel worker a slice of its own (tests/conftest.py), which its subprocesses
inherit. A process walks its range from a random start (re-seeded after a fork), so it
does not return one port twice while others are left. Where the ephemeral range leaves
too little room below it, and no range is named, the kernel picks (bind to port 0).
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
#: "low-high": the ports this process and its children pick from (high excluded).
RANGE_ENV = "TOKENPROBE_PORTS"


def below_ephemeral() -> range | None:
    """The ports between FLOOR and the ephemeral range; None where they are too few."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(FLOOR, low) if low - FLOOR >= MIN_SPAN else None


def _ports() -> range | None:
    named = os.environ.get(RANGE_ENV)
    if named:
        low, _, high = named.partition("-")
        return range(int(low), int(high))
    return below_ephemeral()


class _Walk:
    """This process's sequence of candidate ports: from a random start, one after another,
    so the same process never returns one port twice while others are left (a forked
    child starts a sequence of its own, and reads RANGE_ENV again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._next: itertools.count[int] = itertools.count()
        self._ports: range | None = None

    def ports(self) -> range | None:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._ports = _ports()
                start = random.randrange(len(self._ports)) if self._ports else 0
                self._next = itertools.count(start)
            return self._ports

    def candidate(self, ports: range) -> int:
        with self._lock:
            return ports[next(self._next) % len(ports)]


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
    ports = _walk.ports()
    if ports is None:
        return _kernel_picks(count)
    picked: list[int] = []
    for _ in range(len(ports)):
        port = _walk.candidate(ports)
        if port not in picked and _bindable(port):
            picked.append(port)
            if len(picked) == count:
                return picked
    raise OSError(f"no {count} free ports in {ports}")


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
