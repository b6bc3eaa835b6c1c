"""The usage stripper: exactly the usage-only event goes, every other byte passes unchanged."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.strip import Injection, UsageEventStripper, _members
from tests.paths import STREAMS


def fixture(name: str) -> bytes:
    return (STREAMS / name).read_bytes()


def usage_only_event(stream: bytes, sep: bytes = b"\n\n") -> bytes:
    (event,) = [e + sep for e in stream.split(sep) if b'"choices":[],"usage"' in e]
    return event


def relay(*chunks: bytes) -> bytes:
    stripper = UsageEventStripper()
    return b"".join(stripper.feed(c) for c in chunks) + stripper.flush()


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted(min(c, len(data)) for c in cuts)
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


VLLM_CHAT = fixture("vllm_chat.sse")
VLLM_CHAT_STRIPPED = VLLM_CHAT.replace(usage_only_event(VLLM_CHAT), b"")


@pytest.mark.parametrize("name", ["vllm_chat.sse", "vllm_completions.sse", "vllm_tool_calls.sse"])
def test_only_the_usage_only_event_is_removed(name: str) -> None:
    stream = fixture(name)
    expected = stream.replace(usage_only_event(stream), b"")
    assert relay(stream) == expected
    assert expected.endswith(b"data: [DONE]\n\n")


def test_every_two_way_split_removes_exactly_the_usage_event() -> None:
    for i in range(len(VLLM_CHAT) + 1):
        assert relay(VLLM_CHAT[:i], VLLM_CHAT[i:]) == VLLM_CHAT_STRIPPED, i


def test_every_two_way_split_of_a_crlf_stream_removes_exactly_the_usage_event() -> None:
    crlf = VLLM_CHAT.replace(b"\n", b"\r\n")
    expected = crlf.replace(usage_only_event(crlf, b"\r\n\r\n"), b"")
    for i in range(len(crlf) + 1):
        assert relay(crlf[:i], crlf[i:]) == expected, i


def test_byte_at_a_time_removes_exactly_the_usage_event() -> None:
    chunks = [VLLM_CHAT[i : i + 1] for i in range(len(VLLM_CHAT))]
    assert relay(*chunks) == VLLM_CHAT_STRIPPED


@settings(max_examples=150)
@given(
    line_end=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=len(VLLM_CHAT) * 2), max_size=30),
)
def test_random_splits_remove_exactly_the_usage_event(line_end: bytes, cuts: list[int]) -> None:
    stream = VLLM_CHAT.replace(b"\n", line_end)
    expected = VLLM_CHAT_STRIPPED.replace(b"\n", line_end)
    assert relay(*_split(stream, cuts)) == expected


@pytest.mark.parametrize("name", ["vllm_reasoning.sse", "no_done_finish_ends.sse", "cut_off.sse"])
def test_stream_without_usage_passes_byte_for_byte(name: str) -> None:
    stream = fixture(name)
    assert relay(stream) == stream


def test_usage_attached_to_a_content_chunk_is_kept() -> None:
    stream = fixture("usage_on_last_content.sse")
    assert b'"usage"' in stream
    assert relay(stream) == stream


@pytest.mark.parametrize(
    "name",
    ["vllm-0.32/chat_stream_forced_usage.sse", "vllm-0.32/completions_stream_forced_usage.sse"],
)
def test_a_backend_that_forces_usage_keeps_its_stream_and_is_no_longer_asked(name: str) -> None:
    """vLLM --enable-force-include-usage: its client gets usage on every chunk and the
    usage chunk direct, so nothing is stripped, at any split, and the upstream is not asked
    again (its usage comes unasked)."""
    stream = fixture(name)
    told: list[tuple[int, str]] = []
    for i in range(0, len(stream) + 1, 7):
        injection = Injection()
        injection.on_forced = lambda endpoint, at=i: told.append((at, endpoint))
        stripper = UsageEventStripper(injection=injection, endpoint="/v1/x")
        out = stripper.feed(stream[:i]) + stripper.feed(stream[i:]) + stripper.flush()
        assert out == stream, i
        assert stripper.stepped_aside and told[-1] == (i, "/v1/x"), i
        # not asked again on that API; still asked on the others
        assert not injection.asks("/v1/x") and injection.asks("/v1/y") and injection.on, i
    assert len(told) == len(range(0, len(stream) + 1, 7))  # once a stream


def test_a_stream_asked_for_usage_alone_is_still_stripped_and_injection_stays_on() -> None:
    injection = Injection()
    stripper = UsageEventStripper(injection=injection)
    out = stripper.feed(VLLM_CHAT) + stripper.flush()
    assert out == VLLM_CHAT_STRIPPED and not stripper.stepped_aside
    assert injection.asks("/v1/chat/completions") and not injection.unasked


def test_empty_choices_with_null_usage_is_kept() -> None:
    # Azure OpenAI's prompt-filter chunk, with the `"usage": null` every chunk carries
    # once include_usage is set: it is not usage-only and the client expects it.
    stream = (
        b'data: {"choices":[],"prompt_filter_results":[{"prompt_index":0}],"usage":null}\n\n'
        b"data: [DONE]\n\n"
    )
    assert relay(stream) == stream


def test_keepalive_comments_pass_unchanged() -> None:
    stream = b": ping\n\n" + VLLM_CHAT + b": ping\n\n"
    assert relay(stream) == b": ping\n\n" + VLLM_CHAT_STRIPPED + b": ping\n\n"


def test_incomplete_event_waits_for_its_blank_line() -> None:
    stripper = UsageEventStripper()
    assert stripper.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\n') == b""
    assert stripper.feed(b"\n") == b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'


def test_flush_relays_an_unfinished_last_event() -> None:
    stripper = UsageEventStripper()
    assert stripper.feed(b"data: [DONE]") == b""
    assert stripper.flush() == b"data: [DONE]"


def test_flush_drops_an_unfinished_usage_only_event() -> None:
    event = usage_only_event(VLLM_CHAT).rstrip(b"\n")
    assert relay(event) == b""


# -- the fingerprint vLLM moves to the usage chunk (real vLLM 0.32 captures) ----------------


def _vllm032_pair(api: str) -> tuple[bytes, bytes]:
    """(the include_usage stream with the no_usage stream's id, the no_usage stream): two
    requests that differ in nothing else (tests/fixtures/streams/vllm-0.32/README.md)."""
    asked = fixture(f"vllm-0.32/{api}_stream_include_usage.sse")
    direct = fixture(f"vllm-0.32/{api}_stream_no_usage.sse")
    ids = [s.split(b'"id":"', 1)[1].split(b'"', 1)[0] for s in (asked, direct)]
    return asked.replace(ids[0], ids[1]), direct


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_include_usage_stream_becomes_the_direct_stream_at_every_split(api: str) -> None:
    asked, direct = _vllm032_pair(api)
    assert b'"system_fingerprint"' not in asked.split(b'"choices":[]')[0]  # moved by vLLM
    assert relay(asked) == direct
    for i in range(len(asked) + 1):
        assert relay(asked[:i], asked[i:]) == direct, i


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_include_usage_stream_becomes_the_direct_stream_byte_at_a_time(api: str) -> None:
    asked, direct = _vllm032_pair(api)
    assert relay(*[asked[i : i + 1] for i in range(len(asked))]) == direct


@settings(max_examples=100)
@given(cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12))
def test_include_usage_stream_becomes_the_direct_stream_at_random_splits(cuts: list[int]) -> None:
    asked, direct = _vllm032_pair("chat")
    assert relay(*_split(asked, cuts)) == direct


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_comment_between_the_terminal_and_the_usage_chunk_stays_and_the_member_goes_back(
    api: str,
) -> None:
    """A gateway's `: ping` between vLLM's finish chunk and its usage chunk: the comment
    stays where it was, and the fingerprint still goes back to the finish chunk (the
    comment once parted them: the fingerprint was lost and nothing said so)."""
    asked, direct = _vllm032_pair(api)
    cut = asked.index(b"data: ", asked.index(b'"finish_reason":"'))  # the usage chunk
    pinged = asked[:cut] + b": ping\n\n" + asked[cut:]
    # direct, the same comment comes right before [DONE], where the usage chunk was
    end = direct.index(b"data: [DONE]")
    expected = direct[:end] + b": ping\n\n" + direct[end:]
    for i in range(0, len(pinged) + 1, 5):
        injection = Injection()
        stripper = UsageEventStripper(injection=injection)
        out = stripper.feed(pinged[:i]) + stripper.feed(pinged[i:]) + stripper.flush()
        assert out == expected, i
        assert injection.on and not stripper.unplaced, i


def test_a_null_usage_beside_choices_is_a_reshaped_stream_the_proxy_stops_asking_for() -> None:
    """OpenAI and Azure put `"usage": null` on every chunk once include_usage is set: the
    client, which did not set it, would get a member on each chunk it never gets direct.
    The stripper steps aside at the first one (the rest of that stream passes as it
    comes, the usage chunk too), and the proxy asks that upstream no more on that API, so
    the next stream is the backend's own."""
    chunk = (
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt",'
        b'"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}],"usage":null}\n\n'
    )
    stream = (
        chunk % b"Hel"
        + chunk % b"lo"
        + b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt",'
        b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
        b"data: [DONE]\n\n"
    )
    for i in range(0, len(stream) + 1, 3):
        told: list[str] = []
        injection = Injection()
        injection.on_forced = told.append
        stripper = UsageEventStripper(injection=injection, endpoint="/v1/chat/completions")
        out = stripper.feed(stream[:i]) + stripper.feed(stream[i:]) + stripper.flush()
        assert out == stream and stripper.stepped_aside, i
        assert told == ["/v1/chat/completions"] and not injection.asks("/v1/chat/completions")


def test_terminal_chunk_waits_only_for_the_next_event() -> None:
    asked, _ = _vllm032_pair("chat")
    events = [e + b"\n\n" for e in asked.split(b"\n\n") if e]
    terminal = events[-3]
    stripper = UsageEventStripper()
    assert stripper.feed(b"".join(events[:-3])) == b"".join(events[:-3])
    assert stripper.feed(terminal) == b""  # held: the usage chunk may follow
    assert stripper.feed(b"data: [DONE]\n\n") == terminal + b"data: [DONE]\n\n"


def test_terminal_chunk_without_a_fingerprint_on_the_usage_chunk_is_unchanged() -> None:
    # Older vLLM writes no fingerprint anywhere: nothing to give back.
    stream = fixture("vllm_chat.sse")
    assert relay(stream) == VLLM_CHAT_STRIPPED
    assert b"system_fingerprint" not in VLLM_CHAT_STRIPPED


def test_terminal_chunk_that_has_its_fingerprint_is_not_stamped_twice() -> None:
    terminal = (
        b'data: {"choices":[{"index":0,"finish_reason":"stop"}],"system_fingerprint":"fp"}\n\n'
    )
    usage = b'data: {"choices":[],"usage":{"completion_tokens":1},"system_fingerprint":"fp"}\n\n'
    assert relay(terminal + usage + b"data: [DONE]\n\n") == terminal + b"data: [DONE]\n\n"


def test_a_held_terminal_chunk_goes_out_when_the_stream_ends() -> None:
    terminal = b'data: {"choices":[{"index":0,"finish_reason":"stop"}]}\n\n'
    stripper = UsageEventStripper()
    assert stripper.feed(terminal) == b""
    assert stripper.flush() == terminal


def test_a_held_terminal_chunk_goes_out_first_when_the_stripper_gives_up() -> None:
    terminal = b'data: {"choices":[{"index":0,"finish_reason":"stop"}]}\n\n'
    stripper = UsageEventStripper(max_event_bytes=16)
    assert stripper.feed(terminal) == b""
    big = b"data: " + b"x" * 40
    assert stripper.feed(big) == terminal + big
    assert stripper.gave_up


def test_a_large_unfinished_event_after_whole_ones_is_relayed_not_lost() -> None:
    stripper = UsageEventStripper(max_event_bytes=16)
    head = b'data: {"a":1}\n\n'
    big = b"data: " + b"y" * 40
    assert stripper.feed(head + big) == head + big


# -- members a backend moves to the usage chunk: the kind, not one field ------------------

_TIMINGS = re.compile(rb',"timings":\{[^{}]*\}')


def _llamacpp_pair() -> tuple[bytes, bytes]:
    """(the include_usage stream with the no_usage stream's id and created second, what the
    client gets direct with the include_usage request's timings): two real llama-server
    requests that differ in nothing else (tests/fixtures/streams/llamacpp/README.md)."""
    asked = fixture("llamacpp/chat_stream_include_usage.sse")
    direct = fixture("llamacpp/chat_stream_no_usage.sse")
    for field in (rb'"id":"[^"]*"', rb'"created":\d+'):
        want = re.search(field, direct)
        assert want is not None
        asked = re.sub(field, want.group(0).replace(b"\\", b"\\\\"), asked)
    (moved,) = _TIMINGS.findall(asked)
    (own,) = _TIMINGS.findall(direct)
    return asked, direct.replace(own, moved)


def test_llamacpp_timings_go_back_to_the_finish_chunk_at_every_split() -> None:
    asked, direct = _llamacpp_pair()
    (usage_chunk,) = [e for e in asked.split(b"\n\n") if b'"choices":[],' in e]
    assert b'"timings"' in usage_chunk and b'"timings"' not in asked.replace(usage_chunk, b"")
    assert relay(asked) == direct
    for i in range(len(asked) + 1):
        assert relay(asked[:i], asked[i:]) == direct, i
    assert relay(*[asked[i : i + 1] for i in range(len(asked))]) == direct


@settings(max_examples=100)
@given(cuts=st.lists(st.integers(min_value=0, max_value=2500), max_size=12))
def test_llamacpp_timings_go_back_at_random_splits(cuts: list[int]) -> None:
    asked, direct = _llamacpp_pair()
    assert relay(*_split(asked, cuts)) == direct


@pytest.mark.parametrize("name", ["chat_stream_no_usage.sse", "completions_stream_no_usage.sse"])
def test_llamacpp_streams_without_a_usage_only_chunk_pass_byte_for_byte(name: str) -> None:
    stream = fixture(f"llamacpp/{name}")
    assert relay(stream) == stream


def test_a_moved_member_goes_back_last_with_its_exact_bytes() -> None:
    # llama.cpp's shape (tools/server/server-task.cpp, to_json_oaicompat_chat_stream): the
    # finish chunk already has its fingerprint; timings ride on the usage chunk when asked.
    timings = b',"timings":{"cache_n":0,"prompt_n":5,"prompt_ms":1.5e-3,"x":[1, 2]}'
    terminal = (
        b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1,'
        b'"id":"c","model":"m","system_fingerprint":"b1-x","object":"chat.completion.chunk"}\n\n'
    )
    usage = (
        b'data: {"choices":[],"created":1,"id":"c","model":"m","system_fingerprint":"b1-x",'
        b'"object":"chat.completion.chunk","usage":{"completion_tokens":2}' + timings + b"}\n\n"
    )
    direct = terminal[: terminal.rfind(b"}")] + timings + b"}\n\n"
    stream = terminal + usage + b"data: [DONE]\n\n"
    stripper = UsageEventStripper()
    assert stripper.feed(stream) + stripper.flush() == direct + b"data: [DONE]\n\n"
    assert stripper.unplaced == ()


def test_usage_only_members_go_with_the_usage_chunk() -> None:
    asked, direct = _vllm032_pair("chat")
    assert b'"metrics":' in asked and b'"metrics":' not in direct  # vLLM's, usage-only
    stripper = UsageEventStripper()
    assert stripper.feed(asked) + stripper.flush() == direct
    assert stripper.unplaced == ()


TERMINAL = b'data: {"choices":[{"index":0,"finish_reason":"stop"}],"id":"c"}\n\n'
UNKNOWN = b'data: {"choices":[],"id":"c","usage":{"completion_tokens":1},"novel":{"a":1}}\n\n'


def test_a_member_it_cannot_place_stops_usage_injection_for_the_upstream() -> None:
    refused: list[tuple[str, ...]] = []
    injection = Injection(refused.append)
    stripper = UsageEventStripper(injection=injection)
    out = stripper.feed(TERMINAL + UNKNOWN + b"data: [DONE]\n\n") + stripper.flush()
    assert out == TERMINAL + b"data: [DONE]\n\n"  # the member is not guessed onto a chunk
    assert stripper.unplaced == ("novel",)
    assert not injection.on and injection.unplaced == ("novel",)
    assert refused == [("novel",)]
    UsageEventStripper(injection=injection).feed(TERMINAL + UNKNOWN)
    assert refused == [("novel",)]  # told once


def test_an_unreadable_usage_chunk_after_a_terminal_one_stops_injection() -> None:
    injection = Injection()
    broken = b'data: {"choices":[],"usage":{"completion_tokens":1},"x":tru}\n\n'
    assert relay_with(injection, TERMINAL + broken) == TERMINAL
    assert not injection.on


def test_a_usage_chunk_with_nothing_to_place_keeps_injection_on() -> None:
    injection = Injection()
    usage = b'data: {"choices":[],"id":"c","usage":{"completion_tokens":1}}\n\n'
    assert relay_with(injection, TERMINAL + usage) == TERMINAL
    assert injection.on


def relay_with(injection: Injection, *chunks: bytes) -> bytes:
    stripper = UsageEventStripper(injection=injection)
    return b"".join(stripper.feed(c) for c in chunks) + stripper.flush()


@pytest.mark.parametrize(
    ("event", "members"),
    [
        (b'data: {"a":1,"b":{"c":[1,"}"]}}\n\n', {"a": '"a":1', "b": ',"b":{"c":[1,"}"]}'}),
        (b'data: { "a" : 1 , "b":"\\u00e9"}\n\n', {"a": ' "a" : 1', "b": ' , "b":"\\u00e9"'}),
        (b'data: {"\xc3\xa9":1}\n\n', {"\u00e9": '"\u00e9":1'}),
        (b"data: {}\n\n", {}),
    ],
)
def test_members_keep_their_exact_text(event: bytes, members: dict[str, str]) -> None:
    assert _members(event) == members


@pytest.mark.parametrize(
    "event",
    [
        b"data: [DONE]\n\n",
        b'data: {"a":1,}\n\n',
        b'data: {"a" 1}\n\n',
        b'data: {"a":1}}\n\n',
        b'data: {"a":\n\ndata: 1}\n\n',
        b'data: {"\xff":1}\n\n',
        b'data: {"a":1 "b":2}\n\n',
    ],
)
def test_members_of_no_single_object_are_none(event: bytes) -> None:
    assert _members(event) is None


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200)
@given(obj=st.dictionaries(st.text(), _JSON, max_size=6), compact=st.booleans())
def test_members_rebuild_the_object_exactly(obj: dict[str, object], compact: bool) -> None:
    text = json.dumps(obj, separators=(",", ":") if compact else None, ensure_ascii=False)
    members = _members(b"data: " + text.encode() + b"\n\n")
    assert members is not None and list(members) == list(obj)
    assert "{" + "".join(members.values()) + "}" == text  # each member's exact text, in order


