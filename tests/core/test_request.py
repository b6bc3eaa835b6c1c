"""Reading a client's request body, and asking upstream for usage without changing the rest."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.core.apis import api_for
from proxy.core.apis.chat import Chat
from proxy.core.request import CHAT, COMPLETIONS, RequestInfo, parse_request


def with_usage_requested(obj: dict[str, Any], body: bytes | None = None) -> bytes | None:
    """Chat.ask_for_usage for a body sent as orjson writes `obj`, unless `body` is given."""
    return Chat().ask_for_usage(obj, orjson.dumps(obj) if body is None else body)


MESSAGES = [{"role": "user", "content": "Hi"}]


def body(**fields: object) -> bytes:
    return orjson.dumps({"model": "llama", "messages": MESSAGES, **fields})


def test_chat_request_fields_are_read() -> None:
    info, obj = parse_request(CHAT, body(stream=True, max_tokens=64, temperature=0.2))
    assert info == RequestInfo(
        endpoint=CHAT,
        model="llama",
        stream=True,
        usage_requested=False,
        max_tokens=64,
        temperature=0.2,
        prompt=MESSAGES,
    )
    assert obj is not None and obj["messages"] == MESSAGES


def test_completions_prompt_is_the_prompt_field() -> None:
    raw = orjson.dumps({"model": "llama", "prompt": "Paris is", "messages": MESSAGES})
    info, _ = parse_request(COMPLETIONS, raw)
    assert info.prompt == "Paris is"


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    info, _ = parse_request(CHAT, body(max_tokens=10, max_completion_tokens=20))
    assert info.max_tokens == 20


def test_usage_requested_when_include_usage_is_true_as_vllm_reads_it() -> None:
    """vLLM's pydantic models read `1` as true (proxy/core/lax.py), `"false"` as false."""
    on, _ = parse_request(CHAT, body(stream=True, stream_options={"include_usage": True}))
    off, _ = parse_request(CHAT, body(stream=True, stream_options={"include_usage": False}))
    one, _ = parse_request(CHAT, body(stream=True, stream_options={"include_usage": 1}))
    word, _ = parse_request(CHAT, body(stream=True, stream_options={"include_usage": "false"}))
    assert (on.usage_requested, off.usage_requested, one.usage_requested) == (True, False, True)
    assert word.usage_requested is False


@pytest.mark.parametrize(("stream", "streams"), [("true", True), (1, True), ("no", False),
                                                 (None, False), (2, False), ("maybe", False)])  # fmt: skip
def test_stream_is_read_as_vllm_reads_it(stream: object, streams: bool) -> None:
    info, _ = parse_request(CHAT, body(stream=stream))
    assert info.stream is streams


@pytest.mark.parametrize(
    ("fields", "max_tokens", "temperature"),
    [
        ({"max_tokens": True, "temperature": True}, 1, 1.0),  # pydantic's lax reading
        ({"max_tokens": "16", "temperature": "0.7"}, 16, 0.7),
        ({"max_tokens": 12.5, "temperature": "hot"}, None, None),  # vLLM refuses both
        ({"max_tokens": [1], "temperature": "nan"}, None, None),  # no figure to report
        ({"temperature": 1}, None, 1.0),
    ],
)
def test_numbers_are_read_as_vllm_reads_them_and_others_dropped(
    fields: dict[str, object], max_tokens: int | None, temperature: float | None
) -> None:
    info, _ = parse_request(CHAT, body(**fields))
    assert (info.max_tokens, info.temperature) == (max_tokens, temperature)


@pytest.mark.parametrize("model", [None, 42, ["llama"], {"name": "llama"}])
def test_non_string_model_becomes_empty(model: object) -> None:
    info, obj = parse_request(CHAT, body(model=model))
    assert info.model == ""
    assert info.valid_json is True
    assert obj is not None


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b'{"model": "llama",}', b"\xff\xfe"])
def test_malformed_body_gives_defaults(raw: bytes) -> None:
    info, obj = parse_request(CHAT, raw)
    assert obj is None
    assert info == RequestInfo(CHAT, "", False, False, None, None, valid_json=False)


@pytest.mark.parametrize("raw", [b"[]", b'"llama"', b"42", b"null"])
def test_json_that_is_not_an_object_gives_defaults(raw: bytes) -> None:
    info, obj = parse_request(CHAT, raw)
    assert obj is None
    assert info.valid_json is False


# -- asking for usage (Chat.ask_for_usage) -----------------------------------------------------------------


def test_usage_request_is_added_and_everything_else_kept() -> None:
    original = {"model": "llama", "messages": MESSAGES, "stream": True, "n": 1, "seed": 7}
    assert orjson.loads(with_usage_requested(dict(original))) == {
        **original,
        "stream_options": {"include_usage": True},
    }


