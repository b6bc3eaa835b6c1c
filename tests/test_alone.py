"""tests/alone.py: an `alone` test waits for the running tests to end, and holds off the
ones that arrive meanwhile until it is done; a run of alone tests on one worker holds
them off from the first to the last; quiet tests of the lanes run side by side and hold
off the rest the same way; under xdist the alone tests are one such run, and each lane's
quiet tests one more; a worker beyond the active ones runs the modules that mostly wait,
and those only. And what the first process of a parallel run starts early for a worker's
module fixture (tests/servers.py, `Early`) reaches the worker whole."""

from __future__ import annotations

import fcntl
import gc
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest

from tests.alone import ALONE, NORMAL, AloneLast, Kind, Locks, frozen_heap, unit
from tests.paths import ROOT
from tests.servers import EARLY_ENV, Early, Started, started_early


def start(folder: Path, events: list[str], kind: Kind, name: str, hold: float) -> threading.Thread:
    """Another worker's test, in a thread: a Locks of its own, as a worker has."""

    def body() -> None:
        with Locks(folder).hold(kind):
            events.append(f"{name} in")
            time.sleep(hold)
            events.append(f"{name} out")

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_an_alone_test_waits_for_the_running_and_holds_off_the_arriving(tmp_path: Path) -> None:
    events: list[str] = []
    running = Locks(tmp_path)
    with running.hold(NORMAL):
        events.append("running in")
        alone = start(tmp_path, events, ALONE, "alone", 0.2)
        time.sleep(0.2)
        arriving = start(tmp_path, events, NORMAL, "arriving", 0)
        time.sleep(0.2)
        assert events == ["running in"]  # the alone test waits; the arriving one behind it
        events.append("running out")
    alone.join(5)
    arriving.join(5)
    assert events == [
        "running in", "running out", "alone in", "alone out", "arriving in", "arriving out"
    ]  # fmt: skip


def test_a_run_of_alone_tests_keeps_the_others_out_between_them(tmp_path: Path) -> None:
    events: list[str] = []
    worker = Locks(tmp_path)
    with worker.hold(ALONE, next_kind=ALONE):
        events.append("first in")
        arriving = start(tmp_path, events, NORMAL, "arriving", 0)
        time.sleep(0.2)
        events.append("first out")
    time.sleep(0.2)  # between the two: the arriving test still waits
    with worker.hold(ALONE, next_kind=NORMAL):
        events.append("second in")
        time.sleep(0.1)
        events.append("second out")
    arriving.join(5)
    assert events == [
        "first in", "first out", "second in", "second out", "arriving in", "arriving out"
    ]  # fmt: skip


def test_quiet_tests_of_two_lanes_run_side_by_side_and_hold_off_the_others(
    tmp_path: Path,
) -> None:
    events: list[str] = []
    running = Locks(tmp_path)
    with running.hold(NORMAL):
        events.append("running in")
        lanes = [start(tmp_path, events, lane, f"lane {lane}", 0.3) for lane in (0, 1)]
        time.sleep(0.2)
        arriving = [start(tmp_path, events, NORMAL, "arriving", 0)]
        time.sleep(0.2)
        assert events == ["running in"]  # the lanes wait for it; the arriving test behind
        events.append("running out")
    time.sleep(0.2)  # both lanes in, side by side
    assert sorted(events[2:]) == ["lane 0 in", "lane 1 in"], events
    alone = start(tmp_path, events, ALONE, "alone", 0)
    for thread in [*lanes, *arriving, alone]:
        thread.join(5)
    outs = {event: i for i, event in enumerate(events)}
    last_lane_out = max(outs["lane 0 out"], outs["lane 1 out"])
    assert outs["arriving in"] > last_lane_out and outs["alone in"] > last_lane_out, events


