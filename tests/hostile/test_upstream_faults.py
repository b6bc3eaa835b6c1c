"""One upstream fault, told the same way on every data path: the wire, and the ASGI relay
on its aiohttp and httpx transports each met these in their own words (a connect timeout
as a cancelled task, a status 600 as "the upstream answered status 600", h11's "Only
Transfer-Encoding: chunked is supported", asyncio's "Connect call failed"). Each is now
told in the one wording of proxy.core.errors.UPSTREAM_FAULTS, or, for a refused connect,
in the system's words for its errno, with the same status and error kind.

Each test runs on the three paths (the `path` fixture), in a real `tokenprobe serve` in
front of a peer on 127.0.0.1, but for those only one path meets (the wire's WebSocket
tunnel, aiohttp's parsers). Shown able to fail: each was run against the tree before.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import HttpVersion11
from aiohttp.http_parser import RawResponseMessage
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.core.errors import describe
from tests.backlog import full_backlog
from tests.edge_backend import serving
from tests.hostile.client import ws_head
from tests.hostile.peers import Conn, Handler, RawUpstream, Request, by_target
from tests.hostile.shared import DataPath, SharedProxies, counted, until

REQUESTS = "tokenprobe_requests_total"
ERRORS = "tokenprobe_upstream_protocol_errors_total"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def ask(base: str, target: str = "/v1/chat/completions") -> tuple[int, str]:
    """A measured request: the proxy's status and its error message."""
    got = httpx.post(base + target, json=CHAT, timeout=30)
    return got.status_code, str(got.json()["error"]["message"])


@pytest.fixture
def unanswered() -> Iterator[str]:
    """An upstream address on 127.0.0.1 whose SYNs go unanswered: a listening socket with
    a backlog of none, filled by connections it never accepts, so the kernel drops the
    next SYN and the proxy's connect waits for its --connect-timeout."""
    with full_backlog(("127.0.0.1", 0)) as (host, port):
        yield f"http://{host}:{port}"


def test_a_connect_timeout_names_the_setting_on_every_path(unanswered: str, path: DataPath) -> None:
    """Every path answered "upstream: CancelledError: cancelled before the upstream
    answered" (httpx: anyio's "Cancelled via cancel scope 7f..."), words that name neither
    the connect nor the limit that ran out."""
    flags = (*path.flags, "--connect-timeout", "0.5")
    with path.shared.take(path.relay, unanswered, *flags) as base:
        status, message = ask(base)
        assert status == 504, message
        assert message == (
            "upstream: ConnectTimedOut: the connect timed out after 0.5 s (--connect-timeout)"
        )
        assert until(lambda: counted(base, REQUESTS, error_type="upstream_timeout") == 1)


