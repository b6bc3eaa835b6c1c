"""A request's prefix fingerprint: which leading part of its prompt it shares with others,
without keeping the prompt.

Units are the leading messages for chat, Anthropic Messages (its `system` counts as the
first message) and the Responses API (an `input` list), or the leading BLOCK-character
blocks of the prompt for completions (and a Responses `input` string). A message is
hashed as its JSON with the keys sorted (frameworks rebuild the history each turn with
the fields in their own order, and it is the same message: RFC 8259 §4, an object is
unordered) and without what the model never sees (`_unit`). Digest i covers units 1..i
(cumulative), at most DEPTH of them, so two requests with the same system prompt share
digest 1, and two turns of one conversation share the digests of the history they have in
common.

`of_prompt` runs once per request, when the record is built (after the response, never
per chunk); `message_chain`, the same digests for up to CHAIN_DEPTH messages, once per
request at its start, for the conversation table (proxy/core/conversations.py). A
request's `chain_of` keeps them on its RequestInfo and `prefix_of` takes the record's
prefix from them: the messages are serialised and hashed once a request, not twice
(about 24 µs of 48 for a 30 KB, 20-message prompt). Its digests are plain BLAKE2b of the content: they must be keyed with the
deployment's salt (`keyed`) before they leave the process, or a guessed system prompt
could be tested against them. The access log does that; nothing else outputs them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from proxy.core.chat_prompt import without_billing_line

#: At most this many cumulative digests per request.
DEPTH = 8
#: Characters per block of a plain-text prompt (completions).
BLOCK = 256
#: Hex digits of a keyed digest in the log (64 bits: collisions are negligible per log).
HEX_DIGITS = 16


@dataclass(frozen=True, slots=True)
class Prefix:
    digests: tuple[bytes, ...]  # unkeyed digest of units 1..i, i = 1..len
    chars: tuple[int, ...]  # characters of units 1..i (as hashed), same length as digests
    total_chars: int  # characters of the whole prompt (all units)


def of_prompt(prompt: Any) -> Prefix | None:
    """The fingerprint of a RequestInfo.prompt: a messages list or a text; None otherwise."""
    if isinstance(prompt, str):
        return _blocks(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(m, dict) for m in prompt):
            return _messages(prompt)
        if all(isinstance(p, str) for p in prompt):  # a batch of prompts: the first one
            return _blocks(prompt[0])
    return None


def _messages(messages: list[dict[str, Any]]) -> Prefix:
    return _chain(messages, DEPTH).prefix()


@dataclass(frozen=True, slots=True)
class _Chain:
    """The cumulative digests of a messages prompt's first messages, the characters each
    covers, and the characters of all of them."""

    digests: tuple[bytes, ...]
    chars: tuple[int, ...]
    total: int

    def prefix(self) -> Prefix:
        return Prefix(self.digests[:DEPTH], self.chars[:DEPTH], self.total)


def _chain(messages: list[dict[str, Any]], depth: int) -> _Chain:
    h = hashlib.blake2b(digest_size=16)
    digests: list[bytes] = []
    chars: list[int] = []
    total = 0
    for index, message in enumerate(messages):
        unit = _unit(message)
        total += len(unit)
        if index < depth:
            h.update(unit)
            h.update(b"\x1e")  # a message boundary, so [ab] and [a, b] differ
            digests.append(h.copy().digest())
            chars.append(total)
    return _Chain(tuple(digests), tuple(chars), total)


def _unit(message: dict[str, Any]) -> bytes:
    """A message as hashed: its JSON with the keys sorted, its content blocks without their
    `cache_control`, and content that is one text block as that text. Agents move the cache
    breakpoint to the latest message each turn (a text becomes a block to carry it), and
    the model sees the same prompt either way: vLLM's Anthropic content block has no
    `cache_control` (anthropic/protocol.py, AnthropicContentBlock), and for a template
    that takes text it joins a message's text parts with "\n" (renderers/chat_utils.py),
    so a lone part is its text. A system message's text loses Claude Code's billing line
    (chat_prompt.without_billing_line): vLLM drops it, and its `cch` is new each request,
    so with it every turn of a Claude Code session was a conversation of its own."""
    content = message.get("content")
    if message.get("role") == "system":
        content = without_billing_line(content)
        if content is not message.get("content"):
            message = {**message, "content": content}
    if type(content) is list and content and all(type(b) is dict for b in content):
        blocks = [{k: v for k, v in b.items() if k != "cache_control"} for b in content]
        only = blocks[0] if len(blocks) == 1 else None
        if only is not None and only.keys() == {"type", "text"} and only["type"] == "text":
            message = {**message, "content": only["text"]}
        else:
            message = {**message, "content": blocks}
    try:
        return orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        # deeper than orjson writes (it reads deeper than it writes): the request went on,
        # its record must too (a client's 300 nested lists lost both its turn and record)
        return _UNWRITABLE


#: What a message orjson cannot write is hashed as: no vLLM renders such a prompt.
_UNWRITABLE = b"\x00unwritable"


def _blocks(text: str) -> Prefix:
    h = hashlib.blake2b(digest_size=16)
    digests: list[bytes] = []
    chars: list[int] = []
    for start in range(0, min(len(text) // BLOCK, DEPTH) * BLOCK, BLOCK):
        h.update(text[start : start + BLOCK].encode())
        digests.append(h.copy().digest())
        chars.append(start + BLOCK)
    return Prefix(tuple(digests), tuple(chars), len(text))


#: At most this many message digests per request for the conversation table.
CHAIN_DEPTH = 1024


def message_chain(prompt: Any, limit: int = CHAIN_DEPTH) -> tuple[tuple[bytes, ...], bool]:
    """The cumulative digests of a messages prompt, the same as `Prefix.digests` (digest i
    covers messages 1..i) but for up to `limit` messages, and whether they cover all of
    them: what proxy/core/conversations.py matches an earlier request's messages by. A
    prompt that is no list of messages has none: ((), False)."""
    if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
        return (), False
    h = hashlib.blake2b(digest_size=16)
    digests: list[bytes] = []
    for message in prompt[:limit]:
        h.update(_unit(message))
        h.update(b"\x1e")
        digests.append(h.copy().digest())
    return tuple(digests), len(prompt) <= limit


class RequestInfo(Protocol):
    """What `chain_of` and `prefix_of` read of a proxy.core.apis.base.RequestInfo."""

    @property
    def prompt(self) -> Any: ...
    @property
    def digests(self) -> Any: ...


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def chain_of(info: RequestInfo) -> tuple[tuple[bytes, ...], bool]:
    """`message_chain(info.prompt)`, kept on `info` for `prefix_of`."""
    prompt = info.prompt
    if not _is_messages(prompt):
        return (), False
    chain = _chain(prompt, CHAIN_DEPTH)
    object.__setattr__(info, "digests", chain)  # a memo on a frozen record: set once
    return chain.digests, len(prompt) <= CHAIN_DEPTH


def prefix_of(info: RequestInfo) -> Prefix | None:
    """`of_prompt(info.prompt)`, from the digests `chain_of` took if it ran."""
    chain = info.digests
    if isinstance(chain, _Chain):
        return chain.prefix()
    return of_prompt(info.prompt)


def keyed(prefix: Prefix, salt: bytes) -> list[str]:
    """The digests as they may be shown: keyed with the deployment's salt, short hex."""
    size = HEX_DIGITS // 2
    return [hashlib.blake2b(d, key=salt, digest_size=size).hexdigest() for d in prefix.digests]
