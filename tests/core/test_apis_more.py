"""The seams of the APIs added by issue 18 on real or source-faithful vLLM streams, fed with
synthetic read times (one read per event, and byte at a time): token-in/token-out generate,
audio transcription and translation, Cohere chat v2. Sources: tests/fixtures/streams/index.toml.
"""

from __future__ import annotations

import asyncio

import orjson
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.apis import api_for
from proxy.core.form import read_form, with_field
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver
from proxy.core.request import parse_request
from tests.core.test_apis import byte_at_a_time, events
from tests.paths import STREAMS

START, OPENED = 100.0, 100.125


def run(
    path: str, body: bytes, reads: list[bytes], times: list[float], end: float, **kw: object
) -> Measurement:
    info, _ = parse_request(path, body, **kw)  # type: ignore[arg-type]
    observer = StreamObserver(info, start=START)
    observer.open(200, "text/event-stream", OPENED)
    for chunk, now in zip(reads, times, strict=True):
        observer.feed(chunk, now)
    observer.end_of_stream(end)
    return asyncio.run(
        observer.finish(
            end=end, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )


# -- /inference/v1/generate ---------------------------------------------------------------

GENERATE = orjson.dumps(
    {
        "model": "tiny",
        "stream": True,
        "token_ids": [1, 2, 3, 4, 5],
        "sampling_params": {"max_tokens": 5, "ignore_eos": True, "temperature": 0.5},
    }
)
GEN_TIMES = [100.5, 100.625, 100.75, 100.875, 101.0, 101.0]


def test_generate_route_has_its_api() -> None:
    api = api_for("/inference/v1/generate")
    assert api is not None and api.endpoint == "/inference/v1/generate"


def test_generate_request_reads_sampling_params_and_the_prompt_ids() -> None:
    info, _ = parse_request("/inference/v1/generate", GENERATE)
    assert (info.model, info.stream, info.max_tokens, info.temperature) == ("tiny", True, 5, 0.5)
    assert info.prompt_tokens == 5 and not info.usage_requested


def test_generate_stream_counts_output_exactly_from_token_ids() -> None:
    m = run("/inference/v1/generate", GENERATE, events("vllm032_generate.sse"), GEN_TIMES, 101.125)
    assert m.ok and m.ttft == 0.5  # the first chunk with token_ids
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (5, 5, TokenSource.TOKEN_IDS)
    assert (m.finish_reason, m.raw_finish_reason) == ("length", "length")
    assert m.tpot == 0.5 / 4 and m.content_events == 5
    assert m.response_id == "generate-tokens-94e2b1d16869bb0b"


def test_a_generate_stream_refusing_a_prompt_over_the_context_is_context_length() -> None:
    """vLLM's token-in generate stream answers 200, then refuses a prompt longer than the
    context in an error event (scale_out/token_in_token_out/serving.py); not streamed, the
    same words are a 400, context_length. The stream's was stream_error: a server-side
    failure in the availability ratio, for a prompt the client must shorten."""
    refusal = (
        b'data: {"error": {"message": "The decoder prompt (length 300) is longer than the '
        b"maximum model length of 256. Make sure that `max_model_len` is no smaller than the "
        b'number of text tokens.", "type": "BadRequestError", "code": 400}}\n\n'
    )
    m = run(
        "/inference/v1/generate", GENERATE, [refusal, b"data: [DONE]\n\n"], [100.5, 100.5], 100.6
    )
    assert m.error_type is ErrorType.CONTEXT_LENGTH, m.error_type
    assert m.error_message is not None and "longer than the maximum model length" in m.error_message
    other = b'data: {"error": {"message": "engine died", "type": "InternalServerError"}}\n\n'
    m = run("/inference/v1/generate", GENERATE, [other, b"data: [DONE]\n\n"], [100.5, 100.5], 100.6)
    assert m.error_type is ErrorType.STREAM_ERROR


def test_generate_stream_byte_at_a_time_gives_the_same_record() -> None:
    whole = run("/inference/v1/generate", GENERATE, events("vllm032_generate.sse"), GEN_TIMES, 102)
    reads, times = byte_at_a_time(events("vllm032_generate.sse"), GEN_TIMES)
    assert run("/inference/v1/generate", GENERATE, reads, times, 102) == whole


def test_generate_several_ids_in_one_chunk_count_each() -> None:
    chunk = (
        b'data: {"request_id":"r","usage":null,"output_mode":"tokens","choices":[{"index":0,'
        b'"finish_reason":"stop","stop_reason":null,"token_ids":[7,8,9]}]}\n\ndata: [DONE]\n\n'
    )
    m = run("/inference/v1/generate", GENERATE, [chunk], [100.5], 100.5)
    assert (m.output_tokens, m.content_events, m.finish_reason) == (3, 1, "stop")


def test_generate_with_two_choices_finishes_each_choice_alone() -> None:
    """vLLM streams one chunk per choice, each with its own index and finish reason
    (token_in_token_out/serving.py, serve_tokens_stream_generator), as completions do: a
    stream cut after both finishes, before [DONE], is whole (every finish went on choice
    0: ('stop', 'none') and stream_truncated)."""

    def chunk(index: int, ids: list[int], finish: str | None = None) -> bytes:
        choice = {"index": index, "finish_reason": finish, "token_ids": ids}
        return b"data: " + orjson.dumps({"request_id": "r", "choices": [choice]}) + b"\n\n"

    reads = [chunk(0, [5]), chunk(1, [6]), chunk(0, [7], "length"), chunk(1, [8], "stop")]
    m = run("/inference/v1/generate", GENERATE, reads, GEN_TIMES[:4], 101.0)
    assert (m.finish_reasons, m.error_type, m.output_tokens) == (("length", "stop"), None, 4)


def test_generate_asked_usage_wins_over_token_ids() -> None:
    usage = (
        b'data: {"request_id":"r","choices":[],"usage":{"prompt_tokens":6,"total_tokens":11,'
        b'"completion_tokens":5},"output_mode":"tokens"}\n\n'
    )
    reads = events("vllm032_generate.sse")
    m = run(
        "/inference/v1/generate",
        GENERATE,
        [*reads[:-1], usage, reads[-1]],
        [*GEN_TIMES[:-1], 101, 101],
        101,
    )
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (6, 5, TokenSource.USAGE)


def test_generate_error_after_the_200_is_a_stream_error() -> None:
    error = b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}\n\n'
    reads = events("vllm032_generate.sse")
    m = run(
        "/inference/v1/generate",
        GENERATE,
        [reads[0], error, reads[-1]],
        [100.5, 100.6, 100.6],
        100.7,
    )
    assert m.error_type is ErrorType.STREAM_ERROR and m.output_tokens == 1


