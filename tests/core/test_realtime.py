"""The /v1/realtime seam I/O-free: recorded frames (vLLM's event shapes and flow,
realtime/protocol.py @ c6088cb14ab5, connection.py @ 8ba6842cb276) fed as WsMessages with synthetic read times, compared with the records it
must give: one per utterance, plus the session's own figures."""

from __future__ import annotations

import base64

import orjson
import pytest

from proxy.core.apis.realtime import RealtimeSession
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.wsframes import WsMessage
from proxy.core.wsseam import ws_api_for

START = 100.0
AUDIO = base64.b64encode(b"\0\0" * 16_000).decode()  # one second of PCM16 at 16 kHz


def c(at: float, **event: object) -> WsMessage:
    return WsMessage(True, "text", orjson.dumps(event), at)


def s(at: float, **event: object) -> WsMessage:
    return WsMessage(False, "text", orjson.dumps(event), at)


def session(query: str = "model=whisper") -> tuple[RealtimeSession, list[Measurement]]:
    api = ws_api_for("/v1/realtime")
    assert api is not None and api.endpoint == "/v1/realtime"
    records: list[Measurement] = []
    return api.open(
        start=START, started_at=1e9, path="/v1/realtime", query=query, record=records.append
    ), records


def utterance(t: float, text: str) -> list[WsMessage]:
    """Half a second of audio, the commit that starts the generation, the other half, the
    final commit, then vLLM's deltas (one empty) and done."""
    usage = {"prompt_tokens": 50, "total_tokens": 53, "completion_tokens": 3}
    cut = len(AUDIO) // 16 * 8  # 8 characters, 6 bytes: whole samples, as vLLM wants them
    half = AUDIO[:cut]
    return [
        c(t, type="input_audio_buffer.append", audio=half),
        c(t + 0.125, type="input_audio_buffer.commit"),
        c(t + 0.125, type="input_audio_buffer.append", audio=AUDIO[cut:]),
        c(t + 0.125, type="input_audio_buffer.commit", final=True),
        s(t + 0.25, type="transcription.delta", delta=""),  # empty: no token
        s(t + 0.5, type="transcription.delta", delta=text),
        s(t + 0.625, type="transcription.delta", delta=" a"),
        s(t + 0.75, type="transcription.delta", delta=" b"),
        s(t + 0.875, type="transcription.done", text=text + " a b", usage=usage),
    ]


def test_three_utterances_give_three_records_and_the_session_figures() -> None:
    sess, records = session()
    frames = [
        s(100.0, type="session.created", id="sess-1", created=1),
        c(100.0, type="session.update", model="whisper-v3"),
    ]
    for t in (101.0, 102.0, 103.0):
        frames += utterance(t, "hi")
    for frame in frames:
        sess.message(frame)
    sess.close(104.0, "closed_by_client")
    assert len(records) == 3
    for m in records:
        assert (m.endpoint, m.model, m.ok, m.response_id) == (
            "/v1/realtime",
            "whisper-v3",
            True,
            "sess-1",
        )
        assert m.ttft == 0.375 and m.e2e == 0.75 and m.tpot == 0.125  # from the commit
        # each gap between non-empty deltas, as an HTTP stream's content events give them
        assert m.inter_token_latencies == (0.125, 0.125)
        assert (m.prompt_tokens, m.output_tokens, m.token_source) == (50, 3, TokenSource.USAGE)
        assert m.audio_seconds == 1.0
    assert (sess.utterances, sess.audio_seconds, sess.duration) == (3, 3.0, 4.0)


def test_an_error_event_ends_the_open_utterance_as_a_stream_error() -> None:
    sess, records = session()
    for frame in utterance(101.0, "x")[:6]:
        sess.message(frame)
    sess.message(s(101.6, type="error", error="decoder failed", code="processing_error"))
    sess.close(102.0, "closed_by_upstream")
    (m,) = records
    assert (
        m.error_type is ErrorType.STREAM_ERROR
        and m.error_message == "processing_error: decoder failed"
    )
    assert m.ttft == 0.375 and (m.output_tokens, m.token_source) == (1, TokenSource.CHUNKS)


