"""The bench reads the engine's per-request metrics: the split per level, and compare rows."""

from __future__ import annotations

import pytest

from proxy.bench.significance import figures, rows
from proxy.bench.stats import spec_decode, ttft_split
from proxy.core.engine import EngineMetrics, SpecDecode
from tests.factories import measurement


def engine(queue: float, first: float, spec: SpecDecode | None = None) -> EngineMetrics:
    return EngineMetrics(queue, first, None, None, None, spec)


def test_the_split_is_the_mean_of_the_streams_that_carried_the_object() -> None:
    records = [
        measurement(ttft=0.3, engine=engine(0.1, 0.1)),
        measurement(ttft=0.1, engine=engine(0.0, 0.05)),
        measurement(ttft=9.0),  # no object: not in the split
    ]
    split = ttft_split(records)
    assert split == {
        "requests": 2,
        "queue": pytest.approx(0.05),
        "engine": pytest.approx(0.075),
        "outside": pytest.approx(0.075),
    }


def test_spec_decode_sums_the_engine_counts() -> None:
    spec = SpecDecode(21, 14, 3.0, 0.67, 7)
    out = spec_decode([measurement(engine=engine(0.0, 0.01, spec))] * 2)
    assert out is not None and (out["draft"], out["accepted"]) == (42, 28)
    assert out["acceptance_rate"] == pytest.approx(28 / 42)
    assert spec_decode([measurement()]) is None


def test_compare_figures_read_the_saved_engine_object() -> None:
    saved = [
        {
            "error_type": None,
            "ttft": 0.3,
            "e2e": 1.0,
            "output_tokens": 4,
            "engine": {"queue_time": 0.2, "time_to_first_token": 0.05},
        },
        {"error_type": None, "ttft": 0.2, "e2e": 1.0, "output_tokens": 4, "engine": None},
    ]
    f = figures(rows(saved, {}), 1.0, has_slo=False)
    assert (f["queue_mean"], f["engine_ttft_mean"], f["outside_mean"]) == pytest.approx(
        (0.2, 0.05, 0.05)
    )
    without = figures(rows(saved[1:], {}), 1.0, has_slo=False)
    assert without["queue_mean"] is None  # no row in the compare table
