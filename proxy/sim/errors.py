"""Error responses, shaped like vLLM's (and, for `html_502`, like a load balancer's).

vLLM's body is `{"error": {"message", "type", "param", "code"}}` with `code` the HTTP
status as an int; its API-key middleware answers a bare `{"error": "Unauthorized"}`.
After a 200 stream has begun, vLLM reports failures as an SSE event
`data: {"error": {...}}` followed by `data: [DONE]` (see `stream.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

JSON = b"application/json"


@dataclass(frozen=True, slots=True)
class ErrorReply:
    status: int
    body: bytes
    content_type: bytes = JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()


def error_json(message: str, err_type: str, code: int, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    )


def bad_request(message: str, param: str | None = None) -> ErrorReply:
    return ErrorReply(400, error_json(message, "BadRequestError", 400, param))


def validation_error(param: str, errors: list[dict[str, object]]) -> ErrorReply:
    """vLLM 0.32's 400 for a body its pydantic models refuse (serve/exception_handling/
    handlers/validation.py, validation_exception_handler): each error as Python prints the
    dict, its `loc` the dotted `param`, a list `input` as "<list of N items>"."""
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:" + "".join(f"\n  {e!r}" for e in errors)
    return ErrorReply(400, error_json(message, "Bad Request", 400, param))


def error_input(value: object) -> object:
    """A refused value as vLLM's validation handler echoes it (serve/exception_handling/
    handlers/validation.py:89-110, _summarize_error_input)."""
    if isinstance(value, str):
        return value[:200] + "...[truncated]" if len(value) > 200 else value
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def list_too_long(field: str, items: int, max_length: int) -> ErrorReply:
    """pydantic's `too_long` for a `list[str]` field of at most `max_length` items."""
    loc = f"body.{field}"
    return validation_error(
        loc,
        [
            {
                "type": "too_long",
                "loc": loc,
                "msg": f"List should have at most {max_length} items after validation, not {items}",
                "input": f"<list of {items} items>",
                "ctx": {"field_type": "List", "max_length": max_length, "actual_length": items},
            }
        ],
    )


def too_long(field: str, items: int, max_length: int) -> ErrorReply:
    """A `str | list[str]` field whose list has more than `max_length` items (pydantic's
    `too_long`; the `str` branch fails too): vLLM's `stop` past VLLM_MAX_STOP_STRINGS."""
    loc, given = f"body.{field}", f"<list of {items} items>"
    return validation_error(
        loc,
        [
            {
                "type": "string_type",
                "loc": loc,
                "msg": "Input should be a valid string",
                "input": given,
            },
            {
                "type": "too_long",
                "loc": loc,
                "msg": f"List should have at most {max_length} items after validation, not {items}",
                "input": given,
                "ctx": {"field_type": "List", "max_length": max_length, "actual_length": items},
            },
        ],
    )


