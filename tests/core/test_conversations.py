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


def end(t: Conversations, turn: Turn, now: float, prompt: int = 10) -> None:
    t.end(
        turn,
        now,
        duration=now - 0.0,
        response_id=None,
        prompt_tokens=prompt,
    )


def fail(t: Conversations, turn: Turn, now: float) -> None:
    t.end(turn, now, duration=0.5, response_id=None, prompt_tokens=None,
          failed=True)  # fmt: skip


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
    t.end(second, 2.5, duration=0.5, response_id=None, prompt_tokens=None,
          failed=True)  # fmt: skip
    retry = begin(t, 3.0, rounds[1])  # a 429, say: the agent sends the same messages again
    assert (retry.id, retry.index, retry.via, retry.gap) == (first.id, 3, MESSAGES, 0.5)
    assert retry.shared_prefix_tokens == 10  # the first's prompt, which it repeats
    end(t, retry, 4.0)
    third = begin(t, 5.0, rounds[2])
    assert (third.id, third.index, third.via) == (first.id, 4, MESSAGES)


def test_a_retry_repeats_the_last_answered_prompt_whatever_the_failed_one_reported() -> None:
    """The failed request's tokens (None: a 429 reports none) had replaced the answered
    one's, and the retry, header and `previous_response_id` turns after a failure lost the
    prefix their cached-prompt ratio is measured against."""
    t = table()
    rounds = agent_rounds("hi")
    first = begin(t, 0.0, rounds[0], header=b"s")
    t.end(first, 1.0, duration=1.0, response_id="resp_1", prompt_tokens=20)
    fail(t, begin(t, 2.0, rounds[1], header=b"s"), 2.1)
    by_header = begin(t, 3.0, rounds[1], header=b"s")
    assert (by_header.via, by_header.shared_prefix_tokens) == (HEADER, 20)
    fail(t, by_header, 3.1)
    t2 = table()
    first = begin(t2, 0.0, rounds[0])
    t2.end(first, 1.0, duration=1.0, response_id="resp_1", prompt_tokens=20)
    fail(t2, begin(t2, 2.0, rounds[1]), 2.1)
    retry = begin(t2, 3.0, rounds[1])
    assert (retry.via, retry.shared_prefix_tokens) == (MESSAGES, 20)
    fail(t2, retry, 3.1)
    again = t2.begin(4.0, previous_response_id="resp_1")
    assert (again.via, again.shared_prefix_tokens) == (PREVIOUS_RESPONSE, 20)


def test_a_retry_that_trims_the_failed_turn_stays_in_its_conversation() -> None:
    """A turn fails (a 400: its tool result is over the context) and the agent sends it
    again with the result cut short: its leading messages are still all of the last
    answered request's. Before, the failed request's digest had replaced that one at its
    start, and the retry opened a new conversation."""
    t = table()
    first_round = [SYSTEM, {"role": "user", "content": "task"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}
    first = begin(t, 0.0, first_round)
    end(t, first, 1.0, prompt=20)
    huge = begin(t, 2.0, [*first_round, call, {"role": "tool", "content": "x" * 10_000}])
    fail(t, huge, 2.5)
    cut = [*first_round, call, {"role": "tool", "content": "x [cut]"}]
    retry = begin(t, 3.0, cut)
    assert (retry.id, retry.index, retry.via, retry.gap) == (first.id, 3, MESSAGES, 0.5)
    assert retry.shared_prefix_tokens == 20  # it repeats the answered prompt, not the failed
    end(t, retry, 4.0)
    # The retry answered: it is the conversation's latest, the next round continues it.
    assert begin(t, 5.0, [*cut, {"role": "user", "content": "go on"}]).index == 4
    assert len(t._by_digest) <= 2 * len(t)


def test_after_a_failed_turn_both_an_identical_and_an_edited_retry_are_found() -> None:
    t = table()
    first_round = [SYSTEM, {"role": "user", "content": "task"}]
    first = begin(t, 0.0, first_round)
    end(t, first, 1.0)
    asked = [*first_round, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "a"}]
    fail(t, begin(t, 2.0, asked), 2.5)  # a 500
    same = begin(t, 3.0, asked)
    assert (same.id, same.via, same.index) == (first.id, MESSAGES, 3)
    fail(t, same, 3.5)  # again
    rephrased = [*asked[:-1], {"role": "user", "content": "a, rephrased"}]
    edited = begin(t, 4.0, rephrased)
    assert (edited.id, edited.via, edited.index) == (first.id, MESSAGES, 4)
    # Once one succeeds the failed request is forgotten: the same messages are new.
    end(t, edited, 5.0)
    assert begin(t, 6.0, asked).via == NEW
    assert len(t._by_digest) <= 2 * len(t)


