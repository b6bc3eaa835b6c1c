"""Defects 4, 5 and 7: hostile or odd upstream answers (a giant event line, a corrupt chunk
size, a JSON answer to a stream request), each through a real `tokenprobe serve`."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from proxy.core.sse import EventTooLarge, SSEDecoder
from proxy.core.strip import UsageEventStripper
from tests.edge_backend import backend, metric, rss_bytes, serving, serving_process
from tests.server.conftest import no_proxy

CHAT = "/v1/chat/completions"
STREAM = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
MiB = 1024 * 1024


# -- defect 4: one giant event line -----------------------------------------------------


@no_proxy
def test_decoder_gives_up_at_its_limit_and_never_recopies_a_growing_line() -> None:
    decoder = SSEDecoder(max_event_bytes=8 * MiB)
    piece = b"x" * 65536
    started = time.perf_counter()
    decoder.feed(b'data: {"a":"')
    with pytest.raises(EventTooLarge):
        for _ in range(200):  # 12.5 MiB in 64 KiB reads: linear, well under a second
            decoder.feed(piece)
    assert time.perf_counter() - started < 1.0


@no_proxy
def test_stripper_releases_a_giant_event_at_its_limit_and_then_steps_aside() -> None:
    stripper = UsageEventStripper(max_event_bytes=MiB)
    out = [stripper.feed(b'data: {"choices":[{"delta":{"content":"')]
    out += [stripper.feed(b"x" * 65536) for _ in range(32)]
    assert sum(map(len, out)) > MiB and stripper.gave_up  # released, not held
    assert stripper.feed(b"rest") == b"rest"


def test_a_giant_event_line_flows_to_the_client_while_it_arrives_and_is_not_measured() -> None:
    half = 16 * MiB
    progress = {"received": 0, "at_pause": -1}

    async def giant(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        )
        writer.write(ROLE + b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"')
        for _ in range(2):
            for _ in range(half // 65536):
                writer.write(b"x" * 65536)
                await writer.drain()
            if progress["at_pause"] < 0:
                await asyncio.sleep(1.0)  # the line is half sent: the client must have it
                progress["at_pause"] = progress["received"]
        writer.write(b'"}}]}\n\ndata: [DONE]\n\n')
        await writer.drain()
        writer.close()

    with (
        backend(responder=giant) as upstream,
        serving_process(upstream.url, "--max-event-bytes", str(MiB)) as (base, process),
    ):
        idle_rss = rss_bytes(process.pid)
        peak = 0
        with httpx.stream("POST", base + CHAT, json=STREAM, timeout=30) as response:
            for n, chunk in enumerate(response.iter_raw()):
                progress["received"] += len(chunk)
                if n % 64 == 0:
                    peak = max(peak, rss_bytes(process.pid))
        total = progress["received"]
        assert total > 2 * half  # everything reached the client
        assert progress["at_pause"] > half - 2 * MiB  # ... as it arrived, not at the end
        assert peak - idle_rss < 64 * MiB
        assert metric(base, "tokenprobe_measurement_failures_total", stage="event_too_large") == 1
        assert httpx.get(base + "/healthz", timeout=1).status_code == 200


# -- defect 5: a corrupt chunk size -------------------------------------------------------


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
def test_a_corrupt_chunk_size_counts_as_stream_truncated_at_once(transport: str) -> None:
    async def corrupt(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        writer.write(b"%x\r\n%s\r\n" % (len(ROLE), ROLE))
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"zz\r\nnot a chunk\r\n")  # not hex: the body cannot go on
        await writer.drain()
        await asyncio.sleep(10)  # and the connection stays open
        writer.close()

    flags = ("--idle-timeout", "8", "--upstream-transport", transport)
    with backend(responder=corrupt) as upstream, serving(upstream.url, *flags) as base:
        started = time.monotonic()
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream("POST", base + CHAT, json=STREAM, timeout=30) as response,
        ):
            for _ in response.iter_raw():
                pass
        assert time.monotonic() - started < 3
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            truncated = metric(base, "tokenprobe_requests_total", error_type="stream_truncated")
            if truncated:
                break
            time.sleep(0.05)
        assert truncated == 1
        assert metric(base, "tokenprobe_requests_total", error_type="upstream_timeout") == 0


# -- defect 7: a JSON answer to a stream request ----------------------------------------


def test_a_json_answer_to_a_stream_request_reaches_the_client_whole() -> None:
    body = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}}'
    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    with backend(response=answer) as upstream, serving(upstream.url) as base:
        response = httpx.post(base + CHAT, json=STREAM, timeout=10)
        assert response.status_code == 200
        assert response.content == body
        assert b'"include_usage":true' in upstream.seen[-1].body  # the proxy did ask
