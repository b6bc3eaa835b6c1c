"""Tests marked `alone` run while no other test runs, even in parallel workers; tests
marked `quiet` run while no test runs but other quiet ones, at most one a lane.

Some tests compare what was measured with delays the simulator was told to add: a TTFT of
0.2 s must read 0.2 s plus a small slack, a programmed 4 tokens at 10/s must miss an SLO of
0.25 s and 4 at 100/s must meet it. Four workers on two cores add more than such a slack
to a test that shares the CPU with them. Most such tests are light (their servers wait
on programmed sleeps: the quiet tests run by themselves in three lanes kept the machine
17-48% busy), and their slack holds with two more of them beside them: those are `quiet`. The
ones that load both cores, or compare two timings within a few percent, are `alone`.

Every test holds locks on files for its setup, call and teardown
(`pytest_runtest_protocol`, module fixtures included): one gate per quiet lane, shared by
most tests, each taken exclusively by an `alone` test and its own one by a `quiet` test
(so the lanes run side by side, and nothing else with them). A further file, the
turnstile, is taken for a moment by every test and held by an `alone` or `quiet` test
until it has its gates, so that a steady stream of shared holders cannot starve it.

The files are flock(2)ed in a folder of the run's own (xdist's testrunuid); without
workers nothing is locked.

Under xdist the alone tests are handed out in one unit of work and each lane's quiet
tests in one of their own, last (`AloneLast`): one worker runs a unit's tests back to
back, keeping its gates from the first to the last, so the others are drained once, not
before each such test between their own (that cost 40 s a run: the alone tests took 166 s
of the run's wall time for 126 s of their own work). The quiet tests go to the lanes
module by module (a module fixture starts once), each to the lane with the fewest
seconds so far (`_give_lanes`). The
workers name these tests and their units in a file for the scheduler, which sees node
ids only. The scheduler also holds a file until every test of the rest has run, and the
alone and quiet tests wait for it before their gates: a worker's last test of the rest
starts only when the lanes are handed out, and a lane at its gate first kept it waiting.

An alone or quiet test also runs with the process's older objects out of the garbage
collector's reach (`frozen_heap`), in parallel runs and serial ones.
"""

from __future__ import annotations

import fcntl
import gc
import os
import tempfile
import time
import uuid
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

import pytest
from xdist.scheduler import LoadScopeScheduling

#: How many quiet tests run side by side, each in its lane.
LANES = 3

#: How long an alone or quiet test waits at most for the rest to have run.
REST_WAIT_SECONDS = 120.0

#: What a test holds: `NORMAL`, `ALONE`, or the number of its quiet lane.
NORMAL, ALONE = "normal", "alone"
Kind = str | int


