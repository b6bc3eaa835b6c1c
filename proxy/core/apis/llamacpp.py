"""llama.cpp's native completion, `POST /completion` (and `/completions`), as `llama-server`
serves it.

Wire facts (seen on llama-server build b1-0c1e570, the build .ci/llama makes from the
llama-cpp-python 0.3.36 sdist; tools/server/server-task.cpp,
server_task_result_cmpl_partial::to_json_non_oaicompat and the final one):

- The body names the prompt in `prompt` (a text, token ids, or a list of prompts) and the
  limit in `n_predict` (or `max_tokens`: params_from_json_cmpl reads n_predict first).
  `stream` is false unless given.
- A stream is SSE `data:` events with no `[DONE]`: `{"index", "content", "tokens",
  "stop": false, ...}` per token, then one `{"index", "content": "", "stop": true,
  "stop_type", "tokens_predicted", "tokens_evaluated", "timings", ...}`. A non-streamed
  answer is that last object with the whole text in `content`.
- `stop_type` is "eos" or "word" (a stop word) for an answer that ended, "limit" for one
  cut at n_predict, "none" otherwise (server-common.h, stop_type).
- There is no `usage`: the counts are the engine's own, the last object's
  `tokens_evaluated` (the whole prompt, cached tokens included) and `tokens_predicted`,
  with `timings.cache_n` cached (source `engine`, as llama.cpp's timings are without usage).
- An error before the answer is an HTTP status with `{"error": {"code", "message",
  "type"}}`; a stream that fails carries `{"error": ...}`.

A list of prompts streams `data: null`, then every prompt's events interleaved, each
with its `index` and its own last object: each prompt is a choice, their counts are
added up, and the TTFT split is the prompt's whose token came first, as on
/v1/completions (fixture native_completion_batch_stream.sse). A non-streamed list is
answered as a JSON array of last objects (server-context.cpp, handle_completions_impl): the
observer reads each as a prompt's (proxy/core/observe.py, `_parse_answers`).

Of llama-server's other routes (tools/server/server.cpp), `/rerank`, `/v1/rerank`,
`/reranking` and `/v1/reranking` (one handler) are measured as vLLM's rerank and
`/v1/embeddings` as OpenAI's (proxy/core/apis/pooling.py); `/embedding` and `/embeddings`
(llama-server's own answer, no OpenAI usage), `/infill`, `/tokenize` and `/props` are
forwarded unmeasured.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from proxy.core.apis.base import (
    MALFORMED,
    NOTHING,
    Api,
    Facts,
    RequestInfo,
    TokenCounts,
    as_int,
    json_object,
)
from proxy.core.apis.chat import keep
from proxy.core.apis.completions import batch_of_prompts
from proxy.core.measurement import TokenSource

#: stop_type onto the closed finish set.
_FINISH = {"eos": "stop", "word": "stop", "limit": "length"}
#: The shared answer for the common event: the first prompt's token, nothing else.
_TEXT = Facts(content="text", plain=True)


class LlamaCompletion(Api):
    endpoint = "/completion"
    # `/completions` without the /v1 is this one too, not the OpenAI completion (seen on
    # b1-0c1e570: it answers the native events; `/chat/completions` is OpenAI's chat).
    # Both are llama-server's own (tools/server/server.cpp; vLLM 0.32 answers them 404):
    # measured only where the backend may be llama-server (apis/__init__.py LLAMACPP_PATHS).
    paths = ("/completion", "/completions")
    operation = "text_completion"
    bench_name = "llamacpp-completion"
    provider: ClassVar[str] = "llama.cpp"
    finish_ends_stream = True  # a stream has no end marker: every prompt's stop ends it
    reads_n_cmpl = True  # llama-server's own API: `n_cmpl`, else `n` (server-schema.cpp:62-64)
    end_marker = 'a "stop": true event for every prompt'
    measures = (
        "TTFT at the first event with non-empty content; TPOT, ITL, decode speed; tokens "
        "from the last event's tokens_evaluated and tokens_predicted (source engine), the "
        "TTFT split from its timings; stop_type (limit is length); in-stream errors"
    )

    def bench_body(
        self, model: str, prompt: Any, max_tokens: int, ignore_eos: bool
    ) -> dict[str, Any]:
        # `model` is ignored by one llama-server and read by the routers in front of
        # several (llama-swap); ignore_eos is a llama.cpp sampling parameter too.
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "n_predict": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        if ignore_eos:
            body["ignore_eos"] = True
        return body

    def max_tokens(self, obj: dict[str, Any]) -> object:
        limit = obj.get("n_predict")
        return obj.get("max_tokens") if limit is None else limit

    def prompt(self, obj: dict[str, Any]) -> Any:
        return obj.get("prompt")

    def read_request(self, obj: dict[str, Any]) -> RequestInfo:
        """A list of prompts owes a last object for each (with one slot they stream one
        after another: a cut between two left no sign of the second)."""
        info = super().read_request(obj)
        prompt = info.prompt
        if batch_of_prompts(prompt):  # (a list of token ids is one prompt)
            return replace(info, choices_due=len(prompt))
        return info

    def event(self, payload: bytes, collect: bool, identify: bool) -> Facts:
        obj = json_object(payload)
        if obj is None:
            # a list of prompts' stream opens with `data: null` (as /v1/completions' does
            # between its tasks): nothing, not a malformed event
            return NOTHING if payload == b"null" else MALFORMED
        error = obj.get("error")
        if error is not None:
            return Facts(error=error)
        index = obj.get("index", 0)
        index = index if type(index) is int else 0
        content = obj.get("content")
        last = obj.get("stop") is True
        facts = NOTHING
        if content and type(content) is str:
            if index == 0 and not collect and not last:  # (no identity before the last)
                return _TEXT
            facts = Facts(content="text", choices=(index,))
            if collect:
                keep(facts, content)
        if last:
            facts = facts if facts is not NOTHING else Facts()
            self._last(facts, obj)
            facts.finish_choice = index
        return facts

    def body(self, obj: dict[str, Any], collect: bool) -> Facts:
        facts = Facts()
        self._last(facts, obj)
        content = obj.get("content")
        if collect and content and type(content) is str:
            keep(facts, content)
        return facts

    @staticmethod
    def _last(facts: Facts, obj: dict[str, Any]) -> None:
        """The last object's finish, counts, timings and model (it has no id)."""
        reason = obj.get("stop_type")
        facts.finish = reason if reason and type(reason) is str else "none"
        facts.usage = obj  # its counts: read by `counts`
        facts.timings = obj.get("timings")
        model = obj.get("model")
        facts.response_id = ""
        facts.response_model = model if type(model) is str else None

    def finish_label(self, raw: str) -> str:
        return _FINISH.get(raw, "other")

    def counts(self, usage: dict[str, Any]) -> TokenCounts | None:
        output = as_int(usage.get("tokens_predicted"))
        if output is None:
            return None
        timings = usage.get("timings")
        cached = as_int(timings.get("cache_n")) if type(timings) is dict else None
        prompt = as_int(usage.get("tokens_evaluated"))
        return TokenCounts(prompt=prompt, output=output, cached=cached, source=TokenSource.ENGINE)
