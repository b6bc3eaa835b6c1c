"""Defect 1 (paths) and the normaliser itself: one normalised path is routed, measured and
forwarded, byte for byte, with the query as the client sent it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.paths import BadTarget, normalise
from tests.edge_backend import RawBackend, backend, metric, serving
from tests.server.conftest import no_proxy

CHAT_BODY = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'


def raw_exchange(base: str, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send exactly `head` (request line and headers, no final blank line) and `body`;
    return the status and the raw response."""
    port = urlsplit(base).port
    assert port is not None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        length = b"content-length: %d\r\n" % len(body) if body else b""
        sock.sendall(head + b"\r\nhost: x\r\nconnection: close\r\n" + length + b"\r\n" + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    response = b"".join(chunks)
    return int(response.split(b" ", 2)[1]), response


@pytest.fixture(scope="module", params=["aiohttp", "httpx"])
def edge(request: pytest.FixtureRequest, relay: str) -> Iterator[tuple[RawBackend, str]]:
    if relay == "wire" and request.param == "httpx":
        pytest.skip("--upstream-transport is the ASGI relay's: the wire has its own client")
    transport = ("--upstream-transport", request.param)
    with backend() as upstream, serving(upstream.url, *transport) as base:
        yield upstream, base


@pytest.mark.parametrize(
    ("sent", "forwarded"),
    [
        (b"/v1/x/../chat/completions", b"/v1/chat/completions"),
        (b"/v1/./chat/completions", b"/v1/chat/completions"),
        (b"/v1/x/%2e%2E/chat/completions", b"/v1/chat/completions"),
        (b"/v1/chat/%63ompletions", b"/v1/chat/completions"),
    ],
)
def test_dot_segments_are_removed_once_and_the_request_is_measured_by_that_path(
    edge: tuple[RawBackend, str], sent: bytes, forwarded: bytes
) -> None:
    upstream, base = edge
    before = metric(base, "tokenprobe_requests_total", code="200", error_type="none")
    status, response = raw_exchange(base, b"POST " + sent + b" HTTP/1.1", CHAT_BODY)
    assert status == 200 and b"Hello" in response
    assert upstream.seen[-1].request_line == b"POST " + forwarded + b" HTTP/1.1"
    # measured, not an unmeasured pass-through
    assert metric(base, "tokenprobe_requests_total", code="200", error_type="none") == before + 1


@pytest.mark.parametrize(
    ("sent", "forwarded"),
    [
        (b"/v1/models?a=%2F&b=../x&c=%3F%23", b"/v1/models?a=%2F&b=../x&c=%3F%23"),
        (b"/v1/files/a%3Fb%23c", b"/v1/files/a%3Fb%23c"),
        (b"/v1/files/a%3fb?q=1", b"/v1/files/a%3Fb?q=1"),
        (b"/v1/files/caf%C3%A9", b"/v1/files/caf%C3%A9"),
        (b"/v1/x/..?keep=..%2F", b"/v1/?keep=..%2F"),
    ],
)
def test_encoded_delimiters_and_the_query_reach_the_backend_unchanged(
    edge: tuple[RawBackend, str], sent: bytes, forwarded: bytes
) -> None:
    upstream, base = edge
    status, _ = raw_exchange(base, b"GET " + sent + b" HTTP/1.1")
    assert status == 200
    assert upstream.seen[-1].request_line == b"GET " + forwarded + b" HTTP/1.1"


@pytest.mark.parametrize(
    ("sent", "reason"),
    [
        (b"/v1/files%2F..%2Fadmin", b"encoded slash"),
        (b"/v1/a%5C..%5Cb", b"encoded backslash"),
        # raw, it went on as the %5C refused above (a server that splits at it: /metrics)
        (b"/v1\\..\\metrics", b"a backslash"),
        (b"/v1/a%00b", b"%00"),
        (b"/v1/a%zz", b"malformed percent-encoding"),
        (b"/v1/../../etc", b"climbs above the root"),
    ],
)
def test_targets_that_cannot_be_normalised_safely_get_a_400_and_never_reach_the_backend(
    edge: tuple[RawBackend, str], sent: bytes, reason: bytes
) -> None:
    upstream, base = edge
    count = len(upstream.seen)
    status, response = raw_exchange(base, b"POST " + sent + b" HTTP/1.1", CHAT_BODY)
    assert status == 400
    assert b"invalid_request_target" in response and reason in response
    assert len(upstream.seen) == count


# -- the normaliser on its own ----------------------------------------------------------


@no_proxy
def test_rfc3986_examples_of_dot_segment_removal() -> None:
    # RFC 3986 §5.2.4's worked example, and the §5.4 cases that stay under the root.
    assert normalise(b"/a/b/c/./../../g").path == "/a/g"
    assert normalise(b"/a/b/c/.").path == "/a/b/c/"
    assert normalise(b"/a/b/c/..").path == "/a/b/"
    assert normalise(b"/a/b/c/g.").path == "/a/b/c/g."
    assert normalise(b"/a/b/c/..g").path == "/a/b/c/..g"


_PATH_BYTES = st.lists(
    st.sampled_from(
        [
            *(b"/", b".", b"..", b"%2e", b"%2E", b"%2F", b"%", b"%41", b"%c3%a9", b"a", b"v1"),
            *(b"~", b"%00", b"%5c", b" ", b"\xff", b"?", b"#", b"%3f", b";", b"//"),
        ]
    ),
    max_size=20,
).map(lambda parts: b"/" + b"".join(parts))


@no_proxy
@given(_PATH_BYTES)
def test_normalised_paths_are_fixed_points_without_dot_segments(raw: bytes) -> None:
    try:
        target = normalise(raw)
    except BadTarget:
        return
    path = target.path
    assert path.startswith("/") and path.isascii()
    segments = path.split("/")
    assert "." not in segments and ".." not in segments
    assert "%2F" not in path.upper() and " " not in path and "?" not in path
    assert normalise(path.encode()).path == path  # normalising twice changes nothing


@no_proxy
@given(st.binary(max_size=200))
def test_any_bytes_either_normalise_or_are_refused_with_a_message(raw: bytes) -> None:
    try:
        target = normalise(b"/" + raw, raw)
    except BadTarget as exc:
        assert str(exc)
        return
    assert target.request_target.isascii() and "#" not in target.query
