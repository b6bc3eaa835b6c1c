"""The event loop's lag, sampled: how late the loop wakes a task that asked to sleep.

One small task per process (started with the app, stopped with it) sleeps `interval`
seconds over and over and reports how much later than asked it woke. A loop busy with
JSON, a blocking call or too many streams shows here first: every request on that loop
waited as long. The clock and the observer are passed in, so tests need no patching.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from time import perf_counter

#: Often enough to see a stall of a fraction of a second, rare enough to cost nothing.
INTERVAL = 0.25


class LoopLag:
    def __init__(
        self,
        observe: Callable[[float], None],
        interval: float = INTERVAL,
        clock: Callable[[], float] = perf_counter,
    ) -> None:
        self.observe, self.interval, self.clock = observe, interval, clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="tokenprobe-loop-lag")

    async def _run(self) -> None:
        clock, interval, observe = self.clock, self.interval, self.observe
        while True:
            due = clock() + interval
            await asyncio.sleep(interval)
            observe(max(0.0, clock() - due))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
