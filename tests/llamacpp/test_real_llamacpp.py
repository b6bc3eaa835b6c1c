"""Against a real llama.cpp `llama-server` (tests/llamacpp/conftest.py) through a real
`tokenprobe serve` (issue 27): the client's chat stream is the stream direct, whether it
asked for usage or not (llama.cpp moves its `timings` to the usage chunk when asked, and
the proxy puts them back: proxy/core/strip.py); the tokens are the server's own
`timings.predicted_n` and `prompt_n` (+ `cache_n`); the engine part of the TTFT split is its
`prompt_ms`; a repeated prompt's `cache_n` is counted as cached tokens; and `tokenprobe
bench` through the proxy agrees with the server's timings.

How streams are compared. Two requests never give the same bytes: llama.cpp stamps each
with a fresh `id`, its `created` second, and in `timings` that request's own milliseconds
and rates. Each stream is asked for twice at temperature 0 with `cache_prompt: false` (so
the second request does not meet the first one's cache and both count the same tokens),
once direct and once through the proxy, and the two bodies are compared byte for byte after
replacing exactly those values (each replacement counted, so a missing field is seen).
Everything else must be identical: every chunk in order, `timings` on the chunk where the
server put it with its token counts, `system_fingerprint`, the `[DONE]` line.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.sinks.metrics import cache_class
from tests.llamacpp.conftest import SERVED, Llama
from tests.pairs import events, payloads
from tests.scrape import Delta, scrape

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(600)]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPTS = ("hello there, how are you", "the quick brown fox", "a b c a b c a b c a b c")
#: The timings members whose values are times or rates (differ run to run).
TIMED = (
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
)
_ID = re.compile(rb'"id":"chatcmpl-[A-Za-z0-9]+"')
_CREATED = re.compile(rb'"created":\d+')
_TIMED = re.compile(rb'"(' + "|".join(TIMED).encode() + rb')":[-+0-9.eE]+')


def body_for(prompt: str, usage: bool, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "cache_prompt": False,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    return {**body, **extra}


def fetch(client: httpx.Client, url: str, body: Any) -> bytes:
    with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return b"".join(response.iter_raw())


def normalise(raw: bytes) -> tuple[bytes, tuple[int, int, int]]:
    raw, ids = _ID.subn(b'"id":"chatcmpl-X"', raw)
    raw, created = _CREATED.subn(b'"created":0', raw)
    raw, timed = _TIMED.subn(rb'"\1":0', raw)
    return raw, (ids, created, timed)


def timings_of(raw: bytes) -> dict[str, Any]:
    """The one `timings` object of a stream, from the chunk that carries it."""
    found = [p["timings"] for p in payloads(raw) if "timings" in p]
    assert len(found) == 1, raw
    timings: dict[str, Any] = found[0]
    return timings


def settled(llama: Llama) -> int:
    """The access log's line count once the requests of earlier tests are all recorded
    (none in flight, the log still for 0.2 s): a test's records start after it."""
    deadline = time.monotonic() + 10
    count = len(llama.log_lines())
    while time.monotonic() < deadline:
        time.sleep(0.2)
        busy = scrape(llama.proxy_url).total("tokenprobe_requests_in_flight")
        now = len(llama.log_lines())
        if now == count and busy == 0:
            break
        count = now
    return count


