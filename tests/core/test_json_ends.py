"""A JSON answer too large to keep, read from its two ends (proxy/core/json_ends.py).

The answers are shaped as the backends write them (each test names its source); the
property at the end builds objects of one large member with hostile strings (quotes,
backslash runs, brackets, commas and multibyte characters, wherever a window may begin)
and checks every member read against the whole parse.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.json_ends import HEAD_BYTES, TAIL_BYTES, BodyEnds, read

MiB = 1024 * 1024


def ends(body: bytes) -> dict[str, Any] | None:
    return read(body[:HEAD_BYTES], body[-TAIL_BYTES:])


def test_a_long_chat_answer_gives_its_identity_usage_and_finish() -> None:
    """vLLM 0.32's ChatCompletionResponse, compact as its JSONResponse writes it: the
    content of 3 MiB in the middle, the finish after it in its choice, usage at the end."""
    body = orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "a" * (3 * MiB)},
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "token_ids": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": "fp_1",
            "usage": {"prompt_tokens": 9, "completion_tokens": 700000, "total_tokens": 700009},
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
    )
    assert ends(body) == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        # the choice the ends are cut in: what follows its message
        "choices": [
            {"logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": None}
        ],
        "service_tier": None,
        "system_fingerprint": "fp_1",
        "usage": {"prompt_tokens": 9, "completion_tokens": 700000, "total_tokens": 700009},
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def test_logprobs_with_quotes_and_backslashes_in_their_tokens() -> None:
    """A chat answer with logprobs (vLLM's ChatCompletionLogProbs: token, logprob, bytes,
    top_logprobs), whose tokens hold the characters a window may begin inside."""
    entry = {"token": 'say "\\n" \\', "logprob": -0.5, "bytes": [34, 92], "top_logprobs": []}
    top = [{"token": '"]},{', "logprob": -1.5, "bytes": [34]}] * 4
    body = orjson.dumps(
        {
            "id": "chatcmpl-2",
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x"},
                    "logprobs": {"content": [{**entry, "top_logprobs": top}] * 6000},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 2, "completion_tokens": 6000, "total_tokens": 6002},
        }
    )
    assert len(body) > MiB
    got = ends(body)
    assert got is not None
    assert got["choices"] == [{"finish_reason": "stop"}]
    assert (got["id"], got["usage"]["completion_tokens"]) == ("chatcmpl-2", 6000)


def test_an_embeddings_batch_gives_its_usage() -> None:
    """vLLM's EmbeddingResponse (pooling/embed/protocol.py): id, object, created, model,
    data, usage. Its last element is whole in the window."""
    vector = [0.0123456789] * 1024
    data = [{"index": i, "object": "embedding", "embedding": vector} for i in range(200)]
    body = orjson.dumps(
        {
            "id": "embd-1",
            "object": "list",
            "created": 1,
            "model": "e5",
            "data": data,
            "usage": {"prompt_tokens": 4000, "total_tokens": 4000, "completion_tokens": 0},
        }
    )
    got = ends(body)
    assert got is not None
    assert (got["id"], got["model"], got["usage"]["prompt_tokens"]) == ("embd-1", "e5", 4000)
    assert got["data"] == [data[-1]]


def test_ollamas_embed_answer_keeps_a_list_of_embeddings() -> None:
    """Ollama's /api/embed (api/types.go EmbedResponse): model, embeddings, then its
    durations and prompt_eval_count. The parser reads counts only beside a list."""
    body = orjson.dumps(
        {
            "model": "all-minilm",
            "embeddings": [[0.25] * 4096] * 100,
            "total_duration": 14143917,
            "load_duration": 1019500,
            "prompt_eval_count": 800,
        }
    )
    got = ends(body)
    assert got is not None
    assert got == {
        "model": "all-minilm",
        "embeddings": [],  # the stand-in: its last element is no object
        "total_duration": 14143917,
        "load_duration": 1019500,
        "prompt_eval_count": 800,
    }


def test_members_after_a_long_string_at_the_top() -> None:
    """llama-server's /completion answer (tools/server/server-task.cpp, to_json_non_oaicompat):
    its content first, its stop type, counts and timings after; pretty-printed, to show
    whitespace anywhere."""
    answer = {
        "index": 0,
        "content": 'a "quoted" \\ line\n' * 200000,
        "tokens": [],
        "model": "gguf",
        "tokens_predicted": 1000,
        "tokens_evaluated": 5,
        "stop_type": "limit",
        "timings": {"prompt_n": 5, "predicted_n": 1000},
    }
    body = json.dumps(answer, indent=2).encode()
    got = ends(body)
    assert got is not None
    assert {k: got[k] for k in ("index", "model", "stop_type", "timings")} == {
        "index": 0,
        "model": "gguf",
        "stop_type": "limit",
        "timings": {"prompt_n": 5, "predicted_n": 1000},
    }
    assert "content" not in got


def test_ends_that_hold_no_member_are_read_as_nothing() -> None:
    big = b"x" * (2 * MiB)
    assert ends(big) is None  # no JSON
    assert ends(b"[" + b"1," * MiB + b"1]") is None  # a list, no object
    assert ends(b'{"a":"' + big + b'"}') is None  # one member, longer than the window
    assert ends(b'{"a":[' + b"1," * MiB + b"1]}") is None


def test_ends_nested_past_any_parser_are_read_as_nothing_or_what_is_whole() -> None:
    """A hostile backend's nesting: json's C scanner refuses a value nested past the
    interpreter's recursion limit, and orjson past 1024; the read says so, it does not
    raise. Nesting the window begins in is walked out of, level by level."""
    ones = b"1," * MiB
    deep = b"[" * 20000 + b"]" * 20000  # whole in the window
    assert ends(b'{"a":[' + ones + deep + b'],"usage":{"n":1}}') is None
    deeper = b"[" * 50000 + b"]" * 50000  # the window begins inside it
    got = ends(b'{"a":[' + ones + deeper + b'],"usage":{"n":1}}')
    assert got == {"a": [], "usage": {"n": 1}}


def test_the_ends_kept_are_the_first_and_last_bytes_whatever_the_reads() -> None:
    body = bytes(range(256)) * 8192  # 2 MiB
    for size in (1, 1000, 65535, 65536, 200000):
        kept = BodyEnds([body[:MiB], body[MiB : MiB + 10]])
        for at in range(MiB + 10, len(body), size):
            kept.feed(body[at : at + size])
        assert (kept.head, kept.tail()) == (body[:HEAD_BYTES], body[-TAIL_BYTES:]), size


# -- the property -----------------------------------------------------------------------

#: Text that is hardest where a window begins: quotes, backslash runs, JSON's own marks,
#: escapes json.dumps writes, and characters of 2, 3 and 4 bytes.
HOSTILE = st.text(alphabet=st.sampled_from(list('a"\\,:{}[] \n\u2028é€😀')), max_size=40)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), HOSTILE)
SMALL = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(HOSTILE, inner, max_size=4)
    ),
    max_leaves=12,
)
NAMES = st.lists(HOSTILE, min_size=1, max_size=12, unique=True)


def _body(
    members: list[tuple[str, Any]], ascii_only: bool, spaced: bool
) -> tuple[bytes, list[int]]:
    """The object of `members`, and where each member's text begins."""
    separator, colon = (", ", ": ") if spaced else (",", ":")
    body, starts = b"{", []
    for index, (name, value) in enumerate(members):
        if index:
            body += separator.encode()
        starts.append(len(body))
        text = json.dumps(name, ensure_ascii=ascii_only) + colon
        body += (text + json.dumps(value, ensure_ascii=ascii_only)).encode()
    return body + b"}", starts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    names=NAMES,
    values=st.lists(SMALL, min_size=12, max_size=12),
    element=st.dictionaries(HOSTILE, SMALL, max_size=5),
    big_at=st.integers(0, 11),
    as_list=st.booleans(),
    ascii_only=st.booleans(),
    spaced=st.booleans(),
    head_cut=st.integers(1, 10**6),
    tail_cut=st.integers(1, 10**6),
)
def test_every_member_read_is_the_members_whole_value(
    names: list[str],
    values: list[Any],
    element: dict[str, Any],
    big_at: int,
    as_list: bool,
    ascii_only: bool,
    spaced: bool,
    head_cut: int,
    tail_cut: int,
) -> None:
    """Members before and after one large member (a list of objects, or a string of
    hostile text); the head and the tail window both cut inside its value, at any byte.
    Every member before it and every member after it is read with its whole value; the
    large member stands in as a list holding what of its last element lies whole in the
    tail."""
    big = "\u0000big"
    members = list(zip(names, values, strict=False))
    big_at = min(big_at, len(members))
    filler = [element] * 300 if as_list else '"\\,{[é😀' * 2000
    members.insert(big_at, (big, filler))
    body, starts = _body(members, ascii_only, spaced)
    whole = orjson.loads(body)
    # the large value's bytes: from its opening `[` or `"` to the separator after it
    value_at = body.index(b"[" if as_list else b'"', starts[big_at] + len(json.dumps(big)))
    value_end = starts[big_at + 1] if big_at + 1 < len(members) else len(body) - 1
    inside = value_end - value_at - 3  # well inside it, short of its last bytes
    head = body[: value_at + 1 + head_cut % inside]
    tail = body[value_at + 1 + tail_cut % inside :]
    got = read(head, tail)
    expected = {name: whole[name] for name, _ in members if name != big}
    if big_at + 1 == len(members):
        assert got is None  # the tail holds no whole member
        return
    assert got is not None
    stand_in = got.pop(big, None)
    assert got == expected
    if not as_list:
        assert stand_in is None
        return
    assert stand_in is not None and len(stand_in) <= 1
    for read_element in stand_in:
        assert read_element.items() <= whole[big][-1].items()  # as orjson reads it whole


def test_a_window_may_begin_at_any_byte() -> None:
    """Every window over one body whose last members hold every hard case: a member is
    read once the comma before it is in the window."""
    members = [
        ("id", "r"),
        ("choices", [{"finish_reason": 'a"b\\', "x": ['\\"', "\\\\", "]},{"]}] * 40),
        ("quoted", '\\"' * 20),
        ("nested", {"a": [{"b": "}"}], "c": "\\"}),
        ("usage", {"prompt_tokens": 1}),
    ]
    body, starts = _body(members, ascii_only=False, spaced=True)
    whole = orjson.loads(body)
    for first in range(1, len(body)):
        got = read(b"", body[first:])
        # the comma is two bytes before a member's text (", ")
        expected = {
            name: whole[name]
            for (name, _), at in zip(members, starts, strict=True)
            if at - 2 >= first
        }
        assert got == (expected or None), first
