"""Conversations end to end where a turn fails or branches: the proxy in front of the
simulator with its prefix cache, real requests over loopback.

A retry after a failed turn repeats the last answered request's prompt, so its cached
share is measured against that prompt; two requests continuing one answer at once are a
branch, as they are one after the other, and each branch's next turn stays in its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from proxy.sim.tokens import count_prompt_tokens
from tests.conftest import MODEL, ProxyUnderTest, Running

SYSTEM = {"role": "system", "content": "You are a planning agent. Split the task in steps."}


def chat(proxy: ProxyUnderTest, messages: list[Any], **headers: str) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "stream": True}
    return httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_a_retry_after_a_rate_limit_gets_its_cached_share_of_the_answered_prompt(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    sim = start_sim(ttft=0.0, tokens_per_second=5000.0, output_tokens=2, prefix_cache=1000)
    proxy = start_proxy(sim.url)
    first = [SYSTEM, {"role": "user", "content": "Plan a trip to Oslo, and to all of Norway."}]
    second = [*first, {"role": "assistant", "content": "Fly."}, {"role": "user", "content": "?"}]
    assert chat(proxy, first).status_code == 200
    proxy.wait_records(1)
    assert chat(proxy, second, **{"x-sim-error": "rate_limit"}).status_code == 429
    proxy.wait_records(2)
    assert chat(proxy, second).status_code == 200  # the agent's retry
    retry = proxy.wait_records(3)[2]
    assert (retry.turn, retry.continued_via) == (2, "messages")  # the 429 was no turn
    assert retry.cached_prompt_tokens  # the simulator served the repeated prefix
    assert retry.shared_prefix_tokens == count_prompt_tokens({"messages": first})
    assert proxy.sample("tokenprobe_continuation_cached_prompt_ratio_count", model=MODEL) == 1


def test_parallel_continuations_of_one_answer_are_branches_that_each_go_on(
    start_sim: Callable[..., Running], start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    # 60 tokens a second: the long step takes 0.5 s, the short one starts inside it.
    sim = start_sim(ttft=0.0, tokens_per_second=60.0, output_tokens=1)
    proxy = start_proxy(sim.url)
    first = [SYSTEM, {"role": "user", "content": "Refactor the parser."}]
    answered = [*first, {"role": "assistant", "content": "Two steps."}]
    assert chat(proxy, first).status_code == 200
    base = proxy.wait_records(1)[0]
    steps = {"long": 30, "short": 1}  # output tokens of each branch's answer
    branches = {k: [*answered, {"role": "user", "content": f"Do the {k} step."}] for k in steps}

    def step(kind: str) -> None:
        headers = {"x-sim-output-tokens": str(steps[kind])}
        assert chat(proxy, branches[kind], **headers).status_code == 200

    long = threading.Thread(target=step, args=("long",))
    long.start()
    time.sleep(0.15)
    step("short")
    long.join()
    records = proxy.wait_records(3)[1:]
    short_record, long_record = sorted(records, key=lambda r: r.output_tokens or 0)
    by_kind = {"short": short_record, "long": long_record}
    assert (short_record.output_tokens or 0) < (long_record.output_tokens or 0)
    # One continues the answered request (the first to start), the other is a branch.
    assert sorted(r.turn for r in records) == [1, 2]
    assert len({base.conversation_id, *(r.conversation_id for r in records)}) == 2
    for n, kind in enumerate(("short", "long")):  # the long one ended last: no matter
        answer = {"role": "assistant", "content": "Done."}
        going_on = [*branches[kind], answer, {"role": "user", "content": "Next."}]
        assert chat(proxy, going_on).status_code == 200
        record, branch = proxy.wait_records(4 + n)[3 + n], by_kind[kind]
        assert (record.conversation_id, record.turn) == (branch.conversation_id, branch.turn + 1)
        assert record.continued_via == "messages"