def test_a_continuation_that_comes_before_its_requests_end_is_recorded_is_found() -> None:
    # The client has the last byte, the record may still be in the making (a tokenizer's
    # count): the request's digest is indexed at its start, not only at its end.
    t = table()
    rounds = agent_rounds("hi")
    first = begin(t, 0.0, rounds[0])
    second = begin(t, 1.0, rounds[1])
    assert (second.id, second.via, second.gap) == (first.id, MESSAGES, None)


def test_parallel_continuations_of_one_answer_are_branches() -> None:
    """Two requests that continue the same answered one, at once (parallel samples, a
    fan-out), are a branch as they are one after the other: the first stays in the
    conversation, the others open their own. Before, all joined it, and the one that ended
    last took its digest: the agent's next turn on the other branch opened a new one."""
    t = table()
    first_round = [SYSTEM, {"role": "user", "content": "plan"}]
    first = begin(t, 0.0, first_round)
    end(t, first, 1.0)
    answered = [*first_round, {"role": "assistant", "content": "steps"}]
    short, long, third = (
        begin(t, 2.0 + i / 100, [*answered, {"role": "user", "content": f"step {i}"}])
        for i in range(3)
    )
    assert (short.id, short.index, short.via) == (first.id, 2, MESSAGES)
    for branch in (long, third):
        assert (branch.via, branch.index, branch.gap) == (NEW, 1, None)
    assert len({first.id, long.id, third.id}) == 3
    end(t, short, 2.5)
    end(t, third, 2.6)
    end(t, long, 4.0)  # the long one ends last
    on_short = [*answered, {"role": "user", "content": "step 0"}, {"role": "assistant"}]
    next_turn = begin(t, 5.0, [*on_short, {"role": "user", "content": "go on"}])
    assert (next_turn.id, next_turn.index, next_turn.gap) == (first.id, 3, 2.5)
    on_long = [*answered, {"role": "user", "content": "step 1"}, {"role": "assistant"}]
    assert begin(t, 5.0, [*on_long, {"role": "user", "content": "and"}]).id == long.id


def test_a_turn_sent_before_the_one_before_is_recorded_is_no_branch() -> None:
    """An agent loop sends its next turn as soon as it has the answer; the proxy may
    record that answer's end later, and a third turn may come before the second's end too:
    each repeats the one in flight, never a sibling of it."""
    t = table()
    rounds = agent_rounds("hi")
    first = begin(t, 0.0, rounds[0])
    end(t, first, 1.0)
    second = begin(t, 2.0, rounds[1])
    third = begin(t, 3.0, rounds[2])  # the second's end not run yet
    end(t, second, 3.5)
    fourth = begin(t, 4.0, [*rounds[2], {"role": "assistant"}, {"role": "tool"}])
    assert {second.id, third.id, fourth.id} == {first.id}
    assert (second.index, third.index, fourth.index) == (2, 3, 4)


def test_a_conversation_with_a_request_in_flight_is_not_evicted() -> None:
    t = table(capacity=3)
    opening = [SYSTEM, {"role": "user", "content": "a slow one"}]
    slow = begin(t, 0.0, opening)
    for i in range(10):  # a flood of one-request conversations while it is in flight
        end(t, begin(t, 1.0 + i, [{"role": "user", "content": f"flood {i}"}]), 1.5 + i)
    assert len(t) == 3 and t.evicted == 8
    end(t, slow, 20.0)
    follow = [*opening, {"role": "assistant", "content": "a"}, {"role": "user", "content": "go"}]
    second = begin(t, 21.0, follow)
    assert (second.id, second.index, second.via) == (slow.id, 2, MESSAGES)