def wait_records(llama: Llama, since: int, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 30
    while True:
        records = llama.log_lines(since)
        if len(records) >= n or time.monotonic() > deadline:
            assert len(records) == n, records
            return records
        time.sleep(0.05)


# -- the stream is the stream direct ---------------------------------------------------------


def test_chat_streams_through_the_proxy_are_byte_identical_to_direct(llama: Llama) -> None:
    with httpx.Client(timeout=60) as client:
        for prompt in PROMPTS:
            for usage in (False, True):
                body = body_for(prompt, usage)
                direct = fetch(client, llama.url + CHAT, body)
                proxied = fetch(client, llama.proxy_url + CHAT, body)
                (want, counts), (got, got_counts) = normalise(direct), normalise(proxied)
                n = len(events(direct))
                assert counts == got_counts and counts[0] == counts[1] == n - 1
                assert counts[2] == len(TIMED)  # one timings object, on one chunk
                assert got == want, (prompt, usage, direct, proxied)
                chunks = payloads(proxied)
                # where llama.cpp puts timings: the usage chunk when asked, else the finish
                # chunk, the last one before [DONE] either way
                assert "timings" in chunks[-1] and [
                    i for i, c in enumerate(chunks) if "timings" in c
                ] == [len(chunks) - 1]
                assert ("usage" in chunks[-1]) == usage
                if not usage:
                    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_completions_streams_through_the_proxy_are_byte_identical_to_direct(llama: Llama) -> None:
    # llama.cpp ignores include_usage on /v1/completions: usage and timings ride on the
    # finish chunk either way, so there is no usage-only chunk to strip
    with httpx.Client(timeout=60) as client:
        for usage in (False, True):
            body = {"model": SERVED, "prompt": "once upon", "max_tokens": 8, "temperature": 0}
            body.update(stream=True, cache_prompt=False)
            if usage:
                body["stream_options"] = {"include_usage": True}
            direct = fetch(client, llama.url + COMPLETIONS, body)
            proxied = fetch(client, llama.proxy_url + COMPLETIONS, body)
            (want, counts), (got, got_counts) = normalise(direct), normalise(proxied)
            assert counts == got_counts and counts[2] == len(TIMED)
            assert got == want, (usage, direct, proxied)
            last = payloads(proxied)[-1]
            assert "usage" in last and "timings" in last and last["choices"][0]["finish_reason"]


def test_a_resumable_stream_replays_exactly_what_the_client_got(llama: Llama) -> None:
    """llama-server keeps a stream sent with `X-Conversation-Id` and replays its bytes on
    `GET /v1/stream?conv_id=<id>&from=N` (server-stream.cpp,
    server_stream_make_get_handler). The proxy does not ask such a stream for usage: a
    usage chunk asked for and taken out would still be in the replay, and a resume at the
    client's byte count would start inside it. The tokens still come from the server's
    `timings` on the finish chunk."""
    since = settled(llama)
    conversation = f"tokenprobe-resume-{time.monotonic_ns()}"
    body = body_for(PROMPTS[0], False, max_tokens=3)
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST", llama.proxy_url + CHAT, json=body, headers={"X-Conversation-Id": conversation}
        ) as response:
            assert response.status_code == 200, response.read()
            got = b"".join(response.iter_raw())
        replays = [
            client.get(
                llama.proxy_url + "/v1/stream", params={"conv_id": conversation, "from": start}
            )
            for start in (0, len(got))
        ]
    assert b'"usage"' not in got
    assert [r.status_code for r in replays] == [200, 200]
    assert replays[0].content == got
    assert replays[1].content == b""
    (streamed,) = wait_records(llama, since, 1)  # the replays are passthrough: no record
    assert (streamed["endpoint"], streamed["output_tokens"]) == (CHAT, 3)
    assert streamed["prompt_tokens"] == timings_of(got)["prompt_n"] + timings_of(got)["cache_n"]


# -- tokens, the TTFT split and the cache are the server's own ------------------------------


