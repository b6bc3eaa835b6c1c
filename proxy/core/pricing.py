"""The cost formula shared by the proxy's cost sink and the bench report: per-million-token
prices, and a deployment's hourly cost turned into a price per million tokens at the
observed throughput."""

from __future__ import annotations

PER_TOKENS = 1_000_000
SECONDS_PER_HOUR = 3600


def per_million_tokens(cost_per_hour: float, tokens_per_second: float) -> float | None:
    """cost_per_hour / (tokens_per_second * 3600) * 1e6; None without throughput."""
    if tokens_per_second <= 0:
        return None
    return cost_per_hour / (tokens_per_second * SECONDS_PER_HOUR) * PER_TOKENS
