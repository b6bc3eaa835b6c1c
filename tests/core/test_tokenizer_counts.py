"""Token counts from a local tokenizer when the backend sends no usage."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.core.apis import api_for
from proxy.core.chat_prompt import responses_template
from proxy.core.measurement import Measurement, TokenSource
from proxy.core.observe import StreamObserver
from proxy.core.tokens import TokenCounter, count_output, count_request, load_tokenizer
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.tokenizers_local import (
    build_tiny_tokenizer,
    loaded_counter,
    mistral_tokenizer_dir,
    with_chat_template,
)

NO_USAGE = {"x-sim-usage-mode": "ignore", "x-sim-output-tokens": "24"}


def streamed_text(raw: bytes) -> str:
    text = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


@pytest.fixture(params=["tiny-bpe", "mistral-sentencepiece"])
def tokenizer_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "tiny-bpe":
        return build_tiny_tokenizer(tmp_path)
    return mistral_tokenizer_dir(tmp_path)


def test_tokenizer_counts_when_backend_sends_no_usage(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest], tokenizer_dir: Path
) -> None:
    proxy = start_proxy(sim.url, tokenizer=str(with_chat_template(tokenizer_dir)))
    deadline = time.monotonic() + 30
    while not (proxy.app.counter and proxy.app.counter.ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    raw = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "stream": True,
            "messages": [{"role": "user", "content": "你好 hello"}],
        },
        headers=NO_USAGE,
    ).content
    while not proxy.records and time.monotonic() < deadline:
        time.sleep(0.01)
    m = proxy.records[0]
    expected = count_output(load_tokenizer(str(tokenizer_dir)), [streamed_text(raw)])
    assert m.token_source is TokenSource.TOKENIZER
    assert m.output_tokens == expected and expected > 0
    assert m.prompt_tokens is not None and m.prompt_tokens > 0
    assert (
        proxy.sample(
            "tokenprobe_generation_tokens_total",
            model=MODEL,
            endpoint="/v1/chat/completions",
            source="tokenizer",
        )
        == expected
    )


def test_usage_wins_over_the_tokenizer(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest], tmp_path: Path
) -> None:
    proxy = start_proxy(sim.url, tokenizer=str(build_tiny_tokenizer(tmp_path)))
    httpx.post(
        proxy.url + "/v1/chat/completions", json={"model": MODEL, "stream": True, "messages": []}
    )
    deadline = time.monotonic() + 5
    while not proxy.records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.records[0].token_source is TokenSource.USAGE


def test_transformers_is_not_imported_without_a_tokenizer() -> None:
    import subprocess
    import sys

    code = "import proxy.server.app, proxy.server.serve, sys; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_messages_client_that_left_after_message_start_keeps_its_exact_prompt(
    tmp_path: Path,
) -> None:
    """message_start's input_tokens is vLLM's own count (anthropic/serving.py): when the
    client leaves, a tokenizer counts the output from the texts and the prompt stays
    vLLM's, not the tokenizer's re-count of the request (a review saw 2 against 43)."""
    from proxy.core.measurement import ErrorType
    from tests.core.test_apis import MSG_TIMES, START, events

    counter = loaded_counter(tmp_path)
    api = api_for("/v1/messages")
    assert api is not None
    request = api.read_request(
        {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Hello there"}]}
    )
    observer = StreamObserver(request, start=START, collect_text=True)
    observer.open(200, "text/event-stream", START)
    for chunk, now in zip(events("vllm_messages.sse")[:11], MSG_TIMES[:11], strict=True):
        observer.feed(chunk, now)
    observer.end_of_stream(101.5)
    m = asyncio.run(
        observer.finish(end=101.5, started_at=0.0, status_code=200,
                        error_type=ErrorType.CLIENT_CANCELLED, error_message=None,
                        counter=counter)
    )  # fmt: skip
    counter.close()
    assert m.token_source is TokenSource.TOKENIZER and m.output_tokens
    assert m.prompt_tokens == 12  # message_start's input_tokens


def test_a_whole_chat_answer_counts_its_reasoning_and_calls_as_its_stream_does(
    tmp_path: Path,
) -> None:
    """Without usage, a tokenizer counts what was generated: a stream's deltas give the
    reasoning and the tool calls' names and arguments with the answer (vLLM counts them all
    in completion_tokens); a non-streamed message gave its `content` alone."""
    counter = loaded_counter(tmp_path)
    api = api_for("/v1/chat/completions")
    assert api is not None
    call = {"index": 0, "id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": ' {"city": "Oslo"}'}}  # fmt: skip
    message = {"role": "assistant", "content": " The answer is sunny.",
               "reasoning": "Let me look it up.", "tool_calls": [call]}  # fmt: skip
    deltas = [{"reasoning": message["reasoning"]}, {"content": message["content"]},
              {"tool_calls": [call]}]  # fmt: skip

    def count(streamed: bool) -> int | None:
        request = api.read_request({"model": MODEL, "stream": streamed, "messages": []})
        observer = StreamObserver(request, start=0.0, collect_text=True)
        if streamed:
            observer.open(200, "text/event-stream", 0.0)
            for delta in deltas:
                choice = {"index": 0, "delta": delta, "finish_reason": None}
                observer.feed(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n", 0.1)
            observer.feed(b"data: [DONE]\n\n", 0.2)
        else:
            observer.open(200, "application/json", 0.0)
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
            observer.feed(orjson.dumps({"choices": [choice]}), 0.1)
        observer.end_of_stream(0.3)
        m = asyncio.run(
            observer.finish(end=0.3, started_at=0.0, status_code=200, error_type=None,
                            error_message=None, counter=counter)
        )  # fmt: skip
        assert m.token_source is TokenSource.TOKENIZER
        return m.output_tokens

    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path / "again")))
    answer_alone = count_output(tokenizer, [str(message["content"])])
    whole, streamed = count(False), count(True)
    counter.close()
    assert whole == streamed and whole is not None and whole > answer_alone


def _finished(
    counter: Any, endpoint: str, body: dict[str, Any], chunks: list[dict[str, Any]] | None,
    whole: dict[str, Any] | None = None,
) -> Measurement:  # fmt: skip
    """A response's record as the proxy makes it with a tokenizer: a stream of `chunks`
    (one read each, 1/8 s apart) or a `whole` body."""
    api = api_for(endpoint)
    assert api is not None
    observer = StreamObserver(api.read_request(body), start=0.0, collect_text=True)
    if chunks is not None:
        observer.open(200, "text/event-stream", 0.0)
        for i, chunk in enumerate(chunks, 1):
            observer.feed(b"data: " + orjson.dumps(chunk) + b"\n\n", i / 8)
        observer.feed(b"data: [DONE]\n\n", 8.0)
    else:
        observer.open(200, "application/json", 0.0)
        observer.feed(orjson.dumps(whole), 0.125)
    observer.end_of_stream(8.0)
    return asyncio.run(
        observer.finish(end=8.0, started_at=0.0, status_code=200, error_type=None,
                        error_message=None, counter=counter)
    )  # fmt: skip


#: Two choices' texts, streamed interleaved as vLLM streams n > 1 (one choice a chunk);
#: joined, the first's end and the second's start would make one word.
CHOICES = (["Meas", "uring", " lat"], ["ency", " tok", "ens"])


def _interleaved(
    key: str, first: tuple[str, str] = ("", ""), field: str = "content"
) -> list[dict[str, Any]]:
    chunks = []
    for step, pieces in enumerate(zip(*CHOICES, strict=True)):
        for index, piece in enumerate(pieces):
            text = (first[index] if step == 0 else "") + piece
            body = {"delta": {field: text}} if key == "delta" else {"text": text}
            chunks.append({"choices": [{"index": index, **body, "finish_reason": None}]})
    for index in (0, 1):
        end: dict[str, Any] = {"delta": {}} if key == "delta" else {"text": ""}
        chunks.append({"choices": [{"index": index, **end, "finish_reason": "length"}]})
    return chunks


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "body"])
def test_each_choice_is_counted_alone_and_added_up(tmp_path: Path, streamed: bool) -> None:
    """vLLM's completion_tokens adds each choice's own token ids (n > 1): the choices'
    texts once were joined into one string, interleaved, and counted as one (15 vs 6)."""
    counter = loaded_counter(tmp_path)
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path / "again")))
    body = {"model": MODEL, "stream": streamed, "n": 2, "messages": [{"role": "user",
            "content": "hi"}]}  # fmt: skip
    whole = {"choices": [{"index": i, "finish_reason": "length",
                          "message": {"role": "assistant", "content": "".join(texts)}}
                         for i, texts in enumerate(CHOICES)]}  # fmt: skip
    m = _finished(counter, "/v1/chat/completions", body,
                  _interleaved("delta") if streamed else None, whole)  # fmt: skip
    counter.close()
    vllm = sum(count_output(tokenizer, list(texts)) for texts in CHOICES)
    assert m.token_source is TokenSource.TOKENIZER and m.output_tokens == vllm


@pytest.mark.parametrize("echo", [False, True])
def test_a_batch_counts_each_choice_less_its_own_echoed_prompt(tmp_path: Path, echo: bool) -> None:
    """Completions with a batch of prompts stream their choices interleaved; with `echo`
    each choice's first text begins with its own prompt, left out of its own count."""
    counter = loaded_counter(tmp_path)
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path / "again")))
    prompts = ["Measuring latency", "Streaming chunks"]
    body = {"model": MODEL, "stream": True, "prompt": prompts, "max_tokens": 4, "echo": echo}
    chunks = _interleaved("text", (prompts[0], prompts[1]) if echo else ("", ""))
    m = _finished(counter, "/v1/completions", body, chunks)
    counter.close()
    vllm = sum(count_output(tokenizer, list(texts)) for texts in CHOICES)
    assert m.token_source is TokenSource.TOKENIZER and m.output_tokens == vllm