def cohere_error(reply: ErrorReply, request_id: str | None) -> ErrorReply:
    """vLLM's Cohere routes rewrite every OpenAI-style error body into Cohere's `{message,
    id}` (cohere/api_router.py:106-120 _error_response, and :206-280 its middleware for the
    errors of the global handlers): the message sanitized, the id the request's
    `X-Request-Id` (before generation no other is known), left out when there is none.
    Other bodies (`{"error":"Unauthorized"}`, FastAPI's `{"detail":...}`) pass as they are."""
    if reply.content_type != JSON:
        return reply
    try:
        error = orjson.loads(reply.body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return reply
    if not isinstance(error, dict) or "message" not in error:
        return reply
    body: dict[str, object] = {"message": sanitize_message(str(error["message"]))}
    if request_id is not None:
        body["id"] = request_id
    return ErrorReply(reply.status, orjson.dumps(body), reply.content_type, reply.headers)


def sanitize_message(message: str) -> str:
    """serve/exception_handling/utils.py:7-15: addresses, tracebacks and paths left out."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def unauthorized() -> ErrorReply:
    return ErrorReply(401, b'{"error":"Unauthorized"}')


def model_not_found(model: str) -> ErrorReply:
    return ErrorReply(
        404, error_json(f"The model `{model}` does not exist.", "NotFoundError", 404, "model")
    )


def route_not_found() -> ErrorReply:
    # vLLM is a FastAPI app: unknown routes get FastAPI's body, not an OpenAI error.
    return ErrorReply(404, b'{"detail":"Not Found"}')


def method_not_allowed() -> ErrorReply:
    return ErrorReply(405, b'{"detail":"Method Not Allowed"}')


def max_tokens_over(field: str, max_tokens: int, max_model_len: int) -> ErrorReply:
    """vLLM 0.32's 400 for a token limit over the whole context (renderers/params.py,
    TokenizeParams.__post_init__; the error handler appends the parameter and its value):
    the one context check a limit meets. One that fits the context, but not beside the
    prompt, is clamped to the room left (serve/utils/api_utils.py, get_max_tokens)."""
    message = (
        f"{field}={max_tokens} cannot be greater than max_model_len={max_model_len}. Please "
        f"request fewer output tokens. (parameter={field}, value={max_tokens})"
    )
    return bad_request(message, field)


def prompt_over(max_model_len: int, prompt_tokens: int) -> ErrorReply:
    """vLLM 0.32's 400 for a prompt that does not fit on its own (renderers/params.py,
    TokenizeParams._token_len_check)."""
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {prompt_tokens} input tokens, which exceeds this limit even without any "
        "output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={prompt_tokens})"
    )
    return bad_request(message, "input_tokens")


def context_length(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> ErrorReply:
    """The 400 of vLLM before 0.32 when the prompt plus `max_tokens` cannot fit in the
    context (`x-sim-error: context_length`: the wording tokenprobe reads, kept by tests)."""
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens} tokens in the messages, Please reduce the length of "
            "the messages."
        )
    else:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion."
        )
    return bad_request(message)


_HTML_502 = (
    b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n"
    b"</body>\r\n</html>\r\n"
)

#: `x-sim-error` values, besides `context_length` and `not_found` which need the request.
_FIXED: dict[str, ErrorReply] = {
    "auth": unauthorized(),
    "forbidden": ErrorReply(403, error_json("Forbidden", "PermissionDeniedError", 403)),
    "token_exchange": ErrorReply(
        500, error_json("token exchange failed", "InternalServerError", 500)
    ),
    "rate_limit": ErrorReply(
        429,
        error_json("Rate limit exceeded, retry later.", "RateLimitError", 429),
        headers=((b"retry-after", b"1"),),
    ),
    "bad_request": bad_request("temperature must be non-negative, got -1.0.", "temperature"),
    "server_error": ErrorReply(
        500, error_json("Internal server error", "InternalServerError", 500)
    ),
    "html_502": ErrorReply(502, _HTML_502, b"text/html"),
}

FORCED_ERRORS: frozenset[str] = frozenset({*_FIXED, "context_length", "not_found"})


def forced_error(
    name: str, *, model: str, max_model_len: int, prompt_tokens: int, max_tokens: int | None
) -> ErrorReply:
    """The reply for `x-sim-error: <name>`; `name` must be in FORCED_ERRORS."""
    if name == "context_length":
        # Ask for one token more than fits, so the numbers in the message are consistent.
        over = max(max_tokens or 0, max_model_len - prompt_tokens + 1)
        return context_length(max_model_len, prompt_tokens, over)
    if name == "not_found":
        return model_not_found(model)
    return _FIXED[name]


def anthropic_error(reply: ErrorReply) -> ErrorReply:
    """vLLM's `translate_error_response`: an OpenAI-style error body in Anthropic's shape.

    Bodies that are not `{"error": {"type", "message", ...}}` (the API-key middleware's
    `{"error":"Unauthorized"}`, FastAPI's `{"detail":...}`, a proxy's HTML page) never
    reach that function in vLLM either, so they stay as they are.
    """
    if reply.content_type != JSON:
        return reply
    try:
        parsed = orjson.loads(reply.body)
    except orjson.JSONDecodeError:
        return reply
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict):
        return reply
    body = orjson.dumps(
        {"type": "error", "error": {"type": error.get("type"), "message": error.get("message")}}
    )
    return ErrorReply(reply.status, body, reply.content_type, reply.headers)


#: ollama/ollama llm/llama_server.go: a prompt over the context length, without context shift.
OLLAMA_CONTEXT = (
    "the prompt is longer than the context length currently available to the model; "
    "shorten the prompt, adjust the context length in settings, or use a model with a "
    "longer context length"
)
#: ollama/ollama server/routes.go EmbedHandler with truncate false.
OLLAMA_EMBED_CONTEXT = "the input length exceeds the context length"
OLLAMA_JSON = b"application/json; charset=utf-8"  # gin's c.JSON


def ollama_error(reply: ErrorReply, model: str) -> ErrorReply:
    """A vLLM-shaped error reply in Ollama's `{"error": "..."}` (server/routes.go: c.JSON
    with gin.H{"error": ...}): a missing model is GenerateHandler's and ChatHandler's
    "model '%s' not found", a context overflow llm/llama_server.go's sentence."""
    try:
        message = str(orjson.loads(reply.body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = reply.body.decode("utf-8", "replace")
    if reply.status == 404:
        message = f"model '{model}' not found"
    elif "context length" in message:
        message = OLLAMA_CONTEXT
    return ErrorReply(reply.status, orjson.dumps({"error": message}), OLLAMA_JSON)


#: llama.cpp's error types by status (tools/server/server-common.cpp format_error_response,
#: the error_type enum); 400 and 500 as a real llama-server (.ci/llama, b1-0c1e570) answers.
_LLAMACPP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}
LLAMACPP_CONTEXT = "exceed_context_size_error"
LLAMACPP_JSON = b"application/json; charset=utf-8"  # as the real server answers


def llamacpp_json(status: int, message: str, err_type: str) -> bytes:
    """llama-server's error body: `{"error": {"code", "message", "type"}}`, in that order."""
    return orjson.dumps({"error": {"code": status, "message": message, "type": err_type}})


def llamacpp_context(prompt_tokens: int, n_ctx: int) -> ErrorReply:
    """llama-server's 400 for a prompt that does not fit (server-context.cpp: the prompt
    alone, n_prompt_tokens >= n_ctx; max_tokens is never checked against the context),
    byte for byte as the real server answers it, n_prompt_tokens and n_ctx after type."""
    message = (
        f"request ({prompt_tokens} tokens) exceeds the available context size ({n_ctx} "
        "tokens), try increasing it"
    )
    body = llamacpp_json(400, message, LLAMACPP_CONTEXT)[:-2]
    body += b',"n_prompt_tokens":%d,"n_ctx":%d}}' % (prompt_tokens, n_ctx)
    return ErrorReply(400, body, LLAMACPP_JSON)


def llamacpp_error(reply: ErrorReply) -> ErrorReply:
    """A vLLM-shaped error reply in llama-server's shape and content type. Replies already
    in its shape (`llamacpp_context`), statuses it has no type for (429) and bodies that
    are no OpenAI error (a proxy's HTML page) stay as they are."""
    err_type = _LLAMACPP_TYPES.get(reply.status)
    if reply.content_type != JSON or err_type is None:
        return reply
    try:
        error = orjson.loads(reply.body)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return reply
    message = error.get("message") if isinstance(error, dict) else error
    body = llamacpp_json(reply.status, str(message), err_type)
    return ErrorReply(reply.status, body, LLAMACPP_JSON, reply.headers)