def test_generate_cut_before_finish_is_truncated() -> None:
    reads = events("vllm032_generate.sse")[:2]
    m = run("/inference/v1/generate", GENERATE, reads, [100.5, 100.625], 100.7)
    assert m.error_type is ErrorType.STREAM_TRUNCATED and m.output_tokens == 2


def test_generate_non_streaming_body() -> None:
    info, _ = parse_request(
        "/inference/v1/generate", GENERATE.replace(b'"stream":true', b'"stream":false')
    )
    observer = StreamObserver(info, start=START)
    observer.open(200, "application/json", OPENED)
    observer.feed((STREAMS / "vllm032_generate.json").read_bytes(), 101.0)
    m = asyncio.run(
        observer.finish(
            end=101.0, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (5, 5, TokenSource.USAGE)
    assert m.finish_reason == "length" and m.response_id == "generate-tokens-a273b8ba44e5e549"


# -- multipart forms and the audio APIs ----------------------------------------------------

FORM_CT = b"multipart/form-data; boundary=b0und"


def form(*parts: tuple[str, bytes, str | None]) -> bytes:
    out = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += b"--b0und\r\nContent-Disposition: " + disposition.encode() + b"\r\n"
        if filename:
            out += b"Content-Type: audio/wav\r\n"
        out += b"\r\n" + value + b"\r\n"
    return out + b"--b0und--\r\n"


AUDIO_FORM = form(
    (
        "file",
        b"RIFF" + b"\x00\r\n--b0un" * 50,
        "a.wav",
    ),  # binary that almost looks like a delimiter
    ("model", b"whisper", None),
    ("stream", b"true", None),
    ("temperature", b"0.25", None),
)


def test_form_fields_are_read_and_files_only_sized() -> None:
    got = read_form(AUDIO_FORM, FORM_CT)
    assert got == {"model": "whisper", "stream": "true", "temperature": "0.25"}
    assert got is not None and got.file_bytes == 4 + 9 * 50


def test_form_boundary_is_found_without_the_header() -> None:
    assert read_form(AUDIO_FORM) == read_form(AUDIO_FORM, FORM_CT)


def test_malformed_forms_read_as_none() -> None:
    assert read_form(AUDIO_FORM[:-12], FORM_CT) is None  # no closing delimiter
    assert read_form(AUDIO_FORM, b"multipart/form-data") is None  # no boundary
    assert read_form(AUDIO_FORM, b"application/json") is None
    assert read_form(b"--b0und\r\nX: y\r\n\r\nv\r\n--b0und--\r\n", FORM_CT) is None  # no name
    info, obj = parse_request("/v1/audio/transcriptions", b"{}", b"application/json")
    assert obj is None and not info.valid_json and info.endpoint == "/v1/audio/transcriptions"


def test_usage_is_asked_for_by_one_more_part_and_every_client_byte_stays() -> None:
    api = api_for("/v1/audio/transcriptions")
    assert api is not None
    info, obj = parse_request(api, AUDIO_FORM, FORM_CT)
    assert (info.model, info.stream, info.temperature, info.usage_requested) == (
        "whisper",
        True,
        0.25,
        False,
    )
    assert obj is not None
    asked = api.ask_for_usage(obj, AUDIO_FORM)
    assert asked is not None
    again = read_form(asked, FORM_CT)
    assert again is not None and again["stream_include_usage"] == "true"
    extra = (
        b'\r\n--b0und\r\nContent-Disposition: form-data; name="stream_include_usage"\r\n\r\ntrue'
    )
    assert asked.replace(extra, b"") == AUDIO_FORM


def test_a_client_that_chose_usage_itself_is_left_alone() -> None:
    api = api_for("/v1/audio/translations")
    assert api is not None
    for value in (b"true", b"false"):
        body = form(
            ("file", b"RIFF", "a.wav"),
            ("stream", b"1", None),
            ("stream_include_usage", value, None),
        )
        info, obj = parse_request(api, body, FORM_CT)
        assert obj is not None and api.ask_for_usage(obj, body) is None
        assert info.usage_requested is (value == b"true")


def test_a_client_that_asked_for_continuous_usage_is_not_asked_for_usage() -> None:
    """vLLM sends usage on every chunk only beside stream_include_usage (base/serving.py,
    `include_continuous_usage = request.stream_continuous_usage_stats if include_usage
    else False`): asked for usage, that client would get usage it gets not direct (and the
    stripper, seeing it, stops asking for every later stream). Its false is no ask."""
    api = api_for("/v1/audio/transcriptions")
    assert api is not None
    for value, asked in ((b"true", False), (b"1", False), (b"false", True)):
        body = form(
            ("file", b"RIFF", "a.wav"),
            ("stream", b"true", None),
            ("stream_continuous_usage_stats", value, None),
        )
        _, obj = parse_request(api, body, FORM_CT)
        assert obj is not None and (api.ask_for_usage(obj, body) is not None) is asked, value


# vLLM's transcription stream (base/serving.py @ 00e2ed95ef60): content chunks, the finish
# chunk, the usage chunk (stream_include_usage) and [DONE].
TRANSCRIPTION = [
    b'data: {"id":"trsc-1","object":"transcription.chunk","created":1,"model":"whisper","choices":[{"delta":{"content":" Hello"}}]}\n\n',
    b'data: {"id":"trsc-1","object":"transcription.chunk","created":1,"model":"whisper","choices":[{"delta":{"content":" world"}}]}\n\n',
    b'data: {"id":"trsc-1","object":"transcription.chunk","created":1,"model":"whisper","choices":[{"delta":{"content":"."},"finish_reason":"stop","stop_reason":null}]}\n\n',
    b'data: {"id":"trsc-1","object":"transcription.chunk","created":1,"model":"whisper","choices":[],"usage":{"prompt_tokens":54,"total_tokens":58,"completion_tokens":4}}\n\n',
    b"data: [DONE]\n\n",
]


def test_transcription_stream_gives_exact_record() -> None:
    m = run(
        "/v1/audio/transcriptions",
        AUDIO_FORM,
        TRANSCRIPTION,
        [100.5, 100.75, 101.0, 101.0, 101.0],
        101.125,
        content_type=FORM_CT,
    )
    assert m.ok and m.ttft == 0.5 and m.content_events == 3
    assert (m.prompt_tokens, m.output_tokens, m.token_source) == (54, 4, TokenSource.USAGE)
    assert (m.finish_reason, m.response_id, m.response_model) == ("stop", "trsc-1", "whisper")
    assert m.tpot == 0.5 / 3


def test_a_long_transcription_cut_after_its_first_segment_is_truncated() -> None:
    """Audio longer than the model's clip is transcribed in segments, each ending with its
    own finish_reason (base/serving.py loops over the segments): a stream cut after the
    first segment's finish, before [DONE], is cut short, not a success."""
    cut = [*TRANSCRIPTION[:3], TRANSCRIPTION[0]]  # segment 2 had begun
    m = run("/v1/audio/transcriptions", AUDIO_FORM, cut, [100.5, 100.75, 101.0, 101.1],
            101.2, content_type=FORM_CT)  # fmt: skip
    assert m.error_type is ErrorType.STREAM_TRUNCATED and m.error_message is not None
    assert "[DONE]" in m.error_message


def test_transcription_stream_without_finish_or_done_is_truncated() -> None:
    m = run(
        "/v1/audio/transcriptions",
        AUDIO_FORM,
        TRANSCRIPTION[:2],
        [100.5, 100.75],
        101.0,
        content_type=FORM_CT,
    )
    assert m.error_type is ErrorType.STREAM_TRUNCATED and m.output_tokens == 2


# -- /cohere/v2/chat ------------------------------------------------------------------------

COHERE_BODY = orjson.dumps({"model": "command", "stream": True, "max_tokens": 64, "messages": []})
COHERE = [
    b'data: {"type":"message-start","id":"chatcmpl-7","delta":{"message":{"role":"assistant"}}}\n\n',
    b'data: {"type":"content-start","index":0,"delta":{"message":{"content":{"type":"thinking","thinking":""}}}}\n\n',
    b'data: {"type":"content-delta","index":0,"delta":{"message":{"content":{"thinking":"Hm"}}}}\n\n',
    b'data: {"type":"content-end","index":0}\n\n',
    b'data: {"type":"content-start","index":1,"delta":{"message":{"content":{"type":"text","text":""}}}}\n\n',
    b'data: {"type":"content-delta","index":1,"delta":{"message":{"content":{"text":"Hi"}}}}\n\n',
    b'data: {"type":"content-delta","index":1,"delta":{"message":{"content":{"text":"!"}}}}\n\n',
    b'data: {"type":"content-end","index":1}\n\n',
    b'data: {"type":"message-end","id":"chatcmpl-7","delta":{"finish_reason":"MAX_TOKENS","usage":{"billed_units":{"input_tokens":9,"output_tokens":4},"tokens":{"input_tokens":9,"output_tokens":4},"cached_tokens":8}}}\n\n',
    b"data: [DONE]\n\n",
]
COHERE_TIMES = [100.125, 100.125, 100.5, 100.5, 100.75, 100.75, 101.0, 101.0, 101.0, 101.0]


def test_cohere_stream_gives_exact_record() -> None:
    m = run("/cohere/v2/chat", COHERE_BODY, COHERE, COHERE_TIMES, 101.125)
    assert m.ok and m.ttft == 0.5  # the thinking delta, not message-start or content-start
    assert (m.prompt_tokens, m.output_tokens, m.cached_prompt_tokens) == (9, 4, 8)
    assert (m.finish_reason, m.raw_finish_reason, m.response_id) == (
        "length",
        "MAX_TOKENS",
        "chatcmpl-7",
    )
    assert m.content_events == 3 and m.tpot == 0.5 / 3


def test_cohere_stream_byte_at_a_time_gives_the_same_record() -> None:
    whole = run("/cohere/v2/chat", COHERE_BODY, COHERE, COHERE_TIMES, 102)
    reads, times = byte_at_a_time(COHERE, COHERE_TIMES)
    assert run("/cohere/v2/chat", COHERE_BODY, reads, times, 102) == whole


def test_cohere_message_end_with_an_error_is_a_stream_error() -> None:
    end = b'data: {"type":"message-end","delta":{"error":"boom","finish_reason":"ERROR"}}\n\n'
    m = run(
        "/cohere/v2/chat",
        COHERE_BODY,
        [*COHERE[:3], end, COHERE[-1]],
        [100.1, 100.1, 100.5, 100.6, 100.6],
        100.7,
    )
    assert m.error_type is ErrorType.STREAM_ERROR and m.finish_reason == "error"


def test_cohere_without_message_end_is_truncated() -> None:
    m = run("/cohere/v2/chat", COHERE_BODY, COHERE[:6], COHERE_TIMES[:6], 101.0)
    assert m.error_type is ErrorType.STREAM_TRUNCATED and m.output_tokens == 2


def test_cohere_tool_plan_and_tool_call_arguments_are_content() -> None:
    plan = b'data: {"type":"tool-plan-delta","delta":{"message":{"tool_plan":"I will"}}}\n\n'
    call = b'data: {"type":"tool-call-delta","index":0,"delta":{"message":{"tool_calls":{"function":{"arguments":"{}"}}}}}\n\n'
    m = run(
        "/cohere/v2/chat",
        COHERE_BODY,
        [COHERE[0], plan, call, COHERE[-2], COHERE[-1]],
        [100.1, 100.5, 100.75, 101, 101],
        101,
    )
    assert m.ttft == 0.5 and m.content_events == 2


# -- finish reasons and usage, rechecked at the source ---------------------------------------

CHAT_BODY = orjson.dumps({"model": "m", "stream": True, "messages": []})


def test_vllm_repetition_finish_reason_has_its_own_label() -> None:
    # vllm/v1/engine/__init__.py FINISH_REASON_STRINGS: stop, length, abort, error, repetition
    chunk = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"repetition"}]}\n\n'
    m = run("/v1/chat/completions", CHAT_BODY, [chunk, b"data: [DONE]\n\n"], [100.5, 100.5], 100.5)
    assert (m.finish_reason, m.raw_finish_reason) == ("repetition", "repetition")


