"""Ollama's native seams, its engine adapter and the backend identity, on their own."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from proxy.core.apis import api_for
from proxy.core.apis.ollama import OllamaApi
from proxy.core.engine import EngineMetrics, load_split
from proxy.core.engine_ollama import MAX_NS, ollama_engine
from proxy.core.identity import KINDS, PROBES, UNKNOWN, identify
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver

# The done line of ollama/ollama docs/api.md "Generate a chat completion" (streaming).
DONE: dict[str, Any] = {
    "model": "llama3.2",
    "created_at": "2023-08-04T19:22:45.499127Z",
    "message": {"role": "assistant", "content": ""},
    "done": True,
    "done_reason": "stop",
    "total_duration": 4883583458,
    "load_duration": 1334875,
    "prompt_eval_count": 26,
    "prompt_eval_duration": 342546000,
    "eval_count": 282,
    "eval_duration": 4535599000,
}


def seam(path: str) -> OllamaApi:
    api = api_for(path)
    assert isinstance(api, OllamaApi)
    return api


def line(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj)


def chat_line(**message: Any) -> bytes:
    return line({"model": "m", "message": {"role": "assistant", **message}, "done": False})


# -- the request --------------------------------------------------------------------------


def test_streaming_is_the_default_and_options_carry_the_limits() -> None:
    chat = seam("/api/chat")
    info = chat.read_request(
        {"model": "m", "messages": [], "options": {"num_predict": 9, "temperature": 0.5}}
    )
    assert (info.stream, info.max_tokens, info.temperature) == (True, 9, 0.5)
    assert info.usage_requested and chat.ask_for_usage({"model": "m"}, b'{"model": "m"}') is None
    assert chat.read_request({"model": "m", "stream": False}).stream is False
    assert seam("/api/embed").read_request({"model": "m", "input": "x"}).stream is False


def test_the_sampling_options_and_format_are_the_spans_request_attributes() -> None:
    """Ollama's options sit in `options` and its output type in `format` (api/types.go):
    read as chat's top-level fields are, for gen_ai.request.* (they were left out)."""
    options = {"seed": 7, "top_k": 20, "top_p": 0.9, "stop": ["\n"], "presence_penalty": 0.5}
    chat = seam("/api/chat").read_request(
        {"model": "m", "messages": [], "options": options, "format": "json"}
    )
    assert chat.options is not None
    o = chat.options
    assert (o.seed, o.top_k, o.top_p, o.stop_sequences, o.presence_penalty) == (
        7,
        20,
        0.9,
        ("\n",),
        0.5,
    )
    assert (o.output_type, o.choices) == ("json", None)
    schema = seam("/api/generate").read_request(
        {"model": "m", "prompt": "x", "format": {"type": "object"}}
    )
    assert schema.options is not None and schema.options.output_type == "json"
    assert seam("/api/generate").read_request({"model": "m", "prompt": "x"}).options is None


