"""The upstream's answer to a handshake (proxy/server/tunnel/handshake.py): read on the side
(UpstreamAnswer), a 101 opens the tunnel, a final status refuses it, and a head that never
ends is bounded; gated before it goes (AnswerHead), a refusal's head is whole before it
goes, says the connection closes, and nothing after the refusal's end goes at all."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from proxy.server.tunnel.handshake import MAX_ANSWER_HEAD, AnswerHead, UpstreamAnswer


def test_an_endless_header_is_a_refusal_in_bounded_memory_and_time() -> None:
    """httptools joins a header's value across reads: 75 MB of one header once held 121 MB
    of the proxy's memory and a core for 6 s (review). Past MAX_ANSWER_HEAD the answer is
    read as a refusal, and what was read is let go."""
    refused: list[bool] = []
    answer = UpstreamAnswer(lambda: refused.append(True))
    tracemalloc.start()
    started = time.perf_counter()
    try:
        answer.feed(b"HTTP/1.1 101 Switching Protocols\r\nX-Big: ")
        for _ in range(2000):  # 20 MB
            answer.feed(b"a" * 10_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused == [True]
    assert peak < 4 * MAX_ANSWER_HEAD
    assert time.perf_counter() - started < 1.0


def test_a_refusal_with_a_long_body_is_read_whole() -> None:
    """Only the head is bounded: a refusal's body runs as long as its length says."""
    refused: list[bool] = []
    answer = UpstreamAnswer(lambda: refused.append(True))
    answer.feed(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 200000\r\n\r\n" + b"x" * 150_000)
    assert refused == []
    answer.feed(b"x" * 50_000)
    assert refused == [True] and answer.status == 403


def test_a_101_after_an_interim_answer_opens_the_tunnel_with_what_followed() -> None:
    answer = UpstreamAnswer(lambda: None)
    switch = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    assert answer.feed(b"HTTP/1.1 100 Continue\r\n\r\n" + switch + b"\x81\x02hi") == b"\x81\x02hi"
    assert answer.status == 101


# the upstream's scheme://authority and base path, and the proxy as the client named it
ENDS = (b"http://10.0.0.5:8000/tenant-a", b"http://llm.example.com")
REDIRECT = (
    b"HTTP/1.1 302 Found\r\nLocation: http://10.0.0.5:8000/tenant-a/v1/realtime2\r\n"
    b"content-length: 2\r\n\r\nno"
)


def closing(refusal: bytes) -> bytes:
    """A refusal as the client gets it: `connection: close` first among its fields."""
    line = refusal.index(b"\r\n") + 2
    return refusal[:line] + b"connection: close\r\n" + refusal[line:]


def test_a_refusals_redirect_into_the_upstream_points_at_the_proxy_once_its_head_is_whole() -> None:
    head = AnswerHead(ENDS)
    cut = REDIRECT.index(b"tenant-a/v1")  # the head split inside its Location
    assert head(REDIRECT[:cut]) == b""  # held: a Location cannot be rewritten in pieces
    assert head(REDIRECT[cut:]) == closing(
        REDIRECT.replace(
            b"http://10.0.0.5:8000/tenant-a/v1/realtime2", b"http://llm.example.com/v1/realtime2"
        )
    )
    assert head.done and not head.released


def test_a_101_and_the_frames_after_it_go_on_as_they_came() -> None:
    switch = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n\x81\x02hi"
    head = AnswerHead(ENDS)
    assert head(switch) == switch and head.done and head.released
    # an interim head first: it goes on at once, and the next head is held till whole
    head = AnswerHead(ENDS)
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    assert head(interim + switch[:20]) == interim and not head.done
    assert head(switch[20:]) == switch and head.done and head.released


def test_a_redirect_elsewhere_or_without_a_host_to_name_stays_as_sent() -> None:
    elsewhere = REDIRECT.replace(b"10.0.0.5:8000/tenant-a", b"auth.example")
    assert AnswerHead(ENDS)(elsewhere) == closing(elsewhere)
    assert AnswerHead(None)(REDIRECT) == closing(REDIRECT)


def test_an_answer_head_over_the_bound_goes_on_as_it_is() -> None:
    head = AnswerHead(ENDS)
    endless = b"HTTP/1.1 302 Found\r\nx-long: " + b"a" * MAX_ANSWER_HEAD
    assert head(endless[:100]) == b""
    assert head(endless[100:]) == endless and head.done


SMUGGLED = b'HTTP/1.1 200 OK\r\ncontent-length: 17\r\n\r\n{"smuggled":true}'


def _through(answer: bytes, cut: int) -> tuple[bytes, int]:
    """`answer` through a gate in two reads cut at `cut`: what went on, and how many
    times the gate told of bytes past the refusal's end."""
    told: list[bool] = []
    head = AnswerHead(None, past_end=lambda: told.append(True))
    return head(answer[:cut]) + head(answer[cut:]), len(told)


FORBIDDEN = b"HTTP/1.1 403 Forbidden\r\n"
CLOSE = b"connection: close\r\n"


@pytest.mark.parametrize(
    ("refusal", "relayed"),
    [
        (
            FORBIDDEN + b"content-length: 2\r\n\r\nno",
            FORBIDDEN + CLOSE + b"content-length: 2\r\n\r\nno",
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b"HTTP/1.1 204 No Content\r\n" + CLOSE + b"\r\n"),
        (
            b"HTTP/1.1 100 Continue\r\n\r\n" + FORBIDDEN + b"content-length: 0\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n" + FORBIDDEN + CLOSE + b"content-length: 0\r\n\r\n",
        ),
        (
            FORBIDDEN + b"transfer-encoding: chunked\r\n\r\n"
            b"2;x=y\r\nno\r\n1\r\n!\r\n0\r\nx-trailer: t\r\n\r\n",
            # each piece llhttp reads is a chunk anew, the trailers dropped
            FORBIDDEN + CLOSE + b"transfer-encoding: chunked\r\n\r\n2\r\nno\r\n1\r\n!\r\n0\r\n\r\n",
        ),
    ],
    ids=["length", "bodiless", "after-a-1xx", "chunked"],
)
def test_nothing_after_a_refusals_end_goes_however_the_reads_split(
    refusal: bytes, relayed: bytes
) -> None:
    """A whole response after a refusal's end, in the reads that brought the refusal, cut
    at every byte: the client gets the refusal and nothing after it, and the gate tells
    of the bytes past the end once. They once went on as they came."""
    answer = refusal + SMUGGLED
    assert _through(answer, len(answer)) == (relayed, 1)  # one read
    # two reads may cut a chunk the upstream sent whole in two: its pieces are joined
    same = _dechunked if b"chunked" in refusal else _as_is
    for cut in range(len(answer) + 1):
        got, told = _through(answer, cut)
        assert (cut, same(got), told) == (cut, same(relayed), 1)


def _as_is(relayed: bytes) -> bytes:
    return relayed


def _dechunked(relayed: bytes) -> bytes:
    """A relayed chunked answer with its body's chunks joined: cut reads chunk a piece
    the upstream sent as one in two."""
    head, _, rest = relayed.partition(b"\r\n\r\n")
    body = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        if int(size, 16) == 0:
            assert rest == b"\r\n", rest  # the last chunk, and nothing after it
            return head + b"\r\n\r\n" + body
        body, rest = body + rest[: int(size, 16)], rest[int(size, 16) + 2 :]


def test_bytes_no_response_starts_with_after_a_refusal_go_nowhere() -> None:
    got, told = _through(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 2\r\n\r\nnozzzz", 0)
    assert (got, told) == (closing(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 2\r\n\r\nno"), 1)


def test_a_refusal_read_to_the_close_goes_whole_and_tells_of_nothing() -> None:
    refusal = b"HTTP/1.1 401 Unauthorized\r\n\r\nnope, HTTP/1.1 200 OK is text here"
    for cut in range(len(refusal) + 1):
        assert _through(refusal, cut) == (closing(refusal), 0)
