"""The simulator's prefix cache: the programmed truth for cached tokens on continuations."""

from __future__ import annotations

import pytest

from proxy.sim.config import SimConfig
from proxy.sim.prefix_cache import PrefixCache
from proxy.sim.tokens import count_prompt_tokens

SYSTEM = {"role": "system", "content": "s" * 400}  # 100 tokens


def test_a_continuation_gets_its_earlier_prompt_as_cached_tokens() -> None:
    cache = PrefixCache(100, block=1)
    first = {"messages": [SYSTEM, {"role": "user", "content": "u" * 40}]}
    assert cache.cached_tokens(first) == 0
    second = {"messages": [*first["messages"], {"role": "assistant", "content": "a" * 8}]}
    assert cache.cached_tokens(second) == count_prompt_tokens(first) == 110


def test_cached_tokens_come_in_whole_blocks_and_a_shared_system_prompt_counts() -> None:
    cache = PrefixCache(100, block=16)
    cache.cached_tokens({"messages": [SYSTEM, {"role": "user", "content": "a"}]})
    other = {"messages": [SYSTEM, {"role": "user", "content": "b"}]}
    assert cache.cached_tokens(other) == 96  # the system prompt's 100 tokens, in blocks of 16


def test_the_cache_is_bounded_oldest_first_out() -> None:
    cache = PrefixCache(4, block=1)
    for i in range(6):
        cache.cached_tokens({"messages": [{"role": "user", "content": f"{i}" * 8}]})
    assert len(cache) == 4
    assert cache.cached_tokens({"messages": [{"role": "user", "content": "0" * 8}]}) == 0
    assert cache.cached_tokens({"messages": [{"role": "user", "content": "5" * 8}]}) == 2


def test_responses_input_items_and_instructions_are_units_a_text_prompt_has_none() -> None:
    cache = PrefixCache(10, block=1)
    body = {"instructions": "i" * 40, "input": [{"role": "user", "content": "x" * 8}]}
    cache.cached_tokens(body)
    assert cache.cached_tokens({**body, "input": [*body["input"], {"role": "user"}]}) == 12
    assert cache.cached_tokens({"prompt": "p" * 100}) == 0


def test_bad_prefix_cache_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        SimConfig(prefix_cache=-1)
    with pytest.raises(ValueError):
        SimConfig(prefix_cache_block=0)
