"""The simulator as llama.cpp's `llama-server` (SimConfig.backend_kind / `x-sim-backend-kind:
llamacpp`): its chat and completions shapes, its `timings` where it writes them, `/props`.

Checked in llama.cpp as vendored in the llama-cpp-python 0.3.36 sdist (commit 0c1e570, the
build .ci/llama makes) and against the captures in tests/fixtures/streams/llamacpp/:

- Chunks (`tools/server/server-task.cpp`, to_json_oaicompat_chat_stream / to_json_oaicompat):
  chat  {"choices":[{"finish_reason":null,"index":0,"delta":{...}}],"created","id","model",
         "system_fingerprint","object":"chat.completion.chunk"}, a first chunk with
         `delta: {role: assistant, content: null}`, a finish chunk with `delta: {}`;
  completions  {"choices":[{"text","index":0,"logprobs":null,"finish_reason":null}],
         "created","model","system_fingerprint","object":"text_completion","id"}.
  Ids are "chatcmpl-" + random on both (server-common.cpp gen_chatcmplid).
- `timings` (server_slot_stats::to_json, server-common.cpp) is the last member of the last
  chunk: the chat finish chunk, or with `stream_options.include_usage` the usage chunk
  (`"choices":[]`, after `usage`) and then the finish chunk has none; completions streams
  carry `usage` and `timings` on the finish chunk whether asked or not. Non-streamed bodies
  carry both after `id`.
- usage always has `prompt_tokens_details.cached_tokens`, equal to `cache_n`.
- `/props` answers `build_info` (server-context.cpp, the props json); there is no `/version`.

The figures are what the simulator did, on its own clock, to the microsecond as llama.cpp's
`ggml_time_us`: `prompt_ms` from the engine having the request (routed to generation, or a
free slot under max_num_seqs: llama.cpp's wait for a slot is before its `t_start`, so
outside the engine) to the first token's write; `predicted_ms` from there to the last
token's; `cache_n` the plan's cached tokens (x-sim-cached-tokens or the prefix cache), at
most all but one prompt token, as llama.cpp evaluates at least one ("need to evaluate at
least 1 token", server-context.cpp; the captured repeat: 121 of 122), none for a request
with `"cache_prompt": false`; `prompt_n` the rest.
The per-token and per-second rates follow server-common.h (decode over `n_gen - 1` steps, 0
where there is nothing to divide).

The EOS that ends a "stop" answer is a token of its own, decoded in a step of its own, as
in the vLLM mode (controls.Plan.eos, the same rules: none after a length finish). llama-
server counts it (server-context.cpp process_token runs for it, `n_decoded` included,
before the EOG check sets STOP_TYPE_EOS; the real binary with a grammar that forces two
words then EOS: `completion_tokens` 3, `predicted_n` 3) and sends the finish at its step,
where `predicted_ms` ends. Its partial has no text: /v1/completions streams it as a chunk
with `"text": ""`, chat's empty diff sends no chunk.

`stop` is llama-server's stop words here, one slot loop for all its routes
(proxy/sim/llamacpp_words.py): the text is cut before the word, finish_reason "stop"
(STOP_TYPE_WORD, to_json_oaicompat), no EOS; the chunk of the token that completes it
carries `timings` as well as the finish; a token whose text is held back streams a chunk
of empty text on /v1/completions and none on chat; the EOS's partial sends what was held.

The chat role chunk leaves at once, as in the vLLM mode, but llama-server sends it with the
first token's partial (server-task.cpp to_json_oaicompat_chat: the role delta when
`n_decoded == 1`, then the text diffs, `timings` on the last of them). Where the first
token completes a stop word with no text before it, that partial's only chunk is the role
chunk, and it carries the `timings`: so where the first step completes a word, the role
chunk waits for it and goes out with its partial (the real binary, a grammar of " upon
upon upon" with `stop: [" up"]`: the role chunk with `timings`, predicted_n 1, then the
finish chunk).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from proxy.sim import wire
from proxy.sim.controls import Plan, burn_cpu
from proxy.sim.exchange import Exchange
from proxy.sim.llamacpp_words import SentText
from proxy.sim.pacing import Pacer
from proxy.sim.state import Outcome
from proxy.sim.stream import SSE, fire_fault, paced_content
from proxy.sim.tokens import completion_text, text_json

#: What the simulator's /props says it is: llama.cpp's "b<build>-<commit>" form.
BUILD_INFO = "b1-sim"


class Clock:
    """The instants `timings` is made of, kept as the request runs."""

    __slots__ = ("first", "last", "start")

    def __init__(self, ex: Exchange) -> None:
        record = ex.record
        start = record.scheduled_at if record.scheduled_at is not None else record.queued_at
        self.start = start if start is not None else record.started
        self.first: float | None = None  # the first token's write
        self.last: float | None = None  # the last token's write

    def token(self) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
        self.last = now


def no_cache(plan: Plan, body: dict[str, Any]) -> bool:
    """`"cache_prompt": false` (default true, server-task.h): llama.cpp reuses nothing of
    its cache for this prompt (server-context.cpp: n_past from the common prefix only when
    `params.cache_prompt`), so the prefix cache is neither asked nor told."""
    return plan.backend == "llamacpp" and body.get("cache_prompt") is False


def cache_n(plan: Plan) -> int:
    return min(plan.cached_tokens or 0, max(0, plan.prompt_tokens - 1))


def _ms(seconds: float) -> float:
    return round(seconds * 1e6) / 1e3  # whole microseconds, as ggml_time_us


def timings_json(plan: Plan, clock: Clock, predicted_n: int) -> bytes:
    """`server_slot_stats::to_json`, in its member order."""
    cached = cache_n(plan)
    prompt_n = plan.prompt_tokens - cached
    first = clock.first if clock.first is not None else time.monotonic()
    last = clock.last if clock.last is not None else first
    prompt_ms, predicted_ms = _ms(max(0.0, first - clock.start)), _ms(max(0.0, last - first))
    steps = max(0, predicted_n - 1)
    return orjson.dumps(
        {
            "cache_n": cached,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n > 0 else 0.0,
            "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps > 0 else 0.0,
            "predicted_per_second": 1e3 / predicted_ms * steps if predicted_ms > 0 else 0.0,
        }
    )


def usage_json(plan: Plan, completion_tokens: int) -> bytes:
    """`usage_json_oaicompat`: cached_tokens is cache_n, always written."""
    return (
        b'{"completion_tokens":%d,"prompt_tokens":%d,"total_tokens":%d,'
        b'"prompt_tokens_details":{"cached_tokens":%d}}'
        % (
            completion_tokens,
            plan.prompt_tokens,
            plan.prompt_tokens + completion_tokens,
            cache_n(plan),
        )
    )


class LlamaWire:
    """The chunks of one llama.cpp stream. Build once per request; call per chunk."""

    __slots__ = ("_chat", "_choice_post", "_tail", "_tail_no_id", "fingerprint", "id_json")

    def __init__(self, chat: bool, response_id: str, created: int, model: str) -> None:
        self._chat = chat
        self.fingerprint = orjson.dumps(BUILD_INFO)
        self.id_json = orjson.dumps(response_id)
        meta = b'"created":%d' % created
        if chat:
            self._tail = (
                b',%s,"id":%s,"model":%s,"system_fingerprint":%s,'
                b'"object":"chat.completion.chunk"'
                % (meta, self.id_json, orjson.dumps(model), self.fingerprint)
            )
            self._tail_no_id = self._tail
        else:
            self._tail_no_id = (
                b',%s,"model":%s,"system_fingerprint":%s,"object":"text_completion"'
                % (
                    meta,
                    orjson.dumps(model),
                    self.fingerprint,
                )
            )
            self._tail = self._tail_no_id + b',"id":' + self.id_json
        self._choice_post = b"}]"

    def role(self, timings: bytes | None = None) -> bytes:
        """The role chunk; `timings` where it is the last chunk of a partial that ended
        the slot (a stop word completed by the first token)."""
        tail = self._tail if timings is None else self._tail + b',"timings":' + timings
        return (
            b'data: {"choices":[{"finish_reason":null,"index":0,'
            b'"delta":{"role":"assistant","content":null}}]' + tail + b"}\n\n"
        )

    def content(
        self, text: bytes, usage: bytes | None = None, timings: bytes | None = None
    ) -> bytes:
        """A content chunk; `text` is already escaped for the inside of a JSON string.
        `timings` last, where the slot had stopped when it was sent (a stop word's)."""
        if self._chat:
            choice = b'{"finish_reason":null,"index":0,"delta":{"content":"%s"}}' % text
        else:
            choice = b'{"text":"%s","index":0,"logprobs":null,"finish_reason":null}' % text
        tail = self._tail if timings is None else self._tail + b',"timings":' + timings
        return b'data: {"choices":[' + choice + b"]" + tail + b"}\n\n"

    def finish(self, finish_reason: str, usage: bytes | None, timings: bytes | None) -> bytes:
        reason = orjson.dumps(finish_reason)
        if self._chat:
            choice = b'{"finish_reason":%s,"index":0,"delta":{}}' % reason
            body = b'data: {"choices":[' + choice + b"]" + self._tail
        else:  # completions: usage between object and id (to_json_oaicompat)
            choice = b'{"text":"","index":0,"logprobs":null,"finish_reason":%s}' % reason
            body = b'data: {"choices":[' + choice + b"]" + self._tail_no_id
            body += b"" if usage is None else b',"usage":' + usage
            body += b',"id":' + self.id_json
        return body + (b"" if timings is None else b',"timings":' + timings) + b"}\n\n"

    def usage(self, usage: bytes, timings: bytes) -> bytes:
        return (
            b'data: {"choices":[]' + self._tail + b',"usage":' + usage
            + b',"timings":' + timings + b"}\n\n"
        )  # fmt: skip


async def stream_llamacpp(
    ex: Exchange, plan: Plan, chat: bool, created: int, pacer: Pacer
) -> Outcome:
    clock = Clock(ex)
    sse = LlamaWire(chat, _llama_id(ex.record.id), created, plan.model)
    await ex.start(200, SSE)
    hit = plan.word_hit
    # the first partial ends the slot on a stop word: the role chunk goes with it
    role_waits = chat and hit is not None and hit.tokens <= plan.tokens_per_chunk
    if chat and not role_waits:
        await ex.write(sse.role())

    words = SentText(plan.words) if plan.words else None

    def content(count: int, sent: int) -> list[bytes]:
        clock.token()
        if words is None:
            return [sse.content(text_json(count, sent))]
        text = words.step(count, sent)
        timings = word_timings(plan, clock, sent + count)
        role = role_waits and sent == 0
        if chat and not text:  # held back or cut: chat's empty diff sends no chunk of its own
            return [sse.role(timings)] if role else []
        return [*([sse.role()] if role else []), sse.content(text, None, timings)]

    async def fire(fault: str) -> bool:
        return await fire_fault(ex, plan, sse, pacer, fault)

    sent = await paced_content(ex, plan, pacer, content, fire)
    if sent is None:
        return "fault"
    if plan.eos:  # the EOS token's step (paced_content waited for it)
        sent = eos_step(ex, plan, clock, sent)
        # its partial: what stop words held back, else a chunk of empty text (chat's
        # empty diff sends none)
        held = b"" if words is None else words.eos()
        if held or not chat:
            await ex.write(sse.content(held))
    ex.record.finish_reason = plan.finish_reason
    timings = timings_json(plan, clock, sent)
    usage = usage_json(plan, sent)
    if not chat:
        await ex.write(sse.finish(plan.finish_reason, usage, timings))
    elif plan.include_usage:
        await ex.write(sse.finish(plan.finish_reason, None, None))
        await ex.write(sse.usage(usage, timings))
    else:
        await ex.write(sse.finish(plan.finish_reason, None, timings))
    outcome: Outcome = "fault" if ex.record.fault else "completed"
    await ex.end(b"" if plan.no_done else wire.DONE, outcome)
    return outcome


def word_timings(plan: Plan, clock: Clock, predicted: int) -> bytes | None:
    """The `timings` of the partial whose token completes a stop word: process_token sets
    the slot's `stop` before send_partial_response, which then adds them (server-context.cpp;
    the captures *stop*); none on any other partial."""
    hit = plan.word_hit
    return None if hit is None or predicted < hit.tokens else timings_json(plan, clock, predicted)


def eos_step(ex: Exchange, plan: Plan, clock: Clock, sent: int) -> int:
    """The EOS token, decoded: llama-server counts it in `n_decoded` (process_token is
    called for it before the EOG check ends the slot: server-context.cpp), so in
    `tokens_predicted`, `predicted_n` and `completion_tokens`, and its step is the last
    one `predicted_ms` runs to. Returns the tokens each choice was predicted."""
    clock.token()
    burn_cpu(plan.cpu_per_token * plan.eos * plan.n)
    sent += plan.eos
    ex.record.completion_tokens = sent * plan.n
    return sent


async def paced_body(ex: Exchange, plan: Plan, pacer: Pacer) -> Clock:
    """A non-streamed answer's time: every token's slot passes (the EOS's too, its CPU
    burnt, for every choice), on the clock `timings` is made of; then the record says the
    tokens left."""
    clock = Clock(ex)
    per_chunk, n = plan.tokens_per_chunk, plan.output_tokens + plan.eos
    await pacer.first()
    clock.token()
    for i in range(-(-n // per_chunk)):
        if i:
            await pacer.next()
            clock.token()
        burn_cpu(plan.cpu_per_token * min(per_chunk, n - i * per_chunk) * plan.n)
    record = ex.record
    record.completion_tokens, record.finish_reason = n * plan.n, plan.finish_reason
    record.first_token_at = time.monotonic()  # the tokens leave with the body
    return clock


async def complete_llamacpp(
    ex: Exchange, plan: Plan, chat: bool, created: int, pacer: Pacer
) -> Outcome:
    """The non-streamed body: every token's slot passes, then usage and timings after id."""
    clock = await paced_body(ex, plan, pacer)
    record, n, hit = ex.record, plan.output_tokens, plan.word_hit
    text, predicted = completion_text(n) if hit is None else hit.text, n + plan.eos
    if chat:
        choice: dict[str, object] = {
            "finish_reason": plan.finish_reason,
            "index": 0,
            "message": {"role": "assistant", "content": text},
        }
    else:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": plan.finish_reason}
    body = {
        "choices": [choice],
        "created": created,
        "model": plan.model,
        "system_fingerprint": BUILD_INFO,
        "object": "chat.completion" if chat else "text_completion",
        "usage": orjson.Fragment(usage_json(plan, predicted)),
        "id": _llama_id(record.id),
        "timings": orjson.Fragment(timings_json(plan, clock, predicted)),
    }
    await ex.reply(200, orjson.dumps(body))
    return "completed"


def props(model: str, n_ctx: int) -> bytes:
    """GET /props: the members a client reads first (server-context.cpp, the props json)."""
    return orjson.dumps(
        {
            "default_generation_settings": {"n_ctx": n_ctx},
            "total_slots": 1,
            "model_alias": model,
            "model_path": f"/models/{model}.gguf",
            "build_info": BUILD_INFO,
        }
    )


def _llama_id(record_id: str) -> str:
    """llama.cpp names chat and completions alike: "chatcmpl-" + the request's own part."""
    return "chatcmpl-" + record_id.split("-", 1)[-1]
