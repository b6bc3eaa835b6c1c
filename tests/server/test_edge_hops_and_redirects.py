"""What the proxy changes between client and upstream, and only that: a header the client's
Connection names stops at the proxy whatever its name (Accept-Encoding too, on HTTP and on
a WebSocket handshake), and a redirect into the upstream's URL never shows the upstream's
address, even to a client that named no Host (HTTP/1.0): it becomes a path on the proxy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator

import pytest

from proxy.core.upstream_url import UpstreamURL
from proxy.server.headers import redirect_ends, redirected
from tests.edge_backend import serving
from tests.hostile.client import Switcher, responses, whole, ws_head
from tests.hostile.peers import (
    Conn,
    RawUpstream,
    Request,
    by_target,
    exchange,
    get,
    raw_upstream,
)
from tests.server.conftest import no_proxy, paths

Proxies = Callable[[str], str]


@pytest.fixture(scope="module")
def shared() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        yield server


@pytest.fixture(scope="module")
def proxies(relay: str) -> Iterator[Proxies]:
    """`proxies(upstream_url)`: a `tokenprobe serve` on the module's path in front of it,
    started once per URL (a base path is another URL)."""
    started: dict[str, str] = {}
    with contextlib.ExitStack() as stack:

        def take(url: str) -> str:
            if url not in started:
                started[url] = stack.enter_context(serving(url, "--first-byte-timeout", "30"))
            return started[url]

        yield take


@pytest.fixture
def upstream(shared: RawUpstream) -> Iterator[RawUpstream]:
    shared.reset()
    yield shared
    shared.hang_up()


# -- headers the client's Connection names ------------------------------------------------


def test_accept_encoding_named_by_connection_does_not_go_upstream(
    upstream: RawUpstream, proxies: Proxies
) -> None:
    """RFC 9110 §7.6.1: a header the Connection field names is hop-by-hop, whatever its
    name. The proxy re-adds the client's Accept-Encoding to an unmeasured request (it
    takes it out only to decide on it); named in Connection, it stops here like the
    X-Forwarded-For beside it (the proxy then adds the client's address alone)."""
    base = proxies(upstream.url)
    request = (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: accept-encoding, x-forwarded-for\r\n"
        b"Accept-Encoding: br\r\nX-Forwarded-For: 10.9.9.9\r\nX-Kept: 1\r\n\r\n"
    )
    got = exchange(base, request, idle=0.5, done=whole())
    assert got.startswith(b"HTTP/1.1 200 "), got
    (seen,) = upstream.requests
    assert seen.header(b"accept-encoding") == [], seen.head
    assert seen.header(b"x-forwarded-for") == [b"127.0.0.1"], seen.head
    assert seen.header(b"x-kept") == [b"1"]


def test_accept_encoding_not_named_by_connection_still_goes_upstream(
    upstream: RawUpstream, proxies: Proxies
) -> None:
    """The other side of the rule: an end-to-end Accept-Encoding reaches the upstream of
    an unmeasured request as the client sent it."""
    base = proxies(upstream.url)
    request = (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: x-hop\r\nAccept-Encoding: br\r\n\r\n"
    )
    assert exchange(base, request, idle=0.5, done=whole()).startswith(b"HTTP/1.1 200 ")
    (seen,) = upstream.requests
    assert seen.header(b"accept-encoding") == [b"br"], seen.head


@paths("wire", why="only the wire tunnels WebSockets (the ASGI relay refuses the upgrade)")
def test_accept_encoding_named_by_a_handshakes_connection_does_not_go_upstream(
    upstream: RawUpstream, proxies: Proxies
) -> None:
    upstream.default = Switcher(delay=0.0).script()
    base = proxies(upstream.url)
    handshake = ws_head(b"/v1/echo", extra=b"Accept-Encoding: gzip\r\nX-Kept: 1\r\n").replace(
        b"Connection: Upgrade", b"Connection: Upgrade, accept-encoding"
    )
    assert exchange(base, handshake, idle=0.5, done=whole()).startswith(b"HTTP/1.1 101")
    (seen,) = upstream.requests
    assert seen.header(b"accept-encoding") == [], seen.head
    assert seen.header(b"x-kept") == [b"1"] and seen.header(b"upgrade") == [b"websocket"]


def test_an_empty_query_goes_as_none_on_both_paths(upstream: RawUpstream, proxies: Proxies) -> None:
    """`/v1/models?` and `/v1/models` are one to an ASGI server (its scope's query_string
    is b"" for both), so the relay cannot keep the `?`; the wire drops it alike
    (docs/proxying.md). A query with anything in it goes as sent."""
    base = proxies(upstream.url)
    for target in (b"/v1/models?", b"/v1/models?a=%7e&b"):
        assert exchange(base, get(target), idle=0.5, done=whole()).startswith(b"HTTP/1.1 200")
    assert [r.target for r in upstream.requests] == [b"/v1/models", b"/v1/models?a=%7e&b"]


# -- a redirect to a client that named no Host ---------------------------------------------


def _redirect(location: bytes) -> Callable[[Conn, Request], Awaitable[None]]:
    async def answer(conn: Conn, request: Request) -> None:
        conn.write(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: " + location
                   + b"\r\ncontent-length: 0\r\n\r\n")  # fmt: skip
        await conn.drain()

    return answer


@pytest.mark.parametrize("base_path", ["", "/tenant-a"])
def test_a_redirect_into_the_upstream_becomes_a_path_for_a_client_that_named_no_host(
    upstream: RawUpstream, proxies: Proxies, base_path: str
) -> None:
    """An HTTP/1.0 client may send no Host: the proxy has no name of its own to put in
    the Location, and the upstream's (Starlette builds its redirect from the Host the
    proxy sent) would take the client around the proxy. A path-absolute Location (RFC
    9110 §10.2.2 allows a relative one) keeps it on whatever address it came by; what
    follows the upstream's URL (query, fragment) is kept."""
    own = f"http://127.0.0.1:{upstream.port}{base_path}".encode()
    upstream.default = by_target(
        {
            base_path.encode() + b"/v1/models/": _redirect(own + b"/v1/models?x=1#f"),
            base_path.encode() + b"/v1/root": _redirect(own),
            base_path.encode() + b"/v1/away": _redirect(b"https://elsewhere.example/v1/models"),
        }
    )
    asked = {
        b"/v1/models/": b"/v1/models?x=1#f",
        b"/v1/root": b"/",
        b"/v1/away": b"https://elsewhere.example/v1/models",
    }
    base = proxies(upstream.url + base_path)
    for target, want in asked.items():
        got = exchange(base, b"GET " + target + b" HTTP/1.0\r\n\r\n", idle=0.5, done=whole())
        ((status, head, _),) = responses(got)
        assert (status, Request(head, b"").header(b"location")) == (307, [want]), got


@no_proxy
@pytest.mark.parametrize(
    ("location", "want"),
    [
        (b"http://up:8000/base/v1/models", b"/v1/models"),
        (b"http://up:8000/base?x=1", b"/?x=1"),
        (b"http://up:8000/base#top", b"/#top"),
        (b"http://up:8000/base", b"/"),
        # a path that begins with `//` would read as another host's (`//evil.example/x`,
        # a network-path reference): "/." before it keeps it a path on the proxy
        (b"http://up:8000/base//evil.example/x", b"/.//evil.example/x"),
        (b"http://up:8000/basement", b"http://up:8000/basement"),  # not under the base path
        (b"http://up:8000/v1/models", b"http://up:8000/v1/models"),
        (b"/v1/models", b"/v1/models"),
    ],
)
def test_without_a_host_a_location_into_the_upstream_is_made_a_path(
    location: bytes, want: bytes
) -> None:
    upstream = UpstreamURL.parse("http://up:8000/base")
    ends = redirect_ends(upstream, False, [(b"x-other", b"1")])
    assert ends is not None
    assert redirected([(b"location", location)], *ends) == [(b"location", want)]


@no_proxy
def test_with_a_host_a_location_into_the_upstream_names_the_proxy() -> None:
    upstream = UpstreamURL.parse("http://up:8000/base")
    ends = redirect_ends(upstream, True, [(b"host", b"llm.example")])
    assert ends is not None
    location = [(b"location", b"http://up:8000/base//x?y")]
    assert redirected(location, *ends) == [(b"location", b"https://llm.example//x?y")]
