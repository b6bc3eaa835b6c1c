"""The conversation figures over OTLP: `tokenprobe serve` (a real process) in front of the
simulator with its prefix cache, exporting to an in-process OTLP receiver; two
conversations (one recognised by its messages, one by its header, one continuation the
backend did not cache), and what arrives equals the same proxy's /metrics, count for
count and sum for sum."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL, Running
from tests.otlp_receiver import OtlpReceiver, ReceivedPoint, points
from tests.scrape import wait_for
from tests.servers import serve
from tests.sinks.test_otlp_metrics_e2e import tokenprobe, total

IDLE = 1.0  # --conversation-idle: well over the sleeps, so no conversation closes early
#: (OTLP name, Prometheus name) of each histogram the conversations export.
HISTOGRAMS = (
    ("tokenprobe.conversation.turn_gap", "tokenprobe_conversation_turn_gap_seconds"),
    ("tokenprobe.continuation.cached_prompt_ratio", "tokenprobe_continuation_cached_prompt_ratio"),
    ("tokenprobe.conversation.turns", "tokenprobe_conversation_turns"),
    ("tokenprobe.conversation.duration", "tokenprobe_conversation_duration_seconds"),
    ("tokenprobe.conversation.model_time", "tokenprobe_conversation_model_seconds"),
    (
        "tokenprobe.conversation.between_requests",
        "tokenprobe_conversation_between_requests_seconds",
    ),
)
COUNTERS = (
    ("tokenprobe.conversation.continuations", "tokenprobe_conversation_continuations_total"),
    ("tokenprobe.continuation.cache_misses", "tokenprobe_continuation_cache_misses_total"),
)


def chat(client: httpx.Client, messages: list[Any], **headers: str) -> None:
    body = {
        "model": MODEL,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        response.read()


def test_conversation_figures_over_otlp_equal_prometheus(
    start_sim: Callable[..., Running],
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=4, prefix_cache=1000)
    sim.app.config.prefix_cache_block = 1  # cached tokens exactly the shared prefix
    sim.app.prefix_cache.block = 1
    receiver = OtlpReceiver()
    flags = ("--conversation-idle", str(IDLE), "--conversation-header", "x-session-id")
    with (
        serve(receiver) as collector,
        tokenprobe(sim.url, {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url}, *flags) as base,
        httpx.Client(base_url=base, timeout=30) as client,
    ):
        # Three turns recognised by their messages, 0.2 s and 0.3 s of "tool" between.
        messages: list[Any] = [{"role": "user", "content": "Weather in Oslo, and in Bergen?"}]
        for sleep in (0.2, 0.3, None):
            chat(client, messages)
            if sleep is None:
                break
            time.sleep(sleep)
            messages += [
                {"role": "assistant", "content": "Rain."},
                {"role": "user", "content": f"And after {sleep} s?"},
            ]
        # Two turns of one header; the second reached a backend that recomputed it all.
        other = [{"role": "user", "content": "Tell me about Lisbon."}]
        chat(client, other, **{"x-session-id": "sess-lisbon"})
        time.sleep(0.1)
        other += [{"role": "assistant", "content": "Hills."}, {"role": "user", "content": "?"}]
        chat(client, other, **{"x-session-id": "sess-lisbon", "x-sim-cached-tokens": "0"})

        ended = "tokenprobe_conversation_turns_count"  # observed when a conversation goes idle
        prom = wait_for(base, ended, 2, timeout=20 * IDLE, every=0.1)
        assert prom.total(ended) >= 2, "the conversations never went idle"

        def closed(exports: list[Any]) -> bool:  # an export taken after that scrape
            if not exports:
                return False
            last = points(exports[-1])
            return total(last, HISTOGRAMS[2][0]) >= 2 and total(
                last, COUNTERS[0][0], "sum"
            ) >= prom.total(COUNTERS[0][1])

        found: list[ReceivedPoint] = points(receiver.metrics.wait_for(closed)[-1])
        raw = b"".join(receiver.metrics.raw)

    # The programmed truth first: 5 requests, 2 conversations of 3 and 2 turns, 3
    # continuations (2 by messages, 1 by header), one of them a miss.
    assert prom.total("tokenprobe_conversation_continuations_total") == 3
    assert prom.total("tokenprobe_conversation_turns_sum") == 5
    assert prom.total("tokenprobe_continuation_cache_misses_total") == 1
    for otlp, prometheus in HISTOGRAMS:
        count = prom.total(prometheus + "_count")
        assert count > 0, prometheus
        assert total(found, otlp) == count, otlp
        assert total(found, otlp, "sum") == pytest.approx(
            prom.total(prometheus + "_sum"), abs=1e-6
        ), otlp
    for otlp, prometheus in COUNTERS:
        assert total(found, otlp, "sum") == prom.total(prometheus), otlp
    # By how each continuation was recognised, as Prometheus's via label says.
    for via in ("messages", "header"):
        attrs = {"tokenprobe.conversation.via": via}
        gaps = "tokenprobe_conversation_turn_gap_seconds"
        assert total(found, HISTOGRAMS[0][0], **attrs) == prom.total(gaps + "_count", via=via)
        assert total(found, HISTOGRAMS[0][0], "sum", **attrs) == pytest.approx(
            prom.total(gaps + "_sum", via=via), abs=1e-6
        )
    assert total(found, HISTOGRAMS[0][0], "sum") >= 0.2 + 0.3 + 0.1  # the sleeps, at least
    # The same buckets: the turns histogram's bounds and counts are Prometheus's.
    (turns,) = [p for p in found if p.metric == "tokenprobe.conversation.turns"]
    cumulative = [sum(turns.bucket_counts[: i + 1]) for i in range(len(turns.explicit_bounds))]
    for bound, n in zip(turns.explicit_bounds, cumulative, strict=True):
        assert n == prom.total("tokenprobe_conversation_turns_bucket", le=str(bound)), bound
    # A closed conversation is no request: server.* only; a continuation names its model.
    assert set(turns.attributes) == {"server.address", "server.port"}
    (ratio,) = [p for p in found if p.metric == "tokenprobe.continuation.cached_prompt_ratio"]
    assert ratio.attributes["gen_ai.request.model"] == MODEL
    assert ratio.unit == "1"
    assert b"sess-lisbon" not in raw  # the header's value is never exported
