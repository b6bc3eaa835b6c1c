"""A live progress line on stderr, redrawn in place on a terminal, one line per level otherwise.

Results only bump counters; the line is drawn by a ticker a few times a second, so a
busy run does not spend its time writing to the terminal.
"""

from __future__ import annotations

import asyncio
import bisect
import sys
from collections.abc import Sequence
from time import perf_counter
from typing import TextIO

from proxy.bench.client import Result
from proxy.bench.load import Level

INTERVAL = 0.25


class Progress:
    def __init__(
        self, planned: int | None, stream: TextIO = sys.stderr, enabled: bool = True
    ) -> None:
        self.planned = planned
        self.stream = stream
        self.enabled = enabled
        self.live = enabled and stream.isatty()
        self.level: Level | None = None
        self.done = self.errors = self.tokens = 0
        self._ticker: asyncio.Task[None] | None = None
        self._width = 0

    def result(self, level: Level, result: Result) -> None:
        if level is not self.level:
            self._finish_level()
            self.level = level
            self.done = self.errors = self.tokens = 0
        self.done += 1
        if result.m.ok:
            self.tokens += result.m.output_tokens or 0
        else:
            self.errors += 1

    def start(self) -> None:
        if self.live:
            self._ticker = asyncio.create_task(self._tick())

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        self._finish_level()

    def _line(self) -> str:
        level = self.level
        if level is None:
            return ""
        elapsed = max((level.end or perf_counter()) - level.start, 1e-9)
        of = f"/{self.planned}" if self.planned else ""
        return (
            f"[{level.label}] {self.done}{of} requests, {self.errors} errors, "
            f"{self.done / elapsed:.1f} req/s, {self.tokens / elapsed:.0f} output tok/s, {elapsed:.0f}s"
        )

    def _draw(self) -> None:
        line = self._line()
        pad = " " * max(0, self._width - len(line))
        self.stream.write(f"\r{line}{pad}")
        self.stream.flush()
        self._width = len(line)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL)
            self._draw()

    def _finish_level(self) -> None:
        if not self.enabled or self.level is None:
            return
        if self.live:
            self._draw()
            self.stream.write("\n")
            self._width = 0
        else:
            self.stream.write(self._line() + "\n")
        self.stream.flush()
        self.level = None


class ReplayProgress(Progress):
    """The bench's progress line, saying how many requests were sent of those due by now."""

    def __init__(self, planned: int, enabled: bool, stream: TextIO = sys.stderr) -> None:
        super().__init__(planned, stream, enabled=enabled)
        self.schedule: Sequence[float] = ()
        self.sent_count = 0
        self.began = 0.0

    def start(self) -> None:
        self.began = perf_counter()
        super().start()

    def sent(self) -> None:
        self.sent_count += 1

    def _line(self) -> str:
        due = bisect.bisect_right(self.schedule, perf_counter() - self.began)
        return (
            f"[replay] {self.sent_count} sent / {due} due of {self.planned}, "
            f"{self.done} done, {self.errors} errors, {perf_counter() - self.began:.0f}s"
        )
