"""A tool call sent whole at the first content: its decoding is in the TTFT, not the span.

Ollama sends each call once its parser has read it whole (ollama/ollama @ fb30760
server/routes.go ChatHandler's toolParser; GenerateHandler puts tool_calls on the done
line; the /v1 layer writes one chunk per call, middleware/openai.go ChatWriter). A call of
40 tokens at 20 ms each after a 100 ms prefill reaches the proxy at 905 ms, the EOS's done
line 20 ms later: the span from the first content to the end holds one step, and TPOT over
it divided by 40 gave 0.5 ms (2000 tok/s) while Ollama's own eval_duration / eval_count
says 20 ms; the TTFT's part outside the engine was the call's 800 ms of decoding. Such a
stream has no client-side TPOT or decode speed, and no TTFT split; the engine's own
figures stay. vLLM's tool parsers stream a call in pieces (a name, then its arguments on
later steps), which keep theirs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from proxy.core.apis import api_for
from proxy.core.measurement import Measurement, TokenSource
from proxy.core.observe import StreamObserver
from tests.paths import FIXTURES

MODEL = "qwen3"
STAMP = "2026-08-22T10:00:00.123456789Z"
CALL = {
    "id": "call_k3j1xq7w",
    "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
}
#: The done line's Metrics: 5 ms load, 100 ms prefill of 30 tokens, 41 tokens in 820 ms
#: (the call's 40 and the EOS).
METRICS = {
    "total_duration": 925_000_000,
    "load_duration": 5_000_000,
    "prompt_eval_count": 30,
    "prompt_eval_duration": 100_000_000,
    "eval_count": 41,
    "eval_duration": 820_000_000,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def chat_line(content: str = "", done: bool = False, **fields: Any) -> bytes:
    """A /api/chat line in api/types.go ChatResponse's field order."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    for key in ("thinking", "tool_calls"):
        if key in fields:
            message[key] = fields.pop(key)
    line = {"model": MODEL, "created_at": STAMP, "message": message, "done": done, **fields}
    return orjson.dumps(line) + b"\n"


def generate_line(response: str = "", done: bool = False, **fields: Any) -> bytes:
    line = {"model": MODEL, "created_at": STAMP, "response": response, "done": done, **fields}
    return orjson.dumps(line) + b"\n"


