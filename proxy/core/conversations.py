"""Which requests continue which: the conversation table, I/O-free, the time passed in.

A request continues a conversation when, in this order,
  1. it carries the operator's conversation header (--conversation-header) with a value
     seen before (the value is keyed-hashed at once and never kept in clear);
  2. it is a Responses request whose `previous_response_id` is a response this table saw;
  3. its leading messages are exactly all of an earlier request's messages (an agent that
     appends the answer and a tool result and sends again), matched by the cumulative
     message digests of proxy/core/fingerprint.py (`message_chain`); or all its messages
     are those of a request that failed (its retry). A second request continuing the same
     answered one while the first is in flight is a branch (parallel samples, a fan-out),
     as it is when sent after the first's answer: it opens a new conversation. A request
     that continues by `previous_response_id` sends only its new input items, not its
     prompt: it is never matched by its messages, nor are they kept for others to match.
     A branch is judged at its start, and looked at again at its end: if the request in
     flight that made it one had in fact ended unanswered before it began (its end recorded
     after this one's start: a trimmed retry sent at once), it is that request's retry and
     moves into its conversation, when it is still alone in its own.
Anything else opens a new conversation (turn 1).

A turn is an exchange that happened. A request refused (`end(refused=True)`: the client
got an error status, 4xx or 5xx, instead of an answer: a 429, a 401, a 400 over the
context, vLLM's 404 for a `previous_response_id` its store lost, the proxy's 502/504;
proxy/sinks/conversations.py `refused`) is none: its index goes back to its retry (or,
when a later request of the conversation already took the next one, it is counted out),
its gap and time leave the conversation's figures, the last answer and its end stay what
the next turn continues and measures its gap from, and a conversation that only refused
requests opened is forgotten. A request that failed after its answer began (a 200 stream
cut or ending in an error) or that its client left is a turn: the same messages again are
its retry, in its conversation.

The table is updated twice per request, never per chunk: `begin` at its start (which
conversation, which turn, the gap since the previous answer ended) and `end` at its end
(its end, its tokens, its response id). A request's digest is indexed at its start beside
the last answered one's, and replaces that one only when it gets an answer: after a turn
that fails, both its retry and a resend that trims it are found. When requests of one
conversation overlap, the answered one that started last owns the answered digest, its
tokens and its response id, whichever ends last. A conversation closes
when it has been idle for `idle` seconds (`sweep`), and its figures come out then: turns,
duration (first start to last end), the time inside requests and the time between them.

Memory is bounded: at most `capacity` conversations, each holding two message digests at
most (its latest answered request's, and its latest one's while that is in flight or if
it failed) and one response id (its latest); when the table is full the conversation
touched longest ago with no request in flight goes first, the oldest of all only when
every one has a request in flight (`evicted` counts them). `ENTRY_BYTES` is the measured
worst-case size of one conversation (tests/core/test_conversations.py).

An unnamed conversation's id is a keyed hash of a random per-table nonce and a counter:
distinct across workers, restarts and replicas that share the salt. A named one's is a
keyed hash of the header's value, the same in every worker that shares the salt.

Identical openings are indistinguishable without a header: two clients that send the
very same messages are taken for one (the later one owns the digest: the earlier one's
next turn joins the later one's conversation, its gap measured from the later one's end).
The header (or `previous_response_id`) tells them apart.
"""

from __future__ import annotations

import hashlib
import os
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
#: Bytes one conversation holds at most in the table, with its index entries (two digests,
#: its latest request having failed, and a 256-character response id): 928 measured with
#: tracemalloc over 10,000 of them (826 with one digest).
ENTRY_BYTES = 1024


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
    digest: bytes | None = None  # the latest answered request's digest of all its messages
    unanswered: bytes | None = None  # the latest one's while in flight, or if it failed
    response_id: str | None = None  # the latest response id
    answered_turn: int = 0  # the index of the request `digest` and `response_id` are from
    refused: int = 0  # requests refused whose index a later request had already taken
    # The latest answered request's (a failed one's are None, and its retry repeats the
    # answered prompt, not the failed one's).
    prompt_tokens: int | None = None
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
    digest: bytes | None = None  # its digest of all its messages (None: no complete chain)
    # The `unanswered` digest its own replaced at its start: put back if it is refused.
    replaced: bytes | None = None
    # The conversation it would have continued, when a request in flight there made it a
    # branch: a retry of that request if it turns out to have ended, unanswered, first.
    branch_of: Conversation | None = None

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