def test_a_tokenizer_that_raises_loses_the_counts_not_the_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The counts fall back as without a tokenizer, the timings stay, and the failure is
    told as stage "tokenizer" (tokenprobe_measurement_failures_total): observer.finish
    once raised, and the request got a bare record without TTFT or TPOT."""
    counter = loaded_counter(tmp_path)

    def broken(*args: object, **kwargs: object) -> list[int]:
        raise ValueError("tokenizer failed on: my password is hunter2")  # a quoted text

    counter._loading.result().encode = broken
    failed: list[str] = []
    reasoned = {"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]}
    chunks = [reasoned] + [{"choices": [{"index": 0, "delta": {"content": w}}]}
                           for w in ("Hello", " big", " world")]  # fmt: skip
    # vLLM's EOS: the finish, with `stop_reason` (an OpenAI-shaped `{}` finish is no token)
    eos = {"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": None}
    chunks.append({"choices": [eos]})
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    m = _finished(counter.reporting(failed.append), "/v1/chat/completions", body, chunks)
    counter.close()
    # the chunks: 4 with content and the EOS's empty finish chunk
    assert (m.token_source, m.output_tokens, m.prompt_tokens) == (TokenSource.CHUNKS, 5, None)
    assert (m.ttft, m.tpot) == (0.125, 0.125)
    assert (m.reasoning_tokens, m.reasoning_token_source) == (1, "events")
    assert failed == ["tokenizer", "tokenizer"]  # the counts, then the reasoning's
    assert "ValueError" in caplog.text and "hunter2" not in caplog.text  # never the text


# -- reasoning, by choice ---------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "body"])
def test_each_choices_reasoning_is_counted_alone_and_added_up(
    tmp_path: Path, streamed: bool
) -> None:
    """vLLM counts each choice's reasoning tokens in its own token ids and adds them up
    (chat_completion/serving.py): the choices' reasoning texts were once joined into one
    string, interleaved, and counted as one, as their output once was."""
    counter = loaded_counter(tmp_path)
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path / "again")))
    body = {"model": MODEL, "stream": streamed, "n": 2, "messages": [{"role": "user",
            "content": "hi"}]}  # fmt: skip
    chunks = _interleaved("delta", field="reasoning")
    chunks[-2:-2] = [{"choices": [{"index": i, "delta": {"content": "ok"}}]} for i in (0, 1)]
    whole = {"choices": [{"index": i, "finish_reason": "length", "message": {
        "role": "assistant", "reasoning": "".join(texts), "content": "ok"}}
        for i, texts in enumerate(CHOICES)]}  # fmt: skip
    m = _finished(counter, "/v1/chat/completions", body, chunks if streamed else None, whole)
    counter.close()
    vllm = sum(count_output(tokenizer, list(texts)) for texts in CHOICES)
    assert (m.reasoning_tokens, m.reasoning_token_source) == (vllm, "tokenizer")


def test_one_choices_texts_are_kept_once_for_both_readers() -> None:
    """The bench's recount reads every text in order (`texts`), the tokenizer each
    choice's (`choice_outputs`): one store serves both, where the texts were once kept
    twice, a flat list and the same texts again by choice."""
    api = api_for("/v1/chat/completions")
    assert api is not None
    request = api.read_request({"model": MODEL, "stream": True, "messages": []})
    observer = StreamObserver(request, start=0.0, collect_text=True)
    observer.open(200, "text/event-stream", 0.0)
    for text in CHOICES[0]:
        chunk = {"choices": [{"index": 0, "delta": {"content": text}}]}
        observer.feed(b"data: " + orjson.dumps(chunk) + b"\n\n", 0.1)
    [(kept, echoed)] = observer.choice_outputs()
    assert kept == observer.texts == list(CHOICES[0]) and echoed is None
    assert kept is observer.texts  # the same list, not a copy


def test_several_choices_reasoning_is_kept_in_order_and_by_choice() -> None:
    """The bench reads `reasoning_texts` in the order they came; the tokenizer counts
    `choice_reasoning()`, each choice's alone."""
    api = api_for("/v1/chat/completions")
    assert api is not None
    request = api.read_request({"model": MODEL, "stream": True, "n": 2, "messages": []})
    observer = StreamObserver(request, start=0.0, collect_text=True)
    observer.open(200, "text/event-stream", 0.0)
    for chunk in _interleaved("delta", field="reasoning"):
        observer.feed(b"data: " + orjson.dumps(chunk) + b"\n\n", 0.1)
    assert observer.reasoning_texts == ["Meas", "ency", "uring", " tok", " lat", "ens"]
    assert observer.choice_reasoning() == [list(CHOICES[0]), list(CHOICES[1])]


