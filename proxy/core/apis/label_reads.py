"""vLLM's label reads: `POST /generative_scoring` and `POST /v1/systemone`.

Both run the engine for one token per read and answer the logprobs of chosen label
tokens as one JSON body, never a stream (vllm/entrypoints/generate/label_reads.py,
next_token_label_reads: `max_tokens=1` per read). So they are measured as non-streamed
generations: e2e latency, prompt and output tokens from `usage`, error type.

Wire facts (vLLM 0.32):
- `/generative_scoring` (generate/generative_scoring/serving.py): a `query` and its
  `items`, one read per item; the answer's `usage` is OpenAI's UsageInfo, every item's
  prompt tokens and output tokens summed (`prompt_tokens`, `completion_tokens`,
  `total_tokens`, serving.py:314-353).
- `/v1/systemone` (generate/structured_decisions/): a `state` and its `questions`, one read
  per question, its answer's `usage` a DecisionUsage of `input_tokens` and `output_tokens`
  (protocol.py:64-85, serving.py:130-136).
Neither request has `stream` or `max_tokens`; their prompts are built by vLLM from parts
(items after or before the query, a chat template around state and question), so no
prompt is handed to a tokenizer: the usage counts them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from proxy.core.apis.base import Api, RequestInfo, TokenCounts, as_int, request_info
from proxy.core.measurement import TokenSource


class GenerativeScoring(Api):
    endpoint = "/generative_scoring"
    paths: ClassVar[tuple[str, ...]] = ("/generative_scoring",)
    operation = "score"
    measures = (
        "never streamed: e2e latency, prompt and output tokens from usage (every item's "
        "one-token read together), error type"
    )

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        """No sampling options (vLLM sets them: one token, the labels' logprobs), and
        never a stream: its request model has no `stream`, so one is ignored."""
        info = request_info(self, obj, None)
        return replace(info, stream=False) if info.stream else info

    def prompt(self, obj: dict[str, Any]) -> Any:
        return None

    def max_tokens(self, obj: dict[str, Any]) -> object:
        return None


class StructuredDecisions(GenerativeScoring):
    endpoint = "/v1/systemone"
    paths = ("/v1/systemone",)
    operation = "chat"
    measures = (
        "never streamed: e2e latency, prompt and output tokens from usage.input_tokens "
        "and usage.output_tokens (every question's one-token read together), error type"
    )

    def counts(self, usage: dict[str, Any]) -> TokenCounts | None:
        output = as_int(usage.get("output_tokens"))
        if output is None:
            return None
        prompt = as_int(usage.get("input_tokens"))
        return TokenCounts(prompt=prompt, output=output, cached=None, source=TokenSource.USAGE)
