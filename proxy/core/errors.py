"""Every error decided in one place, and the one writer of the proxy's own error bodies.

Four questions, each answered here and nowhere else:

- an upstream error *response* (status and body) -> ErrorType: `classify_response`;
- a streamed success whose body carried an error event or stopped short: `classify_stream_end`;
- an *exception* from an upstream client (httpx's, aiohttp's, the stdlib's) -> ErrorType
  and a one-line description: `classify_exception`, `describe`;
- why a *relay stopped* before the body ended (`Cause`: client gone, idle or first-byte
  timeout, the drain cut by shutdown, the upstream broke) -> what the record says, what
  the client gets and how its connection ends (`Ending`): `relay_failure`.

An upstream error body (`classify_response`) is read in three steps, each only when the one
before did not decide:

1. Structure. The fields a backend sets on purpose: OpenAI's `code` ("context_length_exceeded",
   "invalid_api_key", ...), a specific `type` (Anthropic's "rate_limit_error", llama.cpp's
   "exceed_context_size_error", ...), and vLLM's `param`, which names the input a validation
   error is about ("input_tokens"). Generic types ("invalid_request_error", "BadRequestError",
   "api_error", "internal_error") say no more than the status does and decide nothing.
2. Wording, after the three statuses that mean one thing wherever they are used: 401 and 403
   are a credential or a permission, 429 a rate limit, whatever the sentence says (a gateway's
   429 "too many tokens per minute" is no long prompt). Sentences drift between releases (vLLM
   has worded "prompt too long" in many ways), so the patterns below are wide and each names where
   its phrasing comes from; the auth sentences are read first, because "token exchange failed"
   names its cause and what follows it may use the context patterns' words ("too many tokens
   issued", "lifetime must be <= 3600").
3. Status. Backends disagree on the other codes (a too-long prompt is 400, 413 or 422; an auth
   gateway may answer a failed token exchange with 500), so the status is the last word.

The real bodies behind every rule, with their sources, are in tests/fixtures/errors/index.toml.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import orjson

from proxy.core.apis import ErrorShape, api_under
from proxy.core.apis.ollama import native_route as ollama_route
from proxy.core.measurement import ErrorType
from proxy.core.secrets import is_secret_name

#: How much of an error body is read for classification and messages.
MAX_ERROR_BODY = 64 * 1024

# -- 1. structure ---------------------------------------------------------------------------

# OpenAI's `error.code` (a string; vLLM and llama.cpp put the HTTP status, an int, there).
_CODES: dict[str, ErrorType] = {
    "context_length_exceeded": ErrorType.CONTEXT_LENGTH,
    "invalid_api_key": ErrorType.AUTH,
    "rate_limit_exceeded": ErrorType.RATE_LIMIT,
    "insufficient_quota": ErrorType.RATE_LIMIT,
    "model_not_found": ErrorType.NOT_FOUND,
}

# `type` values specific enough to decide alone. Anthropic's list is ErrorType in
# anthropic-sdk-python src/anthropic/types/shared/error_type.py; llama.cpp's are in
# format_error_response, tools/server/server-common.cpp; vLLM's come from create_error_response.
_TYPES: dict[str, ErrorType] = {
    "authentication_error": ErrorType.AUTH,  # Anthropic, llama.cpp
    "permission_error": ErrorType.AUTH,  # Anthropic, llama.cpp
    "rate_limit_error": ErrorType.RATE_LIMIT,  # Anthropic
    "insufficient_quota": ErrorType.RATE_LIMIT,  # OpenAI puts it in `type` too
    "billing_error": ErrorType.RATE_LIMIT,  # Anthropic: out of credit, like OpenAI's quota
    "not_found_error": ErrorType.NOT_FOUND,  # Anthropic, llama.cpp, Ollama's OpenAI layer
    "NotFoundError": ErrorType.NOT_FOUND,  # vLLM
    "overloaded_error": ErrorType.UPSTREAM_ERROR,  # Anthropic 529
    "unavailable_error": ErrorType.UPSTREAM_ERROR,  # llama.cpp 503 (model loading)
    "timeout_error": ErrorType.UPSTREAM_TIMEOUT,  # Anthropic 504
    "exceed_context_size_error": ErrorType.CONTEXT_LENGTH,  # llama.cpp
}

# vLLM's `param` for a VLLMValidationError (vllm/entrypoints/openai/engine/serving.py
# create_error_response). These two are only ever set by the length checks
# (OpenAIServing._validate_input, TokenizeParams in vllm/renderers/params.py).
_LENGTH_PARAMS = frozenset({"input_tokens", "input_text"})
# These name the output budget; they are about the context only when the message says so,
# because "max_tokens must be at least 1" carries the same param.
_OUTPUT_PARAMS = frozenset(
    {"max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens"}
)
_ABOUT_CONTEXT = re.compile(r"context|max_model_len|model length", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class _Fields:
    """The structured fields of an error body, whichever shape carried them."""

    type: str | None
    code: str | None
    param: str | None
    message: str | None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _fields(obj: object) -> _Fields | None:
    """Read the four fields from every known shape, or None if the body is no JSON object.

    {"error": {...}} (OpenAI, vLLM >= 0.10, llama.cpp, Anthropic's {"type": "error", "error":
    {...}}); a flat {"object": "error", "message", "type", "param", "code"} (vLLM before, SGLang);
    {"error": "text", "error_type": ...} (TGI, Ollama's native API).
    """
    if not isinstance(obj, dict):
        return None
    inner = obj.get("error")
    if isinstance(inner, dict):
        obj = inner
    elif inner is not None:
        return _Fields(_str(obj.get("error_type")), None, None, _str(inner))
    return _Fields(
        _str(obj.get("type")),
        _str(obj.get("code")),
        _str(obj.get("param")),
        _str(obj.get("message")),
    )


def _by_structure(f: _Fields) -> ErrorType | None:
    if f.code is not None and f.code in _CODES:
        return _CODES[f.code]
    if f.type is not None and f.type in _TYPES:
        return _TYPES[f.type]
    if f.param in _LENGTH_PARAMS:
        return ErrorType.CONTEXT_LENGTH
    if f.param in _OUTPUT_PARAMS and f.message and _ABOUT_CONTEXT.search(f.message):
        return ErrorType.CONTEXT_LENGTH
    return None


# -- 2. wording -----------------------------------------------------------------------------

# (pattern over the lower-cased body, error type). First match wins.
_BODY_RULES: tuple[tuple[re.Pattern[str], ErrorType], ...] = (
    (
        re.compile(
            r"token exchange failed|invalid[ _-]api[ _-]key|incorrect api key|api key (?:is )?invalid"
            # a credential: "invalid token", not llama.cpp's "invalid tokens" nor a token id
            r"|invalid (?:access |bearer |auth(?:entication)? )?token(?![\w-]| ?ids?\b)"
            r"|(?:token|key) (?:has )?expired"
            r"|expired (?:access |bearer )?token|unauthori[sz]ed|authentication failed"
        ),
        ErrorType.AUTH,
    ),
    (
        re.compile(
            r"maximum context length"  # vLLM (all releases), OpenAI, SGLang's total check
            r"|context_length_exceeded"  # OpenAI's code, when the body is not JSON we can read
            r"|context length (?:is )?exceeded"
            r"|exceeds? (?:the )?(?:model'?s? )?(?:maximum |available )?context"  # llama.cpp, Ollama
            r"|context length is only"  # vLLM renderers/params.py: "the model's context length is only"
            r"|longer than the (?:maximum model length|model's context length)"  # vLLM, SGLang
            r"|too long to fit into the model"  # vLLM before v1's input processor
            r"|longer than the context length"  # Ollama llm/llama_server.go, a prompt over num_ctx
            r"|larger than the max context size"  # llama.cpp, unsplittable input
            r"|(?:max_tokens|max_completion_tokens|max_output_tokens)=\d+ ?cannot be greater than"
            r"|prompt is too long|input is too long|too many (?:input )?tokens"  # Anthropic, others
            r"|must be <= \d+"  # TGI: `inputs` tokens + `max_new_tokens` must be <= N
            r"|must have less than \d+ tokens"  # TGI: `inputs` must have less than N tokens
            r"|context window"
        ),
        ErrorType.CONTEXT_LENGTH,
    ),
)

# -- 3. status ------------------------------------------------------------------------------

#: The statuses that decide before the wording (step 2 above).
_STATUS_FIRST: dict[int, ErrorType] = {
    401: ErrorType.AUTH,
    403: ErrorType.AUTH,
    429: ErrorType.RATE_LIMIT,
}
#: The status that decides only when the wording did not.
_STATUS_LAST: dict[int, ErrorType] = {404: ErrorType.NOT_FOUND}


def classify_response(status: int, body: bytes) -> ErrorType | None:
    """Classify an upstream HTTP response; None for success (< 400). Never raises."""
    if status < 400:
        return None
    raw = body[:MAX_ERROR_BODY]
    fields = _parse(raw)
    if fields is not None and (decided := _by_structure(fields)) is not None:
        return decided
    if status in _STATUS_FIRST:
        return _STATUS_FIRST[status]
    text = raw.decode("utf-8", "replace").lower()
    for pattern, error_type in _BODY_RULES:
        if pattern.search(text):
            return error_type
    if status in _STATUS_LAST:
        return _STATUS_LAST[status]
    return ErrorType.BAD_REQUEST if status < 500 else ErrorType.UPSTREAM_ERROR


#: The kinds an error is the client's own doing in: an error event inside a stream that
#: says one of these is recorded as it, as the same words in a 4xx are. Any other (a
#: server fault: vLLM's 500 InternalServerError or 503 ServiceUnavailableError, an engine
#: that died, Anthropic's overloaded_error) is stream_error: a failure of the stream.
_CLIENTS_OWN = frozenset(
    {
        ErrorType.AUTH,
        ErrorType.CONTEXT_LENGTH,
        ErrorType.RATE_LIMIT,
        ErrorType.BAD_REQUEST,
        ErrorType.NOT_FOUND,
    }
)

#: An error event's `type` that says the status the event stands in for, where no `code`
#: carries it: vLLM's (serve/exception_handling/error_response.py create_error_response,
#: which also puts the status in `code`), OpenAI's and Anthropic's generic ones (Anthropic's
#: stream `error` events carry no status: docs.claude.com/en/api/errors), llama.cpp's.
_STATUS_BY_TYPE: dict[str, int] = {
    "BadRequestError": 400,  # vLLM: a VLLMValidationError, a bad grammar or schema
    "invalid_request_error": 400,  # OpenAI, Anthropic, llama.cpp
    "UnprocessableEntityError": 422,  # vLLM
    "NotFoundError": 404,  # vLLM
    "InternalServerError": 500,  # vLLM: a GenerationError, an engine that died
    "ServiceUnavailableError": 503,  # vLLM: a RetryableRequestError
    "internal_error": 500,  # vLLM's Messages layer, whatever failed (anthropic/serving.py)
    "api_error": 500,  # Anthropic
    "server_error": 500,  # llama.cpp, OpenAI
}

#: OpenAI Responses' `error.code` of a `response.failed` (openai-python
#: src/openai/types/responses/response_error.py ResponseError.code): all but server_error,
#: rate_limit_exceeded (in _CODES) and vector_store_timeout are about the request's input.
_RESPONSES_CLIENT_CODES = frozenset(
    {
        "invalid_prompt",
        "data_residency_mismatch",
        "bio_policy",
        "misalignment_policy_violation",
        "invalid_image",
        "invalid_image_format",
        "invalid_base64_image",
        "invalid_image_url",
        "image_too_large",
        "image_too_small",
        "image_parse_error",
        "image_content_policy_violation",
        "invalid_image_mode",
        "image_file_too_large",
        "unsupported_image_media_type",
        "empty_image_file",
        "failed_to_download_image",
        "image_file_not_found",
    }
)


#: The words of vLLM's server failures, which decide over an event's code: before vLLM
#: classified in-stream errors by their exception (serve/exception_handling/
#: error_response.py), its streams passed str(e) to create_streaming_error_response,
#: whose defaults are "BadRequestError" and 400, for a dead engine too. The sentences are
#: EngineDeadError's (vllm/v1/engine/exceptions.py ENGINE_DEAD_MESSAGE) and the defaults
#: of GenerationError and RetryableRequestError (vllm/exceptions.py).
_SERVER_FAILURE = re.compile(
    r"enginecore encountered an issue|^internal server error$|^request failed; please retry$"
)


def _event_status(error: dict[object, object]) -> int:
    """The HTTP status an in-stream error object stands in for: its `code` where that is
    a status (vLLM and llama.cpp put the int there, the same `code` as in their 4xx and
    5xx bodies), else what its `type` or a Responses code says; 500 when nothing does."""
    code, kind = error.get("code"), error.get("type")
    if type(code) is str and code.isdecimal():
        code = int(code)
    if type(code) is int and 400 <= code < 600:
        return code
    if type(code) is str and code in _RESPONSES_CLIENT_CODES:
        return 400
    if type(kind) is str and kind in _STATUS_BY_TYPE:
        return _STATUS_BY_TYPE[kind]
    return 500


def classify_stream_end(
    stream_error: object, ended: bool, end_marker: str
) -> tuple[ErrorType | None, str | None]:
    """A streamed success that reached the end of its body: an error event inside it
    (vLLM's `data: {"error": ...}` after the 200, Messages' `event: error`, Responses'
    `error` and `response.failed`, Cohere's `message-end` with an error) is read as the
    same error answered with a status would be (`_event_status`, then `classify_response`):
    the client's own doing (a bad grammar or schema, a 404, a prompt over the context, a
    rate limit) is that kind, as it is when not streamed: vLLM 0.32 checks a request's
    structured output only once its stream has begun, and answers a bad one with a 400
    inside it (generate/base/serving.py create_streaming_error_response), and its
    token-in generate stream refuses a long prompt so (scale_out/token_in_token_out/
    serving.py). Any other is stream_error, a server's failure inside the stream. A body
    that stopped before the API's end (`ended` false: no `end_marker`, nor a finish reason
    where that ends the stream) is stream_truncated. Returns (error type, message),
    (None, None) if fine; the record's `stream` says the error came inside a stream."""
    if stream_error is not None:
        wrapped = stream_error if isinstance(stream_error, dict) else {"error": stream_error}
        inner = wrapped.get("error")
        error = inner if isinstance(inner, dict) else wrapped
        body = orjson.dumps(wrapped)
        message = error_message(body)
        kind = classify_response(_event_status(error), body)
        if kind not in _CLIENTS_OWN or _SERVER_FAILURE.search(message.lower()):
            kind = ErrorType.STREAM_ERROR
        return kind, message
    if not ended:
        return ErrorType.STREAM_TRUNCATED, f"stream ended without {end_marker}"
    return None, None


