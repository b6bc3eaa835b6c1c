"""The OTLP metrics' instruments: names, units, descriptions and bucket bounds, one each.

The GenAI semantic conventions' two name sets (CURRENT, PREVIOUS), tokenprobe's own
figures (FIGURES, one row per figure of the record), the request, cost and in-flight
counters, the conversation figures and the WebSocket session figures. Nothing here
records or exports; proxy/sinks/otlp/sink.py does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from proxy.core.buckets import (
    DECODE_SPEED_BUCKETS,
    OVERHEAD_BUCKETS,
    TOKENS_PER_CHUNK_BUCKETS,
    WS_SESSION_BUCKETS,
)
from proxy.core.measurement import Measurement
from proxy.sinks.metrics import CACHED_RATIO_BUCKETS, TURN_GAP_BUCKETS, TURNS_BUCKETS

#: The conventions' advice for every duration histogram: 0.01 s doubling to 81.92 s.
DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
#: The conventions' advice for gen_ai.client.token.usage: powers of 4 from 1 to 4**13.
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))


@dataclass(frozen=True, slots=True)
class Instrument:
    name: str
    unit: str
    description: str
    bounds: tuple[float, ...] = ()  # a histogram's; () for a counter


# -- the previous names (semantic-conventions-genai 004902b8) ----------------------------------
OPERATION_DURATION = Instrument(
    "gen_ai.client.operation.duration",
    "s",
    "GenAI operation duration: from the proxy receiving the request to the last byte "
    "relayed to the client (or the request failing).",
    DURATION_BUCKETS,
)
TOKEN_USAGE = Instrument(
    "gen_ai.client.token.usage",
    "{token}",
    "Number of input and output tokens used (backend usage, else the tokenizer; none "
    "when only content chunks were counted), recorded when the request ends.",
    TOKEN_BUCKETS,
)
TIME_TO_FIRST_CHUNK = Instrument(
    "gen_ai.client.operation.time_to_first_chunk",
    "s",
    "From the proxy receiving the request to the first read carrying generated content "
    "(not the role-only first chunk). Streams only.",
    DURATION_BUCKETS,
)
TIME_PER_OUTPUT_CHUNK = Instrument(
    "gen_ai.client.operation.time_per_output_chunk",
    "s",
    "For each content chunk after the first: from the read carrying the previous one to "
    "the read carrying it (0 when both came in one read). Streams only.",
    DURATION_BUCKETS,
)


# -- the current names (semantic-conventions-genai ac48b1f9 / 27f82f09) -----------------------
INFERENCE_DURATION = Instrument(
    "gen_ai.client.inference.duration",
    "s",
    OPERATION_DURATION.description,
    DURATION_BUCKETS,
)
INFERENCE_TIME_TO_FIRST_CHUNK = Instrument(
    "gen_ai.client.inference.time_to_first_chunk",
    "s",
    TIME_TO_FIRST_CHUNK.description,
    DURATION_BUCKETS,
)
INFERENCE_TIME_PER_OUTPUT_CHUNK = Instrument(
    "gen_ai.client.inference.time_per_output_chunk",
    "s",
    TIME_PER_OUTPUT_CHUNK.description,
    DURATION_BUCKETS,
)
OPERATION_INPUT_TOKENS = Instrument(
    "gen_ai.client.inference.operation.input_tokens",
    "{token}",
    "Input (prompt) tokens per request (backend usage, else the tokenizer), recorded when "
    "the request ends.",
    TOKEN_BUCKETS,
)
OPERATION_OUTPUT_TOKENS = Instrument(
    "gen_ai.client.inference.operation.output_tokens",
    "{token}",
    "Output tokens per request (backend usage, else the tokenizer; none when only content "
    "chunks were counted), recorded when the request ends.",
    TOKEN_BUCKETS,
)
#: The token counters' words on background Responses (proxy/core/background.py).
LATE = (
    " A background Response whose POST's answer ended before it did is counted when a "
    "retrieval (GET /v1/responses/{id}) through the same proxy process first sees it "
    "finished."
)
USAGE_INPUT = Instrument(
    "gen_ai.client.inference.usage.input_tokens",
    "{token}",
    "Input (prompt) tokens, cached ones included, counted when each request ends (0 with "
    "modality unknown when no count was had)." + LATE,
)
USAGE_OUTPUT = Instrument(
    "gen_ai.client.inference.usage.output_tokens",
    "{token}",
    "Output tokens, reasoning ones included, counted when each request ends (0 with "
    "modality unknown when no count was had)." + LATE,
)
USAGE_CACHE_READ = Instrument(
    "gen_ai.client.inference.usage.cache_read.input_tokens",
    "{token}",
    "Input tokens the backend served from its prefix cache (usage), when each request ends." + LATE,
)
USAGE_CACHE_WRITE = Instrument(
    "gen_ai.client.inference.usage.cache_write.input_tokens",
    "{token}",
    "Input tokens the backend wrote to its prefix cache (usage: vLLM chat's "
    "prompt_tokens_details.created_cache_tokens, Responses' "
    "input_tokens_details.cache_write_tokens, Messages' cache_creation_input_tokens), "
    "when each request ends." + LATE,
)
USAGE_REASONING = Instrument(
    "gen_ai.client.inference.usage.reasoning.output_tokens",
    "{token}",
    "Output tokens spent on reasoning, counted when each request ends: the backend's usage, "
    "else the tokenizer's count (the span's tokenprobe.reasoning_token_source and the access "
    "log's reasoning_token_source say which); not a count of reasoning events." + LATE,
)
UNKNOWN_MODALITY = (("gen_ai.token.modality", "unknown"),)

# -- embeddings (semantic-conventions-genai docs/gen-ai/client-embeddings.md at 88eccb15) ----
# For gen_ai.operation.name "embeddings", with the current names, in place of the inference
# duration and per-request input histogram; the conventions define no output metric.
EMBEDDINGS_DURATION = Instrument(
    "gen_ai.client.embeddings.duration",
    "s",
    OPERATION_DURATION.description,
    DURATION_BUCKETS,
)
EMBEDDINGS_INPUT_TOKENS = Instrument(
    "gen_ai.client.embeddings.operation.input_tokens",
    "{token}",
    "Input tokens per embeddings request (backend usage), recorded when the request ends "
    "when the count is known.",
    TOKEN_BUCKETS,
)


@dataclass(frozen=True, slots=True)
class GenAiInstruments:
    """One name set's duration, first-chunk and per-chunk histograms."""

    duration: Instrument
    time_to_first_chunk: Instrument
    time_per_output_chunk: Instrument


