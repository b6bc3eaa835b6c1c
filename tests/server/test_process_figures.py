"""The serving process's own figures on /metrics (proxy/server/processfigures.py): the
names and values prometheus-client's ProcessCollector gives, but the open descriptors
from the kernel's count rather than a listing of /proc/self/fd."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, ProcessCollector

from proxy.server.processfigures import ProcessFigures, open_fds
from tests.server.conftest import no_proxy

pytestmark = no_proxy

COUNTED = open_fds() is not None  # Linux 6.2 or later


def figures(collector: object) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    return {sample.name: sample.value for family in registry.collect() for sample in family.samples}


def test_the_figures_are_prometheus_clients_names_and_this_process_values() -> None:
    ours = figures(ProcessFigures())
    theirs = figures(ProcessCollector(registry=None))
    assert set(ours) == set(theirs) - ({"process_open_fds"} if not COUNTED else set())
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert ours["process_max_fds"] == theirs["process_max_fds"] == soft
    assert ours["process_start_time_seconds"] == pytest.approx(
        theirs["process_start_time_seconds"], abs=0.02
    )
    assert ours["process_start_time_seconds"] <= time.time()
    # Read a moment apart: equal but for what this process did in between.
    assert ours["process_cpu_seconds_total"] == pytest.approx(
        theirs["process_cpu_seconds_total"], abs=0.05
    )
    assert ours["process_resident_memory_bytes"] == pytest.approx(
        theirs["process_resident_memory_bytes"], rel=0.05
    )
    assert ours["process_virtual_memory_bytes"] == pytest.approx(
        theirs["process_virtual_memory_bytes"], rel=0.05
    )


@pytest.mark.skipif(not COUNTED, reason="the kernel's count of open descriptors needs Linux 6.2")
def test_open_descriptors_are_the_kernels_count_and_follow_sockets_opened() -> None:
    """In a process of its own: in the test worker, other tests' servers open and close
    descriptors on their threads between the two readings (CI once saw 473 for 500)."""
    program = """
import os, socket
from prometheus_client import CollectorRegistry
from proxy.server.processfigures import ProcessFigures

def open_fds():
    registry = CollectorRegistry()
    registry.register(ProcessFigures())
    return next(s.value for f in registry.collect() for s in f.samples if s.name == "process_open_fds")

before = open_fds()
sockets = [socket.socket() for _ in range(500)]
during = open_fds()
listed = len(os.listdir("/proc/self/fd")) - 1  # the listing itself holds one while it lists
print(int(during - before), int(during - listed))
"""
    run = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True
    )
    assert run.stdout.split() == ["500", "0"]


def test_the_open_descriptors_are_never_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """At every scrape, on the event loop: a listing costs one entry a descriptor."""

    def refuse(*args: object) -> list[str]:
        raise AssertionError("/proc/self/fd listed")

    monkeypatch.setattr(os, "listdir", refuse)
    monkeypatch.setattr(os, "scandir", refuse)
    figures(ProcessFigures())


def test_a_kernel_without_the_count_leaves_open_descriptors_out(tmp_path: Path) -> None:
    """Before Linux 6.2 stat(2) of /proc/self/fd reports size 0: no figure rather than a
    wrong one, or a listing."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "fd").write_bytes(b"")  # size 0, as the directory reads on such a kernel
    (proc / "statm").write_bytes(b"1000 200 50 1 0 300 0\n")
    assert open_fds(proc) is None
    got = figures(ProcessFigures(proc))
    assert "process_open_fds" not in got
    assert got["process_resident_memory_bytes"] == 200 * os.sysconf("SC_PAGE_SIZE")
    assert "process_start_time_seconds" not in got  # no stat file there
