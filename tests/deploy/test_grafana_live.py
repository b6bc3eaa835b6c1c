"""Every dashboard expression, and every rule, evaluated on a real Prometheus ("no dead panels").

Two sources of metrics:

1. `ContractExporter`: a registry exporting exactly the metric names, labels and bucket
   boundaries the proxy promises (and vLLM's own), fed with traffic of every outcome.
   It runs today and pins the dashboards and rules to that contract: a renamed metric,
   a wrong label or an `le` that is not a bucket boundary leaves a panel or rule empty.
2. The real proxy in front of the simulator, as processes on loopback: skipped until
   `proxy.server.app` exists (see `test_no_dead_panels_with_the_proxy_in_front_of_the_simulator`).
"""

from __future__ import annotations

import base64
import contextlib
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app

from proxy.core.measurement import Measurement
from proxy.sinks.cost import CostSink, parse_prices
from proxy.sinks.metrics import (
    CACHED_RATIO_BUCKETS,
    TURN_GAP_BUCKETS,
    TURNS_BUCKETS,
    UPSTREAM_PROTOCOL_ERRORS,
    cache_class,
    prompt_class,
)
from proxy.sinks.sink import Labels
from tests.deploy.test_grafana import CHECKED, iter_targets, load, substitute
from tests.factories import measurement
from tests.paths import ROOT
from tests.prom import Prometheus, finite_values, require_binary
from tests.servers import ThreadedServer, free_port

RULE_FILES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yaml"))
MODELS = ("llama", "qwen")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
SPEECH = ("/v1/audio/transcriptions", "/v1/audio/translations", "/v1/realtime")

# vLLM's bucket boundaries, which the proxy mirrors.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]  # fmt: skip
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
# The proxy's: vLLM's with finer edges where the figures sit (proxy/core/buckets.py).
TOKEN_ITL_BUCKETS = sorted({*ITL_BUCKETS, 0.0025, 0.005, 0.0075, 0.015, 0.02, 0.03, 0.04})
TOKEN_TTFT_BUCKETS = sorted({*TTFT_BUCKETS, 0.15, 0.2, 0.3, 0.4})
TOKEN_E2E_BUCKETS = sorted({*E2E_BUCKETS, 0.01, 0.025, 0.05, 0.1, 0.2})
TOKEN_BUCKETS = [m * 10**e for e in range(6) for m in (1, 2, 5)]
SPEED_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
TTFT_CLASS_BUCKETS = [0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0]
COST_PER_HOUR = 2.5
OVERHEAD_BUCKETS = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.25, 0.5, 1.0, 2.5]  # fmt: skip
SHARE_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
PER_CHUNK_BUCKETS = [1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0]

#: (code, finish_reason, error_type); successes repeated so they dominate, as in life.
OUTCOMES = [("200", "stop", "none")] * 6 + [
    ("200", "length", "none"),
    ("200", "tool_calls", "none"),
    ("401", "none", "auth"),
    ("400", "none", "context_length"),
    ("429", "none", "rate_limit"),
    ("400", "none", "bad_request"),
    ("404", "none", "not_found"),
    ("502", "none", "upstream_error"),
    ("502", "none", "upstream_unreachable"),
    ("504", "none", "upstream_timeout"),
    ("200", "none", "stream_error"),
    ("200", "none", "stream_truncated"),
    ("200", "none", "client_cancelled"),
]