@pytest.mark.parametrize(
    ("cause", "error"),
    [
        ("client_vanished", ErrorType.CLIENT_CANCELLED),  # as an HTTP client that hangs up
        ("closed_by_client", ErrorType.CLIENT_CANCELLED),
        ("upstream_vanished", ErrorType.STREAM_TRUNCATED),
        ("closed_by_upstream", ErrorType.STREAM_TRUNCATED),
        ("idle_timeout", ErrorType.STREAM_TRUNCATED),
    ],
)
def test_a_session_cut_mid_utterance_records_who_cut_it(cause: str, error: ErrorType) -> None:
    sess, records = session()
    for frame in utterance(101.0, "x")[:7]:
        sess.message(frame)
    sess.close(101.75, cause)
    (m,) = records
    assert m.error_type is error and cause in (m.error_message or "")
    assert m.e2e == 0.625 and m.output_tokens == 2


def test_a_commit_while_a_generation_runs_is_ignored_as_vllm_ignores_it() -> None:
    sess, records = session()
    frames = utterance(101.0, "y")
    for frame in [*frames[:2], c(101.2, type="input_audio_buffer.commit"), *frames[2:]]:
        sess.message(frame)
    sess.close(102.0, "closed_by_client")
    (m,) = records
    assert m.ok and m.ttft == 0.375


def test_client_side_errors_are_records_of_their_own_and_open_no_utterance() -> None:
    sess, records = session()
    sess.message(c(101.0, type="input_audio_buffer.commit"))
    sess.message(s(101.0, type="error", error="Model not validated.", code="model_not_validated"))
    sess.message(c(101.1, type="session.update", model="nope"))
    sess.message(
        s(101.1, type="error", error="The model `nope` does not exist.", code="model_not_found")
    )
    sess.message(WsMessage(True, "text", b"{oops", 101.2))
    sess.message(s(101.2, type="error", error="Invalid JSON", code="invalid_json"))
    sess.close(102.0, "closed_by_client")
    assert [m.error_type for m in records] == [
        ErrorType.BAD_REQUEST,
        ErrorType.NOT_FOUND,
        ErrorType.BAD_REQUEST,
    ]
    assert sess.utterances == 0 and sess.malformed == 1


def test_frames_that_are_not_json_objects_are_counted_and_ignored() -> None:
    sess, records = session()
    sess.message(WsMessage(True, "text", b"{not json", 101.0))
    sess.message(WsMessage(False, "text", b"[1]", 101.0))
    sess.message(WsMessage(True, "binary", b"\x00\x01", 101.0))
    sess.close(101.5, "closed_by_client")
    assert records == [] and sess.malformed == 2


def test_vllms_answer_to_a_client_event_it_refuses_leaves_the_utterance_open() -> None:
    """vLLM answers any client event its models refuse (an append without a string
    `audio`) with a `processing_error`, as it does a failed generation, and the generation
    runs on (connection.py, handle_connection): that error is a bad request of its own, and
    the utterance still ends with its done and usage."""
    sess, records = session()
    frames = utterance(101.0, "hi")
    sess.message(frames[0])
    sess.message(frames[1])  # the commit: the generation starts
    sess.message(c(101.2, type="input_audio_buffer.append"))  # no audio: refused
    sess.message(s(101.2, type="error", error="1 validation error", code="processing_error"))
    for frame in frames[2:]:
        sess.message(frame)
    sess.close(102.0, "closed_by_client")
    refused, spoken = records
    assert refused.error_type is ErrorType.BAD_REQUEST
    assert refused.error_message == "processing_error: 1 validation error"
    assert spoken.ok and spoken.ttft == 0.375
    assert (spoken.prompt_tokens, spoken.output_tokens, spoken.token_source) == (
        50,
        3,
        TokenSource.USAGE,
    )
    assert sess.utterances == 1


def test_a_refused_commit_before_any_model_was_validated_is_answered_model_not_validated() -> None:
    """vLLM checks that a model was validated before it reads a commit's fields
    (connection.py, handle_event): a commit whose `final` it could not read, sent before
    any session.update, gets model_not_validated, never a processing_error. That answer
    settles it, so a later generation's processing_error ends that generation (it was
    taken for the commit's answer, and the utterance ran on to the session's close)."""
    sess, records = session()
    sess.message(c(100.5, type="input_audio_buffer.commit", final="maybe"))
    text = "Model not validated. Make sure to validate the model by sending a session.update event."
    sess.message(s(100.5, type="error", error=text, code="model_not_validated"))
    sess.message(c(101.0, type="session.update", model="whisper"))
    sess.message(c(101.0, type="input_audio_buffer.append", audio=AUDIO))
    sess.message(c(101.5, type="input_audio_buffer.commit"))
    sess.message(s(102.0, type="transcription.delta", delta="hi"))
    sess.message(s(103.5, type="error", error="CUDA error", code="processing_error"))
    sess.close(110.0, "closed_by_client")
    refused, failed = records
    assert refused.error_type is ErrorType.BAD_REQUEST
    assert (failed.error_type, failed.ttft, failed.e2e) == (ErrorType.STREAM_ERROR, 0.5, 2.0)


