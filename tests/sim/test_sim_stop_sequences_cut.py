"""`stop_sequences` cut the text on the Anthropic Messages and Cohere routes, as chat's `stop`.

vLLM 0.32 runs both as a chat completion with `stop=stop_sequences`
(anthropic/serving.py _build_base_request, cohere/serving.py _build_base_chat_completion),
so the text, the held-back streaming and the token count are chat's (proxy/sim/stops.py).
The stop is reported from the chat choice's `stop_reason` (the matched string):
Messages `stop_reason: "stop_sequence"` with `stop_sequence` that string
(_to_anthropic_stop_reason, in the body and in the stream's message_delta); Cohere
`finish_reason: "STOP_SEQUENCE"` (_map_finish_reason). Both stream converters drop chat
chunks with empty text, so held-back steps send nothing.

The REAL_* bytes are vLLM 0.32.0 (the CPU build, `/opt/vllm-venv`, the tiny random-weight
Llama of .ci/vllm, served as `tiny`, `--max-model-len 256 --enforce-eager`), answering
`/v1/messages` with `{"model": "tiny", "max_tokens": 8 (or 4), "messages": [{"role":
"user", "content": "hi"}], "temperature": 0, "stop_sequences": [...]}`; greedily that
model says "\\n" every token. Its Cohere route is not served there (no `cohere` SDK in
that venv), so Cohere is checked against vLLM's source only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.sim import SimConfig, completion_text
from tests.sim.test_sim_llamacpp import skeleton
from tests.sim.test_sim_support import read_named_events, running

MESSAGES, COHERE, CHAT = "/v1/messages", "/cohere/v2/chat", "/v1/chat/completions"
TOKENS = 10  # the planned answer: " The quick brown fox jumps 你好世界 🚀 over the"

#: `stop_sequences: ["\n\n\n"]`, streamed: the stop completes at the third token with no
#: text before it, so no content block at all, and output_tokens counts the three.
REAL_CUT_TO_NOTHING_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-97b13269255'
    b'b1e0c","type":"message","role":"assistant","content":[],"model":"tiny","stop_reason":null'
    b',"stop_sequence":null,"usage":{"input_tokens":18,"output_tokens":0}}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"stop_sequence'
    b'","stop_sequence":"\\n\\n\\n"},"usage":{"input_tokens":18,"output_tokens":3}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)
#: The same, not streamed: one empty text block, then stop_reason and stop_sequence.
REAL_CUT_TO_NOTHING_BODY = (
    b'{"id":"chatcmpl-90081c7b71f2c211","type":"message","role":"assistant","content":[{"type":'
    b'"text","text":""}],"model":"tiny","stop_reason":"stop_sequence","stop_sequence":"\\n\\n\\n",'
    b'"usage":{"input_tokens":18,"output_tokens":3}}'
)
#: `stop_sequences: ["\nX"]`, max_tokens 4, streamed: never matched, but each step's last
#: character is held back, so the first step sends nothing and the limit's token sends
#: the rest ("\n\n").
REAL_HELD_TO_THE_LIMIT_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-8111fcd9750'
    b'8f680","type":"message","role":"assistant","content":[],"model":"tiny","stop_reason":null'
    b',"stop_sequence":null,"usage":{"input_tokens":18,"output_tokens":0}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","content_block":{"type":'
    b'"text","text":""},"index":0}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_del'
    b'ta","text":"\\n"},"index":0}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_del'
    b'ta","text":"\\n"},"index":0}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_del'
    b'ta","text":"\\n\\n"},"index":0}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens","'
    b'stop_sequence":null},"usage":{"input_tokens":18,"output_tokens":4}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = SimConfig(ttft=0.0, tokens_per_second=2000.0, output_tokens=TOKENS)
    with running(config) as (server, _):
        yield server.url


def body(stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        **extra,
    }


def named(raw: bytes) -> list[tuple[str, Any]]:
    """A Messages stream's events as (name, data)."""
    out = []
    for block in raw.split(b"\n\n"):
        if block:
            head, _, data = block.partition(b"\n")
            out.append((head.removeprefix(b"event: ").decode(), orjson.loads(data[6:])))
    return out


def cohere_events(raw: bytes) -> list[Any]:
    return [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]


def chat_cut(url: str, stop: list[str]) -> tuple[str, int, str | None]:
    """What the chat route answers for the same text and `stop`: text, tokens, stop_reason."""
    got = httpx.post(url + CHAT, json=body(False, stop=stop)).json()
    choice = got["choices"][0]
    return choice["message"]["content"], got["usage"]["completion_tokens"], choice["stop_reason"]


def test_messages_body_is_cut_where_chat_cuts_it_and_says_which_sequence(url: str) -> None:
    text, tokens, matched = chat_cut(url, [" fox"])
    assert (text, tokens, matched) == (" The quick brown", 4, " fox")
    got = httpx.post(url + MESSAGES, json=body(False, stop_sequences=[" fox"])).json()
    assert got["content"] == [{"type": "text", "text": text}]
    assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", " fox")
    assert got["usage"]["output_tokens"] == tokens  # no EOS after a stop string
    assert list(got) == ["id", "type", "role", "content", "model", "stop_reason",
                         "stop_sequence", "usage"]  # fmt: skip


