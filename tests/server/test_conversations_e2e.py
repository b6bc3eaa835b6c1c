"""Conversations end to end: an agent loop (the official `openai` SDK: tools, the answer
appended with a tool call, a `tool` result, a known sleep as the tool) through a real
`tokenprobe serve` process, against the simulator with its prefix cache.

In the first two rounds the simulator streams a tool call (x-sim-tool-calls, shaped like
vLLM's hermes parser: id and name first, then the arguments in pieces); the loop parses
it from the stream as an agent does and appends that call and its `tool` result.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.sim.tokens import count_prompt_tokens
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.scrape import scrape, wait_for
from tests.server.conftest import no_proxy
from tests.servers import free_port, spawn, stop, wait_http

#: On the tests that read a turn gap; the others read no clock.
GAPS = pytest.mark.quiet("turn gaps are programmed sleeps read within a slack")

SYSTEM = {"role": "system", "content": "You are a weather agent. Call get_weather first."}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
#: The tool's time in each agent's two tool rounds (seconds): the truth of the turn gaps.
SLEEPS = {"oslo": (0.3, 0.6), "buenos aires": (0.45, 0.15)}  # prompts of different lengths
#: A turn gap is at least the sleep and at most this much more (client parse, SDK, loopback
#: on a loaded 2-core machine).
SLACK = 0.5
#: --conversation-idle: well over the longest sleep plus SLACK, so no agent's conversation
#: goes idle between its turns on a loaded machine.
IDLE = 2.0


def agent_loop(base: str, city: str, header: str | None, sent: list[list[Any]]) -> None:
    """Three rounds of one agent; each round's messages are appended to `sent`."""
    client = openai.OpenAI(
        base_url=base + "/v1",
        api_key="sk-test",
        max_retries=0,
        default_headers={"x-session-id": header} if header else None,
    )
    messages: list[Any] = [SYSTEM, {"role": "user", "content": f"Weather in {city}?"}]
    for round_ in range(3):
        sent.append(list(messages))
        calling = round_ < 2  # the model calls the tool twice, then answers
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-sim-tool-calls": "1"} if calling else None,
        )
        content, calls = "", {}  # the call's pieces, by index, as the client received them
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.id or ""
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
        if not calling:
            assert content and not calls
            return
        (call,) = calls.values()
        assert call["id"] and call["name"]
        orjson.loads(call["arguments"])  # the arguments are whole JSON
        function = {"name": call["name"], "arguments": call["arguments"]}
        messages.append(
            {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [{"id": call["id"], "type": "function", "function": function}],
            }
        )
        time.sleep(SLEEPS[city][round_])  # the tool runs
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "12 C, rain"})


