"""Upstream status, body and exceptions -> one ErrorType. One table, read top to bottom.

Body wording is checked before status codes because backends disagree on codes: vLLM
answers a too-long prompt with 400, others with 413 or 422, and an auth gateway in front
of a model may turn a failed token exchange into a 500.
"""

from __future__ import annotations

import re

import orjson

from proxy.core.measurement import ErrorType

# (pattern over the lower-cased body, error type). First match wins.
_BODY_RULES: tuple[tuple[re.Pattern[str], ErrorType], ...] = (
    (
        re.compile(
            r"maximum context length"  # vLLM, OpenAI
            r"|context_length_exceeded"  # OpenAI's error code
            r"|context length (?:is )?exceeded|exceeds? (?:the )?(?:model'?s? )?(?:maximum )?context"
            r"|longer than the maximum model length"  # vLLM: decoder prompt too long
            r"|prompt is too long|input is too long|too many (?:input )?tokens"
            r"|must be <= \d+"  # TGI: `inputs` tokens + `max_new_tokens` must be <= N
            r"|must have less than \d+ tokens"  # TGI: `inputs` must have less than N tokens
            r"|context window"
        ),
        ErrorType.CONTEXT_LENGTH,
    ),
    (
        re.compile(
            r"token exchange failed|invalid[ _-]api[ _-]key|incorrect api key|api key (?:is )?invalid"
            r"|invalid (?:access |bearer |auth(?:entication)? )?token|(?:token|key) (?:has )?expired"
            r"|expired (?:access |bearer )?token|unauthori[sz]ed|authentication failed"
        ),
        ErrorType.AUTH,
    ),
)

_STATUS_RULES: dict[int, ErrorType] = {
    401: ErrorType.AUTH,
    403: ErrorType.AUTH,
    404: ErrorType.NOT_FOUND,
    429: ErrorType.RATE_LIMIT,
}

#: How much of an error body is read for classification and messages.
MAX_ERROR_BODY = 64 * 1024


def classify_response(status: int, body: bytes) -> ErrorType | None:
    """Classify an upstream HTTP response; None for success (< 400)."""
    if status < 400:
        return None
    text = body[:MAX_ERROR_BODY].decode("utf-8", "replace").lower()
    for pattern, error_type in _BODY_RULES:
        if pattern.search(text):
            return error_type
    if status in _STATUS_RULES:
        return _STATUS_RULES[status]
    return ErrorType.BAD_REQUEST if status < 500 else ErrorType.UPSTREAM_ERROR


_SECRET = re.compile(
    r"(?i)(bearer\s+)\S+|\b(sk|pk|rk)-[A-Za-z0-9_\-*]{6,}|\bey[A-Za-z0-9_\-]{16,}\.\S+"
)


def scrub(text: str) -> str:
    """Mask things that look like credentials (bearer tokens, sk-... keys, JWTs)."""
    return _SECRET.sub(lambda m: (m.group(1) or "") + "[redacted]", text)


def error_message(body: bytes, limit: int = 300) -> str:
    """A short, secret-free message from an OpenAI/vLLM-shaped error body (or raw text)."""
    raw = body[:MAX_ERROR_BODY]
    message: object = None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        message = err.get("message") if isinstance(err, dict) else err
    if not isinstance(message, str) or not message:
        message = raw.decode("utf-8", "replace")
    text = " ".join(message.split())
    return scrub(text)[:limit]
