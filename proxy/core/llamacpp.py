"""llama.cpp's own account of one request: the `timings` object of `llama-server`, typed.

`llama-server` writes `timings` on a non-streamed answer and on the last chunk of a stream
(the finish chunk, or the usage chunk when usage is asked for: proxy/core/strip.py), from
`server_slot_stats::to_json` (tools/server/server-common.cpp, llama.cpp as vendored in
llama-cpp-python 0.3.36; its tools/server/README.md, "Timings and context usage"):

  cache_n       prompt tokens reused from the slot's cache (`n_prompt_cached`)
  prompt_n      prompt tokens processed (`n_prompt_processed`): prompt = prompt_n + cache_n
  prompt_ms     from the slot starting on the prompt (`t_start`) to the prompt's last batch
                (`t_prompt_last`), whose logits give the first token: the engine's TTFT
  predicted_n   tokens generated (`n_gen`)
  predicted_ms  from the prompt's end to the last token (`t_gen_last - t_prompt_last`)
  predicted_per_token_ms, predicted_per_second   over the decode steps (`n_gen - 1`)
  draft_n, draft_n_accepted   with speculative decoding only

llama.cpp reports no queue time: a request waiting for a free slot waits before `t_start`,
so that wait is outside the engine in the TTFT split (proxy/core/engine.py ttft_split).

A field that is there but makes no sense (not a number, negative, not finite, huge) is
None and named in `EngineMetrics.invalid`, which a metric counts; the bytes are relayed
as they came either way. Read once per request, from the one event (or body) that carries
it; never per chunk.
"""

from __future__ import annotations

import math
from typing import Any

from proxy.core.engine import EngineMetrics, SpecDecode

#: Above these a figure is nonsense: a day of prefill or decode, a billion tokens.
MAX_MS = 86_400_000.0
MAX_TOKENS = 1_000_000_000
#: The fields read, and so the closed set `invalid` names come from ("timings" when the
#: object itself is not one).
FIELDS = (
    "timings",
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
    "draft_n",
    "draft_n_accepted",
)


def timings_metrics(obj: object) -> EngineMetrics | None:
    """The typed figures of a `timings` object; None when it has none of them."""
    if type(obj) is not dict:
        return _NOT_AN_OBJECT
    invalid: list[str] = []
    found = EngineMetrics(
        queue_time=None,
        time_to_first_token=_seconds(obj, "prompt_ms", invalid),
        generation_time=_seconds(obj, "predicted_ms", invalid),
        mean_itl=_seconds(obj, "predicted_per_token_ms", invalid),
        tokens_per_second=_number(obj, "predicted_per_second", MAX_TOKENS, invalid),
        spec=_spec(obj, invalid),
        cached_tokens=_count(obj, "cache_n", invalid),
        prompt_tokens=_count(obj, "prompt_n", invalid),
        output_tokens=_count(obj, "predicted_n", invalid),
        invalid=tuple(invalid),
    )
    return None if found == _EMPTY else found


_EMPTY = EngineMetrics(None, None, None, None, None, None)
_NOT_AN_OBJECT = EngineMetrics(None, None, None, None, None, None, invalid=("timings",))


def _number(obj: dict[str, object], name: str, limit: float, invalid: list[str]) -> float | None:
    value = obj.get(name)
    if value is None:
        return None
    if (type(value) is float or type(value) is int) and 0 <= value <= limit:
        number = float(value)
        if math.isfinite(number):
            return number
    invalid.append(name)
    return None


def _seconds(obj: dict[str, object], name: str, invalid: list[str]) -> float | None:
    ms = _number(obj, name, MAX_MS, invalid)
    return None if ms is None else ms / 1000.0


def _count(obj: dict[str, object], name: str, invalid: list[str]) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if type(value) is int and 0 <= value <= MAX_TOKENS:
        return value
    invalid.append(name)
    return None


def _spec(obj: dict[str, object], invalid: list[str]) -> SpecDecode | None:
    draft = _count(obj, "draft_n", invalid)
    accepted = _count(obj, "draft_n_accepted", invalid)
    if draft is None or accepted is None:
        return None
    if accepted > draft:
        invalid.append("draft_n_accepted")
        return None
    return SpecDecode(
        draft_tokens=draft,
        accepted_tokens=accepted,
        mean_acceptance_length=None,
        acceptance_rate=accepted / draft if draft else None,
        steps=None,
    )


#: The members of `timings` that count tokens (the rest are times and rates).
_COUNTS = frozenset({"cache_n", "prompt_n", "predicted_n"})


def several_tasks(obj: dict[str, Any]) -> bool:
    """Whether a non-streamed OpenAI-shaped answer (one with `timings`, which only
    llama-server writes) merges several tasks: n > 1, or a list of prompts. llama-server
    runs a task per choice and, not streamed, answers the first task's object with the
    other tasks' `choices` appended to its own, so its `usage` and `timings` are the first
    task's alone (tools/server/server-context.cpp, handle_completions_impl, "if multiple
    results in OAI format, we need to re-format them"; the capture
    tests/fixtures/streams/llamacpp/chat_n2.json: two choices of 5 tokens, usage 5)."""
    choices = obj.get("choices")
    return type(choices) is list and len(choices) > 1


def several_prompts(prompt: object) -> bool:
    """Whether a Completions request's `prompt` is a list of prompts (texts, or lists of
    token ids). An array holding any number is one prompt, texts and ids mixed
    (tools/server/server-common.cpp tokenize_input_prompts,
    `json_is_array_and_contains_numbers`). Not streamed, llama-server answers several
    merged (`several_tasks`) with the first prompt's usage alone."""
    return type(prompt) is list and len(prompt) > 1 and not any(type(p) is int for p in prompt)


def first_task_prompt(usage: object) -> dict[str, Any] | None:
    """A merged answer's usage (`several_tasks`) less the output's count: the first task's
    prompt (and its cached tokens), which the n tasks of one prompt share (for a list of
    prompts it is the first one's alone: the observer drops it then, `several_prompts`) (server-context.cpp
    copies the evaluated prompt to the children's slots, stats included), is kept as the
    request's; its `completion_tokens` is one choice's, so the output is counted otherwise
    (a tokenizer over every choice's text) or not at all."""
    if type(usage) is not dict:
        return None
    return {k: v for k, v in usage.items() if k in ("prompt_tokens", "prompt_tokens_details")}


def first_task_times(timings: object) -> object:
    """A merged answer's `timings` (`several_tasks`) less its counts, which are one task's:
    its times and rates are still that task's own, the engine's figures of the request."""
    if type(timings) is not dict:
        return timings
    return {k: v for k, v in timings.items() if k not in _COUNTS}