CURRENT = GenAiInstruments(
    INFERENCE_DURATION, INFERENCE_TIME_TO_FIRST_CHUNK, INFERENCE_TIME_PER_OUTPUT_CHUNK
)
PREVIOUS = GenAiInstruments(OPERATION_DURATION, TIME_TO_FIRST_CHUNK, TIME_PER_OUTPUT_CHUNK)
#: The current names for embeddings: their own duration (they stream no chunks).
EMBEDDINGS = GenAiInstruments(
    EMBEDDINGS_DURATION, INFERENCE_TIME_TO_FIRST_CHUNK, INFERENCE_TIME_PER_OUTPUT_CHUNK
)

#: Histograms of one figure of the record each: (how to read it from the record,
#: instrument); None is not observed. A new figure on the record (the engine split of
#: TTFT, say) is one more row here and nothing else.
FIGURES: tuple[tuple[Callable[[Measurement], float | None], Instrument], ...] = (
    (
        attrgetter("ttfb"),
        Instrument(
            "tokenprobe.time_to_first_byte",
            "s",
            "From the proxy receiving the request to the upstream's response headers.",
            DURATION_BUCKETS,
        ),
    ),
    (
        attrgetter("tpot"),
        Instrument(
            "tokenprobe.time_per_output_token",
            "s",
            "Per request: (last token time - first token time) / (output tokens - 1).",
            DURATION_BUCKETS,
        ),
    ),
    (
        lambda m: m.ttft_parts()[0],
        Instrument(
            "tokenprobe.engine.queue_time",
            "s",
            "The engine's own queue time (vLLM per-request metrics queue_time_ms): from the "
            "request entering the waiting queue to its first scheduling; for streams the "
            "queue part of the client-seen TTFT (scaled with the engine TTFT when both "
            "exceed it).",
            DURATION_BUCKETS,
        ),
    ),
    (
        lambda m: m.ttft_parts()[1],
        Instrument(
            "tokenprobe.engine.time_to_first_token",
            "s",
            "The engine's own time to first token (time_to_first_token_ms): from the "
            "request's scheduling to its first token.",
            DURATION_BUCKETS,
        ),
    ),
    (
        lambda m: m.ttft_parts()[2],
        Instrument(
            "tokenprobe.time_to_first_token.outside_engine",
            "s",
            "Client-seen TTFT minus the engine's queue time and TTFT, never below 0: "
            "network, the server's HTTP front end and tokenisation, the proxy. Streams "
            "that carried the engine's per-request metrics.",
            DURATION_BUCKETS,
        ),
    ),
    (
        attrgetter("proxy_overhead"),
        Instrument(
            "tokenprobe.proxy_overhead",
            "s",
            "The proxy's own time per request: body read -> request handed upstream, plus "
            "response head from upstream -> sent to the client.",
            OVERHEAD_BUCKETS,
        ),
    ),
    (
        lambda m: m.output_tokens_per_chunk(),
        Instrument(
            "tokenprobe.output_tokens_per_chunk",
            "{token}",
            "Per stream: output tokens (usage, engine, token ids or tokenizer) / content events; above 1 with "
            "speculative decoding or multi-token prediction.",
            TOKENS_PER_CHUNK_BUCKETS,
        ),
    ),
    (
        attrgetter("decode_tokens_per_second"),
        Instrument(
            "tokenprobe.decode_speed",
            "{token}/s",
            "Per request single-stream speed: (output tokens - 1) / (last token time - first "
            "token time). Not aggregate throughput.",
            tuple(DECODE_SPEED_BUCKETS),
        ),
    ),
)

