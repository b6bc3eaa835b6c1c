"""A request body read as vLLM 0.32 reads it: every JSON route of the simulator uses this.

vLLM's routes (FastAPI, fastapi/routing.py: `json_body = await request.json()`) and its
`/invocations` (serve/sagemaker/api_router.py: `body = await raw_request.json()`) read a
body with starlette's `json.loads(body)` (starlette/requests.py `Request.json`). On bytes
that takes a UTF-8 BOM, UTF-16 and UTF-32 (`json.detect_encoding`), `NaN` and `Infinity`:
vLLM 0.32 served each of those (checked against the real server: a completion with a BOM,
UTF-16 or UTF-32 body, or an unknown field set to NaN, is a 200). orjson, which reads the
rest faster, refuses them, so a body it refuses is read again only where
`lenient_may_read` says `json.loads` may take it (proxy/core/lenient_json.py).
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.core.lenient_json import lenient_may_read, python_json_object


def read_json(raw: bytes) -> tuple[Any, str | None]:
    """(the parsed body or None, why it is not JSON or None). An empty body is None.

    A body only `json.loads` reads comes back with its lone surrogates (a "\\ud800" escape)
    made U+FFFD: the simulator echoes strings in answers orjson writes, and orjson writes
    no lone surrogate. Such a body that is JSON but no object (rare: a BOM before a list)
    is refused as orjson refused it; every route but `/invocations` refuses a non-object
    anyway."""
    if not raw:
        return None, None
    try:
        return orjson.loads(raw), None
    except orjson.JSONDecodeError as exc:
        if lenient_may_read(raw, exc):
            body = python_json_object(raw)
            if body is not None:
                return body, None
        return None, f"JSON decode error: {exc}"
