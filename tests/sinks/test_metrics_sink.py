"""The Prometheus sink: a fresh registry per test, values read back with get_sample_value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.core.apis import FINISH_LABELS
from proxy.core.measurement import NONE_LABEL, ErrorType, Measurement, TokenSource
from proxy.sinks.metrics import FIRST_COUNTED, Metrics, token_buckets
from proxy.sinks.sink import Labels
from tests.factories import measurement

CHAT = "/v1/chat/completions"
MODEL_LABEL = "llama"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def stream_record(**overrides: object) -> Measurement:
    """Four tokens: the first at 0.5 s, then gaps of 0.25, 0.25 and 0 s (two in one read)."""
    return measurement(
        **{
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "started_at": 1_718_000_000.0,
            "ttfb": 0.125,
            "ttft": 0.5,
            "tpot": 0.25,
            "decode_tokens_per_second": 4.0,
            "e2e": 1.5,
            "inter_token_latencies": (0.25, 0.25, 0.0),
            "output_tokens": 4,
            "cached_prompt_tokens": 8,
            "content_events": 4,
            **overrides,
        }
    )


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> Metrics:
    return Metrics(registry)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model": MODEL_LABEL, "endpoint": CHAT, **labels})


def requests_total(
    registry: CollectorRegistry, reason: str, error: str = NONE_LABEL, code: str = "200"
) -> float | None:
    return value(
        registry, "tokenprobe_requests_total", code=code, finish_reason=reason, error_type=error
    )


@pytest.mark.parametrize(
    ("histogram", "observed"),
    [
        ("tokenprobe_time_to_first_byte_seconds", 0.125),
        ("tokenprobe_time_to_first_token_seconds", 0.5),
        ("tokenprobe_request_time_per_output_token_seconds", 0.25),
        ("tokenprobe_request_decode_tokens_per_second", 4.0),
        ("tokenprobe_e2e_request_latency_seconds", 1.5),
        ("tokenprobe_request_prompt_tokens", 12.0),
        ("tokenprobe_request_generation_tokens", 4.0),
    ],
)
def test_each_duration_and_count_is_observed_once(
    registry: CollectorRegistry, metrics: Metrics, histogram: str, observed: float
) -> None:
    metrics.record(stream_record(), Labels(MODEL_LABEL))
    assert value(registry, histogram + "_count") == 1.0
    assert value(registry, histogram + "_sum") == observed


def test_every_inter_token_latency_is_observed(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.record(stream_record(), Labels(MODEL_LABEL))
    name = "tokenprobe_inter_token_latency_seconds"
    assert value(registry, name + "_count") == 3.0
    assert value(registry, name + "_sum") == 0.5
    assert value(registry, name + "_bucket", le="0.01") == 1.0  # the 0.0 gap


def test_ttft_lands_in_its_vllm_bucket(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.record(stream_record(ttft=0.3), Labels(MODEL_LABEL))
    name = "tokenprobe_time_to_first_token_seconds_bucket"
    assert value(registry, name, le="0.25") == 0.0
    assert value(registry, name, le="0.5") == 1.0


def test_token_totals_are_labelled_by_source(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.record(stream_record(), Labels(MODEL_LABEL))
    metrics.record(
        stream_record(prompt_tokens=None, output_tokens=7, token_source=TokenSource.CHUNKS),
        Labels(MODEL_LABEL),
    )
    assert value(registry, "tokenprobe_prompt_tokens_total", source="usage") == 12.0
    assert value(registry, "tokenprobe_generation_tokens_total", source="usage") == 4.0
    assert value(registry, "tokenprobe_generation_tokens_total", source="chunks") == 7.0
    assert value(registry, "tokenprobe_prompt_tokens_total", source="chunks") is None


def test_cached_prompt_tokens_are_counted(registry: CollectorRegistry, metrics: Metrics) -> None:
    metrics.record(stream_record(), Labels(MODEL_LABEL))
    metrics.record(stream_record(cached_prompt_tokens=None), Labels(MODEL_LABEL))
    assert value(registry, "tokenprobe_cached_prompt_tokens_total") == 8.0


def test_cache_write_prompt_tokens_are_counted_beside_the_cached_ones(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.record(stream_record(cache_write_tokens=128), Labels(MODEL_LABEL))
    metrics.record(stream_record(cache_write_tokens=None), Labels(MODEL_LABEL))  # unsaid
    metrics.record(stream_record(cache_write_tokens=0), Labels(MODEL_LABEL))
    assert value(registry, "tokenprobe_cache_write_prompt_tokens_total") == 128.0
    assert value(registry, "tokenprobe_cached_prompt_tokens_total") == 24.0


def test_successful_request_is_counted_with_none_error(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.record(stream_record(), Labels(MODEL_LABEL))
    assert requests_total(registry, "stop") == 1.0


def test_failed_request_is_counted_with_its_error_type(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    failed = stream_record(
        status_code=400,
        ttft=None,
        tpot=None,
        decode_tokens_per_second=None,
        inter_token_latencies=(),
        prompt_tokens=None,
        output_tokens=None,
        token_source=TokenSource.NONE,
        finish_reason=NONE_LABEL,
        error_type=ErrorType.CONTEXT_LENGTH,
    )
    metrics.record(failed, Labels(MODEL_LABEL))
    assert requests_total(registry, NONE_LABEL, "context_length", "400") == 1.0
    assert value(registry, "tokenprobe_time_to_first_token_seconds_count") == 0.0
    assert value(registry, "tokenprobe_request_generation_tokens_count") == 0.0


def test_the_counted_error_outcomes_exist_at_0_from_a_pairs_first_request(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    """The Auth and Context-length panels read increase() over their range: a first burst
    in a series that first appears already at 5 reads 0 there."""
    assert requests_total(registry, NONE_LABEL, "auth", "401") is None
    metrics.record(stream_record(), Labels(MODEL_LABEL))
    assert requests_total(registry, NONE_LABEL, "auth", "401") == 0.0
    assert requests_total(registry, NONE_LABEL, "auth", "403") == 0.0
    assert requests_total(registry, NONE_LABEL, "context_length", "400") == 0.0
    assert requests_total(registry, NONE_LABEL, "upstream_error", "503") is None  # only those


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("502", "upstream_unreachable"),
        ("504", "upstream_timeout"),
        ("500", "upstream_error"),
        ("502", "upstream_error"),
        ("429", "rate_limit"),
        ("404", "not_found"),
        ("400", "bad_request"),
        ("200", "stream_error"),
        ("200", "stream_truncated"),
    ],
)
def test_an_outage_counts_into_a_series_that_was_at_0_before_it(
    registry: CollectorRegistry, metrics: Metrics, code: str, error: str
) -> None:
    """The availability alerts and the error-ratio rules rate() these: an outage's 502s in
    a series first scraped at 30 fired nothing (a review, TokenprobeUpstreamUnreachable)."""
    metrics.record(stream_record(), Labels(MODEL_LABEL))
    assert requests_total(registry, NONE_LABEL, error, code) == 0.0


def test_a_pair_starts_with_the_successes_the_ratios_divide_by(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    """A generative pair's stop and length successes (the truncation ratio's numerator and
    denominator) exist at 0 even when its first request failed; an embedding pair has its
    finish-less success and none of the stream outcomes."""
    failed = stream_record(
        status_code=502,
        finish_reason=NONE_LABEL,
        error_type=ErrorType.UPSTREAM_UNREACHABLE,
    )
    metrics.record(failed, Labels(MODEL_LABEL))
    assert requests_total(registry, "stop") == 0.0
    assert requests_total(registry, "length") == 0.0
    assert requests_total(registry, NONE_LABEL, "upstream_unreachable", "502") == 1.0
    embedded = measurement(endpoint="/v1/embeddings", finish_reason=NONE_LABEL, stream=False)
    metrics.record(embedded, Labels(MODEL_LABEL))
    embeddings = {"model": MODEL_LABEL, "endpoint": "/v1/embeddings"}
    samples = [
        sample
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == "tokenprobe_requests_total"
        and sample.labels.items() >= embeddings.items()
    ]
    assert len(samples) == len(FIRST_COUNTED) + 1
    assert {s.labels["finish_reason"] for s in samples} == {NONE_LABEL}
    assert not {s.labels["error_type"] for s in samples} & {"stream_error", "stream_truncated"}


@pytest.mark.parametrize("reason", sorted(FINISH_LABELS))
def test_known_finish_reason_is_its_own_label(
    registry: CollectorRegistry, metrics: Metrics, reason: str
) -> None:
    metrics.record(stream_record(finish_reason=reason), Labels(MODEL_LABEL))
    assert requests_total(registry, reason) == 1.0


def test_model_label_is_the_one_given_not_the_requested_model(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.record(stream_record(model="random-client-string"), Labels("other"))
    sample = registry.get_sample_value(
        "tokenprobe_e2e_request_latency_seconds_count", {"model": "other", "endpoint": CHAT}
    )
    assert sample == 1.0


def test_records_accumulate(registry: CollectorRegistry, metrics: Metrics) -> None:
    for _ in range(3):
        metrics.record(stream_record(), Labels(MODEL_LABEL))
    assert requests_total(registry, "stop") == 3.0
    assert value(registry, "tokenprobe_e2e_request_latency_seconds_sum") == 4.5


def test_trace_id_becomes_an_exemplar_on_ttft(
    registry: CollectorRegistry, metrics: Metrics
) -> None:
    metrics.record(stream_record(trace_id=TRACE_ID), Labels(MODEL_LABEL))
    exemplars = [
        sample.exemplar
        for family in registry.collect()
        if family.name == "tokenprobe_time_to_first_token_seconds"
        for sample in family.samples
        if sample.exemplar is not None
    ]
    assert [(e.labels, e.value) for e in exemplars] == [({"trace_id": TRACE_ID}, 0.5)]


def test_token_buckets_are_the_1_2_5_series() -> None:
    assert token_buckets(1000) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)


def test_backend_info_in_multiprocess_mode_is_a_live_gauge_set_to_0_not_removed(
    tmp_path: Path,
) -> None:
    """With --workers each process writes its own file: the info gauge is `livemax`, so
    a dead worker's last answer is dropped at the next scrape (with `max` it stayed at 1
    beside the new backend's forever), and a change sets the old series to 0 rather than
    calling remove(), which prometheus-client cannot do there (it warned each time)."""
    program = f"""
import warnings
warnings.simplefilter("error")
from prometheus_client import CollectorRegistry, multiprocess
from proxy.sinks.metrics import Metrics
metrics = Metrics(CollectorRegistry())
metrics.set_backend("vllm", "1")
metrics.set_backend("llamacpp", "2")
scrape = CollectorRegistry()
multiprocess.MultiProcessCollector(scrape, path={str(tmp_path)!r})
for family in scrape.collect():
    if family.name == "tokenprobe_backend_info":
        print(sorted((s.labels["kind"], s.value) for s in family.samples))
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[('llamacpp', 1.0), ('vllm', 0.0)]"
    assert list(tmp_path.glob("gauge_livemax_*.db")) and not list(tmp_path.glob("gauge_max_*"))