# -- the Responses API's prompt, as vLLM 0.32 renders and encodes it ----------------------------

#: A template that shows what it is given: BOS, reasoning, tool calls, tools, options.
SHOWING = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}{% for c in m.tool_calls or [] %}"
    "<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>{% endfor %}\n"
    "{% endfor %}{% if tools %}TOOLS:{{ tools | tojson }}{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ASK = "Measuring latency means time to first token."


def _showing(directory: Path) -> tuple[Any, TokenCounter]:
    """Mistral's SentencePiece tokenizer (its encode() adds <s>, as its own config says)
    with SHOWING as its chat template, and a loaded counter of it."""
    made = mistral_tokenizer_dir(directory)
    config = json.loads((made / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, chat_template=SHOWING)
    (made / "tokenizer_config.json").write_text(json.dumps(config))
    counter = TokenCounter(str(made))
    deadline = time.monotonic() + 30
    while not counter.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    return load_tokenizer(str(made)), counter


def _vllm(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    """vLLM's count of a Responses prompt, its steps written out: the template rendered to
    a text (renderers/hf.py), then encoded with special tokens added (ResponsesRequest's
    build_tok_params leaves TokenizeParams.add_special_tokens at true)."""
    kwargs.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return len(tokenizer.encode(text, add_special_tokens=True))


def _responses_prompt(counter: Any, body: dict[str, Any]) -> int | None:
    """The prompt count of a Responses request's record, its answer a whole body."""
    whole = {"id": "resp_1", "object": "response", "status": "completed", "output": [
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Sure."}]}]}  # fmt: skip
    m = _finished(counter, "/v1/responses", {"model": MODEL, **body}, None, whole)
    assert m.token_source is TokenSource.TOKENIZER
    return m.prompt_tokens


def test_a_responses_prompt_is_encoded_with_the_tokenizers_special_tokens(
    tmp_path: Path,
) -> None:
    """Chat's add_special_tokens defaults to false; a Responses request has no such field
    and vLLM encodes its rendered prompt with TokenizeParams' default, true: the
    tokenizer's BOS comes on top of the template's (counted one short before)."""
    tokenizer, counter = _showing(tmp_path)
    got = _responses_prompt(counter, {"instructions": "Be brief.", "input": ASK})
    counter.close()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]
    assert got == _vllm(tokenizer, messages)


def test_responses_input_items_become_the_messages_vllm_renders(tmp_path: Path) -> None:
    """vLLM's construct_chat_messages_with_tool_call: calls join the assistant message
    before them (a namespace's named ns__name), a reasoning item is that message's
    reasoning, an assistant message is its first part's text. They were once a message
    each, and the reasoning left out."""
    tokenizer, counter = _showing(tmp_path)
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "reasoning", "id": "r1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []},
                     {"type": "output_text", "text": " Twice.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "namespace": "ns",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ]  # fmt: skip
    got = _responses_prompt(counter, {"input": items})
    counter.close()
    calls = [{"id": "c1", "function": {"name": "f", "arguments": {"a": 1}}, "type": "function"},
             {"id": "c2", "function": {"name": "ns__g", "arguments": {}}, "type": "function"}]  # fmt: skip
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "Checking.", "reasoning": "Look it up.",
         "reasoning_content": "Look it up.", "tool_calls": calls},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]  # fmt: skip
    assert got == _vllm(tokenizer, messages)


def test_a_responses_input_that_ends_in_an_incomplete_message_is_continued(
    tmp_path: Path,
) -> None:
    """should_continue_final_message: a last `message` (or reasoning) item in_progress or
    incomplete is continued, with no generation prompt after it (the proxy once added
    one)."""
    tokenizer, counter = _showing(tmp_path)
    partial = {"type": "message", "role": "assistant", "id": "m1", "status": "incomplete",
               "content": [{"type": "output_text", "text": "Time to", "annotations": []}]}  # fmt: skip
    got = _responses_prompt(counter, {"input": [{"role": "user", "content": ASK}, partial]})
    counter.close()
    messages = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "Time to"}]
    assert got == _vllm(
        tokenizer, messages, add_generation_prompt=False, continue_final_message=True
    )