def test_responses_failed_keeps_the_usage_it_carries() -> None:
    failed = orjson.dumps(
        {
            "type": "response.failed",
            "response": {
                "id": "resp_1",
                "status": "failed",
                "error": {"code": "server_error", "message": "boom"},
                "usage": {
                    "input_tokens": 7,
                    "output_tokens": 3,
                    "input_tokens_details": {"cached_tokens": 4},
                },
            },
        }
    )
    body = orjson.dumps({"model": "m", "stream": True, "input": "hi"})
    m = run("/v1/responses", body, [b"data: " + failed + b"\n\n"], [100.5], 100.5)
    assert m.error_type is ErrorType.STREAM_ERROR
    assert (m.prompt_tokens, m.output_tokens, m.cached_prompt_tokens) == (7, 3, 4)


def test_messages_usage_merges_field_by_field_and_a_null_erases_nothing() -> None:
    start = b'data: {"type":"message_start","message":{"id":"m","usage":{"input_tokens":10,"cache_read_input_tokens":6,"cache_creation_input_tokens":2,"output_tokens":0}}}\n\n'
    delta = b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":null,"output_tokens":5,"cache_read_input_tokens":null}}\n\n'
    body = orjson.dumps({"model": "m", "stream": True, "max_tokens": 9, "messages": []})
    m = run(
        "/v1/messages",
        body,
        [start, delta, b'data: {"type":"message_stop"}\n\n'],
        [100.1, 100.5, 100.5],
        100.5,
    )
    assert (m.prompt_tokens, m.cached_prompt_tokens, m.output_tokens) == (18, 6, 5)


