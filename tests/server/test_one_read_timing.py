"""Tokens that all arrive in one network read span no time, on every path: no TPOT, no
decode speed, and gaps of 0 between them (docs/measured.md), however many HTTP chunks
framed them. httpx's h11 hands on one piece per chunk, which the relay timed apart, a few
microseconds each: a TPOT of 0.06 ms and 16,000 tokens/s for a stream that came whole.
The httpx transport's chunked reader hands on one read's data as one piece
(proxy/server/upstream.py `_CheckedChunkedReader`), as aiohttp's `readany` and the wire do.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import h11
import httpx
import pytest
from h11._receivebuffer import ReceiveBuffer

from proxy.server.upstream import _CheckedChunkedReader
from tests.conftest import MODEL, ProxyUnderTest
from tests.server.conftest import no_proxy, paths
from tests.servers import accept_each, read_request

CHAT = "/v1/chat/completions"
TOKENS = 5


def events() -> list[bytes]:
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    chunks: list[dict[str, Any]] = [
        {**base, "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
        for i in range(TOKENS)
    ]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    usage = {"prompt_tokens": 3, "completion_tokens": TOKENS, "total_tokens": 3 + TOKENS}
    chunks.append({**base, "choices": [], "usage": usage})
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


#: The whole answer, an HTTP chunk per event, written at once: one read at the proxy.
ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events())
    + b"0\r\n\r\n"
)


def _answer_whole(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(30)
        request = read_request(conn)
        assert request is not None
        conn.sendall(ANSWER)  # one write
        while conn.recv(65536):  # until the proxy is done with the connection
            pass


@pytest.fixture
def whole_at_once() -> Iterator[str]:
    listener = accept_each(_answer_whole, 8)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def one_read(start_proxy: Callable[..., ProxyUnderTest], upstream: str, **settings: Any) -> None:
    proxy = start_proxy(upstream, **settings)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(proxy.url + CHAT, json=body, timeout=30)
    assert response.content == b"".join(events())
    (record,) = proxy.wait_records(1, exact=True)
    assert record.ok and record.output_tokens == TOKENS
    assert record.tpot is None and record.decode_tokens_per_second is None
    assert record.inter_token_latencies == (0.0,) * (TOKENS - 1)


def test_tokens_in_one_read_give_no_tpot(
    start_proxy: Callable[..., ProxyUnderTest], whole_at_once: str
) -> None:
    one_read(start_proxy, whole_at_once)


@paths("asgi", why="the ASGI relay's httpx transport; the two paths run above")
def test_tokens_in_one_read_give_no_tpot_on_httpx(
    start_proxy: Callable[..., ProxyUnderTest], whole_at_once: str
) -> None:
    one_read(start_proxy, whole_at_once, upstream_transport="httpx")


# -- the reader itself, sans I/O -----------------------------------------------------------


def read_all(data: bytes) -> tuple[list[h11.Data | h11.EndOfMessage | None], list[str]]:
    """The events the reader gives for one read's bytes, until it needs more or fails."""
    counted: list[str] = []
    reader = _CheckedChunkedReader(counted.append)
    buf = ReceiveBuffer()
    buf += data
    got: list[h11.Data | h11.EndOfMessage | None] = []
    while (event := reader(buf)) is not None:
        got.append(event)
        if isinstance(event, h11.EndOfMessage):
            break
    return got, counted


@no_proxy
def test_one_reads_chunks_come_as_one_piece_then_the_end() -> None:
    got, _ = read_all(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    assert [type(e) for e in got] == [h11.Data, h11.EndOfMessage]
    data = got[0]
    assert isinstance(data, h11.Data) and bytes(data.data) == b"hello world"
    assert data.chunk_start and data.chunk_end


@no_proxy
def test_a_chunk_cut_by_the_read_gives_what_came_of_it() -> None:
    got, _ = read_all(b"5\r\nhello\r\n6\r\n wo")
    assert len(got) == 1 and isinstance(got[0], h11.Data)
    assert bytes(got[0].data) == b"hello wo" and not got[0].chunk_end


@no_proxy
def test_a_framing_fault_after_data_comes_after_that_data() -> None:
    counted: list[str] = []
    reader = _CheckedChunkedReader(counted.append)
    buf = ReceiveBuffer()
    buf += b"5\r\nhello\r\n2\nok\n"  # the second size line ends with a bare LF
    first = reader(buf)
    assert isinstance(first, h11.Data) and bytes(first.data) == b"hello"
    with pytest.raises(h11.ProtocolError, match="bare LF"):
        reader(buf)
    assert counted == ["malformed"]
