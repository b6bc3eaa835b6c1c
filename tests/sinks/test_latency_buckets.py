"""The latency histograms' edges: every vLLM edge kept, finer ones where the figures sit.

A review's bench saw a steady 202 ms TTFT; vLLM's TTFT edges have none between 0.1 and
0.25 s and its e2e edges start at 0.3 s, so a change of tens of milliseconds there moved
no quantile the dashboard draws.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from proxy.bench.compare import histogram_quantile
from proxy.core.buckets import E2E_BUCKETS, TTFT_BUCKETS
from proxy.sinks.metrics import Metrics
from proxy.sinks.sink import Labels
from tests.factories import measurement

# vLLM 0.32's (vllm/v1/metrics/buckets.py TIME_TO_FIRST_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS)
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def test_every_vllm_edge_is_kept_so_the_two_compare_edge_for_edge() -> None:
    assert set(VLLM_TTFT) <= set(TTFT_BUCKETS)
    assert set(VLLM_E2E) <= set(E2E_BUCKETS)
    assert list(TTFT_BUCKETS) == sorted(TTFT_BUCKETS)
    assert list(E2E_BUCKETS) == sorted(E2E_BUCKETS)
    assert 2.5 in TTFT_BUCKETS  # the recording rules' TTFT SLO threshold


def _p50(metric: str, field: str, seconds: float) -> float | None:
    """The PromQL p50 of 20 requests that each took `seconds` in `field`."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    for _ in range(20):
        metrics.record(measurement(**{field: seconds}), Labels("m"))
    buckets = [
        (float(sample.labels["le"]), sample.value)
        for family in registry.collect()
        for sample in family.samples
        if sample.name == f"{metric}_bucket"
    ]
    assert buckets and math.isinf(buckets[-1][0])
    return histogram_quantile(0.5, buckets)


@pytest.mark.parametrize(
    ("metric", "field", "before", "after"),
    [
        ("tokenprobe_time_to_first_token_seconds", "ttft", 0.19, 0.21),
        ("tokenprobe_e2e_request_latency_seconds", "e2e", 0.03, 0.09),  # an embedding's
    ],
)
def test_a_shift_of_tens_of_milliseconds_moves_the_median(
    metric: str, field: str, before: float, after: float
) -> None:
    """A backend's first token going from 190 to 210 ms, an embedding from 30 to 90 ms:
    both once fell in one bucket, (0.1, 0.25] and (0, 0.3], and read the same p50."""
    slower, faster = _p50(metric, field, after), _p50(metric, field, before)
    assert slower is not None and faster is not None
    assert slower > faster
    assert faster <= after and slower >= before  # each median reads its own side
