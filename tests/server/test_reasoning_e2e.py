"""Reasoning and tool calls through the proxy in front of the simulator (issue 26): for
chat, Messages and Responses, every figure equals what the simulator was programmed to
send (proxy/sim/agentic.py): its thinking length, the answer after it, the calls, the
truncated and invalid ones, megabytes of arguments; and the client gets the bytes the
simulator sent.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any

import httpx
import pytest

from proxy.core.measurement import Measurement
from tests.conftest import MODEL, ProxyUnderTest, Running

TTFT = 0.1
INTERVAL = 0.02  # x-sim-tps 50: one token every 20 ms
PROGRAM = {"x-sim-ttft": str(TTFT), "x-sim-tps": "50"}
CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
COHERE = "/cohere/v2/chat"
APIS = (CHAT, MESSAGES, RESPONSES, COHERE)


def body(path: str, max_tokens: int | None = None) -> dict[str, Any]:
    prompt = [{"role": "user", "content": "What is the weather?"}]
    if path == CHAT:
        out: dict[str, Any] = {"model": MODEL, "messages": prompt, "stream": True}
        out["stream_options"] = {"include_usage": True}
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        return out
    if path in (MESSAGES, COHERE):
        return {"model": MODEL, "messages": prompt, "stream": True, "max_tokens": max_tokens or 256}
    out = {"model": MODEL, "input": "What is the weather?", "stream": True}
    if max_tokens is not None:
        out["max_output_tokens"] = max_tokens
    return out


def run(
    proxy: ProxyUnderTest, sim: Running, path: str, headers: dict[str, str], **kw: Any
) -> tuple[Measurement, bytes]:
    n = len(proxy.records)
    received = httpx.post(
        proxy.url + path, json=body(path, **kw), headers={**PROGRAM, **headers}, timeout=30
    ).content
    deadline = time.monotonic() + 5
    while len(proxy.records) <= n and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = sim.app.state.last()
    assert sent is not None and hashlib.sha256(received).hexdigest() == sent.body_sha256
    return proxy.records[-1], received


def instants(m: Measurement) -> list[float]:
    """Each content event's instant (seconds after start, as ttft) on the proxy's own clock:
    the TTFT, then one inter-token latency after another (0 where two came in one read).

    Two events tell their order only when they came in two reads: a loaded machine that
    stalls the proxy (or the simulator) longer than the gap between two tokens hands it
    both in one read, at one instant. So a test pins each kind's instant to its own
    event's, which holds however the reads fall, and bounds it below by the simulator's
    schedule (it sends token i at TTFT + i * gap or later, and a read is later still)."""
    assert m.ttft is not None
    out = [m.ttft]
    for gap in m.inter_token_latencies:
        out.append(out[-1] + gap)
    assert len(out) == m.content_events, (len(out), m.content_events)
    return out


def sample(proxy: ProxyUnderTest, name: str, path: str, **labels: str) -> float:
    return proxy.sample(name, model=MODEL, endpoint=path, **labels)


@pytest.mark.parametrize("path", APIS)
def test_reasoning_then_answer_is_measured_by_kind(
    sim: Running, proxy: ProxyUnderTest, path: str
) -> None:
    m, _ = run(proxy, sim, path, {"x-sim-reasoning-tokens": "6", "x-sim-output-tokens": "4"})
    assert m.ok and m.output_tokens == 11  # and the EOS that ends the answer
    first, last, answer, at = m.first_reasoning, m.last_reasoning, m.first_answer, instants(m)
    assert first is not None and last is not None and answer is not None
    assert m.ttft == first and first >= TTFT
    # the last reasoning token is the 6th event, the first answer the 7th (`instants`)
    assert (first, last, answer) == pytest.approx((at[0], at[5], at[6]), abs=1e-9)
    assert last >= TTFT + 5 * INTERVAL and answer >= TTFT + 6 * INTERVAL
    # the answer is what usage counts past the reasoning: its 4 tokens and the EOS
    assert m.reasoning_events == 6 and m.answer_tokens == 5
    # chat and Responses usage carry reasoning_tokens; Messages and Cohere usage do not
    want_source = "events" if path in (MESSAGES, COHERE) else "usage"
    assert (m.reasoning_tokens, m.reasoning_token_source) == (6, want_source)
    assert m.without_answer is None and m.tool_calls == ()
    # Each phase's time per token, unless a loaded machine handed the proxy all of a
    # phase's tokens in one read: a span of one read measures no time per token (none).
    assert m.reasoning_tpot is not None or at[0] == at[5], (m.reasoning_tpot, at)
    assert m.answer_tpot is not None or at[6] == at[-1], (m.answer_tpot, at)
    count = "tokenprobe_time_to_first_answer_token_seconds_count"
    assert sample(proxy, count, path) == 1
    assert sample(proxy, "tokenprobe_reasoning_duration_seconds_count", path) == 1
    assert sample(proxy, "tokenprobe_reasoning_tokens_total", path, source=want_source) == 6
    share = sample(proxy, "tokenprobe_request_answer_token_share_sum", path)
    assert share == pytest.approx(5 / 11)  # the answer's 4 tokens and the EOS, of 11


def test_chat_reasoning_that_usage_counts_as_zero_is_counted_from_the_stream(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    # vLLM reports 0 when the chat template opened <think> in the prompt
    program = {"x-sim-reasoning-tokens": "5", "x-sim-output-tokens": "2",
               "x-sim-reasoning-usage": "zero"}  # fmt: skip
    m, raw = run(proxy, sim, CHAT, program)
    assert b'"reasoning_tokens":0' in raw
    assert (m.reasoning_tokens, m.reasoning_token_source) == (5, "events")


@pytest.mark.parametrize("path", APIS)
def test_a_stream_cut_off_while_reasoning_has_no_answer(
    sim: Running, proxy: ProxyUnderTest, path: str
) -> None:
    program = {"x-sim-reasoning-tokens": "8", "x-sim-output-tokens": "4"}
    m, _ = run(proxy, sim, path, program, max_tokens=5)
    assert m.finish_reason == "length" and m.first_answer is None
    assert m.first_reasoning is not None and m.reasoning_events == 5
    assert m.without_answer == "length"
    total = "tokenprobe_requests_without_answer_total"
    assert sample(proxy, total, path, reason="length") == 1


def client_outcomes(path: str, raw: bytes) -> list[str]:
    """The calls as a client assembles them from the bytes it got, judged by the rules
    (proxy/core/toolcalls.py) with the standard library's JSON parser."""
    events = [
        json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")
    ]
    arguments: dict[int, str] = {}
    length = False
    for e in events:
        if path == CHAT:
            for choice in e.get("choices", []):
                for call in choice.get("delta", {}).get("tool_calls") or []:
                    piece = call.get("function", {}).get("arguments", "")
                    arguments[call["index"]] = arguments.get(call["index"], "") + piece
                length = length or choice.get("finish_reason") == "length"
        elif path == COHERE:
            if e["type"] == "tool-call-start":
                arguments[e["index"]] = e["delta"]["message"]["tool_calls"]["function"]["arguments"]
            if e["type"] == "tool-call-delta":
                arguments[e["index"]] += e["delta"]["message"]["tool_calls"]["function"][
                    "arguments"
                ]
            if e["type"] == "message-end":
                length = e["delta"]["finish_reason"] == "MAX_TOKENS"
        elif path == MESSAGES:
            if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
                arguments[e["index"]] = ""
            if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
                arguments[e["index"]] += e["delta"]["partial_json"]
            if e["type"] == "message_delta":
                length = e["delta"]["stop_reason"] == "max_tokens"
        else:
            if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call":
                arguments[e["output_index"]] = ""
            if e["type"] == "response.function_call_arguments.delta":
                arguments[e["output_index"]] += e["delta"]
            if e["type"] == "response.completed":
                details = e["response"]["incomplete_details"] or {}
                length = details.get("reason") == "max_output_tokens"
    out = []
    for i, index in enumerate(sorted(arguments)):
        if length and i == len(arguments) - 1:
            out.append("truncated")
            continue
        try:
            parsed = json.loads(arguments[index])
        except ValueError:
            parsed = None
        out.append("complete" if isinstance(parsed, dict) else "invalid_arguments")
    return out