def _parse(raw: bytes) -> _Fields | None:
    # Only a body that opens like a JSON object is parsed: HTML pages and plain text skip it.
    if raw.lstrip()[:1] != b"{":
        return None
    try:
        return _fields(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return None  # cut at the read limit, or not JSON after all: wording and status decide


# -- messages -------------------------------------------------------------------------------

#: What a bearer token or a JWT runs to: the next space, quote, comma or semicolon (none
#: is a token68 character, RFC 9110 §11.2), so that the JSON or header list around it
#: keeps its punctuation. A backslash is taken in: a JSON writer may escape a token's
#: "/" as "\/", and what follows it is the token still.
_TOKEN = r"[^\s\"',;]+"

_SECRET = re.compile(
    rf"((?i:bearer)\s+){_TOKEN}"
    r"|\b(?:sk|pk|rk)-[A-Za-z0-9_\-*]{6,}"  # OpenAI, Anthropic (sk-ant-)
    r"|\b(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{6,}"  # Stripe
    # Hugging Face, Groq, GitHub, Replicate, xAI, NVIDIA, Perplexity keys: their exact
    # shapes, case and all, so that HF_HUB_OFFLINE, pk_conversation_id or a model name
    # such as hf-internal-testing/... stay as they are
    r"|\b(?:hf|gsk|gh[pousr]|r8)_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}"
    r"|\b(?:xai|nvapi|pplx)-[A-Za-z0-9_\-]{20,}"
    r"|\bAIza[0-9A-Za-z_\-]{30,}|\bya29\.[0-9A-Za-z_\-]{20,}"  # Google API key, OAuth token
    r"|\bAKIA[0-9A-Z]{16}\b"  # AWS access key id
    rf"|\bey[A-Za-z0-9_\-]{{16,}}\.{_TOKEN}"  # a JWT
)


def scrub(text: str) -> str:
    """Mask things that look like credentials (bearer tokens, provider API keys, JWTs), and
    the value of every member named like one (`_secret_members`)."""
    return _SECRET.sub(lambda m: (m.group(1) or "") + "[redacted]", _secret_members(text))


#: A quoted name and what binds a value to it, as an upstream that echoes the request's
#: body writes it: a JSON member (`"api_key": `), a Python dict's repr (`'api_key': `),
#: either inside a JSON string that quotes JSON (`\"api_key\": `), or a keyword's repr
#: (`api_key='...'`, a dataclass's or pydantic model's).
_MEMBER = re.compile(
    r"""(\\?["'])([\w.\-]{1,64})\1\s*:\s*"""  # a member, its name quoted
    r"""|(?<![\w.\-])([\w.\-]{1,64})=(?=["'{\[])"""  # a keyword, its value quoted
)
#: A quoted value from its opening quote to its closing one, escapes skipped; to the end of
#: the text where a cut (MAX_ERROR_BODY) left it open.
_STRING = {
    '"': re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?'),
    "'": re.compile(r"'[^'\\]*(?:\\.[^'\\]*)*'?"),
}
#: What an object's or list's end is looked for among: its brackets, and the strings whose
#: brackets do not count (JSON's, a repr's, and JSON's quoted in a JSON string: `\"...\"`).
_NESTING = re.compile(
    r'\\"(?:[^\\]|\\(?!"))*(?:\\")?'
    r'|"[^"\\]*(?:\\.[^"\\]*)*"?'
    r"|'[^'\\]*(?:\\.[^'\\]*)*'?"
    r"|[\[\]{}]"
)
#: The scheme before a masked bearer token stays, as `_SECRET` keeps it.
_SCHEME = re.compile(r"(?i:bearer)\s+")


def _secret_members(text: str) -> str:
    """Mask the value of each member whose name carries credentials by its words
    (`is_secret_name`: `api_key`, `password`, `x-auth-token`, `credentials`): an upstream
    that echoes the client's JSON in its error (`bad field in {"api_key": "..."}`) echoes
    keys of no known shape. A string is masked, and an object or a list that holds one (a
    `credentials` object, whatever it names); a bare value is not: numbers and flags name
    no credential, and `max_tokens` and `prompt_tokens` hold counts (the words are the
    ones of header names: `token` is among them). Most errors name no such word: the text
    is looked through once for any, then only for members. Each character is read once:
    a value is skipped once read, so the client's own text, echoed, cannot make it slow."""
    if not is_secret_name(text.lower()):
        return text
    parts: list[str] = []
    kept = searched = 0
    while (member := _MEMBER.search(text, searched)) is not None:
        searched = member.end()
        name = member.group(2) or member.group(3)
        if not is_secret_name(name.lower()):
            continue  # its value is looked through: an object's members are members too
        end, masked = _value(text, searched)
        if masked is not None:
            parts += (text[kept:searched], masked)
            kept = end
        searched = end
    parts.append(text[kept:])
    return "".join(parts)


def _value(text: str, start: int) -> tuple[int, str | None]:
    """The end of the value that begins at `start`, and what replaces it: a string's quotes
    around `[redacted]` (a bearer token's scheme kept), an object or a list `[redacted]`
    whole when it holds a string (an object's names are). None, nothing replaced, for a
    bare value, whose end is `start` (what follows is read on), and for a list that holds
    no string (token ids), skipped whole: no member inside it can hold one either."""
    if text.startswith('\\"', start):  # JSON quoted in a JSON string: its quotes escaped
        close = text.find('\\"', start + 2)
        return (len(text) if close < 0 else close + 2), '\\"[redacted]\\"'
    opening = text[start : start + 1]
    if opening in _STRING:
        string = _STRING[opening].match(text, start)
        end = string.end() if string is not None else len(text)  # it always matches
        scheme = _SCHEME.match(text, start + 1)
        kept = scheme.group() if scheme is not None and scheme.end() < end - 1 else ""
        return end, f"{opening}{kept}[redacted]{opening}"
    if opening not in ("{", "["):
        return start, None
    depth, holds_string = 0, False
    for token in _NESTING.finditer(text, start):
        mark = token.group()
        if mark in ("{", "["):
            depth += 1
        elif mark in ("}", "]"):
            depth -= 1
        else:
            holds_string = True
        if depth == 0:
            return token.end(), "[redacted]" if holds_string else None
    return len(text), "[redacted]" if holds_string else None  # left open: cut at the end


#: The most of a client's model name a log line or a span shows.
MAX_SHOWN_MODEL = 200


def shown_model(model: str) -> str:
    """The model a client named, as the access log and spans show it: cut short, and with
    anything that looks like a credential masked (a key pasted into the wrong field is a
    key still). Masked before the cut, so a key the cut would split loses its start too."""
    return scrub(model[: 2 * MAX_SHOWN_MODEL])[:MAX_SHOWN_MODEL]


def error_message(body: bytes, limit: int = 300) -> str:
    """A short, secret-free message from an error body of any known shape (or its raw text).

    Reads `error.message` (OpenAI, vLLM, llama.cpp, Anthropic's {"type": "error", "error": {...}}),
    a flat `message` (vLLM before 0.10, SGLang) and a string `error` (TGI, Ollama).
    """
    raw = body[:MAX_ERROR_BODY]
    fields = _parse(raw)
    message = fields.message if fields is not None else None
    if message is None:
        message = raw.decode("utf-8", "replace")
    text = scrub(" ".join(message.split()))
    if len(text) <= limit:
        return text
    # Cut at a word's end: a word cut in two may be the start of a credential the upstream
    # echoed, which redaction (of whole header values, proxy/server/headers.py) then no
    # longer recognises.
    cut = text[: limit + 1].rpartition(" ")[0]
    return cut or "(a message of one long word, not kept)"


# -- exceptions -----------------------------------------------------------------------------

# Foreign exception types are matched by name ("package.Class") along each exception's MRO,
# so the core imports neither HTTP client; tests/core/test_errors.py checks every name still
# names a real class. Builtin types are matched with isinstance.
_TIMEOUTS = (TimeoutError,)  # asyncio.TimeoutError is TimeoutError since Python 3.11
_FOREIGN_TIMEOUTS = frozenset({"httpx.TimeoutException", "aiohttp.ServerTimeoutError"})


class ConnectFailed(ConnectionError):
    """Opening a connection to the upstream failed (proxy/server/dial.py), whatever the
    system said (no socket at a Unix socket's path, a name that does not resolve, no
    route): the upstream is unreachable, as httpx's ConnectError and aiohttp's
    ClientConnectorError say on the ASGI relay. What the system said is its cause, which
    `describe` tells, and `where` the address it tried ("host 10.0.0.5:8000"), which every
    path puts after it (dial, send_upstream) and the client's answer leaves out; None
    where the system's words name it already (a Unix socket's path)."""

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.where = where


# -- an upstream fault, told the same way on every path --------------------------------------

#: The one wording of each upstream fault that the data paths meet in their own words:
#: the wire's parser and pool, the ASGI relay's httpx (h11) and aiohttp transports. Each
#: path raises the fault in these words (`fault_words`), so the client's answer and the
#: record read the same whichever path met it; each keeps what helps an operator (the
#: setting whose limit ran out, the upstream's address, which the client's answer leaves
#: out: `relay_failure`).
UPSTREAM_FAULTS: dict[str, str] = {
    # the transports' own said nothing of it: a cancelled task ("CancelledError:
    # cancelled before the upstream answered"), anyio's "Cancelled via cancel scope ..."
    "connect_timeout": "the connect timed out after {limit:g} s (--connect-timeout) to {where}",
    # llhttp, h11 and aiohttp all read any three digits as a status, and give it as a
    # number: written back in three digits, as it came ("099", not "99")
    "not_a_status": "status {status:03d} is not an HTTP status",
    # a 101 the proxy never asked for (WebSockets are the tunnel's)
    "unasked_switch": "the upstream switched protocols unasked",
    # a clean close (a FIN) that cut the response short; `where` says where: "before
    # answering", "before the end of the response head", "... body" (the wire's
    # _closed_early, the aiohttp transport's payload errors)
    "closed_early": "the upstream closed the connection {where}",
    # proxy.server.protocol.refused_transfer_encoding's words; `said` is
    # " (transfer-encoding: gzip, chunked)", empty where h11 refused it unsaid
    "transfer_coding": "a transfer coding other than chunked{said}: only chunked is taken",
}


def fault_words(fault: str, **details: object) -> str:
    """The words of `fault` (a key of UPSTREAM_FAULTS) with its details filled in."""
    return UPSTREAM_FAULTS[fault].format(**details)


class Told(Exception):
    """An upstream fault the proxy raised in its one wording (UPSTREAM_FAULTS): `describe`
    tells these words, not those of the transport's exception beneath it."""


class ConnectTimedOut(Told, TimeoutError):
    """No connection to the upstream within --connect-timeout, on any path: the wire's
    `dial` (given the limit), the ASGI relay's `send_upstream` over either transport. A
    TimeoutError, so it is an upstream_timeout (a 504) as it was."""

    def __init__(self, limit: float, where: str) -> None:
        super().__init__(fault_words("connect_timeout", limit=limit, where=where))


#: The transports' own connect timeouts, by "package.Class" (httpx's is looked past to
#: httpcore's, its cause; httpx-aiohttp's misnamed one, over a dropped connection, is not
#: one: `_causes`). aiohttp's is raised for its `connect` and `sock_connect` limits alike,
#: both --connect-timeout (proxy.server.upstream_aiohttp.send_aiohttp).
_FOREIGN_CONNECT_TIMEOUTS = frozenset({"httpcore.ConnectTimeout", "aiohttp.ConnectionTimeoutError"})


def connect_timed_out(exc: BaseException) -> bool:
    """Whether an upstream client's exception is its connect timeout running out."""
    return any(not _FOREIGN_CONNECT_TIMEOUTS.isdisjoint(type_names(type(e))) for e in _causes(exc))


_CONNECTS = (ConnectionRefusedError, ConnectFailed)
# httpx's ConnectError is looked past to its cause (below), httpcore's ConnectError.
_FOREIGN_CONNECTS = frozenset(
    {"httpx.ConnectError", "httpcore.ConnectError", "aiohttp.ClientConnectorError"}
)
#: httpx's own errors, which httpx-aiohttp raises in place of aiohttp's.
_HTTPX_ERROR = "httpx.HTTPError"


def type_names(kind: type[BaseException]) -> frozenset[str]:
    """ "package.Class" for an exception class and each of its bases."""
    return frozenset(f"{c.__module__.partition('.')[0]}.{c.__name__}" for c in kind.__mro__)


def _is(
    exc: BaseException, builtin: tuple[type[BaseException], ...], foreign: frozenset[str]
) -> bool:
    return isinstance(exc, builtin) or not foreign.isdisjoint(type_names(type(exc)))


def _causes(exc: BaseException) -> Iterator[BaseException]:
    # httpx-aiohttp re-raises aiohttp's errors as httpx ones, not always the right ones
    # (a dropped connection becomes ConnectTimeout): when there is a cause, trust the cause.
    wrapper = exc.__cause__ is not None and _HTTPX_ERROR in type_names(type(exc))
    current: BaseException | None = exc.__cause__ if wrapper else exc
    while current is not None:
        yield current
        current = current.__cause__ or current.__context__


#: The proxy's own resources running out as it connects: too many open files (its own,
#: the system's), no buffer space, no free local port. The backend is not unreachable
#: (that is an alert that pages about the backend); the proxy is (its open-files alert).
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.EADDRNOTAVAIL})


