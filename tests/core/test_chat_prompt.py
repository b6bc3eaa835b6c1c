"""proxy/core/chat_prompt.py: a request's messages as vLLM gives them to the chat template
(the conversions of vllm/renderers/chat_utils.py, anthropic/serving.py and
openai/responses/utils.py), and the tokenizer's count through them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proxy.core.apis import api_for
from proxy.core.chat_prompt import (
    parsed_arguments,
    template_kwargs,
    template_messages,
    template_tools_of,
)
from proxy.core.tokens import count_chat, count_prompt, load_tokenizer
from tests.tokenizers_local import build_tiny_tokenizer, mistral_tokenizer_dir


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


# -- the template's arguments and the encoding, as vLLM 0.32 renders a chat prompt ----------

#: A template that shows what it is given: tools, tool-call arguments, thinking, BOS.
SHOWING = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.arguments | tojson }}</call>"
    "{% endfor %}\n{% endfor %}"
    "{% if tools %}TOOLS:{{ tools | tojson }}{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER = {"role": "user", "content": "Measuring latency means time to first token."}


def _templated(directory: Path, mistral: bool = False) -> Any:
    """A local tokenizer with SHOWING as its chat template."""
    directory.mkdir(exist_ok=True)
    made = mistral_tokenizer_dir(directory) if mistral else build_tiny_tokenizer(directory)
    if mistral:  # as Mistral's own tokenizer_config.json says: encode() adds <s>
        config = json.loads((made / "tokenizer_config.json").read_text())
        (made / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tokenizer = load_tokenizer(str(made))
    tokenizer.chat_template = SHOWING
    return tokenizer


def _vllm(tokenizer: Any, messages: list[dict[str, Any]], special: bool = False,
          **kwargs: Any) -> int:  # fmt: skip
    """vLLM's count, its steps written out: the template rendered to a text with the
    arguments vLLM ends with (renderers/hf.py, safe_apply_chat_template), then encoded
    with the request's add_special_tokens (renderers/base.py, _tokenize_prompt)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return len(tokenizer.encode(text, add_special_tokens=special))


def _chat(tokenizer: Any, **body: Any) -> int | None:
    api = api_for("/v1/chat/completions")
    assert api is not None
    info = api.read_request({"model": "m", **body})
    return count_prompt(tokenizer, info.prompt, info.template, template_only=True)


def test_add_generation_prompt_is_the_request_fields_even_in_chat_template_kwargs(
    tmp_path: Path,
) -> None:
    """build_chat_params merges the request's own add_generation_prompt (default true)
    over chat_template_kwargs: given twice to the template, it once raised a TypeError
    and the count fell back to the joined texts, still labelled `tokenizer`."""
    tokenizer = _templated(tmp_path)
    got = _chat(tokenizer, messages=[USER], chat_template_kwargs={"add_generation_prompt": False})
    assert got == _vllm(tokenizer, [USER], add_generation_prompt=True)
    off = _chat(tokenizer, messages=[USER], add_generation_prompt=False,
                chat_template_kwargs={"add_generation_prompt": True})  # fmt: skip
    assert off == _vllm(tokenizer, [USER], add_generation_prompt=False) < got  # type: ignore[operator]


def test_tool_call_arguments_reach_the_template_as_an_object(tmp_path: Path) -> None:
    """chat_utils.py _postprocess_messages: a JSON text is parsed; one that is empty, not
    JSON or not an object is {}; the request's own messages are left as they were."""
    tokenizer = _templated(tmp_path)

    def call(arguments: object) -> dict[str, Any]:
        return {"id": "c1", "type": "function",
                "function": {"name": "weather", "arguments": arguments}}  # fmt: skip

    given = ['{"city": "Oslo"}', "not json", "", "[1, 2]"]
    assistant = {"role": "assistant", "content": "", "tool_calls": [call(a) for a in given]}
    seen = [USER, {**assistant, "tool_calls": [call(a) for a in
                                               ({"city": "Oslo"}, {}, {}, {})]}]  # fmt: skip
    messages = [USER, assistant]
    assert _chat(tokenizer, messages=messages) == _vllm(tokenizer, seen, add_generation_prompt=True)
    assert assistant["tool_calls"][0]["function"]["arguments"] == given[0]
    assert parsed_arguments([{"role": "assistant", "content": "", "tool_calls": []}]) == [
        {"role": "assistant", "content": ""}  # an empty list is left out
    ]


