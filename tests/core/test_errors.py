"""Upstream error bodies and exceptions -> error type, a relay's early ends, the proxy's own
error bodies, and secret scrubbing.

The table is tests/fixtures/errors/index.toml: one row per real body, with its source.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import socket
import ssl
import time
import tomllib
from collections.abc import Callable
from typing import Any

import aiohttp
import anthropic
import httpcore
import httpx
import openai
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.apis import APIS, Api
from proxy.core.errors import (
    FOREIGN_NAMES,
    MAX_ERROR_BODY,
    Cause,
    ConnectFailed,
    Ending,
    Failure,
    classify_exception,
    classify_response,
    classify_stream_end,
    describe,
    error_body,
    error_message,
    error_shape,
    relay_failure,
    scrub,
    type_names,
)
from proxy.core.measurement import ErrorType
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.paths import ERRORS

INDEX: list[dict[str, Any]] = tomllib.loads((ERRORS / "index.toml").read_text())["fixture"]


def body(name: str) -> bytes:
    return (ERRORS / name).read_bytes()


# -- the table of real bodies ---------------------------------------------------------------


@pytest.mark.parametrize("row", INDEX, ids=[row["file"].rsplit(".", 1)[0] for row in INDEX])
def test_real_upstream_error_body_is_classified(row: dict[str, Any]) -> None:
    assert classify_response(row["status"], body(row["file"])) is ErrorType(row["expect"])


def test_every_fixture_is_in_the_table_once_with_its_source() -> None:
    files = sorted(p.name for p in ERRORS.iterdir() if p.name != "index.toml")
    listed = [row["file"] for row in INDEX]
    assert sorted(listed) == files  # no body without a row, no row without a body, no repeats
    assert all(len(row["source"]) > 20 for row in INDEX)


def test_current_vllm_max_tokens_larger_than_the_context_is_context_length() -> None:
    # vllm/renderers/params.py: no "context" in the sentence; the old wording table said
    # bad_request here. `param` and "max_model_len" decide.
    reply = body("vllm_renderer_max_tokens_over_context.json")
    assert b"context" not in reply
    assert classify_response(400, reply) is ErrorType.CONTEXT_LENGTH


def test_current_vllm_prompt_longer_than_the_context_is_context_length() -> None:
    assert classify_response(400, body("vllm_renderer_prompt_too_long.json")) is (
        ErrorType.CONTEXT_LENGTH
    )
    assert classify_response(400, body("vllm_prompt_too_long_input_tokens.json")) is (
        ErrorType.CONTEXT_LENGTH
    )


# -- structure first ------------------------------------------------------------------------


def openai_shaped(**error: object) -> bytes:
    return orjson.dumps({"error": {"message": "x", **error}})


def anthropic_shaped(error_type: str, message: str = "x") -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": error_type, "message": message}})


@pytest.mark.parametrize(
    ("code", "want"),
    [
        ("context_length_exceeded", ErrorType.CONTEXT_LENGTH),
        ("invalid_api_key", ErrorType.AUTH),
        ("rate_limit_exceeded", ErrorType.RATE_LIMIT),
        ("insufficient_quota", ErrorType.RATE_LIMIT),
        ("model_not_found", ErrorType.NOT_FOUND),
    ],
)
def test_openai_code_decides_whatever_the_status(code: str, want: ErrorType) -> None:
    for status in (400, 500):
        assert classify_response(status, openai_shaped(code=code)) is want


@pytest.mark.parametrize(
    ("error_type", "want"),
    [
        ("authentication_error", ErrorType.AUTH),
        ("permission_error", ErrorType.AUTH),
        ("rate_limit_error", ErrorType.RATE_LIMIT),
        ("billing_error", ErrorType.RATE_LIMIT),
        ("not_found_error", ErrorType.NOT_FOUND),
        ("overloaded_error", ErrorType.UPSTREAM_ERROR),
        ("timeout_error", ErrorType.UPSTREAM_TIMEOUT),
    ],
)
def test_anthropic_error_type_decides_whatever_the_status(error_type: str, want: ErrorType) -> None:
    for status in (400, 500):
        assert classify_response(status, anthropic_shaped(error_type)) is want


@pytest.mark.parametrize(
    ("status", "error_type", "message", "want"),
    [
        (400, "invalid_request_error", "max_tokens: Field required", ErrorType.BAD_REQUEST),
        (400, "invalid_request_error", "prompt is too long: 9 tokens > 8 maximum", "context"),
        (413, "request_too_large", "Request exceeds the maximum size", ErrorType.BAD_REQUEST),
        (500, "api_error", "Internal server error", ErrorType.UPSTREAM_ERROR),
        (401, "invalid_request_error", "x", ErrorType.AUTH),  # generic type: the status decides
        (404, "invalid_request_error", "x", ErrorType.NOT_FOUND),
    ],
)
def test_generic_anthropic_types_leave_it_to_wording_then_status(
    status: int, error_type: str, message: str, want: ErrorType | str
) -> None:
    want = ErrorType.CONTEXT_LENGTH if want == "context" else want
    assert classify_response(status, anthropic_shaped(error_type, message)) is want


def test_llamacpp_type_decides_without_the_sentence() -> None:
    reply = orjson.dumps(
        {"error": {"code": 400, "message": "", "type": "exceed_context_size_error"}}
    )
    assert classify_response(400, reply) is ErrorType.CONTEXT_LENGTH


def test_vllm_length_param_decides_without_the_sentence() -> None:
    for param in ("input_tokens", "input_text"):
        reply = openai_shaped(type="BadRequestError", param=param, code=400)
        assert classify_response(400, reply) is ErrorType.CONTEXT_LENGTH


def test_vllm_max_tokens_param_alone_is_not_the_context() -> None:
    # Same param, other check: vllm/sampling_params.py SamplingParams._verify_args.
    reply = openai_shaped(
        message="max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        type="BadRequestError",
        param="max_tokens",
        code=400,
    )
    assert classify_response(400, reply) is ErrorType.BAD_REQUEST


@pytest.mark.parametrize(
    "message",
    [
        # vllm/renderers/params.py TokenizeParams.__post_init__, before and after the fix
        # pinned by vLLM's tests/renderers/test_params_validation.py
        "max_tokens=20000cannot be greater than max_model_len=max_total_tokens=8192.",
        "max_tokens=20000 cannot be greater than max_model_len=8192",
    ],
)
def test_vllm_max_tokens_over_the_model_length_is_context_length_by_param_or_words(
    message: str,
) -> None:
    with_param = openai_shaped(message=message, type="BadRequestError", param="max_tokens")
    words_only = openai_shaped(message=message, type="BadRequestError")
    assert classify_response(400, with_param) is ErrorType.CONTEXT_LENGTH
    assert classify_response(400, words_only) is ErrorType.CONTEXT_LENGTH


def test_structure_wins_over_wording() -> None:
    reply = openai_shaped(message="your token has expired", code="context_length_exceeded")
    assert classify_response(401, reply) is ErrorType.CONTEXT_LENGTH


def test_auth_wording_is_not_mistaken_for_context_length() -> None:
    assert classify_response(500, body("gateway_token_exchange_failed.json")) is ErrorType.AUTH
    assert classify_response(401, body("openai_incorrect_api_key.json")) is ErrorType.AUTH
    assert classify_response(403, b"Forbidden") is ErrorType.AUTH


@pytest.mark.parametrize(
    "message",
    [
        "token exchange failed: too many tokens issued for this client",
        "token exchange failed: requested token lifetime must be <= 3600",
        "token exchange failed: subject token exceeds the maximum context of the STS",
    ],
)
def test_a_failed_token_exchange_is_auth_whatever_it_says_after(message: str) -> None:
    # A gateway's sentence that names its cause first, then uses words of the context
    # patterns ("too many tokens", "must be <= N", "exceeds the maximum context").
    reply = orjson.dumps({"error": {"message": message, "type": "internal_error", "code": 500}})
    assert classify_response(500, reply) is ErrorType.AUTH
    assert classify_response(400, reply) is ErrorType.AUTH


@pytest.mark.parametrize(
    ("status", "want"),
    [(401, ErrorType.AUTH), (403, ErrorType.AUTH), (429, ErrorType.RATE_LIMIT)],
)
def test_auth_and_rate_limit_statuses_decide_before_the_wording(
    status: int, want: ErrorType
) -> None:
    # A 429 "too many tokens per minute" is a rate limit, never a long prompt; a 401 or 403
    # is a credential or a permission, whatever words of a context error it carries.
    for message in ("Too many tokens per minute", "prompt is too long for this key"):
        assert classify_response(status, orjson.dumps({"error": {"message": message}})) is want
    # The words decide the same sentence on a status that says less.
    assert classify_response(400, b'{"error": {"message": "Too many tokens"}}') is (
        ErrorType.CONTEXT_LENGTH
    )


# -- wording and status, as before ----------------------------------------------------------


@pytest.mark.parametrize("status", [200, 204, 301, 399])
def test_status_below_400_is_not_an_error(status: int) -> None:
    assert classify_response(status, b'{"error": "context_length_exceeded"}') is None


@pytest.mark.parametrize(
    ("status", "want"),
    [
        (400, ErrorType.BAD_REQUEST),
        (401, ErrorType.AUTH),
        (403, ErrorType.AUTH),
        (404, ErrorType.NOT_FOUND),
        (413, ErrorType.BAD_REQUEST),
        (429, ErrorType.RATE_LIMIT),
        (500, ErrorType.UPSTREAM_ERROR),
        (503, ErrorType.UPSTREAM_ERROR),
    ],
)
def test_empty_body_is_classified_by_status(status: int, want: ErrorType) -> None:
    assert classify_response(status, b"") is want


def test_body_wording_wins_over_status() -> None:
    # Some servers answer a too-long prompt with 413 or 500; the words decide.
    reply = b'{"detail": "This model\'s maximum context length is 8 tokens"}'
    assert classify_response(500, reply) is ErrorType.CONTEXT_LENGTH


def test_wording_past_the_read_limit_is_not_seen() -> None:
    reply = b" " * MAX_ERROR_BODY + b"maximum context length"
    assert classify_response(400, reply) is ErrorType.BAD_REQUEST


def test_json_cut_at_the_read_limit_falls_back_to_wording_and_status() -> None:
    reply = b'{"error": {"message": "' + b"x" * MAX_ERROR_BODY + b'", "code": "invalid_api_key"}}'
    assert classify_response(400, reply) is ErrorType.BAD_REQUEST


@given(status=st.integers(min_value=0, max_value=999), reply=st.binary(max_size=2048))
def test_classification_never_raises_on_arbitrary_bytes(status: int, reply: bytes) -> None:
    got = classify_response(status, reply)
    assert (got is None) == (status < 400)
    assert len(error_message(reply, limit=40)) <= 40


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["error", "type", "code", "param", "message", "error_type", "x"]),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


@given(status=st.integers(min_value=400, max_value=599), tree=JSON)
def test_classification_never_raises_on_any_json_shape(status: int, tree: object) -> None:
    reply = orjson.dumps(tree)
    assert isinstance(classify_response(status, reply), ErrorType)
    assert isinstance(error_message(reply), str)


# -- errors inside a stream -----------------------------------------------------------------

#: vLLM 0.32's in-stream errors as its chat and completions streams send them (the
#: object under "error", which the chat Api hands on): create_error_response in
#: vllm/entrypoints/serve/exception_handling/error_response.py, through
#: generate/base/serving.py create_streaming_error_response.
_VLLM_400 = {
    "message": "Grammar error: Pointer '/nowhere' does not exist",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}


@pytest.mark.parametrize(
    ("error", "want"),
    [
        # vLLM: a client's bad grammar, regex or schema (captured from vLLM 0.32)
        (_VLLM_400, ErrorType.BAD_REQUEST),
        # vLLM: a VLLMNotFoundError (a LoRA adapter gone), a VLLMUnprocessableEntityError
        ({**_VLLM_400, "type": "NotFoundError", "code": 404}, ErrorType.NOT_FOUND),
        ({**_VLLM_400, "type": "UnprocessableEntityError", "code": 422}, ErrorType.BAD_REQUEST),
        # vLLM: a length check's VLLMValidationError, by its param or its words
        ({**_VLLM_400, "param": "input_tokens"}, ErrorType.CONTEXT_LENGTH),
        (
            {**_VLLM_400, "message": "This model's maximum context length is 256 tokens."},
            ErrorType.CONTEXT_LENGTH,
        ),
        # vLLM: a GenerationError, a dead engine (EngineDeadError's words), a retryable one
        (
            {"message": "Internal server error", "type": "InternalServerError", "code": 500},
            ErrorType.STREAM_ERROR,
        ),
        (
            {
                "message": "EngineCore encountered an issue. See stack trace (above) for the "
                "root cause.",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            },
            ErrorType.STREAM_ERROR,
        ),
        (
            {**_VLLM_400, "type": "ServiceUnavailableError", "code": 503},
            ErrorType.STREAM_ERROR,
        ),
        # vLLM before its errors were classified by exception: every in-stream error a
        # 400 BadRequestError, a dead engine's too (tests/fixtures/streams/vllm_stream_error.sse)
        (
            {
                "object": "error",
                "message": "EngineCore encountered an issue. See stack trace (above) for the "
                "root cause.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            ErrorType.STREAM_ERROR,
        ),
        ({**_VLLM_400, "message": "Internal server error"}, ErrorType.STREAM_ERROR),
        # a code as a string of digits, as some servers write it
        ({**_VLLM_400, "code": "400"}, ErrorType.BAD_REQUEST),
        # llama.cpp's error objects (tools/server format_error_response)
        (
            {"code": 400, "message": "bad input", "type": "invalid_request_error"},
            ErrorType.BAD_REQUEST,
        ),
        (
            {"code": 400, "message": "too long", "type": "exceed_context_size_error"},
            ErrorType.CONTEXT_LENGTH,
        ),
        ({"code": 500, "message": "oops", "type": "server_error"}, ErrorType.STREAM_ERROR),
        # Messages: vLLM's only type (anthropic/serving.py), Anthropic's own
        (
            {"type": "error", "error": {"type": "internal_error", "message": "boom"}},
            ErrorType.STREAM_ERROR,
        ),
        (
            {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
            ErrorType.STREAM_ERROR,
        ),
        (
            {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}},
            ErrorType.RATE_LIMIT,
        ),
        (
            {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}},
            ErrorType.BAD_REQUEST,
        ),
        # Responses: an `error` event, a response.failed's response.error (openai-python
        # ResponseErrorEvent, ResponseError)
        (
            {"type": "error", "code": "rate_limit_exceeded", "message": "slow", "param": None},
            ErrorType.RATE_LIMIT,
        ),
        ({"code": "server_error", "message": "The server had an error"}, ErrorType.STREAM_ERROR),
        ({"code": "invalid_prompt", "message": "Invalid prompt"}, ErrorType.BAD_REQUEST),
        # no code nor type: Cohere's message-end error, Ollama's error line
        ({"message": "Error converting the stream"}, ErrorType.STREAM_ERROR),
        ("upstream generation failed", ErrorType.STREAM_ERROR),
        ("the input length exceeds the context length", ErrorType.CONTEXT_LENGTH),
    ],
)
def test_an_in_stream_error_is_classified_by_what_it_says(error: object, want: ErrorType) -> None:
    """A client's error inside a 200 stream is the kind it would be answered with a status
    (vLLM 0.32 checks a structured output's grammar once the stream has begun); a
    server's failure inside one is stream_error."""
    got, message = classify_stream_end(error, True, "[DONE]")
    assert got is want
    assert message


def test_an_in_stream_bad_request_keeps_its_words() -> None:
    assert classify_stream_end(_VLLM_400, True, "[DONE]") == (
        ErrorType.BAD_REQUEST,
        "Grammar error: Pointer '/nowhere' does not exist",
    )


def test_a_stream_without_its_end_is_truncated_and_a_whole_one_fine() -> None:
    assert classify_stream_end(None, False, "[DONE]") == (
        ErrorType.STREAM_TRUNCATED,
        "stream ended without [DONE]",
    )
    assert classify_stream_end(None, True, "[DONE]") == (None, None)


# -- messages -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "want"),
    [
        ("vllm_model_not_found.json", "The model `x` does not exist."),  # top-level message
        (
            "vllm_engine_dead.json",  # {"error": {"message": ...}}
            "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        ),
        (
            "tgi_temperature.json",  # {"error": "..."}
            "Input validation error: `temperature` must be strictly positive",
        ),
        (
            "anthropic_prompt_too_long.json",  # {"type": "error", "error": {"type", "message"}}
            "prompt is too long: 208310 tokens > 200000 maximum",
        ),
        ("ollama_model_not_found.json", 'model "llama3" not found, try pulling it first'),
        (
            "nginx_bad_gateway.html",  # not JSON: the text, whitespace collapsed
            "<html> <head><title>502 Bad Gateway</title></head> <body> "
            "<center><h1>502 Bad Gateway</h1></center> <hr><center>nginx/1.25.3</center> "
            "</body> </html>",
        ),
    ],
)
def test_error_message_is_taken_from_each_body_shape(fixture: str, want: str) -> None:
    assert error_message(body(fixture)) == want


@pytest.mark.parametrize(
    ("raised", "told"),
    [
        (
            ConnectionRefusedError(111, "Connect call failed ('10.0.0.5', 8000)"),
            "upstream: ConnectionRefusedError: [Errno 111] Connection refused",
        ),
        (OSError("Cannot connect to host vllm.internal:8000 ssl:default"), "upstream: OSError: Cannot connect ssl:default"),
        (httpx.ConnectError("refused"), "upstream: ConnectError: refused"),
        # an https upstream whose certificate names another host (found in a review)
        (
            ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: Hostname mismatch, certificate is not valid for 'vllm.internal'. (_ssl.c:1006)"),
            "upstream: SSLCertVerificationError: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: Hostname mismatch, certificate is not valid for the upstream's name. (_ssl.c:1006)",
        ),
    ],
)  # fmt: skip
def test_a_client_is_told_what_broke_upstream_not_where_the_upstream_is(
    raised: BaseException, told: str
) -> None:
    """The record keeps the transport's words; the client's answer leaves out the
    backend's address (aiohttp's "('10.0.0.5', 8000)" reached any client of the ASGI relay)."""
    failure = relay_failure(Cause.UPSTREAM_BROKE, after_headers=False, exc=raised)
    assert failure.answer is not None and failure.answer[2] == told
    assert failure.message == describe(raised)


def test_error_message_is_cut_to_the_limit_at_a_words_end() -> None:
    # A word cut in two could be the start of an echoed credential, which redaction of
    # whole values would then miss: the cut word goes.
    assert error_message(b"x" * 30 + b" " + b"y" * 30, limit=50) == "x" * 30
    assert error_message(b"x" * 30 + b" " + b"y" * 19, limit=50) == "x" * 30 + " " + "y" * 19
    assert error_message(b"x" * 1000, limit=50) == "(a message of one long word, not kept)"


def test_error_message_hides_the_masked_openai_key() -> None:
    message = error_message(body("openai_incorrect_api_key.json"))
    assert message.startswith("Incorrect API key provided: [redacted]. You can find")
    assert "sk-" not in message


# -- the proxy's own bodies -----------------------------------------------------------------


def test_openai_shaped_body_is_what_vllm_writes() -> None:
    assert orjson.loads(error_body(413, "request_too_large", "too big")) == {
        "error": {"message": "too big", "type": "request_too_large", "param": None, "code": 413}
    }


@pytest.mark.parametrize(
    ("status", "want"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (408, "invalid_request_error"),
        (413, "request_too_large"),
        (431, "invalid_request_error"),
        (502, "api_error"),
        (503, "api_error"),
        (504, "timeout_error"),
    ],
)
def test_anthropic_shaped_body_takes_its_type_from_the_status(status: int, want: str) -> None:
    got = orjson.loads(error_body(status, "whatever", "said", shape="anthropic"))
    assert got == {"type": "error", "error": {"type": want, "message": "said"}}


@pytest.mark.parametrize(
    ("status", "kind", "openai_want", "anthropic_want"),
    [
        (413, "request_too_large", ErrorType.BAD_REQUEST, ErrorType.BAD_REQUEST),
        (401, "auth", ErrorType.AUTH, ErrorType.AUTH),
        (404, "not_found", ErrorType.NOT_FOUND, ErrorType.NOT_FOUND),
        (502, "upstream_unreachable", ErrorType.UPSTREAM_ERROR, ErrorType.UPSTREAM_ERROR),
        # Anthropic's timeout_error says more than the status; the OpenAI shape keeps the
        # proxy's own kind in `type`, which the classifier does not read (a closed set of
        # backend types is, not the proxy's names).
        (504, "upstream_timeout", ErrorType.UPSTREAM_ERROR, ErrorType.UPSTREAM_TIMEOUT),
    ],
)
def test_own_bodies_are_classified_when_measured_through_the_proxy(
    status: int, kind: str, openai_want: ErrorType, anthropic_want: ErrorType
) -> None:
    # What `tokenprobe bench` records when it measures through the proxy.
    assert classify_response(status, error_body(status, kind, "m")) is openai_want
    anthropic = error_body(status, kind, "m", shape="anthropic")
    assert classify_response(status, anthropic) is anthropic_want


@pytest.mark.parametrize(
    ("path", "want"),
    [
        ("/v1/messages", "anthropic"),
        ("/v1/messages/count_tokens", "anthropic"),
        ("/v1/messagesx", "openai"),
        ("/v1/chat/completions", "openai"),
        ("/v1/responses", "openai"),
    ],
)
def test_error_shape_follows_the_api(path: str, want: str) -> None:
    assert error_shape(path) == want


@pytest.mark.parametrize("api", APIS, ids=lambda api: api.endpoint)
def test_each_seam_declares_its_error_shape_for_its_paths_and_those_below(api: Api) -> None:
    # A new API's clients get its declared shape without errors.py naming its path.
    for path in api.paths:
        assert error_shape(path) == api.error_shape
        assert error_shape(path + "/sub/path") == api.error_shape
    assert error_shape(api.endpoint + "x") == "openai"


def test_official_clients_parse_the_proxys_own_errors(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(sim.url, max_body_bytes=2000)
    big = "x" * 4000
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as caught_a:
        claude.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": big}]
        )
    assert caught_a.value.status_code == 413
    assert caught_a.value.body == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "request body over 2000 bytes"},
    }
    gpt = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught_o:
        gpt.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": big}])
    assert caught_o.value.status_code == 413
    assert caught_o.value.type == "request_too_large"  # the SDK reads error.type and .message
    assert caught_o.value.message == "Error code: 413 - request body over 2000 bytes"
    assert sim.app.state.last() is None  # refused before anything went upstream


