"""A background Response's stream read again: `GET /v1/responses/{id}?stream=true`.

Wire facts (vLLM 0.32, vllm/entrypoints/openai/responses/): a `background: true` request
generates in a task of its own that stores every event of its stream (serving.py:537-589,
1070-1085), so a client that leaves the POST's stream stops only its reading. It reads on
with `GET /v1/responses/{response_id}` and the query parameters `stream` and
`starting_after` (api_router.py:82-109): the stored events from `starting_after + 1` (0
without it), as they come, up to `response.completed`, which carries the whole
response's usage (serving.py:1104-1131). The events are the POST stream's own, so they are
read as a Responses stream; the record is labelled apart (`/v1/responses/{id}`) because
its first content event is a replay's, not the model's first token, and its usage is that
of a response whose POST has a record of its own. Without `stream` the GET answers the
stored response object: no generation, so it is forwarded unmeasured (`resumed` says no).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from urllib.parse import parse_qsl

from proxy.core.apis.base import RequestInfo
from proxy.core.apis.responses import Responses
from proxy.core.lax import lax_bool
from proxy.core.lenient_json import Refusal

_PARENT = "/v1/responses/"


class ResponsesResume(Responses):
    endpoint = "/v1/responses/{id}"
    #: The route of items: never a POST's path (apis/__init__.py leaves it out of api_for).
    paths = ("/v1/responses/{id}",)
    bench_name = ""
    measures = (
        "a GET with stream=true (a background response read again, from its "
        "starting_after): the first non-empty delta of the replay as Responses' TTFT, ITL; "
        "tokens (the whole response's) and status from response.completed; an empty 200 "
        "(vLLM's answer for a response that was not a background stream) is "
        "stream_truncated"
    )

    def decode(self, body: bytes, content_type: bytes) -> dict[str, Any] | Refusal | None:
        return {}  # a GET: its arguments are in the query, which `resumed` read

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        """A stream (only `stream=true` is measured), with no model, prompt or options:
        the response's model is its events' (the record's response_model)."""
        return replace(super().read_request(obj), stream=True, prompt=None, template=None)


def resumed(path: str, query: str) -> bool:
    """Whether a GET of `path?query` reads a stored Response's stream: one path segment
    under /v1/responses (FastAPI's `{response_id}`), and `stream` true as pydantic reads a
    query's bool (`1`, `on`, `yes`, ...); the last `stream` counts, as starlette's
    QueryParams.get gives it."""
    if not query or not path.startswith(_PARENT):
        return False
    item = path[len(_PARENT) :]
    if not item or "/" in item:
        return False
    stream = None
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "stream":
            stream = value
    return stream is not None and lax_bool(stream) is True
