"""TPOT of llama-server's n > 1 streams: each choice is a task that counts its own tokens
(proxy/core/observe.py, `_own_outputs`), so a choice's time per token is its span over its
own count, and a choice with a token that streamed no text gives no figure.

The reads are the real `/v1/completions` capture with `n` 2
(tests/fixtures/streams/llamacpp/completions_n2_stream.sse: 5 tokens a choice, `length`
finishes, each task's usage and timings on its finish chunk), timed as a two-slot
llama-server writes them on loopback: both slots decode in one batch, so a step's two
chunks come back to back (about 0.05 ms apart), one step every STEP. A token whose text
ends inside a UTF-8 character streams no chunk at all (tools/server/server-context.cpp,
process_token: `incomplete` sends no partial): against a real two-slot server such a
choice had 23 content events for its 24 tokens, and the share in proportion to events
gave its sibling more tokens than it had, and a TPOT too low (-4 to -13 %)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from proxy.core.measurement import Measurement, TokenSource
from proxy.core.observe import StreamObserver
from proxy.core.request import parse_request
from tests.paths import STREAMS

START, OPENED, FIRST = 100.0, 100.125, 100.5
STEP = 0.01  # one decode step of both slots
BACK_TO_BACK = 0.00005  # the next chunk of the same step
NAME = "completions_n2_stream.sse"
INDEX: dict[str, Any] = orjson.loads((STREAMS / "llamacpp" / "index.json").read_bytes())


def captured() -> tuple[str, dict[str, Any], list[bytes]]:
    """The capture's path, request body and events, one read each."""
    entry = INDEX["requests"][NAME]
    raw = (STREAMS / "llamacpp" / NAME).read_bytes()
    return entry["path"], entry["body"], [p + b"\n\n" for p in raw.split(b"\n\n") if p]


def choice_of(read: bytes) -> dict[str, Any] | None:
    payload = read.strip()[len(b"data: ") :]
    if payload == b"[DONE]":
        return None
    choice: dict[str, Any] = orjson.loads(payload)["choices"][0]
    return choice


def timed(reads: list[bytes]) -> list[float]:
    """Each read's instant: a text chunk of choice 1 opens a step (llama-server writes
    the slots' results in that order, as captured); every other chunk follows the one
    before it back to back."""
    times: list[float] = []
    step = -1
    for read in reads:
        choice = choice_of(read)
        if choice is not None and choice["index"] == 1 and choice["text"]:
            step += 1
            times.append(FIRST + STEP * step)
        else:
            times.append(times[-1] + BACK_TO_BACK)
    return times


def without_text(
    reads: list[bytes], times: list[float], index: int, nth: int
) -> tuple[list[bytes], list[float]]:
    """The reads, and their times, less choice `index`'s `nth` text chunk (from 0): that
    token's text ended inside a UTF-8 character, so llama-server sent nothing for it (its
    bytes come with the next chunk's text, which the measure never reads)."""
    seen = -1
    kept: list[tuple[bytes, float]] = []
    for read, now in zip(reads, times, strict=True):
        choice = choice_of(read)
        if choice is not None and choice["index"] == index and choice["text"]:
            seen += 1
            if seen == nth:
                continue
        kept.append((read, now))
    return [r for r, _ in kept], [t for _, t in kept]


def replay(reads: list[bytes], times: list[float]) -> Measurement:
    path, body, _ = captured()
    info, _ = parse_request(path, orjson.dumps(body))
    observer = StreamObserver(info, start=START)
    observer.open(200, "text/event-stream", OPENED)
    for chunk, now in zip(reads, times, strict=True):
        observer.feed(chunk, now)
    end = times[-1] + BACK_TO_BACK
    observer.end_of_stream(end)
    return asyncio.run(
        observer.finish(
            end=end, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )


def test_the_capture_as_streamed_gives_one_step_per_token() -> None:
    _, _, reads = captured()
    m = replay(reads, timed(reads))
    assert (m.output_tokens, m.token_source) == (10, TokenSource.USAGE)
    assert m.tpot == pytest.approx(STEP, rel=0.01)
    assert m.decode_tokens_per_second == pytest.approx(1 / STEP, rel=0.01)


#: Each task's own count (usage: 5), of which a choice's reads may hold one fewer.
TOKENS = 5


@pytest.mark.parametrize(("index", "nth"), [(0, 0), (0, 4), (1, 0), (1, 2)])
def test_a_choice_with_a_token_that_streamed_no_text_keeps_its_own_count(
    index: int, nth: int
) -> None:
    """Each task's usage says 5 tokens; the choice that streamed 4 texts still generated 5.
    Shared in proportion to events, the sibling was given 5.56 tokens (0.87 of a step
    where nothing was missing from its reads). By its own count each choice's figure is
    right where the token without text lay inside its span, and short by one step in
    N - 1 at most where it lay before its first read or after its last."""
    _, _, reads = captured()
    m = replay(*without_text(reads, timed(reads), index, nth))
    assert m.output_tokens == 10
    assert m.tpot is not None
    assert (TOKENS - 2) / (TOKENS - 1) * STEP * 0.99 <= m.tpot <= STEP * 1.01


def test_a_token_without_text_inside_the_span_leaves_the_figure_exact() -> None:
    _, _, reads = captured()
    m = replay(*without_text(reads, timed(reads), 1, 2))
    assert m.tpot == pytest.approx(STEP, rel=0.01)
    assert m.decode_tokens_per_second == pytest.approx(1 / STEP, rel=0.01)


def test_when_every_choice_streamed_a_token_without_text_each_keeps_its_count() -> None:
    """Neither choice's reads hold its whole count: a figure still, within one step in
    N - 1 (none was said before, for multi-byte text or a stop word at n > 1)."""
    _, _, reads = captured()
    m = replay(*without_text(*without_text(reads, timed(reads), 0, 0), 1, 4))
    assert m.output_tokens == 10
    assert m.tpot is not None
    assert (TOKENS - 2) / (TOKENS - 1) * STEP * 0.99 <= m.tpot <= STEP * 1.01
