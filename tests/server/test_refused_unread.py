"""A request the proxy answers before it has read its body: what its record and its
access-log line can say of it (nothing the body held), on both data paths."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from proxy.sinks.logs import AccessLog
from tests.conftest import MODEL, ProxyUnderTest, Running

CHAT = "/v1/chat/completions"
LIMIT = 1000


def streaming_body() -> bytes:
    """A chat request that asks for a stream, over LIMIT bytes."""
    messages = [{"role": "user", "content": "x" * (2 * LIMIT)}]
    return orjson.dumps({"model": MODEL, "stream": True, "messages": messages})


def in_pieces(body: bytes) -> Iterator[bytes]:
    """The body with no Content-Length (httpx sends a generator chunked): the proxy finds
    it too large only once LIMIT bytes of it are in."""
    for at in range(0, len(body), 256):
        yield body[at : at + 256]


def log_lines(log: io.StringIO, n: int, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(lines := log.getvalue().splitlines()) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return lines


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_stream_request_refused_before_its_body_was_read_is_not_logged_as_no_stream(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest], framing: str
) -> None:
    """Refused 413 at its head (its Content-Length over --max-body-bytes) or as its body
    passed the limit, the request's `"stream": true` was never read: the record's
    stream_requested is None and the log's `stream` null, not false."""
    log = io.StringIO()
    proxy = start_proxy(sim.url, max_body_bytes=LIMIT, sinks=[AccessLog("json", log)])
    body = streaming_body()
    content = body if framing == "content-length" else in_pieces(body)
    headers = {"content-type": "application/json"}
    reply = httpx.post(proxy.url + CHAT, content=content, headers=headers)
    assert reply.status_code == 413
    (record,) = proxy.wait_records(1)
    assert (record.status_code, record.stream_requested) == (413, None)
    (line,) = log_lines(log, 1)
    logged = orjson.loads(line)
    assert (logged["status"], logged["stream"]) == (413, None)


def test_a_stream_request_read_whole_is_still_logged_as_a_stream(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """The other side of the same line: a body the proxy read says what it asked for."""
    log = io.StringIO()
    proxy = start_proxy(sim.url, sinks=[AccessLog("json", log)])
    reply = httpx.post(proxy.url + CHAT, content=streaming_body())
    assert reply.status_code == 200
    (record,) = proxy.wait_records(1)
    assert record.stream_requested is True
    (line,) = log_lines(log, 1)
    assert orjson.loads(line)["stream"] is True
