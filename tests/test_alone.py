"""tests/alone.py: an `alone` test waits for the running tests to end, and holds off the
ones that arrive meanwhile until it is done."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.alone import Locks


def test_an_alone_test_waits_for_the_running_and_holds_off_the_arriving(tmp_path: Path) -> None:
    events: list[str] = []

    def run(alone: bool, name: str, hold: float) -> threading.Thread:
        def body() -> None:
            with Locks(tmp_path).hold(alone):  # a Locks each: one worker each
                events.append(f"{name} in")
                time.sleep(hold)
                events.append(f"{name} out")

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread

    running = Locks(tmp_path)
    with running.hold(False):
        events.append("running in")
        alone = run(True, "alone", 0.2)
        time.sleep(0.2)
        arriving = run(False, "arriving", 0)
        time.sleep(0.2)
        assert events == ["running in"]  # the alone test waits; the arriving one behind it
        events.append("running out")
    alone.join(5)
    arriving.join(5)
    assert events == [
        "running in", "running out", "alone in", "alone out", "arriving in", "arriving out"
    ]  # fmt: skip
