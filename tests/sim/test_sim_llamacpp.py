"""The simulator as llama.cpp's `llama-server` (proxy/sim/llamacpp.py): every chunk has the
shape of the real server's (the captures in tests/fixtures/streams/llamacpp/, member for
member, in order), `timings` sits where llama.cpp writes it, and its figures are what the
simulator did: its tokens, its cache, its clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.core.measurement import TokenSource
from proxy.sim import cli
from proxy.sim.tokens import completion_text
from tests.conftest import ProxyUnderTest, Running

FIXTURES = Path(__file__).parent.parent / "fixtures" / "streams" / "llamacpp"
INDEX = orjson.loads((FIXTURES / "index.json").read_bytes())
TTFT = 0.05
FAST = {"x-sim-ttft": str(TTFT), "x-sim-tps": "200"}


def skeleton(value: Any) -> Any:
    """The value's shape: members in order, every string or number a placeholder."""
    if isinstance(value, dict):
        return [(k, skeleton(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [skeleton(v) for v in value]
    if isinstance(value, str):
        return "s"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "n"
    return value


def events(raw: bytes) -> list[Any]:
    out = []
    for event in raw.split(b"\n\n"):
        if event:
            assert event.startswith(b"data: "), event
            data = event[len(b"data: ") :]
            out.append(data.decode() if data == b"[DONE]" else orjson.loads(data))
    return out


@pytest.fixture
def sim(start_sim: Callable[..., Running]) -> Running:
    return start_sim(
        models=("tiny",), backend_kind="llamacpp", prefix_cache=8, prefix_cache_block=1
    )


@pytest.mark.parametrize(
    "name",
    [
        "chat_stream_no_usage.sse",
        "chat_stream_include_usage.sse",
        "completions_stream_no_usage.sse",
        "chat_nonstream.json",
    ],
)
def test_every_chunk_has_the_real_servers_shape(sim: Running, name: str) -> None:
    request = INDEX["requests"][name]
    r = httpx.post(sim.url + request["path"], json=request["body"], headers=FAST)
    assert r.status_code == 200
    real = (FIXTURES / name).read_bytes()
    if name.endswith(".json"):
        assert skeleton(orjson.loads(r.content)) == skeleton(orjson.loads(real))
        return
    assert r.headers["content-type"].startswith("text/event-stream")
    got, want = events(r.content), events(real)
    # the same request (max_tokens 5, cut by length) gives the same number of chunks
    assert len(got) == len(want)
    assert [skeleton(e) for e in got] == [skeleton(e) for e in want]


def test_timings_are_what_the_simulator_did(sim: Running) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 40}]}
    headers = {**FAST, "x-sim-output-tokens": "6"}
    start = time.monotonic()
    first = orjson.loads(
        httpx.post(sim.url + "/v1/chat/completions", json=body, headers=headers).content
    )
    elapsed = time.monotonic() - start
    record = sim.app.state.last()
    t, usage = first["timings"], first["usage"]
    # 6 text tokens and the EOS, which llama-server counts (n_decoded): 7
    assert t["predicted_n"] == usage["completion_tokens"] == record.completion_tokens == 7
    assert t["prompt_n"] == usage["prompt_tokens"] == record.prompt_tokens and t["cache_n"] == 0
    # The first token is due one TTFT after the request arrived; prompt_ms counts from its
    # routing (queued_at), after the body was read and parsed: a parallel run once stalled
    # this in-process simulator between the two, and prompt_ms came out 0.05 ms.
    assert record.queued_at is not None
    due = (record.started + TTFT - record.queued_at) * 1000
    assert due - 10 <= t["prompt_ms"] <= elapsed * 1000
    assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / 6)  # n - 1 steps
    # the same prompt again: the prefix cache has all of it, llama.cpp still evaluates one
    again = orjson.loads(
        httpx.post(sim.url + "/v1/chat/completions", json=body, headers=headers).content
    )
    t2 = again["timings"]
    assert t2["cache_n"] == record.prompt_tokens - 1 and t2["prompt_n"] == 1
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == t2["cache_n"]
    assert again["usage"]["prompt_tokens"] == t2["prompt_n"] + t2["cache_n"]


