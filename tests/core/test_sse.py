"""The SSE decoder: the WHATWG examples, every way a network read can split a stream."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.sse import SSEDecoder
from tests.paths import STREAMS

VLLM_CHAT = (STREAMS / "vllm_chat.sse").read_bytes()
VLLM_CHAT_EVENTS = [
    line[len(b"data: ") :] for line in VLLM_CHAT.split(b"\n") if line.startswith(b"data: ")
]


def decode(*chunks: bytes) -> list[bytes]:
    decoder = SSEDecoder()
    events: list[bytes] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    return events + decoder.flush()


def decode_without_flush(*chunks: bytes) -> list[bytes]:
    decoder = SSEDecoder()
    events: list[bytes] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    return events


# -- the WHATWG spec's examples (html.spec.whatwg.org, "server-sent events") ---------------


def test_spec_example_multiline_data_is_joined_with_lf() -> None:
    assert decode_without_flush(b"data: YHOO\ndata: +2\ndata: 10\n\n") == [b"YHOO\n+2\n10"]


def test_spec_example_comment_id_and_unfinished_last_event() -> None:
    stream = b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\ndata:  third event\n"
    assert decode_without_flush(stream) == [b"first event", b"second event"]


def test_spec_example_empty_data_fields() -> None:
    # "data" alone is a field with an empty value; two of them make one LF.
    assert decode_without_flush(b"data\n\ndata\ndata\n\ndata:") == [b"", b"\n"]


def test_spec_example_space_after_colon_is_optional() -> None:
    assert decode_without_flush(b"data:test\n\ndata: test\n\n") == [b"test", b"test"]


def test_only_one_space_after_the_colon_is_dropped() -> None:
    assert decode(b"data:  two spaces\n\n") == [b" two spaces"]


# -- splits ---------------------------------------------------------------------------------


def test_realistic_vllm_stream_decodes_to_its_events() -> None:
    assert decode(VLLM_CHAT) == VLLM_CHAT_EVENTS
    assert VLLM_CHAT_EVENTS[-1] == b"[DONE]"


def test_every_two_way_split_gives_the_same_events() -> None:
    for i in range(len(VLLM_CHAT) + 1):
        assert decode(VLLM_CHAT[:i], VLLM_CHAT[i:]) == VLLM_CHAT_EVENTS, i


def test_every_two_way_split_of_a_crlf_stream_gives_the_same_events() -> None:
    crlf = VLLM_CHAT.replace(b"\n", b"\r\n")
    for i in range(len(crlf) + 1):
        assert decode(crlf[:i], crlf[i:]) == VLLM_CHAT_EVENTS, i


def test_byte_at_a_time_feeding_gives_the_same_events() -> None:
    assert decode(*(VLLM_CHAT[i : i + 1] for i in range(len(VLLM_CHAT)))) == VLLM_CHAT_EVENTS


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted(min(c, len(data)) for c in cuts)  # repeats make empty reads
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=150)
@given(
    line_end=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=len(VLLM_CHAT) * 2), max_size=30),
)
def test_random_splits_give_the_same_events(line_end: bytes, cuts: list[int]) -> None:
    stream = VLLM_CHAT.replace(b"\n", line_end)
    assert decode(*_split(stream, cuts)) == VLLM_CHAT_EVENTS


# -- line endings ---------------------------------------------------------------------------


def test_crlf_line_endings() -> None:
    assert decode_without_flush(b"data: a\r\n\r\ndata: b\r\n\r\n") == [b"a", b"b"]


def test_cr_only_line_endings() -> None:
    assert decode_without_flush(b"data: a\r\rdata: b\r\r") == [b"a", b"b"]


def test_crlf_split_between_cr_and_lf_is_one_line_end() -> None:
    # Were the LF taken as a second line end, it would be a blank line: an extra dispatch.
    assert decode(b"data: a\r", b"\ndata: b\r\n\r\n") == [b"a\nb"]


def test_empty_read_between_cr_and_lf_does_not_make_a_blank_line() -> None:
    assert decode(b"data: a\r", b"", b"\ndata: b\r\n\r\n") == [b"a\nb"]


def test_cr_at_end_of_read_then_cr_is_a_blank_line() -> None:
    assert decode_without_flush(b"data: a\r", b"\r") == [b"a"]


# -- fields, comments, payload bytes --------------------------------------------------------


def test_data_without_a_space_after_the_colon() -> None:
    assert decode_without_flush(b'data:{"choices":[]}\n\n') == [b'{"choices":[]}']


def test_keepalive_comments_produce_no_events() -> None:
    assert decode_without_flush(b": ping\n\n: ping\n\ndata: x\n\n: ping\n\n") == [b"x"]


def test_event_id_and_retry_fields_are_ignored() -> None:
    stream = b"event: message\nid: 7\nretry: 1000\ndata: x\n\n"
    assert decode_without_flush(stream) == [b"x"]


def test_an_event_without_data_is_not_dispatched() -> None:
    assert decode_without_flush(b"event: ping\nid: 3\n\n") == []


def test_unicode_line_separator_inside_json_does_not_split() -> None:
    payload = '{"delta":{"content":"a\u2028b\u2029c\x85d"}}'.encode()
    assert decode_without_flush(b"data: " + payload + b"\n\n") == [payload]


def test_multibyte_utf8_split_across_reads_is_kept_whole() -> None:
    stream = 'data: {"content":"h\u00e9llo \U0001f600"}\n\n'.encode()
    emoji_start = stream.index("\U0001f600".encode())
    for i in range(emoji_start + 1, emoji_start + 4):
        assert decode(stream[:i], stream[i:]) == [stream[6:-2]]


# -- end of stream --------------------------------------------------------------------------


def test_flush_dispatches_a_last_event_lacking_its_blank_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\ndata: last\n") == [b"a"]
    assert decoder.flush() == [b"last"]


def test_flush_dispatches_a_last_line_lacking_its_line_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: [DONE]") == []
    assert decoder.flush() == [b"[DONE]"]


@pytest.mark.parametrize("tail", [b"", b"\n", b": ping\n"])
def test_flush_with_nothing_pending_gives_nothing(tail: bytes) -> None:
    decoder = SSEDecoder()
    decoder.feed(b"data: a\n\n" + tail)
    assert decoder.flush() == []