def test_final_is_read_as_vllms_models_read_it() -> None:
    """`final` as pydantic reads a bool (vLLM validates leniently): `"true"` or `1` is a
    final commit, which starts no generation; a value it refuses starts none either, and
    its processing_error is that commit's, not a generation's."""
    for final in ("true", 1, "yes", True):
        sess, records = session()
        sess.message(c(101.0, type="input_audio_buffer.commit", final=final))
        sess.message(c(102.0, type="input_audio_buffer.commit"))  # the real start
        sess.message(s(102.25, type="transcription.delta", delta="x"))
        sess.message(s(102.5, type="transcription.done", text="x"))
        (m,) = records
        assert m.ttft == 0.25, final
    sess, records = session()
    sess.message(c(101.0, type="input_audio_buffer.commit", final="maybe"))
    sess.message(s(101.0, type="error", error="bad bool", code="processing_error"))
    sess.close(101.5, "closed_by_client")
    (m,) = records
    assert m.error_type is ErrorType.BAD_REQUEST and sess.utterances == 0


def test_a_model_that_is_no_name_is_vllms_to_answer_and_a_later_failure_is_the_utterances() -> None:
    """vLLM checks session.update's model as sent (connection.py, handle_event): 123 is
    model_not_found, 0 passes; neither is a refused event that a processing_error answers,
    so a generation's processing_error later still ends its utterance as a stream error."""
    sess, records = session()
    sess.message(c(101.0, type="session.update", model=123))
    sess.message(
        s(101.0, type="error", error="The model `123` does not exist.", code="model_not_found")
    )
    sess.message(c(101.05, type="session.update", model=0))  # passes: no answer
    frames = utterance(101.1, "hi")
    for frame in frames[:5]:  # up to the empty delta
        sess.message(frame)
    sess.message(s(101.4, type="error", error="generation failed", code="processing_error"))
    sess.close(102.0, "closed_by_client")
    refused, failed = records
    assert (refused.error_type, refused.model) == (ErrorType.NOT_FOUND, "whisper")
    assert failed.error_type is ErrorType.STREAM_ERROR
    assert failed.e2e == pytest.approx(101.4 - 101.225)  # from its commit to the error
    assert sess.utterances == 1


def test_a_client_frame_that_is_json_but_no_event_is_answered_and_the_utterance_goes_on() -> None:
    """vLLM reads a client frame with json.loads and calls `event.get`: `[]` or `"x"` fails
    there and is answered with a processing_error while the generation runs on; NaN, which
    orjson refuses, is JSON to vLLM, so a commit carrying one starts a generation."""
    sess, records = session()
    frames = utterance(101.0, "hi")
    frames[1] = WsMessage(True, "text", b'{"type":"input_audio_buffer.commit","x":NaN}', 101.125)
    for frame in frames[:5]:
        sess.message(frame)
    for odd in (b"[]", b'"x"', b"null"):
        sess.message(WsMessage(True, "text", odd, 101.3))
        sess.message(s(101.3, type="error", error="no .get", code="processing_error"))
    for frame in frames[5:]:
        sess.message(frame)
    sess.close(102.0, "closed_by_client")
    *answers, spoken = records
    assert [m.error_type for m in answers] == [ErrorType.BAD_REQUEST] * 3
    assert spoken.ok and spoken.ttft == 0.375 and spoken.output_tokens == 3
    assert sess.malformed == 3  # the three frames that are no event; the NaN one is one


def test_a_model_vllm_refused_does_not_label_the_utterances_after_it() -> None:
    """vLLM answers a session.update it refuses with model_not_found and keeps the model
    it had; one it takes gets no answer. The utterance is labelled with the last model
    taken before its commit."""
    sess, records = session()
    sess.message(c(100.5, type="session.update", model="whisper-large"))  # taken
    sess.message(c(100.6, type="session.update", model="gpt-4o-transcribe"))  # refused
    frames = utterance(101.0, "hi")
    sess.message(frames[0])
    sess.message(frames[1])  # the commit comes before vLLM's answer to the update
    sess.message(
        s(101.2, type="error", error="The model `gpt-4o-transcribe` does not exist.",
          code="model_not_found")
    )  # fmt: skip
    for frame in frames[2:]:
        sess.message(frame)
    sess.message(c(103.0, type="session.update", model="whisper-small"))  # after: not its
    sess.close(104.0, "closed_by_client")
    refused, spoken = records
    assert (refused.error_type, refused.model) == (ErrorType.NOT_FOUND, "gpt-4o-transcribe")
    assert spoken.ok and spoken.model == "whisper-large"
    assert sess.model == "whisper-large"


