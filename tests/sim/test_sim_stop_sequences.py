"""`stop_sequences` on the Anthropic and Cohere routes, and the `n` cap, as vLLM 0.32 checks
them. Both request models declare `Annotated[list[str], Field(max_length=
envs.VLLM_MAX_STOP_STRINGS)] | None` (anthropic/protocol.py:224-226, cohere/protocol.py:
156-158), so pydantic refuses them before any handler runs: the global validation handler
answers (serve/exception_handling/handlers/validation.py), in OpenAI's shape on
/v1/messages, rewritten to Cohere's `{message, id}` on /cohere/* by its middleware
(cohere/api_router.py:206-280). A valid list goes to chat as `stop`
(anthropic/serving.py:616, cohere/serving.py:558), whose SamplingParams refuse "".
`n` is capped by VLLM_MAX_N_SEQUENCES (vllm/envs.py:1149-1151, sampling_params.py:46-59)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from proxy.sim import SimConfig
from proxy.sim.cli import parse
from tests.sim.test_sim_support import chat, running

MESSAGES, COHERE = "/v1/messages", "/cohere/v2/chat"
FIVE = ["a", "b", "c", "d", "e"]
#: What vLLM 0.32's own validation handler answered for five stop_sequences on
#: /v1/messages (AnthropicMessagesRequest under FastAPI with vLLM's handler, run here
#: from /opt/vllm-venv).
TOO_MANY = (
    b"{\"error\":{\"message\":\"1 validation error:\\n  {'type': 'too_long', 'loc': "
    b"'body.stop_sequences', 'msg': 'List should have at most 4 items after validation, "
    b"not 5', 'input': '<list of 5 items>', 'ctx': {'field_type': 'List', 'max_length': 4, "
    b'\'actual_length\': 5}}","type":"Bad Request","param":"body.stop_sequences","code":400}}'
)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running(SimConfig(ttft=0.0, tokens_per_second=2000.0, output_tokens=2)) as (server, _):
        yield server.url


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


def test_messages_past_the_cap_is_the_validation_400_byte_for_byte(url: str) -> None:
    reply = httpx.post(url + MESSAGES, json=body(stop_sequences=FIVE))
    assert (reply.status_code, reply.content) == (400, TOO_MANY)


@pytest.mark.parametrize(
    ("stops", "error"),
    [
        (
            "x",
            "{'type': 'list_type', 'loc': 'body.stop_sequences', "
            "'msg': 'Input should be a valid list', 'input': 'x'}",
        ),
        (
            ["a", 1],
            "{'type': 'string_type', 'loc': 'body.stop_sequences.1', "
            "'msg': 'Input should be a valid string', 'input': '1'}",
        ),
    ],
)
def test_messages_stop_sequences_of_the_wrong_type_are_refused(
    url: str, stops: object, error: str
) -> None:
    """Also as vLLM's handler answered them (a string is no list: Anthropic's field has no
    `str` branch, unlike chat's `stop`)."""
    reply = httpx.post(url + MESSAGES, json=body(stop_sequences=stops))
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "1 validation error:\n  " + error


def test_an_empty_stop_sequence_is_the_sampling_params_400_in_each_shape(url: str) -> None:
    message = "stop cannot contain an empty string."
    anthropic = httpx.post(url + MESSAGES, json=body(stop_sequences=[""]))
    assert (anthropic.status_code, anthropic.json()) == (
        400,
        {"type": "error", "error": {"type": "BadRequestError", "message": message}},
    )
    cohere = httpx.post(url + COHERE, json=body(stop_sequences=[""]))
    assert (cohere.status_code, cohere.json()) == (400, {"message": message})


def test_cohere_past_the_cap_is_the_same_400_in_cohere_shape(url: str) -> None:
    """The middleware keeps the message and names the request by its X-Request-Id (no
    handler ran, so no other id is known); without one the id is left out."""
    named = httpx.post(url + COHERE, json=body(stop_sequences=FIVE), headers={"x-request-id": "r1"})
    expected = TOO_MANY.split(b'"message":"', 1)[1].split(b'","type"', 1)[0]
    assert named.status_code == 400
    assert named.content == b'{"message":"' + expected + b'","id":"r1"}'
    plain = httpx.post(url + COHERE, json=body(stop_sequences=FIVE))
    assert list(plain.json()) == ["message"]


def test_cohere_errors_take_cohere_shape(url: str) -> None:
    reply = httpx.post(url + COHERE, json=body(model="nope"))
    assert (reply.status_code, reply.json()) == (
        404,
        {"message": "The model `nope` does not exist."},
    )


def test_the_cap_follows_vllm_max_stop_strings_on_both_routes() -> None:
    config = SimConfig(ttft=0.0, tokens_per_second=2000.0, output_tokens=2, max_stop_strings=6)
    with running(config) as (server, _):
        for path in (MESSAGES, COHERE):
            assert httpx.post(server.url + path, json=body(stop_sequences=FIVE)).status_code == 200


def test_vllm_max_n_sequences_is_read_as_vllm_reads_it() -> None:
    assert parse([], {})[0].max_n_sequences == 16384
    assert parse([], {"VLLM_MAX_N_SEQUENCES": "2"})[0].max_n_sequences == 2
    with pytest.raises(SystemExit):
        parse([], {"VLLM_MAX_N_SEQUENCES": "two"})


def test_n_past_vllm_max_n_sequences_is_its_400() -> None:
    config = SimConfig(ttft=0.0, tokens_per_second=2000.0, output_tokens=2, max_n_sequences=2)
    with running(config) as (server, _):
        url = server.url + "/v1/chat/completions"
        assert httpx.post(url, json=chat(False, n=2)).status_code == 200
        reply = httpx.post(url, json=chat(False, n=3))
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        "n must be at most 2, got 3. To increase this limit, set the "
        "VLLM_MAX_N_SEQUENCES environment variable."
    )
