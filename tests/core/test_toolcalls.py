"""Tool calls as the client assembles them (proxy/core/toolcalls.py): outcomes, the bound
on kept arguments, and the observer making a tracker only for streams that carry calls."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from proxy.core.measurement import ErrorType
from proxy.core.observe import StreamObserver
from proxy.core.request import CHAT, RequestInfo
from proxy.core.toolcalls import MAX_ARGUMENT_BYTES, MAX_CALLS, CallPiece, ToolCalls


def outcomes(calls: ToolCalls, length: bool = False, cut_short: bool = False) -> list[str]:
    """The outcomes of a one-choice stream's calls."""
    ended = {0} if length else set(), {0} if cut_short else set()
    return [c.outcome for c in calls.outcomes(length=ended[0], cut_short=ended[1])]


def test_each_call_is_judged_by_its_arguments() -> None:
    calls = ToolCalls(0.0)
    for index, arguments in enumerate(['{"a": 1}', "[1, 2]", '"8100227755100004332e33211"', "{"]):
        calls.add(CallPiece(index, True, ""), float(index))
        calls.add(CallPiece(index, False, arguments), index + 0.5)
    assert outcomes(calls) == ["complete", "invalid_arguments", "invalid_arguments",
                               "invalid_arguments"]  # fmt: skip
    assert [c.arguments_seconds for c in calls.outcomes(length=set(), cut_short=set())] == [0.5] * 4


def test_the_last_call_of_a_length_finish_is_truncated_even_if_its_json_closed() -> None:
    calls = ToolCalls(0.0)
    for index in (0, 1):
        calls.add(CallPiece(index, True, '{"a": 1}'), 0.0)
    assert outcomes(calls, length=True) == ["complete", "truncated"]


def test_a_stream_cut_short_truncates_its_open_call_not_a_closed_one() -> None:
    calls = ToolCalls(0.0)
    calls.add(CallPiece(0, True, '{"a": 1}'), 0.0)
    calls.add(CallPiece(0, False, "", closes=True), 0.25)
    assert outcomes(calls, cut_short=True) == ["complete"]
    calls.add(CallPiece(1, True, '{"a":'), 0.5)
    assert outcomes(calls, cut_short=True) == ["complete", "truncated"]


def test_arguments_over_the_bound_are_forgotten_and_judged_unknown() -> None:
    calls = ToolCalls(0.0)
    calls.add(CallPiece(0, True, "{"), 0.0)
    piece = "x" * 65536
    for i in range(3 * MAX_ARGUMENT_BYTES // len(piece)):  # 3 MiB in 64 KiB pieces
        calls.add(CallPiece(0, False, piece), 1.0 + i)
    call = calls.calls[0, 0]  # (choice, call)
    assert call.parts is None  # nothing kept beyond the bound
    assert outcomes(calls) == ["unknown"]


def test_calls_beyond_the_bound_are_counted_as_unknown() -> None:
    calls = ToolCalls(0.0)
    for index in range(MAX_CALLS + 3):
        calls.add(CallPiece(index, True, "{}"), 0.0)
    assert len(calls.calls) == MAX_CALLS
    assert outcomes(calls).count("unknown") == 3


def test_a_plain_text_stream_makes_no_tracker() -> None:
    observer = StreamObserver(RequestInfo(CHAT, "m", True, False, None, None), start=0.0)
    observer.open(200, "text/event-stream", 0.0)
    for i in range(5):
        chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
        observer.feed(b"data: " + orjson.dumps(chunk) + b"\n\n", 0.125 * (i + 1))
    observer.feed(b"data: [DONE]\n\n", 1.0)
    record = asyncio.run(
        observer.finish(
            end=1.0, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )
    assert observer.tools is None and record.tool_calls == ()
    assert (record.first_answer, record.without_answer, record.reasoning_tokens) == (
        0.125,
        None,
        None,
    )


def test_a_forced_call_cut_before_its_first_delta_is_a_request_without_answer() -> None:
    # vLLM with tool_choice "required" and a small max_tokens: only finish_reason length
    observer = StreamObserver(RequestInfo(CHAT, "m", True, True, 8, None), start=0.0)
    observer.open(200, "text/event-stream", 0.0)
    for event in (
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 8}},
    ):
        observer.feed(b"data: " + orjson.dumps(event) + b"\n\n", 0.5)
    observer.feed(b"data: [DONE]\n\n", 0.5)
    record = asyncio.run(
        observer.finish(
            end=0.5, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )
    assert (record.ttft, record.output_tokens, record.without_answer) == (None, 8, "length")


def n_choices_stream(choice_1_finish: str | None) -> list[dict[str, object]]:
    """Two choices calling tools, as vLLM streams n = 2: one choice per chunk, each with
    its own tool parser numbering its calls from 0 (chat_completion/serving.py)."""

    def piece(choice: int, call: int, arguments: str, name: str | None = None) -> dict[str, object]:
        function: dict[str, str] = {"arguments": arguments}
        opening: dict[str, object] = {}
        if name is not None:
            function["name"] = name
            opening = {"id": f"call-{choice}-{call}", "type": "function"}
        delta = {"tool_calls": [{"index": call, **opening, "function": function}]}
        return {"choices": [{"index": choice, "delta": delta}]}

    events = [
        {"choices": [{"index": c, "delta": {"role": "assistant", "content": ""}}]} for c in (0, 1)
    ]
    events += [
        piece(0, 0, "", "get_weather"), piece(1, 0, "", "get_weather"),
        piece(0, 0, '{"city": "Oslo"}'), piece(1, 0, "false"),
        piece(0, 1, "", "get_weather"), piece(1, 1, "", "get_weather"),
        piece(0, 1, '{"city": "Rome"}'), piece(1, 1, '{"city": "Pa'),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]  # fmt: skip
    if choice_1_finish is not None:
        events.append({"choices": [{"index": 1, "delta": {}, "finish_reason": choice_1_finish}]})
    return events


@pytest.mark.parametrize("choice_1_finish", ["length", None])
def test_each_choice_s_calls_are_judged_by_that_choice_s_end(choice_1_finish: str | None) -> None:
    """n = 2: four calls reach the client, two a choice. Choice 0 finished `tool_calls`, so
    its last call is judged by its arguments; choice 1's last call is truncated, whether
    choice 1 ran out of tokens or the stream was cut before its finish."""
    observer = StreamObserver(RequestInfo(CHAT, "m", True, True, 8, None), start=0.0)
    observer.open(200, "text/event-stream", 0.0)
    for i, event in enumerate(n_choices_stream(choice_1_finish)):
        observer.feed(b"data: " + orjson.dumps(event) + b"\n\n", 0.125 * (i + 1))
    if choice_1_finish is not None:
        observer.feed(b"data: [DONE]\n\n", 2.0)
    record = asyncio.run(
        observer.finish(
            end=2.0,
            started_at=0.0,
            status_code=200,
            error_type=None if choice_1_finish else ErrorType.STREAM_TRUNCATED,
            error_message=None,
        )
    )
    assert [call.outcome for call in record.tool_calls] == [
        "complete",  # choice 0, call 0
        "invalid_arguments",  # choice 1, call 0: `false`
        "complete",  # choice 0, call 1: its choice finished tool_calls
        "truncated",  # choice 1, call 1
    ]