@given(
    audio=st.binary(max_size=300),
    model=st.text(
        alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)),
        max_size=30,
    ),
)
def test_any_file_and_field_survive_reading_and_the_added_part(audio: bytes, model: str) -> None:
    body = form(("file", audio, "a.wav"), ("model", model.encode(), None))
    got = read_form(body, FORM_CT)
    if got is None:  # the file's bytes held the delimiter itself: a client's boundary never does
        assert b"\r\n--b0und" in b"\r\n" + audio + b"\r\n"
        return
    assert got == {"model": model} and got.file_bytes == len(audio)
    asked = with_field(got, "stream_include_usage", "true")
    assert asked is not None
    again = read_form(asked, FORM_CT)
    assert again == {"model": model, "stream_include_usage": "true"}
    assert again is not None and again.file_bytes == len(audio)


def test_an_echo_keeps_each_choices_prompt_by_its_index() -> None:
    """vLLM numbers a completions choice `output.index + prompt_idx * n` and begins its
    text with that prompt when `echo` is set, but not with `return_token_ids`
    (completion/serving.py)."""
    api = api_for("/v1/completions")
    assert api is not None
    batch = api.read_request({"prompt": ["a b", "c"], "n": 2, "echo": True})
    assert batch.echoed == ("a b", "a b", "c", "c")
    one = api.read_request({"prompt": ["a b"], "echo": True})
    assert one.echoed == ("a b",)  # a list of one text is one prompt
    ids = api.read_request({"prompt": [[5, 6, 7], [8]], "echo": True})
    assert ids.echoed == ([5, 6, 7], [8])
    assert api.read_request({"prompt": [5, 6, 7], "echo": True}).echoed == ([5, 6, 7],)
    assert api.read_request({"prompt": "a", "echo": True, "return_token_ids": True}).echoed == ()
    assert api.read_request({"prompt": "a"}).echoed == ()
    # a hostile n is no reason to fill the memory: past MAX_ECHOED nothing is kept (an
    # n of 2**70 was a tuple of 2**70 prompts, built before the request went on)
    assert api.read_request({"prompt": "a", "echo": True, "n": 2**70}).echoed == ()
    assert len(api.read_request({"prompt": "a", "echo": True, "n": 4096}).echoed) == 4096
    # the observer gives the counter the prompts of the choices that answered
    observer = StreamObserver(batch, 0.0)
    observer.open(200, "application/json", 0.0)
    observer.feed(
        orjson.dumps({"choices": [
            {"index": 3, "text": "c x", "finish_reason": "length"},
            {"index": 0, "text": "a b y", "finish_reason": "length"},
        ], "usage": None}),
        0.0,
    )  # fmt: skip
    assert observer.outcome() == (None, None)
    assert observer.echoed_prompts() == ["a b", "c"]


