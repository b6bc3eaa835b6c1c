"""The NDJSON decoder: Ollama's stream shape, every way a network read can split it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.ndjson import NDJSONDecoder
from proxy.core.sse import EventTooLarge

# The shape of ollama/ollama docs/api.md "Generate a chat completion" (streaming), one
# object a line as server/routes.go streamResponse writes them (json.Marshal + "\n").
LINES = [
    b'{"model":"llama3.2","created_at":"2023-08-04T08:52:19.385406455-07:00",'
    b'"message":{"role":"assistant","content":"The"},"done":false}',
    b'{"model":"llama3.2","created_at":"2023-08-04T08:52:19.385406455-07:00",'
    b'"message":{"role":"assistant","content":" sky \\u2028 is \xe2\x80\xa8 blue\\n"},"done":false}',
    b'{"model":"llama3.2","created_at":"2023-08-04T19:22:45.499127Z","message":{"role":'
    b'"assistant","content":""},"done":true,"done_reason":"stop","total_duration":4883583458,'
    b'"load_duration":1334875,"prompt_eval_count":26,"prompt_eval_duration":342546000,'
    b'"eval_count":282,"eval_duration":4535599000}',
]
STREAM = b"".join(line + b"\n" for line in LINES)


def decode(*chunks: bytes) -> list[bytes]:
    decoder = NDJSONDecoder()
    lines: list[bytes] = []
    for chunk in chunks:
        lines += decoder.feed(chunk)
    return lines + decoder.flush()


def test_one_line_per_read_is_one_line() -> None:
    decoder = NDJSONDecoder()
    assert [decoder.feed(line + b"\n") for line in LINES] == [[line] for line in LINES]
    assert decoder.flush() == []


def test_line_separator_inside_json_does_not_split_a_line() -> None:
    # U+2028 raw (e2 80 a8) and escaped: str.splitlines would cut the second line in two.
    assert decode(STREAM) == LINES


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_every_two_way_split_gives_the_same_lines(cut: int) -> None:
    assert decode(STREAM[:cut], STREAM[cut:]) == LINES


def test_byte_at_a_time_gives_the_same_lines() -> None:
    assert decode(*(STREAM[i : i + 1] for i in range(len(STREAM)))) == LINES


@settings(max_examples=200)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_random_splits_give_the_same_lines(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    pieces = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    assert decode(*pieces) == LINES


def test_crlf_line_ends_drop_the_cr() -> None:
    assert decode(b'{"a":1}\r\n{"b":2}\r', b"\n") == [b'{"a":1}', b'{"b":2}']


def test_blank_and_whitespace_lines_are_skipped() -> None:
    assert decode(b'\n\n{"a":1}\n  \n\r\n{"b":2}\n') == [b'{"a":1}', b'{"b":2}']


def test_a_last_line_without_lf_comes_out_on_flush_only() -> None:
    decoder = NDJSONDecoder()
    assert decoder.feed(b'{"a":1}\n{"done":tr') == [b'{"a":1}']
    assert decoder.feed(b"ue}") == []
    assert decoder.flush() == [b'{"done":true}']
    assert decoder.flush() == []


def test_an_empty_read_changes_nothing() -> None:
    decoder = NDJSONDecoder()
    assert decoder.feed(b'{"a"') == []
    assert decoder.feed(b"") == []
    assert decoder.feed(b":1}\n") == [b'{"a":1}']


def test_a_line_that_is_not_json_is_still_a_line() -> None:
    # Judging JSON is the seam's job (MALFORMED), not the framing's.
    assert decode(b"{not json\n") == [b"{not json"]


def test_a_line_over_the_limit_raises_whether_whole_or_in_pieces() -> None:
    with pytest.raises(EventTooLarge):
        NDJSONDecoder(max_event_bytes=8).feed(b'{"a":"0123456789"}\n')
    decoder = NDJSONDecoder(max_event_bytes=8)
    decoder.feed(b'{"a":"01')
    with pytest.raises(EventTooLarge):
        decoder.feed(b"23456789")
    assert NDJSONDecoder(max_event_bytes=8).feed(b'{"a":1}\n{"b":2}\n') == [b'{"a":1}', b'{"b":2}']
