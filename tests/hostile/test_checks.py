"""The two decisions the hostile-client fixes hinge on, as pure functions: which request
is a WebSocket handshake (the one check both data paths make) and which form of a path
the proxy's own routes are matched on."""

from __future__ import annotations

import pytest

from proxy.core.paths import normalise, route_key
from proxy.server.tunnel import is_websocket_upgrade

KEY = (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ==")
HANDSHAKE = [
    (b"host", b"x"),
    (b"upgrade", b"websocket"),
    (b"connection", b"keep-alive, Upgrade"),
    KEY,
    (b"sec-websocket-version", b"13"),
]


def test_a_well_formed_handshake_is_one() -> None:
    assert is_websocket_upgrade(b"GET", HANDSHAKE)
    assert is_websocket_upgrade(b"GET", [(n.upper(), v) for n, v in HANDSHAKE])
    assert is_websocket_upgrade(b"GET", [*HANDSHAKE, (b"content-length", b"0")])


@pytest.mark.parametrize(
    ("why", "method", "headers", "http_11"),
    [
        ("a POST", b"POST", HANDSHAKE, True),
        ("HTTP/1.0", b"GET", HANDSHAKE, False),
        ("no Upgrade", b"GET", [h for h in HANDSHAKE if h[0] != b"upgrade"], True),
        ("Upgrade: h2c", b"GET", [*HANDSHAKE[:1], (b"upgrade", b"h2c"), *HANDSHAKE[2:]], True),
        ("no Connection: upgrade", b"GET", [h for h in HANDSHAKE if h[0] != b"connection"], True),
        ("no key", b"GET", [h for h in HANDSHAKE if h is not KEY], True),
        ("two keys", b"GET", [*HANDSHAKE, KEY], True),
        (
            "a key of 15 bytes",
            b"GET",
            [*HANDSHAKE[:3], (KEY[0], b"AAAAAAAAAAAAAAAAAAAA"), *HANDSHAKE[4:]],
            True,
        ),
        (
            "a key not base64",
            b"GET",
            [*HANDSHAKE[:3], (KEY[0], b"!!!!!!!!!!!!!!!!!!!!!!=="), *HANDSHAKE[4:]],
            True,
        ),
        ("version 8", b"GET", [*HANDSHAKE[:4], (b"sec-websocket-version", b"8")], True),
        ("no version", b"GET", HANDSHAKE[:4], True),
        ("a body", b"GET", [*HANDSHAKE, (b"content-length", b"5")], True),
        ("a chunked body", b"GET", [*HANDSHAKE, (b"transfer-encoding", b"chunked")], True),
    ],
)
def test_anything_else_is_not(
    why: str, method: bytes, headers: list[tuple[bytes, bytes]], http_11: bool
) -> None:
    assert not is_websocket_upgrade(method, headers, http_11=http_11), why


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b"/metrics", "/metrics"),
        (b"//metrics", "/metrics"),
        (b"/healthz/", "/healthz"),
        (b"///healthz//", "/healthz"),
        (b"/v1/../metrics", "/metrics"),
        (b"/v1/%2e%2e/healthz", "/healthz"),
        (b"/ui//app.js", "/ui/app.js"),
        (b"/", "/"),
        (b"//", "/"),
        (b"/v1/chat/completions", "/v1/chat/completions"),
    ],
)
def test_the_proxys_own_routes_are_matched_on_one_form(raw: bytes, key: str) -> None:
    assert route_key(normalise(raw).path) == key


def test_the_forwarded_path_keeps_its_empty_segments() -> None:
    assert normalise(b"/v1//models/").path == "/v1//models/"
