"""Ollama's own account of one request, as the engine adapter for its native API.

An engine adapter takes the engine's per-request object as the seam found it (Facts.engine)
and answers its figures in seconds as an `EngineMetrics` (proxy/core/engine.py has vLLM's,
`engine_metrics`), or None when the object says nothing. The seam names its adapter
(Api.engine_figures).

Ollama's object is the last line of a stream, or the whole non-streamed answer, with
`"done": true` (ollama/ollama api/types.go, `Metrics`, embedded in ChatResponse and
GenerateResponse; EmbedResponse has total, load and prompt_eval_count). Durations are Go
`time.Duration`s, so integers of nanoseconds, and `omitempty`: a zero duration is left out,
so on the done object an absent duration is 0. server/routes.go (ChatHandler,
GenerateHandler) measures them as:

  load_duration         checkpointLoaded - checkpointStart: from the handler's start to a
                        loaded runner (scheduleRunner), so waiting for the model to load
                        (or for another to be evicted) and loading it. Warm, it is a few
                        milliseconds.
  prompt_eval_duration  the runner's prefill of the prompt tokens it had to evaluate
                        (llm/llama_server.go: Timings.PromptMS, the part not reused from
                        the cache)
  eval_duration         generating `eval_count` tokens
  total_duration        time.Since(checkpointStart) when the done object is built

So client-seen TTFT = load + prefill + the rest outside the engine (HTTP, templating and
tokenising in Ollama's front end, the network, the proxy): `engine.load_split`. Ollama
reports no queue time of its own, and a wait for one of the loaded runner's parallel slots
is in neither figure: the runner takes a slot (llm/llama_server.go Completion, Chat and
Embedding: `s.sem.Acquire`, one of numParallel, OLLAMA_NUM_PARALLEL, default 1 in
envconfig/config.go) after checkpointLoaded and before its prefill, so that wait is outside
the engine, as llama.cpp's wait for a slot is (proxy/core/llamacpp.py).

A load or unload answer (an empty prompt or no messages: GenerateHandler, ChatHandler) has
no Metrics at all: no figures (`ollama_engine` answers None) and no counts
(proxy/core/apis/ollama.py `OllamaApi.counts`).

A value that is not an integer, is negative or is over a day is nonsense, and left out.
"""

from __future__ import annotations

from proxy.core.engine import EngineMetrics

#: The longest duration believed (ns): one day. Anything longer is a broken backend's.
MAX_NS = 86_400 * 10**9


def ollama_embed_engine(obj: object) -> EngineMetrics | None:
    """The figures of an /api/embed answer (EmbedResponse): only the load is the engine's
    own; it reports no prefill duration."""
    if type(obj) is not dict or type(obj.get("embeddings")) is not list:
        return None
    load = _seconds(obj.get("load_duration", 0))
    if load is None or "total_duration" not in obj:
        return None
    return EngineMetrics(None, None, None, None, None, None, load_time=load)


def ollama_engine(obj: object) -> EngineMetrics | None:
    """The figures of an Ollama done object, or None when it is not one."""
    if type(obj) is not dict or obj.get("done") is not True:
        return None
    if not any(key in obj for key in _DURATIONS):  # a load/unload answer: none measured
        return None
    load = _seconds(obj.get("load_duration", 0))
    prefill = _seconds(obj.get("prompt_eval_duration", 0))
    generation = _seconds(obj.get("eval_duration", 0))
    tokens = obj.get("eval_count", 0)
    speed = None
    if generation and type(tokens) is int and tokens > 0:
        speed = tokens / generation
    if load is None and prefill is None and generation is None:
        return None
    return EngineMetrics(
        queue_time=None,
        time_to_first_token=prefill,
        generation_time=generation,
        mean_itl=None,
        tokens_per_second=speed,
        spec=None,
        load_time=load,
    )


_DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


def _seconds(value: object) -> float | None:
    if type(value) is not int or not 0 <= value <= MAX_NS:
        return None
    return value / 1e9
