"""A realtime session's spans end to end: a `websockets` client -> `tokenprobe serve` (its
wire tunnels the upgrade) -> the simulator's /v1/realtime, spans exported over OTLP/HTTP
to a real receiver, all on loopback.

Each utterance is one CLIENT span, as each measured HTTP request is (docs/index.md: "each
utterance of a WebSocket session on /v1/realtime: one record each, for metrics, a span and
a log line"). Before, the tunnel's records reached the log and the metrics, never the
tracer."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from websockets.sync.client import ClientConnection, connect

from proxy.sim import SimApp, SimConfig
from tests.otlp_receiver import SPAN_KIND_CLIENT, OtlpReceiver, ReceivedSpan
from tests.server.conftest import paths
from tests.servers import free_port, serve, spawn, stop, wait_http

MODEL = "sim-model"
TTFT = 0.25
PROGRAM = {"x-sim-ttft": str(TTFT), "x-sim-tps": "100", "x-sim-output-tokens": "4"}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SECRET = "sk-realtime-e2e-SECRET-0123456789"

pytestmark = paths("wire", why="only the wire tunnels WebSockets; the ASGI app refuses them")


@pytest.fixture
def collector() -> Iterator[tuple[OtlpReceiver, str]]:
    receiver = OtlpReceiver()
    with serve(receiver) as server:
        yield receiver, server.url


@pytest.fixture
def sim_url() -> Iterator[str]:
    app = SimApp(SimConfig(models=(MODEL,), ttft=0.05, tokens_per_second=200.0))
    with serve(app) as server:
        yield server.url


def _utterance(ws: ClientConnection) -> None:
    """Half a second of audio, its commit, the final commit; read up to its done."""
    audio = base64.b64encode(b"\0\0" * 8000).decode()
    ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
    ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
    while True:
        event = json.loads(ws.recv(timeout=30))
        assert event["type"] != "error", event
        if event["type"] == "transcription.done":
            return


def test_each_utterance_is_a_span_in_the_client_s_trace(
    sim_url: str, collector: tuple[OtlpReceiver, str], tmp_path: Path
) -> None:
    receiver, url = collector
    port = free_port()
    log_path = tmp_path / "access.log"
    with log_path.open("wb") as log_file:
        process = spawn(
            "serve", "--upstream", sim_url, "--port", str(port), "--models-refresh", "0",
            "--model-allowlist", MODEL, "--access-log", "json",
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_BSP_SCHEDULE_DELAY": "50"},
            stdout=log_file.fileno(),
        )  # fmt: skip
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz")
            headers = {
                **PROGRAM,
                "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
                "authorization": f"Bearer {SECRET}",
            }
            with connect(f"ws://127.0.0.1:{port}/v1/realtime", additional_headers=headers) as ws:
                assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
                ws.send(json.dumps({"type": "session.update", "model": MODEL}))
                _utterance(ws)
                _utterance(ws)
            spans = receiver.wait_for(lambda found: len(found) >= 2, timeout=30)
        finally:
            stop(process)
    lines = [orjson.loads(line) for line in log_path.read_bytes().splitlines()]
    records = [line for line in lines if "kind" not in line]  # not the session's line
    assert len(records) == 2, lines
    assert len(spans) == 2, [s.name for s in spans]
    for span, record in zip(sorted(spans, key=_start), records, strict=True):
        _check(span, record)


def _start(span: ReceivedSpan) -> int:
    return span.start_time_unix_nano


def _check(span: ReceivedSpan, record: dict[str, Any]) -> None:
    assert record["endpoint"] == "/v1/realtime"
    assert (span.name, span.kind) == (f"transcription {MODEL}", SPAN_KIND_CLIENT)
    assert (span.trace_id, span.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert record["trace_id"] == CLIENT_TRACE  # the log line names the trace
    attributes = span.attributes
    assert attributes["gen_ai.operation.name"] == "transcription"
    assert attributes["gen_ai.provider.name"] == "openai"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.usage.output_tokens"] == record["output_tokens"] == 4
    assert attributes["gen_ai.usage.input_tokens"] == record["prompt_tokens"]
    assert "error.type" not in attributes
    # At the utterance's instants, the same as its log line's: from its commit (arrival)
    # to its done (e2e), its first delta (ttft) between; not when the record was made.
    start = span.start_time_unix_nano
    assert abs(start / 1e9 - record["arrival"]) < 1e-5
    assert abs((span.end_time_unix_nano - start) / 1e6 - record["e2e_ms"]) < 0.01
    (event,) = span.events
    assert event.name == "first_token"
    ttft = (event.time_unix_nano - start) / 1e9
    assert abs(ttft * 1000 - record["ttft_ms"]) < 0.01
    assert ttft >= TTFT  # the simulator's first delta comes TTFT after the commit
    assert SECRET not in repr(span)
