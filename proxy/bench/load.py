"""Load shapes: a closed-loop concurrency sweep, or open-loop Poisson arrivals at fixed rates.

Closed loop: N workers, each sending its next request when the last one ends; the
backend's speed sets the arrival rate. Open loop: requests are due at Poisson arrival
times whatever the backend does; each one is measured from the time it was due, so a
slow backend (or a busy client) shows up in the latencies instead of silently thinning
the load (coordinated omission). How late sends actually were is kept per request.
Replay (a Schedule): each request at its recorded offset, open loop as well.

A run stops early when the first requests all fail the same way (a wrong key, an
unknown model, an unreachable URL): more of them would measure nothing. It stops too when
the backend stops answering mid-run (it died): a long run of requests that failed before
any response, each at once, would measure nothing but the bench's own speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from time import perf_counter, process_time
from typing import Any

import yarl

from proxy.bench.client import Call, Result, finalize, headers, measure_wire, needs_tokenizer
from proxy.bench.options import Options, label
from proxy.bench.wire import Pool
from proxy.core.measurement import ErrorType, Measurement

#: Stop the run when this many first requests all fail with the same error type: the
#: first ones this process sent, each judged once it ended (a quick 400 that ends before
#: a slower success sent earlier judges nothing alone).
FAIL_FAST = 3

#: Stop the run when the backend stopped answering: at least DEAD_REQUESTS requests in a
#: row, over at least DEAD_SECONDS, each failed before any response came (NO_ANSWER). Both:
#: a closed loop on a dead port fails thousands a second, so a count alone would stop on a
#: backend's restart blip; a slow open loop sends a few a second, so a time alone would stop
#: on a handful. An overloaded but live backend answers (a 429, a 503, a slow or cut-off
#: stream), and any answer, like any success, starts the count again.
DEAD_REQUESTS = 50
DEAD_SECONDS = 2.0

#: Failures before any response: the connection was refused, unreachable, or reset before
#: the response's head (UPSTREAM_ERROR with no status). Not a timeout: a hung backend fails
#: no faster than --timeout, so it cannot spin, and queued requests timing out are a
#: measurement of overload.
NO_ANSWER = frozenset((ErrorType.UPSTREAM_UNREACHABLE, ErrorType.UPSTREAM_ERROR))

#: In a closed loop, how long a stream waits before its next request while the backend is
#: not answering: without it the streams resend at once, and a dead port fails tens of
#: thousands of requests a second (each a record in the JSON) until the rule above stops it.
NO_ANSWER_BACKOFF = 0.05


@dataclass(slots=True)
class Level:
    index: int
    value: float  # the concurrency (closed loop) or the rate per second (open loop)
    label: str
    start: float = 0.0  # perf_counter(): first request due
    end: float = 0.0  # perf_counter(): last request done
    results: list[Result] = field(default_factory=list)
    cancelled: int = 0  # requests in flight when the run was stopped, not recorded
    loop_lag: list[float] = field(default_factory=list)  # see LoopLag
    cpu: float = 0.0  # CPU seconds this process spent during the level (process_time)


class LoopLag:
    """How late the bench's own event loop wakes up. A busy client timestamps every read
    late, so its latencies grow with its own load; this says when that happened."""

    INTERVAL = 0.02

    def __init__(self, samples: list[float]) -> None:
        self.samples = samples
        self._task = asyncio.create_task(self._watch())

    def stop(self) -> None:
        self._task.cancel()

    async def _watch(self) -> None:
        while True:
            before = perf_counter()
            await asyncio.sleep(self.INTERVAL)
            self.samples.append(max(0.0, perf_counter() - before - self.INTERVAL))


@dataclass(frozen=True, slots=True)
class Schedule:
    """A recorded workload's timing: call i is due `offsets[i]` seconds after the start
    and is recorded as request `indices[i]` of the whole workload."""

    offsets: Sequence[float]
    indices: Sequence[int]
    on_send: Callable[[], None] | None = None
    #: Per call, None (it goes at its offset) or (position of an earlier call, seconds): it
    #: goes that many seconds after that call's answer ended (a conversation's next turn).
    after: Sequence[tuple[int, float] | None] = ()


class Runner:
    """Runs every level of `options` in turn; `interrupt()` stops it cleanly from a signal handler."""

    def __init__(
        self,
        options: Options,
        calls: list[Call],
        tokenizer: Any = None,
        on_result: Callable[[Level, Result], None] | None = None,
        schedule: Schedule | None = None,
        start_at: float | None = None,
    ) -> None:
        self.options = options
        self.calls = calls
        self.schedule = schedule
        # A shard (--shard I/N, --workers) sends only its share of the load: in an open
        # loop the requests numbered I mod N of the shared schedule, in a closed loop its
        # share of the streams; the first level starts at `start_at` (one instant for
        # every worker), the later ones when this process finished the one before.
        self.shard = options.shard or (0, 1)
        self.start_at = start_at
        self.tokenizer = tokenizer
        self.on_result = on_result
        self.levels: list[Level] = []
        self.stop_reason: str | None = None  # "interrupted" or "failing"
        self.failure: Result | None = None  # the first failed request, while all failed alike
        self._judging = True  # until the first success, or failures of different types
        # the first FAIL_FAST requests this process sent, (level, index), and how each ended
        self._first: dict[tuple[int, int], Result | None] = {}
        self._unanswered = 0  # requests in a row that got no response at all (NO_ANSWER)
        self._unanswered_since = 0.0  # perf_counter(): when the first of them ended
        self._headers = headers(options)
        self._urls = {options.endpoint: yarl.URL(options.url)}  # parsed once per API
        self._tasks: set[asyncio.Task[Any]] = set()
        self._active = 0  # requests begun and not yet recorded
        # when each request in flight was sent: one sent before a run of unanswered ones
        # and still going is being answered (a long stream), so the backend is alive
        self._sent: dict[tuple[int, int], float] = {}
        self.dead_mid_run = False  # stopped as the backend stopped answering, after answers
        self._answered = 0  # requests that succeeded
        self._cancelled = 0
        self._stopped = asyncio.Event()
        self._client: Pool | None = None

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None

    def interrupt(self) -> None:
        self._stop("interrupted")

    async def run(self) -> list[Level]:
        self._client = Pool(
            yarl.URL(self.options.base_url), self.options.timeout, uds=self.options.uds
        )
        try:
            for index, value in enumerate(self.options.levels):
                if self.stopping:
                    break
                level = Level(index, value, label(self.options.mode, value))
                self.levels.append(level)
                lag = LoopLag(level.loop_lag)
                level.start = self._origin()
                cpu = process_time()
                try:
                    if self.schedule is not None:
                        await self._replay(level, self.schedule)
                    elif self.options.mode == "closed":
                        await self._closed(level, int(value))
                    else:
                        await self._open(level, value)
                finally:
                    level.end = perf_counter()
                    level.cpu = process_time() - cpu
                    lag.stop()
                for result in level.results:
                    finalize(result, self.tokenizer)
        finally:
            self._client.close()
        return self.levels

    # -- load shapes ------------------------------------------------------------------

    async def _closed(self, level: Level, concurrency: int) -> None:
        n, deadline = self.options.max_requests, self._deadline(level)
        mine, shards = self.shard
        streams = range(mine, min(concurrency, n), shards)  # this shard's streams
        # Request j is stream j % concurrency's, as in one process, and so this shard's when
        # that stream is: each shard sends the requests of its own streams, so the shards
        # together run `concurrency` streams to the same total (an equal share each, I,
        # I+N, ..., left a shard with fewer streams running on alone, at less concurrency).
        numbers = (j for j in itertools.count() if j % concurrency % shards == mine)
        ramp = self.options.ramp_up / concurrency

        async def worker(number: int) -> None:
            # from the level's start (--start-at's or --workers' shared instant, which may
            # lie ahead), each stream `ramp` after the one before it
            await self._sleep_until(level.start + number * ramp)
            while not self.stopping:
                index = next(numbers)
                if index >= n or perf_counter() >= deadline:
                    return
                await self._one(level, index, perf_counter())
                if self._unanswered:  # the backend is not answering: don't spin on it
                    await self._sleep_until(perf_counter() + NO_ANSWER_BACKOFF)

        await self._gather(level, [worker(k) for k in streams])

    async def _open(self, level: Level, rate: float) -> None:
        rng = random.Random(self.options.seed * 1_000_003 + level.index)
        cap = self.options.max_concurrency
        slots = asyncio.Semaphore(cap) if cap else None
        deadline = self._deadline(level)
        due = level.start
        for index in range(self.options.max_requests):
            if index:
                due += rng.expovariate(rate)
            if due >= deadline:
                break
            if index % self.shard[1] != self.shard[0]:
                continue  # another shard's request
            await self._sleep_until(due)
            if self.stopping:
                break
            self._spawn(self._one(level, index, due, slots))
        await self._gather(level, [])

    async def _replay(self, level: Level, schedule: Schedule) -> None:
        """Each call at its own offset from the start (a recorded workload), open loop;
        a call that follows another (`schedule.after`) goes its gap after that one ended."""
        after = schedule.after or [None] * len(self.calls)
        loop = asyncio.get_running_loop()
        # when each call's answer ended (perf_counter()), for the calls that follow it
        ended: list[asyncio.Future[float]] = [loop.create_future() for _ in self.calls]
        calls = list(zip(self.calls, schedule.offsets, schedule.indices, after, strict=True))
        # Followers wait from the start: each is due when its earlier answer ended, which
        # the loop below, asleep until later offsets, would not see in time.
        for position, (call, _, index, follows) in enumerate(calls):
            if follows is not None:
                self._spawn(
                    self._follow(level, ended, position, follows, index, call, schedule.on_send)
                )
        for position, (call, offset, index, follows) in enumerate(calls):
            if follows is not None:
                continue
            due = level.start + offset
            await self._sleep_until(due)
            if self.stopping:
                break
            if schedule.on_send is not None:
                schedule.on_send()
            self._spawn(self._then(ended[position], self._one(level, index, due, call=call)))
        await self._gather(level, [])

    async def _follow(
        self,
        level: Level,
        ended: list[asyncio.Future[float]],
        position: int,
        follows: tuple[int, float],
        index: int,
        call: Call,
        on_send: Callable[[], None] | None,
    ) -> None:
        """A conversation's next turn: due its gap after the earlier turn's answer ended."""
        earlier, gap = follows
        try:
            # shielded: cancelling this task must not cancel the end that others await
            due = await asyncio.shield(ended[earlier]) + gap
            await self._sleep_until(due)
            if self.stopping:
                return
            if on_send is not None:
                on_send()
            await self._one(level, index, due, call=call)
        finally:
            ended[position].set_result(perf_counter())

    @staticmethod
    async def _then(ended: asyncio.Future[float], work: Any) -> None:
        try:
            await work
        finally:
            ended.set_result(perf_counter())

    def _origin(self) -> float:
        """The level's start: now, or (first level) the instant every worker shares."""
        start_at, self.start_at = self.start_at, None
        return perf_counter() if start_at is None else start_at

    async def _sleep_until(self, instant: float) -> None:
        """Sleep until the perf_counter() `instant`, or until the run is stopped. Never
        before it: the loop's timers may fire up to a millisecond early (uvloop's are in
        whole milliseconds), and a request sent early would read low from its due time."""
        while (delay := instant - perf_counter()) > 0 and not self.stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), delay)

    def _deadline(self, level: Level) -> float:
        duration = self.options.duration
        return level.start + duration if duration is not None else float("inf")

    # -- one request ------------------------------------------------------------------

    async def _one(
        self,
        level: Level,
        index: int,
        due: float,
        slots: asyncio.Semaphore | None = None,
        call: Call | None = None,
    ) -> None:
        if call is None:
            # level by level through the prompts: each request of the run its own prompt
            # where there are as many (--input-tokens builds them so), in turn where fewer
            call = self.calls[(level.index * self.options.max_requests + index) % len(self.calls)]
        url = self._urls.get(call.info.endpoint)
        if url is None:
            url = self._urls[call.info.endpoint] = yarl.URL(
                self.options.base_url + call.info.endpoint
            )
        keep_text = self.tokenizer is not None
        assert self._client is not None, "run() opens the client"
        if self._judging and len(self._first) < min(FAIL_FAST, self.options.max_requests):
            self._first[(level.index, index)] = None  # one of the requests that judge the run
        self._active += 1
        try:
            if slots is not None:
                await slots.acquire()
            try:
                sent = self._sent[level.index, index] = perf_counter()
                m, observer = await measure_wire(
                    self._client, url, self._headers, call, due, keep_text
                )
            finally:
                if slots is not None:
                    slots.release()
        finally:
            self._active -= 1
            self._sent.pop((level.index, index), None)
        keep = observer if keep_text and needs_tokenizer(m) else None
        result = Result(level.index, index, due, sent, m, keep)
        level.results.append(result)
        self._judge(result)
        self._watch_backend(result)
        if self.on_result is not None:
            self.on_result(level, result)

    def _judge(self, result: Result) -> None:
        """Stop when the first requests of the run all failed with the same error type."""
        if not self._judging:
            return
        if result.m.ok:
            self._judging, self.failure = False, None
            return
        key = (result.level, result.index)
        if key not in self._first:  # a later request: the first ones judge
            return
        self._first[key] = result
        if self.failure is None:
            self.failure = result
        elif result.m.error_type is not self.failure.m.error_type:
            self._judging, self.failure = False, None  # mixed failures: no one clear problem
            return
        if None not in self._first.values():  # every one of them ended, failed alike
            self._stop("failing")

    def _watch_backend(self, result: Result) -> None:
        """Stop when the backend stopped answering (DEAD_REQUESTS, DEAD_SECONDS); the
        request that decided it names the problem, as the first failures' would."""
        if not unanswered(result.m):
            self._unanswered = 0
            self._answered += result.m.error_type is None
            return
        now = perf_counter()
        if not self._unanswered:
            self._unanswered_since = now
        self._unanswered += 1
        if self._unanswered >= DEAD_REQUESTS and now - self._unanswered_since >= DEAD_SECONDS:
            if any(at < self._unanswered_since for at in self._sent.values()):
                return  # a request sent before the run of failures is still being answered
            if not self.stopping:
                self.failure = result
                self.dead_mid_run = self._answered > 0
            self._stop("failing")

    # -- tasks ------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _gather(self, level: Level, coros: list[Coroutine[Any, Any, None]]) -> None:
        for coro in coros:
            self._spawn(coro)
        while self._tasks:
            done, _ = await asyncio.wait(set(self._tasks))
            for task in done:
                if not task.cancelled() and (error := task.exception()) is not None:
                    raise error  # a bug in the bench itself: say so rather than lose results
        if self.stopping:
            level.cancelled += self._cancelled
            self._cancelled = 0

    def _stop(self, reason: str) -> None:
        if self.stopping:
            return
        self.stop_reason = reason
        self._stopped.set()
        self._cancelled = self._active
        for task in self._tasks:
            task.cancel()


def unanswered(m: Measurement) -> bool:
    """The request failed before any response came (NO_ANSWER, no status)."""
    return m.status_code == 0 and m.error_type in NO_ANSWER
