"""A workload to replay: read from tokenprobe access logs or a Mooncake trace, written as one.

A `Want` is one request's shape: when it came (seconds after the first), to which API
and model, streamed or not, how many prompt and output tokens, and which shared prefix
it began with, as a chain of prefix nodes (an id and the tokens up to its end). Only
nodes that at least two requests of the workload reach are kept: a prefix nobody else
has cannot be hit in a cache, so the replay makes it unique like the rest of the prompt.

Access-log lines give a node per keyed prefix hash; its token length is the request's
prompt tokens times the share of the prompt's characters the hash covers (the log holds
no tokens per message), taken from the first request that has it, so every request that
shares the node shares the same length. Mooncake traces (`timestamp` ms, `input_length`,
`output_length`, `hash_ids` of BLOCK-token blocks, the format AIPerf and guidellm replay)
give a node per leading shared block id.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import orjson

from proxy.core.apis.chat import Chat
from proxy.core.apis.completions import Completions
from proxy.core.apis.messages import Messages
from proxy.core.apis.responses import Responses

#: The APIs a replay can send, by their log `endpoint`.
REPLAYABLE = frozenset(api.endpoint for api in (Chat, Completions, Messages, Responses))
#: Tokens per Mooncake block (the trace format's default, and AIPerf's).
BLOCK = 512
#: A prompt keeps at least this many tokens of its own after its shared prefix.
MIN_TAIL = 4
#: The largest token count a line may give: past any model's context and past the
#: int32 that servers read max_tokens into; a trace's 1e30 is a broken line, not a
#: count (orjson cannot even write it back as an integer).
MAX_TOKENS = 2**31 - 1
#: How many skipped line numbers a report names.
SHOW_SKIPPED = 5


class TraceError(ValueError):
    """A workload that cannot be read or holds nothing to replay; the message says why."""


@dataclass(frozen=True, slots=True)
class Want:
    offset: float  # seconds after the workload's first request
    endpoint: str
    model: str
    stream: bool
    prompt_tokens: int
    output_tokens: int
    chain: tuple[tuple[str, int], ...] = ()  # shared prefix nodes: (id, tokens up to its end)
    recorded: dict[str, Any] = field(default_factory=dict)  # the log's latencies and outcome
    # Its conversation as the access log recorded it (proxy/core/conversations.py): the
    # conversation id, its turn, and the gap since the previous turn's end (seconds).
    conversation: str | None = None
    turn: int | None = None
    turn_gap: float | None = None


@dataclass(slots=True)
class Skipped:
    """Lines that were not a replayable record: how many, why, and the first few places."""

    count: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    where: list[str] = field(default_factory=list)

    def add(self, where: str, reason: str) -> None:
        self.count += 1
        self.reasons[reason] += 1
        if len(self.where) < SHOW_SKIPPED:
            self.where.append(where)

    def describe(self) -> str:
        reasons = ", ".join(f"{n} {why}" for why, n in self.reasons.most_common())
        return f"skipped {self.count} lines ({reasons}); first at {', '.join(self.where)}"


@dataclass(slots=True)
class _Line:
    arrival: float
    endpoint: str
    model: str
    stream: bool
    prompt_tokens: int
    output_tokens: int
    prefix: list[str]
    prefix_chars: list[int]
    prompt_chars: int
    recorded: dict[str, Any]
    conversation: str | None = None
    turn: int | None = None
    turn_gap: float | None = None


def read_logs(paths: Sequence[str]) -> tuple[list[Want], Skipped]:
    """Every replayable record of the access logs, by arrival; and what was skipped."""
    skipped = Skipped()
    lines: list[_Line] = []
    for path in paths:
        for number, raw in enumerate(_lines(path), 1):
            line = _record(raw, f"{path}:{number}", skipped)
            if line is not None:
                lines.append(line)
    lines.sort(key=lambda x: x.arrival)
    if not lines:
        return [], skipped
    counts = Counter(h for x in lines for h in x.prefix)
    tokens: dict[str, int] = {}  # node -> tokens up to its end, from its first request
    origin = lines[0].arrival
    wants = []
    for x in lines:
        chain: list[tuple[str, int]] = []
        for h, chars in zip(x.prefix, x.prefix_chars, strict=False):
            if counts[h] < 2:
                break
            n = tokens.setdefault(h, round(x.prompt_tokens * chars / max(x.prompt_chars, 1)))
            if n > x.prompt_tokens - MIN_TAIL or (chain and n <= chain[-1][1]):
                break
            chain.append((h, n))
        wants.append(
            Want(
                x.arrival - origin,
                x.endpoint,
                x.model,
                x.stream,
                x.prompt_tokens,
                x.output_tokens,
                tuple(chain),
                x.recorded,
                x.conversation,
                x.turn,
                x.turn_gap,
            )
        )
    return wants, skipped


def _lines(path: str) -> Iterable[bytes]:
    try:
        with open(path, "rb") as f:
            yield from f
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _record(raw: bytes, where: str, skipped: Skipped) -> _Line | None:
    start = raw.find(b"{")  # a log collector may prefix a timestamp or a pod name
    if start < 0:
        if raw.strip():
            skipped.add(where, "not JSON")
        return None
    try:
        obj = orjson.loads(raw[start:])
    except orjson.JSONDecodeError:
        skipped.add(where, "not JSON (or truncated)")
        return None
    if not isinstance(obj, dict) or "endpoint" not in obj or "prompt_tokens" not in obj:
        skipped.add(where, "not an access-log record")
        return None
    if not isinstance(obj["endpoint"], str) or obj["endpoint"] not in REPLAYABLE:
        skipped.add(where, "not a replayable API")
        return None
    arrival = obj.get("arrival")
    prompt, output = obj.get("prompt_tokens"), obj.get("output_tokens")
    if not isinstance(arrival, int | float) or isinstance(arrival, bool):
        skipped.add(where, "no arrival instant")
        return None
    if not _tokens(prompt) or prompt < 1:
        skipped.add(where, "no prompt token count")
        return None
    if not _tokens(obj.get("prompt_chars") or 0):
        skipped.add(where, "a prompt_chars that is not a count")
        return None
    if not _tokens(output):
        limit = obj.get("max_tokens")
        output = limit if _tokens(limit) else 0
    prefix, chars = obj.get("prefix") or [], obj.get("prefix_chars") or []
    if not (isinstance(prefix, list) and isinstance(chars, list) and len(prefix) == len(chars)):
        prefix, chars = [], []
    return _Line(
        arrival=float(arrival),
        endpoint=obj["endpoint"],
        model=str(obj.get("model") or ""),
        stream=obj.get("stream") is True,
        prompt_tokens=prompt,
        output_tokens=max(output, 1),
        prefix=[str(h) for h in prefix],
        prefix_chars=[int(c) for c in chars if isinstance(c, int)],
        prompt_chars=obj.get("prompt_chars") or 0,
        recorded={
            k: obj.get(k)
            for k in ("ttft_ms", "tpot_ms", "e2e_ms", "error_type", "finish_reason", "status")
        },
        **_conversation(obj),
    )


def _tokens(value: object) -> TypeGuard[int]:
    """A JSON integer in 0..MAX_TOKENS (not a bool, a float or a string)."""
    return type(value) is int and 0 <= value <= MAX_TOKENS


def _conversation(obj: dict[str, Any]) -> dict[str, Any]:
    """A line's conversation fields, each None when absent or malformed."""
    conversation, turn, gap = obj.get("conversation"), obj.get("turn"), obj.get("turn_gap_ms")
    return {
        "conversation": conversation if isinstance(conversation, str) and conversation else None,
        "turn": turn if type(turn) is int and turn >= 1 else None,
        "turn_gap": gap / 1000
        if isinstance(gap, int | float) and not isinstance(gap, bool) and gap >= 0
        else None,
    }


