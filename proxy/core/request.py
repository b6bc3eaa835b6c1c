"""Reading a client's request body once: which API it is for and what matters in it.

The API-specific reading (which field holds max tokens, what the prompt is, whether the
client asked for usage) lives in each seam (proxy/core/apis/); this module only decodes
the body once (JSON, or what the seam decodes: a form) and hands it over. Malformed bodies still give a RequestInfo, with defaults,
so the request is measured (and its error counted) like any other.
"""

from __future__ import annotations

from typing import Any

from proxy.core.apis import Api, RequestInfo, api_for
from proxy.core.apis.chat import Chat
from proxy.core.apis.completions import Completions
from proxy.core.lenient_json import Refusal

CHAT = Chat.endpoint
COMPLETIONS = Completions.endpoint


def parse_request(
    api: Api | str, body: bytes, content_type: bytes = b""
) -> tuple[RequestInfo, dict[str, Any] | None]:
    """The RequestInfo for `body` sent to `api` (an Api, or a path that has one), and the
    decoded body where the proxy may rewrite it (None where it may not, or it is none).
    `content_type` is the request's header, for APIs whose body is not JSON (a form)."""
    if isinstance(api, str):
        found = api_for(api)
        if found is None:
            raise ValueError(f"no measured API serves {api!r}")
        api = found
    obj = api.decode(body, content_type)
    if isinstance(obj, dict):
        return api.read_request(obj), obj
    # Read only as the backend's reader would (a BOM, UTF-16, NaN), and only where its
    # reader may take what orjson refused (Refusal.lenient): measured, but no object
    # handed back, so the body is never rewritten (a usage request spliced into UTF-16
    # bytes, or NaN written back as null, would change what the backend reads).
    if isinstance(obj, Refusal) and obj.lenient:
        lenient = api.decode_leniently(body, content_type)
        if lenient is not None:
            return api.read_request(lenient), None
    info = RequestInfo(api.endpoint, "", False, False, None, None, valid_json=False)
    return info, None


__all__ = ["CHAT", "COMPLETIONS", "RequestInfo", "parse_request"]
