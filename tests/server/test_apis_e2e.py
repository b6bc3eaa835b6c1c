"""Every API end to end: the official clients, unmodified, through the proxy.

Messages and Responses streams come from recorded vLLM streams replayed with programmed
timing (tests/vllm_routes.py); embeddings from the simulator. Each test checks what the
client got (bytes identical to what the backend sent) and what the proxy measured (TTFT
within the programmed bounds, tokens equal to the backend's usage, the finish label).
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Iterator

import anthropic
import httpx
import openai
import orjson
import pytest

from proxy.core.measurement import ErrorType
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.servers import ThreadedServer
from tests.vllm_routes import UTILITY, VllmRoutes

TTFT, GAP = 0.3, 0.02
# The opening events go out with the headers; the first content comes TTFT later. The
# proxy may add to it on a loaded machine, never take away, and it cannot see the first
# token later than the client has read the stream to its end: that bounds it from above.


@pytest.fixture
def backend() -> Iterator[tuple[VllmRoutes, ThreadedServer]]:
    app = VllmRoutes(ttft=TTFT, gap=GAP)
    server = ThreadedServer(app).start()
    yield app, server
    server.stop()


@pytest.fixture
def via(
    backend: tuple[VllmRoutes, ThreadedServer], start_proxy: Callable[..., ProxyUnderTest]
) -> ProxyUnderTest:
    return start_proxy(backend[1].url, model_allowlist=(MODEL, "m"))


def requests_total(proxy: ProxyUnderTest, endpoint: str, **labels: str) -> float:
    return sum(
        sample.value
        for metric in proxy.registry.collect()
        if metric.name == "tokenprobe_requests"
        for sample in metric.samples
        if sample.name == "tokenprobe_requests_total"
        and sample.labels["endpoint"] == endpoint
        and all(sample.labels[k] == v for k, v in labels.items())
    )


# -- Anthropic Messages ------------------------------------------------------------------


def anthropic_client(proxy: ProxyUnderTest) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key="sk-test", max_retries=0)


#: An SDK builds the models of a stream's events on first use: 0.2 s of the GIL here for the
#: Responses events, which this process shares with the in-process proxy, and twice that
#: beside three other workers, so that the proxy read a first token 0.74 s after the
#: request for 0.3 s. The timed tests stream once first, unread.
WARM_UP = 1


def test_anthropic_sdk_messages_stream_is_measured(via: ProxyUnderTest) -> None:
    client = anthropic_client(via)

    def stream_once() -> tuple[str, anthropic.types.Message]:
        with client.messages.stream(
            model="m", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
        ) as stream:
            return "".join(stream.text_stream), stream.get_final_message()

    stream_once()
    started = time.monotonic()
    text, final = stream_once()
    waited = time.monotonic() - started
    assert text == "Hello there!" and final.stop_reason == "end_turn"
    (_, m) = via.wait_records(WARM_UP + 1, exact=True)
    assert m.endpoint == "/v1/messages" and m.ok and m.stream
    assert m.ttft is not None and TTFT <= m.ttft <= waited
    assert (m.prompt_tokens, m.output_tokens) == (12, 5)  # the stream's own usage
    assert (m.finish_reason, m.raw_finish_reason) == ("stop", "end_turn")
    counted = requests_total(via, "/v1/messages", finish_reason="stop", error_type="none")
    assert counted == WARM_UP + 1


def test_anthropic_sdk_messages_create_is_measured(via: ProxyUnderTest) -> None:
    message = anthropic_client(via).messages.create(
        model="m", max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
    )
    assert message.stop_reason == "max_tokens"
    (m,) = via.wait_records(1, exact=True)
    assert (m.endpoint, m.stream, m.ok) == ("/v1/messages", False, True)
    assert (m.prompt_tokens, m.output_tokens, m.finish_reason) == (12, 3, "length")


def test_messages_stream_bytes_reach_the_client_unchanged(
    via: ProxyUnderTest, backend: tuple[VllmRoutes, ThreadedServer]
) -> None:
    body = {"model": "m", "max_tokens": 64, "stream": True, "messages": []}
    received = httpx.post(via.url + "/v1/messages", json=body).content
    via.wait_records(1, exact=True)
    assert hashlib.sha256(received).digest() == hashlib.sha256(backend[0].sent[-1]).digest()


def test_messages_error_classes_are_counted(via: ProxyUnderTest) -> None:
    client = anthropic_client(via)
    with pytest.raises(anthropic.RateLimitError):
        client.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": "Hi"}],
            extra_headers={"x-status": "429"},
        )
    # An `error` event inside the 200 stream (read to its end: the SDK would raise on it
    # and hang up first, which is then counted as the client's cancel).
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": []}
    reply = httpx.post(
        via.url + "/v1/messages", json=body, headers={"x-stream": "vllm_messages_error.sse"}
    )
    assert b"event: error" in reply.content
    via.wait_records(2, exact=True)
    assert requests_total(via, "/v1/messages", error_type="rate_limit", code="429") == 1
    assert requests_total(via, "/v1/messages", error_type="stream_error", code="200") == 1


# -- OpenAI Responses --------------------------------------------------------------------


def openai_client(proxy: ProxyUnderTest) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0)


def test_openai_sdk_responses_stream_is_measured(via: ProxyUnderTest) -> None:
    client = openai_client(via)
    list(client.responses.create(model="m", input="Hi", stream=True))  # WARM_UP
    started = time.monotonic()
    kinds = [event.type for event in client.responses.create(model="m", input="Hi", stream=True)]
    waited = time.monotonic() - started
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    (_, m) = via.wait_records(WARM_UP + 1, exact=True)
    assert m.endpoint == "/v1/responses" and m.ok
    assert m.ttft is not None and TTFT <= m.ttft <= waited
    # 3 text deltas and the EOS, which vLLM's usage counts
    assert (m.prompt_tokens, m.output_tokens, m.cached_prompt_tokens) == (12, 4, 8)
    assert (m.finish_reason, m.raw_finish_reason) == ("stop", "completed")


def test_openai_sdk_responses_create_is_measured(via: ProxyUnderTest) -> None:
    response = openai_client(via).responses.create(model="m", input="Hi")
    assert response.status == "incomplete"
    (m,) = via.wait_records(1, exact=True)
    assert (m.endpoint, m.stream, m.ok) == ("/v1/responses", False, True)
    assert (m.prompt_tokens, m.output_tokens) == (12, 3)
    assert (m.finish_reason, m.raw_finish_reason) == ("length", "max_output_tokens")
    assert requests_total(via, "/v1/responses", finish_reason="length") == 1


def test_responses_stream_bytes_reach_the_client_unchanged(
    via: ProxyUnderTest, backend: tuple[VllmRoutes, ThreadedServer]
) -> None:
    body = {"model": "m", "input": "Hi", "stream": True}
    received = httpx.post(via.url + "/v1/responses", json=body).content
    via.wait_records(1, exact=True)
    assert hashlib.sha256(received).digest() == hashlib.sha256(backend[0].sent[-1]).digest()


def test_responses_error_status_is_counted(via: ProxyUnderTest) -> None:
    with pytest.raises(openai.RateLimitError):
        openai_client(via).responses.create(
            model="m", input="Hi", extra_headers={"x-status": "429"}
        )
    (m,) = via.wait_records(1, exact=True)
    assert (m.endpoint, m.error_type) == ("/v1/responses", ErrorType.RATE_LIMIT)


# -- embeddings (the simulator) ----------------------------------------------------------


def test_openai_sdk_embeddings_are_measured(sim: Running, proxy: ProxyUnderTest) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0)
    result = client.embeddings.create(model=MODEL, input=["hello there", "hi"])
    (m,) = proxy.wait_records(1, exact=True)
    assert (m.endpoint, m.ok, m.stream) == ("/v1/embeddings", True, False)
    assert m.prompt_tokens == result.usage.prompt_tokens > 0
    assert (m.output_tokens, m.ttft, m.finish_reason) == (None, None, "none")
    labels = {"model": MODEL, "endpoint": "/v1/embeddings"}
    assert proxy.sample("tokenprobe_e2e_request_latency_seconds_count", **labels) == 1
    assert proxy.sample("tokenprobe_requests_in_flight", **labels) == 0


@pytest.mark.parametrize("encoding", ["bytes", "bytes_only"])
def test_binary_embeddings_pass_whole_and_take_their_usage_from_the_metadata_header(
    sim: Running, proxy: ProxyUnderTest, encoding: str
) -> None:
    """vLLM answers `encoding_format: "bytes"` with raw float32 and its usage in a
    `metadata` header (pooling/utils.py, build_pooling_bytes_streaming_response);
    "bytes_only" with the vectors alone."""
    from proxy.sim.catalog import EMBEDDING_DIM, embedding

    body = {"model": MODEL, "input": ["hello there", "hi"], "encoding_format": encoding}
    direct = httpx.post(sim.url + "/v1/embeddings", json=body)
    proxied = httpx.post(proxy.url + "/v1/embeddings", json=body)
    (m,) = proxy.wait_records(1, exact=True)
    assert proxied.headers["content-type"] == "application/octet-stream"
    assert proxied.content == direct.content  # the vectors, byte for byte
    vectors = struct.unpack(f"<{2 * EMBEDDING_DIM}f", proxied.content)
    assert vectors == pytest.approx(embedding("hello there") + embedding("hi"), abs=1e-6)
    assert (m.endpoint, m.ok, m.stream, m.malformed_events) == ("/v1/embeddings", True, False, 0)
    if encoding == "bytes":
        account = orjson.loads(proxied.headers["metadata"])
        assert account["usage"]["prompt_tokens"] == m.prompt_tokens > 0
        assert (m.prompt_tokens, m.token_source) == (sim.app.state.last().prompt_tokens, "usage")
        assert m.response_model == MODEL
    else:
        assert "metadata" not in proxied.headers
        assert m.prompt_tokens is None  # nothing says how many


# -- routes forwarded unmeasured ---------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), sorted(UTILITY))
def test_backend_routes_answer_exactly_what_the_backend_answers(
    via: ProxyUnderTest, backend: tuple[VllmRoutes, ThreadedServer], method: str, path: str
) -> None:
    body = b'{"model":"m","prompt":"Hello there!","tokens":[1,2]}' if method == "POST" else None
    direct = httpx.request(method, backend[1].url + path, content=body)
    proxied = httpx.request(method, via.url + path, content=body)
    assert (proxied.status_code, proxied.content) == (direct.status_code, direct.content)
    assert proxied.headers["content-type"] == direct.headers["content-type"]
    assert via.records == []  # forwarded, not measured


# -- n > 1 choices -----------------------------------------------------------------------


@pytest.mark.quiet("TPOT and decode speed are read within 25% of the programmed step", seconds=1)
def test_n_choices_report_one_choice_speed_not_their_sum(
    backend: tuple[VllmRoutes, ThreadedServer], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """Three choices decoding at 1/step tokens/s each: the request's decode speed is one
    choice's (the median), not three times it as over the interleaved events."""
    backend[0].gap = step = 0.06  # one decode step: a token for each choice
    proxy = start_proxy(backend[1].url, model_allowlist=("m",))
    body = {"model": "m", "n": 3, "stream": True, "messages": []}
    httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-tokens": "8"})
    (m,) = proxy.wait_records(1, exact=True)
    assert (m.output_tokens, m.content_events, m.finish_reason) == (24, 24, "stop")
    assert m.ttft is not None and m.ttft >= TTFT  # the role-only chunks are not tokens
    assert m.decode_tokens_per_second == pytest.approx(1 / step, rel=0.25)
    assert m.tpot == pytest.approx(step, rel=0.25)