class Locks:
    def __init__(self, folder: Path, rest: Path | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.gates: list[IO[bytes]] = [
            open(folder / f"gate-{lane}", "ab")  # noqa: SIM115 - held for the run
            for lane in range(LANES)
        ]
        self.turnstile: IO[bytes] = open(folder / "turnstile", "ab")  # noqa: SIM115
        self.kept: Kind | None = None  # the gates held from the test before, for this kind
        # held by the scheduler until every test of the rest has run (`AloneLast`)
        self.rest: IO[bytes] | None = None if rest is None else open(rest, "ab")  # noqa: SIM115

    @contextmanager
    def hold(self, kind: Kind, next_kind: Kind | None = None) -> Iterator[None]:
        """The gates for one test; an alone or quiet test followed by one of its own kind
        (and lane) on this worker keeps them for that one, so the other workers are drained
        once for the run of them, not once for each (a drain idles every worker whose test
        ends first)."""
        if self.kept != kind:
            self._release()
            self._take(kind)
        self.kept = None
        try:
            yield
        finally:
            if kind != NORMAL and next_kind == kind:
                self.kept = kind
            else:
                self._release()

    def _take(self, kind: Kind) -> None:
        """An alone or quiet test waits for its gates holding the turnstile, so no test
        arriving after it goes first. A test of the rest never waits holding it: it tries
        its gates, and where one is held it lets the turnstile go and waits for that gate
        (a test of the rest that waited on one lane holding the turnstile kept the other
        lanes from starting: they ran one after the other)."""
        if kind != NORMAL:
            self._after_the_rest()
        while True:
            fcntl.flock(self.turnstile, fcntl.LOCK_EX)
            try:
                if kind != NORMAL:
                    for gate, mode in self._modes(kind):  # in lane order: no two wait on each other
                        fcntl.flock(gate, mode)
                    return
                held = self._try(self._modes(kind))
                if held is None:
                    return
            finally:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
            fcntl.flock(held, fcntl.LOCK_SH)  # until the test that holds it is done
            fcntl.flock(held, fcntl.LOCK_UN)

    def _after_the_rest(self) -> None:
        """Wait while the scheduler holds the rest file: a test of the rest may not have
        started yet. Each worker runs its last test only once it knows the next, so the
        workers' last tests of the rest start when the lanes are handed out, and a lane
        that went first (its worker's own last test took a millisecond) held one of them
        off at its gate; the lane behind that test then waited for the alone tests too
        (19 s of a run). Bounded: a scheduler that lost count only costs the wait."""
        if self.rest is None:
            return
        deadline = time.monotonic() + REST_WAIT_SECONDS
        while time.monotonic() < deadline:
            try:
                fcntl.flock(self.rest, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                time.sleep(0.02)
                continue
            fcntl.flock(self.rest, fcntl.LOCK_UN)
            self.rest.close()
            self.rest = None  # run: it stays run
            return

    def _try(self, modes: list[tuple[IO[bytes], int]]) -> IO[bytes] | None:
        """Each gate without waiting: None when all are held, else the one that was not
        (and none of them kept)."""
        for gate, mode in modes:
            try:
                fcntl.flock(gate, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                self._release()
                return gate
        return None

    def _modes(self, kind: Kind) -> list[tuple[IO[bytes], int]]:
        if kind == NORMAL:
            return [(gate, fcntl.LOCK_SH) for gate in self.gates]
        if kind == ALONE:
            return [(gate, fcntl.LOCK_EX) for gate in self.gates]
        return [(self.gates[int(kind)], fcntl.LOCK_EX)]

    def _release(self) -> None:
        for gate in self.gates:
            fcntl.flock(gate, fcntl.LOCK_UN)


LOCKS = pytest.StashKey[Locks]()


#: The file in which the workers name the alone and quiet tests, each with its unit of work,
#: for the scheduler: set by the first process before xdist starts the workers, who inherit it.
NAMES_ENV = "TOKENPROBE_ALONE_TESTS"

#: A quiet test's lane, given at collection.
LANE = pytest.StashKey[int]()


def configure(config: pytest.Config) -> None:
    """Under xdist, a worker's locks: in a folder that every worker of this run shares."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        folder = Path(tempfile.gettempdir()) / f"tokenprobe-tests-{workerinput['testrunuid']}"
        names = os.environ.get(NAMES_ENV)
        config.stash[LOCKS] = Locks(folder, rest=None if names is None else rest_file(names))
    else:
        names = Path(tempfile.gettempdir()) / f"tokenprobe-alone-{uuid.uuid4().hex}"
        os.environ[NAMES_ENV] = str(names)


def rest_file(names: str) -> Path:
    """The file the scheduler holds until every test of the rest has run."""
    return Path(f"{names}.rest")


def unconfigure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is None and NAMES_ENV in os.environ:
        names = os.environ.pop(NAMES_ENV)
        Path(names).unlink(missing_ok=True)
        rest_file(names).unlink(missing_ok=True)


def last(items: list[pytest.Item]) -> None:
    """The quiet tests, then the alone tests, moved to the end in the order they were in,
    each quiet module given a lane; under xdist a worker names them with their units in
    the file for the scheduler (each worker collects the same, and gives the same lanes)."""
    _give_lanes([item for item in items if item.get_closest_marker("quiet") is not None])
    items.sort(key=lambda item: {NORMAL: 0, ALONE: 2}.get(str(kind(item)), 1))  # stable
    names = os.environ.get(NAMES_ENV)
    if names and os.environ.get("PYTEST_XDIST_WORKER"):
        written = Path(f"{names}.{os.getpid()}")
        units = (f"{unit(kind(item))}\t{item.nodeid}" for item in items if kind(item) != NORMAL)
        written.write_text("\n".join(units))
        written.replace(names)  # whole, for a reader at any moment


#: What a quiet test is taken to last where its mark names no `seconds`.
QUIET_SECONDS = 0.5


def _give_lanes(quiet: list[pytest.Item]) -> None:
    """Each module's quiet tests to one lane, the longest module first, each to the lane
    that has the fewest seconds so far (a module's seconds: its tests' `seconds` in the
    mark). By test count alone, one lane once took 31 s and the other 14 s."""
    seconds: dict[str, float] = {}
    for item in quiet:
        module = item.nodeid.split("::", 1)[0]
        mark = item.get_closest_marker("quiet")
        given = mark.kwargs.get("seconds", QUIET_SECONDS) if mark is not None else QUIET_SECONDS
        seconds[module] = seconds.get(module, 0.0) + float(given)
    load = [0.0] * LANES
    lane_of: dict[str, int] = {}
    for module in sorted(seconds, key=lambda m: -seconds[m]):  # stable: ties as collected
        lane_of[module] = load.index(min(load))
        load[lane_of[module]] += seconds[module]
    for item in quiet:
        item.stash[LANE] = lane_of[item.nodeid.split("::", 1)[0]]


def kind(item: pytest.Item) -> Kind:
    if item.get_closest_marker("alone") is not None:
        return ALONE
    if item.get_closest_marker("quiet") is not None:
        return item.stash[LANE]
    return NORMAL


def unit(kind: Kind) -> str:
    """The unit of work of the tests of one kind: all the alone tests, or one lane's."""
    return "alone tests" if kind == ALONE else f"quiet tests, lane {kind}"


class AloneLast(LoadScopeScheduling):
    """--dist loadscope, but the alone tests are one unit of work of their own, and each
    lane's quiet tests another, after the rest (they come last in the collection). A test
    module's other tests still go to one worker together, so its module fixtures start
    once there, and once more for its alone or quiet tests.

    These units wait until every other test has run (but each worker's last, which waits
    to know the next), and then go out together: each lane to a worker of its own, the
    alone tests after the first lane. Handed out as workers ran low on work, as loadscope
    does, one worker took both lanes and the alone tests one after the other, while the
    others waited at the gates with the modules they had been given.

    A worker beyond the `active` ones runs the `waiting` modules only (tests/conftest.py,
    `WAITING`), one after the other, and then ends; the active workers take the rest,
    and a waiting module only once no other is left."""

    def __init__(
        self,
        config: pytest.Config,
        log: object = None,
        waiting: Collection[str] = (),
        active: int | None = None,
    ) -> None:
        super().__init__(config, log)  # type: ignore[arg-type]
        self.units: dict[str, str] | None = None
        self._handing_out = False
        # The modules that mostly wait, and how many workers are active: the workers
        # beyond those run the waiting modules only (`_next_unit`).
        self.waiting = set(waiting)
        self.active = active
        # Held until every test of the rest has run; the alone and quiet tests wait for it
        # (Locks._after_the_rest).
        self.rest: IO[bytes] | None = open(rest_file(os.environ[NAMES_ENV]), "ab")  # noqa: SIM115
        fcntl.flock(self.rest, fcntl.LOCK_EX)

    def _let_the_units_go_once_the_rest_has_run(self) -> None:
        if self.rest is None or any(scope not in self._special() for scope in self.workqueue):
            return
        if any(self._left(node, special=False) for node in self.nodes):
            return
        fcntl.flock(self.rest, fcntl.LOCK_UN)
        self.rest.close()
        self.rest = None

    def _split_scope(self, nodeid: str) -> str:
        if self.units is None:  # read when the workers have collected: the first split
            names = Path(os.environ.get(NAMES_ENV, "-"))
            lines = names.read_text().splitlines() if names.is_file() else []
            self.units = {test: name for name, test in (line.split("\t") for line in lines)}
        return self.units.get(nodeid) or super()._split_scope(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        # loadscope's first round hands a unit to each worker; these wait for their turn
        if self._next_is_special() and not self._handing_out:
            return
        if not self._handing_out:
            scope = self._next_unit(node)
            if scope is None:  # a waiting worker with no waiting module left
                node.shutdown()  # runs what it has: held, its last test would wait for the lanes
                return
            self.workqueue.move_to_end(scope, last=False)  # loadscope hands out the first
        super()._assign_work_unit(node)

    def _next_unit(self, node: Any) -> str | None:
        """A waiting worker's next unit is the next waiting module, or none; an active
        worker's is the next other unit of the rest, or a waiting module once no other is
        left (rather than idle while one is still to run)."""
        rest = [scope for scope in self.workqueue if scope not in self._special()]
        waiting = [scope for scope in rest if scope.split("::", 1)[0] in self.waiting]
        if self._waits(node):
            return next(iter(waiting), None)
        return next((scope for scope in rest if scope not in waiting), next(iter(waiting), None))

    def _waits(self, node: Any) -> bool:
        """Whether `node` is a worker beyond the active ones (gw4 of five on 2 cores)."""
        if self.active is None:
            return False
        return int(node.gateway.id.removeprefix("gw")) >= self.active

    def _next_is_special(self) -> bool:
        return bool(self.workqueue) and next(iter(self.workqueue)) in self._special()

    def _reschedule(self, node: Any) -> None:
        self._let_the_units_go_once_the_rest_has_run()
        if not self._next_is_special():
            super()._reschedule(node)
            return
        # A worker runs a test once it knows the one after it (or that none will come):
        # with one test left it waits. So the rest has run when no worker has two left.
        if any(self._left(other, special=False) > 1 for other in self.nodes):
            return
        free = [
            other
            for other in sorted(self.nodes, key=lambda n: self._left(n, special=False))
            if not other.shutting_down and not self._left(other, special=True)
        ]
        given: list[Any] = []
        if unit(ALONE) in self.workqueue:  # the lanes first, whatever order loadscope chose
            self.workqueue.move_to_end(unit(ALONE))
        self._handing_out = True
        while self.workqueue and (free or given):
            # each lane to a worker of its own; the alone tests after the first lane, on
            # its worker (given to another, they would wait at the gates holding the
            # turnstile, and the second lane behind them)
            lane = next(iter(self.workqueue)) != unit(ALONE)
            target = free.pop(0) if free and (lane or not given) else given[0]
            self._assign_work_unit(target)
            given.append(target)
        self._handing_out = False
        if not self.workqueue:  # nothing more will come: each worker runs what it has left
            for other in self.nodes:
                if not other.shutting_down:
                    other.shutdown()

    def _left(self, node: Any, special: bool) -> int:
        """How many of the tests given to `node` have not run: of the alone and quiet
        units, or of the rest."""
        return sum(
            not done
            for scope, tests in self.assigned_work[node].items()
            if (scope in self._special()) == special
            for done in tests.values()
        )

    def _special(self) -> set[str]:
        return set((self.units or {}).values())


@contextmanager
def held_for(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own = kind(item)
    locks = item.config.stash.get(LOCKS, None)
    with ExitStack() as held:
        if locks is not None:
            held.enter_context(locks.hold(own, None if nextitem is None else kind(nextitem)))
        if own != NORMAL:
            held.enter_context(frozen_heap())
        yield


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects made so far left out of the garbage collector's passes, and put back
    after. Many timing tests run the simulator and the proxy in the test's own process;
    late in a run a worker holds about 400,000 objects and a full pass over them took
    141 ms here, a stall of the servers such a test times (one suspect for a first token
    the CI once read 37 ms late). gc.freeze and unfreeze move lists: they cost nothing."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
