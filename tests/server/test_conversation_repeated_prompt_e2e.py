"""What a continuation repeats, end to end: the proxy in front of the simulator, the
official SDKs over loopback.

- Claude Code opens every request's `system` with `x-anthropic-billing-header: ...;
  cch=<hex>;`, the cch new each time; vLLM drops that block (anthropic/serving.py,
  _convert_system_message), so its turns are one prompt, and must be one conversation.
- A `previous_response_id` turn repeats the previous prompt, not its output: vLLM puts
  back the previous answer's text only, never its reasoning (responses/utils.py,
  construct_input_messages). Under the conversation header as well.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import MODEL, ProxyUnderTest, Running

SYSTEM = "You are a weather agent. Answer in one line."
#: Records land just after each response's last byte: a wide wait on a loaded machine.
WAIT = 30.0


def billing_block() -> dict[str, Any]:
    cch = f"{random.getrandbits(20):05x}"
    line = f"x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch={cch};"
    return {"type": "text", "text": line}


def test_a_claude_code_session_whose_cch_changes_every_turn_is_one_conversation(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """Before the fix: three conversations of one turn, three prefix fingerprints."""
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=3)
    proxy = start_proxy(sim.url)
    client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
    system = {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}
    messages: list[Any] = [{"role": "user", "content": "Weather in Sintra?"}]
    for turn in range(3):
        answer = client.messages.create(
            model=MODEL, max_tokens=8, system=[billing_block(), system], messages=messages
        )
        said = [{"type": "text", "text": b.text} for b in answer.content if b.type == "text"]
        messages = [*messages, {"role": "assistant", "content": said},
                    {"role": "user", "content": f"And on day {turn + 2}?"}]  # fmt: skip
    records = proxy.wait_records(3, timeout=WAIT)
    assert [(r.turn, r.continued_via) for r in records] == [
        (1, None),
        (2, "messages"),
        (3, "messages"),
    ]
    assert len({r.conversation_id for r in records}) == 1
    firsts = {r.prefix.digests[0] for r in records if r.prefix is not None}
    assert len(firsts) == 1  # the system prompt's digest, whatever the cch


@pytest.mark.parametrize("header", [None, "x-session-id"], ids=["bare", "header"])
def test_a_responses_chain_after_long_reasoning_shares_the_previous_prompt(
    start_sim: Callable[..., Running],
    start_proxy: Callable[..., ProxyUnderTest],
    header: str | None,
) -> None:
    """The previous turn reasoned 1000 tokens; the next had the previous prompt cached to
    its last whole block. Before the fix its share read cached / (prompt + 1021 output
    tokens) = 0.30, a miss; under the header it was not measured at all."""
    sim = start_sim(ttft=0.0, tokens_per_second=20000.0, output_tokens=20)
    proxy = start_proxy(sim.url, conversation_header=header)
    client = openai.OpenAI(
        base_url=proxy.url + "/v1",
        api_key="sk-test",
        max_retries=0,
        default_headers={header: "session-7"} if header else None,
    )
    instructions = SYSTEM + " " + " ".join(f"Rule {i}: check the city twice." for i in range(40))
    stream = client.responses.create(
        model=MODEL,
        instructions=instructions,
        input="Weather in Coimbra?",
        stream=True,
        extra_headers={"x-sim-reasoning-tokens": "1000"},
    )
    done = [e.response for e in stream if e.type == "response.completed"]
    assert len(done) == 1 and done[0].usage is not None
    assert done[0].usage.output_tokens_details.reasoning_tokens == 1000
    prompt = done[0].usage.input_tokens
    cached = prompt // 16 * 16  # the previous prompt, in whole blocks
    client.responses.create(
        model=MODEL,
        instructions=instructions,
        input="And in Porto?",
        previous_response_id=done[0].id,
        extra_headers={"x-sim-cached-tokens": str(cached)},
    )
    one, two = proxy.wait_records(2, timeout=WAIT)
    assert (two.conversation_id, two.turn) == (one.conversation_id, 2)
    assert two.continued_via == ("header" if header else "previous_response")
    assert one.prompt_tokens == prompt and two.cached_prompt_tokens == cached
    assert two.shared_prefix_tokens == prompt
    assert proxy.sample("tokenprobe_continuation_cached_prompt_ratio_count", model=MODEL) == 1
    ratio = proxy.sample("tokenprobe_continuation_cached_prompt_ratio_sum", model=MODEL)
    assert ratio == pytest.approx(cached / prompt)
    assert proxy.sample("tokenprobe_continuation_cache_misses_total", model=MODEL) == 0