# -- a stream that breaks off (at_break) ---------------------------------------------------


def broken_off(*chunks: bytes) -> bytes:
    """What the client gets of a stream that breaks after `chunks`."""
    stripper = UsageEventStripper()
    return b"".join(stripper.feed(c) for c in chunks) + stripper.at_break()


def test_a_break_right_after_the_finish_chunk_gives_the_client_that_chunk() -> None:
    finish = VLLM_CHAT.index(b'"finish_reason":"stop"')
    end = VLLM_CHAT.index(b"\n\n", finish) + 2
    assert broken_off(VLLM_CHAT[:end]) == VLLM_CHAT[:end]


def test_every_break_gives_the_client_a_prefix_holding_every_whole_event_but_usage() -> None:
    usage = usage_only_event(VLLM_CHAT)
    usage_at = VLLM_CHAT.index(usage)
    for i in range(len(VLLM_CHAT) + 1):
        cut = VLLM_CHAT[:i]
        out = broken_off(cut)
        assert VLLM_CHAT_STRIPPED.startswith(out), i
        whole = cut[: cut.rfind(b"\n\n") + 2] if b"\n\n" in cut else b""
        assert out.startswith(relay(whole)), i  # every whole event, the finish chunk too
        assert b'"usage"' not in out, i
        if not usage_at < i < usage_at + len(usage):  # half an event that is no usage chunk
            assert out == cut.replace(usage, b""), i  # goes, byte for byte, as direct


