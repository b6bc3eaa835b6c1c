"""Issue 22 end to end: the simulator emits vLLM 0.32's per-request `metrics` object (queue
time from `--max-num-seqs`, programmed speculative decoding), a real `tokenprobe serve`
process sits in front, real httpx clients talk to it, and /metrics says where the first
token's time went."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.scrape import Change, Delta, scrape, wait_for
from tests.servers import free_port, spawn, stop, wait_http
from tests.tokenizers_local import build_tiny_tokenizer, with_chat_template

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
FINGERPRINT = "vllm-0.32.0-simfp"


def started(*args: str) -> Iterator[tuple[str, str]]:
    """A sim and a proxy in front of it, as processes; yields their URLs: the proxy's,
    then the sim's."""
    sim_port, proxy_port = free_port(), free_port()
    sim = spawn("sim", "--port", str(sim_port), *args)
    sim_url = f"http://127.0.0.1:{sim_port}"
    proxy = None
    try:
        wait_http(sim_url + "/health")
        proxy = spawn(
            "serve",
            "--upstream",
            sim_url,
            "--port",
            str(proxy_port),
            "--access-log",
            "off",
        )
        wait_http(f"http://127.0.0.1:{proxy_port}/healthz")
        yield f"http://127.0.0.1:{proxy_port}", sim_url
    finally:
        if proxy is not None:
            stop(proxy)
        stop(sim)


SIM_WITH_METRICS = (
    "--per-request-metrics",
    "--max-num-seqs",
    "1",
    "--system-fingerprint",
    FINGERPRINT,
    "--ttft",
    "0.05",
    "--tps",
    "200",
    "--output-tokens",
    "12",
)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[str, str]]:
    yield from started(*SIM_WITH_METRICS)


@pytest.fixture(scope="module")
def proxy(stack: tuple[str, str]) -> str:
    return stack[0]


@pytest.fixture
def proxy_without_object() -> Iterator[str]:
    for base, _ in started("--ttft", "0.02", "--tps", "200", "--output-tokens", "8"):
        yield base


def chat(base: str, headers: dict[str, str] | None = None, **body: object) -> bytes:
    payload = {"model": "sim-model", "stream": True, "messages": MESSAGES, **body}
    return httpx.post(base + CHAT, json=payload, headers=headers or {}, timeout=60).content


def test_queue_engine_and_outside_add_up_to_the_client_seen_ttft(proxy: str) -> None:
    delta = Delta(proxy)
    # Four at once against one slot: three of them queue. Each client is made before they
    # all go at a barrier, and each answer holds the slot for 0.25 s: a CI run's four
    # `httpx.post`s, each building its own client under load, started so far apart that
    # 0.11 s answers hardly overlapped (20 ms of queue in all).
    barrier = threading.Barrier(4)
    longer = {"x-sim-output-tokens": "40"}

    def one() -> None:
        payload = {"model": "sim-model", "stream": True, "messages": MESSAGES}
        with httpx.Client(timeout=60) as client:
            barrier.wait(timeout=30)
            client.post(proxy + CHAT, json=payload, headers=longer)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    grew = delta.when("tokenprobe_time_to_first_token_seconds_count", 4)
    ttft = grew("tokenprobe_time_to_first_token_seconds_sum")
    queue = grew("tokenprobe_engine_queue_time_seconds_sum", stream="true")
    engine = grew("tokenprobe_engine_time_to_first_token_seconds_sum", stream="true")
    outside = grew("tokenprobe_time_to_first_token_outside_engine_seconds_sum")
    assert grew("tokenprobe_time_to_first_token_outside_engine_seconds_count") == 4
    assert queue + engine + outside == pytest.approx(ttft, rel=1e-9, abs=1e-9)
    assert queue > 0.05  # three requests waited for the one slot
    assert engine >= 4 * 0.04  # each one's programmed 50 ms TTFT, loosely
    assert outside >= 0


