"""The loop-lag sampler reports how late the loop woke it, on a real event loop."""

from __future__ import annotations

import asyncio
import time

from proxy.server.looplag import LoopLag
from tests.server.conftest import no_proxy

pytestmark = no_proxy  # runs no proxy: once, on no data path


def test_a_blocked_loop_shows_as_lag_and_an_idle_one_as_little() -> None:
    seen: list[float] = []

    async def main() -> None:
        lag = LoopLag(seen.append, interval=0.02)
        lag.start()
        while len(seen) < 2:  # an idle loop: a couple of samples first
            await asyncio.sleep(0.01)
        idle = len(seen)
        time.sleep(0.3)  # the loop is blocked: the sampler wakes late
        while len(seen) <= idle:
            await asyncio.sleep(0.01)
        await lag.stop()

    asyncio.run(main())
    assert max(seen) >= 0.25  # the 0.3 s block, less the sleep that was due within it
    assert min(seen) >= 0.0


def test_stop_ends_the_task_and_start_is_once() -> None:
    async def main() -> int:
        lag = LoopLag(lambda _: None, interval=0.01)
        lag.start()
        lag.start()
        tasks = [t for t in asyncio.all_tasks() if t.get_name() == "tokenprobe-loop-lag"]
        await lag.stop()
        return len(tasks)

    assert asyncio.run(main()) == 1
