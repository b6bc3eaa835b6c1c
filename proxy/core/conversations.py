"""Which requests continue which: the conversation table, I/O-free, the time passed in.

A request continues a conversation when, in this order,
  1. it carries the operator's conversation header (--conversation-header) with a value
     seen before (the value is keyed-hashed at once and never kept in clear);
  2. it is a Responses request whose `previous_response_id` is a response this table saw;
  3. its leading messages are exactly all of an earlier request's messages (an agent that
     appends the answer and a tool result and sends again), matched by the cumulative
     message digests of proxy/core/fingerprint.py (`message_chain`); or all its messages
     are those of a request that failed (its retry).
Anything else opens a new conversation (turn 1).

The table is updated twice per request, never per chunk: `begin` at its start (which
conversation, which turn, the gap since the previous answer ended) and `end` at its end
(its end, its tokens, its response id). A conversation closes when it has been idle for
`idle` seconds (`sweep`), and its figures come out then: turns, duration (first start to
last end), the time inside requests and the time between them.

Memory is bounded: at most `capacity` conversations, each holding one message digest
(its latest request's) and one response id (its latest); when the table is full the
conversation touched longest ago goes first (`evicted` counts them). `ENTRY_BYTES` is
the measured worst-case size of one conversation (tests/core/test_conversations.py).

Identical openings are indistinguishable without a header: two clients that send the
very same messages are taken for one (the later one owns the digest). The header (or
`previous_response_id`) tells them apart.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

#: How a request was recognised (the `via` label): a closed set.
NEW = "new"
HEADER = "header"
PREVIOUS_RESPONSE = "previous_response"
MESSAGES = "messages"
VIA = (HEADER, PREVIOUS_RESPONSE, MESSAGES)

#: A conversation header value longer than this is not used (counted, reason too_long).
MAX_HEADER_VALUE = 256
#: Response ids longer than this are not remembered (no backend sends such ids).
MAX_RESPONSE_ID = 256
#: Hex digits of an exported conversation id (64 bits).
ID_HEX = 16
#: Bytes one conversation holds at most in the table, with its index entries (its digest
#: and a 256-character response id): 794 measured with tracemalloc over 10,000 of them.
ENTRY_BYTES = 900


@dataclass(slots=True, eq=False)
class Conversation:
    id: str  # the exported id: a keyed hash, never the header's value
    key: bytes  # the table's key
    started: float  # the first request's start
    touched: float  # the last begin or end, for idleness and eviction order
    turns: int = 0
    in_flight: int = 0
    last_end: float | None = None  # the latest request's end
    model_seconds: float = 0.0  # sum of the requests' durations
    between_seconds: float = 0.0  # sum of the turn gaps
    digest: bytes | None = None  # the latest request's digest of all its messages
    response_id: str | None = None  # the latest response id
    prompt_tokens: int | None = None  # the latest ended request's
    output_tokens: int | None = None
    failed: bool = False  # the latest ended request got no answer

    @property
    def named(self) -> bool:
        """The client named it (the conversation header): its id stands for an identifier
        the client gave, not one the proxy made up."""
        return self.key[:1] == b"h"


@dataclass(frozen=True, slots=True)
class Turn:
    """What the table said about one request at its start."""

    conversation: Conversation
    index: int  # 1 for a conversation's first request
    via: str  # NEW or one of VIA
    gap: float | None  # the previous answer's end -> this request's start (continuations)
    shared_prefix_tokens: int | None  # the earlier request's tokens this prompt repeats

    @property
    def id(self) -> str:
        return self.conversation.id


@dataclass(frozen=True, slots=True)
class Closed:
    """A conversation's figures when it went idle."""

    turns: int
    duration: float  # first request's start -> last request's end
    model_seconds: float  # time inside its requests (their e2e, summed)
    between_seconds: float  # time between them (the turn gaps, summed)


def header_refusal(value: bytes) -> str | None:
    """Why a conversation header value is not used (`too_long`, `not_text`), or None."""
    if len(value) > MAX_HEADER_VALUE:
        return "too_long"
    if not all(0x20 <= b < 0x7F for b in value):
        return "not_text"
    return None


