"""llama-server's stop words as proxy/sim/llamacpp_words.py applies them, token by token,
without a server: process_token's text rules (server-context.cpp) on the simulator's text
(" The quick brown fox jumps 你好世界 🚀 over the ...")."""

from __future__ import annotations

import pytest

from proxy.sim.llamacpp_words import (
    SentText,
    WordError,
    WordHit,
    first_word,
    has_new_line,
    read_words,
)
from proxy.sim.tokens import VOCAB, completion_text


def sent(words: tuple[str, ...], tokens: int) -> list[bytes]:
    slot = SentText(words)
    return [slot.token(VOCAB[i]) for i in range(tokens)]


def test_a_possible_start_holds_all_unsent_text_until_it_can_no_longer_complete() -> None:
    # " The" ends with "e", the start of "e x": held; " quick" rules it out: both sent
    assert sent(("e x",), 2) == [b"", b" The quick"]


def test_a_completed_word_cuts_the_text_and_sends_what_came_before_it() -> None:
    assert sent(("e q",), 2) == [b"", b" Th"]
    assert first_word(("e q",), 10) == WordHit("e q", 2, " Th")


def test_the_earliest_word_wins_and_the_first_listed_on_a_tie() -> None:
    assert first_word(("quick", "qu", "ick"), 10) == WordHit("quick", 2, " The ")
    assert first_word(("k b", "quick b"), 10) == WordHit("quick b", 3, " The ")


def test_an_empty_word_stops_at_the_first_token_with_no_text() -> None:
    assert first_word(("",), 10) == WordHit("", 1, "")


def test_words_match_utf8_bytes_across_tokens() -> None:
    # " 你好" and "世界" are tokens 5 and 6: "好世" completes with the 7th token
    assert first_word(("好世",), 20) == WordHit("好世", 7, completion_text(5) + " 你")


def test_a_word_the_text_never_holds_is_no_hit_however_long_the_text() -> None:
    assert first_word(("foxes",), 10**9) is None
    assert first_word(("e q",), 1) is None  # the limit comes first


def test_the_eos_sends_what_was_held() -> None:
    slot = SentText(("e quick!",))
    assert [slot.token(VOCAB[0]), slot.token(VOCAB[1]), slot.eos()] == [b"", b"", b" The quick"]


def test_has_new_line_counts_only_text_that_was_sent() -> None:
    # token 13 is "\n": held by "\nx" and cut off by the limit, it was never sent
    assert has_new_line((), 14, 0) and not has_new_line(("\nx",), 14, 0)
    assert has_new_line(("\nx",), 14, 1)  # the EOS sends it


def test_stop_is_read_as_the_binary_reads_it() -> None:
    assert read_words("on u") == ("on u",)
    assert read_words(["a", None, [], {}, "", "a"]) == ("a", "", "a")
    assert read_words(5) == read_words(None) == read_words({"a": 1}) == ()
    with pytest.raises(WordError, match=r"type must be string, but is number$"):
        read_words([1.5])
