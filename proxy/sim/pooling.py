"""vLLM's non-generative APIs: pooling, score, rerank and classify, with tiny outputs.

Shapes from vllm-project/vllm, vllm/entrypoints/pooling/ (pooling, score, classify
protocol.py and serving.py; older releases: vllm/entrypoints/openai/protocol.py
PoolingResponse, ScoreResponse, RerankResponse, ClassificationResponse):

  /pooling                 {id "pool-", object "list", created, model,
                            data [{index, object "pooling", data [floats]}], usage}
  /score, /v1/score        {id "score-", object "list", created, model,
                            data [{index, object "score", score}], usage}; the pair of
                            inputs is text_1/text_2, queries/documents, queries/items
                            or data_1/data_2 (pooling/score/protocol.py ScoreRequest)
  /rerank, /v1/rerank,     {id "rerank-", model, usage {prompt_tokens, total_tokens},
  /v2/rerank                results [{index, document {text, multi_modal: null},
                            relevance_score}]} (sorted by score, best first; `top_n`
                            > 0 keeps the first n; RerankUsage gained prompt_tokens in
                            current vLLM, older releases send total_tokens only)
  /classify, /v1/classify  {id "classify-", object "list", created, model,
                            data [{index, label, probs, num_classes}], usage}

`usage` is vLLM's UsageInfo {prompt_tokens, total_tokens, completion_tokens: 0}.
Scores are derived from a hash of the texts: deterministic, in [0, 1).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import orjson

from proxy.sim.catalog import embedding
from proxy.sim.tokens import count_prompt_tokens
from proxy.sim.wire import usage_json

#: Labels of the simulated classifier (vLLM reports the model's id2label names).
LABELS = ("negative", "positive")


#: The field pairs a score request may name (vLLM's ScoreRequest union, score/protocol.py).
_SCORE_PAIRS = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)


class PoolingInputError(ValueError):
    """The request lacks the field this API reads (vLLM answers 400)."""


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def item_text(item: Any) -> str:
    """An input item's text: a string, a `{"text"}` part, else its JSON."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("text"), str):
        return str(item["text"])
    return orjson.dumps(item).decode()


def score_of(*texts: str) -> float:
    """A stable score in [0, 1) for these texts (a hash: the same texts, the same score)."""
    digest = hashlib.sha256("\x00".join(texts).encode()).digest()
    return round(int.from_bytes(digest[:4], "big") / 2**32, 6)


def texts_tokens(*texts: str) -> int:
    """The prompt tokens these texts count, as the simulator counts an input list."""
    return count_prompt_tokens({"input": list(texts)})


def prompt_tokens(path: str, body: dict[str, Any]) -> int:
    """What the route would tokenize: every input, or every (query, document) pair."""
    return _pairs_and_tokens(path, body)[1]


def _pairs_and_tokens(path: str, body: dict[str, Any]) -> tuple[list[tuple[str, str]], int]:
    if path.endswith("rerank"):
        query, documents = body.get("query"), body.get("documents")
        if query is None or documents is None:
            raise PoolingInputError("Field required: query and documents")
        pairs = [(item_text(query), item_text(d)) for d in _items(documents)]
    elif path.endswith("score"):
        first, second = None, None
        for left, right in _SCORE_PAIRS:
            if left in body and right in body:
                first, second = body[left], body[right]
                break
        if first is None or second is None:
            raise PoolingInputError("Field required: text_1 and text_2 (or queries and documents)")
        lefts, rights = _items(first), _items(second)
        if len(lefts) == 1:
            lefts = lefts * len(rights)
        pairs = [(item_text(a), item_text(b)) for a, b in zip(lefts, rights, strict=False)]
    else:
        given = body.get("input")
        if given is None:
            raise PoolingInputError("Field required: input")
        items = (
            given
            if isinstance(given, list) and given and not isinstance(given[0], int)
            else [given]
        )
        return [(item_text(i), "") for i in items], count_prompt_tokens(body)
    return pairs, sum(texts_tokens(a, b) for a, b in pairs)


def reply(path: str, response_id: str, model: str, body: dict[str, Any]) -> bytes:
    """The response body of a pooling-family route."""
    pairs, tokens = _pairs_and_tokens(path, body)
    usage = orjson.Fragment(usage_json(tokens, 0, None))
    created = int(time.time())
    head: dict[str, Any] = {"id": response_id, "object": "list", "created": created, "model": model}
    if path.endswith("rerank"):
        scores = [score_of(q, doc) for q, doc in pairs]
        order = sorted(range(len(pairs)), key=lambda i: -scores[i])
        results = [
            {
                "index": i,
                "document": {"text": pairs[i][1], "multi_modal": None},
                "relevance_score": scores[i],
            }
            for i in order
        ]
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        rerank_usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return orjson.dumps(
            {"id": response_id, "model": model, "usage": rerank_usage, "results": results}
        )
    if path.endswith("score"):
        data = [
            {"index": i, "object": "score", "score": score_of(a, b)}
            for i, (a, b) in enumerate(pairs)
        ]
    elif path.endswith("classify"):
        data = []
        for i, (text, _) in enumerate(pairs):
            p = score_of(text)
            probs = [round(1 - p, 6), p]
            data.append(
                {
                    "index": i,
                    "label": LABELS[int(p >= 0.5)],
                    "probs": probs,
                    "num_classes": len(LABELS),
                }
            )
    else:
        data = [
            {"index": i, "object": "pooling", "data": embedding(text)}
            for i, (text, _) in enumerate(pairs)
        ]
    return orjson.dumps({**head, "data": data, "usage": usage})
