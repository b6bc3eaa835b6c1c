"""An upstream that echoes the client's JSON body in its error: the values of the fields
named like credentials (`api_key`, `password`, a `credentials` object) reach neither the
access log's `error` nor the span's status, whatever shape carried them (a JSON member, a
Python dict's repr, JSON quoted in a JSON string), answered with a status or inside a
200's stream; the rest of the error text stays, so operators can still tell errors apart."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from proxy.server.assemble import assemble
from proxy.settings import Settings
from proxy.sinks.logs import AccessLog
from proxy.sinks.sink import Recorder
from proxy.sinks.tracing import Tracing
from tests.conftest import MODEL, relay_config
from tests.servers import ThreadedServer, request_body, serve

CHAT = "/v1/chat/completions"


async def echo_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every request with an error that quotes its body, in the shape its
    `x-echo` header names: `json` (a 401 whose message holds the body as sent), `repr`
    (the body as Python prints a dict), `text` (a plain-text 400 whose JSON body holds the
    message: the proxy reads it raw, escaped quotes and all), `stream` (a 200 stream whose
    error event quotes it, as vLLM sends an error after the 200)."""
    if scope["type"] != "http":
        return
    body = await request_body(receive)
    shape = dict(scope["headers"]).get(b"x-echo", b"json").decode()
    said = "bad field in " + (repr(orjson.loads(body)) if shape == "repr" else body.decode())
    error = {"message": said, "type": "BadRequestError", "code": 400}
    if shape == "stream":
        status, kind = 200, b"text/event-stream"
        first = {"id": "x", "object": "chat.completion.chunk", "model": MODEL, "choices": []}
        out = b"data: %s\n\ndata: %s\n\ndata: [DONE]\n\n" % (
            orjson.dumps(first),
            orjson.dumps({"error": error}),
        )
    elif shape == "text":
        status, kind = 400, b"text/plain"
        out = orjson.dumps({"detail": said})  # no message field: the body is the text
    else:
        status, kind = 401, b"application/json"
        out = orjson.dumps({"error": {**error, "type": "AuthenticationError", "code": 401}})
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]}
    )
    await send({"type": "http.response.body", "body": out})


class Observed:
    """A proxy with a JSON access log and a tracer that keeps its spans."""

    def __init__(self, upstream: str) -> None:
        self.log = io.StringIO()
        self.spans = InMemorySpanExporter()
        self.tracing = Tracing([SimpleSpanProcessor(self.spans)], upstream=upstream)
        self.recorder = Recorder()
        settings = Settings(
            upstream=upstream, model_allowlist=(MODEL,), models_refresh=None, access_log="off"
        )
        app = assemble(
            settings,
            {},
            registry=CollectorRegistry(),
            tracer=self.tracing,
            extra_sinks=[AccessLog("json", self.log), self.recorder],
        )
        self.server = ThreadedServer(app, server_header=False, date_header=False, **relay_config())
        self.server.start()

    def lines(self, n: int) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 30  # wide: a loaded 2-core machine
        while len(self.log.getvalue().splitlines()) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return [orjson.loads(line) for line in self.log.getvalue().splitlines()]


@pytest.fixture
def observed() -> Iterator[Observed]:
    with serve(echo_upstream, lifespan="off") as upstream:
        running = Observed(upstream.url)
        try:
            yield running
        finally:
            running.server.stop()
            running.tracing.shutdown()


@pytest.mark.parametrize("shape", ["json", "repr", "text", "stream"])
def test_secret_named_fields_an_upstream_echoes_reach_no_log_nor_span(
    observed: Observed, shape: str
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    bodies = [
        {"model": MODEL, "messages": messages, "api_key": "CANARYBODYKEY53"},
        {"model": MODEL, "messages": messages, "credentials": {"password": "CANARYPASS54"}},
        {"model": MODEL, "messages": messages, "credentials": {"user": "u", "pin": "CANARY55"}},
        {"model": MODEL, "messages": messages, "x-auth-token": "CANARYTOKEN56", "max_tokens": 7},
    ]
    with httpx.Client(timeout=30) as client:
        for body in bodies:
            stream = {"stream": True} if shape == "stream" else {}
            client.post(
                observed.server.url + CHAT, json={**body, **stream}, headers={"x-echo": shape}
            )
    lines = observed.lines(len(bodies))
    spans = observed.spans.get_finished_spans()
    assert len(lines) == len(spans) == len(bodies)
    errors = [line["error"] for line in lines]
    assert all("bad field in" in error and "[redacted]" in error for error in errors), errors
    # a count under a name with `token` in it stays (the text shape's quotes are escaped)
    assert re.search(r"""max_tokens\\?["']: ?7""", errors[3]), errors[3]
    assert [line["error_type"] for line in lines] == [
        {"json": "auth", "repr": "auth", "text": "bad_request", "stream": "bad_request"}[shape]
    ] * len(bodies)
    for span in spans:
        assert "bad field in" in (span.status.description or "")
    told = [*errors, *(span.to_json() for span in spans)]
    assert not [text for text in told if "CANARY" in text], told
