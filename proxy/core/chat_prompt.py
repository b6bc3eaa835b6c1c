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
"""

from __future__ import annotations

import json
from typing import Any

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
