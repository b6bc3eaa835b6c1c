"""llama-server's n > 1: a task per choice (`n` is `n_cmpl`, tools/server/server-schema.cpp),
each with its own last event, all of them counted (proxy/core/observe.py, `_task`).

Real bytes (tests/fixtures/streams/llamacpp/README.md, captured with `--parallel 2`): chat
writes each task's finish chunk for its own choice and, with include_usage, that task's
usage chunk (`choices: []`) right after it, `timings` on the last of the two; completions
put usage and timings on each finish chunk. The n tasks of one prompt share it: the
server evaluates it once (its /metrics `prompt_tokens_total` grows by one prompt), though
each task's usage and timings name the whole prompt."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.core.llamacpp import several_prompts
from proxy.core.measurement import Measurement, TokenSource
from proxy.core.observe import StreamObserver
from proxy.core.request import parse_request
from proxy.core.tokens import TokenCounter
from tests.paths import STREAMS
from tests.tokenizers_local import loaded_counter

START, OPENED, FIRST, STEP = 100.0, 100.125, 100.5, 0.01
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
INDEX: dict[str, Any] = orjson.loads((STREAMS / "llamacpp" / "index.json").read_bytes())


def events(raw: bytes) -> list[bytes]:
    """A stream cut into one read per event."""
    return [part + b"\n\n" for part in raw.split(b"\n\n") if part]


def payloads(reads: list[bytes]) -> list[Any]:
    return [orjson.loads(r.strip()[6:]) for r in reads if r.strip() != b"data: [DONE]"]


def replay(
    path: str, body: dict[str, Any], reads: list[bytes], counter: TokenCounter | None = None
) -> Measurement:
    """The record of `reads` (one every STEP) as the answer to `body`, counted by `counter`
    where usage counts nothing."""
    info, _ = parse_request(path, orjson.dumps(body))
    observer = StreamObserver(info, start=START, collect_text=counter is not None)
    streamed = body.get("stream") is True
    observer.open(200, "text/event-stream" if streamed else "application/json", OPENED)
    times = [FIRST + STEP * i for i in range(len(reads))]
    for chunk, now in zip(reads, times, strict=True):
        observer.feed(chunk, now)
    end = times[-1] + STEP
    observer.end_of_stream(end)
    return asyncio.run(
        observer.finish(
            end=end,
            started_at=0.0,
            status_code=200,
            error_type=None,
            error_message=None,
            counter=counter,
        )
    )


def captured(name: str) -> tuple[str, dict[str, Any], list[bytes]]:
    entry = INDEX["requests"][name]
    raw = (STREAMS / "llamacpp" / name).read_bytes()
    return entry["path"], entry["body"], events(raw) if name.endswith(".sse") else [raw]


def finals(chunks: list[Any]) -> list[dict[str, Any]]:
    """Each task's own account: the chunks that carry `timings`."""
    return [c for c in chunks if type(c) is dict and "timings" in c]


def first_task(chunks: list[Any]) -> int:
    """The choice whose first text came first."""
    for c in chunks:
        if type(c) is dict and c["choices"]:
            choice = c["choices"][0]
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                return int(choice["index"])
    raise AssertionError("no text")