# -- lines --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (chat_line(content="Hi"), "text"),
        (chat_line(content="", thinking="hmm"), "reasoning"),
        (chat_line(content="", tool_calls=[{"function": {"name": "f", "arguments": {}}}]), "tool"),
        (chat_line(content=""), None),
    ],
    ids=["content", "thinking", "tool_calls", "empty"],
)
def test_chat_line_content_kinds(payload: bytes, kind: str | None) -> None:
    facts = seam("/api/chat").event(payload, collect=False, identify=False)
    assert facts.content == kind and not facts.end


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ({"content": "Hi", "thinking": "so."}, "text"),
        ({"content": "", "thinking": "so.", "tool_calls": [{"function": {"name": "f"}}]}, "tool"),
    ],
    ids=["answer", "call"],
)
def test_a_line_where_the_thinking_ends_is_the_answer_and_one_more_reasoning_event(
    message: dict[str, Any], kind: str
) -> None:
    facts = seam("/api/chat").event(chat_line(**message), collect=False, identify=False)
    assert (facts.content, facts.reasoning) == (kind, ["so."])
    observer = StreamObserver(seam("/api/chat").read_request({"model": "m", "messages": []}), 0.0)
    observer.open(200, "application/x-ndjson", 0.01)
    observer.feed(chat_line(content="", thinking="hm") + b"\n", 0.1)
    observer.feed(chat_line(**message) + b"\n" + line(DONE) + b"\n", 0.2)
    m = asyncio.run(
        observer.finish(
            end=0.3, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )
    assert (m.first_reasoning, m.last_reasoning, m.reasoning_tokens) == (0.1, 0.2, 2)
    assert (m.first_answer, m.first_tool_call) == ((0.2, None) if kind == "text" else (None, 0.2))


def test_generate_line_reads_response_and_thinking() -> None:
    gen = seam("/api/generate")
    assert gen.event(line({"response": "x", "done": False}), False, False).content == "text"
    assert gen.event(line({"thinking": "y", "response": ""}), False, False).content == "reasoning"


def test_done_line_ends_with_counts_finish_and_engine() -> None:
    chat = seam("/api/chat")
    facts = chat.event(line(DONE), collect=False, identify=True)
    assert facts.end and facts.finish == "stop" and facts.response_model == "llama3.2"
    assert facts.usage is not None
    counts = chat.counts(facts.usage)
    assert counts is not None
    assert (counts.prompt, counts.output, counts.source) == (26, 282, TokenSource.USAGE)


def test_absent_counts_on_the_done_line_are_zero_as_go_omits_them() -> None:
    # a generation's done line always has total_duration (time.Since(checkpointStart)); one
    # with no Metrics at all is a load answer (tests/core/test_ollama_load_answers.py)
    done = {"done": True, "done_reason": "stop", "total_duration": 5}
    counts = seam("/api/chat").counts(done)
    assert counts is not None and (counts.prompt, counts.output) == (0, 0)


def test_error_line_and_bad_lines() -> None:
    chat = seam("/api/chat")
    assert chat.event(b'{"error":"boom"}', False, False).error == "boom"
    assert chat.event(b"{not json", False, False).malformed
    assert chat.event(b"[1,2]", False, False).malformed


@pytest.mark.parametrize(
    ("raw", "label"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("load", "other"),
        ("unload", "other"),
        ("x", "other"),
    ],
)
def test_done_reason_onto_the_closed_set(raw: str, label: str) -> None:
    assert seam("/api/generate").finish_label(raw) == label


def test_collected_texts_are_thinking_content_and_tool_calls() -> None:
    facts = seam("/api/chat").event(
        chat_line(
            content="a",
            thinking="b",
            tool_calls=[{"function": {"name": "f", "arguments": {"x": 1}}}],
        ),
        collect=True,
        identify=False,
    )
    assert facts.texts == ["b", "a", "f", '{"x":1}']


# -- the engine adapter -------------------------------------------------------------------


def test_adapter_reads_nanoseconds_as_seconds() -> None:
    engine = ollama_engine(DONE)
    assert engine == EngineMetrics(
        queue_time=None,
        time_to_first_token=0.342546,
        generation_time=4.535599,
        mean_itl=None,
        tokens_per_second=282 / 4.535599,
        spec=None,
        load_time=0.001334875,
    )


@pytest.mark.parametrize(
    "value",
    [-1, MAX_NS + 1, 1.5, "12", None, True],
    ids=["neg", "huge", "float", "str", "null", "bool"],
)
def test_nonsense_durations_are_left_out(value: object) -> None:
    engine = ollama_engine({**DONE, "load_duration": value})
    assert engine is not None and engine.load_time is None
    assert engine.time_to_first_token == 0.342546


def test_embed_answers_give_the_load_and_no_prefill() -> None:
    answer = {"model": "m", "embeddings": [[0.1]], "total_duration": 9, "load_duration": 5}
    engine = seam("/api/embed").engine_figures(answer)
    assert engine is not None and engine.load_time == 5e-9
    assert engine.time_to_first_token is None and engine.generation_time is None
    assert seam("/api/embed").engine_figures({"error": "x"}) is None


def test_adapter_needs_a_done_object_with_durations() -> None:
    assert ollama_engine({**DONE, "done": False}) is None
    assert ollama_engine({"done": True, "done_reason": "load"}) is None  # GenerateHandler's load
    assert ollama_engine([DONE]) is None


def test_load_split_sums_to_the_ttft_and_scales_when_the_engine_says_more() -> None:
    engine = ollama_engine(DONE)
    assert engine is not None
    load, first, outside = load_split(0.5, engine)  # type: ignore[misc]
    assert (load, first) == (0.001334875, 0.342546) and load + first + outside == 0.5
    load, first, outside = load_split(0.2, engine)  # type: ignore[misc]
    assert outside == 0.0 and load + first == pytest.approx(0.2) and first > load
    vllm_like = EngineMetrics(0.1, 0.2, None, None, None, None, load_time=0.1)
    assert load_split(1.0, vllm_like) is None  # a queue time: vLLM's ttft_split applies


# -- the observer, fed a recorded-shape stream --------------------------------------------


def chat_in_two_reads(stream: bytes, cut: int) -> Measurement:
    """The record of an `/api/chat` stream that came in two reads, split at `cut`."""
    chat = seam("/api/chat")
    observer = StreamObserver(chat.read_request({"model": "m", "messages": []}), 0.0)
    observer.open(200, "application/x-ndjson", 0.01)
    observer.feed(stream[:cut], 0.1)
    observer.feed(stream[cut:], 0.2)
    observer.end_of_stream(0.2)
    return asyncio.run(
        observer.finish(
            end=0.3, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )


def test_observer_measures_an_ndjson_stream_split_anywhere() -> None:
    stream = b"".join(
        [
            chat_line(content="", thinking="hm") + b"\n",
            chat_line(content="A") + b"\n",
            chat_line(content="B") + b"\n",
            line({**DONE, "eval_count": 3}) + b"\n",
        ]
    )
    for cut in range(1, len(stream), 7):
        m = chat_in_two_reads(stream, cut)
        assert m.ok and m.content_events == 3 and m.output_tokens == 3 and m.prompt_tokens == 26
        assert m.engine is not None and m.engine.load_time == 0.001334875


@pytest.mark.parametrize(
    ("bad", "at"),
    [(b"{not json\n", 1), (b"[1, 2]\n", 0), (b"{not json", 3)],
    ids=["mid_stream", "first_not_an_object", "last_without_its_lf"],
)
def test_a_line_that_is_not_json_is_counted_and_the_stream_goes_on(bad: bytes, at: int) -> None:
    """As an SSE event that is no JSON object is (tests/core/test_observe.py): skipped,
    counted in `malformed_events` (tokenprobe_malformed_events_total), and the stream
    measured on from the next line, wherever two reads split it."""
    good = [chat_line(content="A"), chat_line(content="B"), line({**DONE, "eval_count": 2})]
    lines = [g + b"\n" for g in good]
    stream = b"".join([*lines[:at], bad, *lines[at:]])
    for cut in range(1, len(stream)):
        m = chat_in_two_reads(stream, cut)
        got = (m.malformed_events, m.content_events, m.output_tokens, m.finish_reason, m.ok)
        assert got == (1, 2, 2, "stop", True), cut


def test_tool_calls_are_counted_one_per_call_streamed_or_not() -> None:
    """Ollama sends each call whole, its arguments an object (api/types.go ToolCall), one
    line per parsed call with an id of its own (server/routes.go, toolCallId), or all of
    them in a non-streamed answer's message: one count per call, as chat's."""
    chat = seam("/api/chat")

    def call(ident: str | None, arguments: dict[str, Any]) -> dict[str, Any]:
        function = {"index": 0, "name": "get_weather", "arguments": arguments}
        return {"function": function} if ident is None else {"id": ident, "function": function}

    first, second = call("call_a", {"city": "Oslo"}), call("call_b", {"city": "Rome"})
    done = line({**DONE, "done_reason": "stop"}) + b"\n"
    streamed = chat_line(content="", tool_calls=[first]) + b"\n"
    streamed += chat_line(content="", tool_calls=[second]) + b"\n" + done
    whole = {
        **DONE,
        "message": {"role": "assistant", "content": "", "tool_calls": [first, call(None, {})]},
    }
    for content_type, body in (
        ("application/x-ndjson", streamed),
        ("application/json", line(whole)),
    ):
        observer = StreamObserver(chat.read_request({"model": "m", "messages": []}), 0.0)
        observer.open(200, content_type, 0.01)
        observer.feed(body, 0.1)
        observer.end_of_stream(0.2)
        m = asyncio.run(
            observer.finish(
                end=0.3, started_at=0.0, status_code=200, error_type=None, error_message=None
            )
        )
        assert [c.outcome for c in m.tool_calls] == ["complete", "complete"], content_type


def test_observer_without_a_done_line_is_truncated() -> None:
    chat = seam("/api/chat")
    observer = StreamObserver(chat.read_request({"model": "m", "messages": []}), 0.0)
    observer.open(200, "application/x-ndjson", 0.01)
    observer.feed(chat_line(content="A") + b"\n" + chat_line(content="B"), 0.1)
    observer.end_of_stream(0.2)
    m = asyncio.run(
        observer.finish(
            end=0.3, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )
    assert m.error_type is ErrorType.STREAM_TRUNCATED and m.content_events == 2
    assert m.token_source is TokenSource.CHUNKS


# -- backend identity ---------------------------------------------------------------------


def answers(**by_kind: tuple[int, bytes]) -> dict[str, tuple[int, bytes] | None]:
    paths = {probe.kind: probe.path for probe in PROBES}
    return {paths[kind]: answer for kind, answer in by_kind.items()}


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ({"ollama": (200, b'{"version":"0.13.0"}')}, ("ollama", "0.13.0")),
        (
            {"llamacpp": (200, b'{"build_info":"b7000-1a2b3c4d","total_slots":1}')},
            ("llamacpp", "b7000-1a2b3c4d"),
        ),
        ({"sglang": (200, b'{"version":"0.5.4","tp_size":1}')}, ("sglang", "0.5.4")),
        (
            {"tgi": (200, b'{"router":"text-generation-router","version":"3.3.6"}')},
            ("tgi", "3.3.6"),
        ),
        ({"vllm": (200, b'{"version":"0.32.0"}')}, ("vllm", "0.32.0")),
        (
            {"vllm": (200, b'{"version":"0.32.0"}'), "sglang": (200, b'{"version":"0.5.4"}')},
            ("sglang", "0.5.4"),
        ),
        ({"tgi": (200, b'{"version":"1.0"}')}, (UNKNOWN, UNKNOWN)),  # /info of someone else
        ({"vllm": (404, b'{"detail":"Not Found"}')}, (UNKNOWN, UNKNOWN)),
        ({"vllm": (200, b"<html>")}, (UNKNOWN, UNKNOWN)),
        ({}, (UNKNOWN, UNKNOWN)),
    ],
)
def test_identify(given: dict[str, tuple[int, bytes]], want: tuple[str, str]) -> None:
    assert identify(answers(**given)) == want
    assert want[0] in KINDS


def test_a_version_is_a_bounded_label() -> None:
    kind, version = identify(answers(vllm=(200, orjson.dumps({"version": "x y\n" * 100}))))
    assert kind == "vllm" and len(version) <= 64 and " " not in version


def test_a_call_whose_arguments_nest_deeper_than_json_writes_is_judged_not_a_failure() -> None:
    """orjson reads deeper nesting than it writes: such arguments once raised out of the
    line's facts, and the stream went unmeasured. The call counts, its arguments unknown."""
    deep = b'{"a":' * 300 + b"{}" + b"}" * 300  # written by hand: orjson cannot
    call = b'{"id":"call_a","function":{"index":0,"name":"f","arguments":' + deep + b"}}"
    head = b'{"model":"m","message":{"role":"assistant","content":"","tool_calls":['
    chat = seam("/api/chat")
    observer = StreamObserver(chat.read_request({"model": "m", "messages": []}), 0.0)
    observer.open(200, "application/x-ndjson", 0.01)
    observer.feed(head + call + b']},"done":false}\n' + line(DONE) + b"\n", 0.1)
    m = asyncio.run(
        observer.finish(
            end=0.2, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )
    assert m.ok and m.first_tool_call == 0.1
    assert [c.outcome for c in m.tool_calls] == ["invalid_arguments"]
