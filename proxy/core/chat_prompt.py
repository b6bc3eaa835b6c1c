"""A request's messages as vLLM hands them to the chat template, for a tokenizer's count.

A tokenizer counts a chat prompt as the template renders it; the template must then see
what vLLM gives it, not the request as sent. vLLM flattens each message's content parts to
one text, the text parts joined by a newline ("string" content format:
vllm/renderers/chat_utils.py, _parse_chat_message_content_parts), and turns the other
APIs' items into chat messages first:

- Anthropic Messages (vllm/entrypoints/anthropic/serving.py, _convert_messages): text
  blocks are the content, `thinking` the assistant's `reasoning`, `tool_use` a tool call
  (arguments `json.dumps(input)`), a user's `tool_result` a `tool` message of its own
  (its text parts joined by a newline); the top-level `system` blocks are joined with
  nothing between them (_convert_system_message: done in Messages.prompt).
- Responses input items (vllm/entrypoints/openai/responses/utils.py,
  construct_chat_messages_with_tool_call): a `message` item is a message, a
  `function_call` an assistant tool call, a `function_call_output` a `tool` message.

Images and audio are left out: their tokens come from the model's processor, which a
tokenizer does not have. Every function here only reads; it never raises on odd input.

What the template then gets beside the messages is vLLM's too (`template_kwargs`): the
request's options merged as vLLM merges them, its tools as vLLM dumps them
(`template_tools_of`), and each assistant tool call's arguments as a dict
(`parsed_arguments`).
"""

from __future__ import annotations

import json
from typing import Any

from proxy.core.lax import lax_bool

#: The part types whose `text` is the content's text (OpenAI chat, Responses, Anthropic).
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def template_tools(tools: Any, schema: str, kind: str | None = None) -> dict[str, Any] | None:
    """A request's tools as the chat template gets them, OpenAI functions: what vLLM turns an
    Anthropic tool ({name, description, input_schema}: `schema` "input_schema") and a
    Responses function tool (`kind` "function", `schema` "parameters") into; None for none."""
    if not isinstance(tools, list):
        return None
    functions = [
        {"type": "function", "function": {"name": t.get("name"), "description":
         t.get("description"), "parameters": t.get(schema)}}
        for t in tools if isinstance(t, dict) and (kind is None or t.get("type") == kind)
    ]  # fmt: skip
    return {"tools": functions} if functions else None


def template_messages(prompt: list[Any]) -> list[dict[str, Any]]:
    """`prompt` (a request's messages or items, as the Api read them) as chat messages."""
    out: list[dict[str, Any]] = []
    for item in prompt:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = {"role": "tool", "content": item.get("output")}
            out.append({**output, "tool_call_id": item.get("call_id")})
        elif "role" in item:
            out.extend(_message(item))
    return out


def _message(item: dict[str, Any]) -> list[dict[str, Any]]:
    """One message, and the `tool` messages its Anthropic `tool_result` blocks become."""
    role, content = item.get("role"), item.get("content")
    message = {k: v for k, v in item.items() if k not in ("content", "type")}
    if not isinstance(content, list):  # vLLM's parts of none join to "" (chat_utils.py)
        return [{**message, "content": "" if content is None else content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = list(message.get("tool_calls") or [])
    reasoning: list[str] = []
    results: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "thinking" and isinstance(part.get("thinking"), str):
            reasoning.append(part["thinking"])
        elif kind == "tool_use":
            arguments = json.dumps(part.get("input") or {})
            calls.append({"id": part.get("id"), "type": "function", "function": {
                "name": part.get("name") or "", "arguments": arguments}})  # fmt: skip
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": part.get("tool_use_id") or "",
                            "content": _result_text(part.get("content"))})  # fmt: skip
        elif kind == "tool_result":
            texts.append(f"Tool result: {part.get('content') or ''}")
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if texts or not (calls or reasoning or results):
        message["content"] = "\n".join(texts)
    # vLLM leaves out a user message whose blocks were all tool results
    head = [] if role == "user" and "content" not in message else [message]
    return [*results, *head] if role == "user" else [*head, *results]


def _result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


#: The values vLLM's merge_kwargs takes for "not set" (vllm/renderers/params.py).
_UNSET = (None, "auto")


