"""llama.cpp's native `POST /completion` (and its alias `/completions`), when the simulator
plays `llama-server` (proxy/sim/llamacpp.py): its events, member for member as the captures
in tests/fixtures/streams/llamacpp/ (native_completion*.sse, .json) and llama.cpp's
tools/server/server-task.cpp (to_json_non_oaicompat_partial / _final) write them.

- Streamed: one `data:` event per pacer slot, `{"index", "content", "tokens", "stop": false,
  "id_slot": -1, "tokens_predicted", "tokens_evaluated"}` (`tokens_predicted` counting up),
  then the last object `{"index", "content": "", "tokens": [], "id_slot", "stop": true,
  "model", "tokens_predicted", "tokens_evaluated", "generation_settings", "prompt",
  "has_new_line", "truncated", "stop_type", "stopping_word", "tokens_cached", "timings"}`;
  no `[DONE]` (the faults that end a stream send none either). Not streamed: that last
  object with the whole text in `content`. No `usage`, no id.
- `stop_type`: "limit" for a `length` finish (n_predict, or the context full), "eos" for
  `stop`, "word" where a stop word ended it (`stopping_word` that word, "" otherwise);
  `x-sim-finish-reason` may name any other (none) as it is.
- `truncated`: true where the answer's last token (the EOS included) filled the context
  (controls.Plan.truncated; server-context.cpp process_token, without context shift). A
  stop word completed by that token ends as "limit", `stopping_word` still the word; an
  EOS there stays "eos" (the real binary at --ctx-size 256: both, `truncated` true).
- The EOS that ends a "stop" answer (controls.Plan.eos) is decoded in a step of its own
  and sent as a partial event of its own, `"content": ""`, `"tokens": [2]` (the EOS id of
  the captured Llama), `tokens_predicted` counting it (server-context.cpp process_token
  streams it before the EOG check: the real binary, a grammar forcing " upon upon" then
  EOS, streams `{"content":"","tokens":[2],...,"tokens_predicted":3}`, then the last
  object with `tokens_predicted` 3 and `timings.predicted_n` 3); the last object follows
  at once. No EOS after a length finish.
- `tokens_evaluated` is the whole prompt (cached tokens included), `tokens_cached` the
  slot's n_past: the prompt and every generated token but the last (the EOS included: 5
  for that 3-token prompt).
- `timings` as the chat route's (llamacpp.timings_json), from the simulator's own clock.
- A list of prompts (a list of texts or of token-id lists; a list of ids is one prompt)
  decodes together, one choice per prompt as `n` does on /v1/completions: `data: null`
  first, then every prompt's event at each step in index order, then each prompt's own
  last object (its own prompt count and timings; its `cache_n` 0). Not streamed, the
  answer is a JSON array of those last objects.
- Stop words (`stop`, a string or a list of them) are applied as llama-server applies
  them (proxy/sim/llamacpp_words.py, the rules of server-context.cpp process_token; the
  captures native_completion_stop*): text that may be the start of a word is held back,
  its token's event sent with `"content": ""`; the event of the token that completes a
  word sends the text before it and carries `timings` (send_partial_response adds them
  once the slot has stopped), then the last object: `stop_type` "word", `stopping_word`,
  `tokens_predicted` counting that token and no EOS. The EOS's event sends the text held
  at the end; n_predict cutting held text loses it in a stream (not streamed, `content`
  keeps it). `generation_settings.stop` echoes the words read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from proxy.sim.controls import Plan
from proxy.sim.exchange import Exchange
from proxy.sim.llamacpp import Clock, eos_step, paced_body, timings_json, word_timings
from proxy.sim.llamacpp_words import SentText, has_new_line, read_words
from proxy.sim.pacing import Pacer
from proxy.sim.state import Outcome
from proxy.sim.stream import SSE, fire_fault, paced_content
from proxy.sim.tokens import VOCAB, completion_text, count_prompt_tokens, text_json

#: finish_reason onto llama.cpp's stop_type (server-common.h).
STOP_TYPES = {"length": "limit", "stop": "eos"}
#: The captured `generation_settings` (b1-0c1e570); the request's own values replace some.
SETTINGS: dict[str, Any] = {
    "seed": 4294967295,
    "temperature": 0.8,
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "top_k": 40,
    "top_p": 0.949999988079071,
    "min_p": 0.05000000074505806,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.10000000149011612,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
    "dry_sequence_breakers": ["\n", ":", '"', "*"],
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.10000000149011612,
    "adaptive_target": -1.0,
    "adaptive_decay": 0.8999999761581421,
    "stop": [],
    "max_tokens": -1,
    "n_predict": -1,
    "n_keep": 0,
    "n_discard": 0,
    "ignore_eos": False,
    "stream": False,
    "logit_bias": [],
    "n_probs": 0,
    "min_keep": 0,
    "grammar": "",
    "grammar_lazy": False,
    "grammar_triggers": [],
    "preserved_tokens": [],
    "chat_format": "Content-only",
    "reasoning_format": "deepseek",
    "reasoning_in_content": False,
    "generation_prompt": "",
    "samplers": [
        "penalties",
        "dry",
        "top_n_sigma",
        "top_k",
        "typ_p",
        "top_p",
        "min_p",
        "xtc",
        "temperature",
    ],
    "speculative.types": "none",
    "timings_per_token": False,
    "post_sampling_probs": False,
    "backend_sampling": False,
    "lora": [],
}
#: The id of vocabulary token i (tokens.VOCAB): any fixed ids do.
TOKEN_ID_BASE = 100
#: The EOS token's id: the captured Llama's `</s>` (its /detokenize of [1, 2]: "<s></s>").
EOS_TOKEN_ID = 2


def prompts_of(plan: Plan, body: dict[str, Any]) -> list[Any]:
    """The prompts: a list of them was planned as that many choices (controls._prompts)."""
    prompt = body.get("prompt")
    return list(prompt) if plan.n > 1 and isinstance(prompt, list) else [prompt]


def settings_json(body: dict[str, Any], stream: bool) -> bytes:
    limit = body.get("n_predict", body.get("max_tokens"))
    limit = limit if type(limit) is int else -1
    temperature = body.get("temperature")
    own = {
        "temperature": float(temperature) if isinstance(temperature, int | float) else None,
        "seed": body.get("seed"),
        "ignore_eos": body.get("ignore_eos"),
        "stop": list(read_words(body.get("stop"))),
    }
    settings = {**SETTINGS, "max_tokens": limit, "n_predict": limit, "stream": stream}
    settings.update({k: v for k, v in own.items() if v is not None})
    return orjson.dumps(settings)


def token_ids(count: int, start: int) -> bytes:
    n = len(VOCAB)
    return orjson.dumps([TOKEN_ID_BASE + i % n for i in range(start, start + count)])


class NativeWire:
    """The events of one native completion, a prompt per index. Build once per request."""

    __slots__ = ("_model", "_plan", "_prompts", "_settings", "evaluated", "predicted")

    def __init__(self, plan: Plan, body: dict[str, Any]) -> None:
        prompts = prompts_of(plan, body)
        self._plan = plan
        self._model = orjson.dumps(plan.model)
        self._settings = settings_json(body, plan.stream)
        self._prompts = [orjson.dumps(p if isinstance(p, str) else "") for p in prompts]
        self.evaluated = (
            [plan.prompt_tokens]
            if len(prompts) == 1
            else [count_prompt_tokens({"prompt": p}) for p in prompts]
        )
        self.predicted = [0] * len(prompts)

    def content(
        self,
        text: bytes,
        usage: bytes | None = None,
        index: int = 0,
        tokens: int = 0,
        clock: Clock | None = None,
    ) -> bytes:
        """A partial event: `text` (escaped for a JSON string) and its `tokens` ids; with
        `clock`, the `timings` of the partial whose token completes a stop word."""
        start = self.predicted[index]
        self.predicted[index] = start + tokens
        timings = None
        if clock is not None:
            timings = word_timings(self._plan_of(index), clock, start + tokens)
        return self._partial(index, text, token_ids(tokens, start), timings)

    def eos(self, index: int, text: bytes = b"") -> bytes:
        """The EOS token's partial event: its id, counted, and no text of its own (but
        what stop words held back)."""
        self.predicted[index] += 1
        return self._partial(index, text, b"[%d]" % EOS_TOKEN_ID)

    def _partial(self, index: int, text: bytes, ids: bytes, timings: bytes | None = None) -> bytes:
        head = b'data: {"index":%d,"content":"%s","tokens":%s,"stop":false,"id_slot":-1,' % (
            index,
            text,
            ids,
        )
        counts = b'"tokens_predicted":%d,"tokens_evaluated":%d' % (
            self.predicted[index],
            self.evaluated[index],
        )
        return head + counts + (b"" if timings is None else b',"timings":' + timings) + b"}\n\n"

    def _plan_of(self, index: int) -> Plan:
        """The plan as prompt `index` sees it: its own prompt count, nothing cached."""
        if len(self.evaluated) == 1:
            return self._plan
        return replace(self._plan, prompt_tokens=self.evaluated[index], cached_tokens=None)

    def last(self, index: int, text: str, predicted: int, clock: Clock) -> bytes:
        """A prompt's last object (without the `data: ` frame); `predicted` counts the EOS
        where one ended it."""
        plan, evaluated = self._plan_of(index), self.evaluated[index]
        reason, hit = plan.finish_reason, plan.word_hit
        # a word whose token filled the context ends as "limit" (controls: "length")
        word = hit is not None and not plan.truncated
        new_line = has_new_line(plan.words, predicted - plan.eos, plan.eos)
        return (
            b'{"index":%d,"content":%s,"tokens":[],"id_slot":%d,"stop":true,"model":%s,'
            b'"tokens_predicted":%d,"tokens_evaluated":%d,"generation_settings":%s,'
            b'"prompt":%s,"has_new_line":%s,"truncated":%s,"stop_type":%s,'
            b'"stopping_word":%s,"tokens_cached":%d,"timings":%s}'
            % (
                index,
                orjson.dumps(text),
                index,
                self._model,
                predicted,
                evaluated,
                self._settings,
                self._prompts[index],
                b"true" if new_line else b"false",
                b"true" if plan.truncated else b"false",
                b'"word"' if word else orjson.dumps(STOP_TYPES.get(reason, reason)),
                orjson.dumps("" if hit is None else hit.word),
                evaluated + max(0, predicted - 1),
                timings_json(plan, clock, predicted),
            )
        )


async def stream_native(ex: Exchange, plan: Plan, body: dict[str, Any], pacer: Pacer) -> Outcome:
    clock = Clock(ex)
    events = NativeWire(plan, body)
    choices = range(plan.n)
    plan = replace(plan, no_done=True)  # the native stream has no [DONE], after a fault too
    await ex.start(200, SSE)
    if plan.n > 1:
        await ex.write(b"data: null\n\n")

    words = SentText(plan.words) if plan.words else None  # every prompt's text is the same

    def content(count: int, sent: int) -> list[bytes]:
        clock.token()
        if words is None:
            text = text_json(count, sent)
            return [events.content(text, None, i, count) for i in choices]
        text = words.step(count, sent)
        return [events.content(text, None, i, count, clock) for i in choices]

    async def fire(fault: str) -> bool:
        return await fire_fault(ex, plan, events, pacer, fault)

    sent = await paced_content(ex, plan, pacer, content, fire)
    if sent is None:
        return "fault"
    if plan.eos:  # the EOS token's step (paced_content waited for it)
        sent = eos_step(ex, plan, clock, sent)
        held = b"" if words is None else words.eos()
        for i in choices:
            await ex.write(events.eos(i, held))
    ex.record.finish_reason = plan.finish_reason
    for i in choices:
        await ex.write(b"data: " + events.last(i, "", sent, clock) + b"\n\n")
    outcome: Outcome = "fault" if ex.record.fault else "completed"
    await ex.end(b"", outcome)
    return outcome


async def complete_native(ex: Exchange, plan: Plan, body: dict[str, Any], pacer: Pacer) -> Outcome:
    """Every token's slot passes, then the last object with the whole text (an array of
    them for a list of prompts)."""
    clock = await paced_body(ex, plan, pacer)
    events = NativeWire(plan, body)
    n, hit = plan.output_tokens, plan.word_hit
    text = completion_text(n) if hit is None else hit.text  # held text kept, as the slot's
    lasts = [events.last(i, text, n + plan.eos, clock) for i in range(plan.n)]
    await ex.reply(200, lasts[0] if plan.n == 1 else b"[" + b",".join(lasts) + b"]")
    return "completed"