@pytest.mark.parametrize("path", APIS)
def test_tool_calls_are_counted_by_outcome(sim: Running, proxy: ProxyUnderTest, path: str) -> None:
    # three calls of 4 tokens each (opening + 3 argument pieces); the last two end without
    # their closing brace; max_tokens 10 cuts the third after its first piece
    program = {"x-sim-output-tokens": "0", "x-sim-tool-calls": "3", "x-sim-invalid-tool-calls": "2"}
    m, raw = run(proxy, sim, path, program, max_tokens=10)
    outcomes = [c.outcome for c in m.tool_calls]
    assert outcomes == ["complete", "invalid_arguments", "truncated"]
    assert outcomes == client_outcomes(path, raw)
    assert m.first_tool_call is not None and m.first_tool_call == m.ttft
    assert m.first_answer is None and m.without_answer is None  # the client got calls
    seconds = [c.arguments_seconds for c in m.tool_calls]
    assert all(s is not None and s >= 0 for s in seconds)
    # the first call's last piece is token 4, sent at TTFT + 3 * 20 ms or later
    assert m.first_tool_call + seconds[0] >= TTFT + 3 * INTERVAL  # type: ignore[operator]
    for outcome in ("complete", "invalid_arguments", "truncated"):
        assert sample(proxy, "tokenprobe_tool_calls_total", path, outcome=outcome) == 1
    assert sample(proxy, "tokenprobe_tool_calls_per_answer_sum", path) == 3
    assert sample(proxy, "tokenprobe_tool_call_arguments_seconds_count", path) == 3


