"""proxy/server/deadline.py: one timer for a wait that restarts often, looked at when it
fires; an owner that is done is freed at once (no reference cycle through its timer)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from time import perf_counter

from proxy.server.deadline import LEAST_DELAY, Deadline
from tests.server.conftest import no_proxy

pytestmark = no_proxy  # runs no proxy: once, on no data path


class Wait(Deadline):
    """A wait on something that arrives now and then: expired after `limit` of silence."""

    __slots__ = ("__weakref__", "expired", "last", "limit", "looks")

    def __init__(self, limit: float) -> None:
        Deadline.__init__(self)
        self.limit = limit
        self.last = perf_counter()
        self.looks = 0
        self.expired: float | None = None

    def time_left(self) -> float | None:
        self.looks += 1
        quiet = perf_counter() - self.last
        if quiet >= self.limit:
            self.expired = quiet
            return None
        return self.limit - quiet


def test_a_wait_that_restarts_is_cut_a_limit_after_its_last_restart_with_few_looks() -> None:
    async def main() -> tuple[Wait, float]:
        wait = Wait(0.1)
        wait.due_within(wait.limit)
        for _ in range(20):  # 20 restarts, 10 ms apart: no timer armed for any of them
            await asyncio.sleep(0.01)
            wait.last = perf_counter()
        last = wait.last
        while wait.expired is None:
            await asyncio.sleep(0.005)
        return wait, perf_counter() - last

    wait, after_last = asyncio.run(main())
    assert wait.expired is not None and wait.expired >= 0.1
    assert 0.1 <= after_last < 0.3, after_last
    assert wait.looks <= 5, wait.looks  # the first look and one re-arm per limit, not 20


def test_a_later_look_does_not_put_off_a_sooner_one_and_a_cancel_stops_it() -> None:
    async def main() -> tuple[int, int]:
        wait = Wait(10.0)  # never expires here: only the looks are counted
        wait.due_within(0.02)
        wait.due_within(5.0)  # stays due within 0.02
        await asyncio.sleep(0.1)
        looked = wait.looks
        wait.cancel_deadline()
        await asyncio.sleep(0.05)
        assert wait.deadline is None
        return looked, wait.looks

    looked, after_cancel = asyncio.run(main())
    assert looked == 1 and after_cancel == 1


def test_a_wait_with_nothing_left_is_looked_at_again_after_the_least_delay() -> None:
    class Early(Wait):
        __slots__ = ()

        def time_left(self) -> float | None:
            self.looks += 1
            return 0.0 if self.looks < 3 else None  # the loop fired "a little early" twice

    async def main() -> tuple[int, float]:
        wait = Early(1.0)
        start = perf_counter()
        wait.due_within(0.0)
        while wait.looks < 3:
            await asyncio.sleep(0)
        return wait.looks, perf_counter() - start

    looks, took = asyncio.run(main())
    assert looks == 3 and took >= 2 * LEAST_DELAY


def test_an_owner_that_is_done_is_freed_without_the_garbage_collector() -> None:
    async def main() -> weakref.ref[Wait]:
        wait = Wait(1.0)
        wait.due_within(1.0)
        wait.cancel_deadline()
        return weakref.ref(wait)

    gc.disable()
    try:
        ref = asyncio.run(main())
        assert ref() is None  # a cycle through the timer would keep it (and its buffers)
    finally:
        gc.enable()