def _continued_in_flight(c: Conversation) -> bool:
    """A request continuing `c`'s latest answered one is in flight: its digest is the
    unanswered one (set at its start). A request that matches that answered one as well
    is its sibling, not its successor: a successor's leading messages would be the one in
    flight's, and it would have matched `unanswered` instead (an agent that sends its next
    turn before the proxy records the end of the one before)."""
    return c.in_flight > 0 and c.unanswered is not None


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
        # Drawn per table: the workers of one server (and its restarts, and other replicas)
        # share the salt, and a counter alone gave their first conversations one id.
        self._nonce = os.urandom(16)
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
        if previous_response_id:
            # Its messages are its new input items alone, not its prompt (the rest is the
            # stored response's): never matched or kept as if they were the whole prompt.
            chain, complete = (), False
        conversation, via, shared = None, NEW, None
        branch_of = None
        if header:
            key = b"h" + self._hash(header)
            conversation = self._table.get(key)
            if conversation is None:
                conversation = self._open(key, now)
            else:
                via = HEADER
                if conversation.digest is not None and conversation.digest in chain[:-1]:
                    shared = conversation.prompt_tokens
                elif previous_response_id and previous_response_id == conversation.response_id:
                    # A Responses chain under the header (its chain emptied above): what
                    # it repeats is what the rule below says without the header.
                    shared = conversation.prompt_tokens
        if conversation is None and previous_response_id:
            conversation = self._by_response.get(previous_response_id)
            if conversation is not None:
                via = PREVIOUS_RESPONSE
                # vLLM rebuilds the prompt from the stored request's messages and, of the
                # previous output, its message texts only: "We skip the reasoning output",
                # and function calls are no message either (vllm/entrypoints/openai/
                # responses/utils.py, construct_input_messages). The previous prompt is
                # what is repeated: its output tokens (reasoning included) were counted
                # once, and 512 cached of a 637-token prompt after 1000 reasoning tokens
                # read 0.31, a miss. The answer's text also repeated is not known apart
                # from its reasoning and calls: left out (docs/conversations.md).
                shared = conversation.prompt_tokens
        if conversation is None and complete and chain:
            # The same messages as a request that failed: its retry, in its conversation.
            # (A resend of a request that succeeded is no continuation: a load test that
            # sends one prompt a thousand times is a thousand conversations.)
            retried = self._by_digest.get(chain[-1])
            if (
                retried is not None
                and retried.unanswered == chain[-1]
                and retried.failed
                and not retried.in_flight
            ):
                conversation, via, shared = retried, MESSAGES, retried.prompt_tokens
        if conversation is None:
            # The longest earlier request this one begins with (not itself).
            for digest in reversed(chain[:-1] if complete else chain):
                conversation = self._by_digest.get(digest)
                if conversation is not None:
                    if digest == conversation.digest and _continued_in_flight(conversation):
                        # A sibling of the one in flight: a branch (unless that one turns
                        # out to have ended unanswered before this began: `_rejoin`).
                        branch_of, conversation = conversation, None
                    else:
                        via, shared = MESSAGES, conversation.prompt_tokens
                    break
        if conversation is None:
            self._opened += 1
            opened = self._nonce + self._opened.to_bytes(8, "big")
            conversation = self._open(b"n" + self._hash(opened), now)
        gap = None
        if via != NEW and conversation.in_flight == 0 and conversation.last_end is not None:
            gap = max(0.0, now - conversation.last_end)
            conversation.between_seconds += gap
        conversation.turns += 1
        conversation.in_flight += 1
        self._touch(conversation, now)
        own = chain[-1] if chain and complete else None
        replaced = conversation.unanswered
        if own is not None:  # found at once (a continuation may come before its end runs)
            self._set_digest(conversation, "unanswered", own)
        return Turn(conversation, conversation.turns, via, gap, shared, own, replaced, branch_of)

    def end(
        self,
        turn: Turn,
        now: float,
        *,
        duration: float,
        response_id: str | None,
        prompt_tokens: int | None,
        failed: bool = False,
        refused: bool = False,
    ) -> Turn:
        """The request of `turn` ended at `now`, after `duration` seconds; `failed`: it
        got no answer (an error), so the same messages again are its retry; `refused`: it
        got an error status instead of an answer, so it was no turn at all (the module's
        docstring). On success its digest replaces the conversation's last answered one
        unless a request that started later already answered; on failure both stay, so an
        identical retry and one that trims the failed turn are both found. Returns the
        turn as it stands now: a branch found to be a retry moved into its conversation."""
        turn = self._rejoin(turn)
        c = turn.conversation
        c.in_flight = max(0, c.in_flight - 1)
        if refused:
            self._refuse(turn, now)
            return turn
        c.failed = failed
        c.model_seconds += duration
        c.last_end = now if c.last_end is None else max(c.last_end, now)
        # The latest-started answered request owns the answered slots, whichever ends last.
        latest = not failed and turn.index >= c.answered_turn
        if latest:  # what the next turn, or a retry of a failed one, repeats
            c.prompt_tokens = prompt_tokens
            c.answered_turn = turn.index
        if self._table.get(c.key) is not c:
            return turn  # evicted while in flight: nothing more to index
        self._touch(c, now)
        if failed:
            if turn.digest is not None:  # (again: an overlapping request may have taken it)
                self._set_digest(c, "unanswered", turn.digest)
            return turn
        if latest:
            self._set_digest(c, "digest", turn.digest)
        if c.unanswered == turn.digest or not c.in_flight:  # not another one's in flight
            self._set_digest(c, "unanswered", None)
        if latest and response_id and len(response_id) <= MAX_RESPONSE_ID:
            if c.response_id is not None and self._by_response.get(c.response_id) is c:
                del self._by_response[c.response_id]
            c.response_id = response_id
            self._by_response[response_id] = c
        return turn

    def _refuse(self, turn: Turn, now: float) -> None:
        """`turn`'s request was refused: no turn. Its index goes back when no later request
        took one (a retry then gets it), its gap leaves the time between turns, its digest
        gives the `unanswered` slot back to the one it replaced, and a conversation it
        alone opened is forgotten. The last answer's end stays the next gap's start."""
        c = turn.conversation
        if turn.index == c.turns:
            c.turns -= 1
        else:
            c.refused += 1
        if turn.gap is not None:
            c.between_seconds -= turn.gap
        c.failed = True  # the latest ended request got no answer (`_rejoin` reads it)
        if self._table.get(c.key) is not c:
            return
        c.touched = max(c.touched, now)
        if c.turns == c.refused and not c.in_flight:
            self._drop(c)  # no exchange happened in it
            return
        if turn.digest is not None and c.unanswered == turn.digest:
            back = turn.replaced if turn.replaced != c.digest else None
            self._set_digest(c, "unanswered", back)

    def _rejoin(self, turn: Turn) -> Turn:
        """`turn` opened a branch because a request of the conversation it continues was in
        flight; if that conversation has nothing in flight now, its latest request got no
        answer, and nothing began or ended there since this one started, that request had
        ended before this began (its end was recorded later): this one is its retry, a
        turn of that conversation. Moved there when it is still alone in its own."""
        p, n = turn.branch_of, turn.conversation
        if (
            p is None
            or p.in_flight
            or not p.failed
            or p.touched > n.started
            or n.turns != 1
            or n.in_flight != 1
            or self._table.get(p.key) is not p
            or self._table.get(n.key) is not n
        ):
            return turn
        self._drop(n)
        gap = None if p.last_end is None else max(0.0, n.started - p.last_end)
        if gap is not None:
            p.between_seconds += gap
        p.turns += 1
        p.in_flight += 1
        self._touch(p, n.started)
        replaced = p.unanswered
        if turn.digest is not None:
            self._set_digest(p, "unanswered", turn.digest)
        return Turn(p, p.turns, MESSAGES, gap, p.prompt_tokens, turn.digest, replaced)

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
            turns = c.turns - c.refused
            closed.append(Closed(turns, end - c.started, c.model_seconds, c.between_seconds))
        return closed

    def _open(self, key: bytes, now: float) -> Conversation:
        while len(self._table) >= self.capacity:
            oldest = self._evictable()
            del self._table[oldest.key]
            self._unindex(oldest)
            self.evicted += 1
        c = Conversation(key.hex()[-ID_HEX:], key, now, now)
        self._table[key] = c
        return c

    def _touch(self, c: Conversation, now: float) -> None:
        c.touched = max(c.touched, now)
        self._table.move_to_end(c.key)

    def _evictable(self) -> Conversation:
        """The conversation touched longest ago with no request in flight; the oldest of
        all only when every one has one. Those in flight go to the end of the order, each
        looked at once at most (as `sweep` does): O(1) amortised."""
        table = self._table
        for _ in range(len(table)):
            c = next(iter(table.values()))
            if not c.in_flight:
                return c
            table.move_to_end(c.key)
        return next(iter(table.values()))

    def _set_digest(self, c: Conversation, slot: str, digest: bytes | None) -> None:
        """Put `digest` in `c`'s `slot` (`digest` or `unanswered`) and in the index; the
        one it replaces leaves the index unless the other slot still holds it."""
        old = getattr(c, slot)
        if old == digest:
            if digest is not None:
                self._claim(c, digest)
            return
        setattr(c, slot, digest)
        other = c.unanswered if slot == "digest" else c.digest
        if old is not None and old != other and self._by_digest.get(old) is c:
            del self._by_digest[old]
        if digest is not None:
            self._claim(c, digest)

    def _claim(self, c: Conversation, digest: bytes) -> None:
        owner = self._by_digest.get(digest)
        if owner is not None and owner is not c:
            # The same messages again: the later conversation owns them.
            if owner.digest == digest:
                owner.digest = None
            if owner.unanswered == digest:
                owner.unanswered = None
        self._by_digest[digest] = c

    def _drop(self, c: Conversation) -> None:
        del self._table[c.key]
        self._unindex(c)

    def _unindex(self, c: Conversation) -> None:
        for digest in (c.digest, c.unanswered):
            if digest is not None and self._by_digest.get(digest) is c:
                del self._by_digest[digest]
        if c.response_id is not None and self._by_response.get(c.response_id) is c:
            del self._by_response[c.response_id]