# -- scrub ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Authorization: Bearer abc.def-123_XYZ", "Authorization: Bearer [redacted]"),
        ("authorization: bearer tok", "authorization: bearer [redacted]"),
        ("key sk-proj-AbC123dEf456GhI789 was rejected", "key [redacted] was rejected"),
        ("bad key sk-abcdef123456", "bad key [redacted]"),
        (
            "token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig rejected",
            "token [redacted] rejected",
        ),
        # other providers' key shapes, as pasted into a model field or echoed in an error
        ("key sk_live_abcdef123456 bad", "key [redacted] bad"),
        ("AIzaSyLEAKGOOGLE1234567890123456789012", "[redacted]"),
        ("gsk_LEAKGROQ1234567890abcd", "[redacted]"),
        ("hf_abcdefghijklmnopqrstuvwxyz1234 expired", "[redacted] expired"),
        ("ghp_abcdefghij1234567890ab", "[redacted]"),
        ("r8_abcdefghijklmnop12345678", "[redacted]"),
        ("xai-abcdefghijkl1234567890", "[redacted]"),
        ("nvapi-abcdefghijklm1234567890", "[redacted]"),
        ("pplx-abcdefghijklmn123456789", "[redacted]"),
        ("ya29.a0AfH6SMBabcdefghijklmnop", "[redacted]"),
        ("id AKIAIOSFODNN7EXAMPLE denied", "id [redacted] denied"),
        # what follows a token is kept: the JSON's quote and comma, a header list's comma
        (
            '{"authorization": "Bearer abc.def", "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJz.sig", "n": 1}',
            '{"authorization": "Bearer [redacted]", "jwt": "[redacted]", "n": 1}',
        ),
        ("Bearer tok, Basic x", "Bearer [redacted], Basic x"),
        ('"Bearer ab\\/cd", "n"', '"Bearer [redacted]", "n"'),  # a JSON-escaped "/"
    ],
)
def test_scrub_removes_credentials(text: str, want: str) -> None:
    assert scrub(text) == want