def test_a_stream_carries_one_timings_object_where_llamacpp_puts_it(sim: Running) -> None:
    body: dict[str, Any] = {"model": "tiny", "prompt": "once", "stream": True}
    for path, usage, carrier in (
        ("/v1/chat/completions", False, "finish"),
        ("/v1/chat/completions", True, "usage"),
        ("/v1/completions", False, "finish"),
        ("/v1/completions", True, "finish"),  # completions ignore include_usage
    ):
        req = {**body, "messages": [{"role": "user", "content": "hi"}]} if "chat" in path else body
        if usage:
            req = {**req, "stream_options": {"include_usage": True}}
        chunks = events(httpx.post(sim.url + path, json=req, headers=FAST).content)
        assert chunks[-1] == "[DONE]"
        timed = [i for i, c in enumerate(chunks) if isinstance(c, dict) and "timings" in c]
        assert timed == [len(chunks) - 2], (path, usage)
        last = chunks[-2]
        assert list(last)[-1] == "timings"
        assert (last["choices"] == []) == (carrier == "usage")
        assert last["timings"]["predicted_n"] == sim.app.state.last().completion_tokens


def test_props_names_the_build_and_there_is_no_version(sim: Running) -> None:
    props = httpx.get(sim.url + "/props")
    assert props.status_code == 200 and props.json()["build_info"] == "b1-sim"
    assert httpx.get(sim.url + "/version").status_code == 404


def test_a_vllm_simulator_has_no_props_and_the_header_picks_the_shape(
    start_sim: Callable[..., Running],
) -> None:
    sim = start_sim()
    assert httpx.get(sim.url + "/props").status_code == 404
    assert httpx.get(sim.url + "/version").status_code == 200
    body = {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        sim.url + "/v1/chat/completions",
        json=body,
        headers={**FAST, "x-sim-backend-kind": "llamacpp"},
    )
    assert "timings" in r.json() and r.json()["system_fingerprint"] == "b1-sim"
    bad = httpx.post(
        sim.url + "/v1/chat/completions", json=body, headers={"x-sim-backend-kind": "tgi"}
    )
    assert bad.status_code == 400 and "x-sim-backend-kind" in bad.text


def test_the_flag_and_its_environment_variable() -> None:
    assert cli.parse(["--backend-kind", "llamacpp"], {})[0].backend_kind == "llamacpp"
    assert cli.parse([], {"TOKENPROBE_SIM_BACKEND_KIND": "llamacpp"})[0].backend_kind == "llamacpp"
    assert cli.parse([], {})[0].backend_kind == "vllm"


def test_a_wait_for_a_slot_is_not_in_prompt_ms(start_sim: Callable[..., Running]) -> None:
    # llama.cpp's slot wait is before its t_start: prompt_ms is the prefill alone, and the
    # proxy shows the wait outside the engine (docs/llamacpp.md)
    sim = start_sim(models=("tiny",), backend_kind="llamacpp", max_num_seqs=1)
    state = sim.app.state
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    url = sim.url + "/v1/chat/completions"

    def second() -> dict[str, Any]:
        r = httpx.post(url, json=body, headers={**FAST, "x-sim-output-tokens": "40"}, timeout=30)
        timings: dict[str, Any] = events(r.content)[-2]["timings"]
        return timings

    # The first holds the one slot (2,000 tokens: 10 s) until the second has waited for
    # it; then the client leaves and the slot frees. No race with the first's end, however
    # late a loaded machine runs the second's thread.
    hold = {**FAST, "x-sim-output-tokens": "2000"}
    with ThreadPoolExecutor(1) as pool, httpx.stream("POST", url, json=body, headers=hold) as first:
        chunks = first.iter_raw()  # kept: a dropped iterator closes the response
        next(chunks)  # it streams: it has the slot
        waiting_future = pool.submit(second)
        assert state.wait_for(
            lambda: len(state.requests()) == 2 and state.requests()[1].queued_at is not None
        )
        time.sleep(0.1)
        assert state.requests()[1].scheduled_at is None  # still waiting for the slot
    t = waiting_future.result()
    waiting = state.requests()[1]
    assert waiting.queued_at is not None and waiting.scheduled_at is not None
    assert waiting.first_token_at is not None
    assert waiting.scheduled_at - waiting.queued_at > 0.05  # it did wait for the slot
    engine = waiting.first_token_at - waiting.scheduled_at
    assert t["prompt_ms"] == pytest.approx(engine * 1000, abs=1.0)
    assert t["prompt_ms"] >= TTFT * 1000 - 10


