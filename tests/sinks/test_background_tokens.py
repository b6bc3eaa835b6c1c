"""A background Response's tokens counted after its POST (proxy/core/background.py): the
table that remembers its POST, and what each sink makes of the late count."""

from __future__ import annotations

import io
import json

import pytest
from prometheus_client import CollectorRegistry

from proxy.core.background import LateTokens, Table, retrieval
from proxy.core.labels import ModelLabels
from proxy.core.measurement import TokenSource
from proxy.core.request import RequestInfo
from proxy.sinks.cost import CostSink, parse_prices
from proxy.sinks.dispatch import Sinks
from proxy.sinks.logs import AccessLog
from proxy.sinks.metrics import Metrics
from proxy.sinks.semconv import Names
from proxy.sinks.sink import Labels
from tests.sinks.test_otlp_sink import Collecting, by_name, sink

#: Per million tokens: LATE's 3 uncached, 4 cached and 31 output tokens cost 3, 2 and 62
#: millionths.
PRICES = parse_prices(
    {"currency": "EUR", "models": {"sim-model": {"input": 1, "cached_input": 0.5, "output": 2}}}
)
LATE_SPEND = {"input": 3e-6, "cached_input": 2e-6, "output": 62e-6}

INFO = RequestInfo("/v1/responses", "sim-model", False, True, None, None, prompt="hi")
LATE = LateTokens(
    response_id="resp_1",
    endpoint="/v1/responses",
    model="sim-model",
    response_model="sim-model",
    started_at=1_700_000_000.0,
    prompt_tokens=7,
    output_tokens=31,
    cached_prompt_tokens=4,
    cache_write_tokens=3,
    token_source=TokenSource.USAGE,
    reasoning_tokens=5,
    reasoning_token_source="usage",
    finish_reason="stop",
    raw_finish_reason="completed",
    counted_by="retrieve",
)


def test_the_table_is_bounded_oldest_first_and_gives_each_id_once() -> None:
    table: Table[str] = Table(limit=2)
    for rid in ("resp_a", "resp_b", "resp_c"):
        table.add(rid, INFO, rid.upper())
    assert len(table) == 2 and table.get("resp_a") is None  # the oldest forgotten
    found = table.take("resp_b")
    assert found is not None and found[1] == "RESP_B"
    assert found[0].prompt is None  # the prompt stays with the POST's record
    assert table.take("resp_b") is None  # a second retrieval counts nothing


def test_only_a_get_of_a_remembered_id_is_a_retrieval_streamed_as_its_query_says() -> None:
    table: Table[str] = Table()
    table.add("resp_a", INFO, "")
    assert retrieval(table, "/v1/responses/resp_b", "") is None  # never started here
    assert retrieval(table, "/v1/responses/resp_a/input_items", "") is None
    plain = retrieval(table, "/v1/responses/resp_a", "")
    streamed = retrieval(table, "/v1/responses/resp_a", "starting_after=3&stream=True")
    assert plain is not None and (plain[0].stream, plain[1]) == (False, "resp_a")
    assert streamed is not None and streamed[0].stream is True


def test_prometheus_counts_the_tokens_with_the_posts_labels_and_no_request() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, attribution=("team",))
    log = io.StringIO()
    sinks = Sinks(
        [metrics, AccessLog("json", stream=log, attribution=("team",))],
        metrics=metrics,
        models=ModelLabels(("sim-model",)),
        attribution=(("x-team", "team"),),
    )
    sinks.late_tokens(LATE, Labels("sim-model", key="k1", attribution=("red",)))
    labels = {"model": "sim-model", "endpoint": "/v1/responses", "team": "red"}
    sample = registry.get_sample_value
    assert sample("tokenprobe_generation_tokens_total", {**labels, "source": "usage"}) == 31
    assert sample("tokenprobe_prompt_tokens_total", {**labels, "source": "usage"}) == 7
    assert sample("tokenprobe_cached_prompt_tokens_total", labels) == 4
    assert sample("tokenprobe_cache_write_prompt_tokens_total", labels) == 3
    assert sample("tokenprobe_reasoning_tokens_total", {**labels, "source": "usage"}) == 5
    key = {"key": "k1", "model": "sim-model"}
    assert sample("tokenprobe_key_tokens_total", {**key, "kind": "output"}) == 31
    assert sample("tokenprobe_key_requests_total", {**key, "error_type": "none"}) is None
    for name in ("tokenprobe_requests_total", "tokenprobe_e2e_request_latency_seconds_count"):
        assert not [s for m in registry.collect() for s in m.samples if s.name == name]
    (line,) = log.getvalue().splitlines()
    got = json.loads(line)
    assert (got["kind"], got["response_id"], got["output_tokens"]) == (
        "background_tokens",
        "resp_1",
        31,
    )
    assert (got["counted_by"], got["labels"]) == ("retrieve", {"team": "red"})
    assert (got["cached_tokens"], got["cache_write_tokens"]) == (4, 3)


def test_otlp_adds_the_usage_counters_and_no_per_request_point() -> None:
    otlp = sink(Collecting(), CollectorRegistry(), names=Names(current=True, previous=True))
    otlp.late_tokens(LATE, Labels("sim-model"))
    metrics = by_name(otlp.collect())  # type: ignore[arg-type]
    values = {
        name: sum(p.value for p in metrics[name].data.data_points)
        for name in (
            "gen_ai.client.inference.usage.input_tokens",
            "gen_ai.client.inference.usage.output_tokens",
            "gen_ai.client.inference.usage.cache_read.input_tokens",
            "gen_ai.client.inference.usage.cache_write.input_tokens",
            "gen_ai.client.inference.usage.reasoning.output_tokens",
            "tokenprobe.usage.cached_input_tokens",
        )
    }
    assert list(values.values()) == [7, 31, 4, 3, 5, 4]
    for name in (
        "gen_ai.client.token.usage",
        "gen_ai.client.inference.operation.output_tokens",
        "gen_ai.client.inference.duration",
        "tokenprobe.requests",
    ):
        assert name not in metrics


def test_the_cost_sink_prices_the_late_tokens_as_a_requests() -> None:
    """Sinks hands the late count to the cost sink (a LateTokensSink): its prompt, cached
    and output tokens priced as `spend` prices a request's, by the model the POST named."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    sinks = Sinks(
        [metrics, CostSink(PRICES, registry)],
        metrics=metrics,
        models=ModelLabels(("sim-model",)),
    )
    sinks.late_tokens(LATE, Labels("sim-model"))
    got = {
        kind: registry.get_sample_value(
            "tokenprobe_cost_total", {"model": "sim-model", "kind": kind}
        )
        for kind in LATE_SPEND
    }
    assert got == pytest.approx(LATE_SPEND)


def test_otlp_prices_the_late_tokens_as_a_requests() -> None:
    otlp = sink(Collecting(), CollectorRegistry(), prices=PRICES)
    otlp.late_tokens(LATE, Labels("sim-model"))
    cost = by_name(otlp.collect())["tokenprobe.cost"]  # type: ignore[arg-type]
    spend = {p.attributes["tokenprobe.cost.kind"]: p.value for p in cost.data.data_points}
    assert spend == pytest.approx(LATE_SPEND)
    assert {p.attributes["tokenprobe.currency"] for p in cost.data.data_points} == {"EUR"}
