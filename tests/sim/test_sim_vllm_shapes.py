"""The simulator's chunks and bodies have real vLLM 0.32's keys, in vLLM's order, nulls
included: each is compared key by key with the capture of the same request kind
(tests/fixtures/streams/vllm-0.32, copied from /work/shared/fixtures/vllm-0.32, whose
index.json gives each request). Only the values may differ (ids, text, timings)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.sim.app import SimApp, create_sim_app
from proxy.sim.config import SimConfig
from tests.paths import STREAMS
from tests.servers import ThreadedServer

REAL = STREAMS / "vllm-0.32"
#: What vLLM 0.32's Messages and Cohere layers say when the chat stream they convert sends
#: its GenerationError chunk: pydantic's ValidationError for that chunk, read as a
#: ChatCompletionStreamResponse, through sanitize_message. Taken from vLLM 0.32's own venv
#: (/opt/vllm-venv, pydantic 2.14.4): ChatCompletionStreamResponse.model_validate_json(
#: json.dumps(create_error_response(GenerationError()).model_dump())).
FIELD = (
    "  Field required [type=missing, input_value={'error': {'message': 'In...am': None, "
    "'code': 500}}, input_type=dict]\n"
    "    For further information visit https://errors.pydantic.dev/2.14/v/missing"
)
CONVERTED_ERROR = (
    f"2 validation errors for ChatCompletionStreamResponse\nmodel\n{FIELD}\nchoices\n{FIELD}"
)
FAULT = {"x-sim-fault": "error_event", "x-sim-fault-after": "2"}
FP = "vllm-0.32.0-sim"
HELLO = [{"role": "user", "content": "hello there, how are you"}]


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    # as the captures' server: --enable-per-request-metrics, a system fingerprint
    config = SimConfig(
        ttft=0.005, tokens_per_second=2000.0, per_request_metrics=True, system_fingerprint=FP
    )
    app = create_sim_app(config)
    server = ThreadedServer(app).start()
    yield server, app
    server.stop()


def shape(value: Any) -> Any:
    """The keys of `value`, in order, all the way down, and which values are null: what a
    pydantic dump fixes, whatever the request's text and timings."""
    if isinstance(value, dict):
        return [(key, shape(v)) for key, v in value.items()]
    if isinstance(value, list):
        return ["list", shape(value[0]) if value and isinstance(value[0], dict) else None]
    return "null" if value is None else "value"


def chunks(body: bytes) -> list[Any]:
    """The shape of each `data:` chunk of a chat or completions stream, `[DONE]` as is."""
    out: list[Any] = []
    for event in body.split(b"\n\n"):
        if event:
            data = event.removeprefix(b"data: ")
            out.append(data.decode() if data == b"[DONE]" else shape(orjson.loads(data)))
    return out


def named_events(body: bytes) -> list[tuple[str, Any]]:
    """Each `event:` and the shape of its data, for the event-typed streams."""
    out = []
    for event in body.split(b"\n\n"):
        if event:
            name, data = event.split(b"\n", 1)
            out.append((name.decode(), shape(orjson.loads(data.removeprefix(b"data: ")))))
    return out


@pytest.mark.parametrize(
    ("capture", "path", "body"),
    [
        ("chat_stream_no_usage.sse", "/v1/chat/completions", {"messages": HELLO}),
        (
            "chat_stream_include_usage.sse",
            "/v1/chat/completions",
            {"messages": HELLO, "stream_options": {"include_usage": True}},
        ),
        ("completions_stream_no_usage.sse", "/v1/completions", {"prompt": "once upon"}),
        (
            "completions_stream_include_usage.sse",
            "/v1/completions",
            {"prompt": "once upon", "stream_options": {"include_usage": True}},
        ),
    ],
)
def test_streamed_chunks_have_vllm_keys_in_vllm_order(
    client: httpx.Client, url: str, capture: str, path: str, body: dict[str, Any]
) -> None:
    # the captured requests: 6 tokens, cut by max_tokens (the finish on the last token's chunk)
    request = {"model": "sim-model", "stream": True, "max_tokens": 6, "temperature": 0, **body}
    sent = client.post(url + path, json=request).content
    assert chunks(sent) == chunks((REAL / capture).read_bytes())


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_continuous_usage_chunks_have_vllm_keys_in_vllm_order(
    client: httpx.Client, url: str, api: str
) -> None:
    """The forced-usage captures (usage on every chunk, 4 tokens) were taken without
    per-request metrics: the usage chunk's metrics are left out of the comparison."""
    path, body = (
        ("/v1/chat/completions", {"messages": HELLO})
        if api == "chat"
        else ("/v1/completions", {"prompt": "once upon"})
    )
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = {"model": "sim-model", "stream": True, "max_tokens": 4, "stream_options": options}
    sent = chunks(client.post(url + path, json=request | body).content)
    real = chunks((REAL / f"{api}_stream_forced_usage.sse").read_bytes())
    usage_chunk = sent[-2]
    assert usage_chunk[-1][0] == "metrics"
    sent[-2] = usage_chunk[:-1]
    assert sent == real


