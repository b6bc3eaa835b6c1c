"""vLLM's token-in/token-out generate, `POST /inference/v1/generate`.

Wire facts (vllm-project/vllm: vllm/entrypoints/scale_out/token_in_token_out/serving.py
and protocol.py, served with `--enable-scale-out` or `--tokens-only`): the request sends
`token_ids` (the prompt, already tokenized) and `sampling_params` (`max_tokens`,
`temperature`, ...), `stream` and `stream_options`. A streamed chunk is
`data: {"request_id", "usage": null, "output_mode": "tokens", "choices": [{"index",
"finish_reason", "stop_reason", "token_ids": [...], ...}]}`: each chunk's `token_ids` are
exactly the tokens generated since the last one (vLLM skips outputs with none), the last
one carries the finish reason, then `data: [DONE]`. A usage chunk (`"choices": []`) comes
only with `stream_options.include_usage`; an error after the 200 is `data: {"error": ...}`.
Not streamed: one body with `usage` and the choices' whole `token_ids`.

So the proxy never needs to ask for usage here: output tokens are the sum of the streamed
`token_ids` lengths (token source `token_ids`) and the prompt is `len(token_ids)`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from proxy.core.apis.base import END, MALFORMED, NOTHING, Facts, RequestInfo, json_object
from proxy.core.apis.chat import OpenAIGeneration
from proxy.core.lax import lax_bool


class Generate(OpenAIGeneration):
    endpoint = "/inference/v1/generate"
    bench_name = "generate"
    paths = ("/inference/v1/generate",)
    operation = "text_completion"
    provider: ClassVar[str] = "vllm"
    measures = (
        "TTFT at the first chunk with non-empty choices[].token_ids; TPOT, ITL, decode "
        "speed; output tokens exactly from the streamed token_ids (source token_ids) unless "
        "the client asked for usage, prompt tokens = len(token_ids); finish_reason, "
        "in-stream errors"
    )

    def bench_body(
        self, model: str, prompt: Any, max_tokens: int, ignore_eos: bool
    ) -> dict[str, Any]:
        # Token ids in: the prompt's UTF-8 bytes, ids every vocabulary has. The output is
        # counted exactly from the ids streamed back, so no usage is asked for.
        params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0}
        if ignore_eos:
            params["ignore_eos"] = True
        ids = list(str(prompt).encode())
        return {"model": model, "token_ids": ids, "sampling_params": params, "stream": True}

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        params = obj.get("sampling_params")
        info = super().read_request(params if type(params) is dict else {})
        ids = obj.get("token_ids")
        model = obj.get("model")
        return RequestInfo(
            endpoint=self.endpoint,
            model=model if isinstance(model, str) else "",
            stream=lax_bool(obj.get("stream")) is True,
            usage_requested=self.usage_requested(obj),
            max_tokens=info.max_tokens,
            temperature=info.temperature,
            prompt=ids,
            prompt_tokens=len(ids) if type(ids) is list else None,
        )

    def max_tokens(self, obj: dict[str, Any]) -> object:
        return obj.get("max_tokens")

    def ask_for_usage(self, obj: dict[str, Any], body: bytes) -> bytes | None:
        return None  # token_ids count the output exactly: the request goes as it came

    def event(self, payload: bytes, collect: bool, identify: bool) -> Facts:
        if payload == b"[DONE]":
            return END
        obj = json_object(payload)
        if obj is None:
            return MALFORMED
        facts = Facts()
        choices = obj.get("choices")
        if type(choices) is list:
            indices: list[int] = []
            for choice in choices:
                if type(choice) is not dict:
                    continue
                ids = choice.get("token_ids")
                if type(ids) is list and ids:
                    facts.tokens += len(ids)
                    index = choice.get("index", 0)
                    indices.append(index if type(index) is int else 0)
                reason = choice.get("finish_reason")
                if reason and type(reason) is str:  # with n > 1 each choice finishes alone
                    index = choice.get("index", 0)
                    facts.finish, facts.finish_choice = reason, index if type(index) is int else 0
            if indices:
                facts.content, facts.choices = "text", tuple(indices)
        usage = obj.get("usage")
        if usage and type(usage) is dict:
            facts.usage = usage
        facts.error = obj.get("error")
        if identify:
            rid = obj.get("request_id")
            facts.response_id = rid if type(rid) is str else ""
        quiet = facts.content is None and facts.finish is None and facts.usage is None
        return NOTHING if quiet and facts.error is None and not identify else facts

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        facts = super().body(obj, collect=False)
        rid = obj.get("request_id")
        facts.response_id = rid if type(rid) is str else ""
        return facts
