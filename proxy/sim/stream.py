"""Generate one completion as vLLM would: streamed event by event, or all at once.

Streamed chat: the role-only chunk goes out as vLLM 0.32 sends it, with its first engine
output (chat_completion/serving.py, chat_completion_stream_generator: `first_iteration`,
the role chunks sent for the first RequestOutput, just before that output's own chunk), so
at the TTFT, just before the first token's chunk; content chunks follow on the pacer's
schedule; then the finish chunk (an EOS's one pacer slot after the last text: vLLM
decodes the EOS in a step of its own), the usage chunk if asked for, and `data: [DONE]`.
Completions have no role chunk. Chat with `echo: true` gives the prompt's last message
back after the role chunks, one content chunk per choice (`echoed_message`).

The first engine output is whatever the stream says first after the prefill: the first
token, an empty completion's EOS (the role chunk, then the finish chunk), or a fault's
event at that slot (vLLM's `error_event` is a GenerationError raised after the role
chunks went out; the simulator's other injected events are treated alike). A `stall`
delays it with the token; a stream cut there (`close_no_done`, `reset`) never sent it.
`x-sim-early-role: 1` (or `tokenprobe sim --early-role`, SimConfig.early_role) sends
the role chunks with the headers instead, at t~0, long before the first token: not
vLLM, but the shape that shows at once a proxy taking the first chunk for the first token.

Where the finish goes follows vLLM (chat_completion/serving.py and completion/serving.py
send `finish_reason` on the chunk of the engine output that ends the choice): a
generation cut by its token limit ("length") ends on a token with text, so the last
content chunk carries the finish and no finish chunk follows; one that ends with EOS
("stop" and the rest) ends on a token without text, the finish chunk with empty text.

With `n` > 1 every choice streams on its own (`"index": i`, one choice per chunk): a
role chunk each, all of them with the first engine output (vLLM's `first_iteration`
loop over `range(num_choices)`), then at every pacer slot (one engine step) a chunk each
in index order, then a finish each; the usage chunk counts the prompt once and every
choice's tokens. Under continuous usage each role chunk carries the prompt and 0
completion tokens, as vLLM's does.

Faults fire at the slot where the next content chunk is due, once `fault_after`
tokens have been sent (after the last token if there are fewer). Ending faults stop
the stream there; passing ones insert their event (or silence) and the stream
carries on as planned. `reset` returns without finishing the body: uvicorn then
closes the connection without the last chunk of the chunked body (the client sees
"incomplete chunked read") and logs one line, "ASGI callable returned without
completing response".
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson

from proxy.core.apis.chat import echo_text
from proxy.core.lax import lax_bool
from proxy.sim import wire
from proxy.sim.controls import ENDING_FAULTS, Plan, burn_cpu
from proxy.sim.engine import metrics_json
from proxy.sim.exchange import Exchange
from proxy.sim.pacing import Pacer
from proxy.sim.state import Outcome
from proxy.sim.stops import HeldText
from proxy.sim.tokens import completion_text, text_json

SSE = b"text/event-stream; charset=utf-8"
#: Ollama's `&openai.Usage{}` on every completion chunk when usage is asked for.
ZERO_USAGE = b'{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}'
_NON_UTF8 = b"\xff\xfe"
#: Faults that send no event where they fire: a stall holds the first engine output back,
#: a cut ends the stream before it.
SILENT_FAULTS = frozenset({"stall", "close_no_done", "reset"})


async def stream(ex: Exchange, plan: Plan, sse: StreamChunks, pacer: Pacer) -> Outcome:
    """A `data:`-chunk stream: chat, completions, and the audio APIs' (proxy/sim/audio.py)."""
    record = ex.record
    await ex.start(200, SSE)
    usage_every = plan.continuous_usage
    choices = range(plan.n)
    roles: list[bytes] = []  # one role chunk per choice, all before any token
    if plan.kind == "chat" and isinstance(sse, wire.StreamWire):
        role_usage = _every(plan, 0) if usage_every else None
        roles = [sse.role(role_usage, i) for i in choices]
        echo = echoed_message(ex.record.body)
        if echo is not None:  # after every role chunk, before any token
            roles += [sse.echo(echo, role_usage, i) for i in choices]
        if plan.early_role:
            for data in roles:
                await ex.write(data)
            roles = []

    def opening() -> list[bytes]:
        """The role chunks not yet sent: they go with the first engine output."""
        nonlocal roles
        out, roles = roles, []
        return out

    zeroed = plan.include_usage and plan.usage_mode == "zeroed"
    separate = plan.include_usage and plan.usage_mode in ("separate", "zeroed")
    on_last = plan.include_usage and plan.usage_mode == "last_chunk"
    fingerprint = None if separate else sse.fingerprint
    # The token limit and a stop string end a generation at a token with text: vLLM
    # sends the finish with it. An EOS is a token of its own without text: its finish
    # chunk has no text (but what stop strings held back), unless it comes in the same
    # engine step as the last text tokens (several tokens a step), whose chunk then ends.
    hit = plan.stop_hit
    shares_step = plan.eos_shares_step
    ends_on_token = (
        plan.finish_reason == "length" or hit is not None or shares_step
    ) and plan.output_tokens > 0
    stop_reason = None if hit is None else hit.string
    held = None if plan.stops is None else HeldText(plan.stops, hit, plan.output_tokens)

    def finish_usage(i: int, sent: int) -> bytes | None:
        """The finish chunk's usage; `sent` counts the EOS where it carries one."""
        if usage_every:  # each choice's own count, as every chunk's
            return _every(plan, sent)
        return _usage(plan, sent * plan.n) if on_last and i == plan.n - 1 else None

    def content(count: int, sent: int) -> list[bytes]:
        now = sent + count
        ends = ends_on_token and now >= plan.output_tokens
        text = text_json(count, sent) if held is None else held.step(count, sent, ends)
        if ends:
            now += plan.eos if shares_step else 0
            return opening() + [
                sse.last(
                    text, plan.finish_reason, finish_usage(i, now), fingerprint, i, stop_reason
                )
                for i in choices
            ]
        usage = _every(plan, now) if usage_every else ZERO_USAGE if zeroed else None
        return opening() + [sse.content(text, usage, i) for i in choices]

    async def fire(fault: str) -> bool:
        if fault not in SILENT_FAULTS:  # an event at the slot: the role chunks go first
            for data in opening():
                await ex.write(data)
        return await fire_fault(ex, plan, sse, pacer, fault)

    sent = await paced_content(ex, plan, pacer, content, fire)
    if sent is None:
        return "fault"
    record.finish_reason = plan.finish_reason
    if shares_step:
        sent += plan.eos
        record.completion_tokens = sent * plan.n
    if not ends_on_token:
        # The EOS token's chunk: no text of its own (but what stop strings held back),
        # counted in usage as vLLM counts its token id.
        rest = b"" if held is None else held.rest()
        sent += plan.eos
        record.completion_tokens = sent * plan.n
        for data in opening():  # an empty completion: its EOS is the first engine output
            await ex.write(data)
        for i in choices:
            usage = finish_usage(i, sent)
            await ex.write(
                sse.last(rest, plan.finish_reason, usage, fingerprint, i)
                if rest
                else sse.finish(plan.finish_reason, usage, fingerprint, i)
            )
    if separate:
        usage = _usage(plan, sent * plan.n)  # the prompt once, every choice's tokens
        metrics = engine_metrics(ex, plan, sent, streamed=True)
        await ex.write(sse.usage(usage, sse.fingerprint, metrics))
    outcome: Outcome = "fault" if record.fault else "completed"
    await ex.end(b"" if plan.no_done else wire.DONE, outcome)
    return outcome


