"""Two starts on one PROMETHEUS_MULTIPROC_DIR in the same instant (proxy/server/multiproc.py,
`fresh_metrics_directory`): exactly one wins, every time.

A start took the directory's flock alone, cleared it, then held it shared; that change
is two steps as flock(2) allows it ("the existing lock is first removed, and then a new
lock is established"), and a second start between them found the directory free: both
started, each clearing the other's files and reporting its traffic as its own. The Linux
6.18 of the test machine never let a second start in (0 of 3000 raced rounds), so the
starts race here both as this kernel changes the lock and as flock(2) allows it to
(`two_steps`: the lock let go, a pause, the shared lock taken), as other systems and
filesystems may.

The starts are real processes, forked two at a time from one driver process (a fresh
interpreter: no threads to fork) and released together by one write to a pipe both wait
on; each holds what it won until both have answered.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import no_proxy

pytestmark = no_proxy

ROUNDS = 60

#: argv: directory-of-rounds, rounds, "two_steps" | "kernel". Prints one line a round: the
#: starts that won (0, 1 or 2) and what the directory held after both answered.
_DRIVER = """
import fcntl, os, sys, time
base, rounds, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import proxy.server.multiproc as multiproc
from proxy.settings import SettingsError
assert multiproc.__file__.startswith(os.getcwd()), multiproc.__file__
if how == "two_steps":
    flock, alone = fcntl.flock, set()
    def two_steps(fd, operation):
        if operation == fcntl.LOCK_SH and fd in alone:
            flock(fd, fcntl.LOCK_UN)
            time.sleep(0.002)
        flock(fd, operation)
        (alone.add if operation & fcntl.LOCK_EX else alone.discard)(fd)
    fcntl.flock = two_steps

# Bare forks and pipes: a round of multiprocessing's barriers and queue took 0.2 s here.
for n in range(rounds):
    directory = os.path.join(base, str(n))
    go, won, answered = os.pipe(), os.pipe(), os.pipe()
    pids = []
    for _ in "ab":
        pid = os.fork()
        if pid == 0:  # a start: released with the other, holds what it won until both answered
            os.close(go[1]); os.close(answered[1])
            os.read(go[0], 1)
            try:
                multiproc.fresh_metrics_directory(directory)
                os.write(won[1], b"1")
            except SettingsError:
                os.write(won[1], b"0")
            os.read(answered[0], 1)  # the driver's close: both have answered
            os._exit(0)
        pids.append(pid)
    os.write(go[1], b"go")  # one byte each: both go at once
    wins = (os.read(won[0], 1) + os.read(won[0], 1)).count(b"1")
    left = sorted(os.listdir(directory))
    os.close(answered[1])
    for pid in pids:
        os.waitpid(pid, 0)
    for fd in (*go, *won, answered[0]):
        os.close(fd)
    print(wins, left, flush=True)
"""


@pytest.mark.parametrize("how", ["kernel", "two_steps"])
def test_two_starts_in_the_same_instant_exactly_one_wins(tmp_path: Path, how: str) -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(tmp_path), str(ROUNDS), how],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rounds = done.stdout.splitlines()
    assert len(rounds) == ROUNDS
    # one winner, and nothing of ours left in the directory (the start lock goes with
    # the start that made it)
    assert [line for line in rounds if line != "1 []"] == []
