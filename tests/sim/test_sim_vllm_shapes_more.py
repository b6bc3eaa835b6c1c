"""The simulator's Responses, generate and cached-usage shapes are real vLLM 0.32's: keys
in vLLM's order, nulls as vLLM sends them, compared with the captures of the same request
(tests/fixtures/streams/vllm-0.32/responses_stream.sse; vllm032_generate.sse and .json,
copied from /work/shared/fixtures/vllm-0.32, whose index.json gives each request) or,
where no capture has them, with vLLM's own models' dumps (named in each test)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.sim.app import SimApp, create_sim_app
from proxy.sim.config import SimConfig
from tests.paths import STREAMS
from tests.servers import ThreadedServer
from tests.sim.test_sim_vllm_shapes import chunks, named_events, shape

REAL = STREAMS / "vllm-0.32"
HELLO = [{"role": "user", "content": "hello there, how are you"}]
#: The captured generate request: 5 token ids in, 5 out, cut by max_tokens.
GENERATE = {
    "model": "sim-model",
    "token_ids": [1, 2, 3, 4, 5],
    "sampling_params": {"max_tokens": 5},
}
CACHED = {"x-sim-cached-tokens": "16"}
LONG = [{"role": "user", "content": "word " * 100}]  # 125 prompt tokens: whole blocks


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    # as the captures' server: --enable-per-request-metrics
    config = SimConfig(ttft=0.005, tokens_per_second=2000.0, per_request_metrics=True)
    app = create_sim_app(config)
    server = ThreadedServer(app).start()
    yield server, app
    server.stop()


def deduplicated(events: list[Any]) -> list[Any]:
    """`events` with runs of one shape as one: the captures' deltas are fewer than ours."""
    return [e for i, e in enumerate(events) if i == 0 or events[i - 1] != e]


def completed(body: bytes) -> dict[str, Any]:
    last = body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    response: dict[str, Any] = orjson.loads(last.split(b"data: ", 1)[1])["response"]
    return response


def test_a_responses_stream_has_vllm_events_and_keys(client: httpx.Client, url: str) -> None:
    """Every event, in order, with vLLM's keys; response.completed's response ends with
    presence_penalty .. output_messages, and its usage details have every field
    (responses/protocol.py ResponsesResponse, InputTokensDetails, OutputTokensDetails)."""
    request = {
        "model": "sim-model",
        "stream": True,
        "max_output_tokens": 6,
        "temperature": 0,
        "input": "hello",
    }
    sent = client.post(url + "/v1/responses", json=request).content
    real = (REAL / "responses_stream.sse").read_bytes()
    assert deduplicated(named_events(sent)) == deduplicated(named_events(real))
    ours, theirs = completed(sent), completed(real)
    # sampling params are floats; "auto" without tools is "none" (check_tool_usage)
    for key in ("temperature", "tool_choice", "presence_penalty", "frequency_penalty"):
        assert (key, ours[key]) == (key, theirs[key])
    assert isinstance(ours["temperature"], float)
    details = ("input_tokens_details", "output_tokens_details")
    assert [ours["usage"][k] for k in details] == [theirs["usage"][k] for k in details]


def test_a_responses_body_has_the_keys_of_vllms_completed_response(
    client: httpx.Client, url: str
) -> None:
    """Not streamed, the body is the response that response.completed carries."""
    request = {"model": "sim-model", "max_output_tokens": 6, "temperature": 0, "input": "hello"}
    body = client.post(url + "/v1/responses", json=request).content
    real = completed((REAL / "responses_stream.sse").read_bytes())
    assert shape(orjson.loads(body)) == shape(real)


def test_a_generate_stream_has_vllm_keys_and_weight_versions(
    client: httpx.Client, url: str
) -> None:
    """The finishing chunk carries the finished output's weight version spans."""
    sent = client.post(url + "/inference/v1/generate", json=GENERATE | {"stream": True}).content
    real = (STREAMS / "vllm032_generate.sse").read_bytes()
    assert chunks(sent) == chunks(real)
    last = orjson.loads(sent.split(b"\n\n")[-3].removeprefix(b"data: "))
    assert last["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]


def test_a_generate_body_has_vllm_keys_in_vllm_order(client: httpx.Client, url: str) -> None:
    body = client.post(url + "/inference/v1/generate", json=GENERATE).json()
    real = orjson.loads((STREAMS / "vllm032_generate.json").read_bytes())
    assert shape(body) == shape(real)
    assert body["choices"][0]["weight_versions"] == real["choices"][0]["weight_versions"]


def test_generates_usage_chunks_are_dumped_as_vllm_dumps_them(
    client: httpx.Client, url: str
) -> None:
    """token_in_token_out/serving.py: a token chunk is dumped whole (its continuous usage
    with null details), the usage chunk with exclude_none, in the model's field order
    (request_id, usage, output_mode, choices): vLLM 0.32's own
    GenerateTokensStreamResponse(...).model_dump_json(...) gives these bytes."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = GENERATE | {"stream": True, "stream_options": options}
    sent = client.post(url + "/inference/v1/generate", json=request, headers=CACHED).content
    events = sent.split(b"\n\n")
    assert b'"usage":{"prompt_tokens":5,"total_tokens":6,"completion_tokens":1,' \
        b'"prompt_tokens_details":null,"completion_tokens_details":null},' in events[0]  # fmt: skip
    usage_chunk = orjson.loads(events[-3].removeprefix(b"data: "))
    assert list(usage_chunk) == ["request_id", "usage", "output_mode", "choices"]
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}


@pytest.mark.parametrize(
    ("path", "body", "streamed", "details"),
    [
        # chat: _make_prompt_tokens_details sets cached_tokens and created_cache_tokens
        ("/v1/chat/completions", {"messages": LONG}, True, ["cached_tokens", "created"]),
        ("/v1/chat/completions", {"messages": LONG}, False, ["cached_tokens", "created", None]),
        # completions: PromptTokenUsageInfo(cached_tokens=...) only
        ("/v1/completions", {"prompt": "word " * 100}, True, ["cached_tokens"]),
        ("/v1/completions", {"prompt": "word " * 100}, False, ["cached_tokens", None, None]),
        ("/inference/v1/generate", {"token_ids": [1] * 40}, False, ["cached_tokens", None, None]),
    ],
)
def test_prompt_tokens_details_have_the_fields_vllm_sets(
    client: httpx.Client,
    url: str,
    path: str,
    body: dict[str, Any],
    streamed: bool,
    details: list[str | None],
) -> None:
    """serve/engine/protocol.py PromptTokenUsageInfo {cached_tokens, created_cache_tokens,
    multimodal_tokens}: a usage chunk drops its nulls (exclude_none), a body keeps them.
    created_cache_tokens counts the prompt's whole 16-token blocks not found cached
    (v1/metrics/stats.py PrefillStats.finalize)."""
    request: dict[str, Any] = {"model": "sim-model", "max_tokens": 2, **body}
    if streamed:
        request |= {"stream": True, "stream_options": {"include_usage": True}}
    reply = client.post(url + path, json=request, headers=CACHED).content
    usage_body = reply.split(b"\n\n")[-3].removeprefix(b"data: ") if streamed else reply
    usage = orjson.loads(usage_body)["usage"]
    prompt = usage["prompt_tokens"]
    values = {
        "cached_tokens": 16,
        "created": prompt - prompt % 16 - 16,
        None: None,
    }
    keys = ["cached_tokens", "created_cache_tokens", "multimodal_tokens"][: len(details)]
    assert usage["prompt_tokens_details"] == {
        k: values[d] for k, d in zip(keys, details, strict=True)
    }