def echoed_message(body: Any) -> bytes | None:
    """The text chat's `echo` streams back, JSON-escaped, or None: vLLM's rule, which the
    proxy reads by too (proxy/core/apis/chat.py `echo_text`: the last message's content,
    a list of parts as their non-empty texts joined with "\\n", when its role is the
    answer's and that text is not empty)."""
    if not isinstance(body, dict) or lax_bool(body.get("echo")) is not True:
        return None
    text = echo_text(body)
    return None if text is None else orjson.dumps(text)[1:-1]


async def paced_content(
    ex: Exchange,
    plan: Plan,
    pacer: Pacer,
    content: Callable[[int, int], list[bytes]],
    fire: Callable[[str], Awaitable[bool]],
) -> int | None:
    """The token schedule every API shares: at each pacer slot, `content(count, sent)`
    gives the writes for the next `count` tokens (after `sent`), and the planned fault
    fires at its slot. With `n` choices, each slot is one step that gives every choice
    `count` tokens. Returns the tokens each choice was sent, or None when a fault ended
    the stream."""
    record = ex.record
    n, per_chunk = plan.output_tokens, plan.tokens_per_chunk
    pending = plan.fault
    sent = slots = 0
    while sent < n:
        await (pacer.first() if slots == 0 else pacer.next())
        slots += 1
        if pending is not None and sent >= plan.fault_after:
            record.fault, pending = pending, None
            if not await fire(record.fault):
                return None
        count = min(per_chunk, n - sent)
        burn_cpu(plan.cpu_per_token * count * plan.n)
        writes = content(count, sent)
        sent += count
        record.completion_tokens = sent * plan.n
        if record.first_token_at is None:
            record.first_token_at = time.monotonic()
        for data in writes:
            await ex.write(data)
    if pending is not None:
        await (pacer.first() if slots == 0 else pacer.next())
        record.fault = pending
        if not await fire(pending):
            return None
    elif slots == 0:
        await pacer.first()  # an empty completion still ends when its EOS token is due
    elif plan.eos and not plan.eos_shares_step:
        await pacer.next()  # the EOS is decoded in an engine step of its own
    return sent


