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
  `responses_messages` builds them as vLLM does, calls and reasoning joining the
  assistant message before them, and `responses_options` adds the options vLLM renders
  and encodes a Responses prompt with.

Images and audio are left out: their tokens come from the model's processor, which a
tokenizer does not have. Every function here only reads; it never raises on odd input.

A system message's text that opens with Claude Code's billing header loses that line
(`without_billing_line`), as vLLM drops it from every system message before the template.

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

#: What Claude Code's attribution line opens with: `x-anthropic-billing-header:
#: cc_version=...; cc_entrypoint=...; cch=<hex>;`, the first system block of every request,
#: its `cch` new each time (vllm/renderers/chat_utils.py, _CLAUDE_CODE_BILLING_HEADER).
BILLING_HEADER = "x-anthropic-billing-header"


def without_billing_line(content: Any) -> Any:
    """A system message's content without Claude Code's billing line, as vLLM gives it to
    the template (vllm/renderers/chat_utils.py, _strip_claude_code_billing_header, which
    _parse_chat_message_content runs on every `system` message of chat, of Anthropic
    Messages once converted, and of the Responses API's messages): each text (the content
    as a string, a string part or a `text` part; not Responses' `input_text`) that opens
    with BILLING_HEADER loses its first line, and goes where nothing follows it. Its `cch`
    changes every request, so a prompt that kept it would be a new prompt every turn: vLLM
    drops it for its prefix cache, and so must a conversation's digests and a count. The
    content itself where nothing changes; a new string or list otherwise."""
    if isinstance(content, str):
        # vLLM makes a string one text part; none left joins to "" (its parts joined).
        return content.partition("\n")[2] if content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list):
        return content
    out: list[Any] = []
    changed = False
    for part in content:
        text = part if isinstance(part, str) else _text_part(part)
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        changed = True
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out if changed else content


def _text_part(part: Any) -> Any:
    return part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None


def template_tools(tools: Any, schema: str, kind: str | None = None) -> dict[str, Any] | None:
    """A request's tools as the chat template gets them, OpenAI functions: what vLLM turns an
    Anthropic tool ({name, description, input_schema}: `schema` "input_schema") and a
    Responses request's tools (`kind` "function": `responses_tools`) into; None for none."""
    if not isinstance(tools, list):
        return None
    if kind == "function":
        functions = responses_tools(tools)
    else:
        functions = [
            {"type": "function", "function": {"name": t.get("name"), "description":
             t.get("description"), "parameters": t.get(schema)}}
            for t in tools if isinstance(t, dict) and (kind is None or t.get("type") == kind)
        ]  # fmt: skip
    return {"tools": functions} if functions else None


#: The one string parameter a Responses `custom` tool is shown with
#: (vllm/tool_parsers/utils.py:45-57, custom_tool_parameters).
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": ["input"],
    "additionalProperties": False,
}


