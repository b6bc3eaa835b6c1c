"""The price table loader and the cost sink (fresh registry, values read back exactly)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.sinks.cost import CostSink, ModelPrice, PriceTable, load_prices, parse_prices
from proxy.sinks.sink import Labels
from tests.factories import measurement

PRICES_YAML = """\
currency: EUR
models:
  llama:
    input: 0.5
    cached_input: 0.25
    output: 1.5
  qwen: {input: 2, output: 6}
"""

#: The request's labels: the cost sink labels by its price table, so they do not matter.
LABELS = Labels("other")


def record(**overrides: object) -> Measurement:
    """1000 prompt tokens (400 of them cached) and 200 output tokens of model "llama"."""
    return measurement(
        **{
            "model": "llama",
            "prompt_tokens": 1000,
            "output_tokens": 200,
            "cached_prompt_tokens": 400,
            "content_events": 200,
            **overrides,
        }
    )


def cost(registry: CollectorRegistry, model: str, kind: str) -> float | None:
    return registry.get_sample_value("tokenprobe_cost_total", {"model": model, "kind": kind})


@pytest.fixture
def table(tmp_path: Path) -> PriceTable:
    path = tmp_path / "prices.yaml"
    path.write_text(PRICES_YAML)
    return load_prices(path)


def test_yaml_table_is_loaded_with_currency_and_prices(table: PriceTable) -> None:
    assert table.currency == "EUR"
    assert table.get("llama") == ModelPrice(input=0.5, cached_input=0.25, output=1.5)


def test_cached_price_defaults_to_input_price(table: PriceTable) -> None:
    assert table.get("qwen") == ModelPrice(input=2.0, cached_input=2.0, output=6.0)


def test_json_table_is_loaded_and_currency_defaults_to_usd(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text(json.dumps({"models": {"m": {"input": 1, "output": 3}}}))
    table = load_prices(path)
    assert table.currency == "USD"
    assert table.get("m") == ModelPrice(input=1.0, cached_input=1.0, output=3.0)


@pytest.mark.parametrize(
    ("content", "names"),
    [
        ("models:\n  m: {input: 1, ouput: 2}\n", "models.m.ouput"),
        ("models:\n  m: {input: 1}\n", "models.m.output"),
        ("models:\n  m: {input: -1, output: 2}\n", "models.m.input"),
        ("models:\n  m: {input: cheap, output: 2}\n", "models.m.input"),
        ("models:\n  m: {input: true, output: 2}\n", "models.m.input"),
        ("models:\n  m: {input: .nan, output: 2}\n", "models.m.input"),
        ("models:\n  m: [1, 2]\n", "models.m"),
        ("models: [m]\n", "models"),
        ("currency: 3\nmodels: {}\n", "currency"),
        ("curency: USD\nmodels: {}\n", "curency"),
        ("- just a list\n", "mapping"),
        ("", "mapping"),
        ("models: {m: {input: 1, output: 2}\n", "not valid YAML"),
    ],
)
def test_bad_table_names_the_file_and_the_key(tmp_path: Path, content: str, names: str) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        load_prices(path)
    assert str(path) in str(info.value)
    assert names in str(info.value)


def test_file_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "prices.yaml"
    path.write_bytes(b"models: {\xff: 1}")
    with pytest.raises(ValueError, match=r"prices\.yaml: not valid YAML"):
        load_prices(path)


def test_bad_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "prices.json"
    path.write_text("{models: }")
    with pytest.raises(ValueError, match=r"prices\.json: not valid JSON"):
        load_prices(path)


def test_cached_input_is_billed_at_cached_price_only(table: PriceTable) -> None:
    registry = CollectorRegistry()
    CostSink(table, registry).record(record(), LABELS)
    assert cost(registry, "llama", "input") == pytest.approx(600 * 0.5 / 1e6)
    assert cost(registry, "llama", "cached_input") == pytest.approx(400 * 0.25 / 1e6)
    assert cost(registry, "llama", "output") == pytest.approx(200 * 1.5 / 1e6)


def test_cached_tokens_over_the_prompt_are_billed_as_the_whole_prompt(table: PriceTable) -> None:
    # A backend that says more prompt tokens came from its cache than the prompt had: the
    # prompt's tokens are billed once, at the cached price, never more of them.
    registry = CollectorRegistry()
    CostSink(table, registry).record(record(prompt_tokens=100, cached_prompt_tokens=400), LABELS)
    assert cost(registry, "llama", "input") == 0.0
    assert cost(registry, "llama", "cached_input") == pytest.approx(100 * 0.25 / 1e6)


def test_costs_accumulate_over_requests(table: PriceTable) -> None:
    registry = CollectorRegistry()
    sink = CostSink(table, registry)
    sink.record(record(model="qwen", prompt_tokens=1_000_000, cached_prompt_tokens=None), LABELS)
    sink.record(record(model="qwen", prompt_tokens=500_000, cached_prompt_tokens=None), LABELS)
    assert cost(registry, "qwen", "input") == pytest.approx(3.0)
    assert cost(registry, "qwen", "output") == pytest.approx(2 * 200 * 6 / 1e6)


def test_model_missing_from_table_costs_nothing_and_is_not_labelled(table: PriceTable) -> None:
    registry = CollectorRegistry()
    CostSink(table, registry).record(record(model="gpt-unknown"), LABELS)
    for kind in ("input", "cached_input", "output"):
        assert cost(registry, "gpt-unknown", kind) is None
    assert cost(registry, "llama", "output") == 0.0


def test_priced_models_are_exported_at_zero_before_any_request(table: PriceTable) -> None:
    registry = CollectorRegistry()
    CostSink(table, registry)
    assert cost(registry, "qwen", "cached_input") == 0.0


def test_unknown_token_counts_cost_nothing(table: PriceTable) -> None:
    registry = CollectorRegistry()
    CostSink(table, registry).record(
        record(prompt_tokens=None, cached_prompt_tokens=None, token_source=TokenSource.CHUNKS),
        LABELS,
    )
    assert cost(registry, "llama", "input") == 0.0
    assert cost(registry, "llama", "output") == pytest.approx(200 * 1.5 / 1e6)


def test_failed_request_is_billed_for_the_tokens_it_used(table: PriceTable) -> None:
    registry = CollectorRegistry()
    CostSink(table, registry).record(
        record(error_type=ErrorType.CLIENT_CANCELLED, output_tokens=10, cached_prompt_tokens=0),
        LABELS,
    )
    assert cost(registry, "llama", "input") == pytest.approx(1000 * 0.5 / 1e6)
    assert cost(registry, "llama", "output") == pytest.approx(10 * 1.5 / 1e6)


def test_parse_prices_accepts_empty_model_table() -> None:
    assert parse_prices({"models": {}}).models == {}
