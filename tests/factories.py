"""Measurement records for tests: one consistent default record, changed by keyword.

The default is a successful streamed chat request whose numbers agree with each other:
16 output tokens, the first at 50 ms, then 15 gaps of 5 ms (tpot 5 ms, 200 tokens/s),
so the last token lands at e2e = 125 ms. A test overrides only the fields it is about,
so what it pins stays visible at the call site.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proxy.core.measurement import Measurement, TokenSource
from proxy.core.request import CHAT

DEFAULT = Measurement(
    endpoint=CHAT,
    model="sim-model",
    stream=True,
    stream_requested=True,
    status_code=200,
    started_at=1_700_000_000.0,
    ttfb=0.010,
    ttft=0.050,
    tpot=0.005,
    decode_tokens_per_second=200.0,
    e2e=0.125,
    inter_token_latencies=(0.005,) * 15,
    prompt_tokens=12,
    output_tokens=16,
    cached_prompt_tokens=None,
    token_source=TokenSource.USAGE,
    content_events=16,
    finish_reason="stop",
    raw_finish_reason="stop",
    error_type=None,
)


def measurement(**overrides: Any) -> Measurement:
    """The default record with `overrides` applied (unknown field names raise TypeError)."""
    return replace(DEFAULT, **overrides)