def test_half_an_event_after_the_finish_chunk_is_held_back_as_the_usage_chunk_may_be() -> None:
    # Where the usage chunk comes, half an event may be it: held back, its line ends not.
    assert broken_off(TERMINAL + b'\ndata: {"id":"c","obj') == TERMINAL + b"\n"


@pytest.mark.parametrize(
    "partial",
    [b'data: {"id":"c","choices":[],"us', b'data: {"id":"c","usage":{"prompt_tokens":1'],
)
def test_half_an_event_that_reads_as_the_usage_chunk_is_held_back(partial: bytes) -> None:
    content = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    assert broken_off(content + partial) == content


def test_a_break_gives_nothing_twice() -> None:
    stripper = UsageEventStripper()
    stripper.feed(TERMINAL)
    assert stripper.at_break() == TERMINAL
    assert stripper.at_break() == b"" and stripper.flush() == b""


def test_a_compressed_stream_stops_usage_injection_once() -> None:
    told: list[str] = []
    injection = Injection()
    injection.on_leaked = told.append
    stripper = UsageEventStripper(injection=injection, endpoint="chat")
    stripper.encoded()
    assert stripper.gave_up and not injection.asks("chat")
    UsageEventStripper(injection=injection).encoded()
    assert told == ["compressed it though the proxy asked for identity"]