def test_tools_reach_the_template_as_vllm_dumps_them(tmp_path: Path) -> None:
    """online_renderer.py render_chat: each tool's model_dump(), so a function without a
    description or parameters has them null, keys in the model's order."""
    tokenizer = _templated(tmp_path)
    tools = [{"type": "function", "function": {"parameters": {"type": "object"},
                                                "name": "weather", "strict": True}}]  # fmt: skip
    dumped = [{"type": "function", "function": {"name": "weather", "description": None,
               "parameters": {"type": "object"}, "strict": True}}]  # fmt: skip
    assert _chat(tokenizer, messages=[USER], tools=tools) == _vllm(
        tokenizer, [USER], tools=dumped, add_generation_prompt=True
    )
    assert template_tools_of(tools) == dumped
    assert template_tools_of(dumped) == dumped  # Anthropic's and Responses' tools stay


def test_reasoning_effort_reaches_the_template_with_enable_thinking(tmp_path: Path) -> None:
    """build_chat_params passes reasoning_effort, and enable_thinking = effort != "none"
    unless chat_template_kwargs sets it."""
    tokenizer = _templated(tmp_path)
    assert _chat(tokenizer, messages=[USER], reasoning_effort="none") == _vllm(
        tokenizer, [USER], add_generation_prompt=True, reasoning_effort="none",
        enable_thinking=False,
    )  # fmt: skip
    assert template_kwargs({"reasoning_effort": "low"})["enable_thinking"] is True
    kept = {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}
    assert template_kwargs(kept)["enable_thinking"] is True


def test_add_special_tokens_adds_the_bos_on_top_of_the_templates(tmp_path: Path) -> None:
    """vLLM renders the text, then encodes it with the request's add_special_tokens
    (default false for chat): true puts the tokenizer's BOS before the template's."""
    tokenizer = _templated(tmp_path, mistral=True)
    plain = _chat(tokenizer, messages=[USER])
    assert plain == _vllm(tokenizer, [USER], add_generation_prompt=True)
    added = _chat(tokenizer, messages=[USER], add_special_tokens=True)
    assert added == _vllm(tokenizer, [USER], special=True, add_generation_prompt=True)
    assert added == plain + 1  # type: ignore[operator]


def test_messages_no_template_renders_get_no_count_from_the_proxy(tmp_path: Path) -> None:
    """The joined texts are no prompt vLLM saw: the proxy's count (template_only) is
    None; the benchmark's prompt sizing keeps the joined count."""
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path)))
    assert not tokenizer.chat_template
    assert count_prompt(tokenizer, [USER], template_only=True) is None
    assert count_prompt(tokenizer, [USER]) == len(tokenizer.encode(USER["content"]))
    tokenizer.chat_template = "{{ raise_exception('no') }}"
    assert count_prompt(tokenizer, [USER], template_only=True) is None


def test_template_kwargs_merge_as_vllms_merge_kwargs() -> None:
    """Unset values (None, "auto") never override; chat_template_kwargs' tools win over
    the request's (ChatParams.with_defaults); the rendering is to a text."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    kwargs = template_kwargs({"tools": tools, "documents": None,
                              "chat_template_kwargs": {"tools": "mine", "x": "auto"}})  # fmt: skip
    assert kwargs == {"tools": "mine", "tokenize": False, "add_generation_prompt": True,
                      "continue_final_message": False, "return_dict": False}  # fmt: skip


def test_a_request_that_brings_its_own_chat_template_is_not_counted(tmp_path: Path) -> None:
    """A client's Jinja is never run in the proxy: a loop of its own could hold the one
    counting thread, and vLLM refuses such a request unless started with
    --trust-request-chat-template. Neither the field nor a chat_template_kwargs entry."""
    tokenizer = load_tokenizer(str(build_tiny_tokenizer(tmp_path)))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    # within the sandbox's range bound each, and 10**10 steps together
    looping = "{% for i in range(10**5) %}{% for j in range(10**5) %}x{% endfor %}{% endfor %}"
    harmless = "{% for m in messages %}{{ m['content'] }}!{% endfor %}"
    assert count_chat(tokenizer, messages, {}) is not None
    for own in (harmless, looping):
        assert count_chat(tokenizer, messages, {"chat_template": own}) is None
        assert (
            count_chat(tokenizer, messages, {"chat_template_kwargs": {"chat_template": own}})
            is None
        )