class ContractExporter:
    """The proxy's metric contract in a registry, fed by a thread until `stop()`."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        me, vl = ["model", "endpoint"], ["model_name", "engine"]

        def hist(name: str, buckets: list[float], labels: list[str] = me) -> Histogram:
            return Histogram(name, "", labels, buckets=buckets, registry=r)

        def counter(name: str, labels: list[str]) -> Counter:
            return Counter(name, "", labels, registry=r)

        def gauge(name: str, labels: list[str]) -> Gauge:
            return Gauge(name, "", labels, registry=r)

        self.ttfb = hist("tokenprobe_time_to_first_byte_seconds", TOKEN_TTFT_BUCKETS)
        self.ttft = hist("tokenprobe_time_to_first_token_seconds", TOKEN_TTFT_BUCKETS)
        self.itl = hist("tokenprobe_inter_token_latency_seconds", TOKEN_ITL_BUCKETS)
        self.tpot = hist("tokenprobe_request_time_per_output_token_seconds", TOKEN_ITL_BUCKETS)
        self.speed = hist("tokenprobe_request_decode_tokens_per_second", SPEED_BUCKETS)
        self.e2e = hist("tokenprobe_e2e_request_latency_seconds", TOKEN_E2E_BUCKETS)
        self.prompt = hist("tokenprobe_request_prompt_tokens", TOKEN_BUCKETS)
        self.generation = hist("tokenprobe_request_generation_tokens", TOKEN_BUCKETS)
        classes = [*me, "prompt_class", "cache_class"]
        self.ttft_class = hist(
            "tokenprobe_time_to_first_token_by_prompt_seconds", TTFT_CLASS_BUCKETS, classes
        )
        self.ttft_class_prompt = counter(
            "tokenprobe_time_to_first_token_by_prompt_prompt_tokens", classes
        )
        gauge("tokenprobe_deployment_cost_per_hour", ["currency"]).labels("USD").set(COST_PER_HOUR)
        self.requests = counter("tokenprobe_requests", [*me, "code", "finish_reason", "error_type"])
        self.prompt_total = counter("tokenprobe_prompt_tokens", [*me, "source"])
        self.generation_total = counter("tokenprobe_generation_tokens", [*me, "source"])
        self.cached_total = counter("tokenprobe_cached_prompt_tokens", me)
        self.cache_write_total = counter("tokenprobe_cache_write_prompt_tokens", me)
        self.in_flight = gauge("tokenprobe_requests_in_flight", me)
        self.lost = counter("tokenprobe_requests_lost", me)
        self.failures = counter("tokenprobe_measurement_failures", ["stage"])
        self.passthrough = counter("tokenprobe_passthrough_requests", ["route", "code"])
        self.audio = counter("tokenprobe_audio_input_seconds", me)
        self.ws_sessions = counter("tokenprobe_websocket_sessions", ["route", "outcome"])
        # serve --slo (proxy/sinks/slo.py): a verdict per judged request.
        self.slo = counter("tokenprobe_slo_requests", [*me, "result"])
        self.slo_cancelled = counter("tokenprobe_slo_cancelled_requests", me)
        self.goodput = counter("tokenprobe_goodput_tokens", me)
        prices = {m: {"input": 0.5, "cached_input": 0.25, "output": 1.5} for m in MODELS}
        self.cost = CostSink(parse_prices({"models": prices}), r)
        # Where the first token's time goes, speculative decoding, cancelled work, overhead.
        self.queue = hist(
            "tokenprobe_engine_queue_time_seconds", TOKEN_E2E_BUCKETS, [*me, "stream"]
        )
        self.engine = hist(
            "tokenprobe_engine_time_to_first_token_seconds", TOKEN_TTFT_BUCKETS, [*me, "stream"]
        )
        self.outside = hist(
            "tokenprobe_time_to_first_token_outside_engine_seconds", [0.0005, *TOKEN_TTFT_BUCKETS]
        )
        self.per_chunk = hist("tokenprobe_request_output_tokens_per_chunk", PER_CHUNK_BUCKETS)
        self.acceptance = hist("tokenprobe_spec_decode_mean_acceptance_length", PER_CHUNK_BUCKETS)
        self.draft = counter("tokenprobe_spec_decode_draft_tokens", me)
        self.accepted = counter("tokenprobe_spec_decode_accepted_tokens", me)
        self.cancelled_prompt = counter("tokenprobe_cancelled_prompt_tokens", [*me, "source"])
        self.cancelled_output = counter("tokenprobe_cancelled_generation_tokens", [*me, "source"])
        self.overhead = hist("tokenprobe_proxy_overhead_seconds", OVERHEAD_BUCKETS)
        self.loop_lag = hist("tokenprobe_event_loop_lag_seconds", OVERHEAD_BUCKETS, [])
        # issue 26: reasoning, answers, tool calls
        self.ttfa = hist("tokenprobe_time_to_first_answer_token_seconds", TOKEN_TTFT_BUCKETS)
        self.ttfr = hist("tokenprobe_time_to_first_reasoning_token_seconds", TOKEN_TTFT_BUCKETS)
        self.reasoning = hist("tokenprobe_reasoning_duration_seconds", TOKEN_TTFT_BUCKETS)
        self.ttftc = hist("tokenprobe_time_to_first_tool_call_seconds", TOKEN_TTFT_BUCKETS)
        self.arguments = hist("tokenprobe_tool_call_arguments_seconds", TOKEN_TTFT_BUCKETS)
        self.calls_per = hist("tokenprobe_tool_calls_per_answer", [1, 2, 3, 4, 6, 8, 16, 32, 64])
        self.share = hist("tokenprobe_request_answer_token_share", SHARE_BUCKETS)
        self.reasoning_tpot = hist(
            "tokenprobe_request_reasoning_time_per_output_token_seconds", TOKEN_ITL_BUCKETS
        )
        self.answer_tpot = hist(
            "tokenprobe_request_answer_time_per_output_token_seconds", TOKEN_ITL_BUCKETS
        )
        self.reasoning_tokens = counter("tokenprobe_reasoning_tokens", [*me, "source"])
        self.without = counter("tokenprobe_requests_without_answer", [*me, "reason"])
        self.tool_calls = counter("tokenprobe_tool_calls", [*me, "outcome"])
        self._conversation_metrics(hist, counter, gauge)
        # Backends (issue 27): Ollama's model load, the backend's identity, broken events.
        self.engine_load = hist(
            "tokenprobe_engine_load_time_seconds", TOKEN_E2E_BUCKETS, [*me, "stream"]
        )
        gauge("tokenprobe_backend_info", ["kind", "version"]).labels("vllm", "0.32.0").set(1)
        self.malformed = counter("tokenprobe_malformed_events", me)
        # A misbehaving backend (issue 32): every kind, one of them seen.
        protocol = counter("tokenprobe_upstream_protocol_errors", ["kind"])
        for kind in UPSTREAM_PROTOCOL_ERRORS:
            protocol.labels(kind=kind).inc(kind == "extra_bytes")
        self.vllm_ttft = hist("vllm:time_to_first_token_seconds", TTFT_BUCKETS, vl)
        self.vllm_itl = hist("vllm:inter_token_latency_seconds", ITL_BUCKETS, vl)
        self.vllm_e2e = hist("vllm:e2e_request_latency_seconds", E2E_BUCKETS, vl)
        self.vllm_running = gauge("vllm:num_requests_running", vl)
        self.vllm_waiting = gauge("vllm:num_requests_waiting", vl)
        self.vllm_kv = gauge("vllm:kv_cache_usage_perc", vl)
        self._rng = random.Random(4)
        self._n = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _conversation_metrics(self, hist: Any, counter: Any, gauge: Any) -> None:
        """Conversations (issue 26): per continuation and per conversation that ended."""
        m, session = ["model"], [0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
        self.continuations = counter("tokenprobe_conversation_continuations", [*m, "via"])
        self.turn_gap = hist(
            "tokenprobe_conversation_turn_gap_seconds", TURN_GAP_BUCKETS, [*m, "via"]
        )
        self.cached_ratio = hist(
            "tokenprobe_continuation_cached_prompt_ratio", CACHED_RATIO_BUCKETS, m
        )
        self.cache_misses = counter("tokenprobe_continuation_cache_misses", m)
        self.turns = hist("tokenprobe_conversation_turns", TURNS_BUCKETS, [])
        self.conversation_times = [
            hist(f"tokenprobe_conversation_{name}_seconds", session, [])
            for name in ("duration", "model", "between_requests")
        ]
        self.conversations_open = gauge("tokenprobe_conversations_open", [])
        self.evictions = counter("tokenprobe_conversation_evictions", [])

    def feed_conversation(self, model: str, n: int) -> None:
        rng = self._rng
        via = ("header", "previous_response", "messages")[n % 3]
        self.continuations.labels(model=model, via=via).inc()
        self.turn_gap.labels(model=model, via=via).observe(rng.uniform(0.05, 20.0))
        ratio = rng.choice([1.0, 0.95, 0.9, 0.0])
        self.cached_ratio.labels(model=model).observe(ratio)
        self.cache_misses.labels(model=model).inc(ratio < 0.5)
        self.turns.observe(rng.randint(1, 12))
        for histogram in self.conversation_times:
            histogram.observe(rng.uniform(1.0, 200.0))
        self.conversations_open.set(rng.randint(1, 50))
        self.evictions.inc(n % 20 == 0)

    def start(self) -> ContractExporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.feed_once()

    def feed_once(self) -> None:
        rng, n = self._rng, self._n
        self._n += 1
        model, endpoint = MODELS[n % 2], ENDPOINTS[(n // 2) % 2]
        code, finish_reason, error_type = OUTCOMES[n % len(OUTCOMES)]
        labels = {"model": model, "endpoint": endpoint}
        trace = {"trace_id": f"{rng.getrandbits(128):032x}"}
        self.requests.labels(
            **labels, code=code, finish_reason=finish_reason, error_type=error_type
        ).inc()
        self.in_flight.labels(**labels).set(rng.randint(0, 8))
        self.lost.labels(**labels).inc(1 if n % 97 == 0 else 0)  # a worker died now and then
        self.passthrough.labels(route="/v1/models", code="200").inc()
        if n % 50 == 0:
            self.failures.labels(stage="observe").inc()
        self.overhead.labels(**labels).observe(rng.uniform(0.0001, 0.002))
        self.loop_lag.observe(rng.uniform(0.0, 0.003))
        if error_type == "client_cancelled":
            self.slo_cancelled.labels(**labels).inc()
        else:
            result = (
                "error" if error_type != "none" else ("met", "met", "met", "ttft", "tpot")[n % 5]
            )
            self.slo.labels(**labels, result=result).inc()
        if error_type == "client_cancelled":
            self.cancelled_prompt.labels(**labels, source="tokenizer").inc(rng.randint(10, 400))
            self.cancelled_output.labels(**labels, source="chunks").inc(rng.randint(1, 40))
        if error_type not in ("none", "stream_error", "stream_truncated", "client_cancelled"):
            self.e2e.labels(**labels).observe(rng.uniform(0.001, 0.05), exemplar=trace)
            return
        output, prompt, cached = rng.randint(2, 800), rng.randint(10, 4000), rng.randint(0, 8) * 16
        ttft, tpot = rng.lognormvariate(-1.5, 0.8), rng.uniform(0.01, 0.08)
        self.ttfb.labels(**labels).observe(ttft * 0.3)
        self.ttft.labels(**labels).observe(ttft, exemplar=trace)
        classes = {"prompt_class": prompt_class(prompt), "cache_class": cache_class(prompt, cached)}
        self.ttft_class.labels(**labels, **classes).observe(ttft)
        self.ttft_class_prompt.labels(**labels, **classes).inc(prompt)
        self.tpot.labels(**labels).observe(tpot, exemplar=trace)
        queue = ttft * rng.uniform(0.0, 0.6)
        prefill = (ttft - queue) * rng.uniform(0.5, 0.95)
        self.queue.labels(**labels, stream="true").observe(queue)
        self.engine.labels(**labels, stream="true").observe(prefill)
        self.outside.labels(**labels).observe(ttft - queue - prefill)
        self.per_chunk.labels(**labels).observe(rng.choice([1.0, 2.5, 3.0]))
        self.acceptance.labels(**labels).observe(rng.uniform(1.5, 3.5))
        self.draft.labels(**labels).inc(21)
        self.accepted.labels(**labels).inc(rng.randint(5, 21))
        for _ in range(5):
            self.itl.labels(**labels).observe(max(0.0, rng.gauss(tpot, tpot / 3)))
        self.speed.labels(**labels).observe(1 / tpot)
        e2e = ttft + tpot * (output - 1)
        self.e2e.labels(**labels).observe(e2e, exemplar=trace)
        speech = {"model": model, "endpoint": SPEECH[n % len(SPEECH)]}
        self.ttft.labels(**speech).observe(ttft, exemplar=trace)
        self.e2e.labels(**speech).observe(e2e, exemplar=trace)
        self.audio.labels(model=model, endpoint="/v1/realtime").inc(e2e * rng.uniform(2, 10))
        self.ws_sessions.labels(route="/v1/realtime", outcome="closed_by_client").inc()
        self._kinds(labels, ttft, tpot, n)
        self.feed_conversation(model, n)
        ollama = {"model": model, "endpoint": "/api/chat"}
        self.engine_load.labels(**ollama, stream="true").observe(rng.choice([0.0, 0.2, 3.5]))
        if n % 7 == 0:
            self.malformed.labels(**ollama).inc()
        self.prompt.labels(**labels).observe(prompt)
        self.generation.labels(**labels).observe(output)
        source = ("usage", "tokenizer", "chunks")[n % 3]
        self.prompt_total.labels(**labels, source=source).inc(prompt)
        self.generation_total.labels(**labels, source=source).inc(output)
        self.goodput.labels(**labels).inc(output // 2)
        self.cached_total.labels(**labels).inc(cached)
        self.cache_write_total.labels(**labels).inc(rng.randint(0, 4) * 16)
        self.cost.record(
            _measurement(model, endpoint, prompt, output, cached, e2e, finish_reason), Labels(model)
        )
        vllm = {"model_name": model, "engine": "0"}
        self.vllm_ttft.labels(**vllm).observe(ttft * 0.9)
        self.vllm_itl.labels(**vllm).observe(tpot * 0.95)
        self.vllm_e2e.labels(**vllm).observe(e2e * 0.97)
        self.vllm_running.labels(**vllm).set(rng.randint(0, 32))
        self.vllm_waiting.labels(**vllm).set(rng.randint(0, 4))
        self.vllm_kv.labels(**vllm).set(rng.random())

    def _kinds(self, labels: dict[str, str], ttft: float, tpot: float, n: int) -> None:
        """One stream's reasoning, answer and tool calls (issue 26)."""
        rng = self._rng
        thinking = rng.uniform(0.5, 8.0)
        self.ttfr.labels(**labels).observe(ttft)
        self.reasoning.labels(**labels).observe(thinking)
        self.ttfa.labels(**labels).observe(ttft + thinking)
        self.share.labels(**labels).observe(rng.uniform(0.05, 0.6))
        self.reasoning_tpot.labels(**labels).observe(tpot)
        self.answer_tpot.labels(**labels).observe(tpot * 1.1)
        source = ("usage", "tokenizer", "events")[n % 3]
        self.reasoning_tokens.labels(**labels, source=source).inc(rng.randint(10, 900))
        if n % 7 == 0:
            self.without.labels(**labels, reason=("length", "stop", "error")[n % 3]).inc()
        self.ttftc.labels(**labels).observe(ttft + thinking * 1.2)
        self.arguments.labels(**labels).observe(rng.uniform(0.05, 2.0))
        self.calls_per.labels(**labels).observe(rng.randint(1, 4))
        outcome = ("complete", "complete", "invalid_arguments", "truncated")[n % 4]
        self.tool_calls.labels(**labels, outcome=outcome).inc()


