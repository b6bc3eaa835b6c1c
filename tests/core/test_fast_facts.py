"""The facts taken from an event's bytes (proxy/core/template.py, the SSE decoder's whole-event
read) against the full parse: the same streams, split the same way, give the same record.

The full-parse side is the same observer with an Api that offers no text opening, so it
never learns a template and parses every event; the SSE decoder's shortcut is checked
against byte-at-a-time feeding, which never takes it.
"""

from __future__ import annotations

import contextvars
import json
import random
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.apis import Api, Facts, api_of
from proxy.core.measurement import Measurement
from proxy.core.observe import RELEARNS, StreamObserver
from proxy.core.request import CHAT, COMPLETIONS, RequestInfo
from proxy.core.sse import SSEDecoder
from proxy.core.template import STRING_BODY, learn
from tests.paths import FIXTURES

VLLM_032 = FIXTURES / "streams" / "vllm-0.32"  # real vLLM 0.32 captures (see its README)
PROOF = 4  # the parses that prove a template (two markers, each with and without texts)
LEARNS = 1 + RELEARNS  # a template is learnt again when the content kind changes


class Counting:
    """Wraps an Api: counts full parses; `openings=False` turns the template off."""

    def __init__(self, endpoint: str, openings: bool) -> None:
        base = type(api_of(endpoint))
        attrs: dict[str, Any] = {} if openings else {"text_openings": ()}
        self.api: Api = type("Under" + base.__name__, (base,), attrs)()
        self.parses = 0
        inner = self.api.event

        def event(payload: bytes, collect: bool, identify: bool) -> Facts:
            self.parses += 1
            return inner(payload, collect, identify)

        self.api.event = event  # type: ignore[method-assign]


def finished(finish: Coroutine[Any, Any, Measurement]) -> Measurement:
    """`StreamObserver.finish` run to its end with no event loop: given no counter it never
    waits, and a coroutine that never waits needs none. asyncio.run made and closed a loop
    for each of the module's thousands of records (about 70% of its time); one shared
    Runner still cost 40% of its CPU (a task each, and the SIGINT handler set and put
    back around each run, whose Enum lookup formats the task's repr: 34 s, now 19)."""
    try:
        finish.send(None)
    except StopIteration as done:
        return done.value
    finish.close()
    raise AssertionError("finish waited for something: it needs an event loop here")


def observe(api: Api, endpoint: str, reads: list[bytes]) -> tuple[Measurement, tuple[object, ...]]:
    request = RequestInfo(endpoint, "m", True, False, None, None)
    observer = StreamObserver(request, start=0.0, api=api)
    observer.open(200, "text/event-stream", 0.125)
    for i, chunk in enumerate(reads):
        observer.feed(chunk, 0.25 + i / 8)
    end = 0.25 + len(reads) / 8
    observer.end_of_stream(end)
    finish = observer.finish(
        end=end, started_at=1.0, status_code=200, error_type=None, error_message=None
    )
    record = contextvars.copy_context().run(finished, finish)  # its own, as asyncio.run gives
    seen = (observer.usage, observer.stream_error, observer.done, observer.malformed_events)
    return record, seen


def both(endpoint: str, reads: list[bytes]) -> int:
    """Feed `reads` to the fast and the full-parse observer; assert equal; return how
    many events the fast side parsed in full."""
    fast, full = Counting(endpoint, True), Counting(endpoint, False)
    assert observe(fast.api, endpoint, reads) == observe(full.api, endpoint, reads)
    assert fast.parses <= full.parses + PROOF * LEARNS
    return fast.parses


def split(raw: bytes, rng: random.Random) -> list[bytes]:
    if len(raw) < 2:
        return [raw]
    cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(0, 40))))
    return [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]


