"""Tracing end to end: client -> proxy -> simulator, spans exported over OTLP/HTTP to a
real receiver, all on uvicorn on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from proxy.server.assemble import assemble
from proxy.settings import Settings
from proxy.sinks.tracing import Tracing, tracing_from_env
from tests.conftest import MODEL, Running
from tests.otlp_receiver import SPAN_KIND_CLIENT, STATUS_CODE_ERROR, OtlpReceiver
from tests.servers import ThreadedServer, serve

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Traced:
    def __init__(self, url: str, receiver: OtlpReceiver, tracing: Tracing) -> None:
        self.url = url
        self.receiver = receiver
        self.tracing = tracing


@pytest.fixture
def receiver() -> Iterator[tuple[OtlpReceiver, str]]:
    app = OtlpReceiver()
    with serve(app) as server:
        yield app, server.url


@pytest.fixture
def traced_proxy(sim: Running, receiver: tuple[OtlpReceiver, str]) -> Iterator[Traced]:
    app, url = receiver
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_BSP_SCHEDULE_DELAY": "20"}
    registry = CollectorRegistry()
    tracing = tracing_from_env(environ, upstream=sim.url, registry=registry)
    assert tracing is not None
    proxy = assemble(
        Settings(upstream=sim.url, models_refresh=None, model_allowlist=(MODEL,), access_log="off"),
        {},
        registry=registry,
        tracer=tracing,
    )
    server = ThreadedServer(proxy, server_header=False, date_header=False).start()
    try:
        yield Traced(server.url, app, tracing)
    finally:
        server.stop()
        tracing.shutdown()


def chat(**extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "stream": True, "max_tokens": 16, "temperature": 0.5}
    return {**body, "messages": [{"role": "user", "content": "hello"}], **extra}


def test_streamed_request_exports_one_genai_client_span(sim: Running, traced_proxy: Traced) -> None:
    # room for the sim's 16 text tokens and the EOS after them, which vLLM counts
    response = httpx.post(traced_proxy.url + "/v1/chat/completions", json=chat(max_tokens=17))
    assert response.status_code == 200
    (span,) = traced_proxy.receiver.wait_for()
    assert (span.name, span.kind) == (f"chat {MODEL}", SPAN_KIND_CLIENT)
    attributes = span.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "openai"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.request.max_tokens"] == 17
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert attributes["gen_ai.usage.output_tokens"] == 17
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["gen_ai.response.id"] == sim.app.state.last().id
    assert attributes["server.address"] == "127.0.0.1"
    assert attributes["server.port"] == int(sim.url.rsplit(":", 1)[1])
    assert attributes["tokenprobe.token_source"] == "usage"
    # The simulator's first token comes 50 ms after the request; 16 tokens at 200/s.
    assert 0.05 <= attributes["tokenprobe.time_to_first_token"] < 1.0
    assert attributes["tokenprobe.e2e"] >= attributes["tokenprobe.time_to_first_token"]
    assert span.resource["service.name"] == "tokenprobe"
    events = {e.name: e.time_unix_nano for e in span.events}
    assert list(events) == ["first_byte", "first_token"]
    assert (
        span.start_time_unix_nano
        <= events["first_byte"]
        <= events["first_token"]
        <= span.end_time_unix_nano
    )
    ttft_ns = events["first_token"] - span.start_time_unix_nano
    assert abs(ttft_ns / 1e9 - attributes["tokenprobe.time_to_first_token"]) < 1e-6


def test_openai_api_type_names_the_openai_api_of_each_span(
    sim: Running, traced_proxy: Traced
) -> None:
    """openai.api.type (semantic-conventions-genai docs/gen-ai/openai.md, the OpenAI
    inference span, Recommended): chat_completions and responses, the values the
    conventions name; none for an API they name none for (legacy completions) nor for
    another provider's (Anthropic Messages: "not expected to include openai.*")."""
    hi = [{"role": "user", "content": "hi"}]
    requests = {
        "/v1/chat/completions": {"model": MODEL, "messages": hi},
        "/v1/responses": {"model": MODEL, "input": "hi"},
        "/v1/completions": {"model": MODEL, "prompt": "hi"},
        "/v1/messages": {"model": MODEL, "max_tokens": 8, "messages": hi},
    }
    with httpx.Client(base_url=traced_proxy.url, timeout=30) as client:
        for path, body in requests.items():
            assert client.post(path, json=body).status_code == 200, path
    spans = traced_proxy.receiver.wait_for(lambda spans: len(spans) == len(requests))
    found = {
        (s.attributes["gen_ai.provider.name"], s.attributes.get("openai.api.type")) for s in spans
    }
    assert found == {
        ("openai", "chat_completions"),
        ("openai", "responses"),
        ("openai", None),
        ("anthropic", None),
    }


