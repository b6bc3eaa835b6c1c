"""proxy.bench.ports: ports below the ephemeral range, never one held, never one twice."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from proxy.bench import ports
from proxy.bench.ports import FLOOR, free_port, free_ports

needs_range = pytest.mark.skipif(
    ports.below_ephemeral() is None,
    reason="no room below this machine's ephemeral range: the kernel picks",
)


@needs_range
def test_ports_lie_below_the_ephemeral_range_so_no_connection_takes_one() -> None:
    low = int(ports.EPHEMERAL_RANGE.read_text().split()[0])
    picked = free_ports(200)
    assert all(FLOOR <= port < low for port in picked)
    assert all(port in (ports._walk.ports() or ()) for port in picked)  # the worker's slice
    assert len(set(picked)) == 200


def test_a_port_something_listens_on_is_never_returned() -> None:
    held = []
    try:
        for port in free_ports(50):
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & set(free_ports(300))
    finally:
        for s in held:
            s.close()


@needs_range
def test_a_forked_child_walks_a_sequence_of_its_own() -> None:
    free_port()  # the parent's walk has begun
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.write(write, ",".join(map(str, free_ports(20))).encode())
        os._exit(0)
    os.close(write)
    mine = free_ports(20)
    os.waitpid(child, 0)
    with os.fdopen(read) as pipe:
        theirs = [int(port) for port in pipe.read().split(",")]
    assert len(theirs) == 20
    assert set(mine) != set(theirs)  # a fork restarted from a random start, not the parent's


def test_a_named_range_is_where_a_process_and_its_children_pick() -> None:
    script = "from proxy.bench.ports import free_ports; print(*free_ports(5))"
    env = {**os.environ, ports.RANGE_ENV: "21000-21010"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(set(out)) == 5 and all(21000 <= int(port) < 21010 for port in out)