def per_choice_tpot(chunks: list[Any], output: int, choices: int) -> float:
    """The record's TPOT: the lower median over choices of the span from a choice's first
    text read to its last over its share of the output less one (a `length` finish ends
    no token of its own: proxy/core/observe.py, _ending_reads)."""
    reads: dict[int, list[float]] = {}
    for i, c in enumerate(chunks):
        if type(c) is dict and c["choices"]:
            choice = c["choices"][0]
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                reads.setdefault(choice["index"], []).append(FIRST + STEP * i)
    share = output / choices
    tpots = sorted((r[-1] - r[0]) / (share - 1) for r in reads.values())
    return tpots[(len(tpots) - 1) // 2]


def test_chat_with_include_usage_counts_every_tasks_usage_and_the_prompt_once() -> None:
    path, body, reads = captured("chat_n2_stream_include_usage.sse")
    chunks = payloads(reads)
    tasks = finals(chunks)
    assert [c["choices"] for c in tasks] == [[], []]  # each task's usage chunk
    usages = [c["usage"] for c in tasks]
    m = replay(path, body, reads)
    assert m.token_source is TokenSource.USAGE
    assert m.output_tokens == sum(u["completion_tokens"] for u in usages) == 10
    assert m.prompt_tokens == usages[0]["prompt_tokens"] == usages[1]["prompt_tokens"] == 11
    assert m.cached_prompt_tokens == 0
    assert m.tpot == pytest.approx(per_choice_tpot(chunks, 10, 2))


def test_chat_without_usage_counts_every_tasks_predicted_n() -> None:
    path, body, reads = captured("chat_n2_stream_no_usage.sse")
    chunks = payloads(reads)
    timings = [c["timings"] for c in finals(chunks)]
    assert [c["choices"][0]["finish_reason"] for c in finals(chunks)] == ["length", "length"]
    m = replay(path, body, reads)
    assert m.token_source is TokenSource.ENGINE
    assert m.output_tokens == sum(t["predicted_n"] for t in timings) == 10
    assert m.prompt_tokens == timings[0]["prompt_n"] + timings[0]["cache_n"] == 11
    assert m.tpot == pytest.approx(per_choice_tpot(chunks, 10, 2))


@pytest.mark.parametrize(
    "name", ["chat_n2_stream_include_usage.sse", "chat_n2_stream_no_usage.sse"]
)
def test_the_engine_part_of_the_split_is_the_first_tokens_tasks(name: str) -> None:
    path, body, reads = captured(name)
    chunks = payloads(reads)
    first = first_task(chunks)
    assert first == 1  # the capture's first text is choice 1's: not the last task's
    # each task's account is its finish chunk or the usage chunk right after it
    by_task: dict[int, dict[str, Any]] = {}
    finished = None
    for c in chunks:
        if type(c) is dict and c["choices"] and c["choices"][0].get("finish_reason"):
            finished = c["choices"][0]["index"]
        if type(c) is dict and "timings" in c:
            assert finished is not None
            by_task[finished] = c["timings"]
    assert by_task[0]["prompt_ms"] != by_task[1]["prompt_ms"]
    m = replay(path, body, reads)
    assert m.engine is not None
    assert m.engine.time_to_first_token == pytest.approx(by_task[first]["prompt_ms"] / 1000)


def test_completions_n2_counts_the_prompt_once() -> None:
    path, body, reads = captured("completions_n2_stream.sse")
    usages = [c["usage"] for c in finals(payloads(reads))]
    m = replay(path, body, reads)
    assert m.token_source is TokenSource.USAGE
    assert m.output_tokens == sum(u["completion_tokens"] for u in usages) == 10
    assert m.prompt_tokens == usages[0]["prompt_tokens"] == 3  # not once a task


def test_completions_of_two_prompts_n2_counts_each_prompt_once() -> None:
    """Task indices are `prompt * n + choice` (server-queue.cpp, post_tasks)."""
    path, body, reads = captured("completions_2_prompts_n2_stream.sse")
    tasks = {c["choices"][0]["index"]: c["usage"] for c in finals(payloads(reads))}
    assert sorted(tasks) == [0, 1, 2, 3]
    m = replay(path, body, reads)
    assert m.output_tokens == sum(u["completion_tokens"] for u in tasks.values()) == 20
    assert m.prompt_tokens == tasks[0]["prompt_tokens"] + tasks[2]["prompt_tokens"] == 9
    assert m.cached_prompt_tokens == 0


def test_a_merged_body_claims_no_output_from_its_first_tasks_usage() -> None:
    """Not streamed, llama-server merges the tasks' answers into the first one's, whose
    usage and timings count that task alone (server-context.cpp, handle_completions_impl):
    two choices of 5 tokens say 5. Their prompt is the request's (the tasks share it); the
    output is not claimed from them (it was: 5, source usage)."""
    path, body, (raw,) = captured("chat_n2.json")
    whole = orjson.loads(raw)
    assert len(whole["choices"]) == 2
    assert whole["usage"]["completion_tokens"] == whole["timings"]["predicted_n"] == 5
    m = replay(path, body, [raw])
    assert (m.prompt_tokens, m.cached_prompt_tokens) == (11, 0)
    assert (m.output_tokens, m.token_source) == (None, TokenSource.NONE)
    assert m.finish_reason == "length"


def test_a_merged_body_has_every_choice_counted_by_a_tokenizer(tmp_path: Path) -> None:
    """With a tokenizer, every choice's text is counted (each alone, added up) and the
    prompt is the first task's usage: 11 and 2 x the tokens of "]]]]]" (not usage's 5)."""
    path, body, (raw,) = captured("chat_n2.json")
    texts = [c["message"]["content"] for c in orjson.loads(raw)["choices"]]
    transformers = pytest.importorskip("transformers")
    counter = loaded_counter(tmp_path)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
        expected = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
        m = replay(path, body, [raw], counter)
    finally:
        counter.close()
    assert (m.prompt_tokens, m.cached_prompt_tokens) == (11, 0)
    assert (m.output_tokens, m.token_source) == (expected, TokenSource.TOKENIZER)


def test_a_merged_body_of_a_list_of_prompts_claims_no_prompt_either() -> None:
    """Two prompts, not streamed: llama-server answers the first task's object with the
    second's choice appended, so its usage's prompt is the first prompt's alone (the real
    server: 2 for ["hi", <19 tokens>]). Neither its prompt nor its output is the request's
    (the prompt was: 2)."""
    body = {"model": "tiny", "prompt": ["hi", "the quick brown fox jumps"], "max_tokens": 4}
    merged = {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "tiny",
        "choices": [
            {"text": " a b c d", "index": 0, "finish_reason": "length", "logprobs": None},
            {"text": " e f g h", "index": 1, "finish_reason": "length", "logprobs": None},
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6},
        "timings": {"prompt_n": 2, "prompt_ms": 1.0, "predicted_n": 4, "predicted_ms": 4.0},
    }
    m = replay("/v1/completions", body, [orjson.dumps(merged)])
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (None, None, TokenSource.NONE)
    one = {**body, "prompt": "hi"}  # one prompt: its usage is the request's
    alone = {**merged, "choices": merged["choices"][:1]}
    m = replay("/v1/completions", one, [orjson.dumps(alone)])
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (2, 4, TokenSource.USAGE)


def test_one_choice_body_is_counted_by_its_usage() -> None:
    """One choice is one task: its body's usage is the request's, as it was."""
    path, body, (raw,) = captured("chat_nonstream.json")
    m = replay(path, body, [raw])
    usage = orjson.loads(raw)["usage"]
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        TokenSource.USAGE,
    )


