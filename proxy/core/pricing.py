"""The cost formula shared by the proxy's cost sink and the bench report: per-million-token
prices, and a deployment's hourly cost turned into a price per million tokens at the
observed throughput; and the price table (`load_prices`), read here, I/O-free but for the
file, so that the settings check it at start (proxy/settings.py) and the sink bills with
it (proxy/sinks/cost.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.core.datafile import parse_data_file

PER_TOKENS = 1_000_000
SECONDS_PER_HOUR = 3600


def per_million_tokens(cost_per_hour: float, tokens_per_second: float) -> float | None:
    """cost_per_hour / (tokens_per_second * 3600) * 1e6; None without throughput."""
    if tokens_per_second <= 0:
        return None
    return cost_per_hour / (tokens_per_second * SECONDS_PER_HOUR) * PER_TOKENS


#: The kinds of spend, in the order `spend` returns them.
PRICE_KEYS = ("input", "cached_input", "output")


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """Prices of one model, per million tokens."""

    input: float
    cached_input: float
    output: float


@dataclass(frozen=True, slots=True)
class PriceTable:
    currency: str
    models: Mapping[str, ModelPrice]

    def get(self, model: str) -> ModelPrice | None:
        return self.models.get(model)


def load_prices(path: str | Path) -> PriceTable:
    """Read a price table; ValueError naming the file and the offending key if it is wrong."""
    path = Path(path)
    try:
        data: Any = parse_data_file(path.read_text(encoding="utf-8"), path.name)
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path}: not valid {_format(path)}: {exc}") from None
    return parse_prices(data, source=str(path))


def parse_prices(data: Any, source: str = "<prices>") -> PriceTable:
    """Build a PriceTable from already-parsed data; `source` names it in errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping with 'models', got {_kind(data)}")
    unknown = sorted(set(data) - {"currency", "models"})
    if unknown:
        raise ValueError(f"{source}: unknown key {unknown[0]!r} (expected currency, models)")
    currency = data.get("currency", "USD")
    if not isinstance(currency, str) or not currency.strip():
        raise ValueError(f"{source}: currency: expected a non-empty string, got {currency!r}")
    models = data.get("models")
    if not isinstance(models, dict):
        raise ValueError(f"{source}: models: expected a mapping of model name to prices")
    table: dict[str, ModelPrice] = {}
    for name, prices in models.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{source}: models: model names must be non-empty strings")
        table[name] = _parse_model(prices, f"{source}: models.{name}")
    return PriceTable(currency=currency.strip(), models=table)


def _parse_model(prices: Any, where: str) -> ModelPrice:
    if not isinstance(prices, dict):
        raise ValueError(f"{where}: expected a mapping of input/cached_input/output prices")
    unknown = sorted(set(prices) - set(PRICE_KEYS))
    if unknown:
        # A typo such as "ouput" must not silently make a model's output free.
        raise ValueError(f"{where}.{unknown[0]}: unknown price key (expected {PRICE_KEYS})")
    for key in ("input", "output"):
        if key not in prices:
            raise ValueError(f"{where}.{key}: missing (price per million tokens)")
    values = {key: _price(prices[key], f"{where}.{key}") for key in prices}
    return ModelPrice(
        input=values["input"],
        cached_input=values.get("cached_input", values["input"]),
        output=values["output"],
    )


def _price(value: Any, where: str) -> float:
    # bool is an int subclass: `output: yes` is a mistake, not a price of 1.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number (per million tokens), got {value!r}")
    price = float(value)
    if not math.isfinite(price) or price < 0:
        raise ValueError(f"{where}: expected a finite price >= 0, got {value!r}")
    return price


def _format(path: Path) -> str:
    return "JSON" if path.suffix == ".json" else "YAML"


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__
