"""HTTP/1.1 as clients speak it, through both data paths: HTTP/1.0 clients, pipelining,
HEAD, chunked request bodies, `Expect: 100-continue`, interim (1xx) responses and
trailers from the upstream, and a non-WebSocket Upgrade relayed as plain HTTP.

Raw sockets on the client side (no HTTP library to smooth over what the proxy wrote);
the simulator, or the raw backend where the upstream must misbehave on purpose.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.edge_backend import backend

CHAT = b"/v1/chat/completions"
STREAM = b'{"model":"%s","stream":true,"messages":[{"role":"user","content":"hi"}]}' % (
    MODEL.encode()
)
WHOLE = STREAM.replace(b'"stream":true', b'"stream":false')


def connect(url: str) -> socket.socket:
    port = int(url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the proxy closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def read_response(sock: socket.socket, buffered: bytearray) -> tuple[bytes, bytes]:
    """One response (head, de-framed body) off a keep-alive connection."""
    while b"\r\n\r\n" not in buffered:
        buffered += sock.recv(65536)
    head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
    buffered[:] = rest
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        body = b""
        while True:
            while b"\r\n" not in buffered:
                buffered += sock.recv(65536)
            size_line, _, _ = bytes(buffered).partition(b"\r\n")
            size = int(size_line, 16)
            need = len(size_line) + 2 + size + 2
            while len(buffered) < need:
                buffered += sock.recv(65536)
            body += bytes(buffered[len(size_line) + 2 : len(size_line) + 2 + size])
            del buffered[:need]
            if size == 0:
                return head, body
    length = 0
    for line in lower.split(b"\r\n")[1:]:
        if line.startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    if head.startswith(b"HTTP/1.1 1") or b"head " in lower[:0]:
        length = 0
    while len(buffered) < length:
        buffered += sock.recv(65536)
    body = bytes(buffered[:length])
    del buffered[:length]
    return head, body


def post(path: bytes, body: bytes, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/%s\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s\r\n%s" % (path, version, len(body), extra, body)
    )


def test_an_http_1_0_client_gets_the_whole_stream_and_the_connection_closes(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    with connect(proxy.url) as sock:
        sock.sendall(post(CHAT, STREAM, version=b"1.0"))
        response = read_all(sock)  # returns only once the proxy closed the connection
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"data: [DONE]" in body and body.count(b'"finish_reason":"stop"') == 1
    assert proxy.wait_records(1)[0].ok


def test_pipelined_requests_are_answered_in_order_on_one_connection(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    models = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
    with connect(proxy.url) as sock:
        sock.sendall(post(CHAT, WHOLE) + models + post(CHAT, STREAM))
        buffered = bytearray()
        first, second, third = (read_response(sock, buffered) for _ in range(3))
    assert first[0].startswith(b"HTTP/1.1 200 ") and b'"chat.completion"' in first[1]
    assert second[0].startswith(b"HTTP/1.1 200 ") and b'"object":"list"' in second[1]
    assert third[0].startswith(b"HTTP/1.1 200 ") and third[1].endswith(b"data: [DONE]\n\n")
    records = proxy.wait_records(2, exact=True)
    assert [r.stream for r in records] == [False, True]


def test_head_gets_the_head_only_and_the_connection_stays_usable(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    with connect(proxy.url) as sock:
        sock.sendall(b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        buffered = bytearray()
        while b"\r\n\r\n" not in buffered:
            buffered += sock.recv(65536)
        head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 ") and rest == b""
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        after = read_response(sock, bytearray())
    assert after[0].startswith(b"HTTP/1.1 200 ") and b'"object":"list"' in after[1]


def test_a_chunked_request_body_goes_upstream_whole(sim: Running, proxy: ProxyUnderTest) -> None:
    half = len(STREAM) // 2
    chunks = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        half,
        STREAM[:half],
        len(STREAM) - half,
        STREAM[half:],
    )
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + chunks
    )
    with connect(proxy.url) as sock:
        sock.sendall(request)
        head, body = read_response(sock, bytearray())
    assert head.startswith(b"HTTP/1.1 200 ") and body.endswith(b"data: [DONE]\n\n")
    record = proxy.wait_records(1)[0]
    assert record.ok and record.model == MODEL and record.stream


def test_expect_100_continue_gets_a_100_before_the_body_is_sent(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    head = post(CHAT, STREAM, extra=b"expect: 100-continue\r\n")[: -len(STREAM)]
    with connect(proxy.url) as sock:
        sock.sendall(head)
        interim = sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(STREAM)
        final, body = read_response(
            sock, bytearray(interim[len(b"HTTP/1.1 100 Continue\r\n\r\n") :])
        )
    assert final.startswith(b"HTTP/1.1 200 ") and body.endswith(b"data: [DONE]\n\n")


def test_an_http_1_0_clients_expect_100_continue_gets_no_interim_response(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    # RFC 9110 §10.1.1: a server MUST ignore a 100-continue expectation in an HTTP/1.0
    # request, and §15.2: it sends no 1xx to an HTTP/1.0 client (nginx and h11 ignore it).
    head = post(CHAT, STREAM, version=b"1.0", extra=b"expect: 100-continue\r\n")
    with connect(proxy.url) as sock:
        sock.sendall(head[: -len(STREAM)])
        sock.settimeout(0.5)
        try:
            early = sock.recv(65536)  # what the proxy sends before the body
        except TimeoutError:
            early = b""
        sock.settimeout(10)
        sock.sendall(STREAM)
        response = early + read_all(sock)
    assert b" 100 " not in response.split(b"\r\n", 1)[0], response[:80]
    assert response.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in response
    assert proxy.wait_records(1)[0].ok


def test_interim_responses_and_trailers_from_the_upstream_are_not_relayed(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    events = (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\ndata: [DONE]\n\n'
    )

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n"
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\ntrailer: x-done\r\n\r\n"
            b"%x\r\n%s\r\n0\r\nx-done: yes\r\n\r\n" % (len(events), events)
        )
        await writer.drain()
        await asyncio.sleep(5)

    with backend(responder=answer) as upstream:
        proxy = start_proxy(upstream.url, model_allowlist=("m",), inject_usage=False)
        with connect(proxy.url) as sock:
            sock.sendall(post(CHAT, STREAM.replace(MODEL.encode(), b"m")))
            head, body = read_response(sock, bytearray())
    assert head.startswith(b"HTTP/1.1 200 ") and b"103" not in head and b"link:" not in head
    assert body == events and b"x-done" not in head
    assert proxy.wait_records(1)[0].ok


def test_an_h2c_upgrade_is_relayed_as_plain_http(sim: Running, proxy: ProxyUnderTest) -> None:
    request = (
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: upgrade, http2-settings\r\n"
        b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
    )
    with connect(proxy.url) as sock:
        sock.sendall(request)
        head, body = read_response(sock, bytearray())
    assert head.startswith(b"HTTP/1.1 200 ") and b'"object":"list"' in body
    assert sim.app.state  # the simulator answered a plain GET
    assert b"upgrade" not in head.lower().split(b"\r\n", 1)[1]
