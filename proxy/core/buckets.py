"""Histogram bucket boundaries: part of what a figure means, so they live in the core.

The Prometheus sink observes into them and the bench client's `--compare-metrics` bins
its own records with the same edges, so the two compare bucket for bucket.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

# vLLM's boundaries (vLLM 0.32: vllm/v1/metrics/buckets.py), each kept, so the two can be
# compared edge for edge, with finer edges where the figures sit.
# fmt: off
# Time to first token: vLLM's TIME_TO_FIRST_TOKEN_BUCKETS with 0.15, 0.2, 0.3 and 0.4 s.
# vLLM's have nothing between 0.1 and 0.25, so a steady 202 ms read as a p50 of 175 ms
# (review), and 190 ms and 240 ms read the same; 2.5 stays for the recording rules.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# Time per output token and between tokens: vLLM's edges (INTER_TOKEN_LATENCY_BUCKETS), with
# the 2.5-40 ms where today's decoders run split finer. vLLM's alone put everything under
# 10 ms in one bucket and 10-25 ms in the next, so a steady 20 ms read as a p50 of 17.5 ms
# and any decoder above 100 tokens/s as 5 ms (review); every vLLM edge is kept, so the two
# still compare edge for edge, and 0.1 stays for the recording rules.
TOKEN_LATENCY_BUCKETS = (0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                         0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
# End to end: vLLM's REQUEST_LATENCY_BUCKETS, which start at 0.3 s, with 0.01-0.2 s below:
# an embedding or a short answer from a nearby backend ends in tens of milliseconds.
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
               15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Sub-millisecond resolution matters for the time to first byte of a nearby backend.
TTFB_BUCKETS = (0.0005, *TTFT_BUCKETS)
DECODE_SPEED_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0,
                        200.0, 300.0, 500.0, 1000.0, 2000.0)
# A WebSocket session lasts from a fraction of a second (a refusal) to hours (a realtime call).
WS_SESSION_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                      3600.0, 7200.0, 14400.0, 43200.0)
# vLLM observes its request queue time into its request-time buckets: the e2e ones above.
QUEUE_TIME_BUCKETS = E2E_BUCKETS
# The proxy's own time and the event loop's lag: tens of microseconds to a stall.
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.25, 0.5, 1.0, 2.5)
# Output tokens per content event: 1 without speculative decoding, up to k + 1 with it.
TOKENS_PER_CHUNK_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
# Mean acceptance length: tokens per verify step, the bonus token included.
ACCEPTANCE_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
# fmt: on


def token_buckets(max_value: int = 1_000_000) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to max_value."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        exponent += 1


def bucket_counts(bounds: Sequence[float], values: Sequence[float]) -> list[int]:
    """How many of `values` fall in each bucket of ascending upper `bounds` (a value on a
    bound counts in that bucket, Prometheus's `le`), with one slot more for values above
    the last bound. A stream's chunk gaps are tens to thousands of values that land in a
    few buckets: one bisect each, then one add per bucket touched instead of per value."""
    counts = [0] * (len(bounds) + 1)
    for value in values:
        counts[bisect_left(bounds, value)] += 1  # the first bound >= value
    return counts