@pytest.mark.parametrize(
    "text",
    [
        "task-abcdefgh failed",
        "risk-assessment pending",
        "The model `x` does not exist.",
        "sk-short",
        "hf-internal-testing/tiny-random-gpt2",  # a model name, not a key
        "hf_hub_download failed",
        "xai-grok",
        # identifiers that share a key's prefix (found in review: all were masked)
        "HF_HUB_ENABLE_HF_TRANSFER=1",
        "constraint pk_conversation_messages",
        "sk_learn_model_v2",
        "hf_hub_download_timeout_seconds",
    ],
)
def test_scrub_leaves_ordinary_text_alone(text: str) -> None:
    assert scrub(text) == text


# An upstream that echoes the client's JSON: the value of every member named like a
# credential (proxy.core.secrets.is_secret_name), whatever its shape.
@pytest.mark.parametrize(
    ("text", "want"),
    [
        (
            'bad field in {"model":"m","api_key":"CANARY1"}',
            'bad field in {"model":"m","api_key":"[redacted]"}',
        ),
        ("{'api_key': 'CANARY2', 'n': 1}", "{'api_key': '[redacted]', 'n': 1}"),  # Python's repr
        (  # an object under a secret name goes whole, whatever its members are named
            '{"credentials": {"user": "u", "pin": "CANARY3"}, "model": "m"}',
            '{"credentials": [redacted], "model": "m"}',
        ),
        ('{"x": {"password": "CANARY4"}}', '{"x": {"password": "[redacted]"}}'),
        ('{"api_keys": ["CANARY5", "CANARY6"], "n": 2}', '{"api_keys": [redacted], "n": 2}'),
        (  # JSON quoted in a JSON string (a body read raw): its quotes escaped
            '{"detail": "bad {\\"x-auth-token\\": \\"CANARY7\\", \\"n\\": 1}"}',
            '{"detail": "bad {\\"x-auth-token\\": \\"[redacted]\\", \\"n\\": 1}"}',
        ),
        (
            '"bad {\\"credentials\\": {\\"pin\\": \\"CANARY8\\"}, \\"n\\": 1}"',
            '"bad {\\"credentials\\": [redacted], \\"n\\": 1}"',
        ),
        ("Client(api_key='CANARY9', timeout=5)", "Client(api_key='[redacted]', timeout=5)"),
        ('{"Password": "it\\"s CANARY10", "n": 1}', '{"Password": "[redacted]", "n": 1}'),
        # cut short by MAX_ERROR_BODY inside the value: masked to the end
        ('{"n": 1, "secret": "CANARY11', '{"n": 1, "secret": "[redacted]"'),
        ('{"n": 1, "credentials": {"pin": "CANARY12', '{"n": 1, "credentials": [redacted]'),
        # the scheme stays, as scrub keeps it before a bearer token
        ('{"Authorization": "Bearer CANARY13"}', '{"Authorization": "Bearer [redacted]"}'),
    ],
)
def test_scrub_masks_fields_named_like_credentials(text: str, want: str) -> None:
    assert scrub(text) == want