def test_the_request_s_sampling_options_reach_the_span_at_its_start(
    traced_proxy: Traced,
) -> None:
    """seed, choice.count (n != 1), top_p, top_k, penalties, stop sequences and output
    type, as the client sent them (docs/gen-ai/client-inference.md @ 024a4f94)."""
    options = {
        "seed": 42, "n": 2, "top_p": 0.9, "top_k": 20, "frequency_penalty": 0.1,
        "presence_penalty": 0.2, "stop": ["\n\n"], "response_format": {"type": "json_object"},
    }  # fmt: skip
    response = httpx.post(traced_proxy.url + "/v1/chat/completions", json=chat(**options))
    assert response.status_code == 200
    (span,) = traced_proxy.receiver.wait_for()
    attributes = span.attributes
    assert attributes["gen_ai.request.seed"] == 42
    assert attributes["gen_ai.request.choice.count"] == 2
    assert attributes["gen_ai.request.top_p"] == 0.9
    assert attributes["gen_ai.request.top_k"] == 20
    assert attributes["gen_ai.request.frequency_penalty"] == 0.1
    assert attributes["gen_ai.request.presence_penalty"] == 0.2
    assert attributes["gen_ai.request.stop_sequences"] == ("\n\n",)
    assert attributes["gen_ai.output.type"] == "json"


def test_a_seed_beyond_64_bits_is_left_out_quietly(
    traced_proxy: Traced, caplog: pytest.LogCaptureFixture
) -> None:
    """JSON allows a seed of 2**64 - 1 (orjson reads it as an int); OTLP carries 64-bit
    integers, and its encoder logged a traceback for each such attribute before leaving
    it out: a client could fill the proxy's log. The proxy leaves it out itself."""
    body = orjson.dumps({**chat(), "seed": 2**64 - 1, "top_k": 20})
    headers = {"content-type": "application/json"}
    response = httpx.post(traced_proxy.url + "/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == 200
    (span,) = traced_proxy.receiver.wait_for()
    assert "gen_ai.request.seed" not in span.attributes
    assert span.attributes["gen_ai.request.top_k"] == 20
    assert "out of range" not in caplog.text


def test_client_traceparent_joins_the_trace_and_upstream_sees_the_proxy_span(
    sim: Running, traced_proxy: Traced
) -> None:
    headers = {
        "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
        "tracestate": "congo=t61rcWkgMzE",
    }
    httpx.post(traced_proxy.url + "/v1/chat/completions", json=chat(), headers=headers)
    (span,) = traced_proxy.receiver.wait_for()
    assert (span.trace_id, span.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert span.trace_state == "congo=t61rcWkgMzE"
    seen = sim.app.state.last()
    assert seen is not None
    # Among what reached the backend (see test_upstream_gets_exactly_one_traceparent).
    assert f"00-{CLIENT_TRACE}-{span.span_id}-01" in seen.headers["traceparent"].split(", ")
    assert "congo=t61rcWkgMzE" in seen.headers["tracestate"].split(", ")


def test_unreachable_upstream_marks_the_span_as_an_error(
    receiver: tuple[OtlpReceiver, str],
) -> None:
    app, url = receiver
    tracing = tracing_from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_BSP_SCHEDULE_DELAY": "20"},
        upstream="http://127.0.0.1:1",
        registry=CollectorRegistry(),
    )
    assert tracing is not None
    proxy = assemble(
        Settings(
            upstream="http://127.0.0.1:1",
            models_refresh=None,
            model_allowlist=(MODEL,),
            access_log="off",
        ),
        {},
        registry=CollectorRegistry(),
        tracer=tracing,
    )
    with serve(proxy) as server:
        assert httpx.post(server.url + "/v1/chat/completions", json=chat()).status_code == 502
        (span,) = app.wait_for()
    tracing.shutdown()
    assert span.attributes["error.type"] == "upstream_unreachable"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert span.status_code == STATUS_CODE_ERROR


async def _raw_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A vLLM-shaped non-streaming answer that records the raw request headers."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    _raw_upstream.seen.append(list(scope["headers"]))  # type: ignore[attr-defined]
    body = b'{"id":"cmpl-1","object":"chat.completion","model":"sim-model","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def test_upstream_gets_exactly_one_traceparent(receiver: tuple[OtlpReceiver, str]) -> None:
    _raw_upstream.seen = []  # type: ignore[attr-defined]
    app, url = receiver
    with serve(_raw_upstream) as upstream:
        tracing = tracing_from_env(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": url},
            upstream=upstream.url,
            registry=CollectorRegistry(),
        )
        assert tracing is not None
        proxy = assemble(
            Settings(
                upstream=upstream.url,
                models_refresh=None,
                model_allowlist=(MODEL,),
                access_log="off",
            ),
            {},
            registry=CollectorRegistry(),
            tracer=tracing,
        )
        with serve(proxy) as server:
            headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
            httpx.post(
                server.url + "/v1/chat/completions", json=chat(stream=False), headers=headers
            )
        tracing.shutdown()
    (seen,) = _raw_upstream.seen  # type: ignore[attr-defined]
    assert [v for k, v in seen if k == b"traceparent"] == [
        f"00-{CLIENT_TRACE}-{app.spans[0].span_id}-01".encode()
    ]