def classify_exception(exc: BaseException, *, after_headers: bool) -> ErrorType:
    """What an upstream client's exception means, before or after the response head."""
    causes = list(_causes(exc))
    if any(_is(e, _TIMEOUTS, _FOREIGN_TIMEOUTS) for e in causes):
        return ErrorType.UPSTREAM_TIMEOUT
    if after_headers:
        return ErrorType.STREAM_TRUNCATED
    if any(isinstance(e, OSError) and e.errno in _EXHAUSTED for e in causes):
        return ErrorType.UPSTREAM_ERROR
    if any(_is(e, _CONNECTS, _FOREIGN_CONNECTS) for e in causes):
        return ErrorType.UPSTREAM_UNREACHABLE
    return ErrorType.UPSTREAM_ERROR


def describe(exc: BaseException) -> str:
    """A one-line description without URLs' credentials or headers.

    Many of these exceptions carry no text (a timeout, a cancellation): then a phrase says
    what happened, rather than the class name twice ("TimeoutError: TimeoutError")."""
    causes = list(_causes(exc))
    told = next((e for e in causes if isinstance(e, Told)), None)
    if told is not None:  # the proxy's own words for the fault, whatever lies beneath
        return f"{type(told).__name__}: {told}"[:300]
    root = causes[-1] if causes else exc
    failed = next((e for e in causes if isinstance(e, ConnectFailed)), None)
    where = f" to {failed.where}" if failed is not None and failed.where else ""
    name = type(root).__name__
    names = type_names(type(root))
    parsing = _HTTP_PROCESSING in names
    said = getattr(root, "message", root) if parsing else root
    # One line: aiohttp's parser errors hold newlines. Their own words only: str() puts
    # aiohttp's internal code before them ("400, message: Not enough data to satisfy
    # content length header."), a status no HTTP peer sent.
    text = " ".join(str(said).split())
    if parsing or not names.isdisjoint(_PROTOCOL_ERRORS):
        text = parser_words(text)
    begun = not isinstance(getattr(root, "message", ""), str)
    if begun and _DISCONNECTED in type_names(type(root)):
        # aiohttp's disconnect error holds the response head it had begun, whose repr is
        # its internals and the upstream's headers: the phrase below says it instead
        text = ""
    if isinstance(root, ConnectionError) and root.errno and root.strerror is not None:
        # A refused or reset connection in the system's words for its errno, as uvloop
        # and httpcore give them: asyncio's are "Connect call failed ('10.0.0.5', 8000)"
        # (aiohttp's connect), for the same refusal.
        text = " ".join(str(OSError(root.errno, os.strerror(root.errno), root.filename)).split())
    if not text or text == name:
        text = next((phrase for kind, phrase in PHRASES if kind in names), "no detail given")
    return f"{name}: {text}{where}"[:300]


