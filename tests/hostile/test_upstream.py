"""A misbehaving upstream: no response, or part of one, ever reaches a request that did not
ask for it, and each misbehaviour is counted (issue 32, defect 1 and the 101 case).

Each test runs on both data paths (conftest.py), in a real `tokenprobe serve` in front of a
`RawUpstream` whose handlers misbehave on one request target and answer `second` on any
other, so a request that ends up on a fresh connection gets `second` and one that reuses a
dirty connection gets something else. Shown able to fail: each was run against the tree
before the fix (see docs/hostile-peers.md), and `test_through_a_byte_relay_*` runs the
first one through a plain byte relay, where it fails as it must.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
import zlib
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager

import httpx
import pytest

from proxy.sim import SimConfig, create_sim_app
from tests.edge_backend import serving_process
from tests.hostile.client import header_names, responses, whole
from tests.hostile.peers import (
    Conn,
    RawUpstream,
    Request,
    answer_each,
    by_target,
    byte_relay,
    exchange,
    get,
    ok,
    raw_upstream,
    read_response,
)
from tests.hostile.shared import counted, until
from tests.paths import ROOT
from tests.servers import ThreadedServer, stop

Proxy = Callable[..., AbstractContextManager[str]]
ERRORS = "tokenprobe_upstream_protocol_errors_total"
REQUESTS = "tokenprobe_requests_total"
PASSTHROUGH = "tokenprobe_passthrough_requests_total"
FIRST = ok(b"first")
SECOND = ok(b"second")
EXTRA = ok(b"EXTRA")  # what no request asked for


TLS_CERT = str(ROOT / "tests" / "fixtures" / "tls" / "test-only.crt")
TLS_KEY = str(ROOT / "tests" / "fixtures" / "tls" / "test-only.key")


def ask(base: str, target: bytes, timeout: float = 10.0) -> tuple[bytes, float]:
    """One request on a new connection: its whole response and the seconds it took."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(get(target))
        try:
            got = read_response(sock, timeout)
        except TimeoutError:
            got = b""
    return got, time.monotonic() - start


def body(response: bytes) -> bytes:
    return response.partition(b"\r\n\r\n")[2]


def errors(base: str, kind: str) -> float:
    return counted(base, ERRORS, kind=kind)


def answer_each_once(response: bytes) -> Callable[[Conn, Request], Awaitable[None]]:
    """A handler that writes `response` (then reads the connection's next request)."""

    async def answer(conn: Conn, request: Request) -> None:
        conn.write(response)
        await conn.drain()

    return answer


async def sleep_forever(conn: Conn, request: Request) -> None:
    await asyncio.sleep(60)


# -- two responses in one read --------------------------------------------------------------


def serve_two_in_one_read(upstream: RawUpstream) -> None:
    async def first(conn: Conn, request: Request) -> None:
        conn.write(FIRST + EXTRA)  # one write, so the proxy reads both at once
        await conn.drain()

    upstream.default = by_target({b"/v1/first": first}, SECOND)


def pipelined(base: str) -> bytes:
    return exchange(base, get(b"/v1/first") + get(b"/v1/next"), idle=1.0, done=whole(2))


