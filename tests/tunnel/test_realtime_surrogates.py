"""A realtime client event that `json.loads` reads with a lone surrogate ("\\ud800"), through
the tunnel (the test listener, tests/ws_proxy.py) in front of the echo upstream
(tests/ws_upstream.py), whose echoes of the client's frames play vLLM's answers.

vLLM 0.32 (realtime/connection.py:76-78, 115, 163, 280-283) answers an event whose answer
would quote the surrogate (a session.update's model_not_found names the model, an
unknown_event names the type) with a processing_error: pydantic's `model_dump_json()` of
that answer raises PydanticSerializationError ("surrogates not allowed"). The utterance in
flight runs on, under the model taken before; the proxy once labelled it with the model
holding the surrogate and ended it at that processing_error as a stream_error."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator

import pytest
from websockets.asyncio.client import connect

from proxy.core.measurement import ErrorType, Measurement
from tests.ws_proxy import TunnelListener
from tests.ws_upstream import EchoUpstream

AUDIO = base64.b64encode(b"\0\0" * 1600).decode()  # 0.1 s of PCM16 at 16 kHz
#: vLLM's answer to such an event (the pydantic error's text, as connection.py:78 sends it)
ANSWER = "Error serializing to JSON: UnicodeEncodeError: surrogates not allowed"


@pytest.fixture(scope="module")
def listener() -> Iterator[TunnelListener]:
    upstream = EchoUpstream().start()
    started = TunnelListener(upstream.url.replace("ws://", "http://")).start()
    yield started
    started.stop()
    upstream.stop()


def _text(**event: object) -> str:
    return json.dumps(event)


def _session(url: str, odd_event: str, at: int) -> None:
    """An utterance under `whisper`, with the odd event and vLLM's processing_error for it
    `at` the given place among the client's events (before its commit, or while it
    generates); then its delta and done. Each frame the client sends comes back from the
    echo upstream as the server's."""
    frames = [
        _text(type="session.update", model="whisper"),
        _text(type="input_audio_buffer.append", audio=AUDIO),
        _text(type="input_audio_buffer.commit"),  # the generation starts
        _text(type="input_audio_buffer.commit", final=True),
        _text(type="transcription.delta", delta="hi"),
        _text(
            type="transcription.done",
            text="hi",
            usage={"prompt_tokens": 9, "total_tokens": 10, "completion_tokens": 1},
        ),
    ]
    # vLLM's answer right after it
    frames[at:at] = [odd_event, _text(type="error", error=ANSWER, code="processing_error")]

    async def run() -> None:
        async with connect(url + "/v1/realtime", compression=None) as ws:
            for frame in frames:
                await ws.send(frame)
                assert await asyncio.wait_for(ws.recv(), 10) == frame

    asyncio.run(asyncio.wait_for(run(), 30))


def _records(listener: TunnelListener, n: int) -> list[Measurement]:
    """The records once the session has ended, waiting up to a second after its end for
    the n-th (the records of an utterance its close cut are made just after it leaves)."""
    deadline = time.monotonic() + 10
    while listener.open_tunnels():
        assert time.monotonic() < deadline, "the session did not end"
        time.sleep(0.01)
    deadline = time.monotonic() + 1
    while len(listener.recorder.records) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(listener.recorder.records)


@pytest.mark.parametrize(
    "odd_event",
    [
        '{"type":"session.update","model":"whisper\\ud800"}',
        '{"type":"input_audio_buffer.\\udfffappend"}',
    ],
    ids=["model", "type"],
)
@pytest.mark.parametrize("at", [2, 3], ids=["before_the_commit", "while_generating"])
def test_an_event_whose_answer_would_quote_a_lone_surrogate_is_a_refusal_of_its_own(
    listener: TunnelListener, odd_event: str, at: int
) -> None:
    before = len(listener.recorder.records)
    _session(listener.url, odd_event, at)
    records = _records(listener, before + 2)[before:]
    assert len(records) == 2, records
    refused, spoken = records
    assert (refused.error_type, refused.error_message) == (
        ErrorType.BAD_REQUEST,
        "processing_error: " + ANSWER,
    )
    assert spoken.ok and spoken.output_tokens == 1, spoken
    assert refused.model == spoken.model == "whisper"
