"""The simulated vLLM backend on a real uvicorn server: wire shapes, timing, errors."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from proxy.sim import SimApp, SimConfig, completion_text
from tests.servers import ThreadedServer
from tests.sim.test_sim_support import best_of, chat, read_events, running, warm_client

# Timing bounds for a loaded 2-core box: a late wake-up is normal, an early one is a bug.
EARLY = 0.003
LATE = 0.025


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[ThreadedServer, SimApp]]:
    with running(SimConfig(ttft=0.05, tokens_per_second=200, output_tokens=8)) as pair:
        yield pair


@pytest.fixture
def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


# -- stream shape -------------------------------------------------------------


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_role_only_chunk_precedes_first_token(client: httpx.Client, url: str, app: SimApp) -> None:
    # x-sim-early-role: vLLM sends the role chunk with the first token (its default here,
    # tests/sim/test_sim_role_chunk.py); the control sends it with the headers
    def attempt() -> None:
        got = read_events(client, url, chat(), {"x-sim-ttft": "0.3", "x-sim-early-role": "1"})
        role, first_content = got.events[0], got.contents()[0]
        assert role.json["choices"] == [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        assert role.at < 0.1, "the role chunk goes out with the headers, not at ttft"
        assert 0.3 - EARLY <= first_content.at <= 0.3 + LATE
        record = app.state.last()
        assert record is not None and record.first_token_at is not None
        assert 0.3 - EARLY <= record.first_token_at - record.started <= 0.3 + LATE

    best_of(3, attempt)


def test_stream_is_role_content_finish_usage_done(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(stream_options={"include_usage": True}))
    kinds = [list(e.json) if e.data != b"[DONE]" else "DONE" for e in got.events]
    chunk_keys = ["id", "object", "created", "model", "choices"]
    role_keys = [*chunk_keys, "prompt_token_ids", "prompt_text"]  # vLLM 0.32's role chunk
    assert kinds == [role_keys] + [chunk_keys] * 9 + [[*chunk_keys, "usage"], "DONE"]
    assert got.headers["content-type"] == "text/event-stream; charset=utf-8"
    finish = got.events[-3].json
    assert finish["choices"] == [
        {
            "index": 0,
            "delta": {"content": ""},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": None,
        }
    ]
    usage = got.events[-2].json
    assert usage["choices"] == []
    # 8 text tokens and the EOS token that ended them (vLLM counts its token id)
    assert usage["usage"] == {"prompt_tokens": 4, "total_tokens": 13, "completion_tokens": 9}
    ids = {e.json["id"] for e in got.events[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert got.text() == completion_text(8)


def test_usage_is_absent_unless_requested(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat())
    assert all("usage" not in e.json for e in got.events[:-1])
    assert got.events[-1].data == b"[DONE]"


def test_usage_mode_last_chunk_puts_usage_on_the_finish_chunk(
    client: httpx.Client, url: str
) -> None:
    body = chat(stream_options={"include_usage": True})
    got = read_events(client, url, body, {"x-sim-usage-mode": "last_chunk"})
    finish = got.events[-2].json
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert finish["usage"]["completion_tokens"] == 9  # the text's 8 and the EOS
    assert not any(e.json["choices"] == [] for e in got.events[:-1])


def test_usage_mode_ignore_never_streams_usage(client: httpx.Client, url: str) -> None:
    body = chat(stream_options={"include_usage": True})
    got = read_events(client, url, body, {"x-sim-usage-mode": "ignore"})
    assert all("usage" not in e.json for e in got.events[:-1])


def test_continuous_usage_stats_count_up_on_every_chunk(client: httpx.Client, url: str) -> None:
    body = chat(stream_options={"include_usage": True, "continuous_usage_stats": True})
    got = read_events(client, url, body, {"x-sim-output-tokens": "3"})
    counts = [e.json["usage"]["completion_tokens"] for e in got.events[:-1]]
    # role, three tokens, then the EOS's finish chunk and the usage chunk count it too
    assert counts == [0, 1, 2, 3, 4, 4]


def test_cached_tokens_are_reported_in_prompt_tokens_details(
    client: httpx.Client, url: str
) -> None:
    body = chat(stream_options={"include_usage": True})
    got = read_events(client, url, body, {"x-sim-cached-tokens": "3"})
    usage = got.events[-2].json["usage"]
    created = max(0, usage["prompt_tokens"] - usage["prompt_tokens"] % 16 - 3)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 3, "created_cache_tokens": created}


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_tokens_follow_the_tps_pace_without_drift(client: httpx.Client, url: str) -> None:
    headers = {"x-sim-ttft": "0.05", "x-sim-tps": "50", "x-sim-output-tokens": "11"}

    def attempt() -> None:
        got = read_events(client, url, chat(), headers)
        times = [e.at for e in got.contents()]
        assert len(times) == 11
        # Absolute deadlines: token i is due at ttft + i / tps, however late earlier ones were.
        for i, at in enumerate(times):
            assert 0.05 + i / 50 - EARLY <= at <= 0.05 + i / 50 + LATE, (i, at)

    best_of(3, attempt)


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_tokens_per_chunk_groups_tokens_and_keeps_tokens_per_second(
    client: httpx.Client, url: str
) -> None:
    headers = {"x-sim-tokens-per-chunk": "3", "x-sim-output-tokens": "7", "x-sim-tps": "100"}

    def attempt() -> None:
        got = read_events(client, url, chat(), headers)
        texts = [e.json["choices"][0]["delta"]["content"] for e in got.contents()]
        assert texts == [completion_text(3), completion_text(3, 3), completion_text(1, 6)]
        for j, event in enumerate(got.contents()):
            due = 0.05 + j * 0.03  # a chunk of 3 tokens every 3 / tps seconds
            assert due - EARLY <= event.at <= due + LATE, (j, event.at)

    best_of(3, attempt)


def test_output_text_mixes_multibyte_utf8(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_headers={"x-sim-output-tokens": "16"},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == completion_text(16)
    assert "🚀" in text and "世界" in text and '"' in text and "\n" in text


def test_openai_sdk_sees_role_then_content_then_finish(sdk: openai.OpenAI) -> None:
    chunks = list(
        sdk.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9


def test_completions_stream_text_choices_without_role_chunk(client: httpx.Client, url: str) -> None:
    body = {"model": "sim-model", "prompt": "Once upon a time", "stream": True}
    got = read_events(client, url, body, path="/v1/completions")
    first = got.events[0].json
    assert first["object"] == "text_completion"
    assert first["id"].startswith("cmpl-")
    assert first["choices"] == [
        {
            "index": 0,
            "text": completion_text(1),
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
    ]
    assert got.events[0].at >= 0.05 - EARLY, "completions have no early role chunk"
    assert got.events[-2].json["choices"][0]["finish_reason"] == "stop"
    assert got.text() == completion_text(8)


def test_stamp_puts_send_time_as_first_key_of_content_chunks(
    client: httpx.Client, url: str
) -> None:
    got = read_events(client, url, chat(), {"x-sim-stamp": "1"})
    contents = got.contents()
    assert all(e.data.startswith(b'{"sent_ns":') for e in contents)
    assert not got.events[0].data.startswith(b'{"sent_ns":'), "the role chunk is not stamped"
    now_ns = time.time_ns()
    stamps = [e.json["sent_ns"] for e in contents]
    assert stamps == sorted(stamps)
    assert 0 < now_ns - stamps[-1] < 1_000_000_000


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_stamp_in_the_text_leaves_chunks_that_differ_only_in_their_text(
    client: httpx.Client, url: str, api: str
) -> None:
    """`x-sim-stamp: text`: the send time opens each text (`@<time_ns> `), and outside their
    texts the content chunks of a stream are one byte string, as vLLM's are (so a proxy's
    template match applies, where the `sent_ns` key defeats it)."""
    before = time.time_ns()
    body = chat() if api == "chat" else {"model": "sim-model", "prompt": "Hi", "stream": True}
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    got = read_events(client, url, body, {"x-sim-stamp": "text"}, path)
    contents = got.contents()
    assert len(contents) > 2
    opening = b'"content":"' if api == "chat" else b'"text":"'
    outside, stamps = set(), []
    for event in contents:
        head, rest = event.data.split(opening, 1)
        stamp, rest = rest.split(b" ", 1)
        assert stamp.startswith(b"@") and stamp[1:].isdigit(), event.data
        stamps.append(int(stamp[1:]))
        outside.add(head + opening + rest.split(b'"', 1)[1])
    assert len(outside) == 1, outside
    assert not any(b"sent_ns" in e.data for e in got.events)
    assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= time.time_ns()
    # The texts are the plain stream's, each behind its stamp.
    plain = read_events(client, url, body, path=path)
    assert [e.data.split(opening, 1)[1].split(b" ", 1)[1] for e in contents] == [
        e.data.split(opening, 1)[1] for e in plain.contents()
    ]


def test_no_done_header_ends_with_the_finish_chunk(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(), {"x-sim-no-done": "1"})
    assert got.events[-1].json["choices"][0]["finish_reason"] == "stop"
    assert b"[DONE]" not in got.raw


# -- length and finish_reason ------------------------------------------------


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_below_plan_stops_with_length(
    client: httpx.Client, url: str, field: str
) -> None:
    body = chat()
    body[field] = 3
    got = read_events(client, url, body)
    assert got.text() == completion_text(3)
    assert got.events[-2].json["choices"][0]["finish_reason"] == "length"


def test_max_tokens_above_plan_stops_with_stop(client: httpx.Client, url: str) -> None:
    body = chat(max_tokens=9, stream_options={"include_usage": True})
    got = read_events(client, url, body)
    assert got.events[-3].json["choices"][0]["finish_reason"] == "stop"
    assert got.events[-2].json["usage"]["completion_tokens"] == 9


def test_max_tokens_at_plan_leaves_no_room_for_the_eos(client: httpx.Client, url: str) -> None:
    """v1/core/sched/utils.py check_stop: the 8th token reaches max_tokens, so the EOS that
    would follow is never generated: "length", on the last text token's chunk."""
    body = chat(max_tokens=8, stream_options={"include_usage": True})
    got = read_events(client, url, body)
    assert got.text() == completion_text(8)
    assert got.events[-3].json["choices"][0]["finish_reason"] == "length"
    assert got.events[-2].json["usage"]["completion_tokens"] == 8