def test_two_responses_in_one_read_never_reach_the_pipelined_request(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    serve_two_in_one_read(upstream)
    with proxy(upstream.url) as base:
        got = pipelined(base)
        assert got.count(b"HTTP/1.1 200") == 2, got
        assert b"EXTRA" not in got
        assert got.index(b"first") < got.index(b"second")
        assert until(lambda: errors(base, "extra_bytes") == 1)
    # the connection that carried the extra response was closed, never reused
    assert [r.target for r in upstream.requests] == [b"/v1/first", b"/v1/next"]
    assert upstream.connections == 2


def test_through_a_byte_relay_the_extra_response_reaches_the_pipelined_request(
    upstream: RawUpstream,
) -> None:
    """The test above, through a plain byte relay: it must fail there."""
    serve_two_in_one_read(upstream)
    with byte_relay(upstream.url) as base:
        got = pipelined(base)
    assert b"EXTRA" in got


# -- the rest of a response left on the connection --------------------------------------------


def test_a_second_client_never_gets_a_partial_extra_response_completed_later(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """The first response, then the start of another in the same read; the rest of it
    comes only once a next request arrives on that connection (a slower second answer)."""

    async def first(conn: Conn, request: Request) -> None:
        conn.write(FIRST + EXTRA[:30])
        await conn.drain()
        if await conn.read_request() is not None:  # a next request on this connection
            await asyncio.sleep(0.2)
            conn.write(EXTRA[30:] + SECOND)

    upstream.default = by_target({b"/v1/first": first}, SECOND)
    with proxy(upstream.url) as base:
        one, _ = ask(base, b"/v1/first")
        two, _ = ask(base, b"/v1/other", timeout=5)
        assert body(one) == b"first"
        assert two.startswith(b"HTTP/1.1 200") and body(two) == b"second", two
        assert until(lambda: errors(base, "extra_bytes") == 1)


def test_a_partial_message_on_an_idle_connection_does_not_make_the_next_client_wait(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """While the connection sits in the pool, the upstream writes the start of a
    response and then answers nothing more on it: the next client must get a fresh
    connection at once, not wait for the first-byte timeout (600 s by default)."""
    idle_write = asyncio.Event()

    async def first(conn: Conn, request: Request) -> None:
        conn.write(FIRST)
        await conn.drain()
        await asyncio.sleep(0.3)
        conn.write(b"HTTP/1.1 200 OK\r\ncontent-")
        await conn.drain()
        idle_write.set()
        await asyncio.sleep(60)  # and nothing more, whatever comes

    upstream.default = by_target({b"/v1/first": first}, SECOND)
    with proxy(upstream.url) as base:
        one, _ = ask(base, b"/v1/first")
        assert body(one) == b"first"
        assert upstream.wait_for(idle_write.is_set, 5)
        time.sleep(0.2)  # the bytes reach the proxy
        two, seconds = ask(base, b"/v1/other", timeout=20)
        assert body(two) == b"second", two
        assert seconds < 5.0
        assert until(lambda: errors(base, "idle_bytes") == 1)


def test_a_response_on_an_idle_connection_never_reaches_the_next_client(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    written = asyncio.Event()
    closed: list[bool] = []

    async def first(conn: Conn, request: Request) -> None:
        conn.write(FIRST)
        await conn.drain()
        await asyncio.sleep(0.3)
        conn.write(EXTRA)  # while the connection sits idle in the proxy's pool
        await conn.drain()
        written.set()
        closed.append(await conn.wait_closed_by_peer(5))  # (a request here: never answered)

    upstream.default = by_target({b"/v1/first": first}, SECOND)
    with proxy(upstream.url) as base:
        one, _ = ask(base, b"/v1/first")
        assert body(one) == b"first"
        assert upstream.wait_for(written.is_set, 5)
        time.sleep(0.2)  # the bytes reach the proxy; well within its 4 s keep-alive
        two, _ = ask(base, b"/v1/other", timeout=5)
        assert body(two) == b"second", two
        assert until(lambda: errors(base, "idle_bytes") == 1)
        assert upstream.wait_for(lambda: bool(closed), 10)
    assert closed == [True]  # the proxy closed that connection


# -- a protocol switch nobody asked for; a malformed response ---------------------------------


SWITCH = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"


@pytest.mark.parametrize("head", [SWITCH, b"HTTP/1.1 101 Switching Protocols\r\n\r\n"])
def test_a_101_to_a_plain_request_is_a_502_and_the_connection_closes(
    upstream: RawUpstream, relay: str, head: bytes
) -> None:
    closed: list[bool] = []

    async def switch(conn: Conn, request: Request) -> None:
        conn.write(head + b"\x81\x05hello")  # and a WebSocket frame after it
        await conn.drain()
        closed.append(await conn.wait_closed_by_peer(5))

    upstream.default = by_target({b"/v1/switch": switch}, SECOND)
    with serving_process(upstream.url) as (base, process):
        got, seconds = ask(base, b"/v1/switch", timeout=10)
        assert got.startswith(b"HTTP/1.1 502"), got
        assert seconds < 5.0
        assert until(lambda: errors(base, "upgrade") == 1)
        assert upstream.wait_for(lambda: bool(closed), 10)
        two, _ = ask(base, b"/v1/other")
        assert body(two) == b"second"
        stop(process)
        assert process.stderr is not None
        log = process.stderr.read()
    assert closed == [True]
    assert b"Fatal error" not in log and b"HttpParserUpgrade" not in log, log


def test_content_length_and_chunked_together_is_a_502_and_the_connection_closes(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    closed: list[bool] = []

    async def both(conn: Conn, request: Request) -> None:
        conn.write(
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
            b"5\r\nEXTRA\r\n0\r\n\r\n"
        )
        await conn.drain()
        closed.append(await conn.wait_closed_by_peer(5))

    upstream.default = by_target({b"/v1/both": both}, SECOND)
    with proxy(upstream.url) as base:
        got, _ = ask(base, b"/v1/both")
        assert got.startswith(b"HTTP/1.1 502"), got
        assert b"EXTRA" not in got
        assert until(lambda: errors(base, "malformed") == 1)
        assert upstream.wait_for(lambda: bool(closed), 10)
    assert closed == [True]


def test_a_well_behaved_upstream_counts_no_protocol_error(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """Keep-alive reuse still works, and counts nothing: many requests, one connection."""
    upstream.default = by_target({}, SECOND)
    with proxy(upstream.url) as base:
        for _ in range(5):
            got = exchange(base, get(b"/v1/a") + get(b"/v1/b"), idle=0.5, done=whole(2))
            assert got.count(b"second") == 2
            time.sleep(0.05)  # the connection settles back into the pool
        for kind in ("extra_bytes", "idle_bytes", "malformed", "upgrade"):
            assert errors(base, kind) == 0
    assert upstream.connections <= 2  # reused, not one per request


# -- the httpx transport of the ASGI relay ----------------------------------------------------


@pytest.mark.parametrize("case", ["extra_bytes", "idle_bytes", "upgrade", "malformed"])
def test_the_asgi_relays_httpx_transport_is_guarded_too(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """--upstream-transport httpx (also what the aiohttp path uses for header values that
    are not UTF-8): the same outcomes and counts as the default transport."""
    monkeypatch.setenv("TOKENPROBE_RELAY", "asgi")
    monkeypatch.setenv("TOKENPROBE_UPSTREAM_TRANSPORT", "httpx")
    written: list[bool] = []
    answers = {
        "extra_bytes": FIRST + EXTRA,
        "upgrade": SWITCH + b"\x81\x05hello",
        "malformed": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5\r\nEXTRA\r\n0\r\n\r\n",
    }

    async def first(conn: Conn, request: Request) -> None:
        if case == "idle_bytes":
            conn.write(FIRST)
            await conn.drain()
            await asyncio.sleep(0.3)
            conn.write(EXTRA)
        else:
            conn.write(answers[case])
        await conn.drain()
        written.append(True)
        await conn.wait_closed_by_peer(5)

    upstream = raw_upstream(default=by_target({b"/v1/first": first}, SECOND))
    with upstream as up, serving_process(up.url) as (base, _):
        one, _ = ask(base, b"/v1/first")
        if case in ("upgrade", "malformed"):
            assert one.startswith(b"HTTP/1.1 502"), one
        else:
            assert body(one) == b"first"
        assert up.wait_for(lambda: bool(written), 5)
        time.sleep(0.2)
        two, seconds = ask(base, b"/v1/other", timeout=5)
        assert body(two) == b"second", two
        assert seconds < 3.0
        assert until(lambda: errors(base, case) == 1)


# -- a TLS upstream's clean close -------------------------------------------------------------


@pytest.mark.parametrize(
    ("relay", "transport"), [("wire", "aiohttp"), ("asgi", "aiohttp"), ("asgi", "httpx")]
)
def test_a_tls_upstream_closing_an_idle_connection_counts_no_protocol_error(
    monkeypatch: pytest.MonkeyPatch, relay: str, transport: str
) -> None:
    """A TLS backend closes an idle kept-alive connection with a close_notify alert, bytes
    on the socket as data would be (TLS 1.3 encrypts both alike). That is a clean close:
    the next request goes on a new connection, and no protocol error is counted. httpx's
    transport reads a TLS socket only when asked, so the guard's peek at an idle socket
    saw the alert's bytes and counted them as idle_bytes, once per close."""
    monkeypatch.setenv("TOKENPROBE_RELAY", relay)
    monkeypatch.setenv("TOKENPROBE_UPSTREAM_TRANSPORT", transport)
    monkeypatch.setenv("SSL_CERT_FILE", TLS_CERT)  # the backend's certificate is self-signed
    app = create_sim_app(SimConfig(models=("m",)))
    backend = ThreadedServer(
        app, ssl_certfile=TLS_CERT, ssl_keyfile=TLS_KEY, timeout_keep_alive=0.3
    ).start()
    try:
        with serving_process(f"https://127.0.0.1:{backend.port}") as (base, _):
            for pause in (0.6, 0.0):  # the backend closes the idle connection after 0.3 s
                got, _ = ask(base, b"/v1/models")
                assert got.startswith(b"HTTP/1.1 200"), got
                time.sleep(pause)
            for kind in ("extra_bytes", "idle_bytes", "malformed", "upgrade"):
                assert errors(base, kind) == 0, kind
    finally:
        backend.stop()
    assert len(app.state.requests()) == 2


# -- the upstream's base path (issue 31 item 1) -----------------------------------------------


@pytest.mark.parametrize("base", ["/tenant-a", "/tenant-a/"])
def test_the_upstreams_base_path_is_kept(upstream: RawUpstream, proxy: Proxy, base: str) -> None:
    with proxy(upstream.url + base) as base_url:
        got, _ = ask(base_url, b"/v1/models?limit=2&after=x")
        assert got.startswith(b"HTTP/1.1 200"), got
        chat = exchange(
            base_url,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 43\r\n\r\n{"model":"m","messages":[],"stream":false}  ',
            idle=0.5,
        )
        assert chat.startswith(b"HTTP/1.1 200"), chat
    assert [r.target for r in upstream.requests] == [
        b"/tenant-a/v1/models?limit=2&after=x",
        b"/tenant-a/v1/chat/completions",
    ]


def test_an_absolute_form_target_with_an_empty_path_is_the_root(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """`GET http://host?x=1` is legal (RFC 9112 §3.2.2), and its empty path is "/" (RFC 9110
    §4.2.3): it reaches the upstream at its base path's root, as nginx sends it, where both
    paths answered 400 (httptools' parse gives no path for it)."""
    targets = [b"http://llm.example", b"http://llm.example?x=1", b"http://llm.example:80"]
    with proxy(upstream.url + "/tenant-a") as base:
        for target in targets:
            request = b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            got = exchange(base, request, idle=0.5, done=whole())
            assert got.startswith(b"HTTP/1.1 200"), (target, got)
    assert [r.target for r in upstream.requests] == [
        b"/tenant-a/",
        b"/tenant-a/?x=1",
        b"/tenant-a/",
    ]


# -- bodiless responses, odd statuses, Connection-named headers (review of 2026-12-05) ---------

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n0\r\n\r\n"
)


def answer(response: bytes) -> Callable[[Conn, Request], Awaitable[None]]:
    async def handler(conn: Conn, request: Request) -> None:
        conn.write(response)
        await conn.drain()

    return handler


def test_a_bodiless_response_after_a_chunked_one_gets_no_body(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A 204 or a 304 on a pooled connection that last carried a chunked response: the
    client gets its head and nothing after it (the wire once wrote a stray last chunk,
    `0\\r\\n\\r\\n`, which the client read as the start of the next response)."""
    upstream.default = by_target(
        {
            b"/chunked": answer(CHUNKED),
            b"/none": answer(b"HTTP/1.1 204 No Content\r\n\r\n"),
            b"/same": answer(b"HTTP/1.1 304 Not Modified\r\netag: x\r\n\r\n"),
        }
    )
    sequence = [b"/chunked", b"/none", b"/chunked", b"/same", b"/chunked", b"/none"]
    with proxy(upstream.url) as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            got = [one_answer(sock, get(target)) for target in sequence]
    assert [r.target for r in upstream.requests] == sequence
    # a 204 or a 304 never leaves its connection pooled: each chunked one after them takes a
    # new one (a body a broken server sent late would be the next answer: hostile-peers.md)
    assert upstream.connections == 3
    for target, answer_ in zip(sequence, got, strict=True):
        if target == b"/chunked":
            assert answer_.endswith(b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n"), answer_
        else:  # the head and nothing after it
            assert answer_.startswith((b"HTTP/1.1 204 ", b"HTTP/1.1 304 ")), answer_
            assert answer_.index(b"\r\n\r\n") == len(answer_) - 4, answer_


@pytest.mark.parametrize(
    ("head", "may_say_length"),
    [
        (b"HTTP/1.1 304 Not Modified\r\netag: x\r\ncontent-length: 1234\r\n\r\n", True),
        (b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n", False),
    ],
    ids=["304", "204"],
)
def test_a_bodiless_answer_with_a_content_length_leaves_the_connection_for_the_next_request(
    upstream: RawUpstream, proxy: Proxy, head: bytes, may_say_length: bool
) -> None:
    """A 304 may say its representation's length (RFC 9110 §8.6) and carries no body: the
    ASGI relay passed the Content-Length to uvicorn, which then dropped the connection for
    a body shorter than it, and the request after it on the connection was lost. A 204
    MUST NOT carry one at all (§8.6; nginx's header filter clears it): the wire relayed
    the upstream's `content-length: 0`."""
    upstream.default = by_target({b"/none": answer(head), b"/chunked": answer(CHUNKED)})
    with proxy(upstream.url) as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            first = one_answer(sock, get(b"/none"))
            second = one_answer(sock, get(b"/chunked"))
    assert first.startswith(head[:13]) and first.endswith(b"\r\n\r\n"), first
    if not may_say_length:
        assert b"content-length" not in header_names(first), first
    assert second.endswith(b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n"), second


def one_answer(sock: socket.socket, request: bytes) -> bytes:
    """Every byte that comes back for `request` until the connection is quiet for 0.3 s."""
    sock.sendall(request)
    got = bytearray()
    sock.settimeout(0.3)
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        pass
    return bytes(got)


@pytest.mark.parametrize("status", [b"600 Odd", b"999 Odd", b"099 Odd"])
def test_three_digits_that_are_no_http_status_are_a_502(
    upstream: RawUpstream, proxy: Proxy, status: bytes
) -> None:
    """llhttp reads any three digits as a status: outside 100-599 the client once got no
    answer at all (the wire had no status line to write)."""
    upstream.default = answer_each(b"HTTP/1.1 " + status + b"\r\ncontent-length: 2\r\n\r\n{}")
    with proxy(upstream.url) as base:
        got, _ = ask(base, b"/v1/models")
        assert got.startswith(b"HTTP/1.1 502 "), got
        assert until(lambda: errors(base, "malformed") == 1)


def test_headers_a_responses_connection_header_names_stop_at_the_proxy(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """RFC 9110 §7.6.1: a proxy removes the headers the Connection header names, both
    ways. A Content-Length it names still frames the body."""
    upstream.default = answer_each(
        b"HTTP/1.1 200 OK\r\nconnection: keep-alive, X-Backend-Internal, content-length\r\n"
        b"x-backend-internal: node-7\r\nx-kept: yes\r\ncontent-length: 2\r\n\r\n{}"
    )
    with proxy(upstream.url) as base:
        got, _ = ask(base, b"/v1/models")
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and rest == b"{}", got
    assert b"x-kept" in header_names(head) and b"content-length" in header_names(head)
    assert b"x-backend-internal" not in header_names(head) and b"node-7" not in got


def test_a_post_the_backend_held_and_closed_unanswered_is_not_sent_again(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A request on a reused connection that the backend closes unanswered goes once more,
    on a new connection, only when the close came at once (a backend that closed an idle
    connection as the request went out: tests/server/test_exits_inprocess.py). One held
    for seconds may have run, and a POST is not idempotent (RFC 9110 §9.2.2): sending it
    again would run a second generation. That one is a 502."""

    async def hold_then_close(conn: Conn, request: Request) -> None:
        await asyncio.sleep(1.2)  # past RESEND_WITHIN (1 s)
        conn.writer.close()

    upstream.default = by_target({b"/v1/completions": hold_then_close})
    post = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 32\r\n\r\n{"model":"m","prompt":"hi"}     '
    )
    with proxy(upstream.url) as base:
        # the POST after the GET's answer: on the connection the GET left in the pool
        got = exchange(base, get(b"/v1/models"), then=post, after=0.3, idle=1.5, done=whole(2))
    assert [status for status, _, _ in responses(got)] == [200, 502], got
    assert [r.target for r in upstream.requests] == [b"/v1/models", b"/v1/completions"]
    assert upstream.connections == 1


@pytest.mark.parametrize(
    "extra",
    [b"link: " + b"b" * 20_000 + b"\r\n", b"".join(b"x-h%d: v\r\n" % i for i in range(150))],
    ids=["a-20-KB-header", "150-headers"],
)
def test_a_long_or_crowded_response_head_is_relayed(
    upstream: RawUpstream, proxy: Proxy, extra: bytes
) -> None:
    """A backend's long Link header, or many headers: relayed as on the wire (the ASGI
    relay's aiohttp transport once refused them, over its own 8190-byte and 128-header
    limits, and the client got a 502 quoting the upstream's bytes)."""
    upstream.default = answer_each(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n" + extra + b"\r\n{}")
    with proxy(upstream.url) as base:
        got, _ = ask(base, b"/v1/models")
    assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"\r\n\r\n{}"), got[:200]
    assert extra in got  # every header, as sent


def test_a_compressed_stream_goes_as_it_comes_unmeasured_and_counted(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A backend that gzips its event stream though the proxy asked for identity: the
    pieces reach the client as they come (the usage stripper once held them all, waiting
    for a blank line compressed bytes never have), and the stream, unreadable, is counted
    as unmeasured (`encoded`), never recorded as truncated."""
    events = [
        b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
        b'"delta":{"content":"t%d"},"finish_reason":null}]}\n\n' % i
        for i in range(3)
    ] + [b"data: [DONE]\n\n"]

    async def gzipped(conn: Conn, request: Request) -> None:
        conn.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        packer = zlib.compressobj(6, zlib.DEFLATED, 31)
        for event in events:
            piece = packer.compress(event) + packer.flush(zlib.Z_SYNC_FLUSH)
            conn.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            await conn.drain()
            await asyncio.sleep(0.3)
        piece = packer.flush()
        conn.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(piece), piece))
        await conn.drain()

    upstream.default = by_target({b"/v1/chat/completions": gzipped})
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with proxy(upstream.url) as base:
        started = time.monotonic()
        arrivals: list[float] = []
        raw = bytearray()
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=10) as reply:
            for piece in reply.iter_raw():
                arrivals.append(time.monotonic() - started)
                raw += piece
        assert until(lambda: counted(base, MEASURING, stage="encoded") == 1)
        assert counted(base, "tokenprobe_requests_total", error_type="stream_truncated") == 0
    assert zlib.decompress(bytes(raw), 31) == b"".join(events)
    assert arrivals[0] < arrivals[-1] - 0.5, arrivals  # the first piece did not wait for the end


MEASURING = "tokenprobe_measurement_failures_total"


def test_a_connection_whose_request_was_still_going_out_when_answered_is_not_reused(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A backend may answer before it has read the request's body (an early 413, or one
    that ignores the body). The rest of that body is still on its way, so a next request
    written behind it would reach the backend inside the first one's body, or the body's
    bytes as a request of their own. nginx keeps no such connection either
    (ngx_http_upstream_free_keepalive_peer: `if (!u->request_body_sent) goto invalid`)."""
    closed: list[bool] = []

    async def early(conn: Conn) -> None:
        await conn.reader.readuntil(b"\r\n\r\n")  # the head, not the body
        conn.write(ok(b"early"))
        await conn.drain()
        closed.append(await conn.wait_closed_by_peer(10))  # and reads no request

    upstream.scripts = [early]
    upstream.default = answer_each(SECOND)
    size = 16 << 20  # more than loopback's socket buffers take in
    post = b"POST /v1/upload HTTP/1.1\r\nHost: x\r\ncontent-length: %d\r\n\r\n" % size
    with proxy(upstream.url) as base:
        first = exchange(base, post + b"x" * size, idle=1.0, done=whole())
        assert body(first) == b"early", first[:200]
        second, _ = ask(base, b"/v1/second", timeout=5)
        assert body(second) == b"second", second
        assert upstream.wait_for(lambda: bool(closed), 10)
    assert closed == [True]  # the proxy closed the connection it could not reuse
    assert [r.target for r in upstream.requests] == [b"/v1/second"]  # on a new one
    assert upstream.connections == 2


def test_a_body_read_to_the_close_that_ends_in_a_reset_is_cut_short_not_whole(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """Only a clean close (FIN) ends a body framed by neither length nor chunks (RFC 9112
    §6.3, item 8); a reset cuts it short (§8: not to be forwarded as complete). The client
    gets what came, no last chunk, and its connection closes, and the record says
    stream_truncated, as for a short Content-Length body (nginx: no last chunk either)."""

    async def reset_mid_body(conn: Conn, request: Request) -> None:
        conn.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"partial":')
        await conn.drain()
        await asyncio.sleep(0.2)  # the head and the bytes are relayed before the reset
        sock = conn.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.writer.transport.abort()  # SO_LINGER 0: the close is a reset

    upstream.default = by_target({b"/v1/chat/completions": reset_mid_body})
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 43\r\n\r\n{"model":"m","messages":[],"stream":false} '
    )
    with proxy(upstream.url) as base:
        got = exchange(base, request + get(b"/v1/next"), idle=2.0)
        assert b'{"partial":' in got, got
        assert not got.endswith(b"0\r\n\r\n"), got  # no last chunk: a client sees it cut
        assert got.count(b"HTTP/1.1 ") == 1, got  # the connection closed: no next answer
        assert until(lambda: counted(base, REQUESTS, error_type="stream_truncated") == 1)


@pytest.mark.parametrize("base_path", ["", "/tenant-a"])
def test_a_redirect_into_the_upstream_points_at_the_proxy_as_the_client_named_it(
    upstream: RawUpstream, proxy: Proxy, base_path: str
) -> None:
    """vLLM's Starlette redirects `/v1/models/` to an absolute URL built from the Host the
    proxy sent: the upstream's own, which a client may not reach and which would take it
    around the proxy. It points at the proxy, as the client named it (nginx's
    proxy_redirect default); a redirect elsewhere, or a relative one, is left alone."""

    def redirect(location: bytes) -> Callable[[Conn, Request], Awaitable[None]]:
        async def answer(conn: Conn, request: Request) -> None:
            conn.write(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: " + location
                       + b"\r\ncontent-length: 0\r\n\r\n")  # fmt: skip
            await conn.drain()

        return answer

    own = f"http://127.0.0.1:{upstream.port}{base_path}".encode()
    upstream.default = by_target(
        {
            base_path.encode() + b"/v1/models/": redirect(own + b"/v1/models"),
            base_path.encode() + b"/v1/away": redirect(b"https://elsewhere.example/v1/models"),
            base_path.encode() + b"/v1/near": redirect(b"/v1/models"),
        }
    )
    asked = {
        b"/v1/models/": b"http://llm.example.com/v1/models",
        b"/v1/away": b"https://elsewhere.example/v1/models",
        b"/v1/near": b"/v1/models",
    }
    with proxy(upstream.url + base_path) as base:
        for target, want in asked.items():
            request = b"GET " + target + b" HTTP/1.1\r\nHost: llm.example.com\r\n\r\n"
            got = exchange(base, request, idle=0.5, done=whole())
            ((status, head, _),) = responses(got)
            location = Request(head, b"").header(b"location")
            assert (status, location) == (307, [want]), got


def test_an_absolute_form_targets_host_is_the_one_a_redirect_names(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """RFC 9112 §3.2.2: with an absolute-form target the server MUST ignore the Host header
    and use the target's host: a redirect the proxy points back at itself names that one
    (userinfo left out), not the Host header's."""
    own = f"http://127.0.0.1:{upstream.port}".encode()

    async def redirect(conn: Conn, request: Request) -> None:
        conn.write(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: " + own
                   + b"/v1/models\r\ncontent-length: 0\r\n\r\n")  # fmt: skip
        await conn.drain()

    upstream.default = by_target({b"/v1/models/": redirect})
    request = b"GET http://u:p@public.example/v1/models/ HTTP/1.1\r\nHost: internal.example\r\n\r\n"
    with proxy(upstream.url) as base:
        got = exchange(base, request, idle=0.5, done=whole())
    ((status, head, _),) = responses(got)
    location = Request(head, b"").header(b"location")
    assert (status, location) == (307, [b"http://public.example/v1/models"]), got


@pytest.mark.parametrize("pieces", [1, 2, 7], ids=["one write", "two", "seven"])
def test_a_response_head_over_the_bound_is_a_502_however_it_was_split(
    upstream: RawUpstream, proxy: Proxy, relay: str, pieces: int
) -> None:
    """The wire's 64 KiB bound on a response head counted only the reads that left the
    head unfinished: 100 KB sent in one write or in two went through, the same in pieces
    did not (a review). Now the headers as parsed count too, and the ASGI relay takes the
    same bound once its client parsed the head (forward.py `_bad_head`)."""
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(
        b"x-h%03d: %s\r\n" % (i, b"v" * 1000) for i in range(100)
    )
    head += b"content-length: 2\r\n\r\nok"
    size = -(-len(head) // pieces)

    async def split(conn: Conn, request: Request) -> None:
        for start in range(0, len(head), size):
            conn.write(head[start : start + size])
            await conn.drain()
            await asyncio.sleep(0.05)

    upstream.default = by_target({b"/v1/big-head": split})
    with proxy(upstream.url) as base:
        got, _ = ask(base, b"/v1/big-head", timeout=10)
    assert got.startswith(b"HTTP/1.1 502"), got[:200]


def test_a_response_head_that_never_ends_is_a_502_at_a_bound(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """An upstream that sends one header without end: the parser joins its value across
    reads, so the proxy would hold all of it at a quadratic cost (a review saw 75 MB take
    a core for 6 s through the WebSocket handshake's reader). The head is bounded: 502."""

    async def endless(conn: Conn, request: Request) -> None:
        conn.write(b"HTTP/1.1 200 OK\r\nx-big: ")
        deadline = time.monotonic() + 10
        with contextlib.suppress(ConnectionError):
            while time.monotonic() < deadline and not conn.writer.is_closing():
                conn.write(b"a" * 65536)
                await conn.drain()

    upstream.default = by_target({b"/v1/endless": endless})
    with proxy(upstream.url) as base:
        got, seconds = ask(base, b"/v1/endless", timeout=15)
    assert got.startswith(b"HTTP/1.1 502"), got[:200]
    assert seconds < 5, seconds


def test_a_chunked_responses_oversized_trailer_cuts_the_body_and_closes_the_connection(
    upstream: RawUpstream, proxy: Proxy, relay: str
) -> None:
    """Trailers are bounded as the head is (64 KiB): llhttp joins a trailer value across
    reads, so a backend's endless one held the wire's loop for seconds, its memory growing
    (a review). Past the bound the response is malformed: counted, its connection closed
    (never pooled), and the client's body cut: no last chunk. The ASGI relay's HTTP client
    bounds a trailer line too (aiohttp: 64 KiB), and breaks the same way, or with a 502
    when it read that far before the relay sent the head."""
    closed: list[bool] = []

    async def endless(conn: Conn, request: Request) -> None:
        conn.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-Trailed: "
        )
        try:
            for _ in range(16):  # 1 MiB
                conn.write(b"a" * 65536)
                await conn.drain()
            conn.write(b"\r\n\r\n")
            await conn.drain()
            while await asyncio.wait_for(conn.reader.read(65536), 5):
                pass
        except ConnectionError:  # a reset: the proxy closed with our bytes unread
            pass
        except TimeoutError:
            closed.append(False)
            return
        closed.append(True)

    upstream.default = by_target({b"/v1/trailed": endless}, SECOND)
    with proxy(upstream.url) as base:
        started = time.monotonic()
        got = exchange(base, get(b"/v1/trailed"), idle=1.0, total=5.0)
        assert time.monotonic() - started < 3.0
        if relay == "asgi" and got.startswith(b"HTTP/1.1 502"):
            pass  # aiohttp read the trailers before the relay sent the head: a 502 then
        else:
            assert got.startswith(b"HTTP/1.1 200") and b"hello" in got, got[:300]
            assert not got.endswith(b"0\r\n\r\n"), got[-100:]  # cut: no last chunk
        assert until(lambda: errors(base, "malformed") == 1)
        assert upstream.wait_for(lambda: bool(closed), 5)
        two, _ = ask(base, b"/v1/next")
        assert body(two) == b"second", two
    assert closed == [True]
    assert upstream.connections == 2  # the next request on a new connection


def test_a_control_character_in_a_response_header_value_is_a_502(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """llhttp refuses a control character in a header value (the wire: a 502); the ASGI
    relay's aiohttp takes it, and uvicorn refused it inside http.response.start with the
    response marked started: an empty close, recorded as a 200 (a review). Both: a 502,
    counted as a malformed response."""
    bad = ok(b"no", extra_headers=b"x-a: o\x01ne\x7f\r\n")
    upstream.default = by_target({b"/v1/bad-header": answer_each_once(bad)}, SECOND)
    with proxy(upstream.url) as base:
        got, _ = ask(base, b"/v1/bad-header")
        assert got.startswith(b"HTTP/1.1 502"), got
        assert until(lambda: errors(base, "malformed") == 1)
        assert until(lambda: counted(base, PASSTHROUGH, code="502") == 1)  # not a 200


# -- a coding under the chunks; HEAD on a pooled connection -----------------------------------


@pytest.mark.parametrize(
    "codings",
    [
        b"transfer-encoding: gzip, chunked\r\n",
        b"transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",
        b"transfer-encoding: chunked, chunked\r\n",
    ],
    ids=["gzip-chunked", "two-lines", "chunked-twice"],
)
def test_a_transfer_coding_before_chunked_is_a_502(
    upstream: RawUpstream, proxy: Proxy, codings: bytes
) -> None:
    """Both paths de-chunked such a body and framed it anew: the client got a 200 whose
    body was still gzip-coded, with nothing to say so (transfer codings are hop by hop,
    and the proxy asked for none). Now a malformed response, as nginx takes every coding
    but chunked and as the request side refuses the same: a 502, counted, and the next
    request gets its own answer (the wire closes the connection, its body unread)."""
    coded = zlib.compress(b'{"coded": true}')

    async def coded_chunks(conn: Conn, request: Request) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + codings + b"\r\n"
        conn.write(head + b"%x\r\n%b\r\n0\r\n\r\n" % (len(coded), coded))
        await conn.drain()

    upstream.default = by_target({b"/v1/coded": coded_chunks}, SECOND)
    with proxy(upstream.url) as base:
        got, _ = ask(base, b"/v1/coded")
        assert got.startswith(b"HTTP/1.1 502"), got
        assert coded not in got
        assert b"only chunked is taken" in got
        assert until(lambda: errors(base, "malformed") == 1)
        assert until(lambda: counted(base, PASSTHROUGH, code="502") == 1)
        two, _ = ask(base, b"/v1/other")
        assert body(two) == b"second", two


HEAD = b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    "framing",
    [b"content-length: 42\r\n", b"transfer-encoding: chunked\r\n"],
    ids=["length", "chunked"],
)
def test_two_heads_in_a_row_each_close_their_upstream_connection(
    upstream: RawUpstream, proxy: Proxy, framing: bytes
) -> None:
    """A HEAD's answer ends at its head, whatever its framing says (RFC 9112 §6.3, item
    1), and its connection is never pooled: a body a broken server sent late would be the
    next request's answer (docs/hostile-peers.md)."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n" + framing + b"\r\n"

    async def heads(conn: Conn) -> None:
        while (request := await conn.read_request()) is not None:
            conn.write(head if request.line.startswith(b"HEAD ") else ok(b"after"))
            await conn.drain()

    upstream.default = heads
    with proxy(upstream.url) as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            got = [one_answer(sock, HEAD) for _ in range(2)]
            after = one_answer(sock, get(b"/v1/after"))
        for kind in ("extra_bytes", "idle_bytes", "malformed"):
            assert errors(base, kind) == 0
    for answer_ in got:
        assert answer_.startswith(b"HTTP/1.1 200 ") and answer_.endswith(b"\r\n\r\n"), answer_
        assert answer_.count(b"HTTP/1.1") == 1, answer_
    assert [r.line for r in upstream.requests][:2] == [HEAD.split(b"\r\n")[0]] * 2
    assert body(after) == b"after", after  # the next response, its own
    assert upstream.connections == 3  # a HEAD's answer's connection is never pooled