def parser_words(text: str) -> str:
    """An HTTP parser's refusal without what it quotes of the bytes it refused, and all
    that follows: h11's "illegal header line: bytearray(b'...')", aiohttp's C parser's
    "Invalid header token: b'...' ^", its pure-Python parser's "Invalid HTTP header:
    b'...'" and "Bad status line '...'". Those bytes are the upstream's own header lines
    (a Set-Cookie, a token), never the client's or the record's to see. Only for parser
    errors: in other texts a quote after a word is no upstream's bytes (a file's name)."""
    return _QUOTED.sub("", text)


#: Where a parser's quoting begins: a bytes or bytearray repr after ": " or " ", a str
#: repr after ": " or aiohttp's "Bad status line " (not h11's "<class '...'>", no bytes).
_QUOTED = re.compile(r"""(?:(?::\s*|\s+)(?:bytearray\()?b|:\s*|(?<=line)\s+)['"].*""")

#: The parsers' protocol errors (h11's, as httpcore and httpx raise them again).
_PROTOCOL_ERRORS = frozenset(
    {"h11.RemoteProtocolError", "httpcore.RemoteProtocolError", "httpx.RemoteProtocolError"}
)

#: aiohttp's clean close, whose `message` is its text or the response head it had begun.
_DISCONNECTED = "aiohttp.ServerDisconnectedError"

