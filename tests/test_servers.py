"""tests/servers.py's stops end a whole process group, its leader gone or not: a leader
killed with SIGKILL leaves its children in the group (a failed run left two
`serve --workers` workers running after `stop_group` had looked only at the leader)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.servers import Early, Started, stop_group

#: A shell that starts two sleeping children in its group and writes their ids.
TWO_CHILDREN = "sleep 60 & echo $! >> {file}; sleep 60 & echo $! >> {file}; wait"


def children(file: Path) -> list[int]:
    """The two ids `TWO_CHILDREN` writes to `file`, once it has written both."""
    deadline = time.monotonic() + 10
    while len(written := file.read_text().split() if file.is_file() else []) < 2:
        assert time.monotonic() < deadline, "the shell did not start its children"
        time.sleep(0.01)
    return [int(pid) for pid in written]


def running(pid: int) -> bool:
    """Whether `pid` runs: not ended, nor a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


@contextlib.contextmanager
def killed_at_the_end(group: int) -> Iterator[None]:
    """Whatever a failing test leaves of `group` is killed, so no sleep outlives it."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def test_stop_group_ends_the_children_of_a_leader_killed_before_it(tmp_path: Path) -> None:
    file = tmp_path / "children"
    leader = subprocess.Popen(["sh", "-c", TWO_CHILDREN.format(file=file)], process_group=0)
    with killed_at_the_end(leader.pid):
        pids = children(file)
        leader.kill()  # the leader only, as an OOM kill or `kill -9` does: its children stay
        leader.wait(10)
        assert all(running(pid) for pid in pids)
        stop_group(leader)
        assert [pid for pid in pids if running(pid)] == []  # all gone when it returns


def leaves_two_children(folder: Path) -> Started:
    """A group whose leader ends at once, leaving its two children behind."""
    folder.mkdir()
    script = TWO_CHILDREN.format(file=folder / "children").removesuffix("; wait")
    return [subprocess.Popen(["sh", "-c", script], process_group=0)], {}


def test_the_early_stop_ends_the_children_of_a_leader_that_has_ended(tmp_path: Path) -> None:
    early = Early(tmp_path / "early")
    early.start(leaves_two_children)
    pids = children(tmp_path / "early" / "leaves_two_children" / "children")
    (leader,) = early._processes
    with killed_at_the_end(leader.pid):
        leader.wait(10)
        assert all(running(pid) for pid in pids)
        early.stop()
        assert [pid for pid in pids if running(pid)] == []
