"""Fuzzing the stream readers: no exception escapes, and relayed bytes equal input bytes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.observe import StreamObserver
from proxy.core.request import CHAT, COMPLETIONS, RequestInfo
from proxy.core.sse import SSEDecoder
from proxy.core.strip import UsageEventStripper
from tests.conftest import ProxyUnderTest
from tests.servers import serve

# Pieces that make the readers take every branch: real event shapes, broken ones, and noise.
FRAGMENTS = [
    b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"hi \\u2028 there"},"finish_reason":null}]}\n\n',
    b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}}]}\n\n',
    b'data: {"choices":[{"text":"x","finish_reason":"length"}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n',
    b'data: {"error":{"message":"boom"}}\n\n',
    b'data: {"error":"plain"}\n\n',
    b"data: [DONE]\n\n",
    b": keep-alive\r\n\r\n",
    b"data:{}\r\r",
    b"data: {not json\n\n",
    b"data: \xff\xfe\n\n",
    b'data: {"choices":"nope","usage":7}\n\n',
    b"data: [1,2]\n\n",
    b"event: x\nid: 1\nretry: 5\ndata: \n\n",
    b"\n",
    b"\r",
    b"data",
]

streams = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.binary(max_size=40)), max_size=30).map(
    b"".join
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in [*points, len(data)]:
        pieces.append(data[last:p])
        last = p
    return pieces


@settings(max_examples=400)
@given(data=streams, cuts=st.lists(st.integers(min_value=0), max_size=12), chat=st.booleans())
def test_observer_never_raises_on_any_bytes(data: bytes, cuts: list[int], chat: bool) -> None:
    info = RequestInfo(CHAT if chat else COMPLETIONS, "m", True, False, None, None)
    observer = StreamObserver(info, start=0.0, collect_text=True)
    observer.open(200, "text/event-stream", 0.1)
    for i, piece in enumerate(split(data, cuts)):
        observer.feed(piece, 0.2 + i)
    observer.end_of_stream(100.0)
    observer.outcome()
    counts = observer.counts_from_usage() or observer.counts_from_chunks()
    observer.measurement(
        end=101.0,
        started_at=0.0,
        status_code=200,
        counts=counts,
        error_type=None,
        error_message=None,
    )


@settings(max_examples=400)
@given(data=streams, cuts=st.lists(st.integers(min_value=0), max_size=12))
def test_decoder_is_split_invariant(data: bytes, cuts: list[int]) -> None:
    whole = SSEDecoder()
    expected = whole.feed(data) + whole.flush()
    pieces = SSEDecoder()
    got: list[bytes] = []
    for piece in split(data, cuts):
        got += pieces.feed(piece)
    assert got + pieces.flush() == expected


@settings(max_examples=400)
@given(data=streams, cuts=st.lists(st.integers(min_value=0), max_size=12))
def test_stripper_only_ever_removes_whole_usage_events(data: bytes, cuts: list[int]) -> None:
    stripper = UsageEventStripper()
    out = b"".join(stripper.feed(p) for p in split(data, cuts)) + stripper.flush()
    unsplit = UsageEventStripper()
    assert out == unsplit.feed(data) + unsplit.flush()
    if b'"usage"' not in data:
        assert out == data


class ScriptedUpstream:
    """Streams whatever chunks the test hands it, one network write each."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.lock = threading.Lock()

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        with self.lock:
            chunks = list(self.chunks)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedUpstream, str]]:
    upstream = ScriptedUpstream()
    with serve(upstream, lifespan="off") as server:
        yield upstream, server.url


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=streams, cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_proxy_relays_any_stream_byte_for_byte(
    scripted: tuple[ScriptedUpstream, str],
    start_proxy: Callable[..., ProxyUnderTest],
    data: bytes,
    cuts: list[int],
) -> None:
    upstream, url = scripted
    upstream.chunks = [p for p in split(data, cuts) if p]
    proxy = _shared_proxy(start_proxy, url)
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "messages": []}
    received = httpx.post(proxy.url + CHAT, json=body).content
    assert received == data
    assert proxy.sample("tokenprobe_measurement_failures_total", stage="observe") == 0


_proxies: dict[str, ProxyUnderTest] = {}


def _shared_proxy(start_proxy: Callable[..., ProxyUnderTest], url: str) -> ProxyUnderTest:
    # One proxy for all examples: starting a server per example would dominate the run.
    if url not in _proxies:
        _proxies[url] = start_proxy(url)
    return _proxies[url]