def test_no_usage_is_asked_for_several_choices() -> None:
    # vLLM stamps system_fingerprint on every choice's terminal chunk only without
    # include_usage; the stripper can give it back to the last one alone.
    assert with_usage_requested({"model": "llama", "stream": True, "n": 2}) is None


@pytest.mark.parametrize(
    ("prompt", "asked"),
    [
        ("once upon", True),
        (["once upon"], True),
        ([1, 2, 3], True),  # token ids: one prompt
        ([[1, 2, 3]], True),
        (["once upon", "a time"], False),  # a batch streams a choice for each, as n > 1
        ([[1, 2], [3, 4]], False),
    ],
)
def test_no_completions_usage_is_asked_for_a_batch_of_prompts(prompt: object, asked: bool) -> None:
    api = api_for("/v1/completions")
    assert api is not None
    obj = {"model": "llama", "stream": True, "prompt": prompt}
    assert (api.ask_for_usage(obj, orjson.dumps(obj)) is not None) is asked


def test_continuous_usage_is_turned_off_with_the_usage_the_proxy_asks_for() -> None:
    # Without include_usage vLLM sends no per-chunk usage however continuous_usage_stats
    # is set: the client would get none direct.
    obj = {"model": "llama", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    sent = orjson.loads(with_usage_requested(obj))
    assert sent["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


def test_other_stream_options_are_kept() -> None:
    obj = {"model": "llama", "stream": True, "stream_options": {"x_vendor": 1}}
    sent = orjson.loads(with_usage_requested(obj))
    assert sent["stream_options"] == {"x_vendor": 1, "include_usage": True}


def test_include_usage_false_is_turned_on() -> None:
    obj = {"model": "llama", "stream": True, "stream_options": {"include_usage": False}}
    assert orjson.loads(with_usage_requested(obj))["stream_options"] == {"include_usage": True}


def test_null_stream_options_is_replaced() -> None:
    obj = {"model": "llama", "stream": True, "stream_options": None}
    assert orjson.loads(with_usage_requested(obj))["stream_options"] == {"include_usage": True}


def test_without_stream_options_the_clients_bytes_stay_as_they_came() -> None:
    """Spacing, escapes, an integer beyond 64 bits (orjson would read a float) and nesting
    deeper than orjson writes: the field is added before the closing brace, nothing else
    changes (review: vLLM refused `vllm_xargs` {"k": 1e29} direct and took it proxied)."""
    deep = b"[" * 300 + b"]" * 300
    body = (
        b'{ "model" : "llama", "stream": true, "prompt": "caf\\u00e9",\n'
        b'  "vllm_xargs": {"k": 123456789012345678901234567890}, "x": ' + deep + b" }\r\n"
    )
    obj = orjson.loads(body)
    assert with_usage_requested(obj, body) == (
        body[: body.rindex(b"}")] + b',"stream_options":{"include_usage":true}' + b"}\r\n"
    )


@pytest.mark.parametrize(
    "options",
    ["yes", [], {"include_usage": "maybe"}, {"include_usage": 2}, {"continuous_usage_stats": "x"}],
)
def test_a_stream_options_vllm_refuses_goes_as_it_came(options: object) -> None:
    """vLLM answers these 400 (pydantic: model_attributes_type, bool_parsing); rewritten,
    the request was a 200 stream through the proxy (review)."""
    assert (
        with_usage_requested({"model": "llama", "stream": True, "stream_options": options}) is None
    )


def test_a_body_whose_rewrite_would_change_it_goes_as_it_came() -> None:
    merged = {"model": "llama", "stream": True, "stream_options": {"x_vendor": 1}}
    big = orjson.dumps(merged)[:-1] + b',"priority":18446744073709551617}'
    assert with_usage_requested(orjson.loads(big), big) is None  # orjson reads a float
    nested: Any = []
    for _ in range(300):
        nested = [nested]
    deep = {**merged, "x": nested}
    assert with_usage_requested(deep, b"{}") is None  # orjson writes 254 levels at most


def test_caller_object_is_not_mutated() -> None:
    options = {"continuous_usage_stats": True}
    obj = {"model": "llama", "stream_options": options}
    with_usage_requested(obj)
    assert obj == {"model": "llama", "stream_options": {"continuous_usage_stats": True}}


def test_field_order_is_kept() -> None:
    obj = {"stream": True, "model": "llama", "messages": MESSAGES}
    assert list(orjson.loads(with_usage_requested(obj))) == [
        "stream",
        "model",
        "messages",
        "stream_options",
    ]