@pytest.mark.parametrize(
    "text",
    [
        # counts and ids under names with "token" in them: numbers, lists of numbers
        "{'max_tokens': 5000, 'prompt_token_ids': [1, 2, 3], 'n': 1}",
        '{"usage": {"prompt_tokens": 9, "completion_tokens": 1}, "stop_token_ids": []}',
        "max_tokens=8000 cannot be greater than max_model_len=4096",
        "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens",
        "token exchange failed: 'invalid_grant': too many tokens issued",
        # vLLM 0.32's validation error (serve/exception_handling/handlers/validation.py)
        "1 validation error: {'type': 'int_parsing', 'loc': 'body.max_tokens', "
        "'msg': 'Input should be a valid integer', 'input': 'ten'}",
        '{"password": null, "token": true, "secret": 12}',  # bare values name no credential
    ],
)
def test_scrub_leaves_counts_and_ordinary_errors_alone(text: str) -> None:
    assert scrub(text) == text


def test_masking_fields_reads_each_character_once() -> None:
    """The client's own text, echoed, cannot make it slow: a value is skipped once read
    (an earlier version read every later value again: 7 s for this 64 KiB)."""
    texts = [
        ("token=[1 " * 9000)[:MAX_ERROR_BODY],  # lists of no string, each left open
        ("token=[" * 10000)[: MAX_ERROR_BODY // 2] + "]" * 5000,  # nested, then closed
    ]
    for text in texts:
        started = time.perf_counter()
        scrub(text)
        assert time.perf_counter() - started < 1.0  # about 5 ms here; 7 s when quadratic


# -- exceptions -----------------------------------------------------------------------------


def test_every_foreign_exception_name_is_a_real_class() -> None:
    """The core matches httpx's and aiohttp's exceptions by name: a rename upstream must
    fail here, not silently turn timeouts into upstream_error."""
    for name in FOREIGN_NAMES:
        package, _, cls = name.partition(".")
        # aiohttp's parser errors are not exported at its top: they are in http_exceptions
        module = importlib.import_module(package)
        found = getattr(module, cls, None) or getattr(
            importlib.import_module(f"{package}.http_exceptions"), cls
        )
        assert isinstance(found, type) and issubclass(found, BaseException), name
        assert name in type_names(found)


def _wrapped(outer: Exception, cause: BaseException) -> Exception:
    outer.__cause__ = cause
    return outer


def _connector_error() -> aiohttp.ClientConnectorError:
    key = aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None)
    return aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused"))


