"""Request bodies orjson refuses and the backend's own reader may still take.

vLLM's routes read a body with starlette's `json.loads(body)`, which takes a UTF-8 BOM,
UTF-16 and UTF-32, `NaN` and `Infinity`: such a request is served, so it is measured. It
is read again only where orjson's refusal says `json.loads` may take it (a second whole
parse on the event loop of a body both refuse cost 2 s for 32 MiB), and the strings
`json.loads` gives are made encodable (a lone surrogate, which no UTF-8 encoder takes,
failed the access log's line and its span's OTLP batch). The sinks use
`without_surrogates` as a guard for any other string not read by orjson.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Refusal:
    """orjson's refusal of a request body, kept as far as it matters: whether the
    backend's own reader may still take the body (`lenient_may_read`)."""

    lenient: bool


def request_object(body: bytes) -> dict[str, Any] | Refusal | None:
    """A request body as a JSON object; a Refusal where orjson refused it; None where it
    is JSON but no object (every reader agrees on that)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        return Refusal(lenient_may_read(body, error))
    return obj if type(obj) is dict else None


def lenient_may_read(body: bytes, error: orjson.JSONDecodeError) -> bool:
    """Whether Python's `json.loads` (vLLM's reader, `python_json_object`) may take a body
    orjson refused, judged from the body's first bytes and orjson's error, at about no
    cost. A refusal both share (a stray byte after the document, a trailing comma, a
    control character in a string) is not tried again: `json.loads` would read the whole
    body once more, on the event loop, to refuse it too (3x orjson's time, 2 s for 32 MiB).
    orjson's messages are its own (orjson 3.x); its `pos` is a character offset into its
    `doc`, the body as text (empty where the body is no UTF-8)."""
    if body.startswith(_BOMS) or b"\x00" in body[:2]:
        return True  # json.detect_encoding: a BOM, or UTF-16/32 told by a NUL in 2 bytes
    message = error.msg
    if message.startswith("str is not valid UTF-8"):
        # json.loads decodes bytes with "surrogatepass": UTF-8 encoded surrogates pass.
        return _ENCODED_SURROGATE.search(body) is not None
    if "surrogate" in message or message.startswith("number is infinity"):
        return True  # a lone "\ud800" escape; 1e999, which json.loads reads as inf
    at = error.doc[error.pos : error.pos + 8]
    if at.startswith("Infinity"):
        return True  # Infinity, and -Infinity (orjson: "no digit after sign" at the I)
    return at.startswith("NaN") and not message.startswith("no digit")  # -NaN: refused


_BOMS = (codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
_ENCODED_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def python_json_object(body: bytes) -> dict[str, Any] | None:
    """A request body as the backend's own JSON reader takes it, where orjson refused it:
    vLLM's routes (FastAPI: fastapi/routing.py, `json_body = await request.json()`) read it
    with starlette's `json.loads(body)` (starlette/requests.py `Request.json`), which on
    bytes detects a UTF-8 BOM and UTF-16 or UTF-32 (`json.detect_encoding`) and takes
    `NaN` and `Infinity`. Such a request is served, so it is measured as one.

    Unlike orjson, json.loads gives strings with lone surrogates (a "\\ud800" escape, or
    the bytes of one: it decodes with "surrogatepass"), which no UTF-8 encoder takes: one
    in the model failed the access log's line and the OTLP batch its span was in. The
    object's strings have each replaced with U+FFFD; the body sent on is not touched."""
    try:
        # As json.loads(bytes) does itself (Lib/json/__init__.py), with the text kept.
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        obj = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError alike
        return None
    if type(obj) is not dict:
        return None
    if _SURROGATE_ESCAPE.search(text) or (not text.isascii() and _LONE_SURROGATE.search(text)):
        clean_surrogates(obj)  # an escape, or the decoded bytes of one, may have made one
    return obj


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
#: A `\uD800`-`\uDFFF` escape, the only escape that can make a lone surrogate: any `\u`
#: (Python's json.dumps escapes all non-ASCII) made the walk run, 2.5 s for 24 MiB.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def without_surrogates(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD (what a UTF-8 decoder with
    errors="replace" puts for bytes it cannot read): a string any encoder takes."""
    if text.isascii() or _LONE_SURROGATE.search(text) is None:  # isascii: O(1) on a str
        return text
    return _LONE_SURROGATE.sub("\ufffd", text)


def clean_surrogates(obj: dict[str, Any] | list[Any]) -> None:
    """Every string in a JSON value (keys too) `without_surrogates`, in place."""
    _fix_in_place(obj, _string_fixed)


def writable(obj: dict[str, Any] | list[Any]) -> None:
    """A JSON value made one orjson writes, in place: its strings `without_surrogates`, and
    integers beyond orjson's range (json.loads keeps any size: `"max_tokens": 1e23`
    written as digits) as their digits in a string."""
    _fix_in_place(obj, _writable_value)


def _string_fixed(value: Any) -> Any:
    return without_surrogates(value) if type(value) is str else value


def _writable_value(value: Any) -> Any:
    if type(value) is int and not _ORJSON_MIN <= value <= _ORJSON_MAX:
        return str(value)
    return _string_fixed(value)


#: The integers orjson writes: signed and unsigned 64-bit.
_ORJSON_MIN, _ORJSON_MAX = -(2**63), 2**64 - 1


def _fix_in_place(obj: dict[str, Any] | list[Any], fix: Callable[[Any], Any]) -> None:
    """`fix` applied to every value in a JSON value that is not a dict or list, and every
    key cleaned of lone surrogates, in place. A loop, not recursion: json.loads nests as
    deep as the recursion limit lets it."""
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            if any(type(k) is str and without_surrogates(k) is not k for k in item):
                renamed = {without_surrogates(k): v for k, v in item.items()}
                item.clear()
                item.update(renamed)
            pairs: Any = item.items()
        else:
            pairs = enumerate(item)
        for key, value in list(pairs):
            if type(value) is dict or type(value) is list:
                stack.append(value)
            else:
                fixed = fix(value)
                if fixed is not value:
                    item[key] = fixed


__all__ = [
    "Refusal",
    "clean_surrogates",
    "lenient_may_read",
    "python_json_object",
    "request_object",
    "without_surrogates",
    "writable",
]