@pytest.mark.parametrize("path", APIS)
def test_complete_calls_after_reasoning_and_an_answer(
    sim: Running, proxy: ProxyUnderTest, path: str
) -> None:
    program = {"x-sim-reasoning-tokens": "2", "x-sim-output-tokens": "1", "x-sim-tool-calls": "2"}
    # Tokens 200 ms apart, not 20, so that the three instants come in three reads and are
    # told apart on most runs; a stall longer than that (a loaded machine) puts two in one
    # read, at one instant, which `instants` allows for.
    gap = 0.2
    m, raw = run(proxy, sim, path, {**program, "x-sim-tps": str(1 / gap)})
    # a Responses response that made calls is just "completed"
    assert m.finish_reason == ("stop" if path == RESPONSES else "tool_calls")
    assert (
        [c.outcome for c in m.tool_calls] == ["complete", "complete"] == client_outcomes(path, raw)
    )
    # the reasoning is events 1 and 2, the answer the 3rd, the first call's opening the 4th
    kinds, at = (m.first_reasoning, m.first_answer, m.first_tool_call), instants(m)
    assert kinds == pytest.approx((at[0], at[2], at[3]), abs=1e-9)
    assert at[2] >= TTFT + 2 * gap and at[3] >= TTFT + 3 * gap


@pytest.mark.parametrize("path", APIS)
def test_tokens_merged_across_a_phase_boundary_count_as_both_kinds_at_one_instant(
    sim: Running, proxy: ProxyUnderTest, path: str
) -> None:
    # The last reasoning token goes out with the first answer token, the last answer token
    # with the call's opening (x-sim-merged-boundaries: vLLM's server merging two engine
    # steps); chat gets one delta of both kinds, the other APIs two events in one write.
    # Tokens 100 ms apart, so that the three instants told apart come in three reads on
    # most runs (`instants` allows for a stall that puts two in one).
    gap = 0.1
    program = {"x-sim-reasoning-tokens": "2", "x-sim-output-tokens": "2",
               "x-sim-tool-calls": "1", "x-sim-merged-boundaries": "1", "x-sim-tps": str(1 / gap)}  # fmt: skip
    m, raw = run(proxy, sim, path, program)
    # 2 + 2 + the call: 1 + 3 pieces, and the EOS
    assert m.reasoning_events == 2 and m.output_tokens == 9
    assert [c.outcome for c in m.tool_calls] == ["complete"] == client_outcomes(path, raw)
    first, last, answer, call = (
        m.first_reasoning,
        m.last_reasoning,
        m.first_answer,
        m.first_tool_call,
    )
    assert first is not None and answer is not None and call is not None
    assert answer == last  # one write, so one read
    at = instants(m)
    if path == CHAT:  # six content events: r0, r1 + a0, a1 + the opening, three pieces
        assert len(re.findall(rb'"delta":\{"reasoning":"[^"]*","content":"', raw)) == 1
        assert len(re.findall(rb'"delta":\{"content":"[^"]*","tool_calls":\[\{"id"', raw)) == 1
        assert len(at) == 6 and (first, answer, call) == pytest.approx(tuple(at[:3]), abs=1e-9)
    else:  # eight: r0, then r1 and a0 in one write, a1 and the opening in one, three pieces
        assert len(at) == 8
        assert (first, last, answer, call) == pytest.approx((*at[0:3], at[4]), abs=1e-9)
    # a merged write goes out at its later token's time (proxy/sim/agentic.py): the first
    # answer token is the 3rd token, the call's opening the 5th
    assert answer >= TTFT + 2 * gap and call >= TTFT + 4 * gap


def test_megabytes_of_arguments_are_not_kept_and_count_as_unknown(
    sim: Running, proxy: ProxyUnderTest
) -> None:
    # 3 MiB of arguments in 64 KiB pieces: over the 1 MiB kept per call
    program = {"x-sim-output-tokens": "0", "x-sim-tool-calls": "1",
               "x-sim-tool-call-argument-bytes": str(3 << 20)}  # fmt: skip
    m, raw = run(proxy, sim, CHAT, program)
    assert len(raw) > 3 << 20 and m.ok
    assert [c.outcome for c in m.tool_calls] == ["unknown"]
    assert sample(proxy, "tokenprobe_tool_calls_total", CHAT, outcome="unknown") == 1