def test_when_every_conversation_has_a_request_in_flight_the_oldest_goes() -> None:
    t = table(capacity=2)
    a, b = t.begin(0.0, header=b"a"), t.begin(1.0, header=b"b")
    c = t.begin(2.0, header=b"c")
    assert len(t) == 2 and t.evicted == 1
    end(t, a, 3.0)  # evicted mid-request: its end is no error and indexes nothing
    assert t.begin(4.0, header=b"a").via == NEW
    end(t, b, 5.0)
    end(t, c, 5.0)


def test_tables_that_share_the_salt_never_share_an_unnamed_conversations_id() -> None:
    """The workers of one server (and its restarts, and other replicas) share the salt:
    a hash of a counter alone gave each one's first conversation the same id."""
    one, two = table(), table()
    first = [{"role": "user", "content": "a"}]
    assert begin(one, 0.0, first).id != begin(two, 0.0, [{"role": "user", "content": "b"}]).id
    # A named conversation keeps one id in every worker: the header's value, keyed-hashed.
    assert one.begin(1.0, header=b"session-1").id == two.begin(1.0, header=b"session-1").id


def test_a_previous_response_id_turns_input_is_never_taken_for_a_whole_prompt() -> None:
    """Its messages are only its new input items ("continue"); indexed as a prompt, an
    unrelated chat that opens with the same user message joined that conversation."""
    t = table()
    first = begin(t, 0.0, [{"role": "user", "content": "plan a trip"}])
    t.end(first, 1.0, duration=1.0, response_id="resp_1", prompt_tokens=30)
    going_on = [{"role": "user", "content": "continue"}]
    second = begin(t, 2.0, going_on, previous_response_id="resp_1")
    assert (second.via, second.id) == (PREVIOUS_RESPONSE, first.id)
    fail(t, second, 3.0)  # a failed one neither
    retry = begin(t, 4.0, going_on, previous_response_id="resp_1")
    assert (retry.via, retry.id, retry.index) == (PREVIOUS_RESPONSE, first.id, 3)
    t.end(retry, 5.0, duration=1.0, response_id="resp_2", prompt_tokens=40)
    chat = [*going_on, {"role": "assistant", "content": "what?"}, {"role": "user", "content": "x"}]
    other = begin(t, 6.0, chat)
    assert (other.via, other.index) == (NEW, 1) and other.id != first.id
    # and its input is not matched against other requests' messages either
    end(t, begin(t, 7.0, [{"role": "user", "content": "hello"}]), 8.0)
    hello = [{"role": "user", "content": "hello"}, {"role": "user", "content": "more"}]
    assert begin(t, 9.0, hello, previous_response_id="resp_unknown").via == NEW


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
    t.end(first, 1.0, duration=1.0, response_id="resp_1", prompt_tokens=30)
    second = t.begin(4.0, previous_response_id="resp_1")
    assert (second.via, second.index, second.gap) == (PREVIOUS_RESPONSE, 2, 3.0)
    assert second.shared_prefix_tokens == 30  # the previous prompt (below)
    assert t.begin(5.0, previous_response_id="resp_unknown").via == NEW


def test_a_previous_response_id_turn_repeats_the_previous_prompt_not_its_output() -> None:
    """vLLM puts the previous output back as its message texts only, without its reasoning
    or calls (responses/utils.py, construct_input_messages): against vLLM 0.32, 512 cached
    of a 637-token prompt after 1000 reasoning tokens read 512/1637 = 0.31, a miss."""
    t = table()
    first = t.begin(0.0)
    t.end(first, 1.0, duration=1.0, response_id="resp_1", prompt_tokens=637)
    second = t.begin(2.0, previous_response_id="resp_1")
    assert (second.via, second.shared_prefix_tokens) == (PREVIOUS_RESPONSE, 637)


