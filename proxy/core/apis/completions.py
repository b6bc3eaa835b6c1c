"""OpenAI text completions, `POST /v1/completions`, as vLLM serves it.

The same stream as chat (proxy/core/apis/chat.py) with the generated text in
`choices[i].text` (vllm-project/vllm: vllm/entrypoints/openai/completion/serving.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proxy.core.apis.base import RequestInfo
from proxy.core.apis.chat import OpenAIGeneration, add_texts
from proxy.core.lax import lax_bool, lax_int

#: The most choices whose echoed prompts a request keeps; past it (vLLM refuses an `n`
#: over its --max-num-seqs, 1024 at most by default) a tokenizer's count keeps them in.
MAX_ECHOED = 4096


class Completions(OpenAIGeneration):
    endpoint = "/v1/completions"
    bench_name = "completions"
    paths = ("/v1/completions",)
    operation = "text_completion"
    text_openings = (b'"text":"',)
    # Ollama's OpenAI layer (ollama/ollama middleware/openai.go, CompleteWriter) puts
    # `"usage": {all zeros}` on every chunk once include_usage is set: asking would change
    # every chunk the client gets, so against an Ollama the proxy does not ask.
    usage_reshapes = frozenset({"ollama"})
    measures = (
        "TTFT at the first chunk with non-empty choices[].text; TPOT, ITL, decode speed, "
        "tokens from usage (asked for when the client did not), finish_reason, in-stream errors"
    )

    def prompt(self, obj: dict[str, Any]) -> Any:
        return obj.get("prompt")

    def max_tokens(self, obj: dict[str, Any]) -> object:
        """`max_tokens` alone: vLLM's CompletionRequest has no `max_completion_tokens`
        (completion/protocol.py; completion/serving.py limits by `request.max_tokens`) and
        ignores a field it does not have (serve/engine/protocol.py, OpenAIBaseModel), so
        chat's rule would log a limit vLLM never applied. A null or absent one is no limit
        the client asked for (vLLM then applies its default, 16; llama-server none), so
        none is logged."""
        return obj.get("max_tokens")

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        """With `echo`, each choice's text begins with its prompt: vLLM sends
        `prompt_text + output.text` in a choice's first chunk (its whole text when not
        streamed), for choice `i = output.index + prompt_idx * n`, and no prompt text when
        `return_token_ids` is set (completion/serving.py). The prompts are kept by choice
        so that a tokenizer's count of the output can leave them out."""
        info = super().read_request(obj)
        if lax_bool(obj.get("echo")) is not True or lax_bool(obj.get("return_token_ids")):
            return info
        prompt = info.prompt
        many = type(prompt) is list and bool(prompt) and all(type(p) is not int for p in prompt)
        prompts = prompt if many else [prompt]
        n = lax_int(obj.get("n"))
        each = n if n is not None and n > 0 else 1
        if each * len(prompts) > MAX_ECHOED:  # a client's n = 2**70 would fill the memory
            return info
        return replace(info, echoed=tuple(p for p in prompts for _ in range(each)))

    def ask_for_usage(self, obj: dict[str, Any], body: bytes) -> bytes | None:
        """As chat's (OpenAIGeneration.ask_for_usage), and not for a batch of prompts:
        vLLM streams a choice for each (`i = output.index + prompt_idx * num_choices`,
        completion/serving.py) and stamps every one's terminal chunk, as with n > 1."""
        if batch_of_prompts(obj.get("prompt")):
            return None
        return super().ask_for_usage(obj, body)

    def input_messages(self, prompt: Any) -> list[dict[str, Any]] | None:
        """A text prompt (or a batch of them): one user message per text."""
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return None
        return [{"role": "user", "parts": [{"type": "text", "content": t}]} for t in texts]

    def _content(self, choice: dict[str, Any], texts: list[str] | None) -> str | None:
        text = choice.get("text")
        if not text:
            return None
        if texts is not None:
            add_texts(texts, text)
        return "text"

    def _held(self, choice: dict[str, Any]) -> bool:
        """An empty `text`: vLLM streams one for every engine output whose text it holds
        back or that has none (completion/serving.py: `delta_text = output.text`, and a
        step is skipped only when it has no text, no token and no previous token). A
        finish with an empty text is vLLM's only with `stop_reason`, which vLLM passes on
        every chunk (`stop_reason=stop_reason`); OpenAI's and llama-server's finish in a
        chunk of its own (`"text": ""`, no `stop_reason`) is no token."""
        if type(choice.get("text")) is not str:
            return False
        return choice.get("finish_reason") is None or "stop_reason" in choice


def batch_of_prompts(prompt: Any) -> bool:
    """More than one prompt: a list of texts or of token-id lists (a list of token ids is
    one prompt)."""
    return type(prompt) is list and len(prompt) > 1 and any(type(p) is not int for p in prompt)
