"""Defect 9 and the "Also" items: request headers reach the backend byte for byte, minus
hop-by-hop ones; proxy-made errors say something useful; the client-side request parser
(httptools behind proxy.server.protocol) survives fuzzed heads."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.errors import describe
from tests.edge_backend import RawBackend, backend, serving
from tests.server.conftest import no_proxy

CHAT_BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'


def exchange(base: str, head: bytes, body: bytes = b"", timeout: float = 10) -> bytes:
    port = urlsplit(base).port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        length = b"content-length: %d\r\n" % len(body)
        sock.sendall(head + b"\r\nhost: x\r\nconnection: close\r\n" + length + b"\r\n" + body)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


@pytest.fixture(scope="module", params=["aiohttp", "httpx"])
def edge(request: pytest.FixtureRequest, relay: str) -> Iterator[tuple[RawBackend, str]]:
    if relay == "wire" and request.param == "httpx":
        pytest.skip("--upstream-transport is the ASGI relay's: the wire has its own client")
    flags = ("--upstream-transport", request.param, "--first-byte-timeout", "3")
    with backend() as upstream, serving(upstream.url, *flags) as base:
        yield upstream, base


def test_expect_100_continue_is_answered_here_and_not_passed_on(
    edge: tuple[RawBackend, str],
) -> None:
    upstream, base = edge
    response = exchange(
        base, b"POST /v1/chat/completions HTTP/1.1\r\nexpect: 100-continue", CHAT_BODY
    )
    assert b"HTTP/1.1 200 OK" in response and b"Hello" in response
    assert upstream.seen[-1].header(b"expect") == []
    assert upstream.seen[-1].body.startswith(b'{"model":"m"')


def test_headers_named_in_connection_are_dropped(edge: tuple[RawBackend, str]) -> None:
    upstream, base = edge
    head = b"GET /v1/models HTTP/1.1\r\nconnection: x-hop, keep-alive\r\nx-hop: 1\r\nx-end: 2"
    assert exchange(base, head).startswith(b"HTTP/1.1 200 ")
    seen = upstream.seen[-1]
    assert seen.header(b"x-hop") == [] and seen.header(b"x-end") == [b"2"]


def test_non_ascii_and_non_utf8_header_values_reach_the_backend_byte_for_byte(
    edge: tuple[RawBackend, str],
) -> None:
    upstream, base = edge
    head = b"GET /v1/models HTTP/1.1\r\nx-name: caf\xc3\xa9\r\nx-bin: \xff\xfe\x80z"
    assert exchange(base, head).startswith(b"HTTP/1.1 200 ")
    seen = upstream.seen[-1]
    assert seen.header(b"x-name") == [b"caf\xc3\xa9"]
    assert seen.header(b"x-bin") == [b"\xff\xfe\x80z"]


def test_utf8_header_values_alone_also_arrive_unchanged(edge: tuple[RawBackend, str]) -> None:
    upstream, base = edge
    head = b"GET /v1/models HTTP/1.1\r\nx-name: caf\xc3\xa9 \xe2\x9c\x93"
    assert exchange(base, head).startswith(b"HTTP/1.1 200 ")
    assert upstream.seen[-1].header(b"x-name") == [b"caf\xc3\xa9 \xe2\x9c\x93"]


def test_no_content_type_is_added_to_a_request_without_one(
    edge: tuple[RawBackend, str],
) -> None:
    upstream, base = edge
    response = exchange(base, b"POST /v1/chat/completions HTTP/1.1", CHAT_BODY)
    assert response.startswith(b"HTTP/1.1 200 ")
    assert upstream.seen[-1].header(b"content-type") == []


def test_a_first_byte_timeout_says_what_timed_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    with (
        backend(responder=silent) as upstream,
        serving(upstream.url, "--first-byte-timeout", "0.5") as base,
    ):
        response = exchange(base, b"POST /v1/chat/completions HTTP/1.1", CHAT_BODY)
    assert response.startswith(b"HTTP/1.1 504 ")
    assert b"no response within 0.5 s (--first-byte-timeout)" in response
    assert b"TimeoutError: TimeoutError" not in response


@no_proxy
@pytest.mark.parametrize(
    "exc",
    [
        TimeoutError(),
        asyncio.CancelledError(),
        aiohttp.ServerDisconnectedError(),
        ConnectionResetError(),
        RuntimeError(),
    ],
)
def test_describe_never_repeats_the_class_name(exc: BaseException) -> None:
    text = describe(exc)
    name = type(exc).__name__
    assert text.count(name) == 1 and len(text) > len(name) + 4


# -- fuzzing the client-side request parser ----------------------------------------------

_TOKENS = st.sampled_from(
    [
        b"GET",
        b"POST",
        b" ",
        b"/v1/",
        b"%2e",
        b"..",
        b"?",
        b"\r\n",
        b"\n",
        b":",
        b"host: x",
        b"content-length: 5",
        b"transfer-encoding: chunked",
        b"expect: 100-continue",
        b"connection: close",
        b"HTTP/1.1",
        b"\x00",
        b"\xff",
        b"\t",
        b"0\r\n\r\n",
    ]
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_TOKENS, max_size=30).map(b"".join))
def test_fuzzed_request_heads_get_an_answer_or_a_close_never_a_crash(
    edge: tuple[RawBackend, str], head: bytes
) -> None:
    _, base = edge
    port = urlsplit(base).port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head + b"\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        try:
            answer = sock.recv(65536)
        except ConnectionResetError:
            answer = b""
    assert answer == b"" or answer.startswith(b"HTTP/1.1 ")
    # and the proxy still serves
    assert exchange(base, b"GET /v1/models HTTP/1.1").startswith(b"HTTP/1.1 200 ")