def chat(proxy: ProxyUnderTest, messages: list[Any], **headers: str) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "stream": True}
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_a_continuation_the_backend_did_not_cache_is_a_miss(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=4, prefix_cache=1000)
    proxy = start_proxy(sim.url, continuation_cache_miss_ratio=0.5)
    first = [SYSTEM, {"role": "user", "content": "Weather in Oslo, and in all of Norway?"}]
    second = [
        *first,
        {"role": "assistant", "content": "It rains."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat(proxy, first).status_code == 200
    proxy.wait_records(1)
    # Another replica, say: the backend recomputed the whole prefix.
    assert chat(proxy, second, **{"x-sim-cached-tokens": "0"}).status_code == 200
    (_, record) = proxy.wait_records(2)
    assert (record.turn, record.continued_via, record.cached_prompt_tokens) == (2, "messages", 0)
    assert record.shared_prefix_tokens == count_prompt_tokens({"messages": first})
    assert proxy.sample("tokenprobe_continuation_cache_misses_total", model=MODEL) == 1
    assert (
        proxy.sample("tokenprobe_continuation_cached_prompt_ratio_bucket", model=MODEL, le="0.0")
        == 1
    )


def test_the_prefix_cache_reports_whole_blocks(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=4, prefix_cache=1000)
    proxy = start_proxy(sim.url)
    first = [{"role": "user", "content": "x" * 4 * 70}]  # 70 tokens: 64 in whole blocks
    second = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert chat(proxy, first).status_code == 200
    proxy.wait_records(1)
    assert chat(proxy, second).status_code == 200
    (first_record, record) = proxy.wait_records(2)
    assert first_record.cached_prompt_tokens == 0  # nothing seen before
    assert (record.cached_prompt_tokens, record.shared_prefix_tokens) == (64, 70)
    ratio = proxy.sample("tokenprobe_continuation_cached_prompt_ratio_sum", model=MODEL)
    assert ratio == pytest.approx(64 / 70)
    assert proxy.sample("tokenprobe_continuation_cache_misses_total", model=MODEL) == 0


def test_a_flood_of_unique_conversations_stays_within_the_table_oldest_first_out(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=2)
    proxy = start_proxy(sim.url, conversation_table=20)
    firsts = [[{"role": "user", "content": f"question {i}"}] for i in range(30)]
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for messages in firsts:
            body = {"model": MODEL, "messages": messages}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    proxy.wait_records(30)
    assert proxy.sample("tokenprobe_conversations_open") == 20
    assert proxy.sample("tokenprobe_conversation_evictions_total") == 10
    follow = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    assert chat(proxy, [*firsts[0], *follow]).status_code == 200  # evicted: a new one
    assert chat(proxy, [*firsts[29], *follow]).status_code == 200  # kept: its turn 2
    records = proxy.wait_records(32)
    assert (records[30].turn, records[30].continued_via) == (1, None)
    assert (records[31].turn, records[31].continued_via) == (2, "messages")
    assert records[31].conversation_id == records[29].conversation_id
    assert proxy.sample("tokenprobe_conversations_open") == 20


@pytest.mark.parametrize(
    ("value", "reason"),
    [(b"s" * 20_000, "too_long"), (b"sess-\xff\xfe-1", "not_text")],
    ids=["huge", "binary"],
)
def test_a_huge_or_binary_conversation_header_is_not_used_and_counted(
    start_sim: Callable[..., Running],
    start_proxy: Callable[..., ProxyUnderTest],
    value: bytes,
    reason: str,
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=2)
    proxy = start_proxy(sim.url, conversation_header="x-session-id")
    first = [{"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for messages in (first, second, [{"role": "user", "content": "unrelated"}]):
            body = {"model": MODEL, "messages": messages}
            response = client.post(
                "/v1/chat/completions", json=body, headers=[(b"x-session-id", value)]
            )
            assert response.status_code == 200  # measured and relayed as any other
    records = proxy.wait_records(3)
    assert proxy.sample("tokenprobe_conversation_header_refused_total", reason=reason) == 3
    # Recognised by its messages instead; the unrelated one is not joined.
    assert [r.turn for r in records] == [1, 2, 1]
    assert records[1].continued_via == "messages"
    assert records[2].conversation_id != records[0].conversation_id


def test_an_agent_s_retry_after_a_rate_limit_stays_in_its_conversation(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=2)
    proxy = start_proxy(sim.url)
    first = [SYSTEM, {"role": "user", "content": "Weather in Oslo?"}]
    second = [
        *first,
        {"role": "assistant", "content": "Rain."},
        {"role": "user", "content": "Sure?"},
    ]
    assert chat(proxy, first).status_code == 200
    assert chat(proxy, second, **{"x-sim-error": "rate_limit"}).status_code == 429
    assert chat(proxy, second).status_code == 200  # the same messages again
    records = proxy.wait_records(3)
    # The 429 was no exchange: no turn (its record names the conversation it addressed);
    # its retry is the second turn.
    assert [r.turn for r in records] == [1, None, 2]
    assert len({r.conversation_id for r in records}) == 1
    assert (records[1].continued_via, records[2].continued_via) == (None, "messages")


def test_a_refused_responses_request_is_no_turn_nor_what_a_later_one_continues(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """A previous_response_id the backend's store does not know is a 404 (vLLM's
    entrypoints/openai/responses/serving.py, `_make_not_found_error` when the id is not in
    its store, as the simulator's), a 429 a refusal too: before, each was a turn, the
    unknown id opened a conversation of its own, and the continuation after the 429 was
    turn 3."""
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=4)
    proxy = start_proxy(sim.url)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0)
    first = client.responses.create(model=MODEL, input="Weather in Oslo?")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=MODEL,
            input="And Lima?",
            previous_response_id="resp_evicted",
        )
    proxy.wait_records(2)
    # The conversation the unknown id opened was forgotten at its end: the table holds one.
    assert proxy.sample("tokenprobe_conversations_open") == 1
    with pytest.raises(openai.RateLimitError):
        client.responses.create(
            model=MODEL,
            input="And Lima?",
            previous_response_id=first.id,
            extra_headers={"x-sim-error": "rate_limit"},
        )
    client.responses.create(model=MODEL, input="And Lima?", previous_response_id=first.id)
    (one, unknown, limited, two) = proxy.wait_records(4, exact=True)
    assert (unknown.status_code, unknown.turn, unknown.continued_via) == (404, None, None)
    assert (limited.status_code, limited.turn, limited.turn_gap) == (429, None, None)
    assert limited.conversation_id == one.conversation_id
    assert (two.conversation_id, two.turn, two.continued_via) == (
        one.conversation_id,
        2,
        "previous_response",
    )
    via = "previous_response"
    assert proxy.sample("tokenprobe_conversation_continuations_total", model=MODEL, via=via) == 1


@GAPS(seconds=4)  # IDLE after the last turn before the conversations close
@pytest.mark.parametrize("with_header", [False, True], ids=["messages", "header"])
def test_an_agent_loop_is_one_conversation_of_three_turns_with_its_sleeps_as_gaps(
    start_sim: Callable[..., Running], tmp_path: Path, with_header: bool
) -> None:
    sim = start_sim(ttft=0.01, tokens_per_second=2000.0, output_tokens=8, prefix_cache=1000)
    sim.app.config.prefix_cache_block = 1  # cached tokens exactly the shared prefix
    sim.app.prefix_cache.block = 1
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "access.log"
    flags = ["--conversation-header", "x-session-id"] if with_header else []
    with log_path.open("wb") as log_file:
        process = spawn(
            "serve",
            *("--upstream", sim.url, "--port", str(port), "--model-allowlist", MODEL),
            *("--models-refresh", "0", "--conversation-idle", str(IDLE), *flags),
            stdout=log_file.fileno(),
        )
        try:
            wait_http(base + "/healthz")
            sent: dict[str, list[list[Any]]] = {"oslo": [], "buenos aires": []}
            # Two agents at once, with the same system prompt: never one conversation.
            threads = [
                threading.Thread(
                    target=agent_loop,
                    args=(base, city, f"sess-{city}" if with_header else None, sent[city]),
                )
                for city in sent
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert all(len(rounds) == 3 for rounds in sent.values())
            during = scrape(base)
            ended = "tokenprobe_conversation_turns_count"  # unlabelled: its total is its value
            after = wait_for(base, ended, 2, timeout=10 * IDLE, every=0.1)
            assert after.value(ended) >= 2, "the conversations never went idle"
        finally:
            stop(process)
    log = [orjson.loads(line) for line in log_path.read_bytes().splitlines()]
    assert len(log) == 6

    # The access log: two conversations, turns 1, 2, 3 each, gaps equal to the sleeps.
    by_conversation: dict[str, list[dict[str, Any]]] = {}
    for line in sorted(log, key=lambda line: line["arrival"]):
        by_conversation.setdefault(line["conversation"], []).append(line)
    assert len(by_conversation) == 2
    for lines in by_conversation.values():
        assert [line["turn"] for line in lines] == [1, 2, 3]
        city = (
            "oslo"
            if lines[0]["prompt_tokens"] == count_prompt_tokens({"messages": sent["oslo"][0]})
            else "buenos aires"
        )
        rounds = sent[city]
        assert [line["prompt_tokens"] for line in lines] == [
            count_prompt_tokens({"messages": m}) for m in rounds
        ]
        assert lines[0]["turn_gap_ms"] is None
        for line, sleep in zip(lines[1:], SLEEPS[city], strict=True):
            assert sleep * 1000 <= line["turn_gap_ms"] <= (sleep + SLACK) * 1000
        # The simulator's prefix cache: each continuation's cached tokens are its earlier
        # prompt's (the programmed truth), so the ratio is 1.
        for earlier, line in zip(rounds, lines[1:], strict=False):
            assert line["cached_tokens"] == count_prompt_tokens({"messages": earlier})

    via = "header" if with_header else "messages"
    model = {"model": MODEL}
    assert after.value("tokenprobe_conversation_continuations_total", **model, via=via) == 4
    assert after.value("tokenprobe_conversation_turn_gap_seconds_count", **model, via=via) == 4
    gap_sum = after.value("tokenprobe_conversation_turn_gap_seconds_sum", **model, via=via)
    total_sleep = sum(sum(s) for s in SLEEPS.values())
    assert total_sleep <= gap_sum <= total_sleep + 4 * SLACK
    # (Once in CI 3, on the ASGI relay: the SDK closes at [DONE], and where the body's
    # terminator came later that turn was `client_cancelled`, and a failed turn's
    # digest is no prefix. A whole answer is a success now: test_client_leaves_after_the_end.)
    outcomes = [(line["turn"], line["status"], line["error_type"], line["error"]) for line in log]
    ratios = after.value("tokenprobe_continuation_cached_prompt_ratio_count", **model)
    assert ratios == 4, outcomes
    assert after.value("tokenprobe_continuation_cached_prompt_ratio_sum", **model) == 4.0
    assert after.value("tokenprobe_continuation_cache_misses_total", **model) == 0
    # Closed when idle: two conversations of three turns each.
    assert during.value("tokenprobe_conversation_turns_count") == 0
    assert during.value("tokenprobe_conversations_open") == 2
    assert after.value("tokenprobe_conversation_turns_count") == 2
    assert after.value("tokenprobe_conversation_turns_sum") == 6
    assert after.value("tokenprobe_conversation_turns_bucket", le="2.0") == 0
    assert after.value("tokenprobe_conversation_turns_bucket", le="3.0") == 2
    between = after.value("tokenprobe_conversation_between_requests_seconds_sum")
    assert between == pytest.approx(gap_sum)
    model_time = after.value("tokenprobe_conversation_model_seconds_sum")
    e2e = sum(line["e2e_ms"] for line in log) / 1000
    assert model_time == pytest.approx(e2e, abs=0.01)
    duration = after.value("tokenprobe_conversation_duration_seconds_sum")
    assert duration == pytest.approx(model_time + between, abs=0.05)
    assert after.value("tokenprobe_conversations_open") == 0
    if with_header:  # the header's value is never logged
        assert b"sess-oslo" not in log_path.read_bytes()


@GAPS
def test_previous_response_id_continues_a_responses_conversation(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=4)
    proxy = start_proxy(sim.url)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0)
    first = client.responses.create(model=MODEL, input="Weather in Oslo?")
    time.sleep(0.2)
    client.responses.create(model=MODEL, input="And Lima?", previous_response_id=first.id)
    (one, two) = proxy.wait_records(2)
    assert one.response_id == first.id and one.turn == 1
    assert (two.conversation_id, two.turn, two.continued_via) == (
        one.conversation_id,
        2,
        "previous_response",
    )
    assert two.turn_gap is not None and 0.2 <= two.turn_gap <= 0.2 + SLACK
    # the previous prompt: vLLM puts back the answer's text only (docs/conversations.md)
    assert two.shared_prefix_tokens == one.prompt_tokens


#: Two turns of one conversation per API: (path, first body, second body).
LONG = "You answer questions about trains. " * 30  # 1050 characters: 263 simulated tokens
TURNS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "Oslo?"}]},
        {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "Oslo?"},
                      {"role": "assistant", "content": "At 9."}, {"role": "user", "content": "And?"}]},
    ),
    "messages": (
        "/v1/messages",
        {"system": LONG, "max_tokens": 8, "messages": [{"role": "user", "content": "Oslo?"}]},
        {"system": LONG, "max_tokens": 8, "messages": [{"role": "user", "content": "Oslo?"},
         {"role": "assistant", "content": "At 9."}, {"role": "user", "content": "And?"}]},
    ),
    "responses": (
        "/v1/responses",
        {"input": [{"role": "system", "content": LONG}, {"role": "user", "content": "Oslo?"}]},
        {"input": [{"role": "system", "content": LONG}, {"role": "user", "content": "Oslo?"},
                   {"role": "assistant", "content": "At 9."}, {"role": "user", "content": "And?"}]},
    ),
}  # fmt: skip


