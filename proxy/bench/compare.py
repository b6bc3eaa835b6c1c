"""`--compare-metrics`: the bench's own figures next to a tokenprobe proxy's, for the same run.

The proxy's /metrics is scraped before and after; its figures are the deltas. TTFT
quantiles come from the histogram's bucket deltas, interpolated within a bucket the way
PromQL's `histogram_quantile` does, so they can only be trusted to the bucket: the bench's
exact quantiles should fall in the same bucket, or the next one up (the bench's clock
starts before the proxy's, on the far side of one network hop).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from proxy.bench.client import Result
from proxy.bench.stats import quantile
from proxy.core.secrets import mask_values, masked_url, url_credentials

REQUESTS = "tokenprobe_requests_total"
GENERATION = "tokenprobe_generation_tokens_total"
PROMPT = "tokenprobe_prompt_tokens_total"
TTFT_BUCKET = "tokenprobe_time_to_first_token_seconds_bucket"
QUANTILES = (0.5, 0.9, 0.95, 0.99)

Sample = tuple[str, dict[str, str], float]


@dataclass(frozen=True, slots=True)
class Figures:
    requests: int
    errors: dict[str, int]
    output_tokens: int
    prompt_tokens: int
    ttft: dict[str, float | None]  # "p50" ... "p99", seconds
    # quantile -> the histogram bucket it falls in, "(lower, upper]"
    ttft_buckets: dict[str, str | None] = field(default_factory=dict)


class ScrapeError(RuntimeError):
    pass


async def scrape(url: str, timeout: float = 10.0) -> list[Sample]:
    """The samples `url` serves. Its credentials (a /metrics behind `http://u:p@` or
    `?token=`) are masked in a ScrapeError, which the run file and stderr show, and in the
    client library's words in it (`mask_values`: aiohttp quotes the URL it refused)."""
    shown = masked_url(url)
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
            s.get(url) as r,
        ):
            text = await r.text()
            if r.status != 200:
                raise ScrapeError(f"--compare-metrics: {shown} answered HTTP {r.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        said = mask_values(str(exc), url_credentials(url)) or type(exc).__name__
        raise ScrapeError(f"--compare-metrics: cannot scrape {shown}: {said}") from None
    return [
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


async def settled(
    url: str, before: list[Sample], endpoint: str, model: str, expected: int
) -> list[Sample]:
    """Scrape after the run. The proxy records a request just after relaying its last byte, so
    wait (up to 2 s) until its count reaches the bench's or stops moving."""
    last: float | None = None
    for _ in range(40):
        after = await scrape(url)
        count = proxy_figures(before, after, endpoint, model).requests
        if count >= expected or count == last:
            return after
        last = count
        await asyncio.sleep(0.05)
    return after


def proxy_figures(before: list[Sample], after: list[Sample], endpoint: str, model: str) -> Figures:
    models = {labels.get("model") for name, labels, _ in after if name == REQUESTS}
    match_model = model in models  # else the proxy folded the name into a bounded label

    def delta(name: str, by: str | None = None) -> dict[str, float]:
        out: dict[str, float] = {}
        for sign, samples in ((-1.0, before), (1.0, after)):
            for sample, labels, value in samples:
                if sample != name or labels.get("endpoint") != endpoint:
                    continue
                if match_model and labels.get("model") != model:
                    continue
                key = labels.get(by, "") if by else ""
                out[key] = out.get(key, 0.0) + sign * value
        return out

    requests = delta(REQUESTS, "error_type")
    buckets = sorted(
        ((float(le), count) for le, count in delta(TTFT_BUCKET, "le").items()), key=lambda b: b[0]
    )
    return Figures(
        requests=round(sum(requests.values())),
        errors={k: round(v) for k, v in requests.items() if k != "none" and round(v)},
        output_tokens=round(sum(delta(GENERATION).values())),
        prompt_tokens=round(sum(delta(PROMPT).values())),
        ttft={f"p{q * 100:g}": histogram_quantile(q, buckets) for q in QUANTILES},
        ttft_buckets={
            f"p{q * 100:g}": bucket_of(histogram_quantile(q, buckets), buckets) for q in QUANTILES
        },
    )


def bench_figures(results: Iterable[Result], bounds: Sequence[float]) -> Figures:
    records = [r.m for r in results]
    ttfts = sorted(m.ttft for m in records if m.ttft is not None)
    errors: dict[str, int] = {}
    for m in records:
        if m.error_type is not None:
            errors[m.error_type.value] = errors.get(m.error_type.value, 0) + 1
    grid = [(b, 0.0) for b in (*bounds, math.inf)]
    exact = {f"p{q * 100:g}": quantile(ttfts, q * 100) for q in QUANTILES}
    return Figures(
        requests=len(records),
        errors=errors,
        output_tokens=sum(m.output_tokens or 0 for m in records),
        prompt_tokens=sum(m.prompt_tokens or 0 for m in records),
        ttft=exact,
        ttft_buckets={k: bucket_of(v, grid) for k, v in exact.items()},
    )


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """PromQL's histogram_quantile over cumulative (upper bound, count) pairs, +Inf last."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return previous_bound  # the highest finite bound, as Prometheus does
            if count == previous_count:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (
                count - previous_count
            )
        previous_bound, previous_count = bound, count
    return None


def bucket_of(value: float | None, buckets: Sequence[tuple[float, float]]) -> str | None:
    """The histogram bucket `value` falls in, as "(lower, upper]"."""
    if value is None:
        return None
    lower = 0.0
    for bound, _ in buckets:
        if value <= bound:
            return f"({lower:g}, {bound:g}]"
        lower = bound
    return f"({lower:g}, +Inf]"


def bucket_index(label: str | None, buckets: Sequence[float]) -> int | None:
    if label is None:
        return None
    upper = label.rsplit(", ", 1)[1].rstrip("]")
    return len(buckets) if upper == "+Inf" else list(buckets).index(float(upper))


def side_by_side(bench: Figures, proxy: Figures) -> str:
    rows: list[tuple[str, str, str]] = [
        ("requests", str(bench.requests), str(proxy.requests)),
        ("  failed", str(sum(bench.errors.values())), str(sum(proxy.errors.values()))),
        ("output tokens", str(bench.output_tokens), str(proxy.output_tokens)),
        ("prompt tokens", str(bench.prompt_tokens), str(proxy.prompt_tokens)),
    ]
    for key, value in bench.ttft.items():
        rows.append(
            (
                f"TTFT {key} ms",
                _cell(value, bench.ttft_buckets.get(key)),
                _cell(proxy.ttft[key], proxy.ttft_buckets.get(key)),
            )
        )
    width = max(len(r[1]) for r in rows)
    lines = [f"{'':15}  {'bench (exact)':>{width}}  proxy /metrics (histogram)"]
    lines += [f"{a:15}  {b:>{width}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def _cell(value: float | None, bucket: str | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} in {bucket}"


def as_json(bench: Figures, proxy: Figures) -> dict[str, Any]:
    from dataclasses import asdict

    return {"bench": asdict(bench), "proxy": asdict(proxy)}
