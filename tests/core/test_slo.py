"""proxy/core/slo.py: one verdict per request, the same for a live record and a saved one."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

import orjson
import pytest

from proxy.core import slo
from proxy.core.measurement import ErrorType, Measurement
from proxy.core.observe import StreamObserver
from proxy.core.request import CHAT, RequestInfo
from tests.factories import measurement
from tests.paths import FIXTURES

LIMITS = slo.parse_slo("ttft=0.5,tpot=0.05,e2e=10")
NOT_STREAMED = {"stream": False, "stream_requested": False}
#: A response with nothing generated yet: no finish, no token, no figure but its e2e.
UNFINISHED = {"finish_reason": "none", "ttft": None, "tpot": None, "output_tokens": None}


@pytest.mark.parametrize(
    ("figures", "expected"),
    [
        ({"ttft": 0.4, "tpot": 0.04, "e2e": 9.0}, "met"),
        ({"ttft": 0.5, "tpot": 0.05, "e2e": 10.0}, "met"),  # at the limit is within it
        ({"ttft": 0.6, "tpot": 0.06, "e2e": 11.0}, "ttft"),  # the first one missed names it
        ({"ttft": 0.4, "tpot": 0.06, "e2e": 11.0}, "tpot"),
        ({"ttft": 0.4, "tpot": 0.04, "e2e": 11.0}, "e2e"),
        ({"ttft": None, "tpot": None, "e2e": 1.0}, "met"),  # a figure it lacks cannot miss
        ({"error_type": ErrorType.UPSTREAM_ERROR}, "error"),
        ({"error_type": ErrorType.RATE_LIMIT, "status_code": 429}, "error"),  # short of capacity
        ({"error_type": ErrorType.STREAM_TRUNCATED, "ttft": 0.1}, "error"),
        # the client's own doing, said with a 4xx: no promise broken, no page for it
        ({"error_type": ErrorType.AUTH, "status_code": 401}, "refused"),
        ({"error_type": ErrorType.NOT_FOUND, "status_code": 404}, "refused"),
        ({"error_type": ErrorType.CONTEXT_LENGTH, "status_code": 400}, "refused"),
        ({"error_type": ErrorType.BAD_REQUEST, "status_code": 413}, "refused"),
        # a gateway's token exchange that failed: a 500, the service's own failure
        ({"error_type": ErrorType.AUTH, "status_code": 500}, "error"),
        # a prompt over the context refused inside a 200 stream (vLLM's generate)
        ({"error_type": ErrorType.CONTEXT_LENGTH, "status_code": 200}, "refused"),
        # a bad JSON schema that vLLM 0.32 reports inside a 200 stream (errors.classify_stream_end)
        ({"error_type": ErrorType.BAD_REQUEST, "status_code": 200}, "refused"),
        # A client that left: a miss already known when it left counts as that miss
        # (the worst waits under overload once vanished from attainment); else cancelled.
        ({"error_type": ErrorType.CLIENT_CANCELLED, "ttft": 9.0}, "ttft"),
        ({"error_type": ErrorType.CLIENT_CANCELLED, "ttft": None, "e2e": 2.0}, "ttft"),
        ({"error_type": ErrorType.CLIENT_CANCELLED, "ttft": None, "e2e": 0.3}, "cancelled"),
        ({"error_type": ErrorType.CLIENT_CANCELLED, "ttft": 0.4, "e2e": 2.0}, "cancelled"),
        # A non-streamed answer's first token reaches its client with the whole answer:
        # its ttft is judged by its e2e (by nothing, it met a ttft target however slow).
        ({"ttft": None, "tpot": None, "e2e": 0.4} | NOT_STREAMED, "met"),
        ({"ttft": None, "tpot": None, "e2e": 0.7} | NOT_STREAMED, "ttft"),
        ({"ttft": None, "tpot": None, "e2e": 12.0} | NOT_STREAMED, "ttft"),  # the first missed
        # and a client that left one waited that long for its first token
        (
            {"error_type": ErrorType.CLIENT_CANCELLED, "ttft": None, "e2e": 0.3} | NOT_STREAMED,
            "cancelled",
        ),
        (
            {"error_type": ErrorType.CLIENT_CANCELLED, "ttft": None, "e2e": 2.0} | NOT_STREAMED,
            "ttft",
        ),
        # A background Response whose client left its stream: no error (vLLM generates
        # on), no finish yet (raw in_progress): not finished, so judged as a client that left
        ({"raw_finish_reason": "in_progress", "ttft": 0.1, "tpot": None, "e2e": 0.2}, "cancelled"),
        ({"raw_finish_reason": "in_progress", "ttft": 0.9, "tpot": None, "e2e": 1.0}, "ttft"),
        ({"raw_finish_reason": "in_progress", "ttft": None, "tpot": None, "e2e": 0.7}, "ttft"),
        # Its acknowledgement not streamed: vLLM answers `queued` at once, no output, no
        # usage, and generates later (openai/responses/serving.py:537-590). Not finished
        # either, so not met on its few milliseconds: judged as a client that left.
        ({"raw_finish_reason": "queued", **UNFINISHED, "e2e": 0.004} | NOT_STREAMED, "cancelled"),
        ({"raw_finish_reason": "queued", **UNFINISHED, "e2e": 0.7} | NOT_STREAMED, "ttft"),
        # Streamed, whichever field says it: a request that named no `stream`
        # (stream_requested null) answered with a stream is judged as a stream, saved or not
        ({"ttft": None, "tpot": None, "e2e": 2.0, "stream": True, "stream_requested": None}, "met"),
        (
            {"ttft": None, "tpot": None, "e2e": 2.0, "stream": False, "stream_requested": None},
            "ttft",
        ),
    ],
)
def test_a_record_and_its_saved_form_get_the_same_verdict(
    figures: dict[str, Any], expected: str
) -> None:
    m = measurement(**figures)
    saved = {k: (v.value if isinstance(v, ErrorType) else v) for k, v in asdict(m).items()}
    assert slo.verdict(m, LIMITS) == expected
    assert slo.record_verdict(saved, LIMITS) == expected


REASONING = slo.parse_slo("ttft=0.5,ttfa=2,tpot=0.05")


@pytest.mark.parametrize(
    ("figures", "expected"),
    [
        ({"ttft": 0.2, "first_answer": 1.5, "tpot": 0.04}, "met"),
        ({"ttft": 0.2, "first_answer": 2.5, "tpot": 0.06}, "ttfa"),  # thought too long
        ({"ttft": 0.6, "first_answer": 2.5}, "ttft"),
        # no answer text, but a call or nothing owed (without_answer None): not judged
        ({"ttft": 0.2, "first_answer": None, "tpot": 0.04}, "met"),
        # generated, then cut with neither answer nor call: the answer it waits for never came
        ({"ttft": 0.2, "first_answer": None, "without_answer": "length"}, "ttfa"),
        ({"ttft": 0.2, "first_answer": None, "without_answer": "stop", "e2e": 0.3}, "ttfa"),
    ],
)
def test_the_first_answer_is_a_target_of_its_own(figures: dict[str, Any], expected: str) -> None:
    m = measurement(**figures)
    saved = {k: (v.value if isinstance(v, ErrorType) else v) for k, v in asdict(m).items()}
    assert slo.verdict(m, REASONING) == expected
    assert slo.record_verdict(saved, REASONING) == expected


def whole_answer(endpoint: str, body: bytes) -> Measurement:
    """The record of a non-streamed answer, `body`, read as the relay reads it."""
    observer = StreamObserver(RequestInfo(endpoint, "tiny", False, False, 40, 0.0), start=100.0)
    observer.open(200, "application/json", 100.5)
    observer.feed(body, 101.0)
    observer.end_of_stream(101.0)
    return asyncio.run(
        observer.finish(
            end=101.0, started_at=1.7e9, status_code=200, error_type=None, error_message=None
        )
    )


@pytest.mark.parametrize(
    ("name", "endpoint"),
    [
        ("reasoning_only_chat_nonstream.json", CHAT),
        ("reasoning_only_messages_nonstream.json", "/v1/messages"),
        ("reasoning_only_responses_nonstream.json", "/v1/responses"),
    ],
)
def test_a_whole_answer_of_reasoning_alone_misses_a_ttfa_target_as_its_stream_does(
    name: str, endpoint: str
) -> None:
    """Real vLLM 0.32 bodies cut by max_tokens inside the reasoning: no content (the
    reasoning parser finds no end of thinking, vllm/reasoning/basic_parsers.py:170-171).
    The answer a ttfa target waits for never came: `without_answer` says how it ended, as
    a stream's does, and the target is missed however quick the body was."""
    body = (FIXTURES / "streams" / "vllm-0.32" / name).read_bytes()
    m = whole_answer(endpoint, body)
    assert (m.stream, m.first_answer, m.without_answer) == (False, None, "length")
    assert slo.verdict(m, slo.parse_slo("ttfa=5")) == "ttfa"
    saved = {k: (v.value if isinstance(v, ErrorType) else v) for k, v in asdict(m).items()}
    assert slo.record_verdict(orjson.loads(orjson.dumps(saved)), slo.parse_slo("ttfa=5")) == "ttfa"