def test_a_responses_request_that_continues_a_stored_response_has_no_prompt_count(
    tmp_path: Path,
) -> None:
    """vLLM puts the stored conversation of `previous_response_id` before the input: the
    proxy, which never saw it, once counted the input alone as the prompt."""
    _, counter = _showing(tmp_path)
    got = _responses_prompt(counter, {"input": ASK, "previous_response_id": "resp_0"})
    counter.close()
    assert got is None


def test_responses_tools_reach_the_template_as_vllm_dumps_them() -> None:
    """construct_tool_dicts (the dump taken from vLLM 0.32 itself): `strict` kept where
    set, a namespace's functions flattened to ns__name, a custom tool a function of one
    string `input`, other tool types left out. Only plain function tools were shown."""
    api = api_for("/v1/responses")
    assert api is not None
    tools = [
        {"type": "function", "name": "f", "parameters": {"type": "object"}},
        {"type": "function", "name": "g", "description": "d", "strict": True,
         "parameters": None},
        {"type": "namespace", "name": "ns", "description": "x",
         "tools": [{"type": "function", "name": "k", "parameters": {}}]},
        {"type": "custom", "name": "c", "description": "cc"},
        {"type": "web_search"},
    ]  # fmt: skip
    custom = {"type": "object", "properties": {"input": {"type": "string",
              "description": "The freeform text payload for this tool."}},
              "required": ["input"], "additionalProperties": False}  # fmt: skip
    info = api.read_request({"model": MODEL, "input": ASK, "tools": tools})
    assert info.template == {"tools": [
        {"type": "function", "function": {"name": "f", "description": None,
                                          "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g", "description": "d",
                                          "parameters": None, "strict": True}},
        {"type": "function", "function": {"name": "ns__k", "description": None,
                                          "parameters": {}}},
        {"type": "function", "function": {"name": "c", "description": "cc",
                                          "parameters": custom}},
    ]}  # fmt: skip


def test_a_responses_requests_reasoning_effort_and_template_kwargs_reach_the_template(
    tmp_path: Path,
) -> None:
    """ResponsesRequest.build_chat_params: `reasoning.effort` is the template's
    reasoning_effort and sets enable_thinking (effort != "none") unless the request's
    chat_template_kwargs does; those kwargs go to the template too. They reach a count
    through Responses.template (chat_prompt.responses_template)."""
    tokenizer, counter = _showing(tmp_path)
    counter.close()
    api = api_for("/v1/responses")
    assert api is not None
    body = {"model": MODEL, "input": ASK, "reasoning": {"effort": "none"},
            "chat_template_kwargs": {"bos_token": "<s><s>"}}  # fmt: skip
    info = api.read_request(body)
    assert info.template == responses_template(body)
    messages = [{"role": "user", "content": ASK}]
    assert count_request(tokenizer, info) == _vllm(
        tokenizer, messages, reasoning_effort="none", enable_thinking=False, bos_token="<s><s>"
    )
