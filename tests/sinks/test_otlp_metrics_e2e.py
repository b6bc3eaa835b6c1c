"""OTLP metrics end to end: `tokenprobe serve` (a real process) in front of the simulator,
exporting to an in-process OTLP receiver (HTTP and gRPC); what arrives is compared with
the same proxy's own /metrics for the same requests."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from proxy.sinks.otlp import DURATION_BUCKETS, TOKEN_BUCKETS
from tests.conftest import MODEL, Running
from tests.otlp_receiver import (
    GrpcMetricsReceiver,
    MetricExports,
    OtlpReceiver,
    ReceivedPoint,
    points,
)
from tests.scrape import scrape
from tests.servers import free_port, serve, spawn, stop, wait_http

SECRET = "sk-secret-do-not-export-4242"
#: The duration, first-chunk and per-chunk histograms of each name set (proxy/sinks/
#: semconv.py): the current names by default, the previous ones with the switch.
CURRENT = (
    "gen_ai.client.inference.duration",
    "gen_ai.client.inference.time_to_first_chunk",
    "gen_ai.client.inference.time_per_output_chunk",
)
PREVIOUS = (
    "gen_ai.client.operation.duration",
    "gen_ai.client.operation.time_to_first_chunk",
    "gen_ai.client.operation.time_per_output_chunk",
)
GENAI = CURRENT
SWITCH = {"current": {}, "previous": {"OTEL_SEMCONV_STABILITY_OPT_IN": "gen_ai_previous"}}


def tokens(found: list[ReceivedPoint], kind: str) -> float:
    """Input or output tokens as whichever name set arrived counts them: the current
    counters (gen_ai.client.inference.usage.*), else the previous histogram's sum."""
    current = f"gen_ai.client.inference.usage.{kind}_tokens"
    if any(p.metric == current for p in found):
        return total(found, current, "sum")
    return total(found, "gen_ai.client.token.usage", "sum", **{"gen_ai.token.type": kind})


