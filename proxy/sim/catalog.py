"""The endpoints that generate nothing: the model list and tiny embeddings.

Both exist so that pass-through paths of a proxy can be tested against the same
backend. Embeddings are 8 floats derived from a hash of the input: deterministic,
unit length, and different for different inputs.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
import uuid
from typing import Any

import orjson

from proxy.sim.config import SimConfig
from proxy.sim.tokens import count_prompt_tokens
from proxy.sim.wire import usage_json

EMBEDDING_DIM = 8


def models_list(config: SimConfig) -> bytes:
    """vLLM's `GET /v1/models` body for the configured models."""
    created = int(time.time())
    return orjson.dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": name,
                    "parent": None,
                    "max_model_len": config.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex}",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
                for name in config.models
            ],
        }
    )


def embedding(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    raw = [v / 32768.0 for v in struct.unpack(f">{EMBEDDING_DIM}h", digest[: 2 * EMBEDDING_DIM])]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [round(v / norm, 6) for v in raw]


def embeddings(response_id: str, model: str, body: dict[str, Any]) -> bytes:
    """vLLM's `POST /v1/embeddings` body: one vector per input item."""
    items = _inputs(body)
    prompt_tokens = count_prompt_tokens(body)
    return orjson.dumps(
        {
            "id": response_id,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [
                {"index": i, "object": "embedding", "embedding": embedding(_as_text(item))}
                for i, item in enumerate(items)
            ],
            "usage": orjson.Fragment(usage_json(prompt_tokens, 0, None)),
        }
    )


def embeddings_bytes(
    response_id: str, model: str, body: dict[str, Any]
) -> tuple[bytes, bytes | None]:
    """vLLM's binary answer to `encoding_format: "bytes"` or `"bytes_only"`: the vectors as
    float32 one after another, and (for "bytes" only) a `metadata` header with the JSON
    account (vllm/entrypoints/pooling/utils.py, build_pooling_bytes_streaming_response:
    `json.dumps({"id", "created", "model", "data": items, "usage"})`, each item's offsets
    into the body; endianness "native", little on the machines vLLM-CPU runs on)."""
    items = _inputs(body)
    vectors = [struct.pack(f"<{EMBEDDING_DIM}f", *embedding(_as_text(i))) for i in items]
    if body.get("encoding_format") == "bytes_only":
        return b"".join(vectors), None
    size, prompt_tokens = 4 * EMBEDDING_DIM, count_prompt_tokens(body)
    account = {
        "id": response_id,
        "created": int(time.time()),
        "model": model,
        "data": [
            {
                "index": i,
                "embed_dtype": "float32",
                "endianness": "native",
                "start": i * size,
                "end": (i + 1) * size,
                "shape": [EMBEDDING_DIM],
            }
            for i in range(len(items))
        ],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return b"".join(vectors), json.dumps(account).encode()


def _inputs(body: dict[str, Any]) -> list[Any]:
    """The items an embeddings request embeds: each of a list (one token-id list is one)."""
    given = body.get("input")
    return given if isinstance(given, list) and given and not isinstance(given[0], int) else [given]


def _as_text(item: Any) -> str:
    return item if isinstance(item, str) else orjson.dumps(item).decode()
