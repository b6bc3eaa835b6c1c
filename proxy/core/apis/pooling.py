"""Non-generative APIs: embeddings and vLLM's pooling, score, rerank and classify routes.

They answer one JSON body with a `usage` object (`prompt_tokens`, `total_tokens`), so what
is measured is e2e latency, prompt tokens, the error type and the model (vllm-project/vllm:
vllm/entrypoints/openai/api_server.py and vllm/entrypoints/pooling/*: `/v1/embeddings`,
`/pooling`, `/classify` (and `/v1/classify`), `/score` with its older alias `/v1/score`, `/rerank` with
`/v1/rerank` and `/v2/rerank`). The rerank answer may carry only `total_tokens`, which for
a model that generates nothing is the prompt. vLLM's Cohere-style `/v2/embed` says its
count in `meta.billed_units` instead (vllm/entrypoints/pooling/embed/protocol.py,
`CohereEmbedResponse`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from proxy.core.apis.base import Api, Facts, TokenCounts, as_int, identity
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


#: llama-server serves its rerank handler under two more names (tools/server/server.cpp:
#: /reranking and /v1/reranking beside /rerank and /v1/rerank); vLLM 0.32 has neither (a
#: 404): measured only where the backend may be llama-server (apis/__init__.py
#: `LLAMACPP_PATHS`).
RERANKING = ("/reranking", "/v1/reranking")


class Rerank(Score):
    endpoint = "/rerank"
    paths = ("/rerank", "/v1/rerank", "/v2/rerank", *RERANKING)
    operation = "rerank"


class Classify(Pooling):
    endpoint = "/classify"
    paths: ClassVar[tuple[str, ...]] = ("/classify", "/v1/classify")
    operation = "classify"


class CohereEmbed(Pooling):
    """`/v2/embed`: texts (or images, or mixed inputs) in, `meta.billed_units` out, with
    `input_tokens` and `image_tokens` (together the prompt: vLLM splits one pooled count
    between them, pooling/embed/serving.py). Its `max_tokens` caps the input, not an
    output, so it is not read as one."""

    endpoint = "/v2/embed"
    paths = ("/v2/embed",)
    provider = "cohere"
    measures = "e2e latency, prompt tokens from meta.billed_units, error type"

    def prompt(self, obj: dict[str, Any]) -> Any:
        return obj.get("texts")

    def max_tokens(self, obj: dict[str, Any]) -> object:
        return None

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        meta = obj.get("meta")
        units = meta.get("billed_units") if type(meta) is dict else None
        return Facts(usage=units if type(units) is dict else None, **identity(obj))

    def counts(self, usage: dict[str, Any]) -> TokenCounts | None:
        text, image = as_int(usage.get("input_tokens")), as_int(usage.get("image_tokens"))
        if text is None and image is None:
            return None
        prompt = (text or 0) + (image or 0)
        return TokenCounts(prompt=prompt, output=None, cached=None, source=TokenSource.USAGE)