def test_ignore_eos_generates_exactly_max_tokens(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(max_tokens=12, ignore_eos=True), {"x-sim-tps": "1000"})
    assert len(got.contents()) == 12
    assert got.events[-2].json["choices"][0]["finish_reason"] == "length"


def test_finish_reason_header_forces_the_reason(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(), {"x-sim-finish-reason": "content_filter"})
    assert got.events[-2].json["choices"][0]["finish_reason"] == "content_filter"


def test_zero_output_tokens_sends_finish_at_ttft(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(), {"x-sim-output-tokens": "0", "x-sim-ttft": "0.1"})
    assert got.contents() == []
    assert got.events[-2].at >= 0.1 - EARLY


# -- non-streaming -------------------------------------------------------------


@pytest.mark.quiet("a timing read within tens of milliseconds")
def test_non_streaming_returns_after_all_tokens(client: httpx.Client, url: str) -> None:
    headers = {"x-sim-ttft": "0.1", "x-sim-tps": "50", "x-sim-output-tokens": "6"}

    def attempt() -> None:
        t0 = time.monotonic()
        response = client.post(
            url + "/v1/chat/completions", json=chat(stream=False), headers=headers
        )
        elapsed = time.monotonic() - t0
        assert 0.1 + 5 / 50 - EARLY <= elapsed <= 0.2 + LATE + 0.01
        body = response.json()
        assert body["object"] == "chat.completion"
        # vLLM 0.32's ChatMessage: every field but an empty tool_calls (its _serialize)
        assert body["choices"][0]["message"] == {
            "role": "assistant",
            "content": completion_text(6),
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"] == {
            "prompt_tokens": 4,
            "total_tokens": 11,
            "completion_tokens": 7,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }

    best_of(3, attempt)