#: Phrases for exceptions without text, by "package.Class", most specific first.
PHRASES: tuple[tuple[str, str], ...] = (
    (_DISCONNECTED, "the upstream closed the connection"),
    ("builtins.TimeoutError", "timed out"),
    ("asyncio.CancelledError", "cancelled before the upstream answered"),
    ("builtins.ConnectionResetError", "the upstream reset the connection"),
    ("httpx.RemoteProtocolError", "the upstream broke the HTTP protocol"),
)

#: aiohttp's parser errors (aiohttp.http_exceptions: ContentLengthError and
#: TransferEncodingError for a body cut short, BadHttpMessage, ...): `message` holds their
#: words, which str() puts after the code aiohttp gives them all ("400, message:").
_HTTP_PROCESSING = "aiohttp.HttpProcessingError"

#: Every foreign name above, for the test that keeps them real.
FOREIGN_NAMES = (
    _FOREIGN_TIMEOUTS
    | _FOREIGN_CONNECTS
    | _FOREIGN_CONNECT_TIMEOUTS
    | {_HTTPX_ERROR, _HTTP_PROCESSING}
    | _PROTOCOL_ERRORS
    | {name for name, _ in PHRASES}
)


# -- a relay that stopped early -------------------------------------------------------------


class Cause(Enum):
    """Why a relay stopped before the upstream body ended."""

    CLIENT_GONE = "client_gone"  # the client disconnected (seen on receive())
    IDLE_TIMEOUT = "idle_timeout"  # the upstream sent nothing for --idle-timeout mid-body
    CLIENT_STALLED = "client_stalled"  # the client took no bytes for --idle-timeout while
    # the upstream waited on it (nginx's send_timeout): it holds a generation it never reads
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"  # no response head within --first-byte-timeout
    SHUTDOWN = "shutdown"  # the server's drain time ran out and it cancelled the request
    UPSTREAM_BROKE = "upstream_broke"  # the upstream client raised