@contextmanager
def tokenprobe(upstream: str, env: dict[str, str], *args: str) -> Iterator[str]:
    port = free_port()
    process = spawn(
        "serve",
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--model-allowlist",
        MODEL,
        "--models-refresh",
        "0",
        "--access-log",
        "off",
        *args,
        env={"OTEL_METRICS_EXPORTER": "otlp", "OTEL_METRIC_EXPORT_INTERVAL": "100", **env},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz")
        yield base
    finally:
        stop(process)


def send_requests(base: str) -> None:
    """Three streamed chats, one streamed completion, one non-streamed chat, one failure."""
    secret = {"authorization": f"Bearer {SECRET}", "x-api-key": SECRET}
    with httpx.Client(base_url=base, headers=secret, timeout=30) as client:
        for _ in range(3):
            body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        body = {"model": MODEL, "stream": True, "prompt": "once upon a time"}
        assert client.post("/v1/completions", json=body).status_code == 200
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        body = {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 404


def latest(exports: list[Any]) -> list[ReceivedPoint]:
    """The newest export's points (cumulative temporality: each export holds every total)."""
    return points(exports[-1])


def total(found: list[ReceivedPoint], metric: str, field: str = "count", **attrs: Any) -> float:
    return sum(
        getattr(p, field)
        for p in found
        if p.metric == metric and all(p.attributes.get(k) == v for k, v in attrs.items())
    )


def wait_for_requests(
    exports: MetricExports, n: int, duration: str = GENAI[0]
) -> list[ReceivedPoint]:
    def arrived(requests: list[Any]) -> bool:
        return bool(requests) and total(points(requests[-1]), duration) >= n

    return latest(exports.wait_for(arrived))


def check_against_prometheus(
    found: list[ReceivedPoint], prom: dict[str, float], genai: tuple[str, ...] = GENAI
) -> None:
    duration, ttft, chunk = genai
    assert total(found, duration) == prom["tokenprobe_e2e_request_latency_seconds_count"] == 6
    assert total(found, duration, "sum") == pytest.approx(
        prom["tokenprobe_e2e_request_latency_seconds_sum"], abs=1e-6
    )
    # Token totals exactly.
    assert tokens(found, "input") == prom["tokenprobe_prompt_tokens_total"]
    assert tokens(found, "output") == prom["tokenprobe_generation_tokens_total"]
    assert prom["tokenprobe_generation_tokens_total"] > 0
    # TTFT: the four streams, to the microsecond.
    assert total(found, ttft) == prom["tokenprobe_time_to_first_token_seconds_count"] == 4
    assert total(found, ttft, "sum") == pytest.approx(
        prom["tokenprobe_time_to_first_token_seconds_sum"], abs=1e-6
    )
    assert total(found, chunk) == prom["tokenprobe_inter_token_latency_seconds_count"] > 0
    assert total(found, chunk, "sum") == pytest.approx(
        prom["tokenprobe_inter_token_latency_seconds_sum"], abs=1e-6
    )
    assert total(found, "tokenprobe.requests", "sum") == 6
    for otlp, prometheus in (
        ("tokenprobe.time_to_first_byte", "tokenprobe_time_to_first_byte_seconds"),
        ("tokenprobe.time_per_output_token", "tokenprobe_request_time_per_output_token_seconds"),
        ("tokenprobe.decode_speed", "tokenprobe_request_decode_tokens_per_second"),
    ):
        assert total(found, otlp) == prom[prometheus + "_count"] > 0, otlp
        assert total(found, otlp, "sum") == pytest.approx(prom[prometheus + "_sum"], abs=1e-6)


def check_conventions(
    found: list[ReceivedPoint], sim: Running, genai: tuple[str, ...] = GENAI
) -> None:
    duration, ttft, _ = genai
    previous = genai == PREVIOUS
    # Only the names of the set asked for arrive.
    other = ("gen_ai.client.inference.",) if previous else ("gen_ai.client.operation.",
                                                            "gen_ai.client.token.")  # fmt: skip
    assert not [p.metric for p in found if p.metric.startswith(other)]
    usage = "gen_ai.client.token.usage"
    histograms = {*genai, usage} if previous else {
        *genai, "gen_ai.client.inference.operation.input_tokens",
        "gen_ai.client.inference.operation.output_tokens",
    }  # fmt: skip
    counters = set() if previous else {
        "gen_ai.client.inference.usage.input_tokens",
        "gen_ai.client.inference.usage.output_tokens",
    }  # fmt: skip
    assert histograms | counters <= {p.metric for p in found}
    sim_port = int(sim.url.rsplit(":", 1)[1])
    for p in found:
        if p.metric in histograms | counters:
            assert p.temporality == 2  # cumulative, the default
            assert p.unit == ("s" if p.metric in genai else "{token}")
            assert p.attributes["gen_ai.provider.name"] == "openai"
            assert p.attributes["gen_ai.operation.name"] in ("chat", "text_completion")
            assert p.attributes["server.address"] == "127.0.0.1"
            assert p.attributes["server.port"] == sim_port
            assert p.resource["service.name"] == "tokenprobe"
            assert p.resource["service.instance.id"]
        if p.metric in histograms:
            assert p.kind == "histogram"
            bounds = DURATION_BUCKETS if p.metric in genai else TOKEN_BUCKETS
            assert p.explicit_bounds == bounds
            assert len(p.bucket_counts) == len(bounds) + 1
            assert sum(p.bucket_counts) == p.count
        if p.metric in counters:  # the conventions require the modality on every point
            assert p.kind == "sum" and p.monotonic
            assert p.attributes["gen_ai.token.modality"] == "unknown"
    assert DURATION_BUCKETS == (
        0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
    )  # fmt: skip
    assert TOKEN_BUCKETS[0] == 1 and TOKEN_BUCKETS[-1] == 67108864
    ok = [p for p in found if p.metric == duration and "error.type" not in p.attributes]
    assert {p.attributes["gen_ai.operation.name"] for p in ok} == {"chat", "text_completion"}
    assert {p.attributes["gen_ai.request.model"] for p in ok} == {MODEL}
    assert {p.attributes["gen_ai.response.model"] for p in ok} == {MODEL}
    assert {p.attributes["tokenprobe.model"] for p in ok} == {MODEL}
    (failed,) = [p for p in found if p.metric == duration and "error.type" in p.attributes]
    assert failed.attributes["error.type"] == "not_found"
    # "no-such-model" is not vouched for: no gen_ai.request.model (never the label's
    # "other", which no client requested), the label as tokenprobe.model
    assert "gen_ai.request.model" not in failed.attributes
    assert failed.attributes["tokenprobe.model"] == "other"
    if not previous:  # the failure's per-request token points: 0, with its error.type
        for kind in ("input", "output"):
            metric = f"gen_ai.client.inference.operation.{kind}_tokens"
            (point,) = [p for p in found if p.metric == metric and "error.type" in p.attributes]
            assert (point.count, point.sum) == (1, 0)
            assert point.attributes["error.type"] == "not_found"
    if previous:
        assert {p.attributes["gen_ai.token.type"] for p in found if p.metric == usage} == {
            "input",
            "output",
        }
    assert total(found, ttft, **{"gen_ai.operation.name": "text_completion"}) == 1


@pytest.mark.parametrize("names", SWITCH)
def test_genai_metrics_over_otlp_http_match_prometheus(sim: Running, names: str) -> None:
    genai = CURRENT if names == "current" else PREVIOUS
    receiver = OtlpReceiver()
    with serve(receiver) as collector:
        env = {
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": collector.url + "/v1/metrics",
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
            **SWITCH[names],
        }
        with tokenprobe(sim.url, env) as base:
            send_requests(base)
            prom = scrape(base).totals()
            found = wait_for_requests(receiver.metrics, 6, genai[0])
    check_against_prometheus(found, prom, genai)
    check_conventions(found, sim, genai)
    assert receiver.spans == []  # metrics only: traces stay off without their variables
    raw = b"".join(receiver.metrics.raw)
    assert SECRET.encode() not in raw and b"Bearer" not in raw


def test_genai_metrics_over_otlp_grpc(sim: Running) -> None:
    with GrpcMetricsReceiver() as receiver:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "cumulative",
        }
        with tokenprobe(sim.url, env) as base:
            send_requests(base)
            prom = scrape(base).totals()
            found = wait_for_requests(receiver.metrics, 6)
    check_against_prometheus(found, prom)
    check_conventions(found, sim)
    assert SECRET.encode() not in b"".join(receiver.metrics.raw)


def test_embeddings_arrive_as_embeddings_metrics_without_output(sim: Running) -> None:
    """gen_ai.operation.name "embeddings": gen_ai.client.embeddings.duration and
    .operation.input_tokens (semantic-conventions-genai docs/gen-ai/client-embeddings.md @
    88eccb15, which defines no output metric), none of the inference histograms, no output
    counter; a chat beside it keeps the inference names."""
    receiver = OtlpReceiver()
    with serve(receiver) as collector:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url}
        with tokenprobe(sim.url, env) as base, httpx.Client(base_url=base, timeout=30) as client:
            body = {"model": MODEL, "input": "hello world", "encoding_format": "float"}
            assert client.post("/v1/embeddings", json=body).status_code == 200
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
            prom = scrape(base).totals()

            def both(requests: list[Any]) -> bool:
                found = points(requests[-1]) if requests else []
                return (
                    total(found, "gen_ai.client.embeddings.duration") == 1 == total(found, GENAI[0])
                )

            found = latest(receiver.metrics.wait_for(both))
    embeddings = {p.metric for p in found if p.attributes.get("gen_ai.operation.name") ==
                  "embeddings" and p.metric.startswith("gen_ai.")}  # fmt: skip
    assert embeddings == {
        "gen_ai.client.embeddings.duration",
        "gen_ai.client.embeddings.operation.input_tokens",
        "gen_ai.client.inference.usage.input_tokens",  # the token total, one counter
    }
    (tokens,) = [p for p in found if p.metric == "gen_ai.client.embeddings.operation.input_tokens"]
    assert tokens.unit == "{token}" and tokens.explicit_bounds == TOKEN_BUCKETS
    assert tokens.count == 1 and tokens.sum > 0
    (duration,) = [p for p in found if p.metric == "gen_ai.client.embeddings.duration"]
    assert duration.unit == "s" and duration.explicit_bounds == DURATION_BUCKETS
    assert duration.sum == pytest.approx(
        prom["tokenprobe_e2e_request_latency_seconds_sum"] - total(found, GENAI[0], "sum"),
        abs=1e-6,
    )


