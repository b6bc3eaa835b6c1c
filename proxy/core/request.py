"""What the proxy needs to know about a client's request, read once from its JSON body.

The body is forwarded as the client sent it, with one exception: when the client streams
without asking for usage, the proxy may ask for it upstream (`stream_options.include_usage`)
so token counts come from the backend, and then removes the usage-only chunk on the way back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MEASURED_ENDPOINTS = frozenset({CHAT, COMPLETIONS})


@dataclass(frozen=True, slots=True)
class RequestInfo:
    endpoint: str
    model: str  # "" when absent or not a string
    stream: bool
    usage_requested: bool  # the client itself set stream_options.include_usage
    max_tokens: int | None
    temperature: float | None
    prompt: Any = None  # `messages` (chat) or `prompt` (completions), for tokenizer counting
    valid_json: bool = True


def parse_request(endpoint: str, body: bytes) -> tuple[RequestInfo, dict[str, Any] | None]:
    """Read the fields that matter; malformed bodies give a RequestInfo with defaults."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        info = RequestInfo(endpoint, "", False, False, None, None, valid_json=False)
        return info, None
    model = obj.get("model")
    options = obj.get("stream_options")
    max_tokens = obj.get("max_completion_tokens", obj.get("max_tokens"))
    temperature = obj.get("temperature")
    info = RequestInfo(
        endpoint=endpoint,
        model=model if isinstance(model, str) else "",
        stream=obj.get("stream") is True,
        usage_requested=isinstance(options, dict) and options.get("include_usage") is True,
        max_tokens=max_tokens if type(max_tokens) is int else None,
        temperature=float(temperature)
        if isinstance(temperature, int | float) and not isinstance(temperature, bool)
        else None,
        prompt=obj.get("messages") if endpoint == CHAT else obj.get("prompt"),
    )
    return info, obj


def with_usage_requested(obj: dict[str, Any]) -> bytes:
    """The request body re-encoded with `stream_options.include_usage: true`."""
    options = obj.get("stream_options")
    merged = dict(options) if isinstance(options, dict) else {}
    merged["include_usage"] = True
    return orjson.dumps({**obj, "stream_options": merged})