def measured(
    endpoint: str, body: dict[str, Any], reads: list[tuple[float, bytes]], content_type: str
) -> Measurement:
    api = api_for(endpoint)
    assert api is not None
    observer = StreamObserver(api.read_request(body), 0.0)
    observer.open(200, content_type, reads[0][0])
    for now, read in reads:
        observer.feed(read, now)
    end = reads[-1][0]
    observer.end_of_stream(end)
    return asyncio.run(
        observer.finish(
            end=end, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
DONE = chat_line(done=True, done_reason="stop", **METRICS)


def assert_whole_call_first(m: Measurement) -> None:
    assert m.ok and [c.outcome for c in m.tool_calls] == ["complete"]
    assert m.ttft == pytest.approx(0.905) and m.first_tool_call == pytest.approx(0.905)
    assert (m.tpot, m.decode_tokens_per_second) == (None, None)
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (30, 41, TokenSource.USAGE)
    # no split: what would be left outside the engine is the call's decoding
    assert (m.ttft_split(), m.load_split()) == (None, None)
    engine = m.engine  # the engine's own figures, as they were
    assert engine is not None
    assert (engine.load_time, engine.time_to_first_token) == (0.005, 0.1)
    assert engine.generation_time == 0.82 and engine.tokens_per_second == pytest.approx(50.0)
    assert m.ttft_parts() == (None, 0.1, None)
    assert m.whole_call_first


def test_ollama_chat_whose_first_content_is_a_whole_call() -> None:
    reads = [(0.905, chat_line(tool_calls=[CALL])), (0.925, DONE)]
    m = measured("/api/chat", {**CHAT, "tools": TOOLS}, reads, "application/x-ndjson")
    assert_whole_call_first(m)


def test_ollama_generate_sends_its_calls_on_the_done_line() -> None:
    done = generate_line(done=True, done_reason="stop", context=[1, 2], **METRICS)
    done = done[:-2] + b',"tool_calls":' + orjson.dumps([CALL]) + b"}\n"
    m = measured(
        "/api/generate",
        {"model": MODEL, "prompt": "Weather in Paris?"},
        [(0.905, done)],
        "application/x-ndjson",
    )
    assert_whole_call_first(m)


def test_ollamas_openai_layer_sends_the_call_in_one_chunk() -> None:
    """middleware/openai.go ChatWriter: ToStreamChunks writes the call (arguments as a
    JSON text) in one chunk with the role; the finish chunk and, with include_usage, the
    usage chunk at the done response. No engine figures on this layer."""

    def chunk(delta: Any, finish: str | None = None, usage: Any = None) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        obj: dict[str, Any] = {"id": "chatcmpl-123", "object": "chat.completion.chunk",
                               "created": 1755856800, "model": MODEL,
                               "system_fingerprint": "fp_ollama", "choices": choices}  # fmt: skip
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    call = {"id": "call_k3j1xq7w", "index": 0, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}  # fmt: skip
    usage = {"prompt_tokens": 30, "completion_tokens": 41, "total_tokens": 71}
    last = chunk({}, "tool_calls") + chunk(None, usage=usage) + b"data: [DONE]\n\n"
    body = {**CHAT, "tools": TOOLS, "stream": True, "stream_options": {"include_usage": True}}
    reads = [(0.905, chunk({"role": "assistant", "content": "", "tool_calls": [call]})),
             (0.925, last)]  # fmt: skip
    m = measured("/v1/chat/completions", body, reads, "text/event-stream")
    assert m.ok and m.ttft == pytest.approx(0.905)
    assert (m.tpot, m.decode_tokens_per_second, m.output_tokens) == (None, None, 41)
    assert m.whole_call_first


def test_a_call_after_streamed_text_keeps_its_figures() -> None:
    """Text first, token by token, then a call the parser held until whole: the span from
    the first text to the done line holds every token after the first, the call's too."""
    reads = [(0.105, chat_line("Let")), (0.125, chat_line(" me")),
             (0.925, chat_line(tool_calls=[CALL])),
             (0.945, chat_line(done=True, done_reason="stop", **{**METRICS, "eval_count": 43}))]  # fmt: skip
    m = measured("/api/chat", {**CHAT, "tools": TOOLS}, reads, "application/x-ndjson")
    assert m.ok and m.tpot == pytest.approx((0.945 - 0.105) / 42)
    split = m.load_split()  # load 5 ms and prefill 100 ms: the whole TTFT of 105 ms
    assert split is not None and split[2] == pytest.approx(0.0, abs=1e-9)
    assert not m.whole_call_first


def test_thinking_then_a_whole_call_keeps_its_figures() -> None:
    reads = [(0.125, chat_line(thinking="Need")), (0.145, chat_line(thinking=" weather.")),
             (0.925, chat_line(tool_calls=[CALL])), (0.945, DONE)]  # fmt: skip
    m = measured("/api/chat", {**CHAT, "tools": TOOLS}, reads, "application/x-ndjson")
    assert m.ttft == pytest.approx(0.125) and m.tpot == pytest.approx((0.945 - 0.125) / 40)
    assert not m.whole_call_first


def vllm_events() -> list[bytes]:
    raw = (FIXTURES / "streams" / "vllm_tool_calls.sse").read_bytes()
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def test_vllm_streams_a_call_in_pieces_and_keeps_its_figures() -> None:
    """vLLM's hermes parser: the call's name on one step, its arguments on later ones
    (tests/core/test_observe.py pins the whole record of this capture)."""
    times = [100.25, 100.5, 100.75, 101.0, 101.125, 101.25, 101.25]
    reads = [(t - 100.0, event) for t, event in zip(times, vllm_events(), strict=True)]
    body = {"model": "m", "messages": [], "tools": TOOLS, "stream": True}
    m = measured("/v1/chat/completions", body, reads, "text/event-stream")
    assert m.ok and m.tpot == pytest.approx(0.625 / 17) and not m.whole_call_first


def test_a_call_whose_pieces_all_came_in_the_first_read_is_whole_there() -> None:
    """The same capture with the name and every argument piece in one read (steps merged
    on the way): the call's tokens were decoded before that read, as Ollama's are."""
    role, name, first, second, *rest = vllm_events()
    reads = [
        (0.25, role),
        (0.5, name + first + second),
        (0.625, rest[0]),
        (0.75, b"".join(rest[1:])),
    ]
    body = {"model": "m", "messages": [], "tools": TOOLS, "stream": True}
    m = measured("/v1/chat/completions", body, reads, "text/event-stream")
    assert m.ok and m.ttft == 0.5 and (m.tpot, m.decode_tokens_per_second) == (None, None)
    assert m.whole_call_first


def test_a_call_cut_off_in_the_first_read_is_not_whole() -> None:
    """Arguments that are no whole JSON object yet go on being decoded after the read."""
    role, name, first, *_ = vllm_events()
    reads = [(0.25, role), (0.5, name + first)]
    body = {"model": "m", "messages": [], "tools": TOOLS, "stream": True}
    m = measured("/v1/chat/completions", body, reads, "text/event-stream")
    assert not m.whole_call_first