@GAPS
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("api", list(TURNS))
def test_each_api_s_continuation_gets_its_gap_and_the_programmed_cached_tokens(
    start_sim: Callable[..., Running],
    start_proxy: Callable[..., ProxyUnderTest],
    api: str,
    stream: bool,
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=4, prefix_cache=1000)
    proxy = start_proxy(sim.url)
    path, first, second = TURNS[api]
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        for turn, body in enumerate((first, second)):
            if turn:
                time.sleep(0.3)  # the tool
            response = client.post(path, json={"model": MODEL, "stream": stream, **body})
            assert response.status_code == 200
    one, two = proxy.wait_records(2)
    # The truth: the first turn's whole prompt, in whole blocks of 16.
    truth = count_prompt_tokens(first) // 16 * 16
    assert one.prompt_tokens == count_prompt_tokens(first)
    assert (two.turn, two.continued_via, two.conversation_id) == (
        2,
        "messages",
        one.conversation_id,
    )
    assert two.cached_prompt_tokens == truth and two.shared_prefix_tokens == one.prompt_tokens
    assert two.turn_gap is not None and 0.3 <= two.turn_gap <= 0.3 + SLACK
    ratio = proxy.sample("tokenprobe_continuation_cached_prompt_ratio_sum", model=MODEL)
    assert ratio == pytest.approx(truth / count_prompt_tokens(first))


@no_proxy
@pytest.mark.parametrize("header", ["authorization", "X-Api-Key", "cookie", "not a header"])
def test_a_credential_or_malformed_conversation_header_is_refused_at_start(header: str) -> None:
    from proxy.settings import SettingsError, parse

    with pytest.raises(SettingsError, match="--conversation-header"):
        parse(["--upstream", "http://127.0.0.1:9", "--conversation-header", header], {})


@no_proxy
def test_conversation_settings_come_from_flags_and_variables() -> None:
    from proxy.settings import SettingsError, parse

    env = {"TOKENPROBE_CONVERSATION_HEADER": "X-Session-Id", "TOKENPROBE_CONVERSATION_IDLE": "30"}
    settings = parse(["--upstream", "http://127.0.0.1:9", "--conversation-table", "500"], env)
    assert settings.conversation_header == "x-session-id"
    assert (settings.conversation_idle, settings.conversation_table) == (30.0, 500)
    with pytest.raises(SettingsError, match="between 0 and 1"):
        parse(["--upstream", "http://h:1", "--continuation-cache-miss-ratio", "1.5"], {})