def test_a_test_of_the_rest_waiting_on_one_lane_keeps_no_other_lane_out(tmp_path: Path) -> None:
    events: list[str] = []
    first = start(tmp_path, events, 0, "lane 0", 0.6)
    time.sleep(0.1)
    waiting = start(tmp_path, events, NORMAL, "other", 0)
    time.sleep(0.1)
    second = start(tmp_path, events, 1, "lane 1", 0)
    for thread in (first, waiting, second):
        thread.join(5)
    assert events.index("lane 1 out") < events.index("lane 0 out"), events
    assert events.index("other in") > events.index("lane 0 out"), events


def test_alone_and_quiet_tests_wait_for_the_rest_even_where_it_is_not_at_a_gate(
    tmp_path: Path,
) -> None:
    """A worker runs its last test only once it knows the next, so its last test of the
    rest starts when the lanes are handed out, beside them: a lane whose worker got there
    first held that test off at its gate, and the lane behind the test then waited for the
    alone tests too. The scheduler holds a file until the rest has run; the alone and
    quiet tests wait for it, gate or no gate."""
    rest = tmp_path / "rest"
    events: list[str] = []

    def special(kind: Kind, name: str) -> threading.Thread:
        def body() -> None:
            with Locks(tmp_path / "locks", rest=rest).hold(kind):
                events.append(f"{name} in")

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread

    with rest.open("ab") as scheduler:
        fcntl.flock(scheduler, fcntl.LOCK_EX)
        waiting = [special(0, "lane"), special(ALONE, "alone")]
        time.sleep(0.3)
        with Locks(tmp_path / "locks").hold(NORMAL):  # the rest's last test, arriving late
            events.append("last of the rest in")
        assert events == ["last of the rest in"]
        fcntl.flock(scheduler, fcntl.LOCK_UN)  # it has run
    for thread in waiting:
        thread.join(5)
    assert sorted(events[1:]) == ["alone in", "lane in"], events


def test_a_full_collection_in_a_frozen_heap_passes_over_none_of_the_old_objects() -> None:
    old = [[i] for i in range(400_000)]  # a late worker's heap, as containers

    def full_pass() -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            gc.collect()
            best = min(best, time.perf_counter() - start)
        return best

    thawed = full_pass()
    with frozen_heap():
        assert gc.get_freeze_count() >= len(old)
        frozen = full_pass()
    assert gc.get_freeze_count() == 0
    assert frozen < thawed / 4, (frozen, thawed)


SUITE = """
import os, time, pytest

def log(request, start):
    with open(os.environ["ALONE_LOG"], "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {start} {time.monotonic()} "
                f"{request.node.nodeid}\\n")

@pytest.mark.parametrize("n", range(4))
def test_other(request, n):
    start = time.monotonic(); time.sleep(0.05); log(request, start)

@pytest.mark.alone("reads a clock")
@pytest.mark.parametrize("n", range(2))
def test_alone(request, n):
    start = time.monotonic(); time.sleep(0.05); log(request, start)

@pytest.mark.quiet("reads a clock with a slack")
@pytest.mark.parametrize("n", range(3))
def test_quiet(request, n):
    start = time.monotonic(); time.sleep(0.05); log(request, start)
"""