# -- /completion (llama.cpp's native completion) -------------------------------------------

NATIVE = orjson.dumps({"prompt": "once upon", "n_predict": 5, "temperature": 0, "stream": True})
NATIVE_TIMES = [100.5, 100.625, 100.75, 100.875, 101.0, 101.125]


def test_a_native_completion_stream_is_measured_from_its_own_fields() -> None:
    """Real llama-server bytes (tests/fixtures/streams/llamacpp/README.md): a token an
    event, then the last object's stop_type, counts and timings; no [DONE], no usage."""
    reads = events("llamacpp/native_completion_stream.sse")
    m = run("/completion", NATIVE, reads, NATIVE_TIMES, 101.125)
    assert (m.endpoint, m.ttft, m.content_events, m.max_tokens) == ("/completion", 0.5, 5, 5)
    assert (m.output_tokens, m.prompt_tokens, m.cached_prompt_tokens) == (5, 3, 0)
    assert (m.token_source, m.finish_reason, m.raw_finish_reason) == (
        TokenSource.ENGINE,
        "length",
        "limit",
    )
    assert m.error_type is None and m.response_model == "tiny"
    assert m.engine is not None and m.engine.time_to_first_token == 0.000481
    reads, times = byte_at_a_time(reads, NATIVE_TIMES)
    assert run("/completion", NATIVE, reads, times, 101.125) == m
    cut = run(
        "/completion",
        NATIVE,
        events("llamacpp/native_completion_stream.sse")[:3],
        NATIVE_TIMES[:3],
        101.0,
    )
    assert (cut.error_type, cut.content_events) == (ErrorType.STREAM_TRUNCATED, 3)


