"""Framing defences that already held when issue 32's probe ran, pinned on both data paths:
each ambiguous or oversized request is refused by the proxy, and not a byte of it
reaches the upstream."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hostile.client import received_bytes, served, whole
from tests.hostile.peers import RawUpstream, exchange

POST = b"POST /v1/files HTTP/1.1\r\nHost: x\r\n"

CASES = {
    "CL and TE": POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /",
    "TE not last chunked": POST + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    "TE with a space before the colon": POST + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "TE xchunked": POST + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    # a coding before chunked: llhttp decodes the chunks, and the body would go upstream
    # still gzip-coded with nothing to say so (RFC 9112 §6.1; nginx and h11 refuse it)
    "TE gzip, chunked": POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "TE gzip, then a TE chunked": POST
    + b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "two Content-Lengths": POST + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    "bare LF": b"GET /v1/models HTTP/1.1\nHost: x\n\n",
    "obs-fold": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\n\r\n",
    "control byte": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n",
    "NUL in the target": b"GET /v1/mo\x00dels HTTP/1.1\r\nHost: x\r\n\r\n",
    "oversized head": b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: "
    + b"a" * 200_000
    + b"\r\n\r\n",
}


@pytest.fixture(scope="module", params=["wire", "asgi"])
def shared(request: pytest.FixtureRequest) -> Iterator[tuple[RawUpstream, str]]:
    with served(request.param) as pair:
        yield pair


@pytest.mark.parametrize("data", list(CASES.values()), ids=list(CASES))
def test_an_ambiguous_request_is_refused_before_the_upstream(
    shared: tuple[RawUpstream, str], data: bytes
) -> None:
    upstream, base = shared
    before = received_bytes(upstream)
    got = exchange(base, data, idle=1.0)
    assert got.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), got[:200]
    assert received_bytes(upstream) == before


HOSTS = {
    "no Host in HTTP/1.1": b"GET /v1/models HTTP/1.1\r\n\r\n",
    "two Hosts": b"GET /v1/models HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n",
    "a path in the Host": b"GET /v1/models HTTP/1.1\r\nHost: evil.example/steal?\r\n\r\n",
    "a space in the Host": b"GET /v1/models HTTP/1.1\r\nHost: a b\r\n\r\n",
    "a letter in the port": b"GET /v1/models HTTP/1.1\r\nHost: a.example:80x\r\n\r\n",
    "the proxy's own route too": b"GET /metrics HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n",
}


@pytest.mark.parametrize("data", list(HOSTS.values()), ids=list(HOSTS))
def test_a_request_without_one_valid_host_is_a_400_and_the_connection_closes(
    shared: tuple[RawUpstream, str], data: bytes
) -> None:
    """RFC 9112 §3.2: a server MUST answer 400 to an HTTP/1.1 request with no Host, and to
    any request with more than one Host or an invalid value (nginx and h11 refuse them)."""
    upstream, base = shared
    before = received_bytes(upstream)
    got = exchange(base, data + b"GET /v1/next HTTP/1.1\r\nHost: x\r\n\r\n", idle=1.0)
    assert got.startswith(b"HTTP/1.1 400") and b"Host header" in got, got[:300]
    assert b"HTTP/1.1 200" not in got, got  # closed: the request behind it is not read
    assert received_bytes(upstream) == before


VALID = {
    "a name and port": b"Host: llm.example.com:8443",
    "an IPv6 literal": b"Host: [::1]:4000",
    "an IPv4 address": b"Host: 127.0.0.1",
    "empty (no authority)": b"Host: ",
}


@pytest.mark.parametrize("host", list(VALID.values()), ids=list(VALID))
def test_a_valid_host_reaches_the_upstream(shared: tuple[RawUpstream, str], host: bytes) -> None:
    upstream, base = shared
    before = received_bytes(upstream)
    got = exchange(base, b"GET /v1/models HTTP/1.1\r\n" + host + b"\r\n\r\n", done=whole())
    assert got.startswith(b"HTTP/1.1 200"), got[:300]
    assert received_bytes(upstream) > before


def test_an_http_1_0_request_needs_no_host(shared: tuple[RawUpstream, str]) -> None:
    upstream, base = shared
    before = received_bytes(upstream)
    got = exchange(base, b"GET /v1/models HTTP/1.0\r\n\r\n", idle=1.0)
    assert got.startswith(b"HTTP/1.1 200"), got[:300]
    assert received_bytes(upstream) > before