def test_under_xdist_the_alone_tests_run_back_to_back_on_one_worker_and_each_lane_on_one(
    tmp_path: Path,
) -> None:
    """A real parallel run of a small suite with this suite's conftest (its scheduler, its
    ordering and its locks): two modules, each with alone and quiet tests among others,
    and a third of others only."""
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text(SUITE)
    # a module of others that runs on while the first two's others are done
    (tmp_path / "test_c.py").write_text(SUITE.split("@pytest.mark.alone")[0].replace("(4)", "(12)"))
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.conftest"]\n')
    log = tmp_path / "log"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", "loadscope", "-p",
         "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=ROOT, env={**os.environ, "ALONE_LOG": str(log), "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line.split(None, 3) for line in log.read_text().splitlines()]
    ran = [(worker, float(start), float(end), nodeid.split("::")[1].split("[")[0], nodeid)
           for worker, start, end, nodeid in lines]  # fmt: skip
    assert len(ran) == 30
    alone = [r for r in ran if r[3] == "test_alone"]
    assert len({r[0] for r in alone}) == 1  # one unit of work
    first, last = min(r[1] for r in alone), max(r[2] for r in alone)
    # Back to back: no other test ran between the first alone test's start and the last's end.
    assert not [r for r in ran if r[3] != "test_alone" and r[1] < last and r[2] > first], ran
    # Each module's quiet tests are a lane, one worker's; nothing but quiet tests beside them.
    quiet = [r for r in ran if r[3] == "test_quiet"]
    for module in ("test_a.py", "test_b.py"):
        workers = {r[0] for r in quiet if r[4].startswith(module)}
        assert len(workers) == 1, (module, quiet)  # a lane: one worker
    for q in quiet:
        beside = [r for r in ran if r[3] != "test_quiet" and r[1] < q[2] and r[2] > q[1]]
        assert not beside, (q, beside)
    # The rest first, whole: the lanes and the alone tests start after its last test ended.
    rest_ended = max(r[2] for r in ran if r[3] == "test_other")
    assert rest_ended <= min(r[1] for r in ran if r[3] != "test_other"), ran


class Worker:
    def __init__(self, gateway_id: str) -> None:
        self.gateway = type("Gateway", (), {"id": gateway_id})()


def test_a_worker_beyond_the_active_ones_runs_the_waiting_modules_only() -> None:
    scheduler = AloneLast.__new__(AloneLast)  # its choice only: no run, no workers
    scheduler.units = {"tests/c.py::test_alone": unit(ALONE)}
    scheduler.waiting, scheduler.active = {"tests/waits.py"}, 2
    queue = ("tests/waits.py", "tests/a.py", "tests/b.py::Class", unit(ALONE))
    scheduler.workqueue = OrderedDict((scope, {}) for scope in queue)
    active, waiting = Worker("gw1"), Worker("gw2")
    assert scheduler._next_unit(active) == "tests/a.py"
    assert scheduler._next_unit(waiting) == "tests/waits.py"
    del scheduler.workqueue["tests/waits.py"]
    assert scheduler._next_unit(waiting) is None  # it ends
    scheduler.workqueue = OrderedDict([("tests/waits.py", {}), (unit(ALONE), {})])
    assert scheduler._next_unit(active) == "tests/waits.py"  # rather than wait idle
    scheduler.active = None  # no worker beyond: every worker takes every module
    assert scheduler._next_unit(Worker("gw7")) == "tests/waits.py"


# -- processes started early (tests/servers.py, `Early`) ---------------------------------


def exits_3(folder: Path) -> Started:
    folder.mkdir()
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], process_group=0)
    return [process], {"folder": str(folder)}


def sleeps_with_a_child(folder: Path) -> Started:
    folder.mkdir()
    script = f"sleep 60 & echo $! > {folder / 'child'}; wait"
    return [subprocess.Popen(["sh", "-c", script], process_group=0)], {}


def test_a_worker_takes_what_was_started_early_and_reads_its_return_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EARLY_ENV, str(tmp_path / "early"))
    early = Early(tmp_path / "early")
    assert started_early(exits_3) is None  # not started: the fixture starts its own
    early.start(exits_3)
    started = started_early(exits_3)
    assert started is not None
    details, (process,) = started
    assert details["folder"] == str(tmp_path / "early" / "exits_3")
    assert process.wait(10) == 3 and process.poll() == 3
    early.stop()
    assert not (tmp_path / "early").exists()


def test_what_still_runs_at_the_end_is_stopped_with_its_children(tmp_path: Path) -> None:
    early = Early(tmp_path / "early")
    early.start(sleeps_with_a_child)
    child_file = tmp_path / "early" / "sleeps_with_a_child" / "child"
    deadline = time.monotonic() + 10
    while not child_file.is_file() or not child_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child = int(child_file.read_text())
    early.stop()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
        assert time.monotonic() < deadline, "the child outlived the stop"
        time.sleep(0.01)


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rfind(")") + 2]