def _dial_failed(cause: OSError) -> ConnectFailed:
    """As proxy.server.dial raises it."""
    try:
        raise ConnectFailed(str(cause)) from cause
    except ConnectFailed as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "before", "after"),
    [
        (httpx.ConnectError("refused"), "upstream_unreachable", "stream_truncated"),
        # as httpx's transport raises it: the cause decides, whatever the system said
        (
            _wrapped(httpx.ConnectError(""), httpcore.ConnectError("[Errno 2] No such file")),
            "upstream_unreachable",
            "stream_truncated",
        ),
        (httpx.ConnectTimeout(""), "upstream_timeout", "upstream_timeout"),
        (httpx.ReadTimeout(""), "upstream_timeout", "upstream_timeout"),
        (httpx.ReadError("reset"), "upstream_error", "stream_truncated"),
        (httpx.RemoteProtocolError("bad"), "upstream_error", "stream_truncated"),
        (TimeoutError(), "upstream_timeout", "upstream_timeout"),
        (ConnectionRefusedError(), "upstream_unreachable", "stream_truncated"),
        # the wire's own connect failed (proxy/server/dial.py), whatever the system said
        (
            _dial_failed(socket.gaierror(-2, "Name or service not known")),
            "upstream_unreachable",
            "stream_truncated",
        ),
        (
            _dial_failed(FileNotFoundError(2, "No such file", "/run/x.sock")),
            "upstream_unreachable",
            "stream_truncated",
        ),
        # the proxy's own descriptors or ports ran out: not the backend's fault
        (
            _dial_failed(OSError(errno.EMFILE, "Too many open files")),
            "upstream_error",
            "stream_truncated",
        ),
        (
            _dial_failed(OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")),
            "upstream_error",
            "stream_truncated",
        ),
        (
            _wrapped(
                httpx.ConnectError(""),
                _wrapped(httpcore.ConnectError(""), OSError(errno.EMFILE, "Too many open files")),
            ),
            "upstream_error",
            "stream_truncated",
        ),
        (aiohttp.ServerTimeoutError(), "upstream_timeout", "upstream_timeout"),
        (aiohttp.ServerDisconnectedError(), "upstream_error", "stream_truncated"),
        (aiohttp.ClientPayloadError("bad chunk"), "upstream_error", "stream_truncated"),
        (_connector_error(), "upstream_unreachable", "stream_truncated"),
        # httpx-aiohttp calls a dropped connection ConnectTimeout: the cause decides.
        (
            _wrapped(httpx.ConnectTimeout(""), aiohttp.ServerDisconnectedError()),
            "upstream_error",
            "stream_truncated",
        ),
        (RuntimeError("bug"), "upstream_error", "stream_truncated"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None,
)
def test_exception_is_classified_before_and_after_the_response_head(
    exc: BaseException, before: str, after: str
) -> None:
    assert classify_exception(exc, after_headers=False) is ErrorType(before)
    assert classify_exception(exc, after_headers=True) is ErrorType(after)


def test_a_failed_dial_is_described_by_what_the_system_said() -> None:
    failed = _dial_failed(FileNotFoundError(2, "No such file or directory", "/run/x.sock"))
    assert (
        describe(failed) == "FileNotFoundError: [Errno 2] No such file or directory: '/run/x.sock'"
    )


def test_describe_names_the_root_cause_without_repeating_it() -> None:
    wrapped = _wrapped(httpx.ConnectTimeout(""), aiohttp.ServerDisconnectedError())
    assert describe(wrapped) == "ServerDisconnectedError: Server disconnected"
    assert describe(asyncio.CancelledError()) == (
        "CancelledError: cancelled before the upstream answered"
    )
    assert describe(RuntimeError("x" * 400)) == ("RuntimeError: " + "x" * 400)[:300]


def test_describe_gives_one_line_for_an_exception_whose_text_has_several() -> None:
    """aiohttp's parser errors (the ASGI relay's default transport): newlines inside, and
    the upstream's bytes they quote left out (a header line holds a cookie, a token)."""
    from aiohttp.http_exceptions import BadHttpMessage

    bad = BadHttpMessage("Invalid character in chunk size: b'zz'\n    ^")
    assert "\n" in str(bad)
    assert describe(bad) == "BadHttpMessage: Invalid character in chunk size"


def test_describe_cuts_quotes_only_in_a_parsers_words() -> None:
    """A quote after a word in any other text is no upstream's bytes: kept."""
    said = ValueError('upstream said {"b": 1}')
    assert describe(said) == 'ValueError: upstream said {"b": 1}'


def test_describe_keeps_the_words_of_h11s_state_errors() -> None:
    """A class's repr is no upstream's bytes (h11/_state.py's "can't handle event type")."""
    said = "can't handle event type <class 'h11._events.Response'> when role=CLIENT and state=DONE"
    assert describe(httpx.RemoteProtocolError(said)) == f"RemoteProtocolError: {said}"


def test_describe_leaves_out_the_bytes_h11_quotes() -> None:
    bad = httpx.RemoteProtocolError("illegal header line: bytearray(b'set-cookie: s=SECRET\\r')")
    assert describe(bad) == "RemoteProtocolError: illegal header line"


@pytest.mark.parametrize("kind", ["ContentLengthError", "TransferEncodingError", "BadHttpMessage"])
def test_describe_leaves_out_aiohttps_internal_400(kind: str) -> None:
    """aiohttp's str() of every parser error opens with its class's `code`, 400 ("400,
    message: Not enough data to satisfy transfer length header."): no status any peer
    sent, read as one in a record about a 200 cut short."""
    from aiohttp import http_exceptions

    cut = getattr(http_exceptions, kind)("Not enough data to satisfy transfer length header.")
    assert str(cut).startswith("400, message:")
    payload = aiohttp.ClientPayloadError("Response payload is not completed")
    assert describe(_wrapped(payload, cut)) == (
        f"{kind}: Not enough data to satisfy transfer length header."
    )


# -- a relay's early ends -------------------------------------------------------------------

_SHUTDOWN = "cut off: the proxy shut down before the response ended"


@pytest.mark.parametrize(
    ("cause", "after_headers", "exc", "want"),
    [
        (
            Cause.CLIENT_GONE,
            False,
            None,
            Failure(ErrorType.CLIENT_CANCELLED, "client disconnected", ending=Ending.GONE),
        ),
        (
            Cause.CLIENT_GONE,
            True,
            None,
            Failure(ErrorType.CLIENT_CANCELLED, "client disconnected", ending=Ending.GONE),
        ),
        (
            Cause.IDLE_TIMEOUT,
            True,
            None,
            Failure(
                ErrorType.UPSTREAM_TIMEOUT,
                "no data from the upstream for 2.5 s",
                ending=Ending.CUT,
            ),
        ),
        (
            Cause.FIRST_BYTE_TIMEOUT,
            False,
            TimeoutError(),
            Failure(
                ErrorType.UPSTREAM_TIMEOUT,
                "no response within 2.5 s (--first-byte-timeout)",
                (
                    504,
                    "upstream_timeout",
                    "upstream: no response within 2.5 s (--first-byte-timeout)",
                ),
            ),
        ),
        (
            Cause.SHUTDOWN,
            False,
            None,
            Failure(
                ErrorType.UPSTREAM_ERROR,
                _SHUTDOWN,
                (503, "proxy_shutting_down", _SHUTDOWN),
                Ending.CLOSE,
            ),
        ),
        (
            Cause.SHUTDOWN,
            True,
            None,
            Failure(ErrorType.STREAM_TRUNCATED, _SHUTDOWN, ending=Ending.DROP),
        ),
        (
            Cause.UPSTREAM_BROKE,
            False,
            httpx.ConnectError("refused"),
            Failure(
                ErrorType.UPSTREAM_UNREACHABLE,
                "ConnectError: refused",
                (502, "upstream_unreachable", "upstream: ConnectError: refused"),
            ),
        ),
        (
            Cause.UPSTREAM_BROKE,
            False,
            httpx.ReadTimeout("read"),
            Failure(
                ErrorType.UPSTREAM_TIMEOUT,
                "ReadTimeout: read",
                (504, "upstream_timeout", "upstream: ReadTimeout: read"),
            ),
        ),
        (
            Cause.UPSTREAM_BROKE,
            True,
            httpx.ReadError("reset"),
            Failure(ErrorType.STREAM_TRUNCATED, "ReadError: reset", ending=Ending.CUT),
        ),
    ],
    ids=lambda v: v.value if isinstance(v, Cause) else None,
)
def test_each_early_end_of_a_relay_has_one_verdict(
    cause: Cause, after_headers: bool, exc: BaseException | None, want: Failure
) -> None:
    assert relay_failure(cause, after_headers=after_headers, exc=exc, limit=2.5) == want
