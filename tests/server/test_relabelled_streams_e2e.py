"""A stream asked for and sent as SSE under `Content-Type: application/json`, as some
gateways do (vLLM 0.32 itself says `text/event-stream`: vllm/entrypoints/openai/
chat_completion/api_router.py, completion/api_router.py). The client gets it byte for
byte, and it is measured as the stream it is (proxy/core/observe.py, `_sniff`).

Only an event stream's label lets the proxy strip the usage chunk it asked for: its head
went to the client before the body's first byte said what it is. So the client of such a
stream gets that usage chunk; the proxy then stops asking that upstream for usage, counted
(`tokenprobe_measurement_failures_total{stage="usage_injection"}`) and said once, as for a
compressed stream (test_encoded_stream_injection.py). A JSON error answer to a stream
request stays the error record it was, and stops nothing.

The upstream is a raw socket writing vLLM 0.32's captured streams, one event a write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.core.measurement import ErrorType, TokenSource
from tests.conftest import MODEL, ProxyUnderTest
from tests.hostile.peers import Conn, RawUpstream, Request, by_target, raw_upstream
from tests.paths import FIXTURES

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FAILURES = "tokenprobe_measurement_failures_total"
TTFT_COUNT = "tokenprobe_time_to_first_token_seconds_count"
GAP = 0.02  # between two events
CAPTURES = FIXTURES / "streams" / "vllm-0.32"


def capture(endpoint: str, usage: bool) -> bytes:
    kind = "chat" if endpoint == CHAT else "completions"
    return (CAPTURES / f"{kind}_stream_{'include' if usage else 'no'}_usage.sse").read_bytes()


def asked_usage(request: Request) -> bool:
    options = orjson.loads(request.body).get("stream_options") or {}
    return bool(options.get("include_usage"))


def relabelled(endpoint: str, framing: str = "chunked", content_type: bytes = b"") -> Any:
    """Answers each request with vLLM's capture for what it asked (usage or not), labelled
    `application/json`, framed by chunks or by Content-Length, one event a write."""

    async def handle(conn: Conn, request: Request) -> None:
        body = capture(endpoint, asked_usage(request))
        events = [part + b"\n\n" for part in body.split(b"\n\n") if part]
        head = b"HTTP/1.1 200 OK\r\ncontent-type: %b\r\n" % (content_type or b"application/json")
        chunked = framing == "chunked"
        conn.write(
            head
            + (
                b"transfer-encoding: chunked\r\n"
                if chunked
                else b"content-length: %d\r\n" % len(body)
            )
            + b"\r\n"
        )
        for event in events:
            await asyncio.sleep(GAP)
            conn.write(b"%x\r\n%b\r\n" % (len(event), event) if chunked else event)
            await conn.drain()
        if chunked:
            conn.write(b"0\r\n\r\n")
            await conn.drain()

    return handle


def json_error(conn: Conn, request: Request) -> Any:
    """vLLM 0.32's ErrorResponse (vllm/entrypoints/serve/engine/protocol.py)."""
    body = orjson.dumps({"error": {"message": "busy", "type": "BadRequestError",
                                   "param": None, "code": 400}})  # fmt: skip
    conn.write(
        b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )
    return conn.drain()


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


def stream_body(endpoint: str, usage: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": 8}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if endpoint == CHAT
                else {"prompt": "hi"})  # fmt: skip
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def post(proxy: ProxyUnderTest, endpoint: str, usage: bool) -> httpx.Response:
    return httpx.post(proxy.url + endpoint, json=stream_body(endpoint, usage), timeout=30)


@pytest.mark.parametrize("framing", ["chunked", "length"])
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_a_stream_labelled_json_is_relayed_whole_and_measured_as_a_stream(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest], endpoint: str, framing: str
) -> None:
    upstream.default = by_target({endpoint.encode(): relabelled(endpoint, framing)})
    proxy = start_proxy(upstream.url)
    reply = post(proxy, endpoint, usage=True)  # asked by the client: nothing to strip
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert reply.content == capture(endpoint, usage=True)
    (m,) = proxy.wait_records(1, exact=True)
    usage = orjson.loads(capture(endpoint, True).split(b"\n\n")[-3][6:])["usage"]
    assert (m.stream, m.error_type, m.malformed_events) == (True, None, 0)
    assert m.token_source is TokenSource.USAGE
    assert (m.prompt_tokens, m.output_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert m.finish_reason == "length"  # the captures ran into max_tokens
    # the head and the first events may share a read on a loaded machine: bounds, no gaps
    assert m.ttfb is not None and m.ttft is not None and m.ttfb <= m.ttft <= m.e2e
    labels = {"model": MODEL, "endpoint": endpoint}
    assert proxy.sample(TTFT_COUNT, **labels) == 1
    assert proxy.sample("tokenprobe_malformed_events_total", **labels) == 0
    assert proxy.sample(FAILURES, stage="usage_injection") == 0


def test_its_usage_chunk_asked_for_reaches_the_client_once_then_asking_stops(
    upstream: RawUpstream,
    start_proxy: Callable[..., ProxyUnderTest],
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream.default = by_target({CHAT.encode(): relabelled(CHAT)})
    proxy = start_proxy(upstream.url)
    with caplog.at_level(logging.WARNING, logger="tokenprobe"):
        first, second = post(proxy, CHAT, usage=False), post(proxy, CHAT, usage=False)
    assert first.content == capture(CHAT, usage=True)  # passed whole, usage chunk and all
    assert second.content == capture(CHAT, usage=False)  # not asked: the client's own stream
    posts = [r for r in upstream.requests if r.target == CHAT.encode()]
    assert [asked_usage(r) for r in posts] == [True, False]
    records = proxy.wait_records(2, exact=True)
    assert records[0].token_source is TokenSource.USAGE and records[0].ttft is not None
    assert records[1].ttft is not None and records[1].stream  # measured, without usage
    assert proxy.sample(FAILURES, stage="usage_injection") == 1
    said = [r.message for r in caplog.records if "no longer asks" in r.message]
    assert len(said) == 1 and "application/json" in said[0]


def test_a_json_error_to_a_stream_request_is_an_error_record_and_stops_nothing(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    calls: list[int] = []

    async def first_an_error(conn: Conn, request: Request) -> None:
        calls.append(1)
        if len(calls) == 1:
            await json_error(conn, request)
        else:
            await relabelled(CHAT, content_type=b"text/event-stream")(conn, request)

    upstream.default = by_target({CHAT.encode(): first_an_error})
    proxy = start_proxy(upstream.url)
    error, plain = post(proxy, CHAT, usage=False), post(proxy, CHAT, usage=False)
    assert error.status_code == 400 and error.json()["error"]["message"] == "busy"
    assert b'"usage"' not in plain.content and plain.content.endswith(b"data: [DONE]\n\n")
    m, _ = proxy.wait_records(2, exact=True)
    assert (m.error_type, m.error_message, m.stream, m.ttft) == (
        ErrorType.BAD_REQUEST, "busy", False, None)  # fmt: skip
    posts = [r for r in upstream.requests if r.target == CHAT.encode()]
    assert [asked_usage(r) for r in posts] == [True, True]
    assert proxy.sample(FAILURES, stage="usage_injection") == 0