def test_a_responses_chain_under_the_header_shares_the_previous_prompt() -> None:
    """With the header, previous_response_id had emptied the chain the header rule
    matched: no continuation of a Responses chain got a cached share at all."""
    t = table()
    first = t.begin(0.0, header=b"s")
    t.end(first, 1.0, duration=1.0, response_id="resp_1", prompt_tokens=30)
    second = t.begin(2.0, header=b"s", previous_response_id="resp_1")
    assert (second.via, second.id, second.shared_prefix_tokens) == (HEADER, first.id, 30)
    t.end(second, 3.0, duration=1.0, response_id="resp_2", prompt_tokens=50)
    # An older response of the conversation: a branch of it, whose prompt is not known.
    older = t.begin(4.0, header=b"s", previous_response_id="resp_1")
    assert (older.via, older.shared_prefix_tokens) == (HEADER, None)
    t.end(older, 5.0, duration=1.0, response_id="resp_3", prompt_tokens=40)
    latest = t.begin(6.0, header=b"s", previous_response_id="resp_3")
    assert latest.shared_prefix_tokens == 40


def test_an_idle_conversation_closes_with_its_figures() -> None:
    t = table(idle=10.0)
    rounds = agent_rounds("hi")
    turns = []
    now = 0.0
    for messages in rounds:
        turn = begin(t, now, messages)
        t.end(turn, now + 1.0, duration=1.0, response_id=None, prompt_tokens=5)
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
    t.end(turn, 100.0, duration=100.0, response_id=None, prompt_tokens=1)
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
        )
        # The worst case: its latest request failed, so it keeps that one's digest too.
        again = t.begin(float(i), chain=(i.to_bytes(16, "big"), (i + 10_000).to_bytes(16, "big")))
        fail(t, again, float(i))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(t) == 10_000 and len(t._by_digest) == 20_000
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


def refuse(t: Conversations, turn: Turn, now: float) -> Turn:
    """`turn`'s request got an error status instead of an answer (a 429, a 401, a 404)."""
    return t.end(turn, now, duration=0.1, response_id=None, prompt_tokens=None, failed=True, refused=True)  # fmt: skip


def test_a_refused_request_is_no_turn_and_its_retry_takes_its_place() -> None:
    """A 429 is no exchange: before, it was turn 2, its retry turn 3, and the retry's gap
    ran from the refusal, not from the answer it continues."""
    t = table(idle=10.0)
    rounds = agent_rounds("hi")
    first = begin(t, 0.0, rounds[0])
    end(t, first, 1.0, prompt=20)
    refuse(t, begin(t, 2.0, rounds[1]), 2.1)
    retry = begin(t, 3.0, rounds[1])
    assert (retry.id, retry.index, retry.via, retry.gap) == (first.id, 2, MESSAGES, 2.0)
    assert retry.shared_prefix_tokens == 20
    end(t, retry, 4.0)
    (closed,) = t.sweep(20.0)
    assert closed.turns == 2
    assert closed.between_seconds == pytest.approx(2.0)
    assert closed.model_seconds == pytest.approx(5.0)  # end() gives each `now` seconds


def test_a_conversation_only_refused_requests_opened_is_forgotten() -> None:
    t = table()
    refuse(t, begin(t, 0.0, agent_rounds("hi")[0]), 0.1)  # a 401
    refuse(t, t.begin(1.0, header=b"s"), 1.1)
    refuse(t, t.begin(2.0, previous_response_id="resp_gone"), 2.1)  # unknown to the store
    assert len(t) == 0 and not t._by_digest and t.sweep(100.0) == []
    assert t.begin(3.0, header=b"s").index == 1


def test_a_refused_retry_of_a_failed_turn_leaves_it_to_retry() -> None:
    t = table()
    opening = agent_rounds("hi")[0]
    first = begin(t, 0.0, opening)
    fail(t, first, 1.0)  # cut mid-stream: a turn, and the same messages again are its retry
    again = begin(t, 2.0, opening)
    assert (again.id, again.index) == (first.id, 2)
    refuse(t, again, 2.1)
    third = begin(t, 3.0, opening)
    assert (third.id, third.index, third.via) == (first.id, 2, MESSAGES)