def test_delta_temporality_exports_each_interval_once(sim: Running) -> None:
    receiver = OtlpReceiver()
    with serve(receiver) as collector:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
            "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "delta",
        }
        with tokenprobe(sim.url, env) as base:
            send_requests(base)
            prom = scrape(base).totals()

            def all_six(requests: list[Any]) -> bool:
                every = [p for r in requests for p in points(r)]
                return total(every, GENAI[0]) >= 6

            exports = receiver.metrics.wait_for(all_six)
    every = [p for r in exports for p in points(r) if p.metric != "tokenprobe.requests.in_flight"]
    assert {p.temporality for p in every} == {1}  # delta
    check_against_prometheus(every, prom)


async def _slow_collector(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Takes every export and answers only after the exporter's 1 s timeout, never in time."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await asyncio.sleep(2.5)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("collector", ["dead", "slow"])
def test_a_dead_or_slow_collector_blocks_no_stream_and_its_losses_are_counted(
    sim: Running, collector: str
) -> None:
    with contextlib.ExitStack() as stack:
        if collector == "slow":
            url = stack.enter_context(serve(_slow_collector)).url
        else:
            url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
        base = stack.enter_context(tokenprobe(sim.url, env))
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        took = []
        for _ in range(5):  # while exports fail in the background
            started = time.monotonic()
            response = httpx.post(base + "/v1/chat/completions", json=body, timeout=10)
            assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
            took.append(time.monotonic() - started)
        # 16 tokens at 200/s after 50 ms: about 0.13 s. An export every 100 ms, each held
        # until the 1 s timeout: were they on the event loop, every stream would wait 1 s or
        # more. The median, not each: a loaded CI machine once stalled one stream 0.94 s.
        assert sorted(took)[2] < 0.9, took

        deadline = time.monotonic() + 20
        while scrape(base).total("tokenprobe_metric_export_failures_total") < 1:
            assert time.monotonic() < deadline, "no export failure counted"
            time.sleep(0.05)  # the export thread retries until its 1 s timeout


def test_without_the_variables_the_metrics_sdk_is_not_even_imported() -> None:
    code = (
        "import sys; from proxy.server.assemble import assemble; from proxy.settings import "
        "Settings; assemble(Settings(upstream='http://127.0.0.1:9', access_log='off'), "
        "{'OTEL_EXPORTER_OTLP_ENDPOINT': 'http://127.0.0.1:9'}); "
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.metrics', "
        "'proxy.sinks.otlp', 'opentelemetry.exporter.otlp.proto.http.metric'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_each_worker_exports_its_own_series_under_its_own_instance_id(
    start_sim: Any,
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=2)
    receiver = OtlpReceiver()
    with serve(receiver) as collector:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url}
        with tokenprobe(sim.url, env, "--workers", "2") as base:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            sent = 0

            def instances() -> dict[str, list[ReceivedPoint]]:
                """The newest export of each worker, by service.instance.id."""
                newest: dict[str, list[ReceivedPoint]] = {}
                for request in receiver.metrics.requests:
                    found = points(request)
                    if found:
                        newest[found[0].resource["service.instance.id"]] = found
                return newest

            # New connections until both workers have answered some (the kernel decides).
            while sent < 400 and len(instances()) < 2:
                for _ in range(10):
                    assert httpx.post(base + "/v1/chat/completions", json=body).status_code == 200
                sent += 10
                time.sleep(0.2)  # an export interval
            prom = scrape(base).totals()  # the workers' values summed

            def all_exported(_: list[Any]) -> bool:
                return sum(total(p, GENAI[0]) for p in instances().values()) >= sent

            receiver.metrics.wait_for(all_exported)
            newest = instances()
    assert len(newest) == 2, f"{sent} requests all went to one worker"
    assert sum(total(p, GENAI[0]) for p in newest.values()) == sent
    assert prom["tokenprobe_e2e_request_latency_seconds_count"] == sent
    output = sum(tokens(p, "output") for p in newest.values())
    # each answer's 2 text tokens and the EOS that ends it (vLLM's usage counts it)
    assert output == prom["tokenprobe_generation_tokens_total"] == 3 * sent