async def paced_whole(ex: Exchange, plan: Plan, pacer: Pacer, finish_reason: str | None) -> None:
    """A non-streamed response's time: every token's slot passes (the EOS's too, and their
    CPU is burnt), then the record says the tokens left, all at once, with the body."""
    generated = plan.output_tokens + plan.eos
    chunks = -(-generated // plan.tokens_per_chunk)
    per_chunk = plan.tokens_per_chunk
    await pacer.first()
    for i in range(chunks):
        if i:
            await pacer.next()
        tokens = min(per_chunk, generated - i * per_chunk)
        burn_cpu(plan.cpu_per_token * tokens * plan.n)
    ex.record.completion_tokens = (plan.output_tokens + plan.eos) * plan.n
    ex.record.finish_reason = finish_reason
    ex.record.first_token_at = time.monotonic()  # the tokens leave with the body


class Chunks(Protocol):
    def content(self, text: bytes, usage: bytes | None = None) -> bytes:
        """A valid chunk carrying `text` (escaped for the inside of a JSON string)."""
        ...


class StreamChunks(Chunks, Protocol):
    fingerprint: bytes | None  # chat's system_fingerprint (JSON), None where none is sent

    def content(self, text: bytes, usage: bytes | None = None, index: int = 0) -> bytes:
        """Choice `index`'s chunk carrying `text`."""
        ...

    def last(
        self,
        text: bytes,
        finish_reason: str,
        usage: bytes | None = None,
        fingerprint: bytes | None = None,
        index: int = 0,
        stop_reason: str | None = None,
    ) -> bytes:
        """The chunk of the token that ends choice `index`: its text and the finish."""
        ...

    def finish(
        self,
        finish_reason: str,
        usage: bytes | None = None,
        fingerprint: bytes | None = None,
        index: int = 0,
    ) -> bytes:
        """Choice `index`'s finish after an EOS token: no text."""
        ...

    def usage(
        self, usage: bytes, fingerprint: bytes | None = None, metrics: bytes | None = None
    ) -> bytes: ...


async def fire_fault(ex: Exchange, plan: Plan, sse: Chunks, pacer: Pacer, fault: str) -> bool:
    """Inject `fault` into a `data:`-chunk stream; return whether the stream goes on."""
    if fault == "stall":
        await pacer.pause(plan.stall)
    elif fault == "malformed":
        await ex.write(wire.MALFORMED_EVENT)
    elif fault == "non_utf8":
        await ex.write(sse.content(_NON_UTF8))
    elif fault == "huge_event":
        overhead = len(sse.content(b""))
        await ex.write(sse.content(b"x" * max(0, plan.huge_bytes - overhead)))
    elif fault in ("error_event", "error_string"):
        event = wire.ERROR_EVENT if fault == "error_event" else wire.ERROR_STRING_EVENT
        await ex.end(event if plan.no_done else event + wire.DONE, "fault")
    elif fault == "close_no_done":
        await ex.end(b"", "fault")
    # "reset": send nothing more and leave the body unfinished.
    return fault not in ENDING_FAULTS


async def complete(
    ex: Exchange,
    plan: Plan,
    pacer: Pacer,
    response_id: str,
    created: int,
    fingerprint: str | None = None,
) -> Outcome:
    """The non-streamed response: all tokens' time passes, then one JSON body."""
    hit = plan.stop_hit
    await paced_whole(ex, plan, pacer, plan.finish_reason)
    body = wire.full_completion(
        plan.kind == "chat",
        response_id,
        created,
        plan.model,
        completion_text(plan.output_tokens) if hit is None else hit.text,
        plan.finish_reason,
        wire.full_usage_json(
            plan.prompt_tokens,
            (plan.output_tokens + plan.eos) * plan.n,
            plan.cached_tokens,
            _cache_writes(plan),
        ),
        engine_metrics(ex, plan, plan.output_tokens + plan.eos, streamed=False),
        n=plan.n,
        stop_reason=None if hit is None else hit.string,
        fingerprint=fingerprint,
    )
    await ex.reply(200, body)
    return "completed"


def engine_metrics(ex: Exchange, plan: Plan, sent: int, streamed: bool) -> bytes | None:
    """vLLM's per-request `metrics`, from what this exchange did (proxy/sim/engine.py);
    none for `n` > 1, whose figures belong to no one choice (vLLM leaves them out)."""
    if not plan.metrics or plan.n > 1:
        return None
    record, now = ex.record, time.monotonic()
    arrived = record.queued_at if record.queued_at is not None else record.started
    scheduled = record.scheduled_at if record.scheduled_at is not None else arrived
    first = record.first_token_at if streamed else None
    if first is None:  # not streamed: the first token was due one TTFT after scheduling
        first = min(now, scheduled + plan.ttft)
    return metrics_json(
        queue=scheduled - arrived,
        first_token=max(0.0, first - scheduled),
        generation=max(0.0, now - first),
        output_tokens=sent,
        chunks=-(-sent // plan.tokens_per_chunk),
        spec=plan.spec,
        null_spec=not streamed,
    )


def _usage(plan: Plan, completion_tokens: int) -> bytes:
    return wire.usage_json(
        plan.prompt_tokens, completion_tokens, plan.cached_tokens, _cache_writes(plan)
    )


def _cache_writes(plan: Plan) -> int | None:
    """`created_cache_tokens`: only chat sets it (completion/serving.py passes only
    `cached_tokens` to PromptTokenUsageInfo), and only with the details."""
    if plan.kind != "chat" or plan.cached_tokens is None:
        return None
    return wire.cache_writes(plan.prompt_tokens, plan.cached_tokens, plan.cache_block)


def _every(plan: Plan, completion_tokens: int) -> bytes:
    """The usage on every chunk under continuous usage (wire.continuous_usage_json)."""
    return wire.continuous_usage_json(plan.kind == "chat", plan.prompt_tokens, completion_tokens)
