"""OpenAI Responses, `POST /v1/responses`, as vLLM serves it.

Wire facts (vllm-project/vllm: vllm/entrypoints/openai/responses/serving.py,
simple_streaming_events.py, streaming_events.py; types from openai/openai-python
src/openai/types/responses/): each event is `event: <type>` plus `data: {"type": ...}`.
A stream opens with `response.created` and `response.in_progress` (the response object
with id and model), then per output item `response.output_item.added`,
`response.content_part.added`, deltas, and the matching `.done` events. Generated content
is the `delta` string of `response.output_text.delta`, `response.reasoning_text.delta`,
`response.reasoning_summary_text.delta` or `response.function_call_arguments.delta`.
The stream ends with `response.completed` or `response.incomplete` (the response object
with `status`, `incomplete_details.reason` and `usage`: input_tokens, output_tokens,
input_tokens_details.cached_tokens and .cache_write_tokens) or `response.failed`
(`response.error`); an `error` event carries code and message.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proxy.core.apis.base import (
    MALFORMED,
    NOTHING,
    Api,
    Facts,
    RequestInfo,
    TokenCounts,
    as_int,
    identity,
    json_object,
    request_info,
    sampling_options,
)
from proxy.core.apis.chat import keep
from proxy.core.chat_prompt import responses_template
from proxy.core.lax import lax_bool
from proxy.core.measurement import NONE_LABEL, TokenSource
from proxy.core.toolcalls import CallPiece

_DELTAS = {
    "response.output_text.delta": "text",
    "response.reasoning_text.delta": "reasoning",
    "response.reasoning_summary_text.delta": "reasoning",
    "response.function_call_arguments.delta": "tool",
    # a built-in tool's input, written by the model (harmony models: vLLM's
    # entrypoints/openai/responses/serving.py and streaming_events.py emit both): tool
    # content, though no function call whose outcome is counted
    "response.code_interpreter_call_code.delta": "tool",
    "response.mcp_call_arguments.delta": "tool",
}
_CALL_ARGUMENTS = "response.function_call_arguments.delta"
#: A summary of the reasoning (OpenAI's `reasoning.summary`; vLLM 0.32 writes none, its
#: items' `summary` is always [], openai/responses/utils.py): evidence that the model
#: reasoned, but not the reasoning's text, so its text is kept neither as the reasoning nor
#: as output (a whole answer's summary parts are neither, `_whole`, `_output_texts`).
_SUMMARY = "response.reasoning_summary_text.delta"
_IDENTIFYING = frozenset({"response.created", "response.in_progress"})
_ENDS = frozenset({"response.completed", "response.incomplete"})
#: status, or incomplete_details.reason -> finish_reason label (anything else: "other").
FINISH = {
    "completed": "stop",
    "max_output_tokens": "length",
    "content_filter": "content_filter",
    "failed": "error",
    "cancelled": "abort",
    # `background: true` without a stream: vLLM answers at once with the response queued
    # and generates later (openai/responses/serving.py); nothing has finished, so no finish
    # reason ("none"; the raw status stays in the record), and no tokens yet
    "queued": NONE_LABEL,
    "in_progress": NONE_LABEL,
}


class Responses(Api):
    endpoint = "/v1/responses"
    bench_name = "responses"
    paths = ("/v1/responses",)
    operation = "chat"
    end_marker = "response.completed or response.incomplete"
    measures = (
        "TTFT at the first non-empty output_text, reasoning_text, reasoning_summary_text, "
        "function_call_arguments, code_interpreter_call_code or mcp_call_arguments delta, "
        "or a function_call output_item.added (not "
        "response.created, in_progress or a message item's output_item.added); the first "
        "answer at the first output_text delta; TPOT, ITL, decode speed; tokens and status "
        "from response.completed / response.incomplete; response.failed and error events"
    )

    def max_tokens(self, obj: dict[str, Any]) -> object:
        return obj.get("max_output_tokens")

    def prompt(self, obj: dict[str, Any]) -> Any:
        """The input, after `instructions` as a system message, as vLLM builds the prompt
        (responses/utils.py, construct_input_messages: the instructions first, then a text
        input as a user message, or the input's items)."""
        given = obj.get("input")
        if isinstance(given, str):  # with instructions or without: a user message
            given = [{"role": "user", "content": given}]
        instructions = obj.get("instructions")
        if not instructions or not isinstance(instructions, str):
            return given
        if isinstance(given, list):
            return [{"role": "system", "content": instructions}, *given]
        return given

    def template(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The function tools, as vLLM gives them to the template (an OpenAI function), the
        `chat_template_kwargs` and `reasoning.effort` (chat_prompt.responses_template)."""
        return responses_template(obj)

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        # `previous_response_id` names the stored response this one continues (openai-python
        # src/openai/types/responses/response_create_params.py): a conversation's next turn.
        # The output type from `text.format`, no `n`, the other options as chat's
        # (vllm/entrypoints/openai/responses/protocol.py, ResponsesRequest: top_p, top_k,
        # seed, stop, presence_penalty, frequency_penalty); `instructions`, the system
        # instructions apart from the input.
        previous, text = obj.get("previous_response_id"), obj.get("text")
        instructions = obj.get("instructions")
        info = request_info(
            self,
            obj,
            sampling_options(
                obj, output=text.get("format") if isinstance(text, dict) else None, choices=False
            ),
            instructions if instructions and isinstance(instructions, str) else None,
            previous if isinstance(previous, str) else None,
        )
        if lax_bool(obj.get("background")) is True:
            # streamed or not, vLLM generates in a task of its own (serving.py:537-589)
            return replace(info, detached=True)
        return info

    def bench_body(
        self, model: str, prompt: Any, max_tokens: int, ignore_eos: bool
    ) -> dict[str, Any]:
        return {
            "model": model,
            "input": prompt,
            "max_output_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }

    def event(self, payload: bytes, collect: bool, identify: bool) -> Facts:
        obj = json_object(payload)
        if obj is None:
            return MALFORMED
        kind = obj.get("type")
        try:
            content = _DELTAS.get(kind)  # type: ignore[arg-type]
        except TypeError:  # a `type` that is an object or a list: no event of ours
            return NOTHING
        if content is not None:
            delta = obj.get("delta")
            if not delta or type(delta) is not str:
                return NOTHING
            facts = Facts(content=content)
            if kind == _CALL_ARGUMENTS:  # only tool-call streams pay for this
                facts.calls = (CallPiece(_index(obj), False, delta),)
            if collect and kind != _SUMMARY:
                keep(facts, delta)
            return facts
        if kind == "response.output_item.added" or kind == "response.output_item.done":
            item = obj.get("item")
            if type(item) is dict and item.get("type") == "function_call":
                # added: the call's first delta (its name); done: its arguments are whole
                if kind == "response.output_item.done":
                    return Facts(calls=(CallPiece(_index(obj), False, "", closes=True),))
                return Facts(content="tool", calls=(CallPiece(_index(obj), True, ""),))
            return NOTHING
        if kind == "response.function_call_arguments.done":
            return Facts(calls=(CallPiece(_index(obj), False, "", closes=True),))
        if kind in _IDENTIFYING:
            response = obj.get("response")
            return Facts(**identity(response)) if identify and type(response) is dict else NOTHING
        if kind in _ENDS:
            response = obj.get("response")
            facts = self._ended(response) if type(response) is dict else Facts()
            if facts.timings is None:
                # llama-server puts its timings beside the response, not in it (seen on
                # build b1-0c1e570: `{"type": "response.completed", "response": {...},
                # "timings": {...}}`), as on a chat stream's last chunk
                facts.timings = obj.get("timings")
            facts.end = True
            return facts
        if kind == "response.failed":
            response = obj.get("response")
            error = response.get("error") if type(response) is dict else None
            usage = response.get("usage") if type(response) is dict else None
            # A failed response still says what it used, when it got that far.
            return Facts(
                error=error or obj, finish="failed", usage=usage if type(usage) is dict else None
            )
        if kind == "error":
            return Facts(error=obj)
        return NOTHING

    def _ended(self, obj: dict[str, Any]) -> Facts:
        """A response object's usage, identity and finish: a stream's last event's, or a
        body's (whose output items a stream has already delivered as events)."""
        facts = super().body(obj, collect=False)
        status = obj.get("status")
        details = obj.get("incomplete_details")
        reason = details.get("reason") if type(details) is dict else None
        if type(reason) is str:
            facts.finish = reason
        elif type(status) is str:
            facts.finish = status
        return facts

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        facts = self._ended(obj)
        _whole(facts, obj.get("output"))
        if collect:
            text = obj.get("output_text")  # the SDK's convenience field, when present
            if type(text) is str:
                keep(facts, text)
            else:
                _output_texts(obj.get("output"), facts)
        return facts

    def answered(self, obj: dict[str, Any]) -> bool:
        """A `message` output item has a part with text (vLLM's reasoning is an item of
        its own, openai/responses/utils.py build_response_output_items)."""
        output = obj.get("output")
        for item in output if type(output) is list else ():
            if type(item) is dict and item.get("type") == "message":
                for part in _list(item.get("content")):
                    if type(part) is dict and part.get("text"):
                        return True
        return False

    def finish_label(self, raw: str) -> str:
        return FINISH.get(raw, "other")

    def reasoning_tokens(self, usage: dict[str, Any]) -> int | None:
        details = usage.get("output_tokens_details")
        return as_int(details.get("reasoning_tokens")) if type(details) is dict else None

    def counts(self, usage: dict[str, Any]) -> TokenCounts | None:
        output = as_int(usage.get("output_tokens"))
        if output is None:
            return None
        # vLLM 0.32 always writes both details (0 for none): InputTokensDetails
        # {cached_tokens, cache_write_tokens, ...} (responses/protocol.py, serving.py)
        details = usage.get("input_tokens_details")
        if type(details) is not dict:
            details = {}
        return TokenCounts(
            prompt=as_int(usage.get("input_tokens")),
            output=output,
            cached=as_int(details.get("cached_tokens")),
            source=TokenSource.USAGE,
            cache_write=as_int(details.get("cache_write_tokens")),
        )


def _index(obj: dict[str, Any]) -> int:
    index = obj.get("output_index", 0)
    return index if type(index) is int else 0


def _whole(facts: Facts, output: object) -> None:
    """A whole answer's reasoning (for a tokenizer to count) and each function call whole,
    judged as a stream's are: vLLM's non-streaming output is a `reasoning` item (its
    `reasoning_text` parts), a `message`, then a `function_call` item per call with its
    `arguments` as text (openai/responses/utils.py, build_response_output_items).

    The reasoning is given as text only where it is all there: an empty list (it reasoned,
    none of its text kept) where a reasoning item has a summary in place of its text
    (OpenAI's shape: a summary is not the reasoning usage counts), or where a built-in
    tool's item (code interpreter, browser, MCP) holds text a harmony model wrote to a
    recipient, which vLLM counts as reasoning (vllm/parser/harmony.py,
    `_is_reasoning_token`) and puts in that item (responses/harmony.py,
    harmony_to_response_output). Part of the text would bound the count too low
    (StreamObserver.reasoning_ceiling)."""
    if type(output) is not list:
        return
    calls = []
    texts: list[str] = []
    reasoned = untold = False
    for index, item in enumerate(output):
        kind = item.get("type") if type(item) is dict else None
        if kind == "function_call":
            arguments = item.get("arguments")
            given = arguments if type(arguments) is str else ""
            calls.append(CallPiece(index, True, given, closes=True))
        elif kind == "reasoning":
            own, summary = _texts(item.get("content")), _texts(item.get("summary"))
            reasoned = reasoned or bool(own or summary)
            untold = untold or bool(summary and not own)
            texts += own
        elif kind != "message" and type(kind) is str:
            untold = True
    if reasoned:
        facts.reasoning = [] if untold else texts
    if calls:
        facts.calls = tuple(calls)


def _texts(parts: object) -> list[str]:
    """The texts of a reasoning item's `content` or `summary` parts."""
    found = (part.get("text") if type(part) is dict else None for part in _list(parts))
    return [text for text in found if text and type(text) is str]


def _list(value: object) -> list[Any]:
    return value if type(value) is list else []


def _output_texts(output: object, facts: Facts) -> None:
    if type(output) is not list:
        return
    for item in output:
        parts = item.get("content") if type(item) is dict else None
        if type(parts) is list:
            for part in parts:
                text = part.get("text") if type(part) is dict else None
                if type(text) is str:
                    keep(facts, text)
