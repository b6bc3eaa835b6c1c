"""The upstream's answer to a handshake, read on the side (proxy/server/tunnel/handshake.py
UpstreamAnswer): a 101 opens the tunnel, a final status refuses it, and a head that never
ends is bounded."""

from __future__ import annotations

import time
import tracemalloc

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


def test_a_refusals_redirect_into_the_upstream_points_at_the_proxy_once_its_head_is_whole() -> None:
    head = AnswerHead(ENDS)
    cut = REDIRECT.index(b"tenant-a/v1")  # the head split inside its Location
    assert head(REDIRECT[:cut]) == b""  # held: a Location cannot be rewritten in pieces
    assert head(REDIRECT[cut:]) == REDIRECT.replace(
        b"http://10.0.0.5:8000/tenant-a/v1/realtime2", b"http://llm.example.com/v1/realtime2"
    )
    assert head.done


def test_a_101_and_the_frames_after_it_go_on_as_they_came() -> None:
    switch = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n\x81\x02hi"
    head = AnswerHead(ENDS)
    assert head(switch) == switch and head.done
    # an interim head first: it goes on at once, and the next head is held till whole
    head = AnswerHead(ENDS)
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    assert head(interim + switch[:20]) == interim and not head.done
    assert head(switch[20:]) == switch and head.done


def test_a_redirect_elsewhere_or_without_a_host_to_name_stays_as_sent() -> None:
    elsewhere = REDIRECT.replace(b"10.0.0.5:8000/tenant-a", b"auth.example")
    assert AnswerHead(ENDS)(elsewhere) == elsewhere
    assert AnswerHead(None)(REDIRECT) == REDIRECT


def test_an_answer_head_over_the_bound_goes_on_as_it_is() -> None:
    head = AnswerHead(ENDS)
    endless = b"HTTP/1.1 302 Found\r\nx-long: " + b"a" * MAX_ANSWER_HEAD
    assert head(endless[:100]) == b""
    assert head(endless[100:]) == endless and head.done
