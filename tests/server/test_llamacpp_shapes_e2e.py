"""llama.cpp's stream shapes through the proxy, on both data paths, from an upstream that
replays real `llama-server` bytes (tests/fixtures/streams/llamacpp/) and their broken
variants: timings moved back to the finish chunk byte for byte, the engine's figures on
the record, nonsense timings counted and relayed, and a usage chunk with a member the
proxy cannot place turning usage injection off for the upstream."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.core.measurement import TokenSource
from tests.conftest import ProxyUnderTest
from tests.core.test_strip import _llamacpp_pair
from tests.paths import STREAMS
from tests.servers import request_body, serve

CHAT = "/v1/chat/completions"
MODEL = "tiny"
ASKED, DIRECT = _llamacpp_pair()
NO_USAGE = (STREAMS / "llamacpp" / "chat_stream_no_usage.sse").read_bytes()
NONSENSE = ASKED.replace(
    b'"cache_n":0,"prompt_n":11,"prompt_ms":',
    b'"cache_n":-1,"prompt_n":"11","prompt_ms":1e300,"x":',
)
NOVEL = ASKED.replace(b',"timings":', b',"novel":{"a":1},"timings":')


class Upstream:
    """An ASGI app answering every chat request with `asked` when it asks for usage and
    with `unasked` when it does not; it keeps the bodies it received."""

    def __init__(self, asked: bytes, unasked: bytes = NO_USAGE) -> None:
        self.asked, self.unasked = asked, unasked
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await request_body(receive)
        if scope["path"] != CHAT:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"data":[]}'})
            return
        obj = json.loads(body)
        self.bodies.append(obj)
        asked = (obj.get("stream_options") or {}).get("include_usage") is True
        stream = self.asked if asked else self.unasked
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for event in stream.split(b"\n\n")[:-1]:
            await send({"type": "http.response.body", "body": event + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def proxied(
    start_proxy: Callable[..., ProxyUnderTest],
) -> Iterator[Callable[[Upstream], ProxyUnderTest]]:
    stack: list[Any] = []

    def start(upstream: Upstream) -> ProxyUnderTest:
        server = serve(upstream)
        stack.append(server)
        running = server.__enter__()
        return start_proxy(running.url, model_allowlist=(MODEL,))

    yield start
    for server in stack:
        server.__exit__(None, None, None)


def fetch(proxy: ProxyUnderTest, usage: bool) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", proxy.url + CHAT, json=body, timeout=20) as response:
        assert response.status_code == 200
        return b"".join(response.iter_raw())


def timings(stream: bytes) -> dict[str, Any]:
    (found,) = [orjson.loads(e[6:])["timings"] for e in stream.split(b"\n\n") if b'"timings"' in e]
    return found  # type: ignore[no-any-return]


def test_a_client_that_asked_for_no_usage_gets_the_finish_chunk_with_its_timings(
    proxied: Callable[[Upstream], ProxyUnderTest],
) -> None:
    upstream = Upstream(ASKED)
    proxy = proxied(upstream)
    assert fetch(proxy, usage=False) == DIRECT
    assert upstream.bodies[0]["stream_options"] == {"include_usage": True}  # the proxy asked
    (record,) = proxy.wait_records(1, exact=True)
    t = timings(ASKED)
    assert record.engine is not None
    assert record.engine.time_to_first_token == t["prompt_ms"] / 1000
    assert record.engine.queue_time is None
    assert (record.output_tokens, record.prompt_tokens) == (
        t["predicted_n"],
        t["prompt_n"] + t["cache_n"],
    )
    assert record.token_source is TokenSource.USAGE and record.cached_prompt_tokens == 0
    split = record.ttft_split()
    # a replay is quicker than the engine was: its prompt_ms is then scaled to the TTFT
    assert split is not None and split[0] is None and record.ttft is not None
    assert split[1] == min(t["prompt_ms"] / 1000, record.ttft)
    assert split[1] + split[2] == pytest.approx(record.ttft, abs=1e-12)


def test_nonsense_timings_are_relayed_counted_and_left_out(
    proxied: Callable[[Upstream], ProxyUnderTest],
) -> None:
    proxy = proxied(Upstream(NONSENSE))
    assert fetch(proxy, usage=True) == NONSENSE  # the client asked: nothing to strip
    (record,) = proxy.wait_records(1, exact=True)
    assert record.error_type is None and record.status_code == 200
    assert record.engine is not None
    assert record.engine.invalid == ("prompt_ms", "cache_n", "prompt_n")
    assert record.engine.time_to_first_token is None and record.engine.cached_tokens is None
    assert record.engine.output_tokens == 5  # the fields that made sense stay
    assert (record.output_tokens, record.prompt_tokens) == (5, 11)  # from usage
    assert proxy.sample("tokenprobe_measurement_failures_total", stage="engine_timings") == 1


def test_a_member_the_proxy_cannot_place_stops_it_asking_that_upstream(
    proxied: Callable[[Upstream], ProxyUnderTest],
) -> None:
    upstream = Upstream(NOVEL)
    proxy = proxied(upstream)
    first = fetch(proxy, usage=False)
    assert b'"novel"' not in first and b'"usage"' not in first  # not guessed onto a chunk
    assert proxy.sample("tokenprobe_measurement_failures_total", stage="usage_injection") == 1
    assert fetch(proxy, usage=False) == NO_USAGE  # not asked: the backend's own stream
    assert fetch(proxy, usage=False) == NO_USAGE
    assert [b.get("stream_options") for b in upstream.bodies] == [
        {"include_usage": True},
        None,
        None,
    ]
    records = proxy.wait_records(3, exact=True)
    # without usage, the tokens are the engine's own account (the finish chunk's timings)
    assert [r.token_source for r in records[1:]] == [TokenSource.ENGINE] * 2
    t = timings(NO_USAGE)
    assert records[2].output_tokens == t["predicted_n"]
    assert records[2].prompt_tokens == t["prompt_n"] + t["cache_n"]
    assert proxy.sample("tokenprobe_measurement_failures_total", stage="usage_injection") == 1
