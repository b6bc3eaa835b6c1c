"""The EOS token that ends a choice: vLLM 0.32 generates it, sends no text for it, and
counts it. The scheduler appends it to the output (v1/core/sched/utils.py:99-102,
check_stop), the detokenizer skips its text but keeps its id (v1/engine/detokenizer.py:
107-128), and every route counts `len(output.token_ids)`: chat_completion/serving.py:684
and :1151, completion/serving.py:401 and :598, responses/context.py:222,
token_in_token_out/serving.py:465 and :578, the Anthropic and Cohere layers from chat's
usage. A `length` finish has no EOS (the limit is reached on a text token, :104-109), nor
has a stop string's (the output keeps the tokens up to the one completing it,
detokenizer.py:140-151), nor `ignore_eos`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.sim import SimApp, SimConfig, completion_text
from proxy.sim.generate import EOS_ID, token_ids
from tests.sim.test_sim_support import chat, running

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TEXT = 3  # text tokens the model plans before its EOS
USAGE = {"include_usage": True}


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[str, SimApp]]:
    config = SimConfig(ttft=0.0, tokens_per_second=2000.0, output_tokens=TEXT)
    with running(config) as (server, app):
        yield server.url, app


def payloads(raw: bytes) -> list[Any]:
    """Every `data:` event's JSON (named or not), [DONE] left out."""
    out = []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                out.append(orjson.loads(line[6:]))
    return out


def post(url: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=10)


def completion(stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": "once upon", "stream": stream, **extra}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_usage_counts_each_choices_eos(sim: tuple[str, SimApp], path: str, stream: bool) -> None:
    url, _ = sim
    options = {"stream_options": USAGE} if stream else {}
    body = chat(stream, n=2, **options) if path == CHAT else completion(stream, n=2, **options)
    reply = post(url, path, body)
    usage = payloads(reply.content)[-1]["usage"] if stream else reply.json()["usage"]
    assert usage["completion_tokens"] == 2 * (TEXT + 1)


def test_the_eos_finish_chunk_counts_its_token(sim: tuple[str, SimApp]) -> None:
    """Continuous usage: the text's chunks count up, the empty finish chunk counts the EOS."""
    url, _ = sim
    body = chat(stream_options={**USAGE, "continuous_usage_stats": True})
    chunks = payloads(post(url, CHAT, body).content)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == [0, 1, 2, 3, 4, 4]
    assert chunks[-2]["choices"][0]["delta"] == {"content": ""}


@pytest.mark.parametrize(
    ("extra", "generated", "finish"),
    [
        ({"max_tokens": 2}, 2, "length"),
        ({"max_tokens": TEXT}, TEXT, "length"),  # the EOS has no room left
        ({"max_tokens": TEXT + 1}, TEXT + 1, "stop"),
        ({"max_tokens": 5, "ignore_eos": True}, 5, "length"),
    ],
)
def test_only_a_choice_that_ends_with_eos_counts_one_more(
    sim: tuple[str, SimApp], extra: dict[str, Any], generated: int, finish: str
) -> None:
    url, _ = sim
    answer = post(url, COMPLETIONS, completion(False, **extra)).json()
    assert answer["choices"][0]["finish_reason"] == finish
    assert answer["usage"]["completion_tokens"] == generated


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_string_counts_up_to_the_token_completing_it(
    sim: tuple[str, SimApp], stream: bool
) -> None:
    """ " quick" completes in the 2nd token: 2 tokens, no EOS, the text cut before it."""
    url, _ = sim
    body = completion(stream, stop="quick", max_tokens=8)
    if stream:
        body["stream_options"] = USAGE
    reply = post(url, COMPLETIONS, body, **{"x-sim-output-tokens": "8"})
    usage = payloads(reply.content)[-1]["usage"] if stream else reply.json()["usage"]
    assert usage["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    ("path", "body", "count"),
    [
        (
            "/v1/messages",
            {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
            lambda b: b["usage"]["output_tokens"],
        ),
        (
            "/v1/responses",
            {"input": "hi"},
            lambda b: b.get("response", b)["usage"]["output_tokens"],
        ),
        (
            "/cohere/v2/chat",
            {"messages": [{"role": "user", "content": "hi"}]},
            lambda b: b.get("delta", b)["usage"]["tokens"]["output_tokens"],
        ),
    ],
)
def test_messages_responses_and_cohere_count_the_eos(
    sim: tuple[str, SimApp], path: str, body: dict[str, Any], count: Any, stream: bool
) -> None:
    url, app = sim
    reply = post(url, path, {"model": "sim-model", "stream": stream, **body})
    events = [e for e in payloads(reply.content) if b'"usage"' in orjson.dumps(e)]
    last = events[-1] if stream else reply.json()
    assert count(last) == TEXT + 1
    record = app.state.last()
    assert record is not None and record.completion_tokens == TEXT + 1


def test_generate_streams_the_eos_token_id_and_counts_it(sim: tuple[str, SimApp]) -> None:
    url, _ = sim
    body = {"model": "sim-model", "token_ids": [1, 2, 3], "stream": True, "stream_options": USAGE}
    chunks = payloads(post(url, "/inference/v1/generate", body).content)
    ids = [(c["choices"][0]["token_ids"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]]
    assert ids == [(token_ids(1, i), None) for i in range(TEXT)] + [([EOS_ID], "stop")]
    assert chunks[-1]["usage"]["completion_tokens"] == TEXT + 1
    whole = post(url, "/inference/v1/generate", {**body, "stream": False}).json()
    assert whole["choices"][0]["token_ids"] == [*token_ids(TEXT), EOS_ID]
    assert whole["usage"]["completion_tokens"] == TEXT + 1


def test_an_eos_in_the_last_texts_step_ends_that_chunk(sim: tuple[str, SimApp]) -> None:
    """Several tokens a step (x-sim-tokens-per-chunk 2): tokens 1-2, then token 3 and the
    EOS in one engine output, whose chunk carries the text and the finish."""
    url, _ = sim
    body = chat(stream_options=USAGE)
    chunks = payloads(post(url, CHAT, body, **{"x-sim-tokens-per-chunk": "2"}).content)
    choices = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks[1:-1]]
    assert choices == [
        ({"content": completion_text(2)}, None),
        ({"content": completion_text(1, 2)}, "stop"),
    ]
    assert chunks[-1]["usage"]["completion_tokens"] == TEXT + 1


def test_a_script_counts_its_eos_but_not_as_reasoning(sim: tuple[str, SimApp]) -> None:
    url, app = sim
    headers = {"x-sim-reasoning-tokens": "2"}
    chunks = payloads(post(url, CHAT, chat(stream_options=USAGE), **headers).content)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 2 + TEXT + 1
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 2}
    record = app.state.last()
    assert record is not None and record.completion_tokens == 2 + TEXT + 1


def test_the_request_record_counts_the_eos_sent(sim: tuple[str, SimApp]) -> None:
    """/sim/requests says the tokens sent: the EOS token's finish chunk went out."""
    url, _ = sim
    post(url, CHAT, chat(n=2))
    view = httpx.get(url + "/sim/requests").json()
    assert view[-1]["completion_tokens"] == 2 * (TEXT + 1)
