"""Synthetic prompts for a replay: the recorded token counts, the recorded sharing, no content.

Every shared prefix node gets one text of its own length, made once, so the requests
that shared it in the log send the very same leading text (and the target's prefix
cache sees the same hits). After it comes a tail of random words of the request's own,
sized so that the whole prompt counts the recorded prompt tokens for the target: counted
by the target's `/tokenize` (vLLM's, with the chat template for message APIs) or a local
tokenizer, and corrected until within TOLERANCE.

Chat and the Responses API get the segments as messages (system, then user and assistant
in turn, the tail as the last user message), Anthropic Messages the first as `system`,
completions one text. The words come from a fixed list of common English words, which
most tokenizers encode as one token each.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from proxy.bench.trace import Want
from proxy.core.apis.chat import Chat
from proxy.core.apis.completions import Completions
from proxy.core.apis.messages import Messages

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money story "
    "fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office "
    "door health person art war history party result change morning reason research girl "
    "guy moment air teacher force education foot boy age policy process music market sense "
    "nation plan college interest death experience effect use class control care field "
    "development role effort rate heart drug show leader light voice wife police mind price "
    "report decision son view relationship town road arm difference value building action "
    "model season society tax director position player record paper space ground form event "
    "official matter center couple site project activity star table need court oil "
    "situation cost industry figure street image phone data picture practice piece land "
    "product doctor wall patient worker news test movie north love support technology step "
    "baby computer type attention film tree source organization hair window evidence "
    "population truth song energy period course summer plant river opportunity"
)
WORDS = tuple(_WORD_TEXT.split())

#: A prompt is close enough when within 3% or 3 tokens of the recorded count.
TOLERANCE_SHARE, TOLERANCE_TOKENS = 0.03, 3
#: Corrections of one prompt's tail before giving up on being exact.
ROUNDS = 6

#: counts one payload's prompt tokens at the target
Count = Callable[[str, Any], Awaitable[int]]


class SynthError(ValueError):
    """Prompts that could not be made to the recorded lengths; the message says why."""


def close_enough(got: int, want: int) -> bool:
    return abs(got - want) <= max(TOLERANCE_TOKENS, TOLERANCE_SHARE * want)


def continued(endpoint: str, lead: tuple[Any, str], tail: str) -> Any:
    """A continuation's payload: all of the payload it continues, then that turn's answer
    (an assistant message) and the new tail (a user message); for a text prompt the
    three texts in a row."""
    before, answer = lead
    if isinstance(before, str):
        return before + answer + tail
    return [*before, {"role": "assistant", "content": answer}, {"role": "user", "content": tail}]


def payload(endpoint: str, segments: Sequence[str], tail: str) -> Any:
    """What goes in the request body for these texts: messages, a prompt, or an input list."""
    if endpoint == Completions.endpoint:
        return "".join(segments) + tail
    roles = ["system"] + ["user" if i % 2 else "assistant" for i in range(1, len(segments))]
    roles = roles[: len(segments)]
    messages = [{"role": r, "content": s} for r, s in zip(roles, segments, strict=True)]
    messages.append({"role": "user", "content": tail})
    return messages


def body_fields(endpoint: str, content: Any) -> dict[str, Any]:
    """The prompt's fields of a request body for the API."""
    if endpoint == Completions.endpoint:
        return {"prompt": content}
    if endpoint == Chat.endpoint:
        return {"messages": content}
    if endpoint == Messages.endpoint:
        if content and content[0]["role"] == "system":
            return {"system": content[0]["content"], "messages": content[1:]}
        return {"messages": content}
    return {"input": content}  # the Responses API