#: The record's words for a pipelined request the drain's end dropped before its turn.
SHUTDOWN_BEFORE_TURN = "the proxy shut down before its turn on the connection; no answer went out"
#: The record's words for a pipelined request dropped with the connection of an answer cut.
CUT_BEFORE_TURN = (
    "the answer before it on the connection was cut (the upstream failed), and the "
    "connection dropped with it; no answer went out"
)

#: The early ends that are the upstream's (it broke the response, or went silent in it):
#: after the response head they drop the client's connection, and the requests
#: pipelined behind are the upstream's casualties (Ending.CUT, LostTurn.CUT).
UPSTREAM_CUTS = frozenset({Cause.UPSTREAM_BROKE, Cause.IDLE_TIMEOUT})


class LostTurn(Enum):
    """Why a request pipelined on a connection never got its turn, decided as the
    connection closes (GuardedHttpToolsProtocol.lost_turn), the same on both data paths,
    whatever stage the request was in (its body still coming, or refused at its head).
    Its record (ExchangeRules.turn_lost) has status 0: nothing went out to it."""

    CLIENT = "client"  # client_cancelled: the client ended or reset the connection, or it
    # closed by the client's own doing (it asked for the close, stopped reading its answer)
    DRAIN = "drain"  # upstream_error: the drain's end closed it (SHUTDOWN_BEFORE_TURN)
    CUT = "cut"  # upstream_error: the answer before it was cut for the upstream's failure,
    # and the connection dropped so its client sees the break (CUT_BEFORE_TURN)

    def recorded(self) -> tuple[ErrorType, str | None]:
        """The record's error type and message."""
        if self is LostTurn.CLIENT:
            return ErrorType.CLIENT_CANCELLED, None
        return ErrorType.UPSTREAM_ERROR, (
            SHUTDOWN_BEFORE_TURN if self is LostTurn.DRAIN else CUT_BEFORE_TURN
        )


