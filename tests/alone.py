"""Tests marked `alone` run while no other test runs, even in parallel workers.

Some tests compare what was measured with delays the simulator was told to add: a TTFT of
0.2 s must read 0.2 s plus a small slack, a programmed 4 tokens at 10/s must miss an SLO of
0.25 s and 4 at 100/s must meet it. Four workers on two cores add more than such a slack
to a test that shares the CPU with them. So every test holds a lock on one file for its
setup, call and teardown (`pytest_runtest_protocol`, module fixtures included): shared
for most, exclusive for an `alone` test. A second file, the turnstile, is taken for a
moment by every test and held by an `alone` test until it has its exclusive lock, so that
a steady stream of shared holders cannot starve it.

The files are flock(2)ed in a folder of the run's own (xdist's testrunuid); without
workers nothing is locked.

Under xdist every alone test is handed out in one unit of work, last (`AloneLast`): one
worker runs them back to back, keeping the gate from the first to the last, so the others
are drained once, not before each alone test between their own (that cost 40 s a run:
the alone tests took 166 s of the run's wall time for 126 s of their own work). The
workers name the alone tests in a file for the scheduler, which sees node ids only.

An alone test also runs with the process's older objects out of the garbage collector's
reach (`frozen_heap`), in parallel runs and serial ones.
"""

from __future__ import annotations

import fcntl
import gc
import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

import pytest
from xdist.scheduler import LoadScopeScheduling


class Locks:
    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.gate: IO[bytes] = open(folder / "gate", "ab")  # noqa: SIM115 - held for the run
        self.turnstile: IO[bytes] = open(folder / "turnstile", "ab")  # noqa: SIM115
        self.kept = False  # the gate is held exclusively from the test before

    @contextmanager
    def hold(self, alone: bool, next_alone: bool = False) -> Iterator[None]:
        """The gate for one test; an alone test followed by another on this worker keeps
        it for that one, so the other workers are drained once for the run of them, not
        once for each (a drain idles every worker whose test ends first)."""
        if not (alone and self.kept):
            fcntl.flock(self.turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(self.gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            finally:
                fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        self.kept = False
        try:
            yield
        finally:
            if alone and next_alone:
                self.kept = True
            else:
                fcntl.flock(self.gate, fcntl.LOCK_UN)


LOCKS = pytest.StashKey[Locks]()


#: The file in which the workers name the alone tests for the scheduler: set by the first
#: process before xdist starts the workers, who inherit it.
NAMES_ENV = "TOKENPROBE_ALONE_TESTS"


def configure(config: pytest.Config) -> None:
    """Under xdist, a worker's locks: in a folder that every worker of this run shares."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        folder = Path(tempfile.gettempdir()) / f"tokenprobe-tests-{workerinput['testrunuid']}"
        config.stash[LOCKS] = Locks(folder)
    else:
        names = Path(tempfile.gettempdir()) / f"tokenprobe-alone-{uuid.uuid4().hex}"
        os.environ[NAMES_ENV] = str(names)


def unconfigure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is None and NAMES_ENV in os.environ:
        Path(os.environ.pop(NAMES_ENV)).unlink(missing_ok=True)


def last(items: list[pytest.Item]) -> None:
    """The alone tests moved to the end, in the order they were in; under xdist a worker
    names them in the file for the scheduler (each worker collects the same)."""
    items.sort(key=_alone)  # stable
    names = os.environ.get(NAMES_ENV)
    if names and os.environ.get("PYTEST_XDIST_WORKER"):
        written = Path(f"{names}.{os.getpid()}")
        written.write_text("\n".join(item.nodeid for item in items if _alone(item)))
        written.replace(names)  # whole, for a reader at any moment


class AloneLast(LoadScopeScheduling):
    """--dist loadscope, but the alone tests are one unit of work of their own, after the
    rest (they come last in the collection). A test module's other tests still go to one
    worker together, so its module fixtures start once there, and once more for its
    alone tests."""

    SCOPE = "alone tests"

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        super().__init__(config, log)  # type: ignore[arg-type]
        self.alone: set[str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self.alone is None:  # read when the workers have collected: the first split
            names = Path(os.environ.get(NAMES_ENV, "-"))
            self.alone = set(names.read_text().splitlines()) if names.is_file() else set()
        return self.SCOPE if nodeid in self.alone else super()._split_scope(nodeid)


@contextmanager
def held_for(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    alone = _alone(item)
    locks = item.config.stash.get(LOCKS, None)
    with ExitStack() as held:
        if locks is not None:
            held.enter_context(locks.hold(alone, nextitem is not None and _alone(nextitem)))
        if alone:
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


def _alone(item: pytest.Item) -> bool:
    return item.get_closest_marker("alone") is not None