def test_non_streaming_completion_with_openai_sdk(sdk: openai.OpenAI) -> None:
    result = sdk.completions.create(model="sim-model", prompt="abcdefgh", max_tokens=2)
    assert result.choices[0].text == completion_text(2)
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.prompt_tokens == 2


# -- errors before the stream ---------------------------------------------------


def test_context_errors_are_vllm_032s_400s_and_a_limit_that_fits_is_clamped(
    client: httpx.Client, url: str
) -> None:
    """vLLM 0.32 refuses a limit over the whole context, and a prompt that does not fit on
    its own (renderers/params.py; the first as in the captured
    /work/shared/fixtures/vllm-0.32/chat_over_context.json); a limit that fits the context
    but not beside the prompt is clamped to the room left (serve/utils/api_utils.py,
    get_max_tokens): the answer ends with `length`. The simulator refused that last one."""
    over = client.post(url + "/v1/chat/completions", json=chat(max_tokens=8000))
    assert over.status_code == 400
    assert over.json() == {
        "error": {
            "message": "max_tokens=8000 cannot be greater than max_model_len=4096. Please "
            "request fewer output tokens. (parameter=max_tokens, value=8000)",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }
    long = chat(messages=[{"role": "user", "content": "x" * 16400}])
    too_long = client.post(url + "/v1/chat/completions", json=long).json()["error"]
    assert too_long["param"] == "input_tokens"
    assert too_long["message"].startswith(
        "This model's maximum context length is 4096 tokens. However, your prompt contains "
        "4100 input tokens, which exceeds this limit even without any output tokens."
    )
    clamped = chat(False, messages=[{"role": "user", "content": "x" * 16360}], max_tokens=4000)
    answer = client.post(url + "/v1/chat/completions", json=clamped).json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 4096 - 4090


def test_unknown_model_is_vllms_404(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body == {
        "message": "The model `gpt-9` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


FORCED = [
    ("context_length", 400, "This model's maximum context length is 4096 tokens."),
    ("auth", 401, None),
    ("forbidden", 403, "Forbidden"),
    ("token_exchange", 500, "token exchange failed"),
    ("rate_limit", 429, "Rate limit exceeded"),
    ("not_found", 404, "The model `sim-model` does not exist."),
    ("bad_request", 400, "temperature must be non-negative"),
    ("server_error", 500, "Internal server error"),
]


@pytest.mark.parametrize(("name", "status", "message"), FORCED)
def test_forced_error_status_and_body(
    client: httpx.Client, url: str, app: SimApp, name: str, status: int, message: str | None
) -> None:
    response = client.post(url + "/v1/chat/completions", json=chat(), headers={"x-sim-error": name})
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    if message is None:
        assert response.json() == {"error": "Unauthorized"}
    else:
        error = response.json()["error"]
        assert error["message"].startswith(message)
        assert error["code"] == status
        assert set(error) == {"message", "type", "param", "code"}
    record = app.state.last()
    assert record is not None and record.outcome == "error" and record.status == status


def test_forced_html_502_is_a_load_balancer_page(client: httpx.Client, url: str) -> None:
    response = client.post(
        url + "/v1/chat/completions", json=chat(), headers={"x-sim-error": "html_502"}
    )
    assert response.status_code == 502
    assert response.headers["content-type"] == "text/html"
    assert "<h1>502 Bad Gateway</h1>" in response.text


def test_rate_limit_error_carries_retry_after(client: httpx.Client, url: str) -> None:
    response = client.post(
        url + "/v1/chat/completions", json=chat(), headers={"x-sim-error": "rate_limit"}
    )
    assert response.headers["retry-after"] == "1"


def test_unknown_control_value_is_a_400_naming_the_header(client: httpx.Client, url: str) -> None:
    response = client.post(url + "/v1/chat/completions", json=chat(), headers={"x-sim-fault": "x"})
    assert response.status_code == 400
    assert "x-sim-fault" in response.json()["error"]["message"]


def test_invalid_json_body_is_a_400(client: httpx.Client, url: str) -> None:
    response = client.post(url + "/v1/chat/completions", content=b"{nope")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"


# -- other endpoints -----------------------------------------------------------


def test_models_list_is_vllm_shaped(sdk: openai.OpenAI) -> None:
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["sim-model"]
    assert models.data[0].owned_by == "vllm"


def test_embeddings_are_deterministic_unit_vectors(sdk: openai.OpenAI) -> None:
    one = sdk.embeddings.create(model="sim-model", input=["alpha", "beta"])
    two = sdk.embeddings.create(model="sim-model", input="alpha")
    assert one.data[0].embedding == two.data[0].embedding
    assert one.data[0].embedding != one.data[1].embedding
    assert abs(sum(v * v for v in one.data[0].embedding) - 1) < 1e-4


def test_health_is_200_and_unknown_v1_route_is_404(client: httpx.Client, url: str) -> None:
    assert client.get(url + "/health").status_code == 200
    response = client.get(url + "/v1/nothing-here")
    assert response.status_code == 404
    assert response.json() == {"detail": "Not Found"}
    assert client.get(url + "/v1/chat/completions").status_code == 405


def test_x_request_id_becomes_the_response_id(client: httpx.Client, url: str) -> None:
    got = read_events(client, url, chat(), {"x-request-id": "abc123"})
    assert got.events[0].json["id"] == "chatcmpl-abc123"


# -- records -------------------------------------------------------------------


def test_record_holds_request_and_counts_what_was_sent(
    client: httpx.Client, url: str, app: SimApp
) -> None:
    got = read_events(client, url, chat(), {"Authorization": "Bearer secret", "X-Trace": "t1"})
    record = app.state.last()
    assert record is not None
    assert record.outcome == "completed"
    assert record.headers["x-trace"] == "t1"
    assert record.body == chat()
    assert record.chunks_sent == len(got.events)
    assert record.bytes_sent == len(got.raw)
    assert record.completion_tokens == 9 and record.prompt_tokens == 4  # the EOS is sent too
    assert app.state.active == 0


def test_requests_view_masks_authorization_and_reset_clears(client: httpx.Client, url: str) -> None:
    client.post(
        url + "/v1/chat/completions",
        json=chat(stream=False),
        headers={"Authorization": "Bearer s3cret"},
    )
    view = client.get(url + "/sim/requests").json()
    assert view[-1]["headers"]["authorization"] == "***"
    assert "s3cret" not in json.dumps(view)
    assert client.post(url + "/sim/reset").status_code == 200
    assert client.get(url + "/sim/requests").json() == []


def test_requests_view_masks_every_credential_header_query_and_field(
    client: httpx.Client, url: str
) -> None:
    secrets = {
        "x-api-key": "CANARYF8A",
        "x-goog-api-key": "CANARYF8B",
        "cookie": "session=CANARYF8C",
        "api-key": "CANARYF8D",
    }
    client.get(url + "/v1/models?api_key=CANARYF8E&key=CANARYF8F", headers=secrets)
    body = {**chat(stream=False), "api_key": "CANARYF8G", "credentials": {"pin": "CANARYF8H"}}
    client.post(url + "/v1/chat/completions", json=body, headers={"x-sim-output-tokens": "3"})
    view = client.get(url + "/sim/requests").json()
    assert [record["path"] for record in view] == ["/v1/models", "/v1/chat/completions"]
    assert all(view[0]["headers"][name] == "***" for name in secrets)
    assert view[0]["body"] == {"api_key": "***", "key": "***"}
    assert view[1]["headers"]["x-sim-output-tokens"] == "3"
    assert view[1]["body"]["messages"] == body["messages"]
    assert "CANARY" not in json.dumps(view)


def test_body_digest_covers_every_byte_sent() -> None:
    with running(SimConfig(ttft=0.01, tokens_per_second=1000, record_bodies=True)) as (server, app):
        with warm_client(server.url) as client:
            got = read_events(client, server.url, chat())
        record = app.state.last()
        assert record is not None
        assert record.body_sha256 == hashlib.sha256(got.raw).hexdigest()


def test_api_key_is_required_on_v1_only() -> None:
    with running(SimConfig(api_key="k1")) as (server, _):
        with httpx.Client() as client:
            missing = client.get(server.url + "/v1/models")
            wrong = client.get(server.url + "/v1/models", headers={"Authorization": "Bearer no"})
            right = client.get(server.url + "/v1/models", headers={"Authorization": "Bearer k1"})
            health = client.get(server.url + "/health")
        assert (missing.status_code, missing.json()) == (401, {"error": "Unauthorized"})
        assert wrong.status_code == 401
        assert right.status_code == 200
        assert health.status_code == 200
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="k1", max_retries=0)
        assert sdk.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}]
        ).choices[0].message.content == completion_text(32)
