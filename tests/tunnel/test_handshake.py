"""The upstream's answer to a handshake, read on the side (proxy/server/tunnel/handshake.py
UpstreamAnswer): a 101 opens the tunnel, a final status refuses it, and a head that never
ends is bounded."""

from __future__ import annotations

import time
import tracemalloc

from proxy.server.tunnel.handshake import MAX_ANSWER_HEAD, UpstreamAnswer


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
