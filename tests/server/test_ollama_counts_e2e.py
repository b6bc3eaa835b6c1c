"""Ollama through the proxy on both data paths: load answers, placeholder usage and whole
tool calls, read from the record and the scraped series.

- `ollama run` / `ollama stop` load and unload a model with an empty prompt, no messages
  or no input (cmd/cmd.go loadOrUnloadModel); the answers carry no Metrics. Each is a
  request, with no tokens: nothing goes into the token histograms.
- Ollama's /v1/completions with include_usage puts a 0/0 usage on every chunk
  (middleware/openai.go CompleteWriter): a stream cut before its real usage is counted
  from its chunks, not as 0 tokens of each.
- Ollama sends a tool call whole once its parser has it: the client-side TPOT and decode
  speed are not observed, and the TTFT is not split; the engine's own figures stay.

The simulator plays Ollama's load answers and zeroed usage; a raw upstream replays the
tool answer's lines at their instants (ollama/ollama @ fb30760, server/routes.go
ChatHandler: a call's line, the done line at the EOS's step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import ollama
import orjson
import pytest

from proxy.core.measurement import ErrorType, TokenSource
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.hostile.peers import Conn, RawUpstream, Request, by_target, raw_upstream

MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def histogram_counts(proxy: ProxyUnderTest, endpoint: str, *names: str) -> list[float]:
    return [proxy.sample(name + "_count", model=MODEL, endpoint=endpoint) for name in names]


# -- load and unload answers ---------------------------------------------------------------


def test_load_and_unload_answers_are_requests_without_tokens(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(ollama_load_time=0.2)
    proxy = start_proxy(sim.url)
    with ollama.Client(host=proxy.url) as client:
        loaded = client.generate(model=MODEL, prompt="")  # `ollama run`: the model loads
        chat = client.chat(model=MODEL, messages=[])
        embedded = client.embed(model=MODEL, input=[])
        unloaded = client.generate(model=MODEL, prompt="", keep_alive=0)  # `ollama stop`
    assert [loaded.done_reason, chat.done_reason, unloaded.done_reason] == ["load"] * 2 + ["unload"]
    assert embedded.embeddings == []
    records = proxy.wait_records(4, exact=True)
    for m in records:
        assert (m.ok, m.status_code, m.stream, m.ttft) == (True, 200, False, None), m.endpoint
        assert (m.prompt_tokens, m.output_tokens, m.token_source) == (None, None, TokenSource.NONE)
    assert records[0].e2e >= 0.2  # the load it waited for
    assert [m.raw_finish_reason for m in records] == ["load", "load", None, "unload"]
    for endpoint, requests in (("/api/generate", 2), ("/api/chat", 1), ("/api/embed", 1)):
        names = ("tokenprobe_request_prompt_tokens", "tokenprobe_request_generation_tokens")
        assert histogram_counts(proxy, endpoint, *names) == [0, 0], endpoint
        assert histogram_counts(proxy, endpoint, "tokenprobe_e2e_request_latency_seconds") == [
            requests
        ]


# -- Ollama's /v1/completions, its usage a placeholder on every chunk ----------------------------


def test_a_completions_stream_cut_before_its_usage_is_counted_from_its_chunks(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(record_bodies=True)
    proxy = start_proxy(sim.url)
    body = {"model": MODEL, "prompt": "hi", "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    program = {"x-sim-usage-mode": "zeroed", "x-sim-output-tokens": "6", "x-sim-tps": "200",
               "x-sim-fault": "close_no_done", "x-sim-fault-after": "4"}  # fmt: skip
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, headers=program) as r:
        got = b"".join(r.iter_raw())
    zeroed = b'"usage":{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}'
    assert got.count(zeroed) == 4 and b"[DONE]" not in got  # four chunks, then the cut
    (m,) = proxy.wait_records(1, exact=True)
    assert m.error_type is ErrorType.STREAM_TRUNCATED
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (None, 4, TokenSource.CHUNKS)
    names = ("tokenprobe_request_prompt_tokens", "tokenprobe_request_generation_tokens")
    assert histogram_counts(proxy, "/v1/completions", *names) == [0, 1]


# -- a tool call sent whole ------------------------------------------------------------------

CALL = {"id": "call_k3j1xq7w",
        "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
STAMP = "2026-08-22T10:00:00.123456789Z"
#: prefill 100 ms, 40 call tokens at 20 ms held by the tool parser until the call is whole,
#: the EOS's step 20 ms later: 41 tokens in 820 ms by Ollama's own account
DONE_METRICS = {"total_duration": 925_000_000, "load_duration": 5_000_000,
                "prompt_eval_count": 30, "prompt_eval_duration": 100_000_000,
                "eval_count": 41, "eval_duration": 820_000_000}  # fmt: skip
LINES = [
    (0.905, {"model": MODEL, "created_at": STAMP,
             "message": {"role": "assistant", "content": "", "tool_calls": [CALL]},
             "done": False}),
    (0.925, {"model": MODEL, "created_at": STAMP,
             "message": {"role": "assistant", "content": ""},
             "done": True, "done_reason": "stop", **DONE_METRICS}),
]  # fmt: skip


async def tool_answer(conn: Conn, request: Request) -> None:
    """ChatHandler's stream (streamResponse: application/x-ndjson, Go's chunked framing,
    one chunk a line), each line at its instant after the request."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
    for i, (at, obj) in enumerate(LINES):
        await asyncio.sleep(max(0.0, start + at - loop.time()))
        line = orjson.dumps(obj) + b"\n"
        conn.write((head if i == 0 else b"") + b"%x\r\n%b\r\n" % (len(line), line))
        await conn.drain()
    conn.write(b"0\r\n\r\n")
    await conn.drain()


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    with raw_upstream() as server:
        server.default = by_target({b"/api/chat": tool_answer})
        yield server


def test_a_call_sent_whole_has_no_client_side_tpot_and_no_ttft_split(
    upstream: RawUpstream, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(upstream.url)
    with ollama.Client(host=proxy.url) as client:
        parts = list(client.chat(model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True))
    calls = parts[0].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_weather" and parts[-1].done
    (m,) = proxy.wait_records(1, exact=True)
    assert m.ok and [c.outcome for c in m.tool_calls] == ["complete"]
    assert m.ttft is not None and m.ttft >= 0.9  # the finished call
    assert (m.tpot, m.decode_tokens_per_second) == (None, None)
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (30, 41, TokenSource.USAGE)
    assert m.engine is not None and m.engine.tokens_per_second == pytest.approx(50.0)
    assert m.ttft_parts() == (None, 0.1, None)  # the engine's own prefill, nothing outside
    endpoint = "/api/chat"
    assert histogram_counts(proxy, endpoint, "tokenprobe_time_to_first_token_seconds") == [1]
    timed = ("tokenprobe_request_time_per_output_token_seconds",
             "tokenprobe_request_decode_tokens_per_second",
             "tokenprobe_time_to_first_token_outside_engine_seconds")  # fmt: skip
    assert histogram_counts(proxy, endpoint, *timed) == [0, 0, 0]
    stream = {"model": MODEL, "endpoint": endpoint, "stream": "true"}
    for part in (
        "tokenprobe_engine_load_time_seconds",
        "tokenprobe_engine_time_to_first_token_seconds",
    ):
        assert proxy.sample(part + "_count", **stream) == 0, part  # no split: no part of one