def _measurement(
    model: str, endpoint: str, prompt: int, output: int, cached: int, e2e: float, finish: str
) -> Measurement:
    return measurement(
        endpoint=endpoint,
        model=model,
        started_at=time.time(),
        ttfb=None,
        ttft=None,
        tpot=None,
        decode_tokens_per_second=None,
        e2e=e2e,
        inter_token_latencies=(),
        prompt_tokens=prompt,
        output_tokens=output,
        cached_prompt_tokens=cached,
        content_events=output,
        finish_reason=finish,
    )


def _with_lifespan(app: Any) -> Any:
    """prometheus_client's ASGI app refuses lifespan events; uvicorn runs with lifespan on."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    return wrapped


@pytest.fixture(scope="module")
def contract_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    require_binary("prometheus")
    exporter = ContractExporter()
    server = ThreadedServer(_with_lifespan(make_asgi_app(exporter.registry))).start()
    exporter.start()
    prom = Prometheus(
        tmp_path_factory.mktemp("prometheus"),
        {"tokenprobe": [f"127.0.0.1:{server.port}"]},
        rule_files=RULE_FILES,
        # the exposition is served from a thread of this test process, which a loaded
        # machine starves: a 1 s scrape timeout then failed scrape after scrape, and every
        # series stayed stale for 10 s (a CI run beside other work)
        scrape_interval="2s",
    )
    try:
        prom.start()
        prom.wait_for_targets_up()
        prom.wait_for("sum(rate(tokenprobe_requests_total[1m])) > 0")
        # Recording rules run every second; alerts read them in the next evaluation.
        prom.wait_for('count({__name__=~".+:.+:.+", __name__!~"vllm:.*"})', timeout=20)
        time.sleep(2)
        yield prom
    finally:
        prom.stop()
        exporter.stop()
        server.stop()


def _targets() -> list[tuple[str, str]]:
    found = []
    for path in CHECKED:
        for panel, target in iter_targets(load(path)):
            found.append((f"{path.stem}: {panel['title']} [{target['refId']}]", target["expr"]))
    return found


TARGETS = _targets()


@pytest.mark.parametrize(("where", "expr"), TARGETS, ids=[w for w, _ in TARGETS])
def test_panel_returns_data_from_the_metric_contract(
    contract_prometheus: Prometheus, where: str, expr: str
) -> None:
    # Asked again for a while: a scrape that outlasts its 1 s timeout (the exposition is
    # large, served from this busy process) marks every series stale until the next one,
    # and a gauge read raw is then empty (a parallel run saw it for the streams in flight).
    try:
        contract_prometheus.wait_for(substitute(expr), lambda r: bool(finite_values(r)), 20)
    except TimeoutError as exc:
        raise AssertionError(f"{where}: no finite value from {substitute(expr)!r}") from exc


def _rule_names(kind: str) -> list[str]:
    names = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            names.extend(rule[kind] for rule in group["rules"] if kind in rule)
    return sorted(set(names))


@pytest.mark.parametrize("record", _rule_names("record"))
def test_recording_rule_has_data(contract_prometheus: Prometheus, record: str) -> None:
    result = contract_prometheus.wait_for(record, finite_values, timeout=10)
    assert finite_values(result)


def test_rules_evaluate_without_errors(contract_prometheus: Prometheus) -> None:
    groups = contract_prometheus.rule_groups()
    rules = [rule for group in groups for rule in group["rules"]]
    assert {r["name"] for r in rules} >= set(_rule_names("record")) | set(_rule_names("alert"))
    broken = [(r["name"], r.get("lastError")) for r in rules if r.get("health") != "ok"]
    assert not broken, broken


def test_latency_exemplars_carry_a_trace_id(contract_prometheus: Prometheus) -> None:
    expr = substitute(
        'histogram_quantile(0.95, sum by (le) (rate(tokenprobe_time_to_first_token_seconds_bucket{model=~"$model"}[$__rate_interval])))'
    )
    now = time.time()
    series = contract_prometheus.query_exemplars(expr, now - 120, now + 1)
    trace_ids = [e["labels"].get("trace_id", "") for s in series for e in s["exemplars"]]
    assert trace_ids and all(re.fullmatch(r"[0-9a-f]{32}", t) for t in trace_ids), series[:1]


# --- The real thing: proxy processes in front of the simulator ---------------------------

#: scenario -> (x-sim-* request headers, request shapes, the error_type the proxy must record);
#: shapes: "all" of SHAPES, "stream" (faults inside a 200 stream), "one" (slow: a timeout).
SCENARIOS: dict[str, tuple[dict[str, str], str, str]] = {
    "ok": ({}, "all", "none"),
    "length": ({"x-sim-finish-reason": "length"}, "all", "none"),
    "auth": ({"x-sim-error": "auth"}, "all", "auth"),
    "context_length": ({"x-sim-error": "context_length"}, "all", "context_length"),
    "rate_limit": ({"x-sim-error": "rate_limit"}, "all", "rate_limit"),
    "bad_request": ({"x-sim-error": "bad_request"}, "all", "bad_request"),
    "not_found": ({"x-sim-error": "not_found"}, "all", "not_found"),
    "upstream_error": ({"x-sim-error": "server_error"}, "all", "upstream_error"),
    "upstream_timeout": ({"x-sim-stall-before-headers": "3"}, "one", "upstream_timeout"),
    "stream_error": ({"x-sim-fault": "error_event", "x-sim-fault-after": "2"}, "stream", "stream_error"),
    "stream_truncated": ({"x-sim-fault": "close_no_done", "x-sim-fault-after": "2"}, "stream", "stream_truncated"),
    # issue 26: reasoning then an answer, cut off while reasoning (max_tokens 16), calls
    # with invalid arguments, and more calls than max_tokens lets finish (one truncated)
    # 5 ms a token (not the stack's 0.5): its answer's four tokens in reads of their own,
    # for the answer-phase TPOT panel, on a loaded machine too (a CI run saw none at 0.5)
    "reasoning": ({"x-sim-reasoning-tokens": "6", "x-sim-output-tokens": "4",
                   "x-sim-tps": "200"}, "stream", "none"),
    "reasoning_cut": ({"x-sim-reasoning-tokens": "40"}, "stream", "none"),
    "tool_calls": ({"x-sim-tool-calls": "2", "x-sim-invalid-tool-calls": "1",
                    "x-sim-output-tokens": "0"}, "stream", "none"),
    "tool_calls_cut": ({"x-sim-tool-calls": "5", "x-sim-output-tokens": "0"}, "stream", "none"),
}  # fmt: skip
#: (endpoint, stream, stream_options.include_usage)
SHAPES = [
    ("/v1/chat/completions", True, True),
    ("/v1/chat/completions", True, False),
    ("/v1/chat/completions", False, False),
    ("/v1/completions", True, True),
    ("/v1/completions", False, False),
]
#: Besides the scenarios: the client leaving mid-stream, and a proxy whose upstream is closed.
OTHER_ERRORS = {"client_cancelled", "upstream_unreachable"}
FIRST_BYTE_TIMEOUT = "2"  # below the upstream_timeout scenario's stall, above the Ollama load


def is_vllm(expr: str) -> bool:
    return re.search(r"\bvllm[:_\[]", expr) is not None


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "proxy", *args]


@contextlib.contextmanager
def _processes(*started: tuple[list[str], str, Path, str]) -> Iterator[None]:
    """Each (args, url, log, ready path) started at once, then each waited for until its
    ready path answers 200; all stopped at the end."""
    processes = []
    try:
        for args, _, log, _ in started:
            with log.open("wb") as out:
                processes.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT))
        for process, (args, url, log, ready_path) in zip(processes, started, strict=True):
            _wait_ready(process, args, url, log, ready_path)
        yield
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=40)  # the proxy drains first
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(
    process: subprocess.Popen[bytes], args: list[str], url: str, log: Path, ready_path: str
) -> None:
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{args} exited:\n{log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + ready_path, timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}{ready_path} not 200 after 30 s")
        time.sleep(0.1)


def _request(
    client: httpx.Client,
    url: str,
    model: str,
    endpoint: str,
    stream: bool,
    usage: bool,
    headers: dict[str, str],
) -> None:
    body: dict[str, Any] = {"model": model, "stream": stream, "max_tokens": 16}
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    with client.stream("POST", url + endpoint, json=body, headers=headers) as response:
        response.read()


def _speech(client: httpx.Client, proxy: str, model: str) -> None:
    """A streamed transcription, a translation and a realtime session of two utterances."""
    from websockets.sync.client import connect

    from proxy.core.wav import pcm16, wav

    files = {"file": ("a.wav", wav(0.5), "audio/wav")}
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        client.post(proxy + path, files=files, data={"model": model, "stream": "true"})
    audio = base64.b64encode(pcm16(0.5)).decode()
    url = proxy.replace("http://", "ws://") + "/v1/realtime"
    with connect(url) as ws:
        ws.recv(timeout=10)
        ws.send(orjson.dumps({"type": "session.update", "model": model}).decode())
        for _ in range(2):
            for event in (
                {"type": "input_audio_buffer.append", "audio": audio},
                {"type": "input_audio_buffer.commit"},
                {"type": "input_audio_buffer.commit", "final": True},
            ):
                ws.send(orjson.dumps(event).decode())
            while "transcription.done" not in str(ws.recv(timeout=10)):
                pass


def _conversation(client: httpx.Client, proxy: str, model: str) -> None:
    """Three turns, each repeating all of the previous one: continuations whose repeated
    prefix (a long system prompt) the simulator's prefix cache reports as cached."""
    messages = [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "hello"}]
    for turn in range(3):
        body = {"model": model, "messages": messages, "max_tokens": 16}
        answer = client.post(proxy + "/v1/chat/completions", json=body).json()
        content = answer["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": content}]
        messages.append({"role": "user", "content": f"and then {turn}?"})


