"""An upstream that compresses its stream though the proxy asked it for `Accept-Encoding:
identity`: the proxy cannot strip the usage chunk it asked for out of a compressed body,
so that client gets it; the proxy then stops asking that upstream for usage, so it
happens once (proxy/core/strip.py Injection.encoded, proxy/server/rules.py response_head).
A compressed answer that is no stream (an error's JSON, as nginx's gzip_types compresses)
leaks nothing and stops nothing.
"""

from __future__ import annotations

import gzip
import json
import logging
import socket
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.conftest import MODEL, ProxyUnderTest
from tests.servers import accept_each, read_request

CHAT = "/v1/chat/completions"
STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
FAILURES = "tokenprobe_measurement_failures_total"


def sse(asked: bool) -> bytes:
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    events = [
        {**base, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    if asked:
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        events.append({**base, "choices": [], "usage": usage})
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + b"data: [DONE]\n\n"


def gzipped(status: bytes, content_type: bytes, body: bytes) -> bytes:
    coded = gzip.compress(body, mtime=0)
    return (
        b"HTTP/1.1 %b\r\ncontent-type: %b\r\ncontent-encoding: gzip\r\n"
        b"content-length: %d\r\n\r\n%b" % (status, content_type, len(coded), coded)
    )


def gzipped_stream(asked: bool) -> bytes:
    return gzipped(b"200 OK", b"text/event-stream", sse(asked))


def plain_stream(asked: bool) -> bytes:
    body = sse(asked)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
    return head % len(body) + body


def gzipped_error(asked: bool) -> bytes:
    error = {"error": {"message": "busy", "type": "BadRequestError", "code": 400}}
    return gzipped(b"400 Bad Request", b"application/json", json.dumps(error).encode())


class Compressing:
    """A raw-socket backend that answers each request, in turn, with the next of
    `answers` (each given whether that request asked for usage), on kept-alive
    connections; `asked` keeps whether each request asked."""

    def __init__(self, *answers: Callable[[bool], bytes]) -> None:
        self.answers = list(answers)
        self.asked: list[bool] = []
        self.listener = accept_each(self._serve, 8)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            received = b""
            while (request := read_request(conn, received)) is not None:
                _, body, received = request
                options = json.loads(body).get("stream_options") or {}
                asked = bool(options.get("include_usage"))
                self.asked.append(asked)
                conn.sendall(self.answers[len(self.asked) - 1](asked))


@pytest.fixture
def compressing() -> Iterator[Callable[..., Compressing]]:
    made: list[Compressing] = []

    def make(*answers: Callable[[bool], bytes]) -> Compressing:
        made.append(Compressing(*answers))
        return made[-1]

    yield make
    for each in made:
        each.listener.close()


def streamed(proxy: ProxyUnderTest) -> httpx.Response:
    """A stream that asks for no usage, its body decoded as its client decodes it."""
    return httpx.post(proxy.url + CHAT, json=STREAM, timeout=30)


def test_a_compressed_stream_stops_usage_injection_so_it_leaks_once(
    compressing: Callable[..., Compressing],
    start_proxy: Callable[..., ProxyUnderTest],
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = compressing(gzipped_stream, gzipped_stream, gzipped_stream)
    proxy = start_proxy(backend.url)
    with caplog.at_level(logging.WARNING, logger="tokenprobe"):
        first, second, third = streamed(proxy), streamed(proxy), streamed(proxy)
    assert first.headers["content-encoding"] == "gzip"  # relayed as it came
    assert b'"usage"' in first.content  # the one leak: it could not be stripped
    assert b'"usage"' not in second.content and b'"usage"' not in third.content
    assert backend.asked == [True, False, False]
    proxy.wait_records(3, exact=True)
    assert proxy.sample(FAILURES, stage="encoded") == 3  # each stream went unread
    assert proxy.sample(FAILURES, stage="usage_injection") == 1  # asking stopped once
    said = [r.message for r in caplog.records if "no longer asks" in r.message]
    assert len(said) == 1 and "compressed" in said[0]


def test_a_compressed_error_answer_keeps_usage_injection(
    compressing: Callable[..., Compressing], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    backend = compressing(gzipped_error, plain_stream)
    proxy = start_proxy(backend.url)
    assert streamed(proxy).status_code == 400
    assert b'"usage"' not in streamed(proxy).content  # asked, and stripped
    assert backend.asked == [True, True]  # an error's compressed JSON leaked nothing
    second = proxy.wait_records(2, exact=True)[1]
    assert second.output_tokens == 1  # from the usage asked for
    assert proxy.sample(FAILURES, stage="usage_injection") == 0
