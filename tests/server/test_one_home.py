"""Concerns every data path shares, each read in one place (issue 31): the client's
address (headers.py `client_address`), the Host a redirect names (headers.py
`redirect_ends`), and the request target, normalised once at the head and handed on
(the tunnel's `admit` takes the wire's). End to end, X-Forwarded-For and the rewritten
Location are checked on every path in tests/hostile/ (test_client.py, test_upstream.py,
test_tunnel.py); these pin the readings themselves, forms no loopback test can make."""

from __future__ import annotations

import pytest

from proxy.core.paths import Target
from proxy.core.upstream_url import UpstreamURL
from proxy.server.admission import Refused, where_to
from proxy.server.headers import client_address, redirect_ends
from proxy.server.tunnel.handshake import admit
from tests.server.conftest import no_proxy

pytestmark = no_proxy

UPSTREAM = UpstreamURL.parse("http://10.0.0.5:8000/tenant-a")


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        (("127.0.0.1", 50000), "127.0.0.1"),  # uvicorn's `client`, a transport's peername
        (["10.1.2.3", 50000], "10.1.2.3"),  # an ASGI server may give a list
        (("::1", 50000, 0, 0), "::1"),  # a peername over IPv6: four fields
        (None, None),  # an ASGI scope without a client
        ("", None),  # a peername over a Unix socket
        ("/run/tokenprobe.sock", None),
        ((), None),
    ],
)
def test_the_clients_address_is_read_alike_from_every_paths_peer(
    peer: object, address: str | None
) -> None:
    assert client_address(peer) == address


def test_a_redirect_names_the_host_the_client_named_and_the_proxys_scheme() -> None:
    headers = [(b"accept", b"*/*"), (b"host", b"proxy.example:9")]
    assert redirect_ends(UPSTREAM, False, headers) == (
        b"http://10.0.0.5:8000/tenant-a",
        b"http://proxy.example:9",
    )
    assert redirect_ends(UPSTREAM, True, headers) == (
        b"http://10.0.0.5:8000/tenant-a",
        b"https://proxy.example:9",
    )


def test_without_a_host_a_redirect_names_no_host_and_becomes_a_path() -> None:
    """HTTP/1.0 without Host: no name of the proxy's to put in the Location, which becomes
    a path (headers.py `redirected`; end to end in
    tests/server/test_edge_hops_and_redirects.py), never the upstream's own URL."""
    assert redirect_ends(UPSTREAM, False, [(b"accept", b"*/*")]) == (
        b"http://10.0.0.5:8000/tenant-a",
        b"",
    )


HANDSHAKE = [
    (b"host", b"proxy.example"),
    (b"upgrade", b"websocket"),
    (b"connection", b"Upgrade"),
    (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="),
    (b"sec-websocket-version", b"13"),
]


def test_the_tunnel_takes_the_target_the_wire_normalised_at_the_head() -> None:
    """The wire parses and normalises the target once at the head; the handshake goes
    upstream with that one, not a second reading of the raw bytes."""
    where = Target("/v1/realtime", "model=m")
    admitted = admit(b"GET", b"not read", HANDSHAKE, UPSTREAM, "127.0.0.1", where)
    assert admitted.request.startswith(b"GET /tenant-a/v1/realtime?model=m HTTP/1.1\r\n")
    assert (admitted.path, admitted.query) == ("/v1/realtime", "model=m")


def test_a_target_the_wire_refused_at_the_head_is_the_tunnels_refusal() -> None:
    where = where_to(b"/v1/%2e%2e/%2e%2e/x", b"")
    assert isinstance(where, Refused)
    with pytest.raises(Refused) as refused:
        admit(b"GET", b"/v1/%2e%2e/%2e%2e/x", HANDSHAKE, UPSTREAM, None, where)
    assert (refused.value.status, refused.value.kind) == (400, "invalid_request_target")


def test_without_the_wires_reading_the_tunnel_reads_the_target_as_the_wire_does() -> None:
    """A caller with no parse of its own (tests/ws_proxy.py) gets the same target."""
    raw = b"/v1/./realtime?model=m"
    assert (
        admit(b"GET", raw, HANDSHAKE, UPSTREAM).request
        == (
            admit(b"GET", raw, HANDSHAKE, UPSTREAM, where=where_to(b"/v1/./realtime", b"model=m"))
        ).request
    )