def _ollama(client: httpx.Client, proxy: str, model: str) -> None:
    """Ollama's native chat: a cold model (a load over 1 s, its own part of the split),
    a warm one, and a stream with a line that is not JSON (counted, relayed)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({"x-sim-load-time": "1.1"}, {}, {"x-sim-fault": "malformed"}):
        answer = client.post(proxy + "/api/chat", json=body, headers=headers)
        assert answer.status_code == 200, (headers, answer.status_code, answer.text[:300])


def _drive_traffic(proxy: str, dead_proxy: str, model: str) -> None:
    with ThreadPoolExecutor(2) as beside:
        # The two that wait out a timer, a cold Ollama model's load (1.1 s) and the
        # first-byte timeout (2 s), each beside the rest, on a client of its own.
        waiting = [
            beside.submit(_on_a_client, _ollama, proxy, model),
            beside.submit(_on_a_client, _timeout, proxy, model),
        ]
        with httpx.Client(timeout=30) as client:
            _conversation(client, proxy, model)
            for headers, shapes, _ in SCENARIOS.values():
                chosen = {"all": SHAPES, "stream": [s for s in SHAPES if s[1]], "one": []}
                for endpoint, stream, usage in chosen[shapes]:
                    _request(client, proxy, model, endpoint, stream, usage, headers)
            for _ in range(3):  # the client goes away after the first content of a long answer
                body = {
                    "model": model,
                    "stream": True,
                    "max_tokens": 2000,
                    "messages": [{"role": "user", "content": "a long answer please"}],
                }
                with client.stream(
                    "POST",
                    proxy + "/v1/chat/completions",
                    json=body,
                    headers={"x-sim-output-tokens": "2000", "x-sim-tps": "50"},
                ) as response:
                    for chunk in response.iter_raw():  # leave after the first content chunk
                        if b'"delta":{"content"' in chunk:
                            break
            client.get(proxy + "/v1/models")  # an unmeasured route, passed through
            _speech(client, proxy, model)
            for _ in range(3):
                client.post(
                    dead_proxy + "/v1/chat/completions", json={"model": model, "messages": []}
                )
        for done in waiting:
            done.result()


def _on_a_client(drive: Callable[[httpx.Client, str, str], None], proxy: str, model: str) -> None:
    with httpx.Client(timeout=30) as client:
        drive(client, proxy, model)


def _timeout(client: httpx.Client, proxy: str, model: str) -> None:
    """The scenarios of one request ("one"): a stall the first-byte timeout ends."""
    for headers, shapes, _ in SCENARIOS.values():
        if shapes == "one":
            _request(client, proxy, model, *SHAPES[0], headers)


def _scraped_since(prom: Prometheus, moment: float) -> None:
    """Both proxies scraped whole since `moment` (time.time()): what they counted before it
    is in a sample. (A scrape that timed out marks its series stale: it waits for the next.)"""
    prom.wait_for(
        f'count(timestamp(up{{job="tokenprobe"}} == 1) > {moment:.3f})',
        lambda result: bool(result) and float(result[0]["value"][1]) == 2,
    )


@pytest.fixture(scope="module")
def proxy_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """`tokenprobe sim`, a proxy in front of it, one in front of a closed port, Prometheus."""
    pytest.importorskip("proxy.server.app", reason="proxy.server.app is not written yet")
    require_binary("prometheus")
    tmp = tmp_path_factory.mktemp("stack")
    sim_port, proxy_port, dead_port, closed_port = (free_port() for _ in range(4))
    sim, proxy, dead = (f"http://127.0.0.1:{p}" for p in (sim_port, proxy_port, dead_port))
    sim_args = _cli(
        "sim",
        "--host",
        "127.0.0.1",
        "--port",
        str(sim_port),
        "--ttft",
        "0.01",
        "--tps",
        "2000",
        "--output-tokens",
        "24",
        "--per-request-metrics",  # vLLM's per-request metrics object: the TTFT split
        "--spec-tokens",
        "3",
        "--acceptance-rate",
        "0.67",
        "--prefix-cache",  # cached tokens on the conversation's continuations
        "1000",
    )
    with _processes((sim_args, sim, tmp / "sim.log", "/v1/models")):
        model = httpx.get(sim + "/v1/models").json()["data"][0]["id"]
        prices = tmp / "prices.yaml"
        prices.write_text(yaml.safe_dump({"models": {model: {"input": 1, "output": 2}}}))

        def serve(port: int, upstream: str) -> list[str]:
            return _cli(
                "serve",
                "--upstream",
                upstream,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--prices",
                str(prices),
                "--cost-per-hour",
                str(COST_PER_HOUR),
                "--first-byte-timeout",
                FIRST_BYTE_TIMEOUT,
                "--access-log",
                "off",
                "--slo",  # the SLO row: the simulator's 10 ms TTFT meets it, errors do not
                "ttft=1,tpot=0.05",
                "--conversation-idle",  # conversations end between the traffic rounds
                "1",
            )

        dead_args = serve(dead_port, f"http://127.0.0.1:{closed_port}")
        with (
            _processes(
                (serve(proxy_port, sim), proxy, tmp / "proxy.log", "/readyz"),
                (dead_args, dead, tmp / "dead.log", "/healthz"),
            ),
            Prometheus(
                tmp,
                {
                    "tokenprobe": [f"127.0.0.1:{proxy_port}", f"127.0.0.1:{dead_port}"],
                    "vllm": [f"127.0.0.1:{sim_port}"],
                },
                rule_files=RULE_FILES,
            ) as prom,
        ):
            prom.wait_for('up{job="tokenprobe"} == 1', lambda r: len(r) == 2)
            _drive_traffic(proxy, dead, model)
            _scraped_since(prom, time.time())  # between the two rounds: rate() needs an increase
            _drive_traffic(proxy, dead, model)
            prom.wait_for("sum(rate(tokenprobe_requests_total[1m])) > 0")
            _scraped_since(prom, time.time())  # the last requests (each test waits for the rules)
            yield prom


def _eventually(check: Callable[[], None], timeout: float = 10) -> None:
    """`check` asserted again for a while until it passes. A scrape that outlasts its 1 s
    timeout (a large exposition served from a busy process, a CI run saw it) marks every
    series of that proxy stale until the next scrape succeeds, and the recording rules
    evaluated meanwhile record nothing: for that second the stack reads empty, though
    nothing is wrong. What is wrong stays wrong for the whole wait, and fails."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_the_proxy_records_every_error_type_the_stack_produces(proxy_stack: Prometheus) -> None:
    expected = {error for _, _, error in SCENARIOS.values()} | OTHER_ERRORS

    def check() -> None:
        result = proxy_stack.query("sum by (error_type) (tokenprobe_requests_total)")
        seen = {sample["metric"]["error_type"] for sample in result}
        assert expected <= seen, f"never recorded: {sorted(expected - seen)}"

    _eventually(check)


