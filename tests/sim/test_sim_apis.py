"""The simulator's other vLLM APIs on a real uvicorn server, read by real clients.

Anthropic Messages and OpenAI Responses (wire shape, event order, timing, usage, stop
reasons, errors, faults), the pooling family, the utility routes, and the knobs
ttft_per_prompt_token, cached_tokens and cpu_per_token_us. The official `anthropic`
and `openai` SDKs parse what the simulator sends.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from proxy.sim import SimApp, SimConfig, completion_text
from proxy.sim.cli import parse
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import (
    best_of,
    chat,
    read_events,
    read_named_events,
    running,
    warm_client,
)

# Timing bounds for a loaded 2-core box: a late wake-up is normal, an early one is a bug.
EARLY = 0.003
LATE = 0.025
TOKENS = 8  # planned output of every request unless a test says otherwise
GENERATED = TOKENS + 1  # and the EOS token that ends it: vLLM's usage counts it

MESSAGES_STREAM = [
    "message_start",
    "content_block_start",
    *["content_block_delta"] * TOKENS,
    "content_block_stop",
    "message_delta",
    "message_stop",
]
RESPONSES_STREAM = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * TOKENS,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    config = SimConfig(ttft=0.05, tokens_per_second=200, output_tokens=TOKENS, record_bodies=True)
    with running(config) as pair:
        yield pair


def message(stream: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Say something, please."}],
        "stream": stream,
    }
    body.update(extra)
    return body


def response_body(stream: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "input": "Say something, please.",
        "stream": stream,
    }
    body.update(extra)
    return body


def last_record(app: SimApp) -> Any:
    record = app.state.last()
    assert record is not None
    return record


# -- Anthropic Messages ---------------------------------------------------------


def test_messages_stream_sends_vllm_events_in_order(
    client: httpx.Client, url: str, app: SimApp
) -> None:
    got = read_named_events(client, url, "/v1/messages", message())
    assert got.status == 200
    assert got.names() == MESSAGES_STREAM
    start = got.events[0].json
    record = last_record(app)
    # vLLM 0.32 sets "type" and "role" inside message (its captured messages_stream.sse)
    assert start == {
        "type": "message_start",
        "message": {
            "id": record.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "sim-model",
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": record.prompt_tokens, "output_tokens": 0},
        },
    }
    assert got.events[1].json == {
        "type": "content_block_start",
        "content_block": {"type": "text", "text": ""},
        "index": 0,
    }
    deltas = [e.json for e in got.events if e.name == "content_block_delta"]
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == completion_text(TOKENS)
    assert got.first("content_block_stop").json == {"type": "content_block_stop", "index": 0}
    assert got.first("message_delta").json == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"input_tokens": record.prompt_tokens, "output_tokens": GENERATED},
    }
    assert got.events[-1].json == {"type": "message_stop"}
    assert record.outcome == "completed" and record.finish_reason == "end_turn"
    assert record.body_sha256 == hashlib.sha256(got.raw).hexdigest()


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_messages_start_goes_out_with_the_first_delta_at_the_ttft(
    client: httpx.Client, url: str
) -> None:
    def attempt() -> None:
        got = read_named_events(client, url, "/v1/messages", message(), {"x-sim-ttft": "0.3"})
        # vLLM builds message_start from chat's role chunk, sent with the first engine
        # output (tests/sim/test_sim_openings.py; x-sim-early-role sends it at once)
        assert got.first("message_start").at >= 0.3 - EARLY
        first = got.first("content_block_delta").at
        assert 0.3 - EARLY <= first <= 0.3 + LATE, first
        # vLLM opens the block lazily, with its first text.
        assert got.first("content_block_start").at >= 0.3 - EARLY

    best_of(3, attempt)


@pytest.mark.parametrize(
    ("extra", "headers", "stop_reason"),
    [
        ({"max_tokens": 3}, {}, "max_tokens"),
        ({}, {"x-sim-finish-reason": "tool_calls"}, "tool_use"),
        ({}, {"x-sim-finish-reason": "stop_sequence"}, "stop_sequence"),
        ({}, {"x-sim-finish-reason": "abort"}, None),  # vLLM maps unknown reasons to null
    ],
)
def test_messages_stop_reason_mapping(
    client: httpx.Client,
    url: str,
    extra: dict[str, Any],
    headers: dict[str, str],
    stop_reason: str | None,
) -> None:
    got = read_named_events(client, url, "/v1/messages", message(**extra), headers)
    delta = {"stop_reason": stop_reason, "stop_sequence": None}
    assert got.first("message_delta").json["delta"] == delta
    streamed = client.post(url + "/v1/messages", json=message(False, **extra), headers=headers)
    assert streamed.json().get("stop_reason") == stop_reason


def test_messages_non_streamed_body(client: httpx.Client, url: str, app: SimApp) -> None:
    reply = client.post(url + "/v1/messages", json=message(False))
    record = last_record(app)
    assert reply.status_code == 200
    assert reply.json() == {
        "id": record.id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": completion_text(TOKENS)}],
        "model": "sim-model",
        "stop_reason": "end_turn",
        "usage": {"input_tokens": record.prompt_tokens, "output_tokens": GENERATED},
    }


#: AnthropicUsage's fields in its order (vLLM 0.32 anthropic/protocol.py), as dumped.
CACHED_USAGE = ["input_tokens", "output_tokens", "cache_creation_input_tokens",
                "cache_read_input_tokens"]  # fmt: skip


def test_messages_usage_has_vllm_s_cache_reads_and_writes_apart_from_input(
    client: httpx.Client, url: str
) -> None:
    # vLLM 0.32 _build_anthropic_usage (anthropic/serving.py): with the details, the
    # final usage's input_tokens is the prompt less the cache reads (cached_tokens) and
    # writes (chat's created_cache_tokens: whole 16-token blocks not found cached);
    # message_start's comes from the first chat chunk, whose usage has no details.
    long = message(messages=[{"role": "user", "content": "Say something, please. " * 8}])
    plain = client.post(url + "/v1/messages", json={**long, "stream": False}).json()["usage"]
    prompt = plain["input_tokens"]
    assert prompt > 32 and list(plain) == ["input_tokens", "output_tokens"]
    got = read_named_events(client, url, "/v1/messages", long, {"x-sim-cached-tokens": "2"})
    start_usage = got.first("message_start").json["message"]["usage"]
    assert start_usage == {"input_tokens": prompt, "output_tokens": 0}
    written = prompt - prompt % 16 - 2
    delta_usage = got.first("message_delta").json["usage"]
    assert list(delta_usage) == CACHED_USAGE
    assert delta_usage == {
        "input_tokens": prompt - written - 2,
        "output_tokens": GENERATED,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": 2,
    }
    capped = {"x-sim-cached-tokens": "1000"}  # capped at the prompt: nothing left to write
    body = client.post(url + "/v1/messages", json={**long, "stream": False}, headers=capped)
    usage = body.json()["usage"]
    assert list(usage) == CACHED_USAGE
    assert (usage["input_tokens"], usage["cache_creation_input_tokens"]) == (0, 0)
    assert usage["cache_read_input_tokens"] == prompt


def test_messages_ping_knob_sends_anthropic_ping_after_start(
    client: httpx.Client, url: str
) -> None:
    got = read_named_events(client, url, "/v1/messages", message(), {"x-sim-ping": "1"})
    assert got.names()[:3] == ["message_start", "ping", "content_block_start"]
    assert got.events[1].json == {"type": "ping"}


@pytest.mark.parametrize(
    ("body", "headers", "status", "err_type"),
    [
        (message(model="nope"), {}, 404, "NotFoundError"),
        (message(), {"x-sim-error": "context_length"}, 400, "BadRequestError"),
        (message(), {"x-sim-error": "rate_limit"}, 429, "RateLimitError"),
        (message(), {"x-sim-error": "server_error"}, 500, "InternalServerError"),
    ],
)
def test_messages_errors_come_in_anthropic_shape_with_vllm_types(
    client: httpx.Client,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    status: int,
    err_type: str,
) -> None:
    # vllm/entrypoints/anthropic/api_router.py translate_error_response
    reply = client.post(url + "/v1/messages", json=body, headers=headers)
    assert reply.status_code == status
    got = reply.json()
    assert list(got) == ["type", "error"] and got["type"] == "error"
    assert list(got["error"]) == ["type", "message"] and got["error"]["type"] == err_type
    assert got["error"]["message"]


def test_messages_request_validation_error_is_openai_shaped(client: httpx.Client, url: str) -> None:
    # A body pydantic rejects never reaches the Anthropic layer: vLLM's validation handler.
    body = message()
    del body["max_tokens"]
    reply = client.post(url + "/v1/messages", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "BadRequestError"


def test_messages_error_event_ends_the_stream_without_message_stop(
    client: httpx.Client, url: str, app: SimApp
) -> None:
    headers = {"x-sim-fault": "error_event", "x-sim-fault-after": "2"}
    got = read_named_events(client, url, "/v1/messages", message(), headers)
    assert got.names()[-1] == "error"
    assert "message_stop" not in got.names()
    assert got.names().count("content_block_delta") == 2
    error = got.events[-1].json
    assert error["type"] == "error" and error["error"]["type"] == "internal_error"
    # pydantic's text for chat's error chunk (tests/sim/test_sim_vllm_shapes.py pins it)
    assert error["error"]["message"].startswith("2 validation errors")
    assert last_record(app).outcome == "fault"


def test_messages_no_done_leaves_out_message_stop(client: httpx.Client, url: str) -> None:
    got = read_named_events(client, url, "/v1/messages", message(), {"x-sim-no-done": "1"})
    assert got.names() == MESSAGES_STREAM[:-1]


def test_anthropic_sdk_streams_and_parses_a_message(url: str, app: SimApp) -> None:
    sdk = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    with sdk.messages.stream(
        model="sim-model", max_tokens=5, messages=[{"role": "user", "content": "Hello there"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    record = last_record(app)
    assert text == completion_text(5)
    assert final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == record.prompt_tokens
    assert final.usage.output_tokens == 5
    assert final.content[0].type == "text" and final.content[0].text == completion_text(5)


def test_anthropic_sdk_create_count_tokens_and_errors(url: str, app: SimApp) -> None:
    sdk = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    msgs: Any = [{"role": "user", "content": "Hello there, how are you?"}]
    made = sdk.messages.create(model="sim-model", max_tokens=64, messages=msgs)
    assert made.content[0].type == "text" and made.content[0].text == completion_text(TOKENS)
    assert made.stop_reason == "end_turn" and made.usage.output_tokens == GENERATED
    prompt = last_record(app).prompt_tokens
    counted = sdk.messages.count_tokens(model="sim-model", messages=msgs)
    assert counted.input_tokens == prompt
    with pytest.raises(anthropic.NotFoundError) as caught:
        sdk.messages.create(model="nope", max_tokens=5, messages=msgs)
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "The model `nope` does not exist."},
    }


# -- OpenAI Responses -----------------------------------------------------------


def test_responses_stream_sends_vllm_events_with_sequence_numbers(
    client: httpx.Client, url: str, app: SimApp
) -> None:
    got = read_named_events(client, url, "/v1/responses", response_body())
    assert got.status == 200
    assert got.names() == RESPONSES_STREAM
    assert [e.json["sequence_number"] for e in got.events] == list(range(len(got.events)))
    assert all(e.json["type"] == e.name for e in got.events)
    record = last_record(app)
    created = got.events[0].json["response"]
    assert created["id"] == record.id and created["status"] == "in_progress"
    assert created["usage"] is None and created["output"] == []
    deltas = [e.json for e in got.events if e.name == "response.output_text.delta"]
    item_id = got.first("response.output_item.added").json["item"]["id"]
    assert all(d["item_id"] == item_id for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert text == completion_text(TOKENS)
    assert got.first("response.output_text.done").json["text"] == text
    done = got.events[-1].json["response"]
    assert done["status"] == "completed" and done["incomplete_details"] is None
    assert done["output"][0]["content"][0]["text"] == text
    assert done["usage"] == {
        "input_tokens": record.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": 0,
            "cache_write_tokens": record.prompt_tokens - record.prompt_tokens % 16,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": GENERATED,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": record.prompt_tokens + GENERATED,
    }
    assert record.body_sha256 == hashlib.sha256(got.raw).hexdigest()


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_responses_start_events_at_once_and_first_delta_at_the_ttft(
    client: httpx.Client, url: str
) -> None:
    def attempt() -> None:
        got = read_named_events(
            client, url, "/v1/responses", response_body(), {"x-sim-ttft": "0.3"}
        )
        assert got.first("response.in_progress").at < 0.1
        first = got.first("response.output_text.delta").at
        assert 0.3 - EARLY <= first <= 0.3 + LATE, first

    best_of(3, attempt)


def test_responses_max_output_tokens_is_incomplete(client: httpx.Client, url: str) -> None:
    body = response_body(max_output_tokens=3)
    got = read_named_events(client, url, "/v1/responses", body)
    # vLLM ends with response.completed, its response marked incomplete.
    assert got.events[-1].name == "response.completed"
    final = got.events[-1].json["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 3
    got = read_named_events(client, url, "/v1/responses", body, {"x-sim-incomplete-event": "1"})
    assert got.events[-1].name == "response.incomplete"
    assert got.events[-1].json["response"]["status"] == "incomplete"


def test_responses_cached_tokens_in_input_tokens_details(client: httpx.Client, url: str) -> None:
    got = read_named_events(
        client, url, "/v1/responses", response_body(), {"x-sim-cached-tokens": "1"}
    )
    details = got.events[-1].json["response"]["usage"]["input_tokens_details"]
    assert (details["cached_tokens"], details["cache_write_tokens"]) == (1, 0)  # no whole block


def test_responses_errors_and_error_event(client: httpx.Client, url: str, app: SimApp) -> None:
    reply = client.post(url + "/v1/responses", json=response_body(model="nope"))
    assert reply.status_code == 404
    assert reply.json()["error"]["type"] == "NotFoundError"
    headers = {"x-sim-fault": "error_event", "x-sim-fault-after": "1"}
    got = read_named_events(client, url, "/v1/responses", response_body(), headers)
    assert got.names()[-1] == "error" and "response.completed" not in got.names()
    error = got.events[-1].json
    assert error["type"] == "error" and error["message"] == "Internal server error"
    assert error["sequence_number"] == len(got.events) - 1
    assert last_record(app).outcome == "fault"


def test_openai_sdk_parses_responses_streamed_and_not(url: str, app: SimApp) -> None:
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = sdk.responses.create(model="sim-model", input="Hello there", stream=True)
    kinds = []
    text = ""
    final = None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response
    assert kinds == RESPONSES_STREAM
    assert text == completion_text(TOKENS)
    assert final is not None and final.usage is not None
    assert final.usage.output_tokens == GENERATED
    assert final.usage.input_tokens == last_record(app).prompt_tokens
    made = sdk.responses.create(model="sim-model", input="Hello there", max_output_tokens=4)
    assert made.output_text == completion_text(4)
    assert made.status == "incomplete" and made.incomplete_details is not None
    assert made.incomplete_details.reason == "max_output_tokens"


# -- embeddings and the pooling family ------------------------------------------


def test_openai_sdk_embeddings_with_usage(url: str, app: SimApp) -> None:
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    got = sdk.embeddings.create(model="sim-model", input=["abcdefgh", "ijk"])  # 8 + 3 chars
    assert len(got.data) == 2 and len(got.data[0].embedding) == 8
    assert got.usage.prompt_tokens == last_record(app).prompt_tokens == 3
    assert got.usage.total_tokens == 3


@pytest.mark.parametrize(
    ("path", "body", "data_key"),
    [
        ("/pooling", {"input": ["abcd", "efgh"]}, "data"),
        ("/score", {"text_1": "abcd", "text_2": ["efgh", "ijkl"]}, "data"),
        ("/v1/score", {"queries": "abcd", "documents": ["efgh", "ijkl"]}, "data"),
        ("/classify", {"input": ["abcd", "efgh"]}, "data"),
        ("/v1/classify", {"input": ["abcd", "efgh"]}, "data"),
        ("/rerank", {"query": "abcd", "documents": ["efgh", "ijkl"]}, "results"),
        ("/v1/rerank", {"query": "abcd", "documents": ["efgh", "ijkl"]}, "results"),
        ("/v2/rerank", {"query": "abcd", "documents": ["efgh", "ijkl"]}, "results"),
    ],
)
def test_pooling_routes_answer_vllm_shapes_with_usage(
    client: httpx.Client, url: str, app: SimApp, path: str, body: dict[str, Any], data_key: str
) -> None:
    started = time.monotonic()
    reply = client.post(url + path, json=body, headers={"x-sim-ttft": "0.1"})
    elapsed = time.monotonic() - started
    assert reply.status_code == 200, reply.text
    assert elapsed >= 0.1 - EARLY  # the latency control holds the reply back
    got = reply.json()
    assert got["model"] == "sim-model" and got["id"] == last_record(app).id
    assert len(got[data_key]) == 2
    # two inputs of one token each, or two pairs of two tokens each
    tokens = 2 if path in ("/pooling", "/classify", "/v1/classify") else 4
    assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] == tokens
    assert last_record(app).prompt_tokens == tokens
    item = got[data_key][0]
    if "rerank" in path:
        assert set(item) == {"index", "document", "relevance_score"}
        scores = [r["relevance_score"] for r in got["results"]]
        assert scores == sorted(scores, reverse=True)
    elif "score" in path:
        assert item["object"] == "score" and 0 <= item["score"] < 1
    elif "classify" in path:
        assert set(item) == {"index", "label", "probs", "num_classes"}
    else:
        assert item["object"] == "pooling" and len(item["data"]) == 8


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling", "/v2/rerank", "/classify"])
def test_pooling_routes_honour_error_controls(client: httpx.Client, url: str, path: str) -> None:
    body = {"input": "x", "query": "q", "documents": ["d"]}
    reply = client.post(url + path, json=body, headers={"x-sim-error": "rate_limit"})
    assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
    reply = client.post(url + path, json={**body, "model": "nope"})
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "NotFoundError"
    reply = client.post(url + path, json={"model": "sim-model"})
    assert reply.status_code == 400


# -- utility routes --------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(client: httpx.Client, url: str) -> None:
    got = client.post(url + "/tokenize", json={"model": "sim-model", "prompt": "abcdefgh"}).json()
    assert got == {"count": 2, "max_model_len": 4096, "tokens": [100, 101], "token_strs": None}
    back = client.post(url + "/detokenize", json={"model": "sim-model", "tokens": got["tokens"]})
    assert back.json() == {"prompt": completion_text(2, 100 % 16)}
    assert client.post(url + "/detokenize", json={}).status_code == 400


def test_ping_version_health_and_load(client: httpx.Client, url: str) -> None:
    for reply in (
        client.get(url + "/ping"),
        client.post(url + "/ping"),
        client.get(url + "/health"),
    ):
        assert reply.status_code == 200 and reply.content == b""
    assert client.get(url + "/version").json()["version"]
    assert client.get(url + "/load").json() == {"server_load": 0}
    # The stream is in flight until the block ends (its client leaves then): a first token
    # 5 s away holds it there however slow the machine (at 0.5 s a loaded run of the suite once read
    # the load after the stream had ended), and costs nothing.
    with (
        httpx.Client() as other,
        client.stream(
            "POST", url + "/v1/chat/completions", json=chat(), headers={"x-sim-ttft": "5"}
        ),
    ):
        assert other.get(url + "/load").json() == {"server_load": 1}
    assert client.put(url + "/version").status_code == 405


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "chat.completion"),
        ({"prompt": "hi"}, "text_completion"),
        ({"prompt": "hi", "input": "hi"}, "text_completion"),
    ],
)
def test_invocations_dispatch_by_body_shape(
    client: httpx.Client, url: str, body: dict[str, Any], kind: str
) -> None:
    reply = client.post(url + "/invocations", json={"model": "sim-model", **body})
    assert reply.status_code == 200 and reply.json()["object"] == kind


#: vLLM 0.32's 400 for a completion without a prompt, seen from the real server
#: (vllm/entrypoints/openai/completion/protocol.py:591-610).
NO_PROMPT = {
    "error": {
        "message": "Either prompt or prompt_embeds must be provided and non-empty. "
        "(parameter=prompt)",
        "type": "BadRequestError",
        "param": "prompt",
        "code": 400,
    }
}


@pytest.mark.parametrize(
    "body",
    [{"input": "hi"}, {}, {"prompt": ""}, {"messages": "hi"}],
    ids=["input", "nothing", "empty-prompt", "messages-no-list"],
)
def test_an_invocation_no_chat_takes_is_answered_as_a_completion_without_a_prompt(
    client: httpx.Client, url: str, body: dict[str, Any]
) -> None:
    """A generative model's server tries ChatCompletionRequest, then CompletionRequest
    (vllm/entrypoints/generate/factories.py); the latter's check raises a
    VLLMValidationError that leaves the loop (serve/sagemaker/api_router.py): `input` is
    no embeddings request there, as the real vLLM 0.32 answered."""
    reply = client.post(url + "/invocations", json={"model": "sim-model", **body})
    assert (reply.status_code, reply.json()) == (400, NO_PROMPT)


def test_api_key_guards_vllms_prefixes_only() -> None:
    # vLLM 0.32's AuthenticationMiddleware: the paths under GUARDED_PREFIX ("/v1", "/v2",
    # "/inference", "/cohere") need the Bearer key, every other route is open
    # (vllm/entrypoints/serve/middleware/authenticate.py). The simulator guarded every
    # route it serves, as older vLLMs did.
    with running(SimConfig(api_key="k", ttft=0)) as (server, _), httpx.Client() as c:
        for path in ("/v1/messages", "/v2/rerank", "/v1/unknown"):
            reply = c.post(server.url + path, json=message(False))
            assert reply.status_code == 401 and reply.json() == {"error": "Unauthorized"}
        assert c.post(server.url + "/v1/messages", headers={"x-api-key": "k"}).status_code == 401
        ok = {"authorization": "Bearer k"}
        assert c.post(server.url + "/v1/tokenize", json={"prompt": "x"}).status_code == 401
        for headers in ({}, ok):  # open with or without a key
            reply = c.post(server.url + "/tokenize", json={"prompt": "x"}, headers=headers)
            assert reply.status_code == 200
        for path in ("/version", "/load", "/ping", "/health"):
            assert c.get(server.url + path).status_code == 200


# -- knobs ------------------------------------------------------------------------


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_ttft_grows_per_prompt_token(client: httpx.Client, url: str) -> None:
    prompt = "x" * 400  # 100 prompt tokens
    body = chat(messages=[{"role": "user", "content": prompt}])
    headers = {"x-sim-ttft": "0.05", "x-sim-ttft-per-prompt-token": "0.002"}

    def attempt() -> None:
        got = read_events(client, url, body, headers)
        first = got.contents()[0].at
        assert 0.25 - EARLY <= first <= 0.25 + LATE, first

    best_of(3, attempt)


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_config_knobs_ttft_per_prompt_token_and_cached_tokens() -> None:
    config = SimConfig(ttft=0.0, ttft_per_prompt_token=0.002, cached_tokens=3, output_tokens=2)
    with running(config) as (server, _), warm_client(server.url) as c:
        body = chat(
            messages=[{"role": "user", "content": "x" * 400}],
            stream_options={"include_usage": True},
        )

        def attempt() -> None:
            got = read_events(c, server.url, body)
            assert 0.2 - EARLY <= got.contents()[0].at <= 0.2 + LATE
            usage = got.events[-2].json["usage"]
            created = usage["prompt_tokens"] - usage["prompt_tokens"] % 16 - 3
            assert usage["prompt_tokens_details"] == {
                "cached_tokens": 3,
                "created_cache_tokens": created,
            }

        best_of(3, attempt)
        short = chat(False, messages=[{"role": "user", "content": "hi"}])  # 1 prompt token
        usage = c.post(server.url + "/v1/chat/completions", json=short).json()["usage"]
        assert usage["prompt_tokens"] == 1
        assert usage["prompt_tokens_details"] == {  # capped at the prompt
            "cached_tokens": 1,
            "created_cache_tokens": 0,
            "multimodal_tokens": None,
        }


def test_cpu_per_token_burns_cpu_per_generated_token(client: httpx.Client, url: str) -> None:
    headers = {"x-sim-output-tokens": "20", "x-sim-cpu-per-token-us": "20000", "x-sim-tps": "1000"}
    cpu0, wall0 = time.process_time(), time.monotonic()
    client.post(url + "/v1/chat/completions", json=chat(False), headers=headers).raise_for_status()
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert cpu >= 0.4 * 0.95, cpu  # 20 tokens x 20 ms of busy loop, in this process's server
    assert wall >= 0.4
    cpu0 = time.process_time()
    client.post(url + "/v1/chat/completions", json=chat(False), headers={"x-sim-tps": "1000"})
    assert time.process_time() - cpu0 < 0.2  # without the knob the same request is cheap


def test_cli_sets_decode_speed_ttft_and_knobs() -> None:
    config, _ = parse(
        [
            "--ttft",
            "0.2",
            "--tokens-per-second",
            "77",
            "--ttft-per-prompt-token",
            "0.001",
            "--cached-tokens",
            "5",
            "--cpu-per-token-us",
            "3",
        ],
        {},
    )
    assert (config.ttft, config.tokens_per_second) == (0.2, 77.0)
    assert (config.ttft_per_prompt_token, config.cached_tokens, config.cpu_per_token_us) == (
        0.001,
        5,
        3.0,
    )
    env = {"TOKENPROBE_SIM_CPU_PER_TOKEN_US": "9", "TOKENPROBE_SIM_CACHED_TOKENS": "2"}
    config, _ = parse(["--tps", "12"], env)
    assert (config.tokens_per_second, config.cpu_per_token_us, config.cached_tokens) == (
        12.0,
        9.0,
        2,
    )


# -- faults and pacing on the event-typed streams ---------------------------------


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_stall_fault_delays_the_rest_of_an_event_stream(
    client: httpx.Client, url: str, path: str
) -> None:
    body = message() if path == "/v1/messages" else response_body()
    headers = {"x-sim-fault": "stall", "x-sim-fault-after": "2", "x-sim-stall": "0.3"}

    def attempt() -> None:
        got = read_named_events(client, url, path, body, headers)
        deltas = [
            e.at for e in got.events if e.name.endswith("delta") and "text" in e.data.decode()
        ]
        assert len(deltas) == TOKENS
        assert deltas[2] - deltas[1] >= 0.3 - EARLY  # the silence sits before the 3rd token
        assert got.names()[-1] in ("message_stop", "response.completed")

    best_of(3, attempt)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_close_no_done_and_reset_cut_an_event_stream(
    client: httpx.Client, url: str, app: SimApp, path: str
) -> None:
    body = message() if path == "/v1/messages" else response_body()
    got = read_named_events(
        client, url, path, body, {"x-sim-fault": "close_no_done", "x-sim-fault-after": "3"}
    )
    assert got.names()[-1].endswith("delta") and len(got.events) < 8
    assert last_record(app).outcome == "fault"
    with pytest.raises(httpx.RemoteProtocolError):
        read_named_events(client, url, path, body, {"x-sim-fault": "reset"})


def test_malformed_and_huge_events_are_inserted_and_the_stream_goes_on(
    client: httpx.Client, url: str
) -> None:
    headers = {"x-sim-fault": "huge_event", "x-sim-huge-bytes": "100000"}
    got = read_named_events(client, url, "/v1/messages", message(), headers)
    deltas = [e for e in got.events if e.name == "content_block_delta"]
    assert len(deltas) == TOKENS + 1
    assert len(b"event: content_block_delta\ndata: " + deltas[0].data + b"\n\n") == 100000
    assert got.names()[-1] == "message_stop"
    reply = client.post(
        url + "/v1/responses", json=response_body(), headers={"x-sim-fault": "malformed"}
    )
    assert b"data: {not json\n\n" in reply.content
    assert reply.content.endswith(b'"type":"response.completed"}\n\n')


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_non_streamed_message_arrives_when_its_last_token_is_due(
    client: httpx.Client, url: str
) -> None:
    def attempt() -> None:
        started = time.monotonic()
        client.post(url + "/v1/messages", json=message(False), headers={"x-sim-ttft": "0.2"})
        elapsed = time.monotonic() - started
        due = 0.2 + (TOKENS - 1) / 200
        assert due - EARLY <= elapsed <= due + LATE, elapsed

    best_of(3, attempt)


def test_event_streams_follow_the_lockstep_clock() -> None:
    with running(SimConfig(step_ms=20, ttft=0.05, output_tokens=4)) as (server, app):
        with warm_client(server.url) as c:
            stamp = {"x-sim-stamp": "1"}
            before = time.time_ns() / 1e9
            got = read_named_events(c, server.url, "/v1/responses", response_body(), stamp)
        # when the simulator wrote each token, not when this client read it
        sent = [
            e.json["sent_ns"] / 1e9 for e in got.events if e.name == "response.output_text.delta"
        ]
        assert len(sent) == 4
        # One token per 20 ms tick, the first at the first tick after the TTFT: the last
        # is written three ticks after that, or later. Measured from the request, not
        # between tokens: the ticks keep their schedule, so after a stall late ticks
        # catch up in one burst (a parallel run saw the last three 0.1 ms apart), which
        # only delays. Tokens written together, off the clock, would end at the TTFT.
        assert sent[-1] - before >= 0.05 + 3 * 0.02 - EARLY, [t - before for t in sent]
        assert app.stats()["ticks"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_stamp_puts_sent_ns_first_in_every_text_delta(
    client: httpx.Client, url: str, path: str
) -> None:
    body = message() if path == "/v1/messages" else response_body()
    before = time.time_ns()
    got = read_named_events(client, url, path, body, {"x-sim-stamp": "1"})
    text_events = ("content_block_delta", "response.output_text.delta")
    deltas = [e for e in got.events if e.name in text_events]
    assert len(deltas) == TOKENS
    for event in deltas:
        assert event.data.startswith(b'{"sent_ns":')
        assert before <= event.json["sent_ns"] <= time.time_ns()
    others = [e for e in got.events if e.name not in text_events]
    assert not any(b"sent_ns" in e.data for e in others)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_a_stamp_in_the_text_opens_every_text_delta(
    client: httpx.Client, url: str, path: str
) -> None:
    body = message() if path == "/v1/messages" else response_body()
    before = time.time_ns()
    got = read_named_events(client, url, path, body, {"x-sim-stamp": "text"})
    key = "text" if path == "/v1/messages" else "delta"
    texts = [
        (e.json["delta"] if path == "/v1/messages" else e.json)[key]
        for e in got.events
        if e.name in ("content_block_delta", "response.output_text.delta")
    ]
    assert len(texts) == TOKENS
    stamps = [int(t.split(" ", 1)[0].removeprefix("@")) for t in texts]
    assert all(t.startswith("@") for t in texts)
    assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= time.time_ns()
    assert not any(b"sent_ns" in e.data for e in got.events)