class Conversations:
    """The per-process table. Not thread-safe: one event loop owns it."""

    def __init__(self, *, capacity: int, idle: float, salt: bytes) -> None:
        if capacity < 1 or not idle > 0:
            raise ValueError("capacity must be >= 1 and idle > 0")
        self.capacity, self.idle, self._salt = capacity, idle, salt
        self._table: OrderedDict[bytes, Conversation] = OrderedDict()  # oldest touch first
        self._by_digest: dict[bytes, Conversation] = {}
        self._by_response: dict[str, Conversation] = {}
        self._opened = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._table)

    def _hash(self, data: bytes) -> bytes:
        return hashlib.blake2b(data, key=self._salt, digest_size=ID_HEX // 2).digest()

    def begin(
        self,
        now: float,
        *,
        header: bytes | None = None,
        previous_response_id: str | None = None,
        chain: tuple[bytes, ...] = (),
        complete: bool = True,
    ) -> Turn:
        """A request starts at `now`. `header`: the conversation header's value (already
        checked with `header_refusal`); `chain`: its message digests (message_chain),
        `complete` False when the chain stops short of its last message."""
        conversation, via, shared = None, NEW, None
        if header:
            key = b"h" + self._hash(header)
            conversation = self._table.get(key)
            if conversation is None:
                conversation = self._open(key, now)
            else:
                via = HEADER
                if conversation.digest is not None and conversation.digest in chain[:-1]:
                    shared = conversation.prompt_tokens
        if conversation is None and previous_response_id:
            conversation = self._by_response.get(previous_response_id)
            if conversation is not None:
                via = PREVIOUS_RESPONSE
                if conversation.prompt_tokens is not None:
                    shared = conversation.prompt_tokens + (conversation.output_tokens or 0)
        if conversation is None and complete and chain:
            # The same messages as a request that failed: its retry, in its conversation.
            # (A resend of a request that succeeded is no continuation: a load test that
            # sends one prompt a thousand times is a thousand conversations.)
            retried = self._by_digest.get(chain[-1])
            if retried is not None and retried.failed and not retried.in_flight:
                conversation, via, shared = retried, MESSAGES, retried.prompt_tokens
        if conversation is None:
            # The longest earlier request this one begins with (not itself).
            for digest in reversed(chain[:-1] if complete else chain):
                conversation = self._by_digest.get(digest)
                if conversation is not None:
                    via, shared = MESSAGES, conversation.prompt_tokens
                    break
        if conversation is None:
            self._opened += 1
            conversation = self._open(b"n" + self._hash(self._opened.to_bytes(8, "big")), now)
        gap = None
        if via != NEW and conversation.in_flight == 0 and conversation.last_end is not None:
            gap = max(0.0, now - conversation.last_end)
            conversation.between_seconds += gap
        conversation.turns += 1
        conversation.in_flight += 1
        self._touch(conversation, now)
        if chain and complete:
            self._index_digest(conversation, chain[-1])
        return Turn(conversation, conversation.turns, via, gap, shared)

    def end(
        self,
        turn: Turn,
        now: float,
        *,
        duration: float,
        response_id: str | None,
        prompt_tokens: int | None,
        output_tokens: int | None,
        failed: bool = False,
    ) -> None:
        """The request of `turn` ended at `now`, after `duration` seconds; `failed`: it
        got no answer (an error), so the same messages again are its retry."""
        c = turn.conversation
        c.failed = failed
        c.in_flight = max(0, c.in_flight - 1)
        c.model_seconds += duration
        c.last_end = now if c.last_end is None else max(c.last_end, now)
        c.prompt_tokens, c.output_tokens = prompt_tokens, output_tokens
        if self._table.get(c.key) is not c:
            return  # evicted while in flight: nothing more to index
        self._touch(c, now)
        if response_id and len(response_id) <= MAX_RESPONSE_ID:
            if c.response_id is not None and self._by_response.get(c.response_id) is c:
                del self._by_response[c.response_id]
            c.response_id = response_id
            self._by_response[response_id] = c

    def sweep(self, now: float) -> list[Closed]:
        """Close every conversation idle for `idle` seconds; their figures."""
        closed: list[Closed] = []
        table = self._table
        for _ in range(len(table)):  # bounded: each conversation looked at once at most
            c = next(iter(table.values()), None)
            if c is None or now - c.touched < self.idle:
                break
            if c.in_flight:  # a long request is no idle conversation: look again later
                table.move_to_end(c.key)
                continue
            self._drop(c)
            end = c.last_end if c.last_end is not None else c.touched
            closed.append(Closed(c.turns, end - c.started, c.model_seconds, c.between_seconds))
        return closed

    def _open(self, key: bytes, now: float) -> Conversation:
        while len(self._table) >= self.capacity:
            _, oldest = self._table.popitem(last=False)
            self._unindex(oldest)
            self.evicted += 1
        c = Conversation(key.hex()[-ID_HEX:], key, now, now)
        self._table[key] = c
        return c

    def _touch(self, c: Conversation, now: float) -> None:
        c.touched = max(c.touched, now)
        self._table.move_to_end(c.key)

    def _index_digest(self, c: Conversation, digest: bytes) -> None:
        if c.digest is not None and self._by_digest.get(c.digest) is c:
            del self._by_digest[c.digest]
        owner = self._by_digest.get(digest)
        if owner is not None and owner is not c:
            owner.digest = None  # the same messages again: the later conversation owns them
        c.digest = digest
        self._by_digest[digest] = c

    def _drop(self, c: Conversation) -> None:
        del self._table[c.key]
        self._unindex(c)

    def _unindex(self, c: Conversation) -> None:
        if c.digest is not None and self._by_digest.get(c.digest) is c:
            del self._by_digest[c.digest]
        if c.response_id is not None and self._by_response.get(c.response_id) is c:
            del self._by_response[c.response_id]