def test_a_refused_connect_is_told_in_the_systems_words_on_every_path(path: DataPath) -> None:
    """aiohttp's connect said asyncio's "[Errno 111] Connect call failed" where the wire
    and httpx said "[Errno 111] Connection refused"."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with path.proxy(f"http://127.0.0.1:{port}") as base:
        status, message = ask(base)
        assert status == 502, message
        assert message == "upstream: ConnectionRefusedError: [Errno 111] Connection refused"
        assert until(lambda: counted(base, REQUESTS, error_type="upstream_unreachable") == 1)


def answer(response: bytes) -> Handler:
    """A handler writing `response` in one write."""

    async def handler(conn: Conn, request: Request) -> None:
        conn.write(response)
        await conn.drain()

    return handler


CODED = zlib.compress(b'{"coded": true}')
TRANSFER_CODING = "a transfer coding other than chunked{}: only chunked is taken"


@pytest.mark.parametrize(
    ("response", "kind", "said"),
    [
        (
            b"HTTP/1.1 600 Odd\r\ncontent-length: 2\r\n\r\n{}",
            "malformed",
            "status 600 is not an HTTP status",
        ),
        (
            b"HTTP/1.1 099 Odd\r\ncontent-length: 2\r\n\r\n{}",
            "malformed",
            "status 099 is not an HTTP status",
        ),
        (
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
            "upgrade",
            "the upstream switched protocols unasked",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
            + b"%x\r\n%b\r\n0\r\n\r\n" % (len(CODED), CODED),
            "malformed",
            TRANSFER_CODING.format(" (transfer-encoding: gzip, chunked)"),
        ),
    ],
    ids=["status-600", "status-099", "unasked-101", "gzip-chunked"],
)
def test_a_broken_response_head_is_told_in_one_wording_on_every_path(
    upstream: RawUpstream, path: DataPath, response: bytes, kind: str, said: str
) -> None:
    """The ASGI relay said "the upstream answered status 600" (and 101) where the wire
    said the words below, and its httpx transport passed on h11's "RemoteProtocolError:
    Only Transfer-Encoding: chunked is supported". h11 keeps no coding it refuses, so on
    httpx the sentence goes without them. A 099 was "status 99" on the wire and aiohttp,
    and h11's "InformationalResponse status_code should be in range [100, 200), not 99"
    on httpx."""
    upstream.default = by_target({b"/v1/chat/completions": answer(response)})
    if path.name == "asgi-httpx" and "transfer-encoding" in said:
        said = TRANSFER_CODING.format("")
    with path.proxy(upstream.url) as base:
        status, message = ask(base)
        assert status == 502, message
        assert message == f"upstream: UpstreamProtocolError: {said}"
        assert until(lambda: counted(base, REQUESTS, error_type="upstream_error") == 1)
        assert until(lambda: counted(base, ERRORS, kind=kind) == 1)


SECRET = b"backend_session=SECRET-UPSTREAM-COOKIE-42"
#: The words each path tells (llhttp's on the wire and aiohttp's C parser, which is
#: llhttp too, under UpstreamProtocolError; h11's under httpx's RemoteProtocolError).
MALFORMED = "UpstreamProtocolError: malformed response: "


@pytest.mark.parametrize(
    ("response", "words"),
    [
        (
            b"HTTP/1.1 200 OK\r\nset-cookie: " + SECRET + b"; HttpOnly\rx: y\r\n"
            b"content-length: 2\r\n\r\n{}",
            {
                "wire": MALFORMED + "Missing expected LF after header value",
                "asgi": MALFORMED + "Missing expected LF after header value",
                "asgi-httpx": "RemoteProtocolError: illegal header line",
            },
        ),
        (
            b"HTTP/1.1 200 OK\r\nx-" + SECRET + b" no colon\r\ncontent-length: 2\r\n\r\n{}",
            {
                "wire": MALFORMED + "Invalid header token",
                "asgi": MALFORMED + "Invalid header token",
                "asgi-httpx": "RemoteProtocolError: illegal header line",
            },
        ),
        (
            b"SECRET-UPSTREAM-STATUS-LINE\r\n\r\n",
            {
                "wire": MALFORMED + "Expected HTTP/, RTSP/ or ICE/",
                "asgi": MALFORMED + "Bad status line: Expected HTTP/, RTSP/ or ICE/",
                "asgi-httpx": "RemoteProtocolError: illegal status line",
            },
        ),
    ],
    ids=["bare-cr-in-a-value", "no-colon", "no-status-line"],
)
def test_a_malformed_response_head_never_tells_the_upstreams_bytes(
    upstream: RawUpstream, path: DataPath, response: bytes, words: dict[str, str]
) -> None:
    """aiohttp's parser error quotes the line it refused, and h11's its bytearray: the
    ASGI relay put the upstream's Set-Cookie into the client's 502 and the record's error
    ("BadHttpMessage: Missing expected LF after header value: b'set-cookie:
    backend_session=...' ^"). The wire told llhttp's reason alone; aiohttp's refusal of a
    head is now told in the wire's words, and h11's without its bytes."""
    upstream.default = by_target({b"/v1/chat/completions": answer(response)})
    with path.proxy(upstream.url) as base:
        status, message = ask(base)
        assert status == 502, message
        assert "SECRET" not in message
        assert message == f"upstream: {words[path.name]}"
        assert until(lambda: counted(base, REQUESTS, error_type="upstream_error") == 1)


def test_a_websocket_handshakes_connect_timeout_names_the_setting_too(
    unanswered: str, shared_proxies: SharedProxies
) -> None:
    """The tunnel dialled under its own `asyncio.wait_for`, so a handshake whose connect
    ran out was answered "CancelledError: cancelled before the upstream answered" where an
    HTTP request on the same wire now names --connect-timeout."""
    with shared_proxies.take("wire", unanswered, "--connect-timeout", "0.5") as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(ws_head())
            answer = b""
            while not answer.endswith(b"}") and (got := conn.recv(65536)):
                answer += got
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 504 "), answer
        assert b"the connect timed out after 0.5 s (--connect-timeout)" in body, body


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A folder for Unix sockets, short enough for a socket's path (108 bytes at most)."""
    folder = Path(tempfile.mkdtemp(prefix="tp-uds-", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_missing_unix_socket_is_not_named_to_the_client(socket_dir: Path, path: DataPath) -> None:
    """Every path answered "FileNotFoundError: [Errno 2] No such file or directory:
    '/run/vllm.sock'", where the backend is, which the answer to a refused TCP connect
    leaves out (its host and port); the record keeps it."""
    missing = str(socket_dir / "no-such.sock")
    flags = (*path.flags, "--upstream-uds", missing)
    with path.shared.take(path.relay, "http://localhost", *flags) as base:
        status, message = ask(base)
        assert status == 502, message
        assert message == "upstream: FileNotFoundError: [Errno 2] No such file or directory"
        assert until(lambda: counted(base, REQUESTS, error_type="upstream_unreachable") == 1)


@pytest.fixture
def full_unix_socket(socket_dir: Path) -> Iterator[str]:
    """A listening Unix socket whose backlog is full, filled by connections it never
    accepts: a connect to it fails at once with EAGAIN (Linux net/unix/af_unix.c
    unix_stream_connect, a non-blocking socket), where a blocking one would wait."""
    with full_backlog(str(socket_dir / "full.sock"), socket.AF_UNIX) as where:
        yield str(where)


def test_a_unix_socket_with_a_full_backlog_is_a_connect_timeout_on_every_path(
    full_unix_socket: str, path: DataPath
) -> None:
    """A listener not accepting yet: the wire and aiohttp answered at once 502
    "BlockingIOError: [Errno 11] Resource temporarily unavailable: '/run/vllm.sock'", and
    httpx (whose anyio tries again) 504 "ConnectTimedOut: ... to socket /run/vllm.sock",
    the path in both. Now each waits, as a TCP connect to a full backlog does, and tells
    the connect timeout without the path."""
    flags = (*path.flags, "--upstream-uds", full_unix_socket, "--connect-timeout", "0.5")
    with path.shared.take(path.relay, "http://localhost", *flags) as base:
        status, message = ask(base)
        assert status == 504, message
        assert message == (
            "upstream: ConnectTimedOut: the connect timed out after 0.5 s (--connect-timeout)"
        )
        assert until(lambda: counted(base, REQUESTS, error_type="upstream_timeout") == 1)


def ask_on_a_pooled_connection(base: str) -> tuple[int, str]:
    """`ask` on the upstream connection a first, answered request left in the pool."""
    first = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "hi"})
    assert first.status_code == 200, first.text
    return ask(base)


def test_a_kept_alive_connection_closed_unanswered_is_told_in_one_wording(
    upstream: RawUpstream, path: DataPath
) -> None:
    """A request on a reused connection that the backend held past RESEND_WITHIN and
    closed unanswered (so not sent again): the wire said "UpstreamClosed: the upstream
    closed the connection before answering", aiohttp "_AiohttpClosedUnanswered: Server
    disconnected" (a private class's name), httpx "RemoteProtocolError: Server
    disconnected without sending a response."."""

    async def hold_then_close(conn: Conn, request: Request) -> None:
        await asyncio.sleep(1.2)  # past RESEND_WITHIN (1 s)
        conn.writer.close()

    upstream.default = by_target({b"/v1/chat/completions": hold_then_close})
    with path.proxy(upstream.url) as base:
        status, message = ask_on_a_pooled_connection(base)
        assert status == 502, message
        assert message == (
            "upstream: UpstreamClosed: the upstream closed the connection before answering"
        )
    assert upstream.connections == 1


def close_after(response: bytes) -> Handler:
    """A handler writing `response`, then closing the connection cleanly (a FIN)."""

    async def handler(conn: Conn, request: Request) -> None:
        conn.write(response)
        await conn.drain()
        conn.writer.close()

    return handler


HEAD_CUT = (
    "upstream: UpstreamClosed: the upstream closed the connection"
    " before the end of the response head"
)


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n",
        b"HTTP/1.1 2",
        b"HTTP/1.1 100 Continue\r\n\r\n",
    ],
    ids=["status-and-a-header", "part-of-a-status-line", "a-1xx-alone"],
)
def test_a_response_head_cut_short_is_told_in_one_wording_on_every_path(
    upstream: RawUpstream, path: DataPath, head: bytes
) -> None:
    """The wire said "UpstreamClosed: the upstream closed the connection before the end of
    the response head"; aiohttp "ServerDisconnectedError: <RawResponseMessage(version=...,
    code=200, reason='OK', headers=<CIMultiDictProxy('Content-Type': ...)>, ...)>", its
    internals and the upstream's headers (after a 1xx alone, "before answering"); httpx
    "before answering", though the answer had begun. The backend took the request: it is
    not sent again."""
    upstream.default = by_target({b"/v1/chat/completions": close_after(head)})
    with path.proxy(upstream.url) as base:
        status, message = ask(base)
        assert status == 502, message
        assert message == HEAD_CUT
        assert until(lambda: counted(base, REQUESTS, error_type="upstream_error") == 1)
    assert len(upstream.requests) == 1


