"""A realtime utterance's span: the sinks' dispatcher with the real tracer (in-memory
exporter) and a realtime session (proxy/core/apis/realtime.py) fed its messages with
hand-set instants, so the span's times can be compared exactly.

Before, `Sinks.record` (a WebSocket session's records) never reached the tracer: an
utterance had its log line and its metrics, and no span."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from proxy.core.apis.realtime import RealtimeSession
from proxy.core.labels import ModelLabels
from proxy.core.request import RequestInfo
from proxy.core.wsframes import WsMessage
from proxy.sinks.dispatch import Sinks
from proxy.sinks.metrics import Metrics
from proxy.sinks.sink import Recorder
from proxy.sinks.tracing import Tracing

UPSTREAM = "http://vllm.internal:8000"
MODEL = "whisper-large-v3"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
#: The upgrade request's arrival: perf_counter 100.0 is this wall-clock instant.
START, STARTED_AT = 100.0, 1_700_000_000.25
SECRET = "sk-realtime-SECRET-0123456789abcdef"
#: The upgrade request's headers as the tunnel keeps them (names in lower case).
UPGRADE = [
    (b"host", b"proxy.example"),
    (b"authorization", b"Bearer " + SECRET.encode()),
    (b"openai-beta", b"realtime=v1"),
    (b"x-api-key", SECRET.encode()),
    (b"cookie", b"session=" + SECRET.encode()),
    (b"traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01".encode()),
    (b"tracestate", b"vendor=1"),
]


class Traced:
    def __init__(self, trace_content: bool = False) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracing = Tracing(
            [SimpleSpanProcessor(self.exporter)], upstream=UPSTREAM, trace_content=trace_content
        )
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.recorder = Recorder()
        self.sinks = Sinks(
            [self.metrics, self.recorder],
            metrics=self.metrics,
            models=ModelLabels((MODEL,)),
            tracer=self.tracing,
        )

    def spans(self) -> tuple[ReadableSpan, ...]:
        return tuple(self.exporter.get_finished_spans())


@pytest.fixture
def traced() -> Iterator[Traced]:
    t = Traced()
    yield t
    t.tracing.shutdown()


def _event(from_client: bool, at: float, **event: Any) -> WsMessage:
    return WsMessage(from_client, "text", json.dumps(event).encode(), at)


def utterance(commit: float, first: float, done: float) -> list[WsMessage]:
    """One utterance as vLLM's realtime API has it: commit, two deltas, done with usage."""
    return [
        _event(True, commit - 0.1, type="input_audio_buffer.append", audio="AAAA" * 400),
        _event(True, commit, type="input_audio_buffer.commit"),
        _event(False, first, type="transcription.delta", delta="hello"),
        _event(False, first + 0.05, type="transcription.delta", delta=" world"),
        _event(
            False,
            done,
            type="transcription.done",
            text="hello world",
            usage={"prompt_tokens": 54, "completion_tokens": 2, "total_tokens": 56},
        ),
    ]


def session(sinks: Sinks, headers: list[tuple[bytes, bytes]] | None) -> RealtimeSession:
    """A session whose records go to the sinks as the tunnel hands them over
    (proxy/server/tunnel/session.py `_record`), with the upgrade request's headers."""
    return RealtimeSession(
        START, STARTED_AT, MODEL, record=lambda m: sinks.record(m, None, headers)
    )


def feed(s: RealtimeSession, messages: list[WsMessage]) -> None:
    for message in messages:
        s.message(message)


def test_each_utterance_is_one_client_span_from_its_commit_to_its_done(traced: Traced) -> None:
    s = session(traced.sinks, UPGRADE)
    feed(s, utterance(commit=101.0, first=101.3, done=101.5))
    feed(s, utterance(commit=102.0, first=102.25, done=102.75))
    first, second = traced.spans()
    for span, (commit, ttft, e2e) in zip(
        (first, second), ((1.0, 0.3, 0.5), (2.0, 0.25, 0.75)), strict=True
    ):
        assert (span.name, span.kind) == (f"transcription {MODEL}", SpanKind.CLIENT)
        # At the utterance's instants, not when its record was made (now, in 2025 or later).
        start = int((STARTED_AT + commit) * 1e9)
        assert span.start_time == start
        assert span.end_time == pytest.approx(start + e2e * 1e9, abs=1000)  # float rounding
        assert [e.name for e in span.events] == ["first_token"]
        assert span.events[0].timestamp == pytest.approx(start + ttft * 1e9, abs=1000)
        assert span.attributes is not None
        assert span.attributes["tokenprobe.time_to_first_token"] == pytest.approx(ttft)
        assert span.attributes["gen_ai.usage.output_tokens"] == 2
        assert span.attributes["gen_ai.usage.input_tokens"] == 54
        assert span.status.status_code is StatusCode.UNSET
        # The client's trace, as an HTTP request's span joins it.
        assert span.parent is not None
        assert format(span.parent.span_id, "016x") == CLIENT_SPAN
        assert format(span.context.trace_id, "032x") == CLIENT_TRACE
    assert first.context.span_id != second.context.span_id
    # The trace id goes on each record: its log line and its exemplars carry it.
    assert [m.trace_id for m in traced.recorder.records] == [CLIENT_TRACE] * 2