def by_event(raw: bytes) -> list[bytes]:
    parts = raw.split(b"\n\n")
    return [p + b"\n\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def endpoint_of(raw: bytes) -> str:
    return COMPLETIONS if b'"text_completion"' in raw else CHAT


FIXTURE_FILES = sorted((FIXTURES / "streams").rglob("*.sse"))


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_fixture_gives_the_same_record_at_every_split(path: Path) -> None:
    raw = path.read_bytes()
    endpoint = endpoint_of(raw)
    if b"chat.completion.chunk" not in raw and b"text_completion" not in raw:
        endpoint = "/v1/messages" if b"message_start" in raw else "/v1/responses"
        if "generate" in path.name:
            endpoint = CHAT  # not an OpenAI shape: both sides must still agree
    both(endpoint, by_event(raw))
    both(endpoint, [raw])
    for at in range(1, len(raw), 1 if len(raw) < 4096 else 5):  # every (fifth) two-way split
        both(endpoint, [raw[:at], raw[at:]])
    rng = random.Random(path.name)
    for _ in range(20):
        both(endpoint, split(raw, rng))


def test_a_vllm_stream_is_parsed_once_per_shape_not_per_chunk() -> None:
    raw = (VLLM_032 / "chat_stream_no_usage.sse").read_bytes()
    events = by_event(raw)
    assert b'"delta":{"content":"\\n"}' in events[1]
    events = [events[0], *[events[1]] * 30, *events[1:]]  # a longer answer, the same shape
    parsed = both(CHAT, events)
    # role chunk, first content event (then learnt), last content + finish chunk, [DONE]
    assert len(events) > 30 and parsed <= 4 + PROOF, parsed


def test_a_reasoning_stream_learns_its_answer_shape_once_more() -> None:
    """Reasoning, then the answer: each kind's shape is learnt once (PROOF parses), and
    the record says when each kind began (issue 26)."""
    head = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{'
    tail = b'},"finish_reason":null}]}\n\n'
    thinking = [head + b'"reasoning":"hm ' + str(i).encode() + b'"' + tail for i in range(20)]
    answer = [head + b'"content":"ok ' + str(i).encode() + b'"' + tail for i in range(20)]
    events = [*thinking, *answer, b"data: [DONE]\n\n"]
    parsed = both(CHAT, events)
    assert parsed <= 2 * 2 + 1 + 2 * PROOF, parsed  # 2 per shape before learnt, [DONE]
    fast = Counting(CHAT, True)
    record, _ = observe(fast.api, CHAT, events)
    assert record.first_reasoning == 0.25 and record.last_reasoning == 0.25 + 19 / 8
    assert record.first_answer == 0.25 + 20 / 8 and record.ttft == 0.25
    assert record.reasoning_events == 20 and record.reasoning_token_source == "events"
    assert record.reasoning_tokens == 20 and record.without_answer is None


# -- generated streams ------------------------------------------------------------------

TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
ODD_BODY = st.one_of(  # bytes between the quotes that no JSON encoder writes
    st.binary(max_size=8),
    st.sampled_from([b"\\", b"\\x", b"\\ud800", b"\\udc00", b"\\ud83d\\ude00", b"\xed\xa0\x80",
                     b"\xc0\xaf", b"\x01", b'a"b', b"\\u00e9", b"\\/", b"", b"\xf4\x90\x80\x80"]),
)  # fmt: skip


def encode(value: object, ascii_only: bool) -> bytes:
    if ascii_only:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode()
    return orjson.dumps(value)


@st.composite
def streams(draw: st.DrawFn) -> tuple[str, bytes]:
    chat = draw(st.booleans())
    ascii_only = draw(st.booleans())
    head: list[tuple[str, object]] = [
        ("id", "chatcmpl-x" if chat else "cmpl-x"),
        ("object", "chat.completion.chunk" if chat else "text_completion"),
        ("created", 1700000000),
        ("model", draw(st.sampled_from(["m", "org/model-ü", 'q"uote'])))
    ]  # fmt: skip
    head = draw(st.permutations(head))
    tail = draw(st.lists(st.sampled_from(["logprobs", "finish_reason", "stop_reason",
                                          "token_ids"]), unique=True))  # fmt: skip

    def event(choices: list[dict[str, object]], **extra: object) -> bytes:
        obj = dict(head)
        obj["choices"] = choices
        obj.update(extra)
        return b"data: " + encode(obj, ascii_only) + b"\n\n"

    def content(text: str, index: int = 0, key: str = "content") -> dict[str, object]:
        choice: dict[str, object] = {"index": index}
        choice.update({"delta": {key: text}} if chat else {"text": text})
        choice.update({name: None for name in tail})
        return choice

    out = [event([{"index": 0, "delta": {"role": "assistant", "content": ""}}])] if chat else []
    plain = event([content("warm")])
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(
            ["text", "text", "text", "raw", "n", "finish", "usage", "error", "reasoning",
             "tool", "malformed", "empty", "two"]
        ))  # fmt: skip
        if kind == "text":
            out.append(event([content(draw(TEXT))]))
        elif kind == "raw":  # the learnt shape around bytes of any kind
            marker = b"warm"
            at = plain.index(marker)
            out.append(plain[:at] + draw(ODD_BODY) + plain[at + len(marker) :])
        elif kind == "n":
            out.append(event([content(draw(TEXT), draw(st.integers(1, 3)))]))
        elif kind == "finish":
            choice = content(draw(TEXT))
            choice["finish_reason"] = draw(st.sampled_from(["stop", "length", "", None]))
            out.append(event([choice]))
        elif kind == "usage":
            usage = {"prompt_tokens": 3, "completion_tokens": draw(st.integers(0, 9))}
            out.append(event(draw(st.sampled_from([[], [content(draw(TEXT))]])), usage=usage))
        elif kind == "error":
            out.append(event([content(draw(TEXT))], error={"message": "boom", "code": 500}))
        elif kind == "reasoning" and chat:
            out.append(event([content(draw(TEXT), key="reasoning")]))
        elif kind == "tool" and chat:
            call: dict[str, object] = {"index": draw(st.integers(0, 1))}
            if draw(st.booleans()):  # a call's first delta: id and name
                call.update(id="call-1", function={"name": "f"})
            else:
                arguments = draw(st.sampled_from(['{"a": 1}', "{", "}", "[1]", "", "x"]))
                call["function"] = {"arguments": draw(st.sampled_from([arguments, draw(TEXT)]))}
            out.append(event([{"index": 0, "delta": {"tool_calls": [call]}}]))
        elif kind == "malformed":
            out.append(plain[: draw(st.integers(6, len(plain) - 3))] + b"\n\n")
        elif kind == "empty":
            out.append(event([content("")]))
        elif kind == "two":
            out.append(event([content(draw(TEXT)), content(draw(TEXT), 1)]))
        if draw(st.booleans()):
            out.append(plain)
    if draw(st.booleans()):
        out.append(b"data: [DONE]\n\n")
    return (CHAT if chat else COMPLETIONS), b"".join(out)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.randoms(use_true_random=False))