def test_no_dead_panels_with_the_proxy_in_front_of_the_simulator(proxy_stack: Prometheus) -> None:
    vllm_scraped = bool(proxy_stack.query('count({__name__=~"vllm[:_].+"})'))
    targets = [
        (where, expr) for where, expr in TARGETS if vllm_scraped or not is_vllm(expr)
    ]  # without vLLM, the vLLM row is empty, as its panels say

    def check() -> None:
        dead = [
            f"{where}: {substitute(expr)}"
            for where, expr in targets
            if not finite_values(proxy_stack.query(substitute(expr)))
        ]
        assert not dead, "panels without data:\n" + "\n".join(dead)

    _eventually(check)


def test_the_first_token_shares_count_an_ollama_models_load(proxy_stack: Prometheus) -> None:
    """An Ollama model's load is a part of its first token's time: the share panel once
    divided by queue + engine + outside alone, so for a cold model those added up to 100%
    of a first token that was mostly the load. Selected on Ollama's chat (a cold model in
    this stack), the load has its share, and the shares add up to 1."""
    dashboard = load(ROOT / "grafana" / "dashboards" / "tokenprobe.json")
    targets = {
        target["legendFormat"]: target["expr"]
        for panel, target in iter_targets(dashboard)
        if panel["title"] == "First token: share of each part"
    }

    def check() -> None:
        shares = {
            legend: sum(
                finite_values(proxy_stack.query(substitute(expr, {"endpoint": "/api/chat"})))
            )
            for legend, expr in targets.items()
        }
        assert shares["{{model}} model load"] > 0.5, shares  # the stack's cold load: over 1 s
        assert sum(shares.values()) == pytest.approx(1.0), shares

    _eventually(check)