def test_a_chat_body_has_vllm_keys_in_vllm_order(client: httpx.Client, url: str) -> None:
    request = {"model": "sim-model", "max_tokens": 6, "temperature": 0, "messages": HELLO}
    body = client.post(url + "/v1/chat/completions", json=request).content
    assert shape(orjson.loads(body)) == shape(
        orjson.loads((REAL / "chat_nonstream_metrics.json").read_bytes())
    )


def test_a_completions_body_with_speculative_decoding_has_vllm_keys_in_vllm_order(
    client: httpx.Client, url: str
) -> None:
    request = {"model": "sim-model", "max_tokens": 24, "temperature": 0, "prompt": "a b c d"}
    body = client.post(url + "/v1/completions", json=request, headers={"x-sim-spec-tokens": "3"})
    real = orjson.loads((REAL / "spec_completions_nonstream.json").read_bytes())
    assert shape(body.json()) == shape(real)


def test_a_messages_stream_has_vllm_events_and_keys(client: httpx.Client, url: str) -> None:
    request = {"model": "sim-model", "stream": True, "max_tokens": 6, "messages": HELLO}
    sent = client.post(url + "/v1/messages", json=request).content
    assert named_events(sent) == named_events((REAL / "messages_stream.sse").read_bytes())


def test_an_error_in_a_chat_stream_is_spelled_as_vllm_dumps_it(
    client: httpx.Client, url: str
) -> None:
    """generate/base/serving.py create_streaming_error_response: `json.dumps`, spaces and
    all, of ErrorResponse(error=ErrorInfo(message, type, param, code))."""
    request = {"model": "sim-model", "stream": True, "max_tokens": 6, "messages": HELLO}
    sent = client.post(url + "/v1/chat/completions", json=request, headers=FAULT).content
    assert sent.endswith(
        b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
        b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n'
    )


def test_an_error_in_a_messages_stream_is_pydantics_text_for_the_chat_chunk(
    client: httpx.Client, url: str
) -> None:
    """anthropic/serving.py message_stream_converter, `except Exception`: the error event,
    dumped with exclude_unset, ends the stream (no content_block_stop, no message_stop)."""
    request = {"model": "sim-model", "stream": True, "max_tokens": 6, "messages": HELLO}
    sent = client.post(url + "/v1/messages", json=request, headers=FAULT).content
    error = {"type": "error", "error": {"type": "internal_error", "message": CONVERTED_ERROR}}
    names = [name for name, _ in named_events(sent)]
    assert names[-2:] == ["event: content_block_delta", "event: error"]
    assert sent.endswith(b"event: error\ndata: " + orjson.dumps(error) + b"\n\n")


def test_an_error_in_a_cohere_stream_is_pydantics_text_in_json_dumps_spacing(
    client: httpx.Client, url: str
) -> None:
    """cohere/serving.py _chat_completion_stream_to_v2, `except Exception as exc`: a
    message-end built with `json.dumps` (no content-end before it), then [DONE]."""
    request = {"model": "sim-model", "stream": True, "max_tokens": 6, "messages": HELLO}
    sent = client.post(url + "/cohere/v2/chat", json=request, headers=FAULT).content
    end = {"type": "message-end", "delta": {"error": CONVERTED_ERROR, "finish_reason": "ERROR"}}
    last = sent.split(b"\n\n")[-4:]
    assert last[0].startswith(b'data: {"type":"content-delta"')
    assert last[1:] == [b"data: " + json.dumps(end).encode(), b"data: [DONE]", b""]