def test_an_utterance_s_span_has_what_a_transcription_request_s_span_has(
    traced: Traced,
) -> None:
    """The same attributes as /v1/audio/transcriptions' span for the same figures
    (operation `transcription`, provider, server, model, stream, usage, timings...)."""
    s = session(traced.sinks, UPGRADE)
    feed(s, utterance(commit=101.0, first=101.3, done=101.5))
    (record,) = traced.recorder.records
    request = RequestInfo(
        endpoint="/v1/audio/transcriptions",
        model=MODEL,
        stream=True,
        usage_requested=True,
        max_tokens=None,
        temperature=None,
    )
    span, _, _ = traced.tracing.start(request, UPGRADE, int(record.started_at * 1e9))
    traced.tracing.finish(span, replace(record, endpoint="/v1/audio/transcriptions"))
    utterance_span, http_span = traced.spans()
    assert utterance_span.name == http_span.name
    assert dict(utterance_span.attributes or {}) == dict(http_span.attributes or {})
    assert utterance_span.attributes is not None
    assert utterance_span.attributes["gen_ai.operation.name"] == "transcription"
    assert utterance_span.attributes["gen_ai.request.model"] == MODEL
    assert utterance_span.attributes["gen_ai.request.stream"] is True


def test_without_a_traceparent_an_utterance_s_span_is_a_root(traced: Traced) -> None:
    s = session(traced.sinks, [(b"authorization", b"Bearer " + SECRET.encode())])
    feed(s, utterance(commit=101.0, first=101.3, done=101.5))
    (span,) = traced.spans()
    assert span.parent is None
    (record,) = traced.recorder.records
    assert record.trace_id == format(span.context.trace_id, "032x")


def test_an_unsampled_client_trace_leaves_the_utterance_untraced(traced: Traced) -> None:
    headers = [(b"traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00".encode())]
    s = session(traced.sinks, headers)
    feed(s, utterance(commit=101.0, first=101.3, done=101.5))
    assert traced.spans() == ()
    (record,) = traced.recorder.records
    assert record.trace_id is None


def test_no_header_value_of_the_upgrade_reaches_the_span() -> None:
    """The tunnel hands over the upgrade request's headers whole (credentials among
    them); the span joins the client's trace and carries none of their values, with
    --trace-content too (an utterance has no prompt text to trace)."""
    traced = Traced(trace_content=True)
    try:
        s = session(traced.sinks, UPGRADE)
        feed(s, utterance(commit=101.0, first=101.3, done=101.5))
        feed(s, [_event(False, 103.0, type="error", error="bad audio", code="invalid_audio")])
        spans = traced.spans()
    finally:
        traced.tracing.shutdown()
    assert len(spans) == 2
    for span in spans:
        text = span.to_json()
        assert SECRET not in text
        assert "realtime=v1" not in text and "proxy.example" not in text
        assert "gen_ai.input.messages" not in (span.attributes or {})


def test_a_session_error_is_a_span_with_its_error_type(traced: Traced) -> None:
    """Every record a session makes is a span, as every request that went upstream is:
    a refused session.update's model is a `not_found` one, and an utterance cut by the
    session's end is `stream_truncated`."""
    s = session(traced.sinks, UPGRADE)
    feed(s, [_event(True, 100.5, type="session.update", model="nope")])
    feed(s, [_event(False, 100.6, type="error", error="The model `nope` does not exist.",
                    code="model_not_found")])  # fmt: skip
    feed(s, utterance(commit=101.0, first=101.3, done=101.5)[:3])
    s.close(101.9, "upstream_vanished")
    refused, cut = traced.spans()
    assert refused.attributes is not None and cut.attributes is not None
    assert refused.attributes["error.type"] == "not_found"
    assert refused.status.status_code is StatusCode.ERROR
    assert cut.attributes["error.type"] == "stream_truncated"
    assert cut.attributes["gen_ai.response.finish_reasons"] == ("error",)
    start = int((STARTED_AT + 1.0) * 1e9)
    assert cut.start_time == start
    assert cut.end_time == pytest.approx(start + 0.9 * 1e9, abs=1000)


class _BrokenTracer:
    def start(self, *args: Any) -> Any:
        raise RuntimeError("the tracer broke")

    def finish(self, span: Any, measurement: Any) -> None:
        raise AssertionError("no span was started")

    def shutdown(self) -> None:
        pass


def test_a_tracer_that_fails_costs_the_utterance_its_span_only() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    recorder = Recorder()
    sinks = Sinks([metrics, recorder], metrics=metrics, models=ModelLabels((MODEL,)),
                  tracer=_BrokenTracer())  # fmt: skip
    feed(session(sinks, UPGRADE), utterance(commit=101.0, first=101.3, done=101.5))
    (record,) = recorder.records
    assert record.trace_id is None
    failures = "tokenprobe_measurement_failures_total"
    assert registry.get_sample_value(failures, {"stage": "trace"}) == 1