def test_a_whole_answer_with_text_beside_its_reasoning_was_answered() -> None:
    body = orjson.loads(
        (FIXTURES / "streams" / "vllm-0.32" / "reasoning_only_chat_nonstream.json").read_bytes()
    )
    body["choices"][0]["message"]["content"] = "An answer."
    m = whole_answer(CHAT, orjson.dumps(body))
    assert m.without_answer is None
    assert slo.verdict(m, slo.parse_slo("ttfa=5")) == "met"


def test_the_text_is_read_in_any_order_and_written_in_the_table_s_order() -> None:
    assert slo.parse_slo(" E2E=30, ttft=2 ,") == {"ttft": 2.0, "e2e": 30.0}
    assert slo.format_slo(slo.parse_slo("tpot=0.025,ttft=2")) == "ttft=2,tpot=0.025"
    assert slo.parse_slo("") == {}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("ttft", "expected NAME=SECONDS"),
        ("latency=1", "expected NAME=SECONDS with NAME in ttft, ttfa, tpot, e2e"),
        ("ttft=fast", "ttft is not a number: 'fast'"),
        ("ttft=0", "ttft must be a positive number of seconds, got .0."),
        ("ttft=-1", "ttft must be a positive number"),
        ("ttft=nan", "ttft must be a positive number"),
        ("ttft=inf", "ttft must be a positive number"),
    ],
)
def test_a_malformed_slo_is_refused_saying_why(text: str, says: str) -> None:
    with pytest.raises(slo.SloError, match="^--slo: " + says.replace("(", r"\(")):
        slo.parse_slo(text)


