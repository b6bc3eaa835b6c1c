"""Upstream error bodies -> error type: one row per real body, and secret scrubbing."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.core.errors import MAX_ERROR_BODY, classify_response, error_message, scrub
from proxy.core.measurement import ErrorType

ERRORS = Path(__file__).parent / "fixtures" / "errors"

# (fixture, status the backend sent, expected type)
TABLE = [
    ("vllm_context_length_legacy.json", 400, ErrorType.CONTEXT_LENGTH),
    ("vllm_max_tokens_too_large.json", 400, ErrorType.CONTEXT_LENGTH),
    ("vllm_decoder_prompt_too_long.json", 400, ErrorType.CONTEXT_LENGTH),
    ("openai_context_length_exceeded.json", 400, ErrorType.CONTEXT_LENGTH),
    ("tgi_max_total_tokens.json", 422, ErrorType.CONTEXT_LENGTH),
    ("tgi_input_length.json", 422, ErrorType.CONTEXT_LENGTH),
    ("openai_incorrect_api_key.json", 401, ErrorType.AUTH),
    ("openai_unsupported_region.json", 403, ErrorType.AUTH),
    ("gateway_token_exchange_failed.json", 500, ErrorType.AUTH),
    ("openai_rate_limit.json", 429, ErrorType.RATE_LIMIT),
    ("openai_insufficient_quota.json", 429, ErrorType.RATE_LIMIT),
    ("vllm_model_not_found.json", 404, ErrorType.NOT_FOUND),
    ("vllm_validation_error.json", 400, ErrorType.BAD_REQUEST),
    ("tgi_temperature.json", 422, ErrorType.BAD_REQUEST),
    ("vllm_engine_dead.json", 500, ErrorType.UPSTREAM_ERROR),
    ("nginx_bad_gateway.html", 502, ErrorType.UPSTREAM_ERROR),
]


@pytest.mark.parametrize(
    ("fixture", "status", "want"), TABLE, ids=[row[0].rsplit(".", 1)[0] for row in TABLE]
)
def test_upstream_error_body_is_classified(fixture: str, status: int, want: ErrorType) -> None:
    assert classify_response(status, (ERRORS / fixture).read_bytes()) is want


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
    body = (ERRORS / "openai_context_length_exceeded.json").read_bytes()
    assert classify_response(500, body) is ErrorType.CONTEXT_LENGTH


def test_wording_past_the_read_limit_is_not_seen() -> None:
    body = b" " * MAX_ERROR_BODY + b"maximum context length"
    assert classify_response(400, body) is ErrorType.BAD_REQUEST


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
            "nginx_bad_gateway.html",  # not JSON: the text, whitespace collapsed
            "<html> <head><title>502 Bad Gateway</title></head> <body> "
            "<center><h1>502 Bad Gateway</h1></center> <hr><center>nginx/1.25.3</center> "
            "</body> </html>",
        ),
    ],
)
def test_error_message_is_taken_from_each_body_shape(fixture: str, want: str) -> None:
    assert error_message((ERRORS / fixture).read_bytes()) == want


def test_error_message_is_cut_to_the_limit() -> None:
    assert error_message(b"x" * 1000, limit=50) == "x" * 50


def test_error_message_hides_the_masked_openai_key() -> None:
    message = error_message((ERRORS / "openai_incorrect_api_key.json").read_bytes())
    assert message.startswith("Incorrect API key provided: [redacted]. You can find")
    assert "sk-" not in message


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
    ],
)
def test_scrub_leaves_ordinary_text_alone(text: str) -> None:
    assert scrub(text) == text