def test_a_passing_fault_keeps_the_stream_and_its_timings(sim: Running) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {**FAST, "x-sim-output-tokens": "4", "x-sim-fault": "malformed"}
    raw = httpx.post(sim.url + "/v1/chat/completions", json=body, headers=headers).content
    assert b"data: {not json\n\n" in raw
    good = raw.replace(b"data: {not json\n\n", b"")
    # 4 text tokens and the EOS
    assert events(good)[-2]["timings"]["predicted_n"] == 5 and events(good)[-1] == "[DONE]"


# Error bytes of the real llama-server that .ci/llama builds (b1-0c1e570, `--ctx-size 512
# --alias tiny`), captured from it: /v1/completions with `prompt` 512 token ids, and
# /v1/chat/completions with `"n": 2` (the same answer streamed or not, on both routes).
REAL_EXCEED_512 = (
    b'{"error":{"code":400,"message":"request (512 tokens) exceeds the available context '
    b'size (512 tokens), try increasing it","type":"exceed_context_size_error",'
    b'"n_prompt_tokens":512,"n_ctx":512}}'
)
REAL_N_2 = (
    b'{"error":{"code":400,"message":"Field \'n\': Value must be between 1 <= value <= 1, '
    b'but got 2","type":"invalid_request_error"}}'
)


@pytest.fixture
def ctx512(start_sim: Callable[..., Running]) -> Running:
    return start_sim(models=("tiny",), backend_kind="llamacpp", max_model_len=512)


def test_a_prompt_that_fills_the_context_is_exceed_context_size_error(ctx512: Running) -> None:
    url = ctx512.url + "/v1/completions"
    full = httpx.post(url, json={"model": "tiny", "prompt": [100] * 512, "max_tokens": 2})
    assert (full.status_code, full.content) == (400, REAL_EXCEED_512)
    assert full.headers["content-type"] == "application/json; charset=utf-8"
    # one token short of the context: the real server generates the one token that fits
    fits = httpx.post(
        url, json={"model": "tiny", "prompt": [100] * 511, "max_tokens": 2}, headers=FAST
    )
    assert fits.status_code == 200
    answer = fits.json()
    assert (answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]) == (
        1,
        "length",
    )


def test_max_tokens_and_model_are_not_checked(ctx512: Running) -> None:
    # llama-server checks the prompt alone against the context, and serves one model
    # whatever `model` says, naming its own (the real server: 200 to both)
    url = ctx512.url + "/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "messages": hi, "max_tokens": 5000, "stream": True}
    streamed = httpx.post(url, json=body, headers={**FAST, "x-sim-output-tokens": "3"})
    assert streamed.status_code == 200 and events(streamed.content)[-1] == "[DONE]"
    other = httpx.post(url, json={"model": "nope", "messages": hi, "max_tokens": 2}, headers=FAST)
    assert other.status_code == 200 and other.json()["model"] == "tiny"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_more_than_one_choice_is_refused(ctx512: Running, path: str, stream: bool) -> None:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2, "stream": stream}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = httpx.post(ctx512.url + path, json={**body, "n": 2}, headers=FAST)
    assert (r.status_code, r.content) == (400, REAL_N_2)
    assert httpx.post(ctx512.url + path, json={**body, "n": 1}, headers=FAST).status_code == 200


# -- the native /completion (proxy/sim/llamacpp_native.py) -------------------------------

NATIVE = ("/completion", "/completions")  # the real server answers both with these events


