"""When each chunk of a stream is due: free-running per stream, or in global lockstep.

All times are on the event loop's clock (`loop.time()`), which is also the clock its
timers fire on; under uvloop that clock is cached per loop iteration, so deadlines
taken from it land on time where `time.monotonic()` ones would fire early.

Both pacers work with absolute deadlines: a late wake-up makes the next gap shorter
instead of pushing every later chunk back, so timing does not drift.
"""

from __future__ import annotations

import asyncio
import math
from typing import Protocol


class Pacer(Protocol):
    async def first(self) -> None:
        """Wait until the first token is due."""

    async def next(self) -> None:
        """Wait until the next chunk is due."""

    async def pause(self, seconds: float) -> None:
        """Go silent for `seconds`; everything after moves back by as much."""


class FreePacer:
    """One stream on its own: first chunk at t0 + ttft, then one every `interval`."""

    __slots__ = ("_deadline", "_interval", "_loop")

    def __init__(self, t0: float, ttft: float, interval: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._deadline = t0 + ttft
        self._interval = interval

    async def first(self) -> None:
        await self._until(self._deadline)

    async def next(self) -> None:
        self._deadline += self._interval
        await self._until(self._deadline)

    async def pause(self, seconds: float) -> None:
        self._deadline += seconds
        await self._until(self._deadline)

    async def _until(self, deadline: float) -> None:
        delay = deadline - self._loop.time()
        if delay > 0:
            await asyncio.sleep(delay)


class StepClock:
    """The decode-step clock of a continuously batching engine, shared by all streams.

    Ticks fall on a fixed grid (epoch + k * step). One ticker task wakes every waiter
    of a tick at once; it runs only while someone waits. When the loop wakes up late
    (a busy box), the missed ticks fire back to back, each after the streams woken by
    the one before have sent: the simulator's own jitter must not slow its streams.
    """

    def __init__(self, step: float) -> None:
        self.step = step
        self._epoch: float | None = None
        self._tick = 0  # the last tick fired (or passed while nobody waited)
        self._waiting: dict[int, asyncio.Event] = {}
        self._ticker: asyncio.Task[None] | None = None
        self.fired = 0  # ticks fired while someone waited
        self.late = 0  # of those, ticks fired a whole step or more after they were due

    async def wait_until(self, when: float) -> None:
        """Wait for the first tick at or after loop time `when`."""
        epoch = self._start()
        await self._wait(max(math.ceil((when - epoch) / self.step), self._tick + 1))

    async def next_tick(self) -> None:
        self._start()
        await self._wait(self._tick + 1)

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()

    def _start(self) -> float:
        loop = asyncio.get_running_loop()
        if self._epoch is None:
            self._epoch = loop.time()
        if self._ticker is None:
            # Idle: the ticks that passed unobserved count as fired.
            self._tick = max(self._tick, int((loop.time() - self._epoch) / self.step))
            self._ticker = loop.create_task(self._run())
        return self._epoch

    async def _wait(self, tick: int) -> None:
        event = self._waiting.get(tick)
        if event is None:
            event = self._waiting[tick] = asyncio.Event()
        await event.wait()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._epoch is not None
        try:
            while self._waiting:
                delay = self._epoch + (self._tick + 1) * self.step - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay <= -self.step:
                    self.late += 1
                self._tick += 1
                self.fired += 1
                event = self._waiting.pop(self._tick, None)
                if event is not None:
                    event.set()
                # Let the woken streams send and queue for the next tick before it fires.
                await asyncio.sleep(0)
        finally:
            self._ticker = None


class LockstepPacer:
    """One stream on the shared StepClock: first token on the first tick after ttft."""

    __slots__ = ("_clock", "_due")

    def __init__(self, clock: StepClock, t0: float, ttft: float) -> None:
        self._clock = clock
        self._due = t0 + ttft

    async def first(self) -> None:
        await self._clock.wait_until(self._due)

    async def next(self) -> None:
        await self._clock.next_tick()

    async def pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
