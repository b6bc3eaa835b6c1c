"""Edges of the API seams: event `type`s that are no text, Ollama calls that share an index,
and Cohere's names for the sampling options."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from proxy.core.apis import api_for
from proxy.core.apis.base import RequestOptions
from proxy.core.measurement import Measurement
from proxy.core.observe import StreamObserver
from proxy.core.request import parse_request
from proxy.core.toolcalls import CallPiece, ToolCalls
from tests.core.test_apis import (
    MSG_TIMES,
    MSG_WANT,
    RESP_TIMES,
    RESP_WANT,
    START,
    byte_at_a_time,
    events,
    replay,
)

# -- event types that are objects or lists ------------------------------------------------


def sse(event: dict[str, Any]) -> bytes:
    return b"event: x\ndata: " + orjson.dumps(event) + b"\n\n"


ODD_TYPES: list[object] = [{"a": 1}, ["response.output_text.delta"]]


@pytest.mark.parametrize(
    ("endpoint", "stream", "times", "want", "odd"),
    [
        *(
            (
                "/v1/responses",
                "vllm_responses.sse",
                RESP_TIMES,
                RESP_WANT,
                {"type": kind, "delta": "x"},
            )
            for kind in ODD_TYPES
        ),
        *(
            ("/v1/messages", "vllm_messages.sse", MSG_TIMES, MSG_WANT, {"type": kind, "index": 1})
            for kind in ODD_TYPES
        ),
        *(
            (
                "/v1/messages",
                "vllm_messages.sse",
                MSG_TIMES,
                MSG_WANT,
                {"type": "content_block_delta", "index": 1, "delta": {"type": kind, "text": "x"}},
            )
            for kind in ODD_TYPES
        ),
    ],
    ids=[
        "responses-type-object",
        "responses-type-list",
        "messages-type-object",
        "messages-type-list",
        "messages-delta-type-object",
        "messages-delta-type-list",
    ],
)
def test_an_event_whose_type_is_an_object_or_a_list_is_an_unknown_event(
    endpoint: str, stream: str, times: list[float], want: Measurement, odd: dict[str, Any]
) -> None:
    """Such a `type` was looked up in a dict and raised (unhashable), so the whole stream
    went unmeasured; it is an event the seam does not know, ignored as `ping` is."""
    reads = events(stream)
    reads[1] += sse(odd)  # beside the second event, at its time
    end = START + want.e2e
    assert replay(endpoint, reads, times, end) == want
    assert replay(endpoint, *byte_at_a_time(reads, times), end) == want


# -- Ollama tool calls without an id, each numbered 0 -------------------------------------

DONE = {"model": "m", "message": {"role": "assistant", "content": ""}, "done": True,
        "done_reason": "stop", "prompt_eval_count": 26, "eval_count": 30}  # fmt: skip


def ollama_call(city: str) -> dict[str, Any]:
    """A call as Ollama's built-in parsers wrote one before they numbered calls (ollama
    model/parsers, fixed in cc90a035a and fdfe9cec9) and before calls had ids (809b9c68f):
    no `id`, `function.index` 0 (no omitempty)."""
    return {"function": {"index": 0, "name": "get_weather", "arguments": {"city": city}}}


def ollama_record(content_type: str, body: bytes) -> Measurement:
    chat = api_for("/api/chat")
    assert chat is not None
    observer = StreamObserver(chat.read_request({"model": "m", "messages": []}), 0.0)
    observer.open(200, content_type, 0.01)
    observer.feed(body, 0.1)
    observer.end_of_stream(0.2)
    return asyncio.run(
        observer.finish(
            end=0.3, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )


def test_ollama_calls_on_separate_lines_with_the_same_index_and_no_id_count_each() -> None:
    """Ollama sends each call once, whole, on the line of the parser call that read it
    (server/routes.go ChatHandler): a later line's call is never the same call again, even
    when both say index 0 and neither has an id."""
    calls = (ollama_call("Oslo"), ollama_call("Rome"), ollama_call("Oslo"))
    message = {"role": "assistant", "content": ""}
    lines = [
        {"model": "m", "message": {**message, "tool_calls": [c]}, "done": False} for c in calls
    ]
    body = b"".join(orjson.dumps(line) + b"\n" for line in [*lines, DONE])
    m = ollama_record("application/x-ndjson", body)
    assert m.ok and [c.outcome for c in m.tool_calls] == ["complete"] * 3


def test_an_ollama_answer_with_calls_that_share_an_index_counts_each() -> None:
    message = {"role": "assistant", "content": "",
               "tool_calls": [ollama_call("Oslo"), ollama_call("Rome")]}  # fmt: skip
    m = ollama_record("application/json", orjson.dumps({**DONE, "message": message}))
    assert m.ok and [c.outcome for c in m.tool_calls] == ["complete", "complete"]


def test_a_repeated_opening_of_a_closed_call_is_still_no_new_call() -> None:
    """Only a whole call (opened and closed in one piece) is another call on a closed
    one's index; an opening alone (a repeated Responses output_item.added) is not."""
    calls = ToolCalls(0.0)
    calls.add(CallPiece(0, True, ""), 0.1)
    calls.add(CallPiece(0, False, '{"a": 1}', closes=True), 0.2)
    calls.add(CallPiece(0, True, ""), 0.3)
    assert [c.outcome for c in calls.outcomes(length=set(), cut_short=set())] == ["complete"]


# -- Cohere's sampling options ------------------------------------------------------------


def test_cohere_sampling_options_are_read_by_cohere_names() -> None:
    """Cohere chat v2 calls top_p `p`, top_k `k` and stop `stop_sequences`; seed, the
    penalties, response_format, temperature and max_tokens are chat's (vLLM's
    CohereChatV2Request, mapped onto chat's options in cohere/serving.py)."""
    body = {
        "model": "m", "messages": [], "stream": True, "max_tokens": 64, "temperature": 0.3,
        "p": 0.9, "k": 40, "stop_sequences": ["END"], "seed": 7, "frequency_penalty": 0.1,
        "presence_penalty": 0.2, "response_format": {"type": "json_object"},
    }  # fmt: skip
    info, _ = parse_request("/cohere/v2/chat", orjson.dumps(body))
    assert (info.max_tokens, info.temperature) == (64, 0.3)
    assert info.options == RequestOptions(
        seed=7,
        top_p=0.9,
        top_k=40,
        frequency_penalty=0.1,
        presence_penalty=0.2,
        stop_sequences=("END",),
        output_type="json",
    )


def test_cohere_takes_no_chat_only_option_names() -> None:
    """`top_p`, `top_k`, `stop` and `n` are no Cohere fields: vLLM's Cohere route does not
    apply them, so the span does not say them."""
    body = {"model": "m", "messages": [], "top_p": 0.5, "top_k": 3, "stop": "x", "n": 2}
    info, _ = parse_request("/cohere/v2/chat", orjson.dumps(body))
    assert info.options is None