def test_generated_streams_give_the_same_record_split_at_random(
    stream: tuple[str, bytes], rng: random.Random
) -> None:
    endpoint, raw = stream
    both(endpoint, by_event(raw))
    both(endpoint, split(raw, rng))


@settings(max_examples=300)
@given(st.lists(st.one_of(TEXT.map(lambda t: orjson.dumps(t)[1:-1]), ODD_BODY), max_size=6))
def test_the_string_body_pattern_accepts_exactly_what_json_accepts(bodies: list[bytes]) -> None:
    for body in bodies:
        try:
            value = orjson.loads(b'"' + body + b'"')
        except orjson.JSONDecodeError:
            value = None
        accepted = STRING_BODY.fullmatch(body) is not None
        # every accepted body is a non-empty JSON string; every non-empty JSON string is
        # accepted (the pattern adds nothing the parse would refuse, nor the reverse)
        assert accepted == (type(value) is str and value != ""), body


def test_a_template_is_not_learnt_when_the_text_is_not_the_varying_part() -> None:
    api = api_of(CHAT)
    # the "content" opening inside another string: the proof must fail, not learn it
    payload = (
        b'{"id":"x\\"delta\\":{\\"content\\":\\"y","choices":[{"index":0,'
        b'"delta":{"content":"hi"},"finish_reason":null}],"model":"m"}'
    )
    facts = api.event(payload, False, False)
    assert facts.plain
    template = learn(api, payload, facts)
    assert template is not None and template.before.endswith(b'"delta":{"content":"')
    assert template.after.startswith(b'"},"finish_reason"')


@settings(max_examples=300)
@given(st.binary(max_size=64), st.binary(max_size=64))
def test_the_sse_shortcut_agrees_with_byte_at_a_time(a: bytes, b: bytes) -> None:
    raw = b"data: " + a.replace(b"\n", b"") + b"\n\n" + b"data: " + b + b"\n\n"
    whole, bytewise = SSEDecoder(), SSEDecoder()
    got = [p for part in by_event(raw) for p in whole.feed(part)] + whole.flush()
    want = [p for i in range(len(raw)) for p in bytewise.feed(raw[i : i + 1])] + bytewise.flush()
    assert got == want