def _merge(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """vllm/renderers/params.py, merge_kwargs: `overrides` win, except where unset."""
    return defaults | {k: v for k, v in overrides.items() if v not in _UNSET}


def template_kwargs(template: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments vLLM gives `apply_chat_template` for a request whose template
    options (RequestInfo.template) are `template`, merged in vLLM's order:

    1. the request's own options over its `chat_template_kwargs`
       (chat_completion/protocol.py, ChatCompletionRequest.build_chat_params): so
       `add_generation_prompt` is the request field's (default true) even where
       chat_template_kwargs names it too, and a `reasoning_effort` also sets
       `enable_thinking` (effort != "none") unless chat_template_kwargs sets it;
    2. those over the tools and `tokenize: false` (renderers/online_renderer.py,
       preprocess_chat, then ChatParams.with_defaults): a chat_template_kwargs `tools`
       wins over the request's;
    3. `return_dict: false` over all (renderers/params.py,
       ChatParams.get_apply_chat_template_kwargs). A request's own `chat_template` is not
       rendered here (tokens.count_chat: such a prompt is not counted).

    vLLM then keeps only the names the template or apply_chat_template knows
    (renderers/hf.py, resolve_chat_template_kwargs); a name the template does not use
    renders nothing, so the rendered text is the same without that filter. The server's
    own --default-chat-template-kwargs are not known here."""
    given = template.get("chat_template_kwargs")
    user: dict[str, Any] = given if isinstance(given, dict) else {}
    effort = template.get("reasoning_effort")
    extra: dict[str, Any] = {
        "add_generation_prompt": _flag(template.get("add_generation_prompt"), True),
        "continue_final_message": _flag(template.get("continue_final_message"), False),
        "documents": template.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    merged = _merge(user, extra)
    merged = _merge({"tools": template_tools_of(template.get("tools")), "tokenize": False}, merged)
    return _merge(merged, {"return_dict": False})


def _flag(value: Any, default: bool) -> bool:
    """A bool request field as vLLM's pydantic reads it (absent or unreadable: `default`;
    vLLM answers an unreadable one 400, and such a request is not counted)."""
    read = lax_bool(value)
    return default if read is None else read


def template_tools_of(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as vLLM hands them to the template: each ChatCompletionToolsParam's
    `model_dump()` (renderers/online_renderer.py, render_chat). Its FunctionDefinition
    (generate/base/protocol.py) dumps name, description and parameters in that order, null
    where the request left them out, then `strict` and `defer_loading` only where set; a
    tool's own `defer_loading` is also its function's where that has none
    (chat_completion/protocol.py, _propagate_defer_loading). Idempotent: the tools of
    `template_tools` come out as they went in."""
    if not isinstance(tools, list):
        return None
    dumped: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            continue  # vLLM refuses the request (400): not counted
        defer = lax_bool(tool.get("defer_loading"))
        out = {k: function.get(k) for k in ("name", "description", "parameters")}
        strict = lax_bool(function.get("strict"))
        own = lax_bool(function.get("defer_loading"))
        if strict is not None:
            out["strict"] = strict
        if own is not None or defer is not None:
            out["defer_loading"] = own if own is not None else defer
        entry = {"type": "function", "function": out}
        dumped.append(entry if defer is None else {**entry, "defer_loading": defer})
    return dumped


def parsed_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each assistant tool call's `arguments` a dict, as vLLM gives them
    to the template (renderers/chat_utils.py, _postprocess_messages): a JSON text parsed,
    one that is empty, not JSON or not an object `{}`; an empty `tool_calls` left out.
    New dicts where anything changes: the request's own messages stay as they were."""
    out: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list):
            out.append(message)
        elif not calls:
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
        else:
            out.append({**message, "tool_calls": [_parsed_call(c) for c in calls]})
    return out


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call  # vLLM refuses the request (400): not counted
    return {**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}}


def _arguments(given: Any) -> dict[str, Any]:
    if not given:
        return {}
    parsed = given
    if isinstance(given, str):
        try:
            parsed = json.loads(given)
        except (ValueError, RecursionError):
            return {}
    return parsed if isinstance(parsed, dict) else {}