def test_tokens_and_the_engine_part_of_the_split_are_its_timings(llama: Llama) -> None:
    since = settled(llama)
    delta = Delta(llama.proxy_url)
    seen: dict[str, dict[str, Any]] = {}  # response id -> the timings the client saw
    with httpx.Client(timeout=60) as client:
        for i in range(6):  # half asked for usage, half did not: the proxy asked for them
            raw = fetch(client, llama.proxy_url + CHAT, body_for(PROMPTS[i % 3], i % 2 == 0))
            seen[payloads(raw)[0]["id"]] = timings_of(raw)
    d = delta.after(6)
    records = {r["response_id"]: r for r in wait_records(llama, since, 6)}
    assert records.keys() == seen.keys()
    prompt_ms = 0.0
    for rid, t in seen.items():
        r = records[rid]
        assert r["output_tokens"] == t["predicted_n"] > 0
        assert r["prompt_tokens"] == t["prompt_n"] + t["cache_n"] and t["cache_n"] == 0
        assert r["token_source"] == "usage"
        assert r["engine_ttft_ms"] == round(t["prompt_ms"], 3)
        assert r["queue_ms"] is None  # llama.cpp reports no queue time
        parts = r["engine_ttft_ms"] + r["outside_engine_ms"]
        assert math.isclose(parts, r["ttft_ms"], abs_tol=0.0021), r
        prompt_ms += t["prompt_ms"]
    engine = d("tokenprobe_engine_time_to_first_token_seconds_sum", stream="true")
    outside = d("tokenprobe_time_to_first_token_outside_engine_seconds_sum")
    ttft = d("tokenprobe_time_to_first_token_seconds_sum")
    assert math.isclose(engine, prompt_ms / 1000, rel_tol=1e-9)
    assert math.isclose(engine + outside, ttft, rel_tol=1e-9)
    assert d("tokenprobe_engine_queue_time_seconds_count") == 0
    assert d("tokenprobe_generation_tokens_total", source="usage") == sum(
        t["predicted_n"] for t in seen.values()
    )
    for stage in ("engine_timings", "usage_injection"):
        assert d("tokenprobe_measurement_failures_total", stage=stage) == 0


