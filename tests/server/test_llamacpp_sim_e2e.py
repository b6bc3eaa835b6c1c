"""llama.cpp's `timings` through the proxy, in front of the simulator playing `llama-server`
(proxy/sim/llamacpp.py), on both data paths: what tests/llamacpp/ checks against a real
server, here on every run without one.

The client's stream is the stream direct whether it asked for usage or not (the proxy asks
for usage, the simulator then moves `timings` to the usage chunk as llama.cpp does, and the
proxy puts them back on the finish chunk: proxy/core/strip.py). Two requests differ only in
their `id`, `created` second and the timings' times and rates; those are replaced and
counted as tests/llamacpp/test_real_llamacpp.py does (its `normalise`), and the rest
compared byte for byte. The figures are the simulator's own: tokens equal `predicted_n` and
`prompt_n + cache_n`, the engine part of the TTFT split is `prompt_ms`, `cache_n` (the
simulator's prefix cache) is the cached prompt tokens.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from proxy.core.measurement import Measurement, TokenSource
from proxy.sim.llamacpp import BUILD_INFO
from proxy.sim.state import SimRequest
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.llamacpp.test_real_llamacpp import TIMED, normalise, timings_of
from tests.pairs import payloads

TTFT = 0.08
TOKENS = 6
PROGRAM = {"x-sim-ttft": str(TTFT), "x-sim-tps": "200", "x-sim-output-tokens": str(TOKENS)}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture
def sim(start_sim: Callable[..., Running]) -> Running:
    return start_sim(
        backend_kind="llamacpp", record_bodies=True, prefix_cache=16, prefix_cache_block=1
    )


@pytest.fixture
def proxy(sim: Running, start_proxy: Callable[..., ProxyUnderTest]) -> ProxyUnderTest:
    return start_proxy(sim.url)


def chat_body(usage: bool, content: str = "hello there, how are you", **extra: Any) -> Any:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        **extra,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def fetch(url: str, body: Any) -> bytes:
    with httpx.stream("POST", url, json=body, headers=PROGRAM, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return b"".join(r.iter_raw())


def served(sim: Running, path: str = CHAT) -> SimRequest:
    """The simulator's last record of a request on `path` (not the proxy's identity probes)."""
    found: list[SimRequest] = [r for r in sim.app.state.requests() if r.path == path]
    return found[-1]


def record(proxy: ProxyUnderTest, n: int) -> Measurement:
    return proxy.wait_records(n, exact=True)[-1]


# -- the stream is the stream direct ---------------------------------------------------------


@pytest.mark.parametrize("usage", [False, True], ids=["no_usage", "include_usage"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_streams_through_the_proxy_equal_direct(
    proxy: ProxyUnderTest, sim: Running, path: str, usage: bool
) -> None:
    # `cache_prompt: false`, as the real-server test does: the second request does not meet
    # the first one's cache, so both count the same tokens
    body: dict[str, Any] = chat_body(usage, cache_prompt=False)
    if path == COMPLETIONS:
        body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "once upon"}
    direct = fetch(sim.url + path, body)
    proxied = fetch(proxy.url + path, body)
    asked = served(sim, path).body.get("stream_options")
    assert asked == {"include_usage": True}  # the proxy asked for usage either way
    if usage or path == COMPLETIONS:  # nothing to strip: the backend's bytes, every one
        assert hashlib.sha256(proxied).hexdigest() == served(sim, path).body_sha256
    (want, counts), (got, got_counts) = normalise(direct), normalise(proxied)
    assert timings_of(direct)["cache_n"] == timings_of(proxied)["cache_n"] == 0
    n = len(payloads(direct))
    assert counts == got_counts and counts[:2] == (n, n) and counts[2] == len(TIMED)
    assert got == want, (direct, proxied)
    last = payloads(proxied)[-1]
    assert list(last)[-1] == "timings"  # where llama.cpp writes it: the last member
    if path == CHAT and not usage:  # on the finish chunk, for a client that did not ask
        assert last["choices"][0]["finish_reason"] == "stop" and "usage" not in last
    # the text tokens and the EOS, which llama-server counts (n_decoded)
    assert last["timings"]["predicted_n"] == served(sim, path).completion_tokens == TOKENS + 1


# -- tokens, the TTFT split and the cache are the simulator's own ----------------------------


@pytest.mark.parametrize("usage", [False, True], ids=["no_usage", "include_usage"])
def test_tokens_and_the_engine_part_of_the_split_are_its_timings(
    proxy: ProxyUnderTest, sim: Running, usage: bool
) -> None:
    began = time.monotonic()
    t = timings_of(fetch(proxy.url + CHAT, chat_body(usage)))
    elapsed = time.monotonic() - began
    m = record(proxy, 1)
    assert m.token_source is TokenSource.USAGE and m.ok
    assert m.output_tokens == t["predicted_n"] == TOKENS + 1  # the text and the EOS
    assert m.prompt_tokens == t["prompt_n"] + t["cache_n"] == served(sim).prompt_tokens
    engine = m.engine
    assert engine is not None and engine.queue_time is None  # llama.cpp reports none
    assert engine.time_to_first_token == pytest.approx(t["prompt_ms"] / 1000, abs=1e-12)
    assert engine.output_tokens == t["predicted_n"] and engine.cached_tokens == t["cache_n"]
    # what the simulator did: its programmed TTFT runs from `ttft_from` (the loop's clock
    # at the call's start), prompt_ms from the engine having the request (after the
    # simulator's own routing, longer on a loaded machine), so the first token was written
    # at or after ttft_from + TTFT (uvloop's clock counts whole milliseconds)
    seen = served(sim)
    assert seen.queued_at is not None and seen.ttft_from is not None
    first_token = seen.queued_at + t["prompt_ms"] / 1000
    assert seen.ttft_from + TTFT - 0.002 <= first_token
    assert t["prompt_ms"] / 1000 <= elapsed
    split = m.ttft_split()
    assert split is not None and m.ttft is not None
    queue, engine_part, outside = split
    assert queue is None and engine_part == engine.time_to_first_token
    assert engine_part <= m.ttft
    assert math.isclose(engine_part + outside, m.ttft, abs_tol=1e-9)
    labels = {"model": MODEL, "endpoint": CHAT, "stream": "true"}
    assert proxy.sample(
        "tokenprobe_engine_time_to_first_token_seconds_sum", **labels
    ) == pytest.approx(t["prompt_ms"] / 1000)
    assert proxy.sample("tokenprobe_engine_queue_time_seconds_count", **labels) == 0


def test_not_streamed_tokens_and_engine_ttft_are_its_timings(proxy: ProxyUnderTest) -> None:
    body = {k: v for k, v in chat_body(False).items() if k != "stream"}
    answer = httpx.post(proxy.url + CHAT, json=body, headers=PROGRAM, timeout=30).json()
    t = answer["timings"]
    m = record(proxy, 1)
    assert (m.stream, m.ok, m.output_tokens) == (False, True, t["predicted_n"])
    assert m.prompt_tokens == t["prompt_n"] + t["cache_n"]
    assert m.engine is not None
    assert m.engine.time_to_first_token == pytest.approx(t["prompt_ms"] / 1000, abs=1e-12)


def test_a_repeated_prompt_shows_its_cache_n_as_cached_tokens(
    proxy: ProxyUnderTest, sim: Running
) -> None:
    content = "measure the cache: " + " ".join(f"word{i}" for i in range(40))
    timings = [timings_of(fetch(proxy.url + CHAT, chat_body(False, content))) for _ in range(2)]
    first, second = proxy.wait_records(2, exact=True)
    assert timings[0]["cache_n"] == 0 and first.cached_prompt_tokens in (0, None)
    # all of the prompt is in the simulator's prefix cache but one token, as in llama.cpp
    assert timings[1]["cache_n"] == served(sim).prompt_tokens - 1 > 0
    assert second.cached_prompt_tokens == timings[1]["cache_n"]
    assert second.prompt_tokens == timings[1]["prompt_n"] + timings[1]["cache_n"]
    total = proxy.sample("tokenprobe_cached_prompt_tokens_total", model=MODEL, endpoint=CHAT)
    assert total == timings[1]["cache_n"]


def test_the_proxy_sees_a_llamacpp(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(sim.url, models_refresh=0.2)
    deadline = time.monotonic() + 10
    value = 0.0
    while not value and time.monotonic() < deadline:
        value = proxy.sample("tokenprobe_backend_info", kind="llamacpp", version=BUILD_INFO)
        time.sleep(0.05)
    assert value == 1