@pytest.mark.parametrize("path", NATIVE)
@pytest.mark.parametrize("name", ["native_completion_stream.sse", "native_completion.json"])
def test_native_events_have_the_real_servers_shape(sim: Running, path: str, name: str) -> None:
    request = INDEX["requests"][name]
    r = httpx.post(sim.url + path, json=request["body"], headers=FAST)
    assert r.status_code == 200
    real = (FIXTURES / name).read_bytes()
    if name.endswith(".json"):
        got_body = orjson.loads(r.content)
        assert skeleton(got_body) == skeleton(orjson.loads(real))
        assert got_body["content"] == completion_text(5) and got_body["stop_type"] == "limit"
        return
    assert r.headers["content-type"].startswith("text/event-stream")
    got, want = events(r.content), events(real)  # no [DONE]: events() would keep it
    assert [skeleton(e) for e in got] == [skeleton(e) for e in want]
    assert [e["tokens_predicted"] for e in got] == [1, 2, 3, 4, 5, 5]
    last = got[-1]
    assert (last["stop_type"], last["timings"]["predicted_n"]) == ("limit", 5)
    assert last["tokens_evaluated"] == sim.app.state.last().prompt_tokens
    assert last["generation_settings"]["n_predict"] == 5


def test_a_list_of_prompts_streams_null_then_each_prompts_events(sim: Running) -> None:
    name = "native_completion_batch_stream.sse"
    body = INDEX["requests"][name]["body"]
    got = events(httpx.post(sim.url + "/completion", json=body, headers=FAST).content)
    want = events((FIXTURES / name).read_bytes())
    assert got[0] is None is want[0]

    def shapes(stream: list[Any], index: int) -> list[Any]:
        return [skeleton(e) for e in stream[1:] if e["index"] == index]

    assert shapes(got, 0) == shapes(want, 0) and shapes(got, 1) == shapes(want, 1)
    lasts = [e for e in got[1:] if e["stop"]]
    assert [(e["index"], e["tokens_predicted"]) for e in lasts] == [(0, 3), (1, 3)]
    # each prompt's own count: "hello there" 11 characters, "once upon" 9 (ceil of 4 each)
    assert [e["tokens_evaluated"] for e in lasts] == [3, 3]
    assert [e["timings"]["prompt_n"] for e in lasts] == [3, 3]


def test_n_predict_minus_one_runs_to_eos(sim: Running) -> None:
    body = {"prompt": "once", "n_predict": -1}
    r = httpx.post(sim.url + "/completion", json=body, headers={**FAST, "x-sim-output-tokens": "4"})
    answer = r.json()
    assert (answer["tokens_predicted"], answer["stop_type"]) == (5, "eos")  # 4 and the EOS
    assert answer["generation_settings"]["n_predict"] == -1


def test_a_vllm_simulator_has_no_native_completion(start_sim: Callable[..., Running]) -> None:
    sim = start_sim()
    for path in NATIVE:
        assert httpx.post(sim.url + path, json={"prompt": "hi"}).status_code == 404
    played = httpx.post(
        sim.url + "/completion",
        json={"prompt": "hi", "n_predict": 2},
        headers={**FAST, "x-sim-backend-kind": "llamacpp"},
    )
    assert played.status_code == 200 and played.json()["tokens_predicted"] == 2


@pytest.mark.parametrize("stream", [True, False])
def test_the_proxy_measures_the_native_completion(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest], stream: bool
) -> None:
    proxy = start_proxy(sim.url, model_allowlist=("tiny",))
    body = {"model": "tiny", "prompt": "once upon a time", "n_predict": 6, "stream": stream}
    headers = {**FAST, "x-sim-output-tokens": "20", "x-sim-cached-tokens": "2"}
    r = httpx.post(proxy.url + "/completion", json=body, headers=headers)
    assert r.status_code == 200
    record = proxy.wait_records(1, exact=True)[0]
    sent = sim.app.state.last()
    assert record.endpoint == "/completion" and record.stream is stream
    assert (record.prompt_tokens, record.output_tokens) == (sent.prompt_tokens, 6)
    assert record.cached_prompt_tokens == 2
    assert record.token_source is TokenSource.ENGINE
    assert (record.finish_reason, record.raw_finish_reason) == ("length", "limit")
    assert record.error_type is None
    if stream:  # the first token's event leaves one TTFT after the request
        assert record.ttft is not None and record.ttft >= TTFT - 0.005
        assert record.content_events == 6
    else:  # a whole body has no first token of its own
        assert record.ttft is None and record.e2e >= TTFT + 5 / 200 - 0.005
