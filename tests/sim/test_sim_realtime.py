"""The simulator's /v1/realtime read as vLLM 0.32 reads a client's events
(vllm/entrypoints/speech_to_text/realtime/connection.py and protocol.py).

Each expectation was checked against vLLM's own RealtimeConnection, unmodified, behind a
stub engine under uvicorn (its `ws` auto: websockets-sansio), with the websockets client
used here: the error texts are what it sent."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from proxy.sim import SimConfig
from proxy.sim.realtime import pcm16_bytes
from tests.sim.test_sim_support import running

PCM = base64.b64encode(b"\1\0" * 1600).decode()  # 0.1 s of PCM16 at 16 kHz
FAST = {"x-sim-ttft": "0", "x-sim-tps": "1000", "x-sim-output-tokens": "2"}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running(SimConfig(models=("sim-model",))) as (server, _):
        yield server.url.replace("http://", "ws://") + "/v1/realtime"


async def replies(ws: ClientConnection, quiet: float = 0.3) -> list[Any]:
    """What the server sends until it is quiet for `quiet` s, or the close."""
    got: list[Any] = []
    try:
        while True:
            got.append(json.loads(await asyncio.wait_for(ws.recv(), quiet)))
    except TimeoutError:
        pass
    except ConnectionClosed as closed:
        got.append(("closed", closed.rcvd.code if closed.rcvd else None))
    return got


async def session(url: str, *events: Any) -> list[Any]:
    async with connect(url, additional_headers=FAST) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        for event in events:
            await ws.send(event if isinstance(event, bytes) else json.dumps(event))
        return await replies(ws)


def kinds(got: list[Any]) -> list[Any]:
    return [g["type"] if isinstance(g, dict) else g for g in got]


VALIDATE = {"type": "session.update", "model": "sim-model"}
COMMIT = {"type": "input_audio_buffer.commit"}
APPEND = {"type": "input_audio_buffer.append", "audio": PCM}


@pytest.mark.parametrize("final", [True, 1, 1.0, "true", "yes", "On"])
def test_a_final_commit_is_read_as_pydantic_reads_a_bool(url: str, final: Any) -> None:
    """protocol.py:26 `final: bool`, validated in lax mode (connection.py:156)."""
    got = asyncio.run(session(url, VALIDATE, COMMIT, APPEND, {**COMMIT, "final": final}))
    assert kinds(got) == ["transcription.delta"] * 2 + ["transcription.done"]


@pytest.mark.parametrize(
    ("final", "error"),
    [
        (
            "maybe",
            "Input should be a valid boolean, unable to interpret input [type=bool_parsing, "
            "input_value='maybe', input_type=str]",
        ),
        (
            2,
            "Input should be a valid boolean, unable to interpret input [type=bool_parsing, "
            "input_value=2, input_type=int]",
        ),
        (None, "Input should be a valid boolean [type=bool_type, input_value=None, "),
    ],
)
def test_a_final_pydantic_refuses_is_a_processing_error(url: str, final: Any, error: str) -> None:
    got = asyncio.run(session(url, VALIDATE, COMMIT, APPEND, {**COMMIT, "final": final}))
    errors = [g for g in got if g["type"] == "error"]
    assert [e["code"] for e in errors] == ["processing_error"]
    assert errors[0]["error"].startswith("1 validation error for InputAudioBufferCommit\nfinal\n")
    assert error in errors[0]["error"]
    assert "transcription.done" not in kinds(got)  # the audio is not over


@pytest.mark.parametrize(
    ("audio", "size"),
    [  # pybase64 1.5.1, validate=False, then np.frombuffer(int16): what vLLM sent back
        (base64.encodebytes(b"\1\0" * 1600).decode(), 3200),  # wrapped at 76, "\n"s
        ("!!AQA=", 2),
        (" AQA= ", 2),
        ("AQA==", 2),
        ("AQA=\r\nAQA=", None),
        ("AQA", None),
        ("", None),
        ("====", None),
        ("AQ==", None),  # one byte: no int16
        ("AQAB", None),
        ("AQA=AQA=", None),
        ("é AQA=", None),
    ],
)
def test_audio_is_decoded_as_pybase64_decodes_it(audio: str, size: int | None) -> None:
    assert pcm16_bytes(audio) == size


def test_wrapped_base64_is_audio_and_an_odd_byte_is_not(url: str) -> None:
    wrapped = {**APPEND, "audio": base64.encodebytes(b"\1\0" * 1600).decode()}
    odd = {**APPEND, "audio": "AQ=="}
    final = {**COMMIT, "final": True}
    got = asyncio.run(session(url, VALIDATE, wrapped, odd, COMMIT, final))
    assert got[0] == {"type": "error", "error": "Invalid audio data", "code": "invalid_audio"}
    assert kinds(got[1:]) == ["transcription.delta"] * 2 + ["transcription.done"]
    assert got[-1]["usage"]["prompt_tokens"] == 4 + 5  # the wrapped 0.1 s: 5 of 20 ms


def test_audio_that_is_no_string_is_a_processing_error(url: str) -> None:
    got = asyncio.run(session(url, {**APPEND, "audio": 5}))
    assert [g["code"] for g in got] == ["processing_error"]
    assert got[0]["error"].startswith("1 validation error for InputAudioBufferAppend\naudio\n")
    assert "Input should be a valid string [type=string_type, input_value=5" in got[0]["error"]


@pytest.mark.parametrize("model", ["", 0, False])
def test_an_empty_model_validates_the_session(url: str, model: Any) -> None:
    """serve/engine/serving.py:86-88: `if not model_name: return True`."""
    got = asyncio.run(
        session(url, {**VALIDATE, "model": model}, COMMIT, APPEND, {**COMMIT, "final": True})
    )
    assert kinds(got) == ["transcription.delta"] * 2 + ["transcription.done"]


def test_a_null_model_is_still_missing(url: str) -> None:
    got = asyncio.run(session(url, {**VALIDATE, "model": None}, COMMIT))
    assert [g["code"] for g in got] == ["invalid_event", "model_not_validated"]


def test_a_binary_frame_ends_the_session_without_a_close_frame(url: str) -> None:
    """connection.py:70 `receive_text()` raises KeyError on it (starlette websockets.py:127),
    outside the per-event try: the session ends, no close frame, the client sees 1006."""
    got = asyncio.run(session(url, VALIDATE, b"\x00\x01", {"type": "bogus"}))
    assert got == [("closed", None)]


def serialization_error(text: str) -> str:
    """pydantic's error for a string with a lone surrogate, as vLLM's ErrorEvent raised it
    (pydantic 2.14: Python's own UnicodeEncodeError text, checked in vLLM's venv)."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return f"Error serializing to JSON: UnicodeEncodeError: {exc}"
    raise AssertionError(f"{text!r} encodes")