@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["one", "workers"])
def test_what_is_left_is_exported_when_the_proxy_stops(
    sim: Running, workers: tuple[str, ...]
) -> None:
    """Each process exports its last interval on the way out; with `--workers`, a worker is
    ended by the SIGTERM uvicorn raises again after its shutdown, so the export runs in the
    app's shutdown (before, the workers' last minute of figures was lost on every stop)."""
    receiver = OtlpReceiver()
    with serve(receiver) as collector:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
            "OTEL_METRIC_EXPORT_INTERVAL": "600000",
        }
        with tokenprobe(sim.url, env, *workers) as base:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            assert httpx.post(base + "/v1/chat/completions", json=body).status_code == 200
            assert receiver.metrics.requests == []  # the first interval is ten minutes away
        # Stopped (SIGTERM): the last export ran on the way out.

        def exported(requests: list[Any]) -> bool:
            return sum(total(points(r), GENAI[0]) for r in requests) >= 1

        exports = receiver.metrics.wait_for(exported)
    assert sum(total(points(r), GENAI[0]) for r in exports) == 1


def test_the_ttft_split_and_proxy_overhead_match_prometheus(start_sim: Any) -> None:
    sim = start_sim(
        ttft=0.05,
        tokens_per_second=200.0,
        output_tokens=12,
        per_request_metrics=True,
        max_num_seqs=1,
    )
    receiver = OtlpReceiver()
    with (
        serve(receiver) as collector,
        tokenprobe(sim.url, {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url}) as base,
    ):
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}

        statuses: list[int] = []
        # Three at once against one slot: two of them queue. Each client is made before
        # they all go at a barrier, and each answer holds the slot for 0.25 s (40 tokens
        # at 200/s), so the two that wait queue for 0.25 and 0.5 s, unless their starts
        # are further apart than a whole answer.
        barrier = threading.Barrier(3)
        longer = {"x-sim-output-tokens": "40"}

        def chat() -> None:
            with httpx.Client(timeout=30) as client:
                barrier.wait(timeout=30)
                reply = client.post(base + "/v1/chat/completions", json=body, headers=longer)
            statuses.append(reply.status_code)

        threads = [threading.Thread(target=chat) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert statuses == [200, 200, 200]
        plain = {**body, "stream": False}
        assert httpx.post(base + "/v1/chat/completions", json=plain, timeout=30).is_success
        prom = scrape(base).totals()
        found = wait_for_requests(receiver.metrics, 4)
    for otlp, prometheus, n in (
        ("tokenprobe.engine.queue_time", "tokenprobe_engine_queue_time_seconds", 4),
        (
            "tokenprobe.engine.time_to_first_token",
            "tokenprobe_engine_time_to_first_token_seconds",
            4,
        ),
        (
            "tokenprobe.time_to_first_token.outside_engine",
            "tokenprobe_time_to_first_token_outside_engine_seconds",
            3,
        ),
        ("tokenprobe.proxy_overhead", "tokenprobe_proxy_overhead_seconds", 4),
        ("tokenprobe.output_tokens_per_chunk", "tokenprobe_request_output_tokens_per_chunk", 3),
    ):
        assert total(found, otlp) == prom[prometheus + "_count"] == n, otlp
        assert total(found, otlp, "sum") == pytest.approx(prom[prometheus + "_sum"], abs=1e-6)
    assert total(found, "tokenprobe.engine.queue_time", "sum") > 0.05  # two streams waited
