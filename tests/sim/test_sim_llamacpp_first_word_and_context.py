"""Two ends of a llama-server answer the simulator's llama.cpp mode plays as the real server.

1. A stop word completed by the first token, on chat. llama-server sends the role chunk
   with the first token's partial (server-task.cpp to_json_oaicompat_chat: the role
   delta when `n_decoded == 1`, then the text diffs, `timings` on the last chunk), and
   a partial that ended the slot carries `timings` (server-context.cpp
   send_partial_response). With no text before the word, the role chunk is that last
   chunk: it carries the `timings`.
2. A full context. Without context shift (llama.cpp's default, common.h `ctx_shift =
   false`), process_token stops the slot at the token that fills its context
   (`slot.prompt.n_tokens() + 1 >= slot.n_ctx`): `truncated` true and STOP_TYPE_LIMIT
   ("length" on the OpenAI routes), set after the stop-word check, so a word completed
   by that token ends as "limit" (its `stopping_word` kept), and before the EOG check,
   so an EOS there stays "eos" (and `truncated` true).

The REAL_* values are the real binary's (.ci/llama's build b1-0c1e570, /opt/llama-server,
the tiny GGUF, `--parallel 1 --threads 1 --no-webui`), forced with grammars as
tests/llamacpp/capture.py forces them; `--ctx-size 512` for (1) and 256 (llama.cpp's
least) for (2). The simulator's text is its own (" The quick brown fox ..."), so its words
and context are chosen to meet it the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from proxy.sim.tokens import count_prompt_tokens
from tests.conftest import Running
from tests.sim.test_sim_llamacpp import events, skeleton

FAST = {"x-sim-ttft": "0.01", "x-sim-tps": "1000"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}

#: `/v1/chat/completions` {CHAT, "max_tokens": 5, "temperature": 0, "stream": true,
#: "cache_prompt": false, "grammar": 'root ::= " upon upon upon"', "stop": [" up"]}:
#: the first token " upon" completes " up" with nothing before it.
REAL_FIRST_TOKEN_WORD = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":'
    b'null}}],"created":1796607533,"id":"chatcmpl-uMWy7Q74Gr9Jf8fMnULyZM9kvsx8APmc","model":"ti'
    b'ny","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk","timings":{"cache_'
    b'n":0,"prompt_n":11,"prompt_ms":5.237,"prompt_per_token_ms":0.4760909090909091,"prompt_per'
    b'_second":2100.4391827382087,"predicted_n":1,"predicted_ms":0.001,"predicted_per_token_ms"'
    b':0.0,"predicted_per_second":0.0}}\n\n'
    b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1796607533,"id'
    b'":"chatcmpl-uMWy7Q74Gr9Jf8fMnULyZM9kvsx8APmc","model":"tiny","system_fingerprint":"b1-0c1'
    b'e570","object":"chat.completion.chunk","timings":{"cache_n":0,"prompt_n":11,"prompt_ms":5'
    b'.237,"prompt_per_token_ms":0.4760909090909091,"prompt_per_second":2100.4391827382087,"pre'
    b'dicted_n":1,"predicted_ms":0.001,"predicted_per_token_ms":0.0,"predicted_per_second":0.0}'
    b"}\n\ndata: [DONE]\n\n"
)
#: The same with `"stop": ["pon"]`: the first token sends " u" before the word, so the
#: role chunk has no `timings` and the text chunk has them.
REAL_FIRST_TOKEN_WORD_AFTER_TEXT = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":'
    b'null}}],"created":1796607535,"id":"chatcmpl-Aq3WwbCso2W9yrRutWJeK0PdK7dVm4b4","model":"ti'
    b'ny","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" u"}}],"created":17'
    b'96607535,"id":"chatcmpl-Aq3WwbCso2W9yrRutWJeK0PdK7dVm4b4","model":"tiny","system_fingerpr'
    b'int":"b1-0c1e570","object":"chat.completion.chunk","timings":{"cache_n":0,"prompt_n":11,"'
    b'prompt_ms":4.764,"prompt_per_token_ms":0.43309090909090914,"prompt_per_second":2308.98404'
    b'7019311,"predicted_n":1,"predicted_ms":0.001,"predicted_per_token_ms":0.0,"predicted_per_'
    b'second":0.0}}\n\n'
    b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1796607535,"id'
    b'":"chatcmpl-Aq3WwbCso2W9yrRutWJeK0PdK7dVm4b4","model":"tiny","system_fingerprint":"b1-0c1'
    b'e570","object":"chat.completion.chunk","timings":{"cache_n":0,"prompt_n":11,"prompt_ms":4'
    b'.764,"prompt_per_token_ms":0.43309090909090914,"prompt_per_second":2308.984047019311,"pre'
    b'dicted_n":1,"predicted_ms":0.001,"predicted_per_token_ms":0.0,"predicted_per_second":0.0}'
    b"}\n\ndata: [DONE]\n\n"
)

#: Native `/completion` of "once upon" (3 tokens evaluated) with `--ctx-size 256`, room 253:
#: (what ends it, as tokens before the room's end) -> the real last object's
#: (tokens_predicted short of the room, truncated, stop_type, stopping_word, tokens_cached
#: short of n_ctx). The requests: no limit; `n_predict` 252; grammars `" upon"{252}` and
#: `{251}` (then only the EOS); `" upon"{252} " once"` and `{251} " once"` with
#: `"stop": ["once"]`.
REAL_CONTEXT_FULL: dict[str, tuple[int, bool, str, str, int]] = {
    "text fills it": (0, True, "limit", "", 1),
    "n_predict one short": (1, False, "limit", "", 2),
    "EOS fills it": (0, True, "eos", "", 1),
    "EOS one short": (1, False, "eos", "", 2),
    "word fills it": (0, True, "limit", "once", 1),
    "word one short": (1, False, "word", "once", 2),
}
#: The simulator's context leaves the same prompt a room of 4 tokens (" The quick brown
#: fox"): the request that ends each case as the real one ended, and its word's name in
#: the real table.
ROOM = 4
NATIVE = {"prompt": "once upon"}
SIM_CASES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "text fills it": ({}, {}),
    "n_predict one short": ({"n_predict": ROOM - 1}, {}),
    "EOS fills it": ({}, {"x-sim-output-tokens": str(ROOM - 1)}),
    "EOS one short": ({}, {"x-sim-output-tokens": str(ROOM - 2)}),
    "word fills it": ({"stop": [" fox"]}, {}),
    "word one short": ({"stop": [" brown"]}, {}),
}
WORDS = {" fox": "once", " brown": "once", "": ""}


@pytest.fixture
def sim(start_sim: Callable[..., Running]) -> Running:
    return start_sim(models=("tiny",), backend_kind="llamacpp")


@pytest.fixture
def small(start_sim: Callable[..., Running]) -> Running:
    """A context that leaves "once upon" (and CHAT) ROOM tokens."""
    assert count_prompt_tokens(NATIVE) == count_prompt_tokens(CHAT) == 3
    return start_sim(models=("tiny",), backend_kind="llamacpp", max_model_len=3 + ROOM)


def chat_stream(sim: Running, stop: list[str]) -> list[Any]:
    body = {**CHAT, "max_tokens": 5, "stream": True, "stop": stop}
    return events(httpx.post(sim.url + "/v1/chat/completions", json=body, headers=FAST).content)


def test_a_word_the_first_token_completes_puts_timings_on_the_role_chunk(sim: Running) -> None:
    """The first token " The" completes " Th" with nothing before it, as " upon" completes
    " up": the role chunk is the partial's only chunk, and carries its `timings`."""
    got, real = chat_stream(sim, [" Th"]), events(REAL_FIRST_TOKEN_WORD)
    assert [skeleton(e) for e in got] == [skeleton(e) for e in real]
    role = got[0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert role["timings"]["predicted_n"] == real[0]["timings"]["predicted_n"] == 1
    assert got[1]["choices"][0]["finish_reason"] == "stop"


def test_text_before_the_first_tokens_word_keeps_timings_on_the_text(sim: Running) -> None:
    """Text before the word (" T" before "he", " u" before "pon"): the role chunk as
    always, the text chunk with the `timings`."""
    got, real = chat_stream(sim, ["he"]), events(REAL_FIRST_TOKEN_WORD_AFTER_TEXT)
    assert [skeleton(e) for e in got] == [skeleton(e) for e in real]
    assert got[1]["choices"][0]["delta"] == {"content": " T"}


@pytest.mark.parametrize("case", list(SIM_CASES))
@pytest.mark.parametrize("stream", [False, True])
def test_a_full_context_ends_the_native_answer_as_the_real_server(
    small: Running, case: str, stream: bool
) -> None:
    extra, headers = SIM_CASES[case]
    body = {**NATIVE, **extra, "stream": stream}
    reply = httpx.post(small.url + "/completion", json=body, headers={**FAST, **headers})
    last = events(reply.content)[-1] if stream else reply.json()
    n_ctx = 3 + ROOM
    got = (
        n_ctx - last["tokens_evaluated"] - last["tokens_predicted"],
        last["truncated"],
        last["stop_type"],
        WORDS[last["stopping_word"]],
        n_ctx - last["tokens_cached"],
    )
    assert got == REAL_CONTEXT_FULL[case]


@pytest.mark.parametrize("stream", [False, True])
def test_a_word_that_fills_the_context_is_a_length_finish_on_chat(
    small: Running, stream: bool
) -> None:
    """The real chat (`" upon"{244} " once"` filling a 256 context after an 11-token
    prompt, `"stop": ["once"]`) ended with finish_reason "length", completion_tokens 245."""
    body = {**CHAT, "stream": stream, "stop": [" fox"]}
    reply = httpx.post(small.url + "/v1/chat/completions", json=body, headers=FAST)
    if stream:
        finish = events(reply.content)[-2]
        assert finish["timings"]["predicted_n"] == ROOM
    else:
        finish = reply.json()
        assert finish["usage"]["completion_tokens"] == ROOM
        assert finish["choices"][0]["message"]["content"] == " The quick brown"
    assert finish["choices"][0]["finish_reason"] == "length"


def test_an_eos_that_fills_the_context_is_still_a_stop_on_chat(small: Running) -> None:
    """The EOG check comes after the context check: `" upon"{244}` then the EOS, the real
    chat: finish_reason "stop", completion_tokens 245 (the EOS counted)."""
    headers = {**FAST, "x-sim-output-tokens": str(ROOM - 1)}
    reply = httpx.post(small.url + "/v1/chat/completions", json=CHAT, headers=headers)
    got = orjson.loads(reply.content)
    assert (got["choices"][0]["finish_reason"], got["usage"]["completion_tokens"]) == ("stop", ROOM)
