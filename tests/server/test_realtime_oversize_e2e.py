"""A realtime message over `--max-event-bytes` through `tokenprobe serve`: relayed, skipped
by the measuring, and the session's utterances are still recorded.

vLLM takes a WebSocket message up to uvicorn's `ws_max_size` (16 MiB), so an
`input_audio_buffer.append` of minutes of audio is transcribed; once, such a message made
the proxy stop watching the session (`stage="ws_frames"`), and none of its utterances was
recorded. Here the bound is 64 KiB so the oversized append is 3 s of audio, not 98; the
client speaks with and without permessage-deflate (websockets' default: context takeover).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from proxy.sim import SimApp
from tests.server.conftest import paths
from tests.server.test_apis_more_e2e import (
    MODEL,
    PROGRAM,
    Proxy,
    pcm_b64,
    realtime_url,
    recording_sim,
    speak,
)
from tests.servers import stop

BOUND = 64 * 1024
FAILURES = "tokenprobe_measurement_failures_total"


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[str, SimApp]]:
    with recording_sim() as running:
        yield running


@pytest.fixture(scope="module")
def proxy(sim: tuple[str, SimApp], relay: str) -> Iterator[Proxy]:
    running = Proxy(sim[0], "--max-event-bytes", str(BOUND))
    try:
        yield running
    finally:
        stop(running.process)


def _append(seconds: float) -> str:
    return orjson.dumps({"type": "input_audio_buffer.append", "audio": pcm_b64(seconds)}).decode()


@paths("wire", why="the wire tunnels WebSockets; the ASGI app refuses them")
@pytest.mark.parametrize("compression", ["deflate", None])
def test_an_append_over_the_bound_costs_its_audio_not_the_session(
    sim: tuple[str, SimApp], proxy: Proxy, compression: str | None
) -> None:
    from websockets.sync.client import connect

    big = _append(3.0)  # 128 KB of base64: almost twice the bound
    assert len(big) > 1.9 * BOUND
    n = len(proxy.lines) + 1
    audio = "tokenprobe_audio_input_seconds_total"
    before = proxy.metric(audio, endpoint="/v1/realtime", model=MODEL)
    skipped = proxy.metric(FAILURES, stage="ws_message_too_large")
    received: list[str] = []
    with connect(
        realtime_url(proxy), additional_headers=PROGRAM, compression=compression, max_size=None
    ) as ws:
        assert bool(ws.response.headers.get("sec-websocket-extensions")) == bool(compression)
        received.append(ws.recv(timeout=10))  # session.created
        ws.send(orjson.dumps({"type": "session.update", "model": MODEL}).decode())
        ws.send(_append(0.5))
        ws.send(big)
        ws.send('{"type":"input_audio_buffer.commit"}')
        ws.send('{"type":"input_audio_buffer.commit","final":true}')
        while '"transcription.done"' not in (text := ws.recv(timeout=10)):
            received.append(text)
        received.append(text)
        speak(ws, received)  # a second utterance, all under the bound
    assert received == sim[1].realtime_sessions[-1].sent  # every frame as the backend sent it
    records: list[dict[str, Any]] = [proxy.record(n), proxy.record(n + 1)]
    for m in records:
        assert (m["endpoint"], m["model"], m["error_type"]) == ("/v1/realtime", MODEL, None)
        assert (m["output_tokens"], m["token_source"]) == (8, "usage")
    assert proxy.metric(FAILURES, stage="ws_message_too_large") - skipped == 1
    assert proxy.metric(FAILURES, stage="ws_frames") == 0
    # The skipped append's 3 s are unknown to the proxy: the figure is a lower bound (the
    # 0.5 s read before it, and the second utterance's 1 s), as docs/apis.md says.
    assert proxy.metric(audio, endpoint="/v1/realtime", model=MODEL) - before == 1.5
