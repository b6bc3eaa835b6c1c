"""tests/alone.py: an `alone` test waits for the running tests to end, and holds off the
ones that arrive meanwhile until it is done; a run of alone tests on one worker holds
them off from the first to the last."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

from tests.alone import Locks, frozen_heap


def start(folder: Path, events: list[str], alone: bool, name: str, hold: float) -> threading.Thread:
    """Another worker's test, in a thread: a Locks of its own, as a worker has."""

    def body() -> None:
        with Locks(folder).hold(alone):
            events.append(f"{name} in")
            time.sleep(hold)
            events.append(f"{name} out")

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_an_alone_test_waits_for_the_running_and_holds_off_the_arriving(tmp_path: Path) -> None:
    events: list[str] = []
    running = Locks(tmp_path)
    with running.hold(False):
        events.append("running in")
        alone = start(tmp_path, events, True, "alone", 0.2)
        time.sleep(0.2)
        arriving = start(tmp_path, events, False, "arriving", 0)
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
    with worker.hold(True, next_alone=True):
        events.append("first in")
        arriving = start(tmp_path, events, False, "arriving", 0)
        time.sleep(0.2)
        events.append("first out")
    time.sleep(0.2)  # between the two: the arriving test still waits
    with worker.hold(True, next_alone=False):
        events.append("second in")
        time.sleep(0.1)
        events.append("second out")
    arriving.join(5)
    assert events == [
        "first in", "first out", "second in", "second out", "arriving in", "arriving out"
    ]  # fmt: skip


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
