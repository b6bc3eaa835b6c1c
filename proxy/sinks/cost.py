"""What the requests cost: a price table, a sink that turns each record into spend, and the
deployment's cost per hour turned into a cost per million tokens.

Cost per hour (`--cost-per-hour`): what the GPUs behind the backend cost, whatever they
serve. At an observed aggregate throughput of T tokens per second (all streams together):

  cost per million tokens = cost_per_hour / (T * 3600) * 1e6

computed for output tokens and for input (prompt) tokens separately; each figure charges
the whole hour to that one kind of token, so the two are not to be added.

Prices are per million tokens, in the table's currency. For one request:

  input         (prompt_tokens - cached_prompt_tokens) * input
  cached_input  cached_prompt_tokens * cached_input
  output        output_tokens * output

A background Response's tokens, which its POST's record did not have, are priced the same
way when they are counted (`late_tokens`, proxy/core/background.py: the first retrieval
that sees it finished), with the model its POST asked for.

Cached prompt tokens are a part of the prompt tokens (OpenAI's
`usage.prompt_tokens_details.cached_tokens`), so they are billed at the cached price
only, never also at the input price, and never more of them than the prompt had (a
backend's cached count over its prompt count is billed as the whole prompt, cached). A
count the proxy does not know (None) costs nothing; models missing from the table cost nothing and never become a label value,
so the `model` label stays bounded by the table.

The table file, YAML or JSON:

  currency: USD            # optional, default USD
  models:
    my-model: {input: 0.5, cached_input: 0.25, output: 1.5}   # cached_input optional
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.core.background import LateTokens
from proxy.core.measurement import Measurement
from proxy.core.pricing import (  # the table is read in core: the settings check it at start
    PER_TOKENS,
    PRICE_KEYS,
    ModelPrice,
    PriceTable,
    load_prices,
    parse_prices,
)
from proxy.sinks.sink import Labels

__all__ = [
    "PRICE_KEYS",
    "CostSink",
    "ModelPrice",
    "PriceTable",
    "export_cost_per_hour",
    "late_spend",
    "load_prices",
    "parse_prices",
    "spend",
]


def export_cost_per_hour(registry: CollectorRegistry, cost_per_hour: float, currency: str) -> Gauge:
    """`tokenprobe_deployment_cost_per_hour{currency}`: the recording rules divide it by the
    observed token rate (deploy/prometheus/rules/tokenprobe-recording.yaml)."""
    gauge = Gauge(
        "tokenprobe_deployment_cost_per_hour",
        "The deployment's cost per hour (--cost-per-hour), in `currency`. Cost per million "
        "output tokens = this / (output tokens per second * 3600) * 1e6, at the observed "
        "throughput of all streams; the same with prompt tokens for input.",
        ["currency"],
        registry=registry,
        multiprocess_mode="max",  # every worker states the same figure: never sum them
    )
    gauge.labels(currency).set(cost_per_hour)
    return gauge


class CostSink:
    """A Sink adding each request's spend to `tokenprobe_cost_total{model, kind}`; its
    model label is bounded by the price table, not by the request's Labels."""

    def __init__(self, prices: PriceTable, registry: CollectorRegistry) -> None:
        self.prices = prices
        counter = Counter(
            "tokenprobe_cost",
            "Spend on requests, in the price table's currency, from the token counts the "
            "proxy recorded when each request ended (a background Response's when a "
            "retrieval first saw it finished). kind: input (uncached prompt tokens), "
            "cached_input (cached prompt tokens), output (generated tokens).",
            ["model", "kind"],
            registry=registry,
        )
        # Children resolved once: every priced model's series exists (at 0) from the start,
        # so a rate() over it reads 0 rather than "no data" before its first request.
        self._children = {
            model: tuple(counter.labels(model=model, kind=kind) for kind in PRICE_KEYS)
            for model in prices.models
        }

    def record(self, m: Measurement, labels: Labels) -> None:
        price = self.prices.get(m.model)
        if price is not None:
            self._add(m.model, spend(price, m))

    def late_tokens(self, t: LateTokens, labels: Labels) -> None:
        """A background Response's tokens, counted after its POST's record (a
        LateTokensSink, proxy/sinks/sink.py): priced as `record` prices a request's."""
        price = self.prices.get(t.model)
        if price is not None:
            self._add(t.model, late_spend(price, t))

    def _add(self, model: str, amounts: tuple[float, float, float]) -> None:
        for child, amount in zip(self._children[model], amounts, strict=True):
            if amount:
                child.inc(amount)


def spend(price: ModelPrice, m: Measurement) -> tuple[float, float, float]:
    """One request's cost by kind (input, cached_input, output), as the module says."""
    return spend_tokens(price, m.prompt_tokens, m.cached_prompt_tokens, m.output_tokens)


def late_spend(price: ModelPrice, t: LateTokens) -> tuple[float, float, float]:
    """A background Response's late tokens' cost by kind, as `spend`."""
    return spend_tokens(price, t.prompt_tokens, t.cached_prompt_tokens, t.output_tokens)


def spend_tokens(
    price: ModelPrice, prompt: int | None, cached_prompt: int | None, output_tokens: int | None
) -> tuple[float, float, float]:
    """The cost by kind (input, cached_input, output) of these counts (None: unknown, so
    nothing), as the module says."""
    cached = max(cached_prompt or 0, 0)
    if prompt is not None:  # a part of the prompt, never more than all of it
        cached = min(cached, max(prompt, 0))
    uncached = max(max(prompt or 0, 0) - cached, 0)
    output = max(output_tokens or 0, 0)
    return (
        uncached * price.input / PER_TOKENS,
        cached * price.cached_input / PER_TOKENS,
        output * price.output / PER_TOKENS,
    )
