"""TTFT by prompt size and prefix-cache hit: the classes, where requests land, how many series.

The simulator grows TTFT with the prompt (`ttft_per_prompt_token`) and reports cached
prompt tokens (`x-sim-cached-tokens`); the proxy in front of it must file each request's
TTFT under its prompt class and cache class, in the bucket the simulator's timing implies.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.core.measurement import Measurement, TokenSource
from proxy.sinks.metrics import (
    CACHE_CLASSES,
    PROMPT_CLASSES,
    TTFT_CLASS_BUCKETS,
    Metrics,
    cache_class,
    prompt_class,
)
from proxy.sinks.sink import Labels
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.tokenizers_local import build_tiny_tokenizer

#: The end-to-end tests: TTFTs programmed per prompt class must land in their buckets.
TIMED = pytest.mark.quiet("TTFTs programmed per prompt class must land in their buckets")

HISTOGRAM = "tokenprobe_time_to_first_token_by_prompt_seconds"
COMPLETIONS = "/v1/completions"
PER_TOKEN = 2e-4  # seconds of TTFT per prompt token, programmed into the simulator


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [(None, "unknown"), (0, "0-1k"), (1024, "0-1k"), (1025, "1k-4k"), (4096, "1k-4k"),
     (8192, "4k-8k"), (32768, "8k-32k"), (131072, "32k-128k"), (131073, "128k+")],
)  # fmt: skip
def test_prompt_classes_end_at_common_context_sizes(tokens: int | None, expected: str) -> None:
    assert prompt_class(tokens) == expected


@pytest.mark.parametrize(
    ("prompt", "cached", "expected"),
    [(100, None, "unknown"), (None, 5, "unknown"), (0, 0, "unknown"), (100, 0, "none"),
     (100, 1, "part"), (100, 49, "part"), (100, 50, "most"), (100, 100, "most")],
)  # fmt: skip
def test_cache_classes_by_share_of_the_prompt_cached(
    prompt: int | None, cached: int | None, expected: str
) -> None:
    assert cache_class(prompt, cached) == expected


def _record(prompt: int | None, cached: int | None, ttft: float, endpoint: str) -> Measurement:
    return Measurement(
        endpoint=endpoint,
        model=MODEL,
        stream=True,
        stream_requested=True,
        status_code=200,
        started_at=time.time(),
        ttfb=ttft / 2,
        ttft=ttft,
        tpot=None,
        decode_tokens_per_second=None,
        e2e=ttft + 0.1,
        inter_token_latencies=(),
        prompt_tokens=prompt,
        output_tokens=1,
        cached_prompt_tokens=cached,
        token_source=TokenSource.USAGE,
        content_events=1,
        finish_reason="stop",
        error_type=None,
    )


def test_series_stay_bounded_whatever_the_prompt_sizes_and_cache_hits() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    endpoints = ("/v1/chat/completions", COMPLETIONS)
    sizes = [None, *range(1, 300_000, 997)]
    for endpoint in endpoints:
        for n, prompt in enumerate(sizes):
            for share in (None, 0.0, 0.1, 0.9, 1.0):
                cached = None if share is None else int((prompt or 0) * share)
                metrics.record(_record(prompt, cached, 0.001 * (n % 900), endpoint), Labels(MODEL))
    (family,) = [f for f in registry.collect() if f.name == HISTOGRAM]
    label_sets = {
        (s.labels["endpoint"], s.labels["prompt_class"], s.labels["cache_class"])
        for s in family.samples
    }
    # An unknown prompt size has an unknown cache share: 6 sizes x 4 cache classes + 1.
    per_endpoint = (len(PROMPT_CLASSES) - 1) * len(CACHE_CLASSES) + 1
    assert len(label_sets) == len(endpoints) * per_endpoint  # every class reached, no more
    # buckets + +Inf, _count, _sum (and _created) per label set
    assert len(family.samples) <= len(label_sets) * (len(TTFT_CLASS_BUCKETS) + 4)
    assert len(family.samples) <= 2 * 25 * 18  # 900 series at most for one model, 2 endpoints


def _bucket(proxy: ProxyUnderTest, pclass: str, cclass: str, le: float) -> float:
    labels = {"model": MODEL, "endpoint": COMPLETIONS, "prompt_class": pclass,
              "cache_class": cclass, "le": str(le)}  # fmt: skip
    return proxy.sample(f"{HISTOGRAM}_bucket", **labels)


# (prompt tokens, cached tokens sent by the simulator, prompt class, cache class, the
#  bucket the TTFT (PER_TOKEN * prompt tokens, plus the proxy's few ms) must land in).
# Each programmed TTFT sits just above its bucket's lower edge, so a loaded machine's
# extra milliseconds (100 ms and more) still land in the same bucket.
CASES = [
    (600, 0, "0-1k", "none", 0.25),  # 120 ms
    (1500, 0, "1k-4k", "none", 0.5),  # 300 ms
    (1500, 200, "1k-4k", "part", 0.5),
    (1500, 1400, "1k-4k", "most", 0.5),
    (6000, 0, "4k-8k", "none", 2.5),  # 1.2 s
    (15000, 14000, "8k-32k", "most", 5.0),  # 3 s
]


@TIMED(seconds=5.5)
def test_ttft_lands_in_the_bucket_of_its_prompt_and_cache_class(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(
        ttft=0.0, ttft_per_prompt_token=PER_TOKEN, tokens_per_second=2000.0, output_tokens=4,
        max_model_len=100_000,
    )  # fmt: skip
    proxy = start_proxy(sim.url)
    with httpx.Client(timeout=10) as client:
        for tokens, cached, *_ in CASES:
            body = {"model": MODEL, "prompt": "abcd" * tokens, "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            with client.stream(
                "POST", proxy.url + COMPLETIONS, json=body,
                headers={"x-sim-cached-tokens": str(cached)},
            ) as response:  # fmt: skip
                response.read()
                assert response.status_code == 200
    proxy.wait_records(len(CASES))  # each record lands just after its response's last byte
    assert [(r.prompt_tokens, r.cached_prompt_tokens) for r in proxy.records] == [
        (t, c) for t, c, *_ in CASES
    ]
    seen: dict[tuple[str, str], int] = {}
    for _, _, pclass, cclass, le in CASES:
        seen[(pclass, cclass)] = seen.get((pclass, cclass), 0) + 1
        below = TTFT_CLASS_BUCKETS[TTFT_CLASS_BUCKETS.index(le) - 1]
        assert _bucket(proxy, pclass, cclass, below) == 0, (pclass, cclass, below)
    for (pclass, cclass), count in seen.items():
        le = next(c[4] for c in CASES if c[2:4] == (pclass, cclass))
        assert _bucket(proxy, pclass, cclass, le) == count, (pclass, cclass, le)
    prompt = proxy.sample(
        "tokenprobe_time_to_first_token_by_prompt_prompt_tokens_total", model=MODEL,
        endpoint=COMPLETIONS, prompt_class="1k-4k", cache_class="most",
    )  # fmt: skip
    assert prompt == 1500


@TIMED(seconds=3)
def test_bench_input_tokens_sweep_reports_ttft_and_implied_prefill_rate(
    start_sim: Callable[..., Running], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.bench.cli import main

    per_token = 2e-3  # 500 prompt tokens per second of prefill: TTFTs of 128 ms and 1 s,
    # so a loaded machine's few extra milliseconds stay inside the 35% below
    sim = start_sim(
        ttft=0.0, ttft_per_prompt_token=per_token, tokens_per_second=2000.0, output_tokens=4
    )
    tokenizer = build_tiny_tokenizer(tmp_path / "tok")
    out = tmp_path / "sweep.json"
    rc = main(
        ["--url", sim.url + "/v1", "--model", MODEL, "--endpoint", "completions", "--quiet",
         "--tokenizer", str(tokenizer), "--input-tokens", "64,512", "--requests", "4",
         "--max-tokens", "4", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT by input length (--input-tokens)" in text
    rows = {}
    for line in text.split("TTFT by input length")[1].splitlines()[2:4]:
        n, level, prompt, p50, _p95, rate = line.split()
        rows[int(n)] = (level, int(prompt), float(p50) / 1000, float(rate))
    assert set(rows) == {64, 512} and rows[64][0] == "c=1"
    for _, prompt, ttft, rate in rows.values():
        assert ttft == pytest.approx(prompt * per_token, rel=0.5, abs=0.01)
        assert rate == pytest.approx(1 / per_token, rel=0.35)  # the proxy adds a few ms
    assert rows[512][2] > 3 * rows[64][2]  # TTFT grows with the prompt
    import orjson

    doc = orjson.loads(out.read_bytes())
    assert {r["level"] for r in doc["records"]} == {"in=64 c=1", "in=512 c=1"}
    assert doc["config"]["input_tokens"] == [64, 512]
