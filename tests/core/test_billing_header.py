"""Claude Code's attribution line, `x-anthropic-billing-header: ...; cch=<hex>;` (the first
`system` block of every request, its `cch` new each time), is left out as vLLM 0.32 leaves
it out, so the conversation's digests, the prefix fingerprint and a tokenizer's count see
one prompt across turns, as the engine does:

- Messages (vllm/entrypoints/anthropic/serving.py, _convert_system_message): every
  `system` text block that opens with the header goes, whole; a string `system` stays;
- then every `system` message (chat, converted Messages, Responses; renderers/chat_utils.py,
  _strip_claude_code_billing_header in _parse_chat_message_content): each text that opens
  with it (the content string, a string part, a `text` part) loses its first line, and
  goes where nothing follows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.core.apis import api_for
from proxy.core.chat_prompt import template_messages, without_billing_line
from proxy.core.conversations import MESSAGES, NEW, Conversations
from proxy.core.fingerprint import message_chain, of_prompt
from proxy.core.tokens import count_request, load_tokenizer
from tests.tokenizers_local import build_tiny_tokenizer


def billing(cch: str) -> str:
    """Claude Code's line: its version, its entry point, and `cch`, new each request."""
    return f"x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch={cch};"


def text(t: str, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": t, **extra}


SYSTEM = "You are a weather agent."


@pytest.mark.parametrize(
    ("content", "seen"),
    [
        (billing("a1") + "\n" + SYSTEM, SYSTEM),  # a string: its first line goes
        (billing("a1"), ""),  # nothing after it: no text, joined to ""
        (SYSTEM + "\n" + billing("a1"), SYSTEM + "\n" + billing("a1")),  # not its opening
        ([text(billing("a1")), text(SYSTEM)], [text(SYSTEM)]),  # Claude Code's blocks
        ([text(SYSTEM), text(billing("a1") + "\nmore")], [text(SYSTEM), text("more")]),
        ([billing("a1") + "\nrest"], ["rest"]),  # a string part
        # the part's other keys stay (cache_control: the fingerprint drops it later)
        (
            [text(billing("a1") + "\nx", cache_control={"type": "ephemeral"})],
            [text("x", cache_control={"type": "ephemeral"})],
        ),
        # vLLM matches `text` parts and strings only: a Responses input_text part stays
        (
            [{"type": "input_text", "text": billing("a1")}],
            [{"type": "input_text", "text": billing("a1")}],
        ),
        (None, None),
    ],
    ids=[
        "string",
        "string-alone",
        "not-first",
        "blocks",
        "later-part",
        "str-part",
        "cache-control",
        "input-text",
        "none",
    ],
)
def test_a_system_text_loses_the_billing_line_as_vllms_chat_renderer_drops_it(
    content: Any, seen: Any
) -> None:
    assert without_billing_line(content) == seen


def test_content_without_the_line_is_left_as_it_is() -> None:
    parts = [text(SYSTEM)]
    assert without_billing_line(parts) is parts


def messages_body(cch: str | None, history: list[dict[str, Any]]) -> dict[str, Any]:
    system = [text(SYSTEM, cache_control={"type": "ephemeral"})]
    if cch is not None:
        system.insert(0, text(billing(cch)))
    return {"model": "m", "max_tokens": 8, "system": system, "messages": history}


def read(path: str, body: dict[str, Any]) -> Any:
    api = api_for(path)
    assert api is not None
    return api.read_request(body).prompt


def test_messages_drops_the_billing_block_whole_as_vllm_does() -> None:
    history = [{"role": "user", "content": "Weather in Sintra?"}]
    assert read("/v1/messages", messages_body("0a1b2", history)) == [
        {"role": "system", "content": SYSTEM},
        *history,
    ]
    # The whole block goes, even the lines after the header's (startswith, then continue)
    whole = {"model": "m", "max_tokens": 8, "messages": history,
             "system": [text(billing("0a1b2") + "\n" + SYSTEM)]}  # fmt: skip
    assert read("/v1/messages", whole) == history  # none left: no system message
    # Blocks that are no text, or empty, add nothing (`block.type == "text" and block.text`)
    other = {"model": "m", "max_tokens": 8, "messages": history,
             "system": [{"type": "image", "source": {}}, text(""), text(SYSTEM)]}  # fmt: skip
    assert read("/v1/messages", other)[0] == {"role": "system", "content": SYSTEM}


def test_a_messages_system_string_keeps_the_line_that_the_chat_stage_then_drops() -> None:
    history = [{"role": "user", "content": "Weather in Sintra?"}]
    body = {"model": "m", "max_tokens": 8, "system": billing("9") + "\n" + SYSTEM,
            "messages": history}  # fmt: skip
    prompt = read("/v1/messages", body)
    assert prompt[0] == {"role": "system", "content": billing("9") + "\n" + SYSTEM}
    assert template_messages(prompt)[0] == {"role": "system", "content": SYSTEM}
    plain = read("/v1/messages", {**body, "system": SYSTEM})
    assert of_prompt(prompt) == of_prompt(plain)


def test_claude_code_turns_with_a_new_cch_each_are_one_conversation_with_one_prefix() -> None:
    """Three turns, a new cch each: three conversations of one turn, each with a prefix
    fingerprint of its own, before; one conversation of three turns, as without the line."""
    table = Conversations(capacity=10, idle=60.0, salt=b"s" * 16)
    history = [{"role": "user", "content": "Weather in Sintra?"}]
    turns, fingerprints = [], []
    for index, cch in enumerate(("0a1b2", "93fe0", "5c7d1")):
        prompt = read("/v1/messages", messages_body(cch, history))
        chain, complete = message_chain(prompt)
        turn = table.begin(float(index), chain=chain, complete=complete)
        table.end(turn, index + 0.5, duration=0.5, response_id=None, prompt_tokens=20)
        turns.append(turn)
        prefix = of_prompt(prompt)
        assert prefix is not None
        fingerprints.append(prefix.digests[0])
        history = [*history, {"role": "assistant", "content": [text("Sunny.")]},
                   {"role": "user", "content": f"And tomorrow {index}?"}]  # fmt: skip
    assert [(t.index, t.via) for t in turns] == [(1, NEW), (2, MESSAGES), (3, MESSAGES)]
    assert len({t.id for t in turns}) == 1
    assert turns[1].shared_prefix_tokens == 20
    plain = of_prompt(read("/v1/messages", messages_body(None, history)))
    assert plain is not None and set(fingerprints) == {plain.digests[0]}


def test_a_gateways_chat_system_message_with_the_line_keeps_its_digests() -> None:
    """A gateway that turns Claude Code's request into chat keeps the line in the system
    message, as a first text part or a first line; vLLM's chat renderer drops it."""
    history = [{"role": "user", "content": "Weather in Sintra?"}]
    plain = message_chain([{"role": "system", "content": SYSTEM}, *history])
    for content in ([text(billing("77")), text(SYSTEM)], billing("78") + "\n" + SYSTEM):
        assert message_chain([{"role": "system", "content": content}, *history]) == plain
    # Only a system message's: vLLM leaves a user's text as it is.
    user = [{"role": "user", "content": billing("79") + "\nhello"}]
    assert message_chain(user) != message_chain([{"role": "user", "content": "hello"}])


#: A template that writes every message's content, so a count sees the line if it is there.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", messages_body("0a1b2", [{"role": "user", "content": "Sintra?"}])),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "system": billing("1") + "\n" + SYSTEM,
                          "messages": [{"role": "user", "content": "Sintra?"}]}),
        ("/v1/chat/completions", {"model": "m", "messages": [
            {"role": "system", "content": billing("2") + "\n" + SYSTEM},
            {"role": "user", "content": "Sintra?"}]}),
        ("/v1/responses", {"model": "m", "instructions": billing("3") + "\n" + SYSTEM,
                           "input": "Sintra?"}),
    ],
    ids=["messages-blocks", "messages-string", "chat", "responses-instructions"],
)  # fmt: skip
def test_a_tokenizer_counts_the_prompt_without_the_line_as_vllm_does(
    tmp_path: Path, path: str, body: dict[str, Any]
) -> None:
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path)))
    tokenizer.chat_template = TEMPLATE
    seen = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Sintra?"}]
    rendered = tokenizer.apply_chat_template(seen, tokenize=False, add_generation_prompt=True)
    api = api_for(path)
    assert api is not None
    info = api.read_request(body)
    assert template_messages(info.prompt) == seen
    # a Responses prompt is encoded with the tokenizer's special tokens (chat_prompt.py,
    # responses_options), a chat one without
    special = path == "/v1/responses"
    truth = len(tokenizer.encode(rendered, add_special_tokens=special))
    assert count_request(tokenizer, info) == truth