class Builder:
    def __init__(self, count: Count, seed: int = 0, concurrency: int = 32) -> None:
        self.count = count
        self.rng = random.Random(seed)
        self.segments: dict[str, str] = {}  # node id -> its text
        self.per_word = 1.0  # tokens per word at the target, from calibrate()
        self.limit = asyncio.Semaphore(concurrency)
        self.missed: list[tuple[int, int]] = []  # (wanted, got) beyond the tolerance

    def words(self, n: int) -> str:
        return "".join(" " + self.rng.choice(WORDS) for _ in range(max(n, 1)))

    async def calibrate(self, endpoint: str) -> None:
        short = await self.count(endpoint, payload(endpoint, (), self.words(10)))
        long = await self.count(endpoint, payload(endpoint, (), self.words(410)))
        self.per_word = max((long - short) / 400, 0.05)

    def _segment(self, node: str, tokens: int) -> str:
        if node not in self.segments:
            self.segments[node] = self.words(round(tokens / self.per_word))
        return self.segments[node]

    async def prompts(self, wants: Sequence[Want], after: Sequence[int | None] = ()) -> list[Any]:
        """One payload per want, in order: segments made in order, tails sized concurrently.

        `after[i]`, when given, is the position of an earlier want that want i continues (a
        conversation's previous turn): its payload is then that want's whole payload, an
        assistant answer of that want's output length and a new user tail, so the replay
        repeats exactly what the turn before sent, as the conversation did. Continuations
        are built once the payload they continue is fitted, a turn of depth per round."""
        plans = []
        for w in wants:
            segments, before = [], 0
            for node, tokens in w.chain:
                segments.append(self._segment(node, tokens - before))
                before = tokens
            tail = self.words(round((w.prompt_tokens - before) / self.per_word))
            plans.append((w, segments, tail, self.rng.getrandbits(64)))
        after = list(after) or [None] * len(wants)
        depth: list[int] = []
        for earlier in after:
            depth.append(0 if earlier is None else depth[earlier] + 1)
        out: list[Any] = [None] * len(wants)
        for level in range(max(depth, default=0) + 1):
            todo = [i for i, d in enumerate(depth) if d == level]
            fitted = await asyncio.gather(
                *(self._plan(plans[i], self._lead(wants, out, after[i])) for i in todo)
            )
            for i, content in zip(todo, fitted, strict=True):
                out[i] = content
        return out

    def _lead(
        self, wants: Sequence[Want], out: list[Any], earlier: int | None
    ) -> tuple[Any, str] | None:
        """What a continuation repeats: the payload it continues and that turn's answer."""
        if earlier is None:
            return None
        return out[earlier], self.words(round(wants[earlier].output_tokens / self.per_word))

    async def _plan(
        self, plan: tuple[Want, list[str], str, int], lead: tuple[Any, str] | None
    ) -> Any:
        want, segments, tail, seed = plan
        if lead is not None and isinstance(lead[0], list | str):
            async with self.limit:
                before = await self.count(want.endpoint, continued(want.endpoint, lead, " x"))
            if before < want.prompt_tokens:
                tail = self.words(round((want.prompt_tokens - before) / self.per_word))
                return await self._fit(want, [], tail, seed, lead)
        return await self._fit(want, segments, tail, seed)

    async def _fit(
        self,
        want: Want,
        segments: list[str],
        tail: str,
        seed: int,
        lead: tuple[Any, str] | None = None,
    ) -> Any:
        rng = random.Random(seed)  # the same corrections on every run: the same prompts

        def build(tail: str) -> Any:
            if lead is None:
                return payload(want.endpoint, segments, tail)
            return continued(want.endpoint, lead, tail)

        content = build(tail)
        got = want.prompt_tokens
        for _ in range(ROUNDS):
            async with self.limit:
                got = await self.count(want.endpoint, content)
            if close_enough(got, want.prompt_tokens):
                return content
            words = tail.split(" ")[1:]
            change = round((want.prompt_tokens - got) / self.per_word) or (
                1 if got < want.prompt_tokens else -1
            )
            if change > 0:
                words += [rng.choice(WORDS) for _ in range(change)]
            else:
                words = words[: max(1, len(words) + change)]
            tail = "".join(" " + w for w in words)
            content = build(tail)
        self.missed.append((want.prompt_tokens, got))
        return content
