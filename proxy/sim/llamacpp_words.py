"""llama-server's stop words (`stop`), applied to the simulator's programmed text when it
plays llama-server: the native /completion and the OpenAI-compatible chat and completions
alike, which share one slot loop.

Source: llama.cpp tools/server/server-context.cpp, `process_token` (with the slot's
`find_stopping_strings`) and `send_partial_response`; common/common.cpp
`string_find_partial_stop` (read at ggml-org/llama.cpp master). Checked against the real
binary, .ci/llama's build b1-0c1e570, which behaves so on every rule below (the captures
tests/fixtures/streams/llamacpp/*stop*, and by hand: the tie, "" and the 400s):

- Each generated token is appended to the slot's text, and the text not sent yet is
  searched for every word, from `word.size() + token.size()` bytes before its end. A
  match cuts the text before the earliest one (`stop_type` "word", `stopping_word` that
  word; on a tie the first in the list) and ends the generation at that token:
  `tokens_predicted` (`n_decoded`) counts it, and no EOS follows. Its partial sends the
  unsent text before the word, and carries `timings` (the slot's `stop` is already set
  when send_partial_response runs).
- Otherwise, if the unsent text ends with the start of a word (any non-empty prefix), the
  whole unsent text is held back: the token's partial has no text. A later token's
  partial sends all of it once the text no longer ends with the start of any word.
- The EOS token skips that check (`!llama_vocab_is_eog`), so its partial sends what was
  held. A token limit hit while text is held ends without sending it: the streamed
  answer loses it, the final object's `content` is empty in a stream; not streamed,
  `content` is the slot's whole text, held text included.
- All of it works on UTF-8 bytes, as std::string does.
- `stop` is read as the binary reads it on all three routes: a string is one word, a
  list its strings (an empty one too, which stops at the first token); `null`, `[]` and
  `{}` in the list are skipped (nlohmann's `empty()`), any other non-string is the 400
  "Field 'stop': [json.exception.type_error.302] type must be string, but is <type>";
  anything else is no words.

A word completed by the first token with no text before it, on chat: the real server puts
`timings` on the role chunk, which it sends with that first partial (proxy/sim/llamacpp.py
holds the role chunk back for it). A word completed by the token that fills the context
ends as "limit" (process_token's context check comes after the words; controls.py,
`Plan.truncated`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.sim.tokens import VOCAB, completion_text


class WordError(ValueError):
    """A `stop` llama-server refuses: its 400, with this message."""


@dataclass(frozen=True, slots=True)
class WordHit:
    word: str  # the final object's `stopping_word`
    tokens: int  # tokens generated, the one that completes the word included
    text: str  # the slot's text: everything before the word


def read_words(stop: Any) -> tuple[str, ...]:
    """The request's `stop` as llama-server's antiprompt list (duplicates and "" kept)."""
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list):
        return ()
    words = []
    for word in stop:
        if isinstance(word, str):
            words.append(word)
        elif word is None or word == [] or word == {}:
            continue  # nlohmann's empty(): skipped before the string conversion
        else:
            raise WordError(
                "Field 'stop': [json.exception.type_error.302] type must be string, "
                f"but is {_json_type(word)}"
            )
    return tuple(words)


def _json_type(value: object) -> str:
    """nlohmann's type_name()."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "array" if isinstance(value, list) else "object"


class SentText:
    """What process_token sends of one slot's text, token by token."""

    __slots__ = ("_sent", "_text", "_words", "has_new_line", "word")

    def __init__(self, words: tuple[str, ...]) -> None:
        self._words = [(w, w.encode()) for w in words]
        self._text = bytearray()  # generated_text
        self._sent = 0  # n_sent_text
        self.word: str | None = None  # the stopping word, once one completed
        self.has_new_line = False  # a sent text had a "\n" (the final object's has_new_line)

    @property
    def text(self) -> str:
        return self._text.decode()

    def token(self, piece: str) -> bytes:
        """A text token: the text its partial sends (UTF-8)."""
        tok = piece.encode()
        self._text += tok
        start = self._sent
        unsent = bytes(self._text[start:])
        cut = self._full_stop(unsent, len(tok))
        if cut is not None:
            del self._text[start + cut :]
        elif any(_partial_stop(unsent, word) for _, word in self._words):
            return b""
        return self._send()

    def step(self, count: int, sent: int) -> bytes:
        """Tokens `sent .. sent+count-1` (tokens.VOCAB) in one event: their sent text,
        escaped for the inside of a JSON string."""
        n = len(VOCAB)
        return _json(b"".join(self.token(VOCAB[i % n]) for i in range(sent, sent + count)))

    def eos(self) -> bytes:
        """The EOS token's partial: no text of its own and no partial check, so what was
        held back (escaped for the inside of a JSON string)."""
        return _json(self._send())

    def _send(self) -> bytes:
        out = bytes(self._text[self._sent :])
        self._sent += len(out)
        self.has_new_line = self.has_new_line or b"\n" in out
        return out

    def _full_stop(self, unsent: bytes, token_size: int) -> int | None:
        """find_stopping_strings(is_full_stop=true): where the earliest word starts."""
        best = None
        for word, raw in self._words:
            pos = unsent.find(raw, max(0, len(unsent) - (len(raw) + token_size)))
            if pos != -1 and (best is None or pos < best):
                best, self.word = pos, word
        return best


def _json(text: bytes) -> bytes:
    return orjson.dumps(text.decode())[1:-1] if text else b""


def _partial_stop(text: bytes, word: bytes) -> bool:
    """string_find_partial_stop: the text ends with a non-empty start of the word."""
    return bool(text) and any(text.endswith(word[:k]) for k in range(1, len(word) + 1))


def first_word(words: tuple[str, ...], tokens: int) -> WordHit | None:
    """Where a stop word ends a generation of `tokens` text tokens, or None."""
    # The text repeats every len(VOCAB) tokens and every token has a byte at least, so a
    # word that has not completed by then never will.
    horizon = len(VOCAB) + max((len(w.encode()) for w in words), default=0) + 1
    slot = SentText(words)
    n = len(VOCAB)
    for i in range(min(tokens, horizon)):
        slot.token(VOCAB[i % n])
        if slot.word is not None:
            return WordHit(slot.word, i + 1, slot.text)
    return None


def has_new_line(words: tuple[str, ...], tokens: int, eos: int) -> bool:
    """The final object's `has_new_line`: a "\\n" in some token's sent text (held text
    that a limit cut off was never sent)."""
    if not words:
        return "\n" in completion_text(tokens)
    slot = SentText(words)
    n = len(VOCAB)
    for i in range(tokens):
        slot.token(VOCAB[i % n])
    if eos:
        slot.eos()
    return slot.has_new_line
