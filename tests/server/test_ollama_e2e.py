"""Ollama's native API through the proxy, in front of the simulator in Ollama's shapes, with
the official `ollama` client unmodified (and httpx for the bytes).

The simulator (proxy/sim/ollama.py) reports the durations it really took and the counts it
really sent; each test checks the proxy's record against those figures exactly, and the
client's bytes against the SHA-256 of what the simulator sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import httpx
import ollama
import orjson
import pytest

from proxy.core.measurement import ErrorType, Measurement, TokenSource
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.demo_run import demo_run
from tests.server.conftest import paths

TTFT = 0.1
LOAD = 0.4
TOKENS = 8  # text tokens: each a content line; eval_count counts the EOS after them too
PROGRAM = {"x-sim-ttft": str(TTFT), "x-sim-tps": "100", "x-sim-output-tokens": str(TOKENS)}
MESSAGES: Any = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture
def sim(start_sim: Callable[..., Running]) -> Running:
    return start_sim(record_bodies=True, max_model_len=64)


@pytest.fixture
def proxy(sim: Running, start_proxy: Callable[..., ProxyUnderTest]) -> ProxyUnderTest:
    return start_proxy(sim.url)


def client(proxy: ProxyUnderTest, **headers: str) -> ollama.Client:
    return ollama.Client(host=proxy.url, headers={**PROGRAM, **headers})


def record(proxy: ProxyUnderTest, n: int = 1) -> Measurement:
    return proxy.wait_records(n, exact=True)[-1]


def seconds(ns: int | None) -> float:
    assert ns is not None
    return ns / 1e9


# -- chat and generate, streamed --------------------------------------------------------


def test_streamed_chat_figures_equal_the_done_line(proxy: ProxyUnderTest, sim: Running) -> None:
    parts = list(client(proxy).chat(model=MODEL, messages=MESSAGES, stream=True))
    done = parts[-1]
    assert done.done and done.done_reason == "stop" and not parts[0].done
    m = record(proxy)
    assert m.prompt_tokens == sim.app.state.last().prompt_tokens  # the simulator's count
    assert (m.endpoint, m.stream, m.ok, m.status_code) == ("/api/chat", True, True, 200)
    assert m.token_source is TokenSource.USAGE
    assert (m.prompt_tokens, m.output_tokens) == (done.prompt_eval_count, done.eval_count)
    assert m.output_tokens == TOKENS + 1 and m.content_events == TOKENS  # and the EOS
    assert (m.finish_reason, m.raw_finish_reason) == ("stop", "stop")
    assert m.response_model == MODEL
    engine = m.engine
    assert engine is not None and engine.queue_time is None
    assert engine.load_time == seconds(done.load_duration)
    assert engine.time_to_first_token == seconds(done.prompt_eval_duration)
    assert engine.generation_time == seconds(done.eval_duration)
    assert m.ttft is not None and m.ttft >= TTFT
    split = m.load_split()
    assert split is not None and abs(sum(split) - m.ttft) < 1e-9
    assert split[1] == seconds(done.prompt_eval_duration) >= TTFT - 0.01


def test_cold_model_load_is_its_own_part_of_the_split(proxy: ProxyUnderTest) -> None:
    cold = client(proxy, **{"x-sim-load-time": str(LOAD)})
    done = list(cold.chat(model=MODEL, messages=MESSAGES, stream=True))[-1]
    m = record(proxy)
    assert m.ttft is not None and m.ttft >= LOAD + TTFT
    split = m.load_split()
    assert split is not None
    load, engine, outside = split
    assert load == seconds(done.load_duration) >= LOAD
    assert engine == seconds(done.prompt_eval_duration) >= TTFT - 0.01
    assert 0 <= outside < m.ttft - load  # the load is not counted as outside the engine
    labels = {"model": MODEL, "endpoint": "/api/chat", "stream": "true"}
    assert proxy.sample("tokenprobe_engine_load_time_seconds_sum", **labels) == pytest.approx(load)
    assert proxy.sample("tokenprobe_engine_load_time_seconds_count", **labels) == 1
    sums = sum(
        proxy.sample(name, **labels)
        for name in (
            "tokenprobe_engine_load_time_seconds_sum",
            "tokenprobe_engine_time_to_first_token_seconds_sum",
        )
    ) + proxy.sample(
        "tokenprobe_time_to_first_token_outside_engine_seconds_sum",
        model=MODEL,
        endpoint="/api/chat",
    )
    assert sums == pytest.approx(m.ttft)
    # the queue part is vLLM's: an Ollama request leaves it empty
    assert proxy.sample("tokenprobe_engine_queue_time_seconds_count", **labels) == 0


def test_thinking_comes_before_content_and_is_measured_as_content(
    proxy: ProxyUnderTest, sim: Running
) -> None:
    parts = list(
        client(proxy, **{"x-sim-thinking-tokens": "3"}).chat(
            model=MODEL, messages=MESSAGES, stream=True, think=True
        )
    )
    assert [bool(p.message.thinking) for p in parts[:4]] == [True, True, True, False]
    assert parts[3].message.content
    m = record(proxy)
    assert m.content_events == TOKENS and m.output_tokens == TOKENS + 1  # and the EOS


def test_streamed_generate_figures_and_bytes(proxy: ProxyUnderTest, sim: Running) -> None:
    body = {"model": MODEL, "prompt": "Why is the sky blue?"}
    with httpx.stream("POST", proxy.url + "/api/generate", json=body, headers=PROGRAM) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        got = b"".join(r.iter_raw())
    last = sim.app.state.last()
    assert hashlib.sha256(got).hexdigest() == last.body_sha256
    done = orjson.loads(got.rstrip(b"\n").rsplit(b"\n", 1)[1])
    m = record(proxy)
    assert (m.endpoint, m.stream, m.ok) == ("/api/generate", True, True)
    assert (m.prompt_tokens, m.output_tokens) == (done["prompt_eval_count"], done["eval_count"])
    assert m.engine is not None and m.engine.load_time == done["load_duration"] / 1e9


def test_streamed_generate_with_the_official_client(proxy: ProxyUnderTest) -> None:
    parts = list(client(proxy).generate(model=MODEL, prompt="Why is the sky blue?", stream=True))
    done = parts[-1]
    assert done.done and "".join(p.response or "" for p in parts[:-1])
    m = record(proxy)
    assert (m.endpoint, m.stream, m.ok, m.finish_reason) == ("/api/generate", True, True, "stop")
    assert (m.prompt_tokens, m.output_tokens) == (done.prompt_eval_count, done.eval_count)
    assert m.output_tokens == TOKENS + 1 and m.ttft is not None and m.ttft >= TTFT  # EOS
    assert m.engine is not None
    assert m.engine.time_to_first_token == seconds(done.prompt_eval_duration)


def test_streamed_chat_bytes_equal_what_the_backend_sent(
    proxy: ProxyUnderTest, sim: Running
) -> None:
    body = {"model": MODEL, "messages": MESSAGES}
    # 200 tokens (0.7 s here): streamed, not buffered, is the client holding its first bytes while
    # the backend is still sending. (Counting reads was not: a client process stalled
    # under load read a short stream's every line in one read.)
    long = {**PROGRAM, "x-sim-output-tokens": "200"}
    with httpx.stream("POST", proxy.url + "/api/chat", json=body, headers=long) as r:
        reads = r.iter_raw()
        chunks = [next(reads)]
        assert sim.app.state.last().outcome == "in_progress"  # type: ignore[union-attr]
        chunks += list(reads)
    assert hashlib.sha256(b"".join(chunks)).hexdigest() == sim.app.state.last().body_sha256


# -- not streamed ------------------------------------------------------------------------


def test_chat_and_generate_not_streamed(proxy: ProxyUnderTest) -> None:
    c = client(proxy)
    chat = c.chat(model=MODEL, messages=MESSAGES, stream=False)
    gen = c.generate(model=MODEL, prompt="Why is the sky blue?", stream=False)
    chat_m, gen_m = proxy.wait_records(2, exact=True)
    for answer, m, endpoint in ((chat, chat_m, "/api/chat"), (gen, gen_m, "/api/generate")):
        assert (m.endpoint, m.stream, m.ok, m.ttft) == (endpoint, False, True, None)
        assert (m.prompt_tokens, m.output_tokens) == (answer.prompt_eval_count, answer.eval_count)
        assert m.token_source is TokenSource.USAGE and m.finish_reason == "stop"
        assert m.engine is not None and m.engine.load_time == seconds(answer.load_duration)
        assert m.engine.time_to_first_token == seconds(answer.prompt_eval_duration)
    labels = {"model": MODEL, "endpoint": "/api/chat", "stream": "false"}
    assert proxy.sample("tokenprobe_engine_load_time_seconds_count", **labels) == 1


def test_embed(proxy: ProxyUnderTest) -> None:
    answer = client(proxy, **{"x-sim-load-time": "0.2"}).embed(model=MODEL, input=["ab", "cdefg"])
    assert len(answer.embeddings) == 2
    m = record(proxy)
    assert (m.endpoint, m.ok, m.stream) == ("/api/embed", True, False)
    assert m.prompt_tokens == answer.prompt_eval_count == 3
    assert m.output_tokens is None and m.token_source is TokenSource.USAGE
    assert m.engine is not None and m.engine.load_time == seconds(answer.load_duration) >= 0.2


def test_load_only_generate_is_not_a_stop(proxy: ProxyUnderTest) -> None:
    answer = client(proxy).generate(model=MODEL, prompt="")
    assert answer.done_reason == "load"
    m = record(proxy)
    assert (m.ok, m.finish_reason, m.raw_finish_reason) == (True, "other", "load")


# -- errors ------------------------------------------------------------------------------


def test_model_not_pulled_is_not_found(proxy: ProxyUnderTest) -> None:
    with pytest.raises(ollama.ResponseError) as caught:
        list(client(proxy).chat(model="llama3", messages=MESSAGES, stream=True))
    assert caught.value.status_code == 404
    m = record(proxy)
    assert m.error_type is ErrorType.NOT_FOUND and m.status_code == 404
    assert m.error_message == "model 'llama3' not found"


def test_prompt_over_the_context_is_context_length(proxy: ProxyUnderTest) -> None:
    # Ollama refuses a prompt over the context only with context shift off (`"shift":
    # false`, api/types.go ChatRequest.Shift; on by default it cuts the prompt and answers
    # 200), which the official client has no argument for: the bytes go by httpx.
    long: Any = [{"role": "user", "content": "word " * 100}]
    body = {"model": MODEL, "messages": long, "stream": False, "shift": False}
    answer = httpx.post(f"{proxy.url}/api/chat", json=body, headers=PROGRAM, timeout=30)
    assert answer.status_code == 400 and "context length" in answer.json()["error"]
    assert record(proxy).error_type is ErrorType.CONTEXT_LENGTH
    with_shift = client(proxy).chat(model=MODEL, messages=long, stream=False)
    assert with_shift.done_reason in ("stop", "length")
    assert record(proxy, 2).error_type is None


def test_an_error_line_mid_stream_is_a_stream_error(proxy: ProxyUnderTest) -> None:
    faulty = client(proxy, **{"x-sim-fault": "error_event", "x-sim-fault-after": "2"})
    with pytest.raises(ollama.ResponseError):
        list(faulty.chat(model=MODEL, messages=MESSAGES, stream=True))
    m = record(proxy)
    assert m.error_type is ErrorType.STREAM_ERROR and m.content_events == 2
    assert m.error_message is not None and "error was encountered" in m.error_message


# -- broken backends: measured and defined, never a crash, the bytes relayed -------------


@pytest.mark.parametrize(
    ("headers", "error", "malformed"),
    [
        ({"x-sim-fault": "malformed", "x-sim-fault-after": "3"}, None, 1),
        ({"x-sim-no-done": "1"}, ErrorType.STREAM_TRUNCATED, 0),
        ({"x-sim-fault": "close_no_done", "x-sim-fault-after": "4"}, ErrorType.STREAM_TRUNCATED, 0),
    ],
    ids=["line_not_json", "no_done_line", "cut_after_4"],
)
def test_broken_streams_are_counted_and_relayed_whole(
    proxy: ProxyUnderTest,
    sim: Running,
    headers: dict[str, str],
    error: ErrorType | None,
    malformed: int,
) -> None:
    body = {"model": MODEL, "messages": MESSAGES}
    with httpx.stream(
        "POST", proxy.url + "/api/chat", json=body, headers={**PROGRAM, **headers}
    ) as r:
        got = b"".join(r.iter_raw())
    assert hashlib.sha256(got).hexdigest() == sim.app.state.last().body_sha256
    m = record(proxy)
    assert m.error_type is error
    if error is ErrorType.STREAM_TRUNCATED:
        assert m.error_message == 'stream ended without a line with "done": true'
        assert m.token_source is TokenSource.CHUNKS  # no done line, no counts
    else:
        assert m.output_tokens == TOKENS + 1 and m.finish_reason == "stop"  # and the EOS
    assert m.malformed_events == malformed
    labels = {"model": MODEL, "endpoint": "/api/chat"}
    assert proxy.sample("tokenprobe_malformed_events_total", **labels) == malformed
    outcome = {"error_type": "none" if error is None else error.value, "code": "200"}
    finish = "stop" if error is None else "none"
    assert proxy.sample("tokenprobe_requests_total", **labels, **outcome, finish_reason=finish) == 1


# -- tokenprobe demo ---------------------------------------------------------------------


@paths("wire", why="the demo runs its proxy as serve does, on the wire")
def test_demo_shows_ollama_rows_with_the_cold_model_load(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    out = demo_run(tmp_path_factory)  # the run tests/server/test_apis_more_e2e.py reads too
    assert out.returncode == 0, out.stderr
    rows = {
        endpoint: next(line for line in out.stdout.splitlines() if f" {endpoint} " in line)
        for endpoint in ("/api/chat", "/api/generate")
    }
    for line in rows.values():
        assert line.split()[-1] == "ok" and " usage " in line and " stop " in line, line
    assert int(rows["/api/chat"].split()[-2]) >= 500  # load ms: the programmed 0.5 s
    assert int(rows["/api/generate"].split()[-2]) < 500  # the model is loaded by then
    # the llama.cpp row (x-sim-backend-kind): its timings moved and put back, measured as usual
    llama = next(line for line in out.stdout.splitlines() if line.startswith("llama.cpp chat"))
    assert llama.split()[-1] == "ok" and " usage " in llama and " stop " in llama, llama