def test_a_responses_streams_engine_part_is_its_timings_beside_the_completed_response(
    llama: Llama,
) -> None:
    """llama-server's `/v1/responses` stream carries its timings on the
    `response.completed` event, beside the response object, not in it: the engine part of
    the TTFT split is its `prompt_ms` there too (it was read from chat streams only)."""
    since = settled(llama)
    body = {"model": SERVED, "input": PROMPTS[0], "max_output_tokens": 4, "stream": True}
    with httpx.Client(timeout=60) as client:
        raw = fetch(client, llama.proxy_url + "/v1/responses", body)
    data = [line[len(b"data: ") :] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    completed = [e for e in map(json.loads, data) if e.get("type") == "response.completed"]
    assert len(completed) == 1 and "timings" in completed[0], raw
    (record,) = wait_records(llama, since, 1)
    assert record["engine_ttft_ms"] == round(completed[0]["timings"]["prompt_ms"], 3)
    parts = record["engine_ttft_ms"] + record["outside_engine_ms"]
    assert math.isclose(parts, record["ttft_ms"], abs_tol=0.0021), record


def test_the_native_completion_and_the_routes_without_v1_are_measured(llama: Llama) -> None:
    """llama-server's own `/completion` (streamed and not), its `/completions` (the same
    native answer, not OpenAI's) and `/chat/completions` (OpenAI's chat without the /v1)
    went through unmeasured: no record at all. The native counts are its last object's
    `tokens_predicted` / `tokens_evaluated`, the engine part of the TTFT split its
    `prompt_ms`, and the stream reaches the client as it left the server."""
    since = settled(llama)
    native = {"prompt": PROMPTS[1], "n_predict": 5, "temperature": 0, "cache_prompt": False}
    with httpx.Client(timeout=60) as client:
        direct = fetch(client, llama.url + "/completion", {**native, "stream": True})
        raw = fetch(client, llama.proxy_url + "/completion", {**native, "stream": True})
        whole = client.post(llama.proxy_url + "/completion", json=native).json()
        for path, body in (
            ("/chat/completions", body_for(PROMPTS[0], True)),
            (
                "/completions",
                {"model": SERVED, "prompt": PROMPTS[2], "max_tokens": 4, "stream": True},
            ),
        ):
            fetch(client, llama.proxy_url + path, body)
    last = payloads(raw)[-1]
    assert last["stop"] is True and payloads(direct)[-1]["stop"] is True
    assert normalise(raw)[0] == normalise(direct)[0]
    streamed, answered, chat, completions = wait_records(llama, since, 4)
    assert (streamed["endpoint"], streamed["stream"], answered["stream"]) == (
        "/completion",
        True,
        False,
    )
    for record, obj in ((streamed, last), (answered, whole)):
        assert record["output_tokens"] == obj["tokens_predicted"] == 5
        assert record["prompt_tokens"] == obj["tokens_evaluated"] > 0
        assert (record["token_source"], record["finish_reason"]) == ("engine", "length")
    assert streamed["engine_ttft_ms"] == round(last["timings"]["prompt_ms"], 3)
    assert streamed["tokens_per_chunk"] == 1.0 and streamed["error_type"] is None
    assert (chat["endpoint"], chat["token_source"]) == ("/v1/chat/completions", "usage")
    assert (completions["endpoint"], completions["token_source"]) == ("/completion", "engine")
    assert completions["output_tokens"] == 4 and completions["error_type"] is None


def test_a_batch_of_prompts_counts_every_tasks_usage(llama: Llama) -> None:
    """A completions batch runs a task per prompt, and each task's finish chunk carries that
    task's own usage and timings (server-task.cpp, to_json_oaicompat): the record adds them
    up, and the engine part of the split is the timings of the task whose token came first."""
    since = settled(llama)
    delta = Delta(llama.proxy_url)
    body = {"model": SERVED, "prompt": ["hello there", "the quick brown fox jumps"],
            "max_tokens": 3, "temperature": 0, "stream": True, "cache_prompt": False}  # fmt: skip
    with httpx.Client(timeout=60) as client:
        raw = fetch(client, llama.proxy_url + COMPLETIONS, body)
    (record,) = wait_records(llama, since, 1)
    chunks = [c for c in payloads(raw) if c is not None]  # a `data: null` between the tasks
    assert b"data: null" in raw
    assert delta.after(1)("tokenprobe_malformed_events_total") == 0
    finals = {c["choices"][0]["index"]: c for c in chunks if "usage" in c}
    assert len(finals) == 2 and all("timings" in c for c in finals.values()), chunks
    usages = [c["usage"] for c in finals.values()]
    assert record["token_source"] == "usage"
    assert record["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert record["output_tokens"] == sum(u["completion_tokens"] for u in usages) == 6
    assert record["cached_tokens"] == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages
    )
    first = next(c["choices"][0]["index"] for c in chunks if c["choices"][0].get("text"))
    assert record["engine_ttft_ms"] == round(finals[first]["timings"]["prompt_ms"], 3)


def test_the_native_completion_of_a_list_of_prompts_is_measured_streamed_or_not(
    llama: Llama,
) -> None:
    """Not streamed, llama-server answers a list of prompts on `/completion` with a JSON
    array, one last object per prompt (server-context.cpp, handle_completions_impl: "multi-
    results, non-OAI compat"). It is measured as the stream is: the prompts' counts added
    up, each prompt's finish its own."""
    since = settled(llama)
    native = {"prompt": ["hello there", "the quick brown fox jumps"], "n_predict": 2,
              "temperature": 0, "cache_prompt": False}  # fmt: skip
    with httpx.Client(timeout=60) as client:
        fetch(client, llama.proxy_url + "/completion", {**native, "stream": True})
        answer = client.post(llama.proxy_url + "/completion", json=native)
    assert answer.status_code == 200
    whole = answer.json()
    assert type(whole) is list and [a["index"] for a in whole] == [0, 1]
    streamed, answered = wait_records(llama, since, 2)
    assert (answered["endpoint"], answered["stream"], answered["error_type"]) == (
        "/completion",
        False,
        None,
    )
    assert answered["output_tokens"] == sum(a["tokens_predicted"] for a in whole) == 4
    assert answered["prompt_tokens"] == sum(a["tokens_evaluated"] for a in whole)
    assert (answered["token_source"], answered["finish_reason"]) == ("engine", "length")
    for figure in ("output_tokens", "prompt_tokens", "token_source", "finish_reason"):
        assert answered[figure] == streamed[figure], figure


def test_a_repeated_prompt_shows_its_cache_n_as_cached_tokens(llama: Llama) -> None:
    prompt = "measure the cache: " + " ".join(f"word{i}" for i in range(40))
    since = settled(llama)
    delta = Delta(llama.proxy_url)
    timings = []
    with httpx.Client(timeout=60) as client:
        for _ in range(2):
            body = body_for(prompt, True, cache_prompt=True)
            timings.append(timings_of(fetch(client, llama.proxy_url + CHAT, body)))
    d = delta.after(2)
    first, second = wait_records(llama, since, 2)
    assert timings[1]["cache_n"] > 0 and timings[1]["prompt_n"] < timings[0]["prompt_n"]
    assert second["cached_tokens"] == timings[1]["cache_n"]
    assert first["cached_tokens"] == timings[0]["cache_n"]
    assert second["prompt_tokens"] == timings[1]["prompt_n"] + timings[1]["cache_n"]
    assert (
        d("tokenprobe_cached_prompt_tokens_total") == timings[0]["cache_n"] + timings[1]["cache_n"]
    )
    # the cache class of the TTFT histogram: most of the repeated prompt came from the cache
    classes = [cache_class(r["prompt_tokens"], r["cached_tokens"]) for r in (first, second)]
    assert classes[1] == "most"
    for name in set(classes):
        assert d(
            "tokenprobe_time_to_first_token_by_prompt_seconds_count", cache_class=name
        ) == classes.count(name)


# -- tokenprobe bench through the proxy ------------------------------------------------------


def bench_through_the_proxy(llama: Llama, tmp_path: Path, *flags: str) -> dict[str, Any]:
    """`tokenprobe bench` of 4 requests of 8 tokens through the proxy, cross-checked with
    its /metrics (--compare-metrics): the run's JSON."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "bench", *flags, "--model", SERVED, "--requests", "4",
         "--max-tokens", "8", "--out", str(out),
         "--compare-metrics", llama.proxy_url + "/metrics", "--quiet"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run: dict[str, Any] = json.loads(out.read_text())
    return run


def test_bench_through_the_proxy_agrees_with_the_servers_timings(
    llama: Llama, tmp_path: Path
) -> None:
    run = bench_through_the_proxy(llama, tmp_path, "--url", llama.proxy_url + "/v1")
    records = run["records"]
    assert len(records) == 4
    for r in records:
        engine = r["engine"]
        assert r["error_type"] is None
        assert r["output_tokens"] == engine["output_tokens"] == 8  # ignore_eos: all 8
        assert r["prompt_tokens"] == engine["prompt_tokens"] + engine["cached_tokens"]
        assert engine["queue_time"] is None and engine["time_to_first_token"] > 0
        assert engine["time_to_first_token"] <= r["ttft"]
    (summary,) = run["summary"]
    split = summary["ttft_split"]
    assert split["requests"] == 4 and "queue" not in split
    mean = sum(r["engine"]["time_to_first_token"] for r in records) / 4
    assert math.isclose(split["engine"], mean, rel_tol=1e-9)
    compare = run["compare"]
    assert compare is not None


def test_bench_measures_the_native_completion_as_the_proxy_does(
    llama: Llama, tmp_path: Path
) -> None:
    """`tokenprobe bench --endpoint llamacpp-completion` drives llama.cpp's own
    /completion: its counts are the server's (`source` engine, every token with
    ignore_eos), and the proxy's /metrics agree with the bench's figures."""
    run = bench_through_the_proxy(
        llama, tmp_path, "--url", llama.proxy_url, "--endpoint", "llamacpp-completion"
    )
    records = run["records"]
    assert len(records) == 4
    for r in records:
        assert r["error_type"] is None and r["finish_reason"] == "length"
        assert (r["output_tokens"], r["token_source"]) == (8, "engine")
        assert r["engine"]["time_to_first_token"] <= r["ttft"]
    bench, proxy = run["compare"]["bench"], run["compare"]["proxy"]
    assert bench["requests"] == proxy["requests"] == 4 and not proxy["errors"]
    assert bench["output_tokens"] == proxy["output_tokens"] == 32
    assert bench["prompt_tokens"] == proxy["prompt_tokens"] > 0