def test_spec_decode_counters_equal_the_sums_of_the_objects_the_client_got(proxy: str) -> None:
    headers = {
        "x-sim-spec-tokens": "3",
        "x-sim-acceptance-rate": "0.67",
        "x-sim-output-tokens": "20",
    }
    delta = Delta(proxy)
    drafted = accepted = 0
    for _ in range(3):
        body = chat(proxy, headers, stream_options={"include_usage": True})
        (usage_event,) = [e for e in body.split(b"\n\n") if b'"choices":[]' in e]
        spec = orjson.loads(usage_event.removeprefix(b"data: "))["metrics"]["speculative_decoding"]
        drafted += spec["num_draft_tokens"]
        accepted += spec["num_accepted_draft_tokens"]
        # 20 tokens and the EOS in steps of 3: the EOS comes in the 7th, whose chunk ends
        assert body.count(b'"delta":{"content":"') == 7
    assert (drafted, accepted) == (3 * 3 * 7, 3 * (21 - 7))
    grew = delta.when("tokenprobe_spec_decode_draft_tokens_total", drafted)
    for name, expected in (
        ("tokenprobe_spec_decode_draft_tokens_total", drafted),
        ("tokenprobe_spec_decode_accepted_tokens_total", accepted),
    ):
        assert grew(name) == expected
    per_chunk = "tokenprobe_request_output_tokens_per_chunk_sum"
    assert grew(per_chunk) == pytest.approx(3 * 21 / 7)  # 20 tokens and the EOS, 7 chunks


def test_the_client_gets_the_finish_chunk_with_its_fingerprint_and_no_usage_chunk(
    proxy: str,
) -> None:
    body = chat(proxy)
    events = [e for e in body.split(b"\n\n") if e]
    assert b'"choices":[]' not in body and events[-1] == b"data: [DONE]"
    assert events[-2].endswith(
        b'"finish_reason":"stop","stop_reason":null,"token_ids":null}],'
        b'"system_fingerprint":"' + FINGERPRINT.encode() + b'"}'
    )


def _disconnect_after(base: str, n: int, headers: dict[str, str]) -> None:
    payload = {"model": "sim-model", "stream": True, "messages": MESSAGES}
    seen = 0
    with httpx.stream("POST", base + CHAT, json=payload, headers=headers, timeout=60) as response:
        for line in response.iter_lines():
            if (
                line.startswith("data: ")
                and b'"content":"' in line.encode()
                and '"content":""' not in line
            ):
                seen += 1
                if seen == n:
                    break  # leaving the block closes the connection
    assert seen == n


def test_cancelled_tokens_match_a_client_that_leaves_after_n_content_events(
    stack: tuple[str, str],
) -> None:
    proxy, sim = stack
    delta = Delta(proxy)
    slow = {"x-sim-tps": "2", "x-sim-output-tokens": "40"}  # 500 ms between tokens
    _disconnect_after(proxy, 3, slow)
    name = "tokenprobe_cancelled_generation_tokens_total"
    grew = delta.when(name, 3)
    # The metric counts what the proxy saw up to the instant it noticed the disconnect:
    # the three the client read, and those the backend sent while the proxy had not
    # noticed yet (one more each 500 ms; a loaded CI machine once took over 250 ms), so
    # at most what the simulator says it sent. Never the 40 the backend would have sent.
    records = httpx.get(sim + "/sim/requests", timeout=10).json()
    ours = [r for r in records if r["path"] == CHAT and r["headers"].get("x-sim-tps") == "2"]
    sent = ours[-1]["completion_tokens"]
    assert 3 <= grew(name, source="chunks") <= sent < 40, sent
    # no tokenizer, no usage: the prompt is not counted
    assert grew("tokenprobe_cancelled_prompt_tokens_total") == 0


