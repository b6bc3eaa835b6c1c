"""What the simulator calls a token: its output vocabulary and its prompt count.

Output: token i of every completion is `VOCAB[i % len(VOCAB)]`, the same for every
request, so tests can predict the exact text (`completion_text`). The vocabulary mixes
ASCII words, Chinese characters, a 4-byte emoji and JSON escapes (quote, newline), so
that splitting UTF-8 or JSON at byte boundaries is exercised by real traffic.

Prompt: ceil(characters / 4) over the text the model would read (message contents,
text parts, an Anthropic `system`, Responses `instructions` and `input` items, or the
completion prompt; a token-id list counts one per id), at least 1.
"""

from __future__ import annotations

import json
import math
from typing import Any

VOCAB: tuple[str, ...] = (
    " The",
    " quick",
    " brown",
    " fox",
    " jumps",
    " 你好",
    "世界",
    " 🚀",
    " over",
    " the",
    ' "lazy"',
    " café",
    ",",
    "\n",
    " dog",
    ".",
)

# Each token as it appears inside a JSON string, encoded once: chunks splice these bytes.
_VOCAB_JSON: tuple[bytes, ...] = tuple(
    json.dumps(t, ensure_ascii=False)[1:-1].encode() for t in VOCAB
)


def completion_text(count: int, start: int = 0) -> str:
    """The text of tokens `start .. start+count-1`."""
    n = len(VOCAB)
    return "".join(VOCAB[i % n] for i in range(start, start + count))


def text_json(count: int, start: int = 0) -> bytes:
    """`completion_text(count, start)` escaped for the inside of a JSON string, as UTF-8."""
    n = len(_VOCAB_JSON)
    if count == 1:
        return _VOCAB_JSON[start % n]
    return b"".join(_VOCAB_JSON[i % n] for i in range(start, start + count))


def count_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a chat or Messages (`messages`), completion (`prompt`), embedding
    or Responses (`input`) request."""
    chars = content_chars(body.get("system")) + content_chars(body.get("instructions"))
    ids = 0
    if "messages" in body:
        for message in body["messages"] or ():
            if isinstance(message, dict):
                chars += content_chars(message.get("content"))
    else:
        prompt = body.get("prompt", body.get("input"))
        items = prompt if isinstance(prompt, list) else [prompt]
        for item in items:
            if isinstance(item, dict):  # a Responses input item (a message)
                chars += content_chars(item.get("content"))
            elif isinstance(item, str):
                chars += len(item)
            elif isinstance(item, int):
                ids += 1
            elif isinstance(item, list):
                ids += len(item)
    return max(1, math.ceil(chars / 4) + ids)


_TEXT_PARTS = ("text", "input_text", "output_text")


def content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: only text parts are read as text
        return sum(
            len(part.get("text") or "")
            for part in content
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS
        )
    return 0
