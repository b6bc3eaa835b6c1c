"""Defects 2 and 3: the request head is capped and timed while it arrives (proxy.server.protocol)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import ProxyUnderTest, Running
from tests.edge_backend import RawBackend, backend, metric, serving

#: Well above the header timeout (0.5 s), as a load balancer's pooled connections need.
KEEP_ALIVE = 3.0


@pytest.fixture(scope="module")
def edge(relay: str) -> Iterator[tuple[RawBackend, str]]:
    flags = (
        "--header-timeout",
        "0.5",
        "--keep-alive-timeout",
        str(KEEP_ALIVE),
        "--max-headers",
        "50",
    )
    with backend() as upstream, serving(upstream.url, *flags) as base:
        yield upstream, base


def connect(base: str) -> socket.socket:
    port = urlsplit(base).port
    assert port is not None
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def test_a_huge_header_value_is_refused_with_431_while_it_is_still_arriving(
    edge: tuple[RawBackend, str],
) -> None:
    upstream, base = edge
    count = len(upstream.seen)
    before = metric(base, "tokenprobe_connections_closed_total", reason="headers_too_large")
    with connect(base) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ")
        try:  # far more than the cap, and no end of line: the head never completes
            for _ in range(4):
                sock.sendall(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = read_all(sock)  # the proxy answers without waiting for the rest
    assert response.startswith(b"HTTP/1.1 431 ")
    assert b"request headers over 65536 bytes" in response
    assert len(upstream.seen) == count
    after = metric(base, "tokenprobe_connections_closed_total", reason="headers_too_large")
    assert after == before + 1


def test_a_large_body_in_the_same_read_as_the_head_is_not_taken_for_a_large_head(
    edge: tuple[RawBackend, str],
) -> None:
    # A client writes head and body at once; a loopback read then carries the head and
    # far more than the head cap of body. Only the head counts against the cap.
    upstream, base = edge
    body = b"x" * (8 * 1024 * 1024)
    head = b"POST /upload HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
    with connect(base) as sock:
        sock.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        response = read_all(sock)
    assert response.startswith(b"HTTP/1.1 200 "), response[:200]
    assert upstream.seen[-1].body == body


def test_too_many_headers_get_431(edge: tuple[RawBackend, str]) -> None:
    upstream, base = edge
    count = len(upstream.seen)
    headers = b"".join(b"x-h%d: v\r\n" % i for i in range(51))
    with connect(base) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n")
        response = read_all(sock)
    assert response.startswith(b"HTTP/1.1 431 ") and b"over 50 request headers" in response
    assert len(upstream.seen) == count


def test_fifty_headers_are_still_fine(edge: tuple[RawBackend, str]) -> None:
    _, base = edge
    headers = b"".join(b"x-h%d: v\r\n" % i for i in range(48))
    with connect(base) as sock:
        sock.sendall(
            b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + headers + b"\r\n"
        )
        assert read_all(sock).startswith(b"HTTP/1.1 200 ")


def test_a_silent_connection_is_closed_after_the_header_timeout(
    edge: tuple[RawBackend, str],
) -> None:
    _, base = edge
    before = metric(base, "tokenprobe_connections_closed_total", reason="header_timeout")
    started = time.monotonic()
    with connect(base) as sock:
        assert read_all(sock) == b""  # closed, not answered: nothing was asked
    assert 0.4 < time.monotonic() - started < 3
    after = metric(base, "tokenprobe_connections_closed_total", reason="header_timeout")
    assert after == before + 1


def test_a_slowloris_head_gets_408_at_the_header_timeout(edge: tuple[RawBackend, str]) -> None:
    _, base = edge
    started = time.monotonic()
    with connect(base) as sock:
        response = trickled_head(sock)
    assert response.startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - started < 3


def trickled_head(sock: socket.socket) -> bytes:
    """A request head sent a byte every 0.1 s, never complete: what the proxy answered
    before it closed the connection."""
    sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
    try:
        for _ in range(50):
            sock.sendall(b"x")
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return read_all(sock)


def answered(sock: socket.socket) -> bytes:
    """The head of the response to a GET /v1/models sent on `sock`, its body read whole;
    b"" when the connection was closed instead."""
    try:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            if not (more := sock.recv(65536)):
                return b""
            data += more
    except (BrokenPipeError, ConnectionResetError):
        return b""
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int({k.lower(): v for k, v in fields.items()}[b"content-length"])
    while len(body) < length and (more := sock.recv(65536)):
        body += more
    return head


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(
    edge: tuple[RawBackend, str],
) -> None:
    """Not after the header timeout: a load balancer that pools connections to the proxy
    needs them open longer than its own idle timeout (--keep-alive-timeout)."""
    _, base = edge
    before = metric(base, "tokenprobe_connections_closed_total", reason="header_timeout")
    with connect(base) as sock:
        assert answered(sock).startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        rest = read_all(sock)
    waited = time.monotonic() - started
    assert b"HTTP/1.1" not in rest  # closed without a second answer
    assert KEEP_ALIVE - 0.3 < waited < KEEP_ALIVE + 3, waited
    # An ordinary end, no refusal.
    after = metric(base, "tokenprobe_connections_closed_total", reason="header_timeout")
    assert after == before


def test_a_kept_alive_connection_idle_past_the_header_timeout_takes_its_next_request(
    edge: tuple[RawBackend, str],
) -> None:
    _, base = edge
    with connect(base) as sock:
        assert answered(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(1.2)  # over twice the header timeout, well within the keep-alive
        assert answered(sock).startswith(b"HTTP/1.1 200 ")


def test_a_kept_alive_connections_slow_next_head_gets_408_from_its_first_byte(
    edge: tuple[RawBackend, str],
) -> None:
    _, base = edge
    with connect(base) as sock:
        assert answered(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(0.8)  # idle: the header timeout has not begun
        started = time.monotonic()
        response = trickled_head(sock)
    assert response.startswith(b"HTTP/1.1 408 ")
    assert 0.4 < time.monotonic() - started < 3


def test_two_servers_in_one_process_keep_their_own_head_limits(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """Issue 31: the limits are each server's, handed to its connections by its app's
    lifespan (uvicorn's app_state), not a class attribute the last server set for all."""
    strict = start_proxy(sim.url, max_headers=5)
    lenient = start_proxy(sim.url, max_headers=50)
    headers = {f"x-extra-{i}": "v" for i in range(10)}
    assert httpx.get(strict.url + "/v1/models", headers=headers).status_code == 431
    assert httpx.get(lenient.url + "/v1/models", headers=headers).status_code == 200
    closed = "tokenprobe_connections_closed_total"
    assert strict.sample(closed, reason="too_many_headers") == 1
    assert lenient.sample(closed, reason="too_many_headers") == 0