def test_with_a_tokenizer_the_cancelled_prompt_is_counted(tmp_path: Path) -> None:
    tokenizer = with_chat_template(build_tiny_tokenizer(tmp_path))  # a chat prompt needs one
    sim_port, proxy_port = free_port(), free_port()
    sim = spawn("sim", "--port", str(sim_port), "--tps", "4", "--output-tokens", "40")
    proxy = None
    try:
        wait_http(f"http://127.0.0.1:{sim_port}/health")
        proxy = spawn(
            "serve",
            "--upstream",
            f"http://127.0.0.1:{sim_port}",
            "--port",
            str(proxy_port),
            "--access-log",
            "off",
            "--tokenizer",
            str(tokenizer),
            "--no-inject-usage",  # streams without usage: the tokenizer counts them
        )
        base = f"http://127.0.0.1:{proxy_port}"
        wait_http(base + "/healthz")
        # The tokenizer loads in the background and nothing says when it is in: short
        # streams until one is counted by it (one stream, then waiting for a count by the
        # tokenizer that usage made, sat out a 30 s deadline in every run).
        deadline = time.monotonic() + 60
        while scrape(base).total("tokenprobe_prompt_tokens_total", source="tokenizer") == 0:
            assert time.monotonic() < deadline, "the proxy's tokenizer did not load"
            chat(base, {"x-sim-tps": "1000", "x-sim-output-tokens": "2"})
            time.sleep(0.1)
        before = scrape(base)
        _disconnect_after(base, 3, {})
        scraped = wait_for(base, "tokenprobe_cancelled_prompt_tokens_total", 1)
        counted = Change(before, scraped, {"source": "tokenizer"})
        prompt = counted("tokenprobe_cancelled_prompt_tokens_total")
        finished = counted("tokenprobe_prompt_tokens_total")
        assert prompt == finished > 0  # the same prompt, counted the same way
        generated = counted("tokenprobe_cancelled_generation_tokens_total")
        assert generated >= 3  # three content events' text, as the tokenizer counts it
    finally:
        if proxy is not None:
            stop(proxy)
        stop(sim)


#: The sample names of the figures only the engine's object gives.
ENGINE_SERIES = re.compile(
    r"tokenprobe_(engine_queue_time_seconds|engine_time_to_first_token_seconds|"
    r"time_to_first_token_outside_engine_seconds|spec_decode_\w+)(_bucket|_sum|_count|_total)?"
)


def test_a_backend_without_the_object_leaves_the_engine_metrics_untouched(
    proxy_without_object: str,
) -> None:
    for _ in range(3):
        chat(proxy_without_object)
    chat(proxy_without_object, stream=False)
    wait_for(proxy_without_object, "tokenprobe_e2e_request_latency_seconds_count", 4)
    # a labelled family has no sample until one of its series is observed
    labelled = {s.name for s in scrape(proxy_without_object).samples if s.labels}
    assert "tokenprobe_time_to_first_token_seconds_count" in labelled
    assert [name for name in labelled if ENGINE_SERIES.fullmatch(name)] == []


def test_a_responses_stream_is_split_from_its_response_completed(proxy: str) -> None:
    delta = Delta(proxy)
    payload = {"model": "sim-model", "stream": True, "input": "hello"}
    body = httpx.post(proxy + "/v1/responses", json=payload, timeout=60).content
    assert b'"metrics":{' in body  # the client asked for nothing: it gets the stream as sent
    name = "tokenprobe_time_to_first_token_outside_engine_seconds_count"
    grew = delta.when(name, 1, endpoint="/v1/responses")  # every reading on that endpoint
    assert grew(name) == 1
    parts = (
        grew("tokenprobe_engine_queue_time_seconds_sum", stream="true")
        + grew("tokenprobe_engine_time_to_first_token_seconds_sum", stream="true")
        + grew("tokenprobe_time_to_first_token_outside_engine_seconds_sum")
    )
    assert parts == pytest.approx(grew("tokenprobe_time_to_first_token_seconds_sum"), rel=1e-9)
