"""Ollama's native API as it goes on the wire: `/api/chat`, `/api/generate`, `/api/embed`,
`/api/version`, `/`.

Sources (ollama/ollama @ fb30760): api/types.go gives the field order Go's json.Marshal
writes (ChatResponse: model, created_at, message{role, content, thinking, tool_calls},
done, done_reason, then the embedded Metrics: total_duration, load_duration,
prompt_eval_count, prompt_eval_duration, eval_count, eval_duration; GenerateResponse:
model, created_at, response, thinking, done, done_reason, context, Metrics), all the
optional ones `omitempty`. server/routes.go: a stream is `application/x-ndjson`, one
object a line (streamResponse); `"stream": false` answers `application/json;
charset=utf-8`; errors are `{"error": "..."}`, with an HTTP status before anything was
written and as a line after; load_duration runs from the handler's start to a loaded
runner, total_duration to the done line; `/api/version` answers `{"version": "..."}`.

The EOS that ends a "stop" answer is a token of its own, decoded in a step of its own, as
in the vLLM mode (controls.Plan.eos, the same rules: none after a length finish), and
`eval_count` counts it: Ollama on a GGUF model runs llama-server and reports its
`timings` (llm/llama_server.go Completion: EvalCount = Timings.PredictN, EvalDuration =
Timings.PredictMS; the chat path alike), and llama-server counts the EOS in `predicted_n`
(proxy/sim/llamacpp.py). (Ollama's MLX runner does not: x/mlxrunner/pipeline.go checks
IsEOS before `generated++`; the simulator plays the llama-server runner.) The EOS's partial
has no text, so no line (Completion calls back only for `lsResp.Content != ""`); the done
line comes when the final event does, at the EOS's step.

Timing: a model that is not loaded (SimConfig.ollama_load_time > 0 and the model not
used yet, or `x-sim-load-time` on the request) first waits its load time; then the
programmed TTFT (the prefill) runs, and tokens follow as for every other API. The
durations the done line reports are the ones this exchange really took, in nanoseconds
(`time.monotonic_ns`): load_duration = the load wait, prompt_eval_duration = load end to
the first token, eval_duration = first token to the done line (the EOS's step, where
llama-server's predicted_ms ends).

`"think": true` sends the first `x-sim-thinking-tokens` (default 4) tokens of the output
as `thinking`, the rest as content. Faults are chat's (controls.py FAULTS), in this
framing: error_event and error_string are a `{"error": "..."}` line, malformed is the
line `{not json`, close_no_done (and x-sim-no-done) end the body without the done line.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from typing import Any

import orjson

from proxy.sim import errors
from proxy.sim.controls import ENDING_FAULTS, Plan, burn_cpu, number
from proxy.sim.exchange import Exchange
from proxy.sim.pacing import Pacer
from proxy.sim.state import Outcome
from proxy.sim.stream import paced_content, paced_whole
from proxy.sim.tokens import completion_text

NDJSON = b"application/x-ndjson"
JSON = b"application/json; charset=utf-8"
TEXT = b"text/plain; charset=utf-8"  # gin's c.String
#: What `GET /` and `HEAD /` answer (server/routes.go GenerateRoutes).
RUNNING = b"Ollama is running"
#: A version for a simulator that plays Ollama (SimConfig.ollama_version, `tokenprobe demo`).
OLLAMA_VERSION = "0.13.0"


def created_at() -> bytes:
    """Go's time.Time in RFC 3339 with nanoseconds, UTC, as json.Marshal writes it."""
    now = time.time_ns()
    stamp = datetime.fromtimestamp(now // 10**9, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    fraction = f"{now % 10**9:09d}".rstrip("0")
    return b'"%s%sZ"' % (stamp.encode(), b"." + fraction.encode() if fraction else b"")


class Timer:
    """The instants an Ollama handler measures (server/routes.go checkpointStart,
    checkpointLoaded), on the monotonic clock in nanoseconds."""

    __slots__ = ("first", "loaded", "start")

    def __init__(self, start: int) -> None:
        self.start = start
        self.loaded = start
        self.first: int | None = None

    def metrics(self, plan: Plan, sent: int) -> bytes:
        now = time.monotonic_ns()
        first = self.first if self.first is not None else now
        fields = [
            (b"total_duration", now - self.start),
            (b"load_duration", self.loaded - self.start),
            (b"prompt_eval_count", plan.prompt_tokens),
            (b"prompt_eval_duration", first - self.loaded),
            (b"eval_count", sent),
            (b"eval_duration", now - first),
        ]
        return b"".join(b',"%s":%d' % (k, v) for k, v in fields if v)  # omitempty


class OllamaWire:
    """The lines of one /api/chat or /api/generate answer."""

    __slots__ = ("_chat", "_context", "_head", "plan", "thinking", "timer")

    def __init__(
        self, plan: Plan, chat: bool, thinking: int, timer: Timer, raw: bool = False
    ) -> None:
        self.plan = plan
        self._chat = chat
        # generate's done line has the token ids, unless the prompt went raw (server/
        # routes.go GenerateHandler: `if !req.Raw { ... res.Context = tokens }`)
        self._context = not chat and not raw
        self._head = b'{"model":%s,"created_at":' % orjson.dumps(plan.model)
        self.thinking = thinking  # output tokens sent as `thinking`
        self.timer = timer

    def line(self, content: str, thinking: str, tail: bytes = b'"done":false') -> bytes:
        think = b',"thinking":%s' % orjson.dumps(thinking) if thinking else b""
        if self._chat:
            body = b'"message":{"role":"assistant","content":%s%s}' % (orjson.dumps(content), think)
        else:
            body = b'"response":%s%s' % (orjson.dumps(content), think)
        return self._head + created_at() + b"," + body + b"," + tail + b"}"

    def tokens(self, count: int, sent: int) -> bytes:
        """The line of output tokens `sent .. sent+count-1`, split into thinking and content."""
        split = min(max(self.thinking - sent, 0), count)
        thinking = completion_text(split, sent)
        content = completion_text(count - split, sent + split)
        return self.line(content, thinking) + b"\n"

    def done(self, sent: int, content: str = "", thinking: str = "") -> bytes:
        """The done line after `sent` text tokens; its eval_count counts the EOS that
        ended them (Plan.eos), `context` does not (it is the prompt and the text,
        tokenized again: server/routes.go GenerateHandler, `r.Tokenize(prompt+sb)`)."""
        plan = self.plan
        tail = b'"done":true,"done_reason":%s' % orjson.dumps(plan.finish_reason)
        if self._context:  # the prompt's and the response's token ids
            tail += b',"context":%s' % orjson.dumps(list(range(1, plan.prompt_tokens + sent + 1)))
        return self.line(content, thinking, tail + self.timer.metrics(plan, sent + plan.eos))


async def stream_ollama(ex: Exchange, plan: Plan, wire: OllamaWire, pacer: Pacer) -> Outcome:
    await ex.start(200, NDJSON)
    timer = wire.timer

    def content(count: int, sent: int) -> list[bytes]:
        if timer.first is None:
            timer.first = time.monotonic_ns()
        return [wire.tokens(count, sent)]

    async def fire(fault: str) -> bool:
        return await _fault(ex, plan, wire, pacer, fault)

    sent = await paced_content(ex, plan, pacer, content, fire)
    if sent is None:
        return "fault"
    # The EOS's step has passed (paced_content waited for it): no line of its own (its
    # partial has no text: llm/llama_server.go sends none), the done line at once.
    burn_cpu(plan.cpu_per_token * plan.eos)
    ex.record.completion_tokens = sent + plan.eos
    ex.record.finish_reason = plan.finish_reason
    outcome: Outcome = "fault" if ex.record.fault else "completed"
    await ex.end(b"" if plan.no_done else wire.done(sent) + b"\n", outcome)
    return outcome


async def complete_ollama(ex: Exchange, plan: Plan, wire: OllamaWire, pacer: Pacer) -> Outcome:
    await paced_whole(ex, plan, pacer, plan.finish_reason)
    timer = wire.timer  # the first token was due one prefill after the load
    timer.first = min(time.monotonic_ns(), timer.loaded + int(plan.ttft * 1e9))
    n, k = plan.output_tokens, min(wire.thinking, plan.output_tokens)
    body = wire.done(n, completion_text(n - k, k), completion_text(k))
    await ex.reply(200, body, JSON)
    return "completed"


async def _fault(ex: Exchange, plan: Plan, wire: OllamaWire, pacer: Pacer, fault: str) -> bool:
    if fault == "stall":
        await pacer.pause(plan.stall)
    elif fault == "malformed":
        await ex.write(b"{not json\n")
    elif fault == "non_utf8":
        await ex.write(wire.line("", "")[:-1] + b',"x":"\xff\xfe"}\n')
    elif fault == "huge_event":
        await ex.write(wire.line("x" * max(0, plan.huge_bytes - 200), "") + b"\n")
    elif fault in ("error_event", "error_string"):
        # streamResponse after the first write: json.NewEncoder(c.Writer).Encode(gin.H{"error": e})
        await ex.end(b'{"error":"an error was encountered while running the model"}\n', "fault")
    elif fault == "close_no_done":
        await ex.end(b"", "fault")
    return fault not in ENDING_FAULTS


def thinking_tokens(body: Any, headers: dict[str, str]) -> int:
    if not isinstance(body, dict) or body.get("think") not in (True, "high", "medium", "low"):
        return 0
    return number(headers, "x-sim-thinking-tokens", int, 4, 0)


def embed_inputs(body: Any) -> list[str] | None:
    """/api/embed's `input`, a string or a list of them; None when it is neither. No input,
    `""` and `[]` are no texts (server/routes.go EmbedHandler: a string counts only
    `if len(i) > 0`, a null input is no error), answered by `no_embeddings`."""
    if not isinstance(body, dict):
        return None
    inputs = body.get("input")
    if inputs is None:
        return []
    if isinstance(inputs, str):
        return [inputs] if inputs else []
    if isinstance(inputs, list) and all(isinstance(t, str) for t in inputs):
        return inputs
    return None


def error_reply(status: int, message: str) -> errors.ErrorReply:
    """Ollama's error answer: gin's c.JSON(status, gin.H{"error": message})."""
    return errors.ErrorReply(status, orjson.dumps({"error": message}), errors.OLLAMA_JSON)


def no_embeddings(model: str) -> bytes:
    """EmbedHandler's answer to no texts, once the model is loaded: `api.EmbedResponse{Model,
    Embeddings: [][]float32{}}`, the durations and the count zero, so absent (omitempty)."""
    return b'{"model":%s,"embeddings":[]}' % orjson.dumps(model)


def embed(model: str, texts: list[str], timer: Timer, prompt_tokens: int) -> bytes:
    """EmbedResponse: one small deterministic vector per input."""
    vectors = [[round(0.1 * (i + 1), 3), 0.25, -0.5] for i in range(len(texts))]
    now = time.monotonic_ns()
    return (
        b'{"model":%s,"embeddings":%s,"total_duration":%d,"load_duration":%d,"prompt_eval_count":%d}'
        % (
            orjson.dumps(model),
            orjson.dumps(vectors),
            now - timer.start,
            max(timer.loaded - timer.start, 1),
            prompt_tokens,
        )
    )


def load_reply(model: str, reason: str, chat: bool = False) -> bytes:
    """GenerateHandler's answer to an empty prompt, and ChatHandler's to no messages
    (server/routes.go): done at once, `done_reason` "load" (the model is loaded) or "unload"
    (keep_alive 0), no counts, no durations; chat's with an empty assistant message."""
    answer = b'"message":{"role":"assistant","content":""}' if chat else b'"response":""'
    return b'{"model":%s,"created_at":%s,%s,"done":true,"done_reason":"%s"}' % (
        orjson.dumps(model),
        created_at(),
        answer,
        reason.encode(),
    )


#: A Go duration of zero, as api.Duration reads a keep_alive string (time.ParseDuration).
_ZERO_DURATION = re.compile(r"[+-]?(?:0|(?:(?:0+(?:\.0*)?|\.0+)(?:ns|us|µs|μs|ms|s|m|h))+)")


def unloads(keep_alive: object) -> bool:
    """keep_alive zero: api.Duration takes a number of seconds or a Go duration string."""
    if isinstance(keep_alive, bool):
        return False
    if isinstance(keep_alive, int | float):
        return keep_alive == 0
    return isinstance(keep_alive, str) and _ZERO_DURATION.fullmatch(keep_alive) is not None


def unload_only(body: dict[str, Any], chat: bool) -> bool:
    """An unload request: no prompt (generate) or no messages (chat), keep_alive zero
    (server/routes.go GenerateHandler `req.Prompt == "" && ... Duration == 0`, ChatHandler
    `len(req.Messages) == 0 && ...`). It loads nothing."""
    return not body.get("messages" if chat else "prompt") and unloads(body.get("keep_alive"))


def version(configured: str) -> bytes:
    return orjson.dumps({"version": configured})