def test_an_answer_holding_a_lone_surrogate_is_a_processing_error(url: str) -> None:
    """json.loads keeps a "\\ud800" escape as a lone surrogate; the answer naming it cannot
    be written (ErrorEvent.model_dump_json raises), and vLLM's per-event handler answers
    that as a processing_error (connection.py:76-78). The session goes on."""
    got = asyncio.run(
        session(url, {**VALIDATE, "model": "\ud800x"}, {"type": "\udfff"}, VALIDATE, COMMIT)
    )
    assert got[:2] == [
        {
            "type": "error",
            "error": serialization_error("The model `\ud800x` does not exist."),
            "code": "processing_error",
        },
        {
            "type": "error",
            "error": serialization_error("Unknown event type: \udfff"),
            "code": "processing_error",
        },
    ]
    assert "position 11" in got[0]["error"]  # as vLLM 0.32 sent it: the index in the text
    assert kinds(got[2:]) == ["transcription.delta"] * 2


def test_an_upgrade_without_the_key_is_vllms_http_401() -> None:
    """vLLM's AuthenticationMiddleware guards upgrades under /v1 as it guards requests
    (serve/middleware/authenticate.py): the handshake gets its 401 JSON answer (checked
    against vLLM 0.32's middleware under uvicorn); the key itself opens the session."""

    async def handshake(url: str, key: str | None) -> tuple[int, bytes]:
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        try:
            async with connect(url, additional_headers=headers) as ws:
                return 101, (await ws.recv()).encode()
        except InvalidStatus as refused:
            return refused.response.status_code, bytes(refused.response.body or b"")

    with running(SimConfig(models=("sim-model",), api_key="good")) as (server, app):
        base = server.url.replace("http://", "ws://")
        for key in ("made-up", None):
            got = asyncio.run(handshake(base + "/v1/realtime", key))
            assert got == (401, b'{"error":"Unauthorized"}'), key
        assert asyncio.run(handshake(base + "/v1/other", "made-up"))[0] == 401  # before routing
        assert asyncio.run(handshake(base + "/other", "made-up"))[0] == 403  # not guarded
        status, first = asyncio.run(handshake(base + "/v1/realtime", "good"))
        assert (status, json.loads(first)["type"]) == (101, "session.created")
        assert len(app.realtime_sessions) == 1