#: The status the proxy answers with when an upstream failure comes before any header.
_STATUS_FOR_ERROR = {
    ErrorType.UPSTREAM_UNREACHABLE: 502,
    ErrorType.UPSTREAM_ERROR: 502,
    ErrorType.UPSTREAM_TIMEOUT: 504,
}


class Ending(Enum):
    """How the client's connection ends after a relay's early end: decided once, with the
    failure (`relay_failure`), and only carried out by each data path (the wire on its
    transport, the ASGI relay through the messages and exceptions it gives the server)."""

    KEEP = "keep"  # the proxy's answer (a 502 or 504 before any head), and the
    # connection serves the next request as the client asked
    CLOSE = "close"  # the proxy's answer says Connection: close and the connection closes
    # after it: the drain's 503, so nothing behind it starts on a server going away
    GONE = "gone"  # the client left: nothing to answer, its connection is over
    DROP = "drop"  # dropped mid-body, never ended cleanly, so the client sees the break
    # as it would without the proxy (the drain's end cut the response)
    CUT = "cut"  # dropped as DROP, for the upstream's failure (UPSTREAM_CUTS): the
    # requests pipelined behind are its casualties (LostTurn.CUT), not the client's
    ABORT = "abort"  # dropped at once with a reset: every byte not yet taken thrown away,
    # the kernel's send queue too (SO_LINGER 0; an abort alone drops only the transport's
    # buffer), where a close would wait for good on what the client never takes
    # (CLIENT_STALLED)


@dataclass(frozen=True, slots=True)
class Failure:
    """What a relay that stopped early records, what its client gets, and how its
    connection ends.

    Before the response head (`answer` set): the proxy answers with its own error body,
    `answer` = (status, kind, message). After it: `ending` drops the client's connection,
    so the client sees the break as it would without the proxy. A client that left gets
    neither."""

    error: ErrorType
    message: str
    answer: tuple[int, str, str] | None = None
    ending: Ending = Ending.KEEP

    @property
    def drop(self) -> bool:
        """The connection is dropped with the response unended (the client sees a break)."""
        return self.ending in _DROPS

    @property
    def closes(self) -> bool:
        """No other request is served on the connection after this one."""
        return self.ending is not Ending.KEEP


_DROPS = frozenset({Ending.DROP, Ending.CUT, Ending.ABORT})