@pytest.mark.parametrize(
    "odd",
    [
        b"\xef\xbb\xbf" + orjson.dumps({"type": "input_audio_buffer.commit"}),  # a UTF-8 BOM
        '{"type":"input_audio_buffer.commit"}'.encode("utf-16-le"),
    ],
    ids=["bom", "utf-16"],
)
def test_a_commit_vllm_reads_as_no_json_opens_no_utterance(odd: bytes) -> None:
    """vLLM reads a client frame as text and `json.loads` that str (connection.py,
    handle_connection), which refuses a BOM and UTF-16 (invalid_json). `json.loads` of
    the bytes takes both: such a commit opened the utterance and its TTFT ran from it."""
    sess, records = session()
    sess.message(c(100.5, type="session.update", model="whisper"))
    sess.message(WsMessage(True, "text", odd, 101.0))
    sess.message(s(101.0, type="error", error="Invalid JSON", code="invalid_json"))
    sess.message(c(102.0, type="input_audio_buffer.commit"))  # the real start
    sess.message(s(102.25, type="transcription.delta", delta="x"))
    sess.message(s(102.5, type="transcription.done", text="x"))
    refused, spoken = records
    assert refused.error_type is ErrorType.BAD_REQUEST
    assert spoken.ok and spoken.ttft == 0.25 and spoken.e2e == 0.5
    assert sess.malformed == 1


def test_a_refused_model_that_is_no_name_leaves_the_name_taken_before_it() -> None:
    """vLLM takes `whisper-large` and refuses 123 (model_not_found, naming `123`): the
    refusal names no model the session tracks, so none of them is refused. It once fell
    back to the oldest one, `whisper-large`, and the utterance was labelled with the
    query's model (or nothing)."""
    sess, records = session("")
    sess.message(c(100.5, type="session.update", model="whisper-large"))
    sess.message(c(100.6, type="session.update", model=123))
    sess.message(
        s(100.6, type="error", error="The model `123` does not exist.", code="model_not_found")
    )
    for frame in utterance(101.0, "hi"):
        sess.message(frame)
    refused, spoken = records
    assert refused.error_type is ErrorType.NOT_FOUND
    assert spoken.ok and spoken.model == "whisper-large"


def test_audio_vllm_refuses_is_not_counted_and_its_characters_are_counted_as_pybase64s() -> None:
    """vLLM decodes `audio` with pybase64, which drops characters outside the alphabet,
    and refuses what decodes to nothing, to an odd number of bytes (no PCM16 sample) or
    with bad padding (invalid_audio; nothing is queued). Once every character counted:
    640,000 `!` were 16 s of audio."""
    sess, records = session()
    for refused in ("!" * 640_000, "", "AA==", "AAAA", "AAAAAA", "AAAAA", "AAAAé"):
        sess.message(c(100.5, type="input_audio_buffer.append", audio=refused))
    wrapped = "\n".join(AUDIO[i : i + 76] for i in range(0, len(AUDIO), 76))  # MIME lines
    sess.message(c(100.6, type="input_audio_buffer.append", audio=wrapped))
    sess.message(c(100.7, type="input_audio_buffer.append", audio="AAA="))  # one sample
    sess.message(c(101.0, type="input_audio_buffer.commit"))
    sess.message(s(101.5, type="transcription.done", text=""))
    (m,) = records
    assert m.audio_seconds == sess.audio_seconds == 1.0 + 2 / 32_000


@pytest.mark.parametrize(
    ("query", "model"),
    [
        ("model=openai%2Fwhisper-large-v3", "openai/whisper-large-v3"),
        ("x=1&model=my+model", "my model"),
        ("model=a&model=b", "b"),  # the last, as starlette's query_params.get
        ("mode%6C=whisper", "whisper"),
    ],
)
def test_the_querys_model_is_read_as_starlette_reads_it(query: str, model: str) -> None:
    """The session's model from `?model=`, decoded as starlette's query_params decode it
    (parse_qsl): a name a client's URL builder percent-encoded is labelled as named, not
    as `openai%2Fwhisper-large-v3`."""
    sess, records = session(query)
    for frame in utterance(101.0, "hi"):
        sess.message(frame)
    (m,) = records
    assert m.model == model
