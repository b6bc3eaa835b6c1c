"""vLLM 0.32's label reads, `/generative_scoring` and `/v1/systemone`: one-token reads whose
answer is one JSON body, with usage.

Shapes from vllm/entrypoints/generate/:
  /generative_scoring   generative_scoring/serving.py: a `query` and a non-empty list of
                        `items`, `label_token_ids` non-empty (else 400); one read of
                        `max_tokens=1` per item; the answer {id "generative-scoring-<id>",
                        object "list", created, model, data [{index, object "score",
                        score}], usage {prompt_tokens, total_tokens, completion_tokens}},
                        every item's prompt and output token summed (serving.py:314-353)
  /v1/systemone         structured_decisions/: a `state` and a dict of `questions` (each
                        {type, instructions, criteria}), one read per question; the answer
                        {id "decision-<id>", object "structured_decision", created, model,
                        answers {qid: {...}}, usage {input_tokens, output_tokens},
                        diagnostics {qid: {label_mass, argmax_is_label}}} (protocol.py,
                        serving.py:100-136). Only the `noul` type is played (yes or no,
                        question_types.py NoulQuestion.answer).
Each read's prompt is the query (or state and question) with its item; its one output
token is counted, as vLLM counts `len(outputs[0].token_ids)`.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from proxy.sim.pooling import PoolingInputError, item_text, score_of, texts_tokens


def scoring_reads(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(query, item) of each read, or PoolingInputError for vLLM's 400."""
    query, items, labels = body.get("query"), body.get("items"), body.get("label_token_ids")
    if query is None or not isinstance(items, list):
        raise PoolingInputError("Field required: query and items")
    if not isinstance(labels, list) or not labels:
        raise PoolingInputError("label_token_ids must contain at least one token ID.")
    if not items:
        raise PoolingInputError("items must contain at least one item.")
    return [(item_text(query), item_text(item)) for item in items]


def decision_reads(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(state, question id) of each read, or PoolingInputError for vLLM's 400."""
    state, questions = body.get("state"), body.get("questions")
    if state is None or not isinstance(questions, dict) or not questions:
        raise PoolingInputError("Field required: state and questions")
    return [(item_text(state), str(qid)) for qid in questions]


def prompt_tokens(reads: list[tuple[str, str]]) -> int:
    return sum(texts_tokens(a, b) for a, b in reads)


def scoring_reply(request_id: str, model: str, reads: list[tuple[str, str]]) -> bytes:
    prompt, output = prompt_tokens(reads), len(reads)
    return orjson.dumps(
        {
            "id": f"generative-scoring-{request_id}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": [
                {"index": i, "object": "score", "score": score_of(a, b)}
                for i, (a, b) in enumerate(reads)
            ],
            "usage": {
                "prompt_tokens": prompt,
                "total_tokens": prompt + output,
                "completion_tokens": output,
                "prompt_tokens_details": None,
            },
        }
    )


def decision_reply(request_id: str, model: str, reads: list[tuple[str, str]]) -> bytes:
    answers, diagnostics = {}, {}
    for state, qid in reads:
        yes = score_of(state, qid)
        answers[qid] = {
            "type": "noul",
            "noul": yes,
            "probabilities": {"yes": yes, "no": 1 - yes},
            "confidence": max(yes, 1 - yes),
        }
        diagnostics[qid] = {"label_mass": 1.0, "argmax_is_label": True}
    return orjson.dumps(
        {
            "id": f"decision-{request_id}",
            "object": "structured_decision",
            "created": int(time.time()),
            "model": model,
            "answers": answers,
            "usage": {"input_tokens": prompt_tokens(reads), "output_tokens": len(reads)},
            "diagnostics": diagnostics,
        }
    )