def test_a_native_completion_answered_whole_gives_its_counts_and_finish() -> None:
    body = (STREAMS / "llamacpp" / "native_completion.json").read_bytes()
    info, _ = parse_request("/completion", orjson.dumps({"prompt": "once upon", "n_predict": 5}))
    observer = StreamObserver(info, start=START)
    observer.open(200, "application/json; charset=utf-8", OPENED)
    observer.feed(body, 100.5)
    m = asyncio.run(
        observer.finish(
            end=100.5, started_at=0.0, status_code=200, error_type=None, error_message=None
        )
    )
    assert (m.stream, m.output_tokens, m.prompt_tokens, m.finish_reason) == (False, 5, 3, "length")
    assert m.token_source is TokenSource.ENGINE and m.ttft is None


def test_a_native_completion_of_two_prompts_adds_their_counts_up() -> None:
    """Real bytes (--parallel 2): `data: null`, then both prompts' events interleaved, each
    with its index and its own last object; as /v1/completions' batch (test_llamacpp)."""
    reads = events("llamacpp/native_completion_batch_stream.sse")
    times = [100.5 + 0.125 * i for i in range(len(reads))]
    body = orjson.dumps({"prompt": ["hello there", "once upon"], "n_predict": 3, "stream": True})
    m = run("/completion", body, reads, times, times[-1])
    assert (m.output_tokens, m.prompt_tokens, m.token_source) == (6, 7, TokenSource.ENGINE)
    assert (m.finish_reasons, m.error_type, m.malformed_events) == (("length", "length"), None, 0)
    assert m.engine is not None and m.engine.time_to_first_token == 0.005614  # index 1's: first


def test_a_native_completion_of_two_prompts_cut_after_the_first_is_truncated() -> None:
    """With one slot llama-server runs the prompts one after another: a stream cut after
    the first prompt's last object has every finish it streamed, and is still short of
    the second prompt's (it read as whole)."""
    reads = events("llamacpp/native_completion_stream.sse")  # prompt 0, whole
    body = orjson.dumps({"prompt": ["once upon", "a time"], "n_predict": 5, "stream": True})
    m = run("/completion", body, reads, NATIVE_TIMES, NATIVE_TIMES[-1])
    assert (m.error_type, m.output_tokens) == (ErrorType.STREAM_TRUNCATED, 5)
    whole = run("/completion", NATIVE, reads, NATIVE_TIMES, NATIVE_TIMES[-1])
    assert whole.error_type is None  # one prompt: its last object ends it