def relay_failure(
    cause: Cause,
    *,
    after_headers: bool,
    exc: BaseException | None = None,
    limit: float = 0.0,
) -> Failure:
    """The one table of a relay's early ends: the record's error and message, the client's
    answer, how its connection ends. `limit` is the timeout that ran out, `exc` what the
    upstream client raised (for UPSTREAM_BROKE)."""
    if cause is Cause.CLIENT_GONE:
        return Failure(ErrorType.CLIENT_CANCELLED, "client disconnected", ending=Ending.GONE)
    if cause is Cause.IDLE_TIMEOUT:
        message = f"no data from the upstream for {limit:g} s"
        return Failure(ErrorType.UPSTREAM_TIMEOUT, message, ending=Ending.CUT)
    if cause is Cause.CLIENT_STALLED:
        message = f"the client took no bytes for {limit:g} s (--idle-timeout)"
        return Failure(ErrorType.CLIENT_CANCELLED, message, ending=Ending.ABORT)
    if cause is Cause.SHUTDOWN:
        message = "cut off: the proxy shut down before the response ended"
        if after_headers:
            return Failure(ErrorType.STREAM_TRUNCATED, message, ending=Ending.DROP)
        answer = (503, "proxy_shutting_down", message)
        return Failure(ErrorType.UPSTREAM_ERROR, message, answer, Ending.CLOSE)
    if cause is Cause.FIRST_BYTE_TIMEOUT:
        error, message = (
            ErrorType.UPSTREAM_TIMEOUT,
            f"no response within {limit:g} s (--first-byte-timeout)",
        )
    else:
        assert exc is not None, "an upstream break has an exception"
        error, message = classify_exception(exc, after_headers=after_headers), describe(exc)
    if after_headers:
        ending = Ending.CUT if cause in UPSTREAM_CUTS else Ending.DROP
        return Failure(error, message, ending=ending)
    status = _STATUS_FOR_ERROR.get(error, 502)
    # The client learns what broke, not where the backend is: the record keeps it all.
    told = _CERT_NAME.sub("the upstream's name", _ADDRESS.sub("", _FILE.sub(r"\1", message)))
    return Failure(error, message, (status, error.value, f"upstream: {told}"))


# The upstream's address in a transport's words: aiohttp's "Cannot connect to host
# 10.0.0.5:8000 ssl:default [Connect call failed ('10.0.0.5', 8000)]", an IP and port;
# the proxy's own " to host 10.0.0.5:8000" and " to socket /run/vllm.sock"
# (proxy.server.dial.where, last in its words: a path may hold spaces).
_ADDRESS = re.compile(
    r" to host \S+| to socket .+$|\s*\(\s*'[^']*',\s*\d+(?:,\s*\d+)*\s*\)"
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\[[0-9A-Fa-f:.]+\](?::\d+)?"
)
# The file an OSError names after its words, as Python writes it ("[Errno 2] No such
# file or directory: '/run/vllm.sock'"): a Unix socket's path (proxy.server.dial
# name_the_socket), where the backend is as much as a host and port are.
_FILE = re.compile(r"(\[Errno \d+\] [^:'\"\]]*): (?:'[^']*'|\"[^\"]*\")")
# The name in Python's "Hostname mismatch, certificate is not valid for 'vllm.internal'".
_CERT_NAME = re.compile(r"(?<=not valid for )'[^']*'")


# -- the proxy's own error bodies -----------------------------------------------------------

Shape = ErrorShape

# Anthropic's `error.type` for each status, from https://docs.claude.com/en/api/errors
# ("HTTP errors") and timeout_error from anthropic-sdk-python's ErrorType. Anthropic's SDK
# picks its exception class from the status; the type is for people and classifiers.
_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_shape(path: str) -> Shape:
    """The error shape clients of `path` parse: what the Api serving it (or a path above
    it) declares; Ollama's on its unmeasured native paths (/api/tags, /api/blobs/...: the
    same clients); OpenAI's elsewhere."""
    api = api_under(path)
    if api is not None:
        return api.error_shape
    return "ollama" if ollama_route(path) else "openai"


def error_body(status: int, kind: str, message: str, *, shape: Shape = "openai") -> bytes:
    """The body of an error the proxy itself answers with (never a relayed upstream body).

    OpenAI shape: {"error": {"message", "type": kind, "param": null, "code": status}}, as vLLM
    writes its own. Anthropic shape: {"type": "error", "error": {"type", "message"}}, the type
    chosen by status as Anthropic does (other 4xx are invalid_request_error, 5xx api_error).
    Ollama shape: {"error": message}, its StatusError (proxy/core/apis/ollama.py); it has no
    field for `kind`, the status says it.
    """
    if shape == "ollama":
        return orjson.dumps({"error": message})
    if shape == "anthropic":
        fallback = "invalid_request_error" if status < 500 else "api_error"
        error_type = _ANTHROPIC_TYPES.get(status, fallback)
        return orjson.dumps({"type": "error", "error": {"type": error_type, "message": message}})
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    )


__all__ = [
    "CUT_BEFORE_TURN",
    "MAX_ERROR_BODY",
    "SHUTDOWN_BEFORE_TURN",
    "UPSTREAM_CUTS",
    "UPSTREAM_FAULTS",
    "Cause",
    "ConnectFailed",
    "ConnectTimedOut",
    "Ending",
    "Failure",
    "LostTurn",
    "Shape",
    "Told",
    "classify_exception",
    "classify_response",
    "classify_stream_end",
    "connect_timed_out",
    "describe",
    "error_body",
    "error_message",
    "error_shape",
    "fault_words",
    "parser_words",
    "relay_failure",
    "scrub",
]
