"""vLLM's utility routes: tokenize, detokenize, version, server load.

Sources: vllm-project/vllm, vllm/entrypoints/serve/ (tokenize/protocol.py
TokenizeResponse {count, max_model_len, tokens, token_strs}, DetokenizeResponse
{prompt}) and vllm/entrypoints/openai/api_server.py (`GET /version` -> {"version"},
`GET /load` -> {"server_load"}, `GET|POST /ping` answered as `GET /health`: 200 with
an empty body, `POST /invocations` dispatched by the body's shape).

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
    """The route a SageMaker `/invocations` body is served by, as vLLM picks it."""
    if not isinstance(body, dict):
        return None
    if "messages" in body:
        return "/v1/chat/completions"
    if "prompt" in body:
        return "/v1/completions"
    if "input" in body:
        return "/v1/embeddings"
    return None