def test_a_refused_request_overlapped_by_a_later_one_is_counted_out() -> None:
    t = table(idle=10.0)
    a, b = t.begin(0.0, header=b"s"), t.begin(0.5, header=b"s")
    refuse(t, a, 0.6)  # b holds index 2: no index goes back, the count leaves a out
    end(t, b, 1.0)
    third = t.begin(2.0, header=b"s")
    assert third.index == 3
    end(t, third, 3.0)
    (closed,) = t.sweep(100.0)
    assert closed.turns == 2


@pytest.mark.parametrize("refused", [False, True], ids=["failed", "refused"])
def test_a_trimmed_retry_sent_before_the_failed_turns_end_is_recorded_stays(
    refused: bool,
) -> None:
    """The client had the failed turn's error at 2.5 and sent the trimmed retry at 2.6;
    the proxy recorded that end after the retry began, which saw a request in flight and
    took the retry for a parallel branch: a new conversation."""
    t = table()
    first_round = [SYSTEM, {"role": "user", "content": "task"}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}
    first = begin(t, 0.0, first_round)
    end(t, first, 1.0, prompt=20)
    huge = begin(t, 2.0, [*first_round, call, {"role": "tool", "content": "x" * 10_000}])
    cut = [*first_round, call, {"role": "tool", "content": "x [cut]"}]
    retry = begin(t, 2.6, cut)
    (refuse if refused else fail)(t, huge, 2.5)
    # A refusal is no turn: the gap runs from the answer before it.
    index, gap = (2, 1.6) if refused else (3, 0.1)
    ended = t.end(retry, 4.0, duration=1.4, response_id=None, prompt_tokens=30)
    assert (ended.id, ended.index, ended.via) == (first.id, index, MESSAGES)
    assert ended.gap == pytest.approx(gap)
    assert ended.shared_prefix_tokens == 20
    assert len(t) == 1
    next_round = begin(t, 5.0, [*cut, {"role": "assistant", "content": "ok"}])
    assert (next_round.id, next_round.index) == (first.id, index + 1)


def test_a_branch_whose_sibling_fails_after_it_began_stays_a_branch() -> None:
    t = table()
    first_round = [SYSTEM, {"role": "user", "content": "plan"}]
    first = begin(t, 0.0, first_round)
    end(t, first, 1.0)
    answered = [*first_round, {"role": "assistant", "content": "steps"}]
    one = begin(t, 2.0, [*answered, {"role": "user", "content": "step 0"}])
    two = begin(t, 2.1, [*answered, {"role": "user", "content": "step 1"}])
    fail(t, one, 2.5)  # after the branch began: they ran side by side
    ended = t.end(two, 3.0, duration=0.9, response_id=None, prompt_tokens=9)
    assert (ended.id, ended.index, ended.via) == (two.id, 1, NEW) and two.id != first.id


def test_overlapping_requests_of_one_header_the_later_started_owns_the_answer() -> None:
    """Before, the one that ended last took the digest, the tokens and the response id."""
    t = table()
    short = [{"role": "user", "content": "short"}]
    a = begin(t, 0.0, [{"role": "user", "content": "long"}], header=b"s")
    b = begin(t, 0.5, short, header=b"s")
    t.end(b, 1.0, duration=0.5, response_id="resp_b", prompt_tokens=7)
    t.end(a, 2.0, duration=2.0, response_id="resp_a", prompt_tokens=30)
    after = begin(t, 3.0, [*short, {"role": "assistant"}, {"role": "user"}], header=b"s")
    assert (after.via, after.shared_prefix_tokens) == (HEADER, 7)
    assert t.begin(4.0, previous_response_id="resp_b").id == a.id


def test_a_turn_recorded_after_the_one_that_continues_it_does_not_take_its_place() -> None:
    t = table()
    rounds = agent_rounds("hi")
    first = begin(t, 0.0, rounds[0])
    end(t, first, 1.0)
    second = begin(t, 2.0, rounds[1])
    third = begin(t, 3.0, rounds[2])  # the second's end not recorded yet
    end(t, third, 3.5, prompt=40)
    end(t, second, 4.0, prompt=30)  # recorded last
    fourth = begin(t, 5.0, [*rounds[2], {"role": "assistant"}, {"role": "tool"}])
    assert (fourth.id, fourth.index, fourth.shared_prefix_tokens) == (first.id, 4, 40)