def test_recording_rules_have_data_from_the_proxy(proxy_stack: Prometheus) -> None:
    def check() -> None:
        names = _rule_names("record")
        empty = [name for name in names if not finite_values(proxy_stack.query(name))]
        assert not empty, empty

    _eventually(check)


def _targets_of(title_start: str) -> list[str]:
    dashboard = load(ROOT / "grafana" / "dashboards" / "tokenprobe.json")
    return [
        target["expr"]
        for panel, target in iter_targets(dashboard)
        if panel["title"].startswith(title_start)
    ]


def test_the_prefill_rate_panel_draws_no_unknown_prompt_class(proxy_stack: Prometheus) -> None:
    """A prompt of unknown size counts no prompt tokens: its class drew a line at 0 tok/s
    (a review). The stack has such first tokens (streams without usage)."""
    unknown = 'tokenprobe_time_to_first_token_by_prompt_seconds_count{prompt_class="unknown"}'
    (expr,) = _targets_of("Implied prefill rate by prompt size")

    def check() -> None:
        assert proxy_stack.query(unknown), "the stack made no first token of unknown prompt size"
        drawn = {s["metric"].get("prompt_class") for s in proxy_stack.query(substitute(expr))}
        assert drawn and "unknown" not in drawn, drawn

    _eventually(check)


def test_a_worker_death_has_its_panel_with_the_errors(proxy_stack: Prometheus) -> None:
    """The TokenprobeWorkerRequestsLost alert fired and no panel showed the loss (a review).
    The panel sits in the outcomes row, and reads the proxy's series (0: nobody died)."""
    dashboard = load(ROOT / "grafana" / "dashboards" / "tokenprobe.json")
    rows = sorted(
        (p["gridPos"]["y"], p["title"]) for p in dashboard["panels"] if p["type"] == "row"
    )
    lost = [
        (panel, target["expr"])
        for panel, target in iter_targets(dashboard)
        if "tokenprobe_requests_lost_total" in target["expr"]
    ]
    assert lost, "no panel reads tokenprobe_requests_lost_total"
    for panel, expr in lost:
        row = [title for y, title in rows if y < panel["gridPos"]["y"]][-1]
        assert row.startswith("Outcomes"), (panel["title"], row)

        def check(expr: str = expr) -> None:
            values = finite_values(proxy_stack.query(substitute(expr)))
            assert values and set(values) == {0.0}, values

        _eventually(check)
