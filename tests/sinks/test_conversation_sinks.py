"""The conversation tracker behind the dispatcher: the record, the span and the metrics get
the conversation, the header's value goes nowhere, a tracker failure fails no request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from proxy.core.conversations import Closed, Conversations
from proxy.core.labels import ModelLabels
from proxy.core.measurement import ErrorType, Measurement
from proxy.core.request import CHAT, RequestInfo
from proxy.sinks.conversations import ClosedListener, ConversationTracker, refused
from proxy.sinks.dispatch import Sinks
from proxy.sinks.metrics import Metrics
from proxy.sinks.sink import Recorder
from proxy.sinks.tracing import Tracing
from tests.factories import measurement

MODEL = "sim-model"
SESSION = b"sess-very-private-42"


def build(exporter: InMemorySpanExporter) -> tuple[Sinks, Recorder, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    table = Conversations(capacity=10, idle=60.0, salt=b"k" * 32)
    recorder = Recorder()
    sinks = Sinks(
        [metrics, recorder],
        metrics=metrics,
        models=ModelLabels((MODEL,)),
        tracer=Tracing([SimpleSpanProcessor(exporter)], upstream="http://vllm:8000"),
        conversations=ConversationTracker(table, metrics, header="X-Session-Id"),
    )
    return sinks, recorder, registry


def info(messages: list[Any]) -> RequestInfo:
    return RequestInfo(CHAT, MODEL, True, False, None, None, prompt=messages)


def request(
    sinks: Sinks, messages: list[Any], start: float, e2e: float, header: bool = True, **kw: Any
) -> None:
    headers = [(b"x-session-id", SESSION)] if header else []
    scope = sinks.begin(info(messages), headers, start)
    m: Measurement = measurement(started_at=start, e2e=e2e, model=MODEL, **kw)
    sinks.end(scope, m)


def test_the_span_and_record_carry_the_conversation_never_the_header_value() -> None:
    exporter = InMemorySpanExporter()
    sinks, recorder, registry = build(exporter)
    first = [{"role": "user", "content": "hi"}]
    request(sinks, first, 1000.0, 0.5, prompt_tokens=10, cached_prompt_tokens=0)
    second = [{"role": "user", "content": "another topic"}]
    request(sinks, second, 1002.0, 0.5, prompt_tokens=12, cached_prompt_tokens=8)
    one, two = recorder.records
    assert one.conversation_id == two.conversation_id and one.conversation_id
    assert (one.turn, two.turn, two.continued_via) == (1, 2, "header")
    assert two.turn_gap == 1.5
    assert two.shared_prefix_tokens is None  # it repeats none of the first prompt
    spans = exporter.get_finished_spans()
    assert [s.attributes["gen_ai.conversation.id"] for s in spans] == [one.conversation_id] * 2
    assert [s.attributes["tokenprobe.conversation.id"] for s in spans] == [one.conversation_id] * 2
    assert [s.attributes["tokenprobe.conversation.turn"] for s in spans] == [1, 2]
    for span in spans:
        assert all(SESSION.decode() not in str(v) for v in (span.attributes or {}).values())
    gap = registry.get_sample_value(
        "tokenprobe_conversation_turn_gap_seconds_sum", {"model": MODEL, "via": "header"}
    )
    assert gap == 1.5
    assert (
        registry.get_sample_value(
            "tokenprobe_continuation_cached_prompt_ratio_count", {"model": MODEL}
        )
        is None
    )


def test_a_failing_tracker_fails_no_request_and_is_counted() -> None:
    sinks, recorder, registry = build(InMemorySpanExporter())
    tracker = sinks.conversations
    assert tracker is not None

    def broken(*args: Any) -> Any:
        raise RuntimeError("boom")

    tracker.end = broken  # type: ignore[method-assign]
    request(sinks, [{"role": "user", "content": "hi"}], 1000.0, 0.5)
    (record,) = recorder.records
    assert record.conversation_id is None  # the record as it was, still recorded
    failures = registry.get_sample_value(
        "tokenprobe_measurement_failures_total", {"stage": "conversation"}
    )
    assert failures == 1


def test_cached_ratio_needs_the_shared_prefix_and_cached_tokens() -> None:
    m = measurement(continued_via="messages", shared_prefix_tokens=40, cached_prompt_tokens=32)
    assert m.continuation_cache_ratio() == 0.8
    assert replace(m, cached_prompt_tokens=None).continuation_cache_ratio() is None
    assert replace(m, continued_via=None).continuation_cache_ratio() is None
    assert replace(m, cached_prompt_tokens=99).continuation_cache_ratio() == 1.0


class Listener:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.closed: list[Closed] = []

    def conversations_closed(self, closed: Sequence[Closed]) -> None:
        if self.fail:
            raise RuntimeError("a broken sink")
        self.closed += closed


def test_closed_conversations_reach_every_listener_a_failing_one_counted() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    broken, working = Listener(fail=True), Listener(fail=False)
    assert isinstance(working, ClosedListener)
    tracker = ConversationTracker(
        Conversations(capacity=10, idle=5.0, salt=b"k" * 32), metrics, listeners=[broken, working]
    )
    turn = tracker.begin(info([{"role": "user", "content": "hi"}]), [], 1000.0)
    tracker.end(turn, measurement(started_at=1000.0, e2e=0.5, model=MODEL), MODEL)
    assert tracker.sweep(1004.0) == [] and working.closed == []  # not idle yet
    (closed,) = tracker.sweep(1006.0)
    assert working.closed == [closed] and (closed.turns, closed.duration) == (1, 0.5)
    assert registry.get_sample_value("tokenprobe_conversation_turns_count") == 1
    failures = registry.get_sample_value("tokenprobe_measurement_failures_total", {"stage": "sink"})
    assert failures == 1


def test_a_conversation_the_proxy_recognised_by_itself_is_no_gen_ai_conversation() -> None:
    """Without the header, the proxy still follows an agent's turns (by their messages),
    under an id it made up: the GenAI conventions say not to put such an id in
    gen_ai.conversation.id ("a new UUID, a trace identifier, or a hash of request content
    SHOULD NOT be used"), so it goes in tokenprobe.conversation.id alone."""
    exporter = InMemorySpanExporter()
    sinks, recorder, _ = build(exporter)
    first = [{"role": "user", "content": "hi"}]
    request(sinks, first, 1000.0, 0.5, header=False)
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "go"}]
    request(sinks, second, 1002.0, 0.5, header=False)
    one, two = recorder.records
    assert one.conversation_id == two.conversation_id and two.continued_via == "messages"
    assert not one.conversation_named and not two.conversation_named
    spans = exporter.get_finished_spans()
    assert [s.attributes.get("gen_ai.conversation.id") for s in spans] == [None, None]
    assert [s.attributes["tokenprobe.conversation.id"] for s in spans] == [one.conversation_id] * 2


@pytest.mark.parametrize(
    ("status", "error", "is_refused"),
    [
        (429, ErrorType.RATE_LIMIT, True),
        (404, ErrorType.NOT_FOUND, True),  # vLLM's answer to an unknown previous_response_id
        (401, ErrorType.AUTH, True),
        (502, ErrorType.UPSTREAM_UNREACHABLE, True),  # the proxy's own
        (200, ErrorType.STREAM_ERROR, False),  # failed after its answer began: a turn
        (200, ErrorType.STREAM_TRUNCATED, False),
        (0, ErrorType.CLIENT_CANCELLED, False),  # the client left: the backend worked on it
        (499, ErrorType.CLIENT_CANCELLED, False),
        (200, None, False),
    ],
)
def test_a_request_is_refused_when_the_client_got_an_error_status_instead_of_an_answer(
    status: int, error: ErrorType | None, is_refused: bool
) -> None:
    assert refused(measurement(status_code=status, error_type=error)) is is_refused
