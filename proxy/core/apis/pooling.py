"""Non-generative APIs: embeddings and vLLM's pooling, score, rerank and classify routes.

They answer one JSON body with a `usage` object (`prompt_tokens`, `total_tokens`), so what
is measured is e2e latency, prompt tokens, the error type and the model (vllm-project/vllm:
vllm/entrypoints/openai/api_server.py and vllm/entrypoints/pooling/*: `/v1/embeddings`,
`/pooling`, `/classify` (and `/v1/classify`), `/score` with its older alias `/v1/score`, `/rerank` with
`/v1/rerank` and `/v2/rerank`). The rerank answer may carry only `total_tokens`, which for
a model that generates nothing is the prompt.
"""

from __future__ import annotations

from typing import Any, ClassVar

from proxy.core.apis.base import Api, TokenCounts, as_int
from proxy.core.measurement import TokenSource


class Pooling(Api):
    generative: ClassVar[bool] = False
    endpoint = "/pooling"
    paths: ClassVar[tuple[str, ...]] = ("/pooling",)
    operation = "embeddings"
    measures = "e2e latency, prompt tokens from usage, error type"

    def counts(self, usage: dict[str, Any]) -> TokenCounts | None:
        prompt = as_int(usage.get("prompt_tokens"))
        if prompt is None:
            prompt = as_int(usage.get("total_tokens"))
        if prompt is None:
            return None
        return TokenCounts(prompt=prompt, output=None, cached=None, source=TokenSource.USAGE)


class Embeddings(Pooling):
    endpoint = "/v1/embeddings"
    bench_name = "embeddings"
    paths = ("/v1/embeddings",)

    def bench_body(
        self, model: str, prompt: Any, max_tokens: int, ignore_eos: bool
    ) -> dict[str, Any]:
        return {"model": model, "input": prompt}


class Score(Pooling):
    endpoint = "/score"
    paths: ClassVar[tuple[str, ...]] = ("/score", "/v1/score")
    operation = "score"

    def prompt(self, obj: dict[str, Any]) -> Any:
        return None


class Rerank(Score):
    endpoint = "/rerank"
    paths = ("/rerank", "/v1/rerank", "/v2/rerank")
    operation = "rerank"


class Classify(Pooling):
    endpoint = "/classify"
    paths: ClassVar[tuple[str, ...]] = ("/classify", "/v1/classify")
    operation = "classify"
