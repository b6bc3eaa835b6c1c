"""Ollama's load and unload answers: a request, with no token counts.

`ollama run` loads a model by sending /api/generate (or /api/chat) with an empty prompt;
`ollama stop` unloads it with keep_alive 0 (ollama/ollama @ fb30760 cmd/cmd.go
loadOrUnloadModel). GenerateHandler and ChatHandler answer those at once with c.JSON, done
with done_reason "load" or "unload" and no Metrics (server/routes.go); EmbedHandler answers
an empty input with `{"model", "embeddings": []}` once the model is loaded. Nothing was
evaluated, so there is no count: recorded as prompt 0 and output 0 from usage, each
`ollama run` put a 0 into the token histograms.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.core.apis import api_for
from proxy.core.measurement import Measurement, TokenSource
from proxy.core.observe import StreamObserver
from proxy.core.tokens import TokenCounter
from tests.tokenizers_local import build_tiny_tokenizer, with_chat_template

STAMP = '"created_at":"2026-08-22T10:00:00.123456789Z"'
# The bytes as gin's c.JSON writes them (no trailing newline), field order of api/types.go.
GENERATE_LOAD = (
    b'{"model":"qwen3",' + STAMP.encode() + b',"response":"","done":true,"done_reason":"load"}'
)
GENERATE_UNLOAD = GENERATE_LOAD.replace(b'"load"', b'"unload"')
CHAT_LOAD = (
    b'{"model":"qwen3",' + STAMP.encode() + b',"message":{"role":"assistant","content":""},'
    b'"done":true,"done_reason":"load"}'
)
CHAT_UNLOAD = CHAT_LOAD.replace(b'"load"', b'"unload"')
EMBED_LOAD = b'{"model":"nomic-embed-text","embeddings":[]}'

#: (endpoint, request body, answer): what `ollama run` / `ollama stop` send and get.
ANSWERS = {
    "generate_load": ("/api/generate", {"model": "qwen3"}, GENERATE_LOAD),
    "generate_unload": ("/api/generate", {"model": "qwen3", "keep_alive": 0}, GENERATE_UNLOAD),
    "chat_load": ("/api/chat", {"model": "qwen3", "messages": []}, CHAT_LOAD),
    "chat_unload": ("/api/chat", {"model": "qwen3", "messages": [], "keep_alive": 0}, CHAT_UNLOAD),
    "embed_load": ("/api/embed", {"model": "nomic-embed-text"}, EMBED_LOAD),
}


def answered(
    endpoint: str, body: dict[str, Any], answer: bytes, counter: TokenCounter | None = None
) -> Measurement:
    """The record of `answer`, a whole application/json body read 0.1 s after the start."""
    api = api_for(endpoint)
    assert api is not None
    observer = StreamObserver(api.read_request(body), 0.0, collect_text=counter is not None)
    observer.open(200, "application/json; charset=utf-8", 0.1)
    observer.feed(answer, 0.1)
    observer.end_of_stream(0.1)
    return asyncio.run(
        observer.finish(
            end=0.1,
            started_at=0.0,
            status_code=200,
            error_type=None,
            error_message=None,
            counter=counter,
        )
    )


@pytest.mark.parametrize(("endpoint", "body", "answer"), ANSWERS.values(), ids=ANSWERS.keys())
def test_a_load_or_unload_answer_is_a_request_with_no_token_counts(
    endpoint: str, body: dict[str, Any], answer: bytes
) -> None:
    m = answered(endpoint, body, answer)
    assert (m.ok, m.status_code, m.e2e) == (True, 200, 0.1)  # a request, timed
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (None, None, TokenSource.NONE)
    assert (m.ttft, m.tpot, m.engine, m.content_events) == (None, None, None, 0)
    if endpoint != "/api/embed":
        reason = orjson.loads(answer)["done_reason"]
        assert (m.finish_reason, m.raw_finish_reason) == ("other", reason)


@pytest.mark.parametrize(
    ("endpoint", "body", "answer"),
    [ANSWERS["generate_load"], ANSWERS["chat_load"], ANSWERS["embed_load"]],
    ids=["generate_load", "chat_load", "embed_load"],
)
def test_a_tokenizer_counts_nothing_of_a_load_answer(
    endpoint: str, body: dict[str, Any], answer: bytes, tmp_path: Path
) -> None:
    """With --tokenizer the answer's missing count is no gap to fill: nothing was evaluated
    (a count of the empty prompt and no output would be a 0 in the histograms again)."""
    counter = TokenCounter(str(with_chat_template(build_tiny_tokenizer(tmp_path))))
    deadline = time.monotonic() + 30
    while not counter.ready and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counter.ready
    try:
        m = answered(endpoint, body, answer, counter)
    finally:
        counter.close()
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (None, None, TokenSource.NONE)