REQUESTS = Instrument(
    "tokenprobe.requests",
    "{request}",
    "Measured requests finished, by HTTP status, finish reason (tokenprobe's closed set) "
    "and error.type when one failed.",
)
CACHED_TOKENS = Instrument(
    "tokenprobe.usage.cached_input_tokens",
    "{token}",
    "Prompt tokens served from the backend's prefix cache, from usage." + LATE,
)


def cost_instrument(currency: str) -> Instrument:
    return Instrument(
        "tokenprobe.cost",
        f"{{{currency}}}",
        "Spend in the price table's currency (tokenprobe.currency), from the token counts "
        "recorded when each request ended, by tokenprobe.cost.kind: input (uncached prompt "
        "tokens), cached_input, output.",
    )


IN_FLIGHT = Instrument(
    "tokenprobe.requests.in_flight",
    "{request}",
    "Measured requests from their body having been read (the model known) to their last byte.",
)

# -- conversations (proxy/core/conversations.py, docs/conversations.md) ----------------------
# The same figures and buckets as the Prometheus conversation metrics; a continuation's
# carry tokenprobe.conversation.via (header, previous_response, messages), a closed
# conversation's only server.* (it is no request: no model, no operation).
CONTINUATIONS = Instrument(
    "tokenprobe.conversation.continuations",
    "{request}",
    "Measured requests that continue an earlier one's conversation, by how that was "
    "recognised (tokenprobe.conversation.via), counted when each ends.",
)
TURN_GAP = Instrument(
    "tokenprobe.conversation.turn_gap",
    "s",
    "Time between a conversation's turns, outside the model: from the end of the previous "
    "request's response (its last byte relayed) to the proxy receiving the continuation. "
    "Not recorded while the previous request is still in flight.",
    TURN_GAP_BUCKETS,
)
CACHED_RATIO = Instrument(
    "tokenprobe.continuation.cached_prompt_ratio",
    "1",
    "A continuation's cached prompt tokens as its backend reported them (usage), over the "
    "tokens of the earlier prompt it repeats, at most 1; only when cached tokens were "
    "reported.",
    CACHED_RATIO_BUCKETS,
)
CACHE_MISSES = Instrument(
    "tokenprobe.continuation.cache_misses",
    "{request}",
    "Continuations whose cached prompt tokens cover less than "
    "--continuation-cache-miss-ratio of the prompt they repeat (0 for every model with a "
    "measured continuation, so the share of misses is defined).",
)
CONVERSATION_TURNS = Instrument(
    "tokenprobe.conversation.turns",
    "{request}",
    "Requests per conversation, recorded when it ends: --conversation-idle seconds after "
    "its last request's end.",
    TURNS_BUCKETS,
)
CONVERSATION_DURATION = Instrument(
    "tokenprobe.conversation.duration",
    "s",
    "A conversation's length, recorded when it ends: from the proxy receiving its first "
    "request to the end of its last request's response.",
    WS_SESSION_BUCKETS,
)
CONVERSATION_MODEL_TIME = Instrument(
    "tokenprobe.conversation.model_time",
    "s",
    "A conversation's time in the model, recorded when it ends: the sum over its requests "
    "of the proxy receiving each to the end of its response.",
    WS_SESSION_BUCKETS,
)
CONVERSATION_BETWEEN_TIME = Instrument(
    "tokenprobe.conversation.between_requests",
    "s",
    "A conversation's time between requests, recorded when it ends: the sum of its turn gaps.",
    WS_SESSION_BUCKETS,
)

# -- WebSocket sessions (proxy/core/wsrecord.py): tokenprobe_websocket_sessions_total and
# tokenprobe_websocket_session_duration_seconds, by tokenprobe.websocket.route (a WsApi's
# endpoint, else "other") and, on the counter, tokenprobe.websocket.outcome.
WS_SESSIONS = Instrument(
    "tokenprobe.websocket.sessions",
    "{session}",
    "WebSocket upgrade requests the proxy tunnelled (or tried to), counted when the tunnel "
    "ended, by route and outcome (tokenprobe_websocket_sessions_total's closed set).",
)
WS_SESSION_DURATION = Instrument(
    "tokenprobe.websocket.session.duration",
    "s",
    "WebSocket session duration: from the upgrade request's arrival to the close (the first "
    "side's connection ending, the idle timeout or the drain closing it).",
    WS_SESSION_BUCKETS,
)
