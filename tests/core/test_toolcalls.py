"""Tool calls as the client assembles them (proxy/core/toolcalls.py): outcomes, the bound
on kept arguments, and the observer making a tracker only for streams that carry calls."""

from __future__ import annotations

import asyncio

import orjson

from proxy.core.observe import StreamObserver
from proxy.core.request import CHAT, RequestInfo
from proxy.core.toolcalls import MAX_ARGUMENT_BYTES, MAX_CALLS, CallPiece, ToolCalls


def outcomes(calls: ToolCalls, length: bool = False, cut_short: bool = False) -> list[str]:
    return [c.outcome for c in calls.outcomes(length=length, cut_short=cut_short)]


def test_each_call_is_judged_by_its_arguments() -> None:
    calls = ToolCalls(0.0)
    for index, arguments in enumerate(['{"a": 1}', "[1, 2]", '"8100227755100004332e33211"', "{"]):
        calls.add(CallPiece(index, True, ""), float(index))
        calls.add(CallPiece(index, False, arguments), index + 0.5)
    assert outcomes(calls) == ["complete", "invalid_arguments", "invalid_arguments",
                               "invalid_arguments"]  # fmt: skip
    assert [c.arguments_seconds for c in calls.outcomes(length=False, cut_short=False)] == [0.5] * 4


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
    call = calls.calls[0]
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
