"""The conversation table: which request continues which, turn gaps, idleness, bounds."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import pytest

from proxy.core.conversations import (
    ENTRY_BYTES,
    HEADER,
    MAX_HEADER_VALUE,
    MESSAGES,
    NEW,
    PREVIOUS_RESPONSE,
    Conversations,
    Turn,
    header_refusal,
)
from proxy.core.fingerprint import message_chain, of_prompt

SYSTEM = {"role": "system", "content": "You are a weather agent."}


def table(capacity: int = 100, idle: float = 60.0) -> Conversations:
    return Conversations(capacity=capacity, idle=idle, salt=b"s" * 32)


def begin(t: Conversations, now: float, messages: list[dict[str, Any]], **kw: Any) -> Turn:
    chain, complete = message_chain(messages)
    return t.begin(now, chain=chain, complete=complete, **kw)


def end(t: Conversations, turn: Turn, now: float, prompt: int = 10, output: int = 5) -> None:
    t.end(
        turn,
        now,
        duration=now - 0.0,
        response_id=None,
        prompt_tokens=prompt,
        output_tokens=output,
    )


def agent_rounds(user: str) -> list[list[dict[str, Any]]]:
    first = [SYSTEM, {"role": "user", "content": user}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}
    second = [*first, call, {"role": "tool", "tool_call_id": "c1", "content": "12C"}]
    third = [*second, {"role": "assistant", "content": "again"}, {"role": "tool", "content": "x"}]
    return [first, second, third]


def test_message_chain_equals_the_access_logs_prefix_digests() -> None:
    messages = agent_rounds("weather in Oslo?")[2]
    prefix = of_prompt(messages)
    assert prefix is not None
    chain, complete = message_chain(messages)
    assert complete and chain == prefix.digests
    assert message_chain("a text prompt") == ((), False)
    long = [{"role": "user", "content": str(i)} for i in range(12)]
    chain, complete = message_chain(long, limit=10)
    assert len(chain) == 10 and not complete


def test_an_agent_loop_is_one_conversation_with_its_turn_gaps() -> None:
    t = table()
    rounds = agent_rounds("weather in Oslo?")
    first = begin(t, 100.0, rounds[0])
    end(t, first, 101.0, prompt=20)
    second = begin(t, 101.5, rounds[1])
    end(t, second, 102.0, prompt=40)
    third = begin(t, 104.0, rounds[2])
    assert (first.via, first.index, first.gap) == (NEW, 1, None)
    assert (second.via, second.index, second.gap) == (MESSAGES, 2, 0.5)
    assert (third.via, third.index, third.gap) == (MESSAGES, 3, 2.0)
    assert first.id == second.id == third.id
    # The shared prefix is the earlier request's whole prompt: its prompt tokens.
    assert (second.shared_prefix_tokens, third.shared_prefix_tokens) == (20, 40)


def test_a_client_that_resends_its_messages_with_keys_reordered_stays_in_its_conversation() -> None:
    # Frameworks rebuild the history each turn (a dict per message, fields in their own
    # order); the same message is the same JSON object whatever its key order (RFC 8259 §4).
    t = table()
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    first_round = [SYSTEM, {"role": "user", "content": "weather?"}]
    first = begin(t, 0.0, first_round)
    end(t, first, 1.0)
    resent = [{"content": m["content"], "role": m["role"]} for m in first_round]
    function = {"arguments": "{}", "name": "w"}
    answer = {"tool_calls": [{"function": function, "type": "function", "id": "c1"}]}
    assert answer["tool_calls"][0] == call and list(answer["tool_calls"][0]) != list(call)
    second = begin(t, 2.0, [*resent, {"role": "assistant", **answer}, {"role": "tool"}])
    assert (second.via, second.id, second.index) == (MESSAGES, first.id, 2)


def test_an_agent_that_moves_its_cache_breakpoint_each_turn_stays_in_its_conversation() -> None:
    # Anthropic-style agents mark the latest message with `cache_control` (its text becomes
    # a block to carry it) and take the mark off the earlier one: the model sees the same
    # prompt, so it is the same history.
    mark = {"type": "ephemeral"}
    t = table()
    asked = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": mark}]}]
    first = begin(t, 0.0, asked)
    end(t, first, 1.0)
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "user", "content": [{"type": "text", "text": "more", "cache_control": mark}]},
    ]
    second = begin(t, 2.0, history)
    assert (second.via, second.id, second.index) == (MESSAGES, first.id, 2)
    # what the model does see still tells two messages apart
    other = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": ""}]}
    ]
    assert message_chain(other)[0] != message_chain(asked)[0]


def test_two_conversations_sharing_a_system_prompt_are_never_joined() -> None:
    t = table()
    a = agent_rounds("weather in Oslo?")
    b = agent_rounds("weather in Lima?")
    a1 = begin(t, 0.0, a[0])
    b1 = begin(t, 0.0, b[0])
    end(t, a1, 1.0)
    end(t, b1, 1.0)
    a2, b2 = begin(t, 2.0, a[1]), begin(t, 2.0, b[1])
    assert a1.id != b1.id
    assert (a2.id, b2.id) == (a1.id, b1.id)
    assert a2.index == b2.index == 2


def test_a_resend_of_the_same_messages_is_no_continuation() -> None:
    t = table()
    messages = agent_rounds("hi")[0]
    first = begin(t, 0.0, messages)
    end(t, first, 1.0)
    again = begin(t, 2.0, messages)
    assert again.via == NEW and again.id != first.id


def test_a_retry_of_a_failed_request_stays_in_its_conversation() -> None:
    t = table()
    rounds = agent_rounds("hi")
    first = begin(t, 0.0, rounds[0])
    end(t, first, 1.0)
    second = begin(t, 2.0, rounds[1])
    t.end(second, 2.5, duration=0.5, response_id=None, prompt_tokens=None, output_tokens=None,
          failed=True)  # fmt: skip
    retry = begin(t, 3.0, rounds[1])  # a 429, say: the agent sends the same messages again
    assert (retry.id, retry.index, retry.via, retry.gap) == (first.id, 3, MESSAGES, 0.5)
    end(t, retry, 4.0)
    third = begin(t, 5.0, rounds[2])
    assert (third.id, third.index, third.via) == (first.id, 4, MESSAGES)


def test_the_header_wins_and_its_value_is_never_kept() -> None:
    t = table()
    value = b"session-secret-1234"
    first = begin(t, 0.0, [{"role": "user", "content": "a"}], header=value)
    end(t, first, 1.0)
    # An unrelated prompt with the same header value: the same conversation.
    second = begin(t, 3.0, [{"role": "user", "content": "b"}], header=value)
    assert (second.via, second.index, second.gap, second.id) == (HEADER, 2, 2.0, first.id)
    assert second.shared_prefix_tokens is None  # it repeats none of the earlier prompt
    assert value.hex() not in first.id and b"session" not in first.conversation.key
    other = begin(t, 3.0, [{"role": "user", "content": "a"}], header=b"session-2")
    assert other.via == NEW and other.id != first.id


def test_previous_response_id_continues_the_response_it_names() -> None:
    t = table()
    first = t.begin(0.0)
    t.end(first, 1.0, duration=1.0, response_id="resp_1", prompt_tokens=30, output_tokens=7)
    second = t.begin(4.0, previous_response_id="resp_1")
    assert (second.via, second.index, second.gap) == (PREVIOUS_RESPONSE, 2, 3.0)
    assert second.shared_prefix_tokens == 37  # the stored context: prompt and answer
    assert t.begin(5.0, previous_response_id="resp_unknown").via == NEW


def test_an_idle_conversation_closes_with_its_figures() -> None:
    t = table(idle=10.0)
    rounds = agent_rounds("hi")
    turns = []
    now = 0.0
    for messages in rounds:
        turn = begin(t, now, messages)
        t.end(turn, now + 1.0, duration=1.0, response_id=None, prompt_tokens=5, output_tokens=1)
        turns.append(turn)
        now += 3.0  # 1 s in the model, 2 s in the tool
    assert t.sweep(now + 5.0) == []  # last end 7.0: idle only 5 s
    (closed,) = t.sweep(7.0 + 10.0)
    assert closed.turns == 3
    assert closed.duration == pytest.approx(7.0)
    assert closed.model_seconds == pytest.approx(3.0)
    assert closed.between_seconds == pytest.approx(4.0)
    assert len(t) == 0
    # Closed: its digest is forgotten, the next round opens a new conversation.
    assert begin(t, 30.0, [*rounds[2], {"role": "user", "content": "more"}]).via == NEW


def test_a_request_in_flight_keeps_its_conversation_open() -> None:
    t = table(idle=1.0)
    turn = t.begin(0.0)
    assert t.sweep(100.0) == []
    t.end(turn, 100.0, duration=100.0, response_id=None, prompt_tokens=1, output_tokens=1)
    assert len(t.sweep(101.0)) == 1


def test_overlapping_requests_of_one_header_have_no_gap() -> None:
    t = table()
    a = t.begin(0.0, header=b"s")
    b = t.begin(0.5, header=b"s")
    assert b.index == 2 and b.gap is None
    end(t, a, 1.0)
    end(t, b, 2.0)


def test_a_flood_of_conversations_stays_within_capacity_oldest_first_out() -> None:
    t = table(capacity=50)
    firsts = []
    for i in range(80):
        messages = [{"role": "user", "content": f"question {i}"}]
        turn = begin(t, float(i), messages)
        end(t, turn, float(i) + 0.5)
        firsts.append(messages)
    assert len(t) == 50 and t.evicted == 30
    assert len(t._by_digest) <= 50 and len(t._by_response) <= 50
    follow = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    assert begin(t, 100.0, [*firsts[0], *follow]).via == NEW  # evicted: forgotten
    assert begin(t, 100.0, [*firsts[79], *follow]).via == MESSAGES  # the newest kept


def test_header_values_that_are_huge_or_binary_are_refused() -> None:
    assert header_refusal(b"a" * MAX_HEADER_VALUE) is None
    assert header_refusal(b"a" * (MAX_HEADER_VALUE + 1)) == "too_long"
    assert header_refusal(b"a" * 1_000_000) == "too_long"
    assert header_refusal(b"ab\x00cd") == "not_text"
    assert header_refusal("café".encode()) == "not_text"
    assert header_refusal(b"\xff\xfe") == "not_text"


def test_one_conversation_holds_at_most_entry_bytes() -> None:
    t = table(capacity=10_000)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(10_000):
        turn = t.begin(float(i), chain=(i.to_bytes(16, "big"),))
        t.end(
            turn,
            float(i),
            duration=0.1,
            response_id=f"resp_{i:0>251}",
            prompt_tokens=10**6,
            output_tokens=10**6,
        )
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(t) == 10_000
    assert used / 10_000 <= ENTRY_BYTES


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # Anthropic's system as text blocks, as an agent that sets cache_control sends it
        ("/v1/messages", lambda system, items: {"system": [{"type": "text", "text": system,
                                                 "cache_control": {"type": "ephemeral"}}],
                                                 "messages": items}),
        ("/v1/messages", lambda system, items: {"system": system, "messages": items}),
        ("/v1/responses", lambda system, items: {"instructions": system, "input": items}),
    ],
)  # fmt: skip
def test_agents_that_differ_in_their_system_prompt_alone_are_never_joined(
    path: str, body: Any
) -> None:
    """Two agents open with the same user message under different system prompts: the
    prompt (Api.prompt) keeps the system prompt first, so each one's second turn continues
    its own conversation, not the other's (before, the block form and the instructions were
    left out, and agent A's second turn joined B's, which had opened last)."""
    from proxy.core.apis import api_for

    api = api_for(path)
    assert api is not None
    t = table()
    hi = [{"role": "user", "content": "fix the failing test"}]
    more = [*hi, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]

    def turn(now: float, system: str, items: list[dict[str, Any]]) -> Turn:
        return begin(t, now, api.read_request({"model": "m", **body(system, items)}).prompt)

    a1 = turn(0.0, "You are agent A, a reviewer", hi)
    end(t, a1, 1.0)
    b1 = turn(1.0, "You are agent B, a planner", hi)
    end(t, b1, 2.0)
    a2 = turn(3.0, "You are agent A, a reviewer", more)
    assert a1.id != b1.id and b1.index == 1
    assert (a2.id, a2.index, a2.gap) == (a1.id, 2, 2.0)


def test_a_message_nested_deeper_than_json_writes_still_gets_a_chain() -> None:
    """orjson reads deeper nesting than it writes: a client's 300 nested lists raised out
    of the hashing, and the request lost its turn and its record."""
    deep: Any = "x"
    for _ in range(300):
        deep = [deep]
    messages = [SYSTEM, {"role": "user", "content": deep}]
    chain, complete = message_chain(messages)
    assert complete and len(chain) == 2 and of_prompt(messages) is not None
