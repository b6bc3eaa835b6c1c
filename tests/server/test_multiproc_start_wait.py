"""A start that holds the start lock of a PROMETHEUS_MULTIPROC_DIR for long (stopped with
^Z while it clears a directory of very many files) keeps a second start waiting a bounded
time, not forever (proxy/server/multiproc.py, `_one_start_at_a_time`): the second is
refused after `START_WAIT`, naming the holder. It waited in a blocking flock, printed
nothing and hung for as long as the first was stopped.

The holder is a real process that takes the start lock as a start does and sleeps; the
second start runs `fresh_metrics_directory` in a fresh interpreter, under a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.server.multiproc import START_LOCK
from tests.server.conftest import no_proxy

pytestmark = no_proxy

ROOT = Path(__file__).resolve().parents[2]

#: Takes the start lock of the directory argv[1] alone, as a start does, says so, and
#: holds it until its stdin closes.
_HOLDER = f"""
import fcntl, os, sys
fd = os.open(os.path.join(sys.argv[1], {START_LOCK!r}), os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
sys.stdin.read()
"""

#: A start on the directory argv[1]: prints "started", or the refusal.
_START = """
import os, sys
import proxy.server.multiproc as multiproc
from proxy.settings import SettingsError
assert multiproc.__file__.startswith(os.getcwd()), multiproc.__file__
try:
    multiproc.fresh_metrics_directory(sys.argv[1])
except SettingsError as exc:
    print(exc, flush=True)
else:
    print("started", flush=True)
"""

#: A previous run's file, which a refused start must leave where it is.
_PREVIOUS_RUN = "counter_999999999.db"


@pytest.fixture
def held(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    (tmp_path / _PREVIOUS_RUN).touch()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def _start(directory: Path) -> tuple[str, float]:
    """What a start on `directory` printed, and how long it took. On the tree before the
    bound it never answered: the timeout fails the test."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _START, str(directory)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=30,  # START_WAIT (3 s) and an interpreter's start on a loaded machine
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), time.monotonic() - began


def test_a_start_lock_held_past_the_wait_refuses_the_start_naming_its_holder(
    tmp_path: Path, held: subprocess.Popen[str]
) -> None:
    said, took = _start(tmp_path)
    assert f"process {held.pid} has been starting on it" in said, said
    assert "give each tokenprobe serve a directory of its own" in said, said
    assert took < 30, took  # (subprocess.run's timeout says so too)
    assert (tmp_path / _PREVIOUS_RUN).exists()  # refused before it cleared anything


def test_a_start_lock_its_holder_let_go_of_keeps_out_no_one(
    tmp_path: Path, held: subprocess.Popen[str]
) -> None:
    """The holder ended (its lock went with it, the file stayed): the next start starts,
    clears the previous run's files, and removes the start lock with its own."""
    assert held.stdin is not None
    held.stdin.close()
    assert held.wait(10) == 0
    said, _ = _start(tmp_path)
    assert said == "started"
    assert sorted(os.listdir(tmp_path)) == []
