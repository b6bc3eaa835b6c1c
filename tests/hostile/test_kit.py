"""The kit itself: the raw upstream records exact bytes, the byte relay passes them, and a
request through the proxy reaches the upstream parsed and normalised (the proxy rewrites
the head, the relay does not), so a test can tell the two apart."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from tests.hostile.client import whole
from tests.hostile.peers import RawUpstream, byte_relay, exchange

REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Odd:  spaced \r\n\r\n"


def test_the_byte_relay_passes_exact_bytes(upstream: RawUpstream) -> None:
    with byte_relay(upstream.url) as base:
        got = exchange(base, REQUEST, idle=0.5, done=whole())
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert upstream.all_received() == REQUEST


def test_the_proxy_forwards_a_parsed_request(
    upstream: RawUpstream, proxy: Callable[..., AbstractContextManager[str]]
) -> None:
    with proxy(upstream.url) as base:
        got = exchange(base, REQUEST, idle=0.5, done=whole())
    assert got.startswith(b"HTTP/1.1 200")
    assert b'{"ok":true}' in got
    (seen,) = [r for r in upstream.requests if r.target == b"/v1/models"]
    assert seen.head != REQUEST[:-4]  # the proxy wrote its own head upstream
