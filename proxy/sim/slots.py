"""vLLM's --max-num-seqs: the sequences the scheduler runs at once, taken first come first
served.

A request with `n` choices is `n` child requests in vLLM (vllm/v1/engine/async_llm.py,
ParentRequest; vllm/v1/engine/parallel_sampling.py), each a sequence of its own, so it
takes `n` slots. The simulator decodes a request's choices together, so it takes them all
at once, and at most every slot there is: where vLLM would run the children over
`max_num_seqs` in waves, the simulator runs them in one (no deadlock, one stream).

Waiters are served in order: one that does not fit yet blocks those behind it, as vLLM's
FCFS scheduler stops at the first waiting request it cannot schedule.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Slots:
    __slots__ = ("_free", "_total", "_waiters")

    def __init__(self, total: int) -> None:
        self._total = total
        self._free = total
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @asynccontextmanager
    async def hold(self, n: int = 1) -> AsyncIterator[None]:
        """Hold `n` slots (at most all of them) while the body runs."""
        n = min(n, self._total)
        await self._acquire(n)
        try:
            yield
        finally:
            self._free += n
            self._wake()

    async def _acquire(self, n: int) -> None:
        if not self._waiters and self._free >= n:
            self._free -= n
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._free += n  # granted, but the request went away first
            elif entry in self._waiters:
                self._waiters.remove(entry)
            self._wake()
            raise

    def _wake(self) -> None:
        while self._waiters and self._waiters[0][0] <= self._free:
            n, waiter = self._waiters.popleft()
            if not waiter.done():  # a cancelled one is skipped
                self._free -= n
                waiter.set_result(None)
