"""The engine's figures, cancelled work and the proxy's own time on a fresh registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from proxy.core.engine import EngineMetrics, SpecDecode
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.sinks.metrics import Metrics
from proxy.sinks.sink import Labels
from tests.factories import measurement

CHAT = "/v1/chat/completions"
L = {"model": "m", "endpoint": CHAT}
S = {**L, "stream": "true"}


def engine(queue: float, first: float, spec: SpecDecode | None = None) -> EngineMetrics:
    return EngineMetrics(queue, first, 0.1, 0.01, 100.0, spec)


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def recorded(*records: Measurement) -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for m in records:
        metrics.record(m, Labels("m"))
    return registry


def test_three_parts_add_up_to_the_ttft_sum_even_when_clamped() -> None:
    registry = recorded(
        measurement(ttft=0.5, engine=engine(0.1, 0.3)),
        measurement(ttft=0.2, engine=engine(0.1, 0.3)),  # engine over the client: scaled
        measurement(ttft=0.05, engine=engine(0.0, 0.01)),
    )
    parts = [
        sample(registry, "tokenprobe_engine_queue_time_seconds_sum", S),
        sample(registry, "tokenprobe_engine_time_to_first_token_seconds_sum", S),
        sample(registry, "tokenprobe_time_to_first_token_outside_engine_seconds_sum", L),
    ]
    assert sum(parts) == pytest.approx(
        sample(registry, "tokenprobe_time_to_first_token_seconds_sum", L)
    )
    assert parts == [pytest.approx(0.15), pytest.approx(0.46), pytest.approx(0.14)]
    assert sample(registry, "tokenprobe_time_to_first_token_outside_engine_seconds_count", L) == 3


def test_a_non_streamed_answer_observes_the_engine_figures_apart() -> None:
    registry = recorded(measurement(stream=False, ttft=None, engine=engine(0.25, 0.5)))
    unstreamed = {**L, "stream": "false"}
    assert sample(registry, "tokenprobe_engine_queue_time_seconds_sum", unstreamed) == 0.25
    assert sample(registry, "tokenprobe_engine_time_to_first_token_seconds_sum", unstreamed) == 0.5
    assert sample(registry, "tokenprobe_time_to_first_token_outside_engine_seconds_count", L) == 0


def test_spec_decode_counters_sum_the_requests() -> None:
    spec = SpecDecode(
        draft_tokens=18,
        accepted_tokens=15,
        mean_acceptance_length=3.0,
        acceptance_rate=0.83,
        steps=7,
    )
    registry = recorded(*[measurement(engine=engine(0.0, 0.01, spec))] * 3)
    assert sample(registry, "tokenprobe_spec_decode_draft_tokens_total", L) == 54
    assert sample(registry, "tokenprobe_spec_decode_accepted_tokens_total", L) == 45
    assert sample(registry, "tokenprobe_spec_decode_mean_acceptance_length_sum", L) == 9.0


def test_output_tokens_per_chunk_is_one_observation_per_stream() -> None:
    registry = recorded(measurement(output_tokens=20, content_events=8))
    assert sample(registry, "tokenprobe_request_output_tokens_per_chunk_sum", L) == 2.5
    assert sample(registry, "tokenprobe_request_output_tokens_per_chunk_count", L) == 1


def test_chunk_counted_tokens_make_no_tokens_per_chunk() -> None:
    registry = recorded(measurement(token_source=TokenSource.CHUNKS))
    assert sample(registry, "tokenprobe_request_output_tokens_per_chunk_count", L) == 0


def test_a_cancelled_request_counts_its_prompt_and_output_by_source() -> None:
    registry = recorded(
        measurement(
            error_type=ErrorType.CLIENT_CANCELLED,
            prompt_tokens=30,
            output_tokens=5,
            token_source=TokenSource.TOKENIZER,
        ),
        measurement(
            error_type=ErrorType.CLIENT_CANCELLED,
            prompt_tokens=None,
            output_tokens=3,
            token_source=TokenSource.CHUNKS,
        ),
        measurement(prompt_tokens=99, output_tokens=99),  # finished: not cancelled
    )
    tok, chunks = {**L, "source": "tokenizer"}, {**L, "source": "chunks"}
    assert sample(registry, "tokenprobe_cancelled_prompt_tokens_total", tok) == 30
    assert sample(registry, "tokenprobe_cancelled_generation_tokens_total", tok) == 5
    assert sample(registry, "tokenprobe_cancelled_generation_tokens_total", chunks) == 3
    assert sample(registry, "tokenprobe_cancelled_prompt_tokens_total", chunks) == 0


def test_a_record_without_the_object_leaves_the_engine_metrics_untouched() -> None:
    registry = recorded(measurement())
    for name in (
        "tokenprobe_engine_queue_time_seconds_count",
        "tokenprobe_engine_time_to_first_token_seconds_count",
    ):
        assert sample(registry, name, S) == 0
    assert sample(registry, "tokenprobe_time_to_first_token_outside_engine_seconds_count", L) == 0
    assert sample(registry, "tokenprobe_spec_decode_draft_tokens_total", L) == 0


def test_proxy_overhead_is_observed_when_the_data_path_reported_it() -> None:
    registry = recorded(measurement(proxy_overhead=0.0004), measurement())
    assert sample(registry, "tokenprobe_proxy_overhead_seconds_sum", L) == 0.0004
    assert sample(registry, "tokenprobe_proxy_overhead_seconds_count", L) == 1


def test_streamed_token_ids_make_a_tokens_per_chunk() -> None:
    """/inference/v1/generate streams its token ids: an exact count, as usage's."""
    registry = recorded(
        measurement(token_source=TokenSource.TOKEN_IDS, output_tokens=20, content_events=10)
    )
    assert sample(registry, "tokenprobe_request_output_tokens_per_chunk_sum", L) == 2.0