def test_a_response_head_cut_short_on_a_kept_alive_connection_is_not_sent_again(
    upstream: RawUpstream, path: DataPath
) -> None:
    """On a reused connection too (where a close before any byte of the answer sends the
    request once more): the head had begun, so the backend took it."""
    cut = close_after(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
    upstream.default = by_target({b"/v1/chat/completions": cut})
    with path.proxy(upstream.url) as base:
        status, message = ask_on_a_pooled_connection(base)
        assert status == 502, message
        assert message == HEAD_CUT
    assert (upstream.connections, len(upstream.requests)) == (1, 2)


def test_a_status_line_cut_short_is_a_head_cut_for_aiohttps_pure_python_parser(
    upstream: RawUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp's pure-Python parser (AIOHTTP_NO_EXTENSIONS) gives up on a status line cut
    short, and its disconnect error said "Server disconnected", as for no answer at all:
    a kept-alive connection's request went once more, though the backend took it. A proxy
    of its own: the parser is chosen as aiohttp is imported."""
    monkeypatch.setenv("TOKENPROBE_RELAY", "asgi")
    monkeypatch.setenv("AIOHTTP_NO_EXTENSIONS", "1")
    upstream.default = by_target({b"/v1/chat/completions": close_after(b"HTTP/1.1 2")})
    with serving(upstream.url, "--upstream-transport", "aiohttp") as base:
        first = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "hi"})
        assert first.status_code == 200, first.text
        status, message = ask(base)  # on the connection the first left in the pool
        assert status == 502, message
        assert message == HEAD_CUT
    assert (upstream.connections, len(upstream.requests)) == (1, 2)


@pytest.mark.parametrize(
    ("head", "words"),
    [
        (b"HTTP/1.1 200 OK\r\nSet-Cookie " + SECRET + b"\r\n", "Invalid HTTP header"),
        (b"SECRET-UPSTREAM-STATUS-LINE\r\n", "Bad status line"),
    ],
    ids=["no-colon", "no-status-line"],
)
def test_a_malformed_head_never_tells_the_upstreams_bytes_with_aiohttps_pure_python_parser(
    upstream: RawUpstream, monkeypatch: pytest.MonkeyPatch, head: bytes, words: str
) -> None:
    """Its words put the bytes after the reason on one line ("Invalid HTTP header:
    b'Set-Cookie session=...'", "Bad status line '...'"), where the C parser puts them on
    a line of their own: the cookie reached the client's 502 and the record."""
    monkeypatch.setenv("TOKENPROBE_RELAY", "asgi")
    monkeypatch.setenv("AIOHTTP_NO_EXTENSIONS", "1")
    response = head + b"content-length: 2\r\n\r\n{}"
    upstream.default = by_target({b"/v1/chat/completions": answer(response)})
    with serving(upstream.url, "--upstream-transport", "aiohttp") as base:
        status, message = ask(base)
    assert status == 502, message
    assert "SECRET" not in message
    assert message == f"upstream: {MALFORMED}{words}"


def test_aiohttps_disconnect_error_never_tells_the_head_it_had_begun() -> None:
    """Its `message` is then aiohttp's RawResponseMessage, whose repr (aiohttp's internals
    and the upstream's headers) `describe` told; now a phrase, wherever one reaches it."""
    headers = CIMultiDictProxy(CIMultiDict({"set-cookie": "secret"}))
    raw = ((b"set-cookie", b"secret"),)
    begun = RawResponseMessage(HttpVersion11, 200, "OK", headers, raw, True, None, False, False)
    said = describe(aiohttp.ServerDisconnectedError(begun))
    assert said == "ServerDisconnectedError: the upstream closed the connection"