def test_an_slo_file_gives_each_model_its_targets_and_the_rest_the_default() -> None:
    policy = slo.parse_slo_file(
        {"default": {"ttft": 2}, "models": {"big": {"TTFT": 4, "e2e": 60}, "small": "tpot=0.01"}},
        "slo.yaml",
    )
    assert policy.limits("big") == {"ttft": 4.0, "e2e": 60.0}
    assert policy.limits("small") == {"tpot": 0.01}
    assert policy.limits("unlisted") == {"ttft": 2.0}


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ([], "slo.yaml: expected a mapping"),
        ({"model": {}}, "slo.yaml: unknown key 'model'"),
        ({"models": ["a"]}, "slo.yaml: models: expected a mapping"),
        ({"models": {"a": {"ttft": "soon"}}}, "slo.yaml: models.a: ttft is not a number"),
        ({"models": {"a": {"latency": 1}}}, "slo.yaml: models.a: expected NAME=SECONDS"),
        ({"models": {"a": {}}}, "slo.yaml: models.a: no targets"),
        # the same written as text: that model would be judged by nothing, silently
        ({"models": {"a": ""}}, "slo.yaml: models.a: no targets"),
        ({"default": " , "}, "slo.yaml: default: no targets"),
        ({"models": {"a": {"ttft": True}}}, "slo.yaml: models.a: ttft is not a number: True"),
        ({"models": {"a": 3}}, "slo.yaml: models.a: expected targets like"),
        ({"default": {"e2e": -2}}, "slo.yaml: default: e2e must be a positive"),
    ],
)
def test_a_malformed_slo_file_is_refused_naming_the_key(data: Any, says: str) -> None:
    with pytest.raises(slo.SloError, match="^" + says):
        slo.parse_slo_file(data, "slo.yaml")
