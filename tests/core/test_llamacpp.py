"""llama.cpp's `timings`, typed: every figure from its field, nonsense counted, never raised."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.engine import EngineMetrics, SpecDecode, ttft_split
from proxy.core.llamacpp import FIELDS, MAX_MS, MAX_TOKENS, timings_metrics

#: The example in llama.cpp's tools/server/README.md ("Timings and context usage").
README_TIMINGS: dict[str, Any] = {
    "cache_n": 236,
    "prompt_n": 1,
    "prompt_ms": 30.958,
    "prompt_per_token_ms": 30.958,
    "prompt_per_second": 32.301828283480845,
    "predicted_n": 35,
    "predicted_ms": 661.064,
    "predicted_per_token_ms": 18.887542857142858,
    "predicted_per_second": 52.94494935437416,
}


def test_every_figure_comes_from_its_field() -> None:
    assert timings_metrics(README_TIMINGS) == EngineMetrics(
        queue_time=None,  # llama.cpp reports none
        time_to_first_token=pytest.approx(0.030958),
        generation_time=pytest.approx(0.661064),
        mean_itl=pytest.approx(0.018887542857142858),
        tokens_per_second=52.94494935437416,
        spec=None,
        cached_tokens=236,
        prompt_tokens=1,
        output_tokens=35,
    )


def test_prompt_ms_is_the_engine_part_of_the_split_and_the_rest_is_outside() -> None:
    engine = timings_metrics(README_TIMINGS)
    assert engine is not None
    queue, first, outside = ttft_split(0.1, engine)  # type: ignore[misc]
    assert queue is None
    assert first == pytest.approx(0.030958)
    assert first + outside == pytest.approx(0.1)


def test_speculative_decoding_counts() -> None:
    engine = timings_metrics({**README_TIMINGS, "draft_n": 10, "draft_n_accepted": 7})
    assert engine is not None
    assert engine.spec == SpecDecode(10, 7, None, 0.7, None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_ms", -1.0),
        ("prompt_ms", MAX_MS * 2),
        ("prompt_ms", "12"),
        ("prompt_ms", True),
        ("prompt_ms", [1]),
        ("predicted_ms", -0.001),
        ("predicted_per_second", 1e300),
        ("cache_n", -3),
        ("cache_n", 1.5),
        ("prompt_n", MAX_TOKENS + 1),
        ("predicted_n", False),
        ("predicted_n", {"n": 1}),
        ("draft_n_accepted", 11),  # more accepted than drafted
    ],
)
def test_a_nonsense_field_is_none_and_named(field: str, value: object) -> None:
    timings = {**README_TIMINGS, "draft_n": 10, "draft_n_accepted": 7, field: value}
    engine = timings_metrics(timings)
    assert engine is not None
    assert engine.invalid == (field,)
    assert field in FIELDS
    good = timings_metrics({k: v for k, v in README_TIMINGS.items() if k != field})
    assert good is not None
    assert engine.cached_tokens == good.cached_tokens
    assert engine.output_tokens == good.output_tokens
    assert engine.time_to_first_token == good.time_to_first_token


@pytest.mark.parametrize("value", ["timings", 3, [README_TIMINGS], True])
def test_a_timings_that_is_no_object_is_named_not_read(value: object) -> None:
    engine = timings_metrics(value)
    assert engine is not None and engine.invalid == ("timings",)
    assert engine.time_to_first_token is None and engine.output_tokens is None


def test_an_object_without_any_known_field_is_none() -> None:
    assert timings_metrics({}) is None
    assert timings_metrics({"something_new": 1}) is None