def test_messages_stream_is_cut_where_chat_cuts_it_and_says_which_sequence(url: str) -> None:
    text, tokens, _ = chat_cut(url, [" fox"])
    with httpx.Client(timeout=10) as client:
        got = read_named_events(client, url, MESSAGES, body(True, stop_sequences=[" fox"]))
    deltas = [e.json["delta"]["text"] for e in got.events if e.name == "content_block_delta"]
    assert "".join(deltas) == text
    assert all(deltas)  # held-back steps send no empty delta
    end = got.first("message_delta").json
    assert end["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " fox"}
    assert end["usage"]["output_tokens"] == tokens
    assert got.names()[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [True, False])
def test_cohere_is_cut_where_chat_cuts_it_with_stop_sequence(url: str, stream: bool) -> None:
    text, tokens, _ = chat_cut(url, ["brown"])
    reply = httpx.post(url + COHERE, json=body(stream, stop_sequences=["brown"]))
    if stream:
        events = cohere_events(reply.content)
        got = "".join(
            e["delta"]["message"]["content"]["text"] for e in events if e["type"] == "content-delta"
        )
        end = events[-1]["delta"]
        assert [e["type"] for e in events][-2:] == ["content-end", "message-end"]
    else:
        end = reply.json()
        got = end["message"]["content"][0]["text"]
    assert (text, tokens) == (" The quick ", 3)
    assert (got, end["finish_reason"]) == (text, "STOP_SEQUENCE")
    assert end["usage"]["tokens"]["output_tokens"] == tokens


def test_a_stream_cut_to_nothing_opens_no_block_as_the_real_server(url: str) -> None:
    """The stop completes at the third token with no text before it (" The quick brown"
    for the simulator's text, "\\n\\n\\n" for the real model's)."""
    reply = httpx.post(url + MESSAGES, json=body(True, stop_sequences=[" The quick brown"]))
    got, real = named(reply.content), named(REAL_CUT_TO_NOTHING_STREAM)
    assert [name for name, _ in got] == [name for name, _ in real]
    assert [skeleton(data) for _, data in got] == [skeleton(data) for _, data in real]
    (_, end), (_, real_end) = got[1], real[1]
    assert end["delta"] == {**real_end["delta"], "stop_sequence": " The quick brown"}
    assert end["usage"]["output_tokens"] == real_end["usage"]["output_tokens"] == 3


def test_a_body_cut_to_nothing_is_one_empty_text_block_as_the_real_server(url: str) -> None:
    reply = httpx.post(url + MESSAGES, json=body(False, stop_sequences=[" The quick brown"]))
    got, real = reply.json(), orjson.loads(REAL_CUT_TO_NOTHING_BODY)
    assert skeleton(got) == skeleton(real)
    assert got["content"] == real["content"] == [{"type": "text", "text": ""}]
    assert (got["stop_reason"], got["usage"]["output_tokens"]) == ("stop_sequence", 3)


def test_cohere_cut_to_nothing_has_no_content(url: str) -> None:
    """Not streamed, `content=content_blocks or None` under exclude_none leaves the message
    without `content`; streamed, no text means no content-start (`if delta.content:`)."""
    stop = {"stop_sequences": [" The quick brown"]}
    whole = httpx.post(url + COHERE, json=body(False, **stop)).json()
    assert whole["message"] == {"role": "assistant"}
    assert whole["finish_reason"] == "STOP_SEQUENCE"
    events = cohere_events(httpx.post(url + COHERE, json=body(True, **stop)).content)
    assert [e["type"] for e in events] == ["message-start", "message-end"]
    assert events[-1]["delta"]["finish_reason"] == "STOP_SEQUENCE"


def test_held_text_goes_out_with_the_limits_token_as_the_real_server(url: str) -> None:
    """A stop never matched holds back its length less one character at every step; the
    token that reaches max_tokens sends the rest in its own delta, not one more. The
    simulator's first token (" The", 4 characters) is all held by a 5-character stop as
    the real model's "\\n" is by "\\nX"."""
    reply = httpx.post(url + MESSAGES, json=body(True, max_tokens=4, stop_sequences=["zzzzz"]))
    got, real = named(reply.content), named(REAL_HELD_TO_THE_LIMIT_STREAM)
    assert [name for name, _ in got] == [name for name, _ in real]
    texts = [data["delta"]["text"] for name, data in got if name == "content_block_delta"]
    assert texts == [" The q", "uick b", "rown fox"]
    assert "".join(texts) == completion_text(4)
    end = {"stop_reason": "max_tokens", "stop_sequence": None}
    assert got[-2][1]["delta"] == real[-2][1]["delta"] == end


@pytest.mark.parametrize("path", [MESSAGES, COHERE])
def test_a_sequence_never_matched_sends_all_the_text_and_the_eos(url: str, path: str) -> None:
    """The text held back at the end goes out at the EOS's step, before the block closes;
    the EOS ends the answer (end_turn / COMPLETE) and is counted."""
    reply = httpx.post(url + path, json=body(True, stop_sequences=["zzzzz"]))
    if path == MESSAGES:
        events = named(reply.content)
        texts = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
        end = next(d for n, d in events if n == "message_delta")
        assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
        assert [n for n, _ in events][-4:-2] == ["content_block_delta", "content_block_stop"]
        tokens = end["usage"]["output_tokens"]
    else:
        events = cohere_events(reply.content)
        texts = [
            e["delta"]["message"]["content"]["text"] for e in events if e["type"] == "content-delta"
        ]
        assert events[-1]["delta"]["finish_reason"] == "COMPLETE"
        tokens = events[-1]["delta"]["usage"]["tokens"]["output_tokens"]
    assert "".join(texts) == completion_text(TOKENS) and all(texts)
    assert tokens == TOKENS + 1


def test_a_tool_call_streams_message_delta_with_stop_sequence_null(url: str) -> None:
    """vLLM 0.32 sets stop_sequence explicitly on message_delta, so exclude_unset keeps it
    (anthropic/serving.py message_stream_converter, `stop_delta`), tool calls or not."""
    reply = httpx.post(url + MESSAGES, json=body(True), headers={"x-sim-tool-calls": "1"})
    end = next(d for n, d in named(reply.content) if n == "message_delta")
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
