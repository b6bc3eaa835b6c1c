"""vLLM's per-request `metrics` object, read from real vLLM 0.32 answers, and the TTFT split."""

from __future__ import annotations

import orjson
import pytest

from proxy.core.apis import api_of
from proxy.core.engine import EngineMetrics, engine_metrics, ttft_split
from proxy.core.observe import StreamObserver
from proxy.core.request import CHAT, parse_request
from tests.paths import STREAMS

V032 = STREAMS / "vllm-0.32"


def observe_stream(name: str, endpoint: str = CHAT) -> StreamObserver:
    api = api_of(endpoint)
    info, _ = parse_request(api, b'{"model":"tiny","stream":true}')
    observer = StreamObserver(info, 0.0)
    observer.open(200, "text/event-stream", 0.001)
    observer.feed((V032 / name).read_bytes(), 0.05)
    return observer


def test_usage_chunk_metrics_are_read_in_seconds() -> None:
    observer = observe_stream("chat_stream_include_usage.sse")
    m = engine_metrics(observer.engine)
    assert m == EngineMetrics(
        queue_time=pytest.approx(0.08094199984043371e-3),  # type: ignore[arg-type]
        time_to_first_token=pytest.approx(9.458903000449936e-3),  # type: ignore[arg-type]
        generation_time=pytest.approx(37.028500999895186e-3),  # type: ignore[arg-type]
        mean_itl=pytest.approx(7.405700199979037e-3),  # type: ignore[arg-type]
        tokens_per_second=pytest.approx(129.06722001416676),  # type: ignore[arg-type]
        spec=None,
    )


def test_speculative_decoding_counts_are_read_from_the_usage_chunk() -> None:
    observer = observe_stream("spec_chat_stream_include_usage.sse")
    m = engine_metrics(observer.engine)
    assert m is not None and m.spec is not None
    assert (m.spec.draft_tokens, m.spec.accepted_tokens, m.spec.steps) == (18, 15, 7)
    assert m.spec.mean_acceptance_length == pytest.approx(3.142857142857143)


def test_a_stream_without_usage_has_no_engine_metrics() -> None:
    assert observe_stream("chat_stream_no_usage.sse").engine is None


def test_responses_completed_carries_the_metrics() -> None:
    observer = observe_stream("responses_stream.sse", "/v1/responses")
    m = engine_metrics(observer.engine)
    assert m is not None and m.queue_time == pytest.approx(0.04496399969866616e-3)


@pytest.mark.parametrize(
    ("name", "draft"),
    [("chat_nonstream_metrics.json", None), ("spec_completions_nonstream.json", 21)],
)
def test_non_streamed_bodies_carry_the_metrics(name: str, draft: int | None) -> None:
    body = orjson.loads((V032 / name).read_bytes())
    endpoint = "/v1/completions" if body["object"] == "text_completion" else CHAT
    facts = api_of(endpoint).body(body, collect=False)
    m = engine_metrics(facts.engine)
    assert m is not None and m.time_to_first_token is not None
    assert (None if m.spec is None else m.spec.draft_tokens) == draft


@pytest.mark.parametrize("value", [None, [], "x", {}, {"queue_time_ms": "1"}])
def test_anything_but_a_metrics_object_is_none(value: object) -> None:
    assert engine_metrics(value) is None


def test_negative_or_mistyped_fields_are_unknown() -> None:
    m = engine_metrics({"queue_time_ms": -1.0, "time_to_first_token_ms": True, "mean_itl_ms": 2})
    assert m is not None and (m.queue_time, m.time_to_first_token, m.mean_itl) == (
        None,
        None,
        0.002,
    )


def _engine(queue: float | None, first: float | None) -> EngineMetrics:
    return EngineMetrics(queue, first, None, None, None, None)


def test_the_split_leaves_the_rest_outside_the_engine() -> None:
    assert ttft_split(0.5, _engine(0.1, 0.3)) == pytest.approx((0.1, 0.3, 0.1))


def test_engine_parts_over_the_client_ttft_are_scaled_to_it_and_outside_is_zero() -> None:
    queue, first, outside = ttft_split(0.2, _engine(0.1, 0.3))  # type: ignore[misc]
    assert (queue, first, outside) == (pytest.approx(0.05), pytest.approx(0.15), 0.0)
    assert queue + first + outside == 0.2


def test_no_split_without_engine_ttft() -> None:
    assert ttft_split(0.2, _engine(0.1, None)) is None
    assert ttft_split(0.2, _engine(None, None)) is None


def test_without_a_queue_time_the_queue_part_is_none_and_its_wait_is_outside() -> None:
    assert ttft_split(0.5, _engine(None, 0.3)) == (None, 0.3, pytest.approx(0.2))
    assert ttft_split(0.2, _engine(None, 0.3)) == (None, 0.2, 0.0)  # scaled to the TTFT
    assert ttft_split(0.2, _engine(None, 0.0)) == (None, 0.0, 0.2)
