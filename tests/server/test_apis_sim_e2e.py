"""Every API through the proxy in front of the simulator, with the official clients.

The simulator (proxy/sim) serves Messages, Responses, embeddings, the pooling family and
vLLM's utility routes wire-faithfully and records what it sent (its SHA-256, usage, the
instant of its first text). Each test checks what the client got against that record and
what the proxy measured against the simulator's programmed timing and usage.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from proxy.core.measurement import ErrorType, Measurement
from proxy.sim.state import SimRequest
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.server.conftest import WITH_HYPERCORN, paths

TTFT = 0.25
PROGRAM = {"x-sim-ttft": str(TTFT), "x-sim-tps": "100", "x-sim-output-tokens": "8"}
MESSAGES: Any = [{"role": "user", "content": "Hello there"}]


pytestmark = paths(*WITH_HYPERCORN, why="the ASGI app is a product: it runs under hypercorn too")


def record(proxy: ProxyUnderTest, n: int = 1) -> Measurement:
    deadline = time.monotonic() + 5
    while len(proxy.records) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(proxy.records) == n
    return proxy.records[-1]


def sent(sim: Running) -> SimRequest:
    last = sim.app.state.last()
    assert last is not None
    return last  # type: ignore[no-any-return]


def requests_total(proxy: ProxyUnderTest, endpoint: str, **labels: str) -> float:
    return proxy.sample(
        "tokenprobe_requests_total",
        **{"model": MODEL, "endpoint": endpoint, "code": "200", "error_type": "none", **labels},
    )


# -- Anthropic Messages ------------------------------------------------------------------


#: An SDK builds the models of a stream's events on first use, holding the GIL that this
#: process shares with the in-process proxy: up to 0.4 s beside three other workers
#: (tests/server/test_apis_e2e.py, WARM_UP). The timed tests stream once first, unread:
#: their record is the second.
TIMED = 2


def test_anthropic_messages_stream(sim: Running, proxy: ProxyUnderTest) -> None:
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)

    def stream_once() -> tuple[str, anthropic.types.Message]:
        with client.messages.stream(
            model=MODEL, max_tokens=64, messages=MESSAGES, extra_headers=PROGRAM
        ) as stream:
            return "".join(stream.text_stream), stream.get_final_message()

    stream_once()
    started = time.monotonic()
    text, final = stream_once()
    waited = time.monotonic() - started  # the proxy saw the first token within it
    m, backend = record(proxy, TIMED), sent(sim)
    assert text and final.stop_reason == "end_turn"
    assert m.endpoint == "/v1/messages" and m.ok and m.stream
    # the first text delta; message_start came with it, as vLLM sends it (x-sim-early-role
    # would send it at ~0)
    assert m.ttft is not None and TTFT <= m.ttft <= waited
    assert (m.prompt_tokens, m.output_tokens) == (backend.prompt_tokens, 9)  # and the EOS
    assert (m.finish_reason, m.raw_finish_reason) == ("stop", "end_turn")
    assert requests_total(proxy, "/v1/messages", finish_reason="stop") == TIMED


def test_anthropic_messages_create_cut_by_max_tokens_is_length(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    made = client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
    m, backend = record(proxy), sent(sim)
    assert made.stop_reason == "max_tokens"
    assert (m.stream, m.prompt_tokens, m.output_tokens) == (False, backend.prompt_tokens, 4)
    assert (m.finish_reason, m.raw_finish_reason) == ("length", "max_tokens")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"model": MODEL, "max_tokens": 64, "stream": True, "messages": MESSAGES}),
        ("/v1/responses", {"model": MODEL, "stream": True, "input": "Hello there"}),
    ],
)
def test_stream_bytes_reach_the_client_as_the_simulator_sent_them(
    sim: Running, proxy: ProxyUnderTest, path: str, body: dict[str, Any]
) -> None:
    received = httpx.post(proxy.url + path, json=body, headers=PROGRAM).content
    record(proxy)
    assert hashlib.sha256(received).hexdigest() == sent(sim).body_sha256


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"model": MODEL, "max_tokens": 64, "stream": True, "messages": MESSAGES}),
        ("/v1/responses", {"model": MODEL, "stream": True, "input": "Hello there"}),
    ],
)
def test_error_classes_are_counted_per_api(
    sim: Running, proxy: ProxyUnderTest, path: str, body: dict[str, Any]
) -> None:
    cases = [
        ({"x-sim-error": "rate_limit"}, ErrorType.RATE_LIMIT),
        ({"x-sim-fault": "error_event", "x-sim-fault-after": "2"}, ErrorType.STREAM_ERROR),
        ({"x-sim-fault": "close_no_done", "x-sim-fault-after": "2"}, ErrorType.STREAM_TRUNCATED),
    ]
    for n, (headers, error) in enumerate(cases, start=1):
        httpx.post(proxy.url + path, json=body, headers=headers)
        m = record(proxy, n)
        assert (m.endpoint, m.error_type) == (path, error), headers
    for _, error in cases:
        labels = {"model": MODEL, "endpoint": path, "error_type": error.value}
        total = sum(
            s.value
            for family in proxy.registry.collect()
            for s in family.samples
            if s.name == "tokenprobe_requests_total"
            and all(s.labels[k] == v for k, v in labels.items())
        )
        assert total == 1, error


# -- OpenAI Responses --------------------------------------------------------------------


def test_openai_responses_stream(sim: Running, proxy: ProxyUnderTest) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    for _ in range(TIMED):
        started = time.monotonic()
        events = list(
            client.responses.create(
                model=MODEL, input="Hello there", stream=True, extra_headers=PROGRAM
            )
        )
        waited = time.monotonic() - started  # the proxy saw the first token within it
    m, backend = record(proxy, TIMED), sent(sim)
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert m.endpoint == "/v1/responses" and m.ok
    assert m.ttft is not None and TTFT <= m.ttft <= waited  # response.created came at ~0
    assert (m.prompt_tokens, m.output_tokens) == (backend.prompt_tokens, 9)  # and the EOS
    assert (m.finish_reason, m.raw_finish_reason) == ("stop", "completed")


def test_openai_responses_create_incomplete_is_length(sim: Running, proxy: ProxyUnderTest) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    response = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=4)
    m, backend = record(proxy), sent(sim)
    assert response.status == "incomplete"
    assert (m.stream, m.prompt_tokens, m.output_tokens) == (False, backend.prompt_tokens, 4)
    assert (m.finish_reason, m.raw_finish_reason) == ("length", "max_output_tokens")
    assert requests_total(proxy, "/v1/responses", finish_reason="length") == 1


# -- non-generative and forwarded --------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "label", "body"),
    [
        ("/pooling", "/pooling", {"input": "Hello there"}),
        ("/score", "/score", {"text_1": "Hello", "text_2": "there"}),
        ("/v1/rerank", "/rerank", {"query": "Hello", "documents": ["a b", "c"]}),
        ("/classify", "/classify", {"input": "Hello there"}),
    ],
)
def test_pooling_family_is_measured_under_its_label(
    sim: Running, proxy: ProxyUnderTest, path: str, label: str, body: dict[str, Any]
) -> None:
    reply = httpx.post(proxy.url + path, json={"model": MODEL, **body})
    m = record(proxy)
    assert reply.status_code == 200
    assert (m.endpoint, m.ok, m.output_tokens, m.ttft) == (label, True, None, None)
    assert m.prompt_tokens == reply.json()["usage"]["prompt_tokens"] == sent(sim).prompt_tokens


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/tokenize", {"model": MODEL, "prompt": "Hello there"}),
        ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2, 3]}),
        ("GET", "/version", None),
        ("GET", "/ping", None),
        ("GET", "/health", None),
        ("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": MESSAGES}),
    ],
)
def test_utility_routes_answer_exactly_what_the_simulator_answers(
    sim: Running, proxy: ProxyUnderTest, method: str, path: str, body: Any
) -> None:
    direct = httpx.request(method, sim.url + path, json=body)
    proxied = httpx.request(method, proxy.url + path, json=body)
    assert (proxied.status_code, proxied.content) == (direct.status_code, direct.content)
    assert proxied.headers.get("content-type") == direct.headers.get("content-type")
    assert proxy.records == []