def responses_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """A Responses request's tools as vLLM shows them to the template
    (responses/utils.py:489-499, construct_tool_dicts): the function tools the model can
    call, in order (tool_parsers/utils.py:212-243, get_function_tools): a `function` tool;
    each function of a `namespace` tool, named `<namespace>__<name>`; a `custom` tool as a
    function of one string `input`. Others (web search, MCP...) are not shown. Each is a
    FunctionDefinition's dump (responses/utils.py:474-486; generate/base/protocol.py:298-313):
    name, description and parameters, then `strict` and `defer_loading` where set."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if kind == "function":
            out.extend(_function(tool, tool.get("name")))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            for inner in tool["tools"]:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    out.extend(_function(inner, f"{tool.get('name')}__{inner.get('name')}"))
        elif kind == "custom":
            function = {"name": tool.get("name"), "description": tool.get("description"),
                        "parameters": _CUSTOM_PARAMETERS}  # fmt: skip
            out.append({"type": "function", "function": function})
    return out


def _function(tool: dict[str, Any], name: Any) -> list[dict[str, Any]]:
    """A Responses function tool as the template's OpenAI function; none where it has no
    name (vLLM reads it as another tool type, or refuses the request)."""
    if not isinstance(tool.get("name"), str):
        return []
    function = {"name": name, "description": tool.get("description"),
                "parameters": tool.get("parameters")}  # fmt: skip
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return [{"type": "function", "function": function}]


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
        elif item.get("role") == "system":
            out.extend(_message({**item, "content": without_billing_line(item.get("content"))}))
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


def responses_messages(prompt: list[Any]) -> list[dict[str, Any]] | None:
    """A Responses prompt (Responses.prompt: `instructions` as a system message, then a
    text input as a user message or the input's items, as construct_input_messages builds
    it: responses/utils.py:248-290) as the chat messages vLLM makes of its items
    (responses/utils.py:293-442, construct_chat_messages_with_tool_call and
    _construct_message_from_response_item), `prev` being the message before when that is
    the assistant's:

    - a `function_call` is a tool call (a `namespace`'s named `<namespace>__<name>`), a
      `custom_tool_call` one whose arguments are `{"input": ...}` as JSON: added to
      `prev`'s tool calls, else an assistant message of its own (:323-370);
    - a `reasoning` item is its first content text, else its first summary text: `prev`'s
      reasoning where it has none, else an assistant message of its own (:371-397); one
      with `encrypted_content` is refused (400);
    - an assistant `message` is its text, a string or its first part's: `prev`'s content
      where it has none, else a message of its own (:398-408, :422-435);
    - a `function_call_output` or `custom_tool_call_output` is a `tool` message (:409-421);
    - any other item with a role is the message as it is (:436-437); one without is refused
      (400: "Unsupported input item type").

    vLLM then gives an assistant message's reasoning to the template under both its names
    (renderers/chat_utils.py:2109-2114). None where vLLM refuses the input. The prompt's
    items are not changed."""
    out: list[dict[str, Any]] = []
    for item in prompt:
        if not isinstance(item, dict):
            return None
        kind = item.get("type")
        prev = out[-1] if out and out[-1].get("role") == "assistant" else None
        if kind in ("function_call", "custom_tool_call"):
            call = _response_call(item)
            if call is None:
                return None
            calls = prev.get("tool_calls") if prev is not None else None
            if prev is not None and (calls is None or isinstance(calls, list)):
                prev["tool_calls"] = [*(calls or ()), call]
            else:
                out.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                return None
            reasoning = _first_text(item.get("content"))
            if reasoning is None:
                reasoning = _first_text(item.get("summary"))
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = reasoning or ""
            else:
                out.append({"role": "assistant", "reasoning": reasoning or ""})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "content": item.get("output"),
                        "tool_call_id": item.get("call_id")})  # fmt: skip
        elif item.get("role") == "assistant" and (text := _said(item.get("content"))) is not None:
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                out.append({"role": "assistant", "content": text})
        elif "role" in item:
            out.append(dict(item))  # a copy: a later call or reasoning may join it
        else:
            return None
    for message in out:
        if message.get("role") == "assistant" and message.get("reasoning") is not None:
            message["reasoning_content"] = message["reasoning"]
    return out


def _response_call(item: dict[str, Any]) -> dict[str, Any] | None:
    """A call item as the tool call vLLM makes of it; None for a custom call whose input is
    no text (vLLM refuses it: 400)."""
    name, namespace = item.get("name"), item.get("namespace")
    if item.get("type") == "custom_tool_call":
        payload = item.get("input") or ""
        if not isinstance(payload, str):
            return None
        arguments: Any = json.dumps({"input": payload}, ensure_ascii=False)
    else:
        arguments = item.get("arguments")
        if namespace:
            name = f"{namespace}__{name}"
    return {"id": item.get("call_id"), "function": {"name": name, "arguments": arguments},
            "type": "function"}  # fmt: skip


def _first_text(parts: Any) -> str | None:
    """The text of the first of `parts` (a reasoning item's content or summary, an
    assistant item's content), None where it has none."""
    if not isinstance(parts, list) or not parts or not isinstance(parts[0], dict):
        return None
    text = parts[0].get("text")
    return text if isinstance(text, str) else None


def _said(content: Any) -> str | None:
    """An assistant item's text as vLLM takes it: the string, or its first part's text."""
    return content if isinstance(content, str) else _first_text(content)


def responses_options(prompt: list[Any], template: dict[str, Any] | None) -> dict[str, Any]:
    """A Responses request's template options (`template`: its tools, and where it has them
    its chat_template_kwargs and reasoning_effort) with those vLLM takes from its input
    and its API rather than from fields of the request:

    - `continue_final_message` where the last input item is a `message` or `reasoning`
      whose status is in_progress or incomplete, and then no `add_generation_prompt`
      (responses/protocol.py:420-458, build_chat_params; responses/utils.py:201-245,
      should_continue_final_message);
    - `add_special_tokens` true: a Responses prompt is encoded with the tokenizer's own
      special tokens added, BOS included, over what the template wrote
      (responses/protocol.py:460-467, build_tok_params, leaves TokenizeParams'
      add_special_tokens at its default, renderers/params.py:183; chat's is false)."""
    last = prompt[-1] if prompt else None
    continues = (
        isinstance(last, dict)
        and last.get("type", "message") in ("message", "reasoning")
        and last.get("status") in ("in_progress", "incomplete")
    )
    return {
        **(template or {}),
        "add_generation_prompt": not continues,
        "continue_final_message": continues,
        "add_special_tokens": True,
    }


def responses_template(obj: dict[str, Any]) -> dict[str, Any] | None:
    """A Responses request's own template options, in the names `template_kwargs` reads:
    its tools (`template_tools`), its `chat_template_kwargs`, and `reasoning.effort` as
    `reasoning_effort` (merged as chat's are, also setting `enable_thinking`: vLLM's
    ResponsesRequest.build_chat_params, responses/protocol.py:420-458, merges them as
    ChatCompletionRequest.build_chat_params does). What Responses.template should answer
    (proxy/core/apis/responses.py), so that a count has them; None without any."""
    found: dict[str, Any] = template_tools(obj.get("tools"), "parameters", "function") or {}
    if obj.get("chat_template_kwargs") is not None:
        found["chat_template_kwargs"] = obj["chat_template_kwargs"]
    reasoning = obj.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if effort is not None:
        found["reasoning_effort"] = effort
    return found or None


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
