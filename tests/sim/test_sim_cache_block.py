"""What a request writes to the prefix cache is counted in the simulator's one block size.

vLLM counts `created_cache_tokens` (chat) and `cache_write_tokens` (Responses) from the
scheduler's estimate of the prompt's full KV blocks less those it found cached
(v1/metrics/stats.py:342-346 PrefillStats.finalize), in the same blocks of --block-size as
its cache hits. Its CPU build's default block is 128 (vllm/platforms/cpu.py:292-293), and
the real vLLM 0.32 CPU server answered a 165-token chat and then its next turn (188
tokens) with {cached_tokens 0, created_cache_tokens 128} and {128, 0}. The simulator
counted its hits in `prefix_cache_block` but what it wrote in blocks of 16 always:
{0, 160}, then {128, 32}.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from proxy.sim import SimConfig
from tests.sim.test_sim_support import running

BLOCK = 128  # vLLM's CPU build
FIRST = [{"role": "user", "content": "w" * 640}]  # 160 of the simulator's tokens
NEXT = [*FIRST, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = SimConfig(ttft=0, output_tokens=1, prefix_cache=8, prefix_cache_block=BLOCK)
    with running(config) as (server, _):
        yield server.url


def chat_details(url: str, messages: list[dict[str, str]]) -> tuple[int, dict[str, Any]]:
    body = {"model": "sim-model", "messages": messages, "max_tokens": 1}
    usage = httpx.post(url + "/v1/chat/completions", json=body).json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]


def test_a_chat_writes_and_then_finds_whole_blocks_of_the_configured_size(url: str) -> None:
    prompt, first = chat_details(url, FIRST)
    assert prompt > BLOCK
    assert first == {"cached_tokens": 0, "created_cache_tokens": BLOCK, "multimodal_tokens": None}
    prompt, then = chat_details(url, NEXT)
    assert prompt < 2 * BLOCK
    assert then == {"cached_tokens": BLOCK, "created_cache_tokens": 0, "multimodal_tokens": None}


def test_a_responses_cache_write_is_in_whole_blocks_of_the_configured_size(url: str) -> None:
    body = {"model": "sim-model", "input": "w" * 640, "max_output_tokens": 1}
    reply = httpx.post(url + "/v1/responses", json=body, headers={"x-sim-cached-tokens": "0"})
    details = reply.json()["usage"]["input_tokens_details"]
    assert (details["cached_tokens"], details["cache_write_tokens"]) == (0, BLOCK)
