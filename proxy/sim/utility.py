"""vLLM's utility routes: tokenize, detokenize, version, server load.

Sources: vllm-project/vllm, vllm/entrypoints/serve/ (tokenize/protocol.py
TokenizeResponse {count, max_model_len, tokens, token_strs}, DetokenizeResponse
{prompt}) and vllm/entrypoints/openai/api_server.py (`GET /version` -> {"version"},
`GET /load` -> {"server_load"}, `GET|POST /ping` answered as `GET /health`: 200 with
an empty body, `POST /invocations` dispatched by the body's shape as for a generative model).

Token ids here are the simulator's own: prompt token i is `100 + i`; detokenizing id n
gives the vocabulary word `VOCAB[n % len(VOCAB)]`, so text and ids round-trip in tests.
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.sim.tokens import VOCAB, count_prompt_tokens

#: The vLLM release the simulator says it is (GET /version): the one whose shapes it plays
#: (tests/fixtures/streams/vllm-0.32/), marked as no real one.
VLLM_VERSION = "0.32.0+sim"
_FIRST_ID = 100


def tokenize(body: dict[str, Any], max_model_len: int) -> bytes:
    count = count_prompt_tokens(body)
    tokens = list(range(_FIRST_ID, _FIRST_ID + count))
    strs = [VOCAB[t % len(VOCAB)] for t in tokens] if body.get("return_token_strs") else None
    return orjson.dumps(
        {"count": count, "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}
    )


def detokenize(tokens: list[int]) -> bytes:
    return orjson.dumps({"prompt": "".join(VOCAB[t % len(VOCAB)] for t in tokens)})


def version() -> bytes:
    return orjson.dumps({"version": VLLM_VERSION})


def load(active: int) -> bytes:
    return b'{"server_load":%d}' % active


def invocation_route(body: Any) -> str | None:
    """The route a SageMaker `/invocations` body is served by, as vLLM 0.32 picks it for a
    generative model (serve/sagemaker/api_router.py `invocations`: the request types of
    generate/factories.py, ChatCompletionRequest then CompletionRequest, the first one
    the body validates as serves it). vLLM serves no embeddings for a generative model,
    so `{"input": ...}` is no embeddings request: it fails ChatCompletionRequest and then
    CompletionRequest's `validate_prompt_and_prompt_embeds` (completion/protocol.py:591-610),
    which raises a VLLMValidationError, no pydantic ValidationError: the loop does not go
    on, and the answer is completions' 400 for a missing prompt. So every object that is
    no chat goes to completions, which answers that. None: no object (vLLM's answer is
    Python's own error on it, not played here)."""
    if not isinstance(body, dict):
        return None
    if isinstance(body.get("messages"), list):
        return "/v1/chat/completions"
    return "/v1/completions"
