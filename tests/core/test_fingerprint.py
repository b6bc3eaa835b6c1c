"""The prefix fingerprint: cumulative digests of leading messages or text blocks."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.apis.base import RequestInfo
from proxy.core.fingerprint import (
    BLOCK,
    DEPTH,
    chain_of,
    keyed,
    message_chain,
    of_prompt,
    prefix_of,
)


def test_messages_are_hashed_cumulatively_up_to_the_depth() -> None:
    messages = [{"role": "user", "content": f"turn {i}"} for i in range(DEPTH + 3)]
    prefix = of_prompt(messages)
    assert prefix is not None and len(prefix.digests) == DEPTH == len(set(prefix.digests))
    shorter = of_prompt(messages[:3])
    assert shorter is not None and shorter.digests == prefix.digests[:3]
    assert prefix.chars == tuple(sorted(prefix.chars)) and prefix.total_chars > prefix.chars[-1]


def test_a_message_boundary_is_part_of_the_digest() -> None:
    one = of_prompt([{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}])
    two = of_prompt([{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}])
    assert one is not None and two is not None and one.digests[1] != two.digests[1]


def test_text_prompts_are_hashed_in_whole_leading_blocks() -> None:
    shared = "x" * (2 * BLOCK)
    a, b = of_prompt(shared + "tail one" + "y" * BLOCK), of_prompt(shared + "tail two")
    assert a is not None and b is not None
    assert len(a.digests) == 3 and len(b.digests) == 2 and a.digests[:2] == b.digests
    assert a.chars == (BLOCK, 2 * BLOCK, 3 * BLOCK) and b.total_chars == 2 * BLOCK + 8
    short = of_prompt("short")
    assert short is not None and short.digests == () and short.total_chars == 5


def test_nothing_to_fingerprint_gives_none() -> None:
    assert of_prompt(None) is None and of_prompt([]) is None and of_prompt([1, 2, 3]) is None


def test_keyed_digests_depend_on_the_key() -> None:
    prefix = of_prompt([{"role": "system", "content": "s"}])
    assert prefix is not None
    assert keyed(prefix, b"k" * 32) == keyed(prefix, b"k" * 32) != keyed(prefix, b"j" * 32)


@pytest.mark.parametrize(
    "prompt",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": f"turn {i}"} for i in range(DEPTH + 3)],
        "a text prompt " * 40,
        [],
        None,
    ],
)
def test_the_conversation_chain_and_the_records_prefix_share_one_hashing(prompt: Any) -> None:
    # chain_of (the conversation table, at the request's start) keeps its digests on the
    # RequestInfo; prefix_of (the record, at its end) takes them: both as computed alone.
    info = RequestInfo("/v1/chat/completions", "m", False, False, None, None, prompt=prompt)
    alone = of_prompt(prompt)
    assert prefix_of(info) == alone  # before any chain: computed from the prompt
    assert chain_of(info) == message_chain(prompt)
    assert prefix_of(info) == alone
    assert info == RequestInfo("/v1/chat/completions", "m", False, False, None, None, prompt=prompt)
