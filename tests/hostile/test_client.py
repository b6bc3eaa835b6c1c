"""Hostile clients, on both data paths: no client byte reaches the upstream except in a
request the proxy parsed and admitted, the proxy's own paths are decided on the
normalised target, and every odd request gets a defined answer (issue 32, defects 2-5
and the ASGI relay's trailer and no-answer cases).

The ASGI relay never tunnels a WebSocket (it refuses the upgrade itself), so the tests of
what happens around an upgrade hold there trivially for the upstream side, and pin that
its client still gets an answer. What only a tunnel can do is in test_tunnel.py.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest

from tests.hostile.client import (
    CHAT,
    COMPLETION,
    Switcher,
    received_bytes,
    responses,
    served,
    whole,
    ws_head,
)
from tests.hostile.peers import Conn, RawUpstream, Request, by_target, exchange, get, ok
from tests.hostile.shared import counted, counted_when
from tests.scrape import REQUESTS, scrape

Proxy = Callable[..., AbstractContextManager[str]]
SMUGGLED = b"GET /v1/smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


# -- defect 2: bytes after an upgrade head ------------------------------------------------


def test_the_upstream_gets_the_clients_address_last_in_x_forwarded_for(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A client's own X-Forwarded-For is kept and the address the proxy saw goes after it,
    measured or not: vLLM's uvicorn trusts 127.0.0.1 for the header, so with the proxy
    beside it a client could otherwise write the address vLLM logs."""
    upstream.default = by_target({})  # ok() to each
    spoofed = b"X-Forwarded-For: 6.6.6.6\r\n"
    with proxy(upstream.url) as base:
        plain = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + spoofed + b"\r\n"
        assert exchange(base, plain, idle=0.5, done=whole()).startswith(b"HTTP/1.1 200")
        assert exchange(base, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", idle=0.5, done=whole())
    first, second = upstream.requests
    assert first.header(b"x-forwarded-for") == [b"6.6.6.6, 127.0.0.1"]
    assert second.header(b"x-forwarded-for") == [b"127.0.0.1"]


def test_a_request_behind_a_refused_upgrade_never_reaches_the_upstream(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """An upgrade head and a second request in one write; the upstream refuses the
    upgrade (a 400 it keeps alive): the second request was never parsed by the proxy,
    so not a byte of it may reach the upstream."""
    switcher = Switcher(answer=ok(b"no", status=b"400 Bad Request"), delay=0.1)
    upstream.default = switcher.script()
    with proxy(upstream.url) as base:
        got = exchange(base, ws_head() + SMUGGLED, idle=1.0)
    assert b"/v1/smuggled" not in upstream.all_received()
    answers = responses(got)
    assert len(answers) == 1 and answers[0][0] >= 400, got


def test_bytes_after_an_unframed_refusal_never_reach_the_upstream(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """The upstream refuses the upgrade with a body that runs to the close, and keeps the
    connection open: what the client writes next is not a tunnel's to pipe."""
    switcher = Switcher(answer=b"HTTP/1.1 403 Forbidden\r\n\r\nno", delay=0.0)
    upstream.default = switcher.script()
    with proxy(upstream.url) as base:
        got = exchange(base, ws_head(), then=SMUGGLED, after=0.5, idle=1.0)
    assert b"/v1/smuggled" not in upstream.all_received()
    assert got.startswith(b"HTTP/1.1 4"), got


@pytest.mark.parametrize(
    ("name", "head", "body"),
    [
        (
            "POST with Upgrade",
            ws_head(
                b"/v1/chat/completions",
                method=b"POST",
                extra=b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(CHAT),
            ),
            CHAT,
        ),
        (
            "GET upgrade with a body",
            ws_head(b"/v1/models", extra=b"Content-Length: 5\r\n"),
            b"hello",
        ),
        (
            "upgrade without a key",
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
            b"",
        ),
    ],
)
def test_an_upgrade_that_is_not_a_websocket_handshake_is_an_ordinary_request(
    upstream: RawUpstream, proxy: Proxy, name: str, head: bytes, body: bytes
) -> None:
    """Only a well-formed WebSocket handshake (GET, Upgrade: websocket, Connection:
    upgrade, key, version, no body) is tunnelled; anything else is relayed as HTTP with
    Upgrade dropped as hop-by-hop, and answered within seconds."""
    upstream.default = Switcher(plain=ok(COMPLETION)).script()
    with proxy(upstream.url) as base:
        start = time.monotonic()
        got = exchange(base, head + body + SMUGGLED, idle=1.0, total=8.0)
        took = time.monotonic() - start
    answers = responses(got)
    assert answers and answers[0][0] == 200 and answers[0][2] == COMPLETION, (name, got)
    assert took < 4.0
    (seen,) = upstream.requests
    assert seen.header(b"upgrade") == [] and seen.body == body
    assert b"/v1/smuggled" not in upstream.all_received()


H2C = (
    b"POST /v1/files HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\n"
    b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def test_an_upgrade_requests_chunked_body_is_read_and_relayed(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """llhttp skips the body of any request asking to upgrade; the proxy reads it itself
    (chunks, then trailers dropped) and relays the request as HTTP."""
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailed: t\r\n\r\n"
    with proxy(upstream.url) as base:
        got = exchange(base, H2C + body + SMUGGLED, idle=1.0)
    assert [status for status, _, _ in responses(got)] == [200], got
    (seen,) = upstream.requests
    assert seen.body == b"hello world" and seen.header(b"upgrade") == []
    assert b"/v1/smuggled" not in upstream.all_received()
    assert b"x-trailed" not in upstream.all_received().lower()


def test_an_upgrade_requests_malformed_body_is_a_400(upstream: RawUpstream, proxy: Proxy) -> None:
    with proxy(upstream.url) as base:
        got = exchange(base, H2C + b"zz\r\nhello\r\n", idle=1.0)
    assert got.startswith(b"HTTP/1.1 400"), got
    assert upstream.requests == []


def test_a_post_with_upgrade_is_measured(upstream: RawUpstream, proxy: Proxy) -> None:
    upstream.default = Switcher(plain=ok(COMPLETION)).script()
    extra = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(CHAT)
    with proxy(upstream.url) as base:
        before = scrape(base).total("tokenprobe_requests_total")
        got = exchange(base, ws_head(b"/v1/chat/completions", method=b"POST", extra=extra) + CHAT)
        assert got.startswith(b"HTTP/1.1 200"), got
        deadline = time.monotonic() + 5
        while scrape(base).total("tokenprobe_requests_total") == before:
            assert time.monotonic() < deadline, "the request was not measured"
            time.sleep(0.05)


# -- defect 4: the proxy's own paths, on the normalised target ----------------------------

OWN = [
    (b"/v1/../metrics", b"tokenprobe_"),
    (b"/v1/%2e%2e/healthz", b'"status":"ok"'),
    (b"/v1/x/%2E%2E/%2e%2E/./healthz", b'"status":"ok"'),
    (b"//metrics", b"tokenprobe_"),
    (b"/%68ealthz", b'"status":"ok"'),
    (b"/healthz/", b'"status":"ok"'),
]


@pytest.fixture(scope="module", params=["wire", "asgi"])
def shared(request: pytest.FixtureRequest) -> Iterator[tuple[RawUpstream, str]]:
    with served(request.param) as pair:
        yield pair


@pytest.mark.parametrize(("target", "mark"), OWN, ids=[t.decode() for t, _ in OWN])
def test_a_spelling_of_the_proxys_own_path_is_answered_by_the_proxy(
    shared: tuple[RawUpstream, str], target: bytes, mark: bytes
) -> None:
    """Routing is decided on the normalised target (empty segments merged, a trailing
    slash ignored): every spelling of /metrics or /healthz gets the proxy's own answer,
    and nothing reaches the upstream."""
    upstream, base = shared
    before = received_bytes(upstream)
    got = exchange(base, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n", idle=1.0, done=whole())
    answers = responses(got)
    assert answers and answers[0][0] == 200 and mark in answers[0][2], got[:300]
    assert received_bytes(upstream) == before


@pytest.mark.parametrize("target", [b"/metrics", b"/v1/../metrics", b"//healthz"])
def test_an_upgrade_to_the_proxys_own_path_is_never_tunnelled(
    shared: tuple[RawUpstream, str], target: bytes
) -> None:
    """The wire answers it as the plain request it also is (RFC 9110 §7.8 lets a server
    ignore Upgrade); the ASGI relay refuses every WebSocket itself."""
    upstream, base = shared
    before = received_bytes(upstream)
    got = exchange(base, ws_head(target), idle=1.0)
    assert received_bytes(upstream) == before
    answers = responses(got)
    assert answers and answers[0][0] in (200, 403), got[:300]


# -- defect 5: pipelining around an upgrade -----------------------------------------------


def test_a_pipelined_get_then_an_upgrade_keeps_the_gets_response(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A GET and an upgrade head in one write: the client gets the GET's response first,
    whole, then the upgrade's own answer (the 101 on the wire, the ASGI relay's refusal)."""
    upstream.default = Switcher(plain=ok(b'{"first":true}')).script()
    get = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    with proxy(upstream.url) as base:
        got = exchange(base, get + ws_head(), idle=1.5, done=whole(2))
    answers = responses(got)
    assert len(answers) == 2, got
    assert answers[0][0] == 200 and answers[0][2] == b'{"first":true}'
    assert answers[1][0] in (101, 403), got


# -- the ASGI relay's trailer -------------------------------------------------------------


def test_a_chunked_requests_trailer_never_becomes_a_header(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """Trailer fields are dropped, as most proxies do: a trailer is not a header, and
    passed on as one it would smuggle a header past the head's policy and limits."""
    head = (
        b"POST /v1/files HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Trailer: X-Trailed\r\n\r\n"
    )
    body = b"5\r\nhello\r\n0\r\nX-Trailed: smuggled\r\n\r\n"
    with proxy(upstream.url) as base:
        got = exchange(base, head + body, idle=1.0, done=whole())
    assert got.startswith(b"HTTP/1.1 200"), got
    (seen,) = upstream.requests
    assert seen.body == b"hello"
    assert b"smuggled" not in upstream.all_received()


def send_trailer(base: str, start: bytes, trailer: bytes, piece: int) -> bytes:
    """Write `start`, then `trailer` in writes of `piece` bytes, then the blank line that
    ends it, as long as the proxy takes them; then every byte it answers until it closes
    (or 2 s of silence). A reset (the proxy closed with bytes unread) ends it early."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    got = bytearray()
    with socket.create_connection((host, int(port)), timeout=5.0) as sock:
        try:
            sock.sendall(start)
            for at in range(0, len(trailer), piece):
                sock.sendall(trailer[at : at + piece])
            sock.sendall(b"\r\n\r\n")
            sock.settimeout(2.0)
            while chunk := sock.recv(65536):
                got += chunk
        except (ConnectionError, TimeoutError):
            pass
    return bytes(got)


@pytest.mark.parametrize(
    ("case", "size", "piece"),
    [
        ("one field without end, in pieces", 2**20, 64 * 1024),
        ("in the same write as the data", 2**20, 2**21),
        ("a whole field, likely in one read with the data", 100_000, 2**21),
    ],
)
def test_a_chunked_requests_oversized_trailer_is_a_431_and_never_reaches_the_upstream(
    upstream: RawUpstream, proxy: Proxy, case: str, size: int, piece: int
) -> None:
    """Trailers are bounded as the head is (--max-header-bytes and 8 KiB): llhttp joins a
    trailer value across reads, so a 100 MB one once held the proxy's loop for seconds
    (its memory growing) and was then relayed with a 200 (a review). Past the bound: a
    431 and a close, counted as an oversized head; the request never goes upstream."""
    start = (
        b"POST /v1/files HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\nX-Trailed: "
    )
    with proxy(upstream.url) as base:
        started = time.monotonic()
        got = send_trailer(base, start, b"a" * size, piece)
        assert time.monotonic() - started < 3.0
        assert got == b"" or got.startswith(b"HTTP/1.1 431"), (case, got[:200])
        closed = counted(base, "tokenprobe_connections_closed_total", reason="headers_too_large")
        assert closed == 1, case
    assert received_bytes(upstream) == 0, case


# -- a request answered before its body is in; pipelined requests (review of 2026-12-05) ----


def closes(base: str) -> float:
    """Every connection close the head guard counted (tokenprobe_connections_closed_total)."""
    return scrape(base).total("tokenprobe_connections_closed_total")


def post_head(length: int, path: bytes = b"/v1/files") -> bytes:
    return b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length


def test_a_body_refused_while_it_arrives_is_read_to_its_end_then_the_next_request_is_served(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A 413 goes out as soon as the body passes --max-body-bytes; the rest of the body is
    read and dropped, and the request after it on the connection is served. The rest was
    once counted as the next request's head: a second answer (431, or 408 at the header
    timeout) cut the connection mid-body, counted as a hostile head."""
    flags = ("--max-body-bytes", "100000", "--header-timeout", "0.5", "--keep-alive-timeout", "1")
    with proxy(upstream.url, *flags) as base:
        before = closes(base)
        got = exchange(
            base,
            post_head(300_000) + b"a" * 80_000,
            then=b"b" * 220_000 + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
            after=0.8,  # past the header timeout: the rest of a body is no head
            idle=1.5,
            done=whole(2),
        )
        assert [status for status, _, _ in responses(got)] == [413, 200], got
        # the body all in, and nothing after it: an idle connection, closed as one
        started = time.monotonic()
        got = exchange(base, post_head(300_000) + b"a" * 80_000, then=b"b" * 220_000, idle=5.0)
        assert [status for status, _, _ in responses(got)] == [413], got
        assert time.monotonic() - started < 3.5
        assert closes(base) == before
    assert [r.target for r in upstream.requests] == [b"/v1/models"]


def test_a_client_waiting_for_100_continue_refused_at_its_head_is_told_the_connection_closes(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A request refused at its head (a 413 on its Content-Length) while its client waits
    for a 100 Continue that never comes: the client may keep its body back for good (RFC
    9110 §10.1.1), so its next request would be read as the rest of this body and go
    unanswered until --body-timeout. The 413 says `connection: close`, and the connection
    closes at once (nginx closes after any 413). A client that sends its body without
    waiting still gets the drain and keeps its connection (the test above)."""
    head = post_head(300_000).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n")
    with proxy(upstream.url, "--max-body-bytes", "100000", "--body-timeout", "5") as base:
        started = time.monotonic()
        got = exchange(base, head, idle=4.0)
        took = time.monotonic() - started
        assert [status for status, _, _ in responses(got)] == [413], got
        assert b"100 Continue" not in got, got
        head_block = got.split(b"\r\n\r\n", 1)[0].lower()
        assert b"\r\nconnection: close" in head_block, got
        assert took < 2.0, took  # closed by the proxy, not by the client's idle wait (4 s)
    assert upstream.requests == []


def test_a_body_refused_and_then_left_unfinished_closes_its_connection_without_a_second_answer(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """The rest of a refused body gets --body-timeout from the answer, as a body does, and
    then the connection closes with the one answer it had (the rest once counted as a head
    that never ended: a 408 at the header timeout, counted as a slowloris)."""
    flags = ("--max-body-bytes", "100000", "--body-timeout", "1.5", "--header-timeout", "0.5")
    with proxy(upstream.url, *flags) as base:
        before = closes(base)
        started = time.monotonic()
        got = exchange(base, post_head(150_000), then=b"c" * 2_000, after=0.3, idle=5.0)
        took = time.monotonic() - started
        assert [status for status, _, _ in responses(got)] == [413], got
        assert 1.3 < took < 4.0, took
        assert closes(base) == before
    assert received_bytes(upstream) == 0


def test_a_client_that_leaves_with_a_request_pipelined_cancels_the_running_one(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """The running request's upstream connection closes when its client leaves, though a
    second request waits behind it (the backend frees the first one's KV cache). It was
    once told to the waiting request only, and the generation ran to its end."""
    closed_after: list[float] = []

    async def generating(conn: Conn, request: Request) -> None:
        started = time.monotonic()
        if await conn.wait_closed_by_peer(timeout=8.0):
            closed_after.append(time.monotonic() - started)

    upstream.default = by_target({b"/v1/slow": generating})
    with proxy(upstream.url) as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(GET_SLOW + b"GET /v1/next HTTP/1.1\r\nHost: x\r\n\r\n")
            assert upstream.wait_for(lambda: len(upstream.requests) == 1, 5)
            time.sleep(0.3)
        assert upstream.wait_for(lambda: bool(closed_after), 6), "the upstream request ran on"
    assert closed_after[0] < 2.0, closed_after
    assert [r.target for r in upstream.requests] == [b"/v1/slow"]


def test_requests_pipelined_behind_one_whose_client_left_are_each_recorded(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """Three streams pipelined, the client gone while the first runs: three records of
    client_cancelled, the two that never had their turn with nothing sent (status 0).
    The ASGI relay once recorded the first only: uvicorn never starts the app for a
    request still waiting in its pipeline."""
    closed: list[float] = []
    upstream.default = by_target({b"/v1/chat/completions": _endless_stream(closed)})
    with proxy(upstream.url) as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(_stream_request() * 3)
            assert upstream.wait_for(lambda: len(upstream.requests) == 1, 5)
            sock.recv(65536)  # the first answer is under way
        change = counted_when(base, REQUESTS, 3, error_type="client_cancelled")
    codes = {s.labels["code"] for s in change.after.series(REQUESTS, error_type="client_cancelled")}
    by_code = {code: change(REQUESTS, code=code) for code in codes}
    assert {code: n for code, n in by_code.items() if n} == {"200": 1, "0": 2}, by_code
    assert len(upstream.requests) == 1


def test_a_pipelined_request_does_not_turn_off_the_running_ones_backpressure(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A client that does not read: the proxy stops reading the upstream, so the backend's
    writes block, with a request pipelined behind too (the wire once paused and resumed
    the waiting request's upstream, which had none: the proxy buffered the whole answer)."""
    written: list[int] = [0]
    total = 96 * 2**20

    async def big(conn: Conn, request: Request) -> None:
        conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        piece = b"x" * 2**20
        for _ in range(total // len(piece)):
            conn.write(piece)
            await conn.drain()
            written[0] += len(piece)

    upstream.default = by_target({b"/v1/big": big})
    with proxy(upstream.url) as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2**16)
            sock.sendall(
                b"GET /v1/big HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/next HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            upstream.wait_for(lambda: written[0] >= total, 1.5)  # it must not get there
            assert written[0] < total // 2, (
                f"{written[0] / 2**20:.0f} MiB went past a client that reads nothing"
            )


def _endless_stream(closed_after: list[float]) -> Callable[[Conn, Request], Any]:
    """An upstream that streams 60 KB chat events until the proxy closes on it, noting
    how long after its first byte that came."""
    text = b"x" * 60_000
    event = b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % text
    chunk = b"%x\r\n%s\r\n" % (len(event), event)

    async def endless(conn: Conn, request: Request) -> None:
        started = time.monotonic()
        conn.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        try:
            while True:
                conn.write(chunk)
                await asyncio.wait_for(conn.drain(), 30)
        except (ConnectionError, TimeoutError):
            pass
        closed_after.append(time.monotonic() - started)

    return endless


def _stream_request() -> bytes:
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


@contextmanager
def _small_window_stream(base: str) -> Iterator[socket.socket]:
    """A client connection with a 4 KiB receive buffer that has sent a streaming chat
    request: whatever it does not read holds the proxy's writes up at once."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(_stream_request())
        yield sock


def test_a_client_that_stops_reading_is_cut_at_the_idle_timeout_and_the_generation_ends(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A client that stays connected and reads nothing held the upstream request for good
    (its backpressure stopped the idle clock): the backend's generation and its KV cache
    with it. Now it is cut at --idle-timeout, as nginx's send_timeout does: the upstream
    closed, the client's connection dropped, the request recorded once as
    client_cancelled."""
    closed_after: list[float] = []
    upstream.default = by_target({b"/v1/chat/completions": _endless_stream(closed_after)})
    with proxy(upstream.url, "--idle-timeout", "1") as base, _small_window_stream(base) as sock:
        assert upstream.wait_for(lambda: bool(closed_after), 8), "the upstream ran on"
        sock.settimeout(5)
        with pytest.raises(ConnectionError):  # dropped: reset, or read to its end
            while sock.recv(2**20):
                pass
            raise ConnectionResetError("closed")
        cancelled = counted_when(base, REQUESTS, 1, error_type="client_cancelled")(REQUESTS)
    assert 1.0 <= closed_after[0] < 4.0, closed_after
    assert cancelled == 1


def test_a_client_that_reads_slowly_keeps_its_stream_past_the_idle_timeout(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """The other side of the bound above: a client that takes bytes, however slowly,
    holds the upstream up without being cut."""
    closed_after: list[float] = []
    upstream.default = by_target({b"/v1/chat/completions": _endless_stream(closed_after)})
    with proxy(upstream.url, "--idle-timeout", "1") as base, _small_window_stream(base) as sock:
        deadline = time.monotonic() + 3.5  # three and a half idle timeouts
        taken = 0
        while time.monotonic() < deadline:
            time.sleep(0.25)
            taken += len(sock.recv(64 * 1024))  # about 256 KB a second
        assert not closed_after, f"cut though it read {taken} bytes"
    assert taken > 0


def test_a_pipelined_requests_body_time_runs_from_its_turn(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A POST pipelined behind a slow GET, its body sent just after its head: it is served.
    Its --body-timeout once ran from its head, while the connection was not read for it."""

    async def slow(conn: Conn, request: Request) -> None:
        await asyncio.sleep(0.8)  # past the body timeout (0.5 s)
        conn.write(ok(b'{"slow":true}'))
        await conn.drain()

    upstream.default = by_target({b"/v1/slow": slow})
    with proxy(upstream.url, "--body-timeout", "0.5") as base:
        got = exchange(
            base, GET_SLOW + post_head(5), then=b"hello", after=0.2, idle=3.0, done=whole(2)
        )
    assert [status for status, _, _ in responses(got)] == [200, 200], got
    assert [(r.target, r.body) for r in upstream.requests] == [
        (b"/v1/slow", b""),
        (b"/v1/files", b"hello"),
    ]


GET_SLOW = b"GET /v1/slow HTTP/1.1\r\nHost: x\r\n\r\n"


# -- bytes the parser refuses behind a request still being answered ------------------------


async def slow_answer(conn: Conn, request: Request) -> None:
    """A 10-byte body in two halves, 1 s apart: past the proxies' --header-timeout 0.5
    from the bytes the tests send 0.2 s in, so a timer that ran inside the answer fires
    0.3 s before its end."""
    conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nAAAAA")
    await conn.drain()
    await asyncio.sleep(1.0)
    conn.write(b"BBBBB")
    await conn.drain()


GARBAGE = b"GARBAGE\x01 /x HTTP/1.1\r\n\r\n"
BAD_CHUNKS = b"POST /v1/bad HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhi\r\n"


@pytest.mark.parametrize(
    ("first", "then", "answers"),
    [
        (get(b"/v1/slow"), GARBAGE, [(200, b"AAAAABBBBB"), (400, None)]),
        (get(b"/v1/slow") + get(b"/v1/next"), GARBAGE,
         [(200, b"AAAAABBBBB"), (200, b"next"), (400, None)]),
        (get(b"/v1/slow"), BAD_CHUNKS, [(200, b"AAAAABBBBB"), (400, None)]),
    ],
    ids=["garbage", "garbage-behind-a-pipelined-request", "a-waiting-requests-bad-body"],
)  # fmt: skip
def test_a_400_for_bytes_behind_a_running_answer_comes_after_it(
    upstream: RawUpstream,
    proxy: Proxy,
    first: bytes,
    then: bytes,
    answers: list[tuple[int, bytes | None]],
) -> None:
    """Bytes the parser refuses, sent while a response is still going out: the 400 would
    land inside that response's body, which the client would read as its own. The answers
    before it go out whole and in order, then the 400, then the close (RFC 9112 §9.3.2);
    a request whose own body was malformed never reaches the upstream."""
    upstream.default = by_target({b"/v1/slow": slow_answer}, ok(b"next"))
    with proxy(upstream.url, "--header-timeout", "0.5") as base:
        got = exchange(base, first, then=then, after=0.2, idle=2.5)
        malformed = counted(base, "tokenprobe_connections_closed_total", reason="malformed")
    read = [(status, None if status == 400 else body) for status, _, body in responses(got)]
    assert read == answers, got
    assert got.endswith(b"Invalid HTTP request received."), got  # nothing after it: closed
    assert malformed == 1
    assert b"/v1/bad" not in upstream.all_received()


def test_a_head_that_goes_bad_behind_a_running_answer_gets_no_408_inside_it(
    upstream: RawUpstream, proxy: Proxy
) -> None:
    """A pipelined head that starts well (its request line starts the header timer) and
    then goes bad: the 400 waits for the running answer, and so must the timer's 408,
    which fired at --header-timeout, inside that answer."""
    upstream.default = by_target({b"/v1/slow": slow_answer}, ok(b"next"))
    with proxy(upstream.url, "--header-timeout", "0.5") as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        got = bytearray()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(get(b"/v1/slow"))
            time.sleep(0.2)
            sock.sendall(b"GET /x HTTP/1.1\r\n")
            time.sleep(0.2)
            sock.sendall(b"no colon here\r\n\r\n")
            while chunk := sock.recv(65536):
                got += chunk
    read = [(status, None if status == 400 else body) for status, _, body in responses(bytes(got))]
    assert read == [(200, b"AAAAABBBBB"), (400, None)], bytes(got)