# -- Mooncake traces -------------------------------------------------------------------

_Row = tuple[float, int, int, list[int]]  # seconds, input and output tokens, hash ids


def to_mooncake(wants: Sequence[Want], block: int = BLOCK) -> list[dict[str, Any]]:
    """One Mooncake entry per request. Block b of a prompt gets a shared id when the
    request's shared prefix covers it whole; the id names the shortest node that covers
    it, so requests share ids exactly as far as they share nodes."""
    ids: dict[tuple[str, int], int] = {}
    fresh = 0
    out = []
    for w in wants:
        hash_ids = []
        for b in range(max(1, math.ceil(w.prompt_tokens / block))):
            end = (b + 1) * block
            node = next((node for node, tokens in w.chain if end <= tokens), None)
            if node is None:
                hash_ids.append(fresh)
                fresh += 1
                continue
            key = (node, b)
            if key not in ids:
                ids[key] = fresh
                fresh += 1
            hash_ids.append(ids[key])
        out.append(
            {
                "timestamp": round(w.offset * 1000),
                "input_length": w.prompt_tokens,
                "output_length": w.output_tokens,
                "hash_ids": hash_ids,
            }
        )
    return out


def write_mooncake(path: str, entries: Sequence[dict[str, Any]]) -> None:
    with open(path, "wb") as f:
        for entry in entries:
            f.write(orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE))


def read_mooncake(
    path: str, endpoint: str, model: str, stream: bool, block: int = BLOCK
) -> tuple[list[Want], Skipped]:
    """A Mooncake trace as Wants for one API and model (the trace names neither)."""
    skipped = Skipped()
    rows: list[_Row] = []
    try:
        text = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    for number, raw in enumerate(text, 1):
        if not raw.strip():
            continue
        row, reason = _mooncake_row(raw)
        if row is None:
            skipped.add(f"{path}:{number}", reason)
            continue
        rows.append(row)
    rows.sort(key=lambda r: r[0])
    counts = Counter(i for r in rows for i in r[3])
    origin = rows[0][0] if rows else 0.0
    wants = []
    for at, prompt, output, hash_ids in rows:
        chain: list[tuple[str, int]] = []
        for b, i in enumerate(hash_ids):
            tokens = (b + 1) * block
            if counts[i] < 2 or tokens > prompt - MIN_TAIL:
                break
            chain.append((f"m{i}", tokens))
        wants.append(
            Want(at - origin, endpoint, model, stream, prompt, max(output, 1), tuple(chain))
        )
    return wants, skipped


def _mooncake_row(raw: bytes) -> tuple[_Row | None, str]:
    """One trace line as a row, or None and why it is skipped. A timestamp of "inf" or
    "nan" (float() reads both) would have the replay wait for it forever."""
    try:
        obj = orjson.loads(raw)
        at = float(obj["timestamp"]) / 1000
        lengths = int(obj["input_length"]), int(obj["output_length"])
        hash_ids = obj.get("hash_ids") or []
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError):
        return None, "not a Mooncake entry"
    if not isinstance(hash_ids, list) or not all(type(i) is int for i in hash_ids):
        return None, "hash_ids not a list of ids"  # a string's characters are no ids
    if not math.isfinite(at):
        return None, "no finite timestamp"
    if not all(0 <= n <= MAX_TOKENS for n in lengths):
        return None, "a length that is not a token count"
    if lengths[0] < 1:
        return None, "no input length"
    return (at, *lengths, hash_ids), ""
