"""Reading a client's request body once: which API it is for and what matters in it.

The API-specific reading (which field holds max tokens, what the prompt is, whether the
client asked for usage) lives in each seam (proxy/core/apis/); this module only decodes
the body once (JSON, or what the seam decodes: a form) and hands it over. Malformed bodies still give a RequestInfo, with defaults,
so the request is measured (and its error counted) like any other.

A request keeps its RequestInfo until it ends, which a backend's queue may hold off for
--first-byte-timeout: token ids are kept as how many there are (`TokenIds`), all that
any reader of them reads, never as the Python ints they decode to (`_kept`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from proxy.core.apis import Api, RequestInfo, api_for
from proxy.core.apis.chat import Chat
from proxy.core.apis.completions import Completions
from proxy.core.lenient_json import Refusal

CHAT = Chat.endpoint
COMPLETIONS = Completions.endpoint


@dataclass(frozen=True, slots=True)
class TokenIds:
    """A prompt of token ids (a completions, generate or embeddings prompt, or one prompt
    of a batch), kept as the number of ids, in RequestInfo.prompt and RequestInfo.echoed.

    That number is all its readers read: a tokenizer counts such a prompt as its length
    (proxy/core/tokens.py, as vLLM's usage does), an echoed one likewise; it is one prompt
    (proxy/core/llamacpp.py several_prompts), nothing to fingerprint or to show in a span.
    Decoded, an id is a pointer and an int object, about 40 bytes, 8 times its JSON: a
    client's 25 MB body of 5M ids held 200 MB for as long as its backend queued it."""

    count: int


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
        return _kept(api.read_request(obj)), obj
    # Read only as the backend's reader would (a BOM, UTF-16, NaN), and only where its
    # reader may take what orjson refused (Refusal.lenient): measured, but no object
    # handed back, so the body is never rewritten (a usage request spliced into UTF-16
    # bytes, or NaN written back as null, would change what the backend reads).
    if isinstance(obj, Refusal) and obj.lenient:
        lenient = api.decode_leniently(body, content_type)
        if lenient is not None:
            return _kept(api.read_request(lenient)), None
    info = RequestInfo(api.endpoint, "", False, False, None, None, valid_json=False)
    return info, None


def _kept(info: RequestInfo) -> RequestInfo:
    """`info` as a request keeps it: each list of token ids in its prompt, the prompt
    itself or a prompt of a batch, and each echoed one, as `TokenIds`; `info` itself where
    it has none. A seam reads the ids as sent (Completions' echo, llama.cpp's prompts due),
    before this, and the decoded body goes once the request is admitted."""
    prompt = info.prompt
    if type(prompt) is not list or not prompt:  # a text, None: no ids
        return info
    counted: dict[int, Any] = {}  # id() of each list replaced -> what replaces it
    prompt = _ids_counted(prompt, counted)
    if not counted:
        return info
    # Echoed prompts are the prompt or prompts of it (the same objects), each n times:
    # looked up, not scanned again (an n of 4096 would scan 5M ids 4096 times).
    echoed = tuple(counted.get(id(p), p) for p in info.echoed)
    return replace(info, prompt=prompt, echoed=echoed)


def _ids_counted(prompt: list[Any], counted: dict[int, Any]) -> Any:
    """`prompt` as TokenIds where it is token ids, else with its prompts that are; each
    replacement in `counted`, by the id() of the list it replaces."""
    kinds = set(map(type, prompt))  # in C: 90 ms for 5M ids (a generator's `all`: 145)
    if kinds == {int}:
        ids = counted[id(prompt)] = TokenIds(len(prompt))
        return ids
    if list not in kinds:  # messages, texts: nothing to count (a list's kinds: a few)
        return prompt
    items = [_one(p, counted) for p in prompt]
    if not counted:
        return prompt
    counted[id(prompt)] = items
    return items


def _one(item: Any, counted: dict[int, Any]) -> Any:
    """One prompt of a batch: TokenIds where it is a list of token ids, else as it is."""
    if type(item) is not list or not item or set(map(type, item)) != {int}:
        return item
    ids = counted[id(item)] = TokenIds(len(item))
    return ids


__all__ = ["CHAT", "COMPLETIONS", "RequestInfo", "TokenIds", "parse_request"]
