"""proxy/core/chat_prompt.py: a request's messages as vLLM gives them to the chat template
(the conversions of vllm/renderers/chat_utils.py, anthropic/serving.py and
openai/responses/utils.py), and the tokenizer's count through them."""

from __future__ import annotations

import json
from pathlib import Path

from proxy.core.apis import api_for
from proxy.core.chat_prompt import template_messages
from proxy.core.tokens import count_prompt, load_tokenizer
from tests.tokenizers_local import build_tiny_tokenizer


def test_text_parts_are_one_text_joined_by_a_newline() -> None:
    parts = [{"type": "text", "text": "hello"}, {"type": "image_url", "image_url": {}},
             {"type": "text", "text": "there"}]  # fmt: skip
    assert template_messages([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "hello\nthere"}
    ]


def test_no_content_is_an_empty_text_as_vllm_joins_no_parts() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert template_messages([{"role": "assistant", "content": None, "tool_calls": calls}]) == [
        {"role": "assistant", "content": "", "tool_calls": calls}
    ]


def test_anthropic_blocks_become_vllms_chat_messages() -> None:
    api = api_for("/v1/messages")
    assert api is not None
    body = {
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use the tool"},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "12C"}, {"type": "text", "text": "dry"}]},
            ]},
        ],
        "tools": [{"name": "weather", "description": "d", "input_schema": {"type": "object"}}],
    }  # fmt: skip
    info = api.read_request({"model": "m", **body})
    assert template_messages(info.prompt) == [
        {"role": "system", "content": "Be brief."},  # the system blocks joined with nothing
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "reasoning": "use the tool", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "weather", "arguments": json.dumps({"city": "Oslo"})}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "12C\ndry"},  # no user message left
    ]  # fmt: skip
    assert info.template == {"tools": [{"type": "function", "function": {
        "name": "weather", "description": "d", "parameters": {"type": "object"}}}]}  # fmt: skip


def test_responses_items_become_vllms_chat_messages() -> None:
    api = api_for("/v1/responses")
    assert api is not None
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ]
    info = api.read_request({"model": "m", "instructions": "Be brief.", "input": items,
                             "tools": [{"type": "function", "name": "f", "parameters": {}}]})  # fmt: skip
    assert template_messages(info.prompt) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]  # fmt: skip
    assert info.template == {"tools": [{"type": "function", "function": {
        "name": "f", "description": None, "parameters": {}}}]}  # fmt: skip


def test_a_responses_text_input_is_a_user_message_with_instructions_or_without() -> None:
    # vLLM's construct_input_messages makes a text input a user message either way; as a
    # bare string it was no message chain, so the next turn could never continue it.
    api = api_for("/v1/responses")
    assert api is not None
    bare = api.read_request({"model": "m", "input": "hello"})
    told = api.read_request({"model": "m", "instructions": "Be brief.", "input": "hello"})
    assert bare.prompt == [{"role": "user", "content": "hello"}]
    assert told.prompt == [{"role": "system", "content": "Be brief."}, *bare.prompt]


def test_a_batch_counts_every_prompt_and_a_chat_prompt_counts_its_ids(tmp_path: Path) -> None:
    """The count is the template's token ids (transformers 5 answers a BatchEncoding by
    default: its two keys were once counted as 2 tokens); a batch adds its prompts up."""
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path)))
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    one = count_prompt(tokenizer, "hello there")
    two = count_prompt(tokenizer, "how are you")
    assert one and two and count_prompt(tokenizer, ["hello there", "how are you"]) == one + two
    assert count_prompt(tokenizer, [[1, 2, 3], [4]]) == 4
    messages = [{"role": "user", "content": "hello there, how are you today"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)  # fmt: skip
    assert count_prompt(tokenizer, messages) == len(ids) > 2