def test_timings_on_every_chunk_change_nothing() -> None:
    """`timings_per_token` puts timings on every chunk; only a task's last event is its
    account (the Api reads timings only beside usage or a finish)."""
    path, body, reads = captured("chat_n2_stream_include_usage.sse")
    chunks = payloads(reads)
    last = finals(chunks)[-1]["timings"]
    every = [
        b"data: " + orjson.dumps({**c, "timings": last}) + b"\n\n"
        if type(c) is dict
        and "timings" not in c
        and c["choices"]
        and "content" in (c["choices"][0].get("delta") or {})
        else r
        for c, r in zip([*chunks, None], reads, strict=True)
    ]
    plain, timed = replay(path, body, reads), replay(path, body, every)
    assert (timed.output_tokens, timed.prompt_tokens, timed.token_source) == (
        plain.output_tokens,
        plain.prompt_tokens,
        plain.token_source,
    )


def test_a_vllm_n2_stream_counts_its_one_usage() -> None:
    """vLLM writes one usage chunk for all choices, no timings: its completion_tokens
    already adds the choices up and its prompt is counted once
    (vllm/entrypoints/openai/chat_completion/serving.py:842-846)."""
    reads = events((STREAMS / "vllm-0.32-held" / "chat_n2_no_usage.sse").read_bytes())
    usage = {"prompt_tokens": 17, "total_tokens": 29, "completion_tokens": 12}
    final = {"id": "chatcmpl-865fa41554650aeb", "object": "chat.completion.chunk",
             "created": 1796638291, "model": "tiny", "choices": [], "usage": usage}  # fmt: skip
    reads = [*reads[:-1], b"data: " + orjson.dumps(final) + b"\n\n", reads[-1]]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    m = replay(CHAT, body, reads)
    assert (m.output_tokens, m.prompt_tokens, m.token_source) == (12, 17, TokenSource.USAGE)


@pytest.mark.parametrize(
    ("asked", "tasks_a_prompt"),
    [({"n": 2}, 2), ({"n_cmpl": 2}, 2), ({"n": 1, "n_cmpl": 2}, 2), ({"n_cmpl": None, "n": 2}, 2)],
    ids=["n", "n_cmpl", "n_cmpl-over-n", "null-n_cmpl"],
)
def test_n_cmpl_is_read_before_its_alias_n(asked: dict[str, Any], tasks_a_prompt: int) -> None:
    """llama-server reads `n` only as `n_cmpl`'s fallback (server-schema.cpp,
    `add_alias("n")`), and streams alike for either: the prompt is counted once a prompt
    whichever was sent (it was counted once a task for `n_cmpl`: 8 for 4)."""
    path, body, reads = captured("completions_n2_stream.sse")
    chunks = payloads(reads)
    body = {k: v for k, v in body.items() if k not in ("n", "n_cmpl")} | asked
    record = replay(path, body, reads)
    usages = [c["usage"] for c in finals(chunks)]
    assert len(usages) == tasks_a_prompt
    assert record.prompt_tokens == usages[0]["prompt_tokens"]
    assert record.output_tokens == sum(u["completion_tokens"] for u in usages)


def test_an_array_holding_a_number_is_one_prompt() -> None:
    """llama-server reads an array that holds any number as one prompt, texts and token
    ids mixed (server-common.cpp, json_is_array_and_contains_numbers): its usage stays."""
    assert not several_prompts(["hi", 15, 16, 17])
    assert not several_prompts([15, 16, 17]) and not several_prompts(["one"])
    assert several_prompts(["hi", "there"]) and several_prompts([[15, 16], [17]])
