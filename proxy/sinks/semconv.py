"""Which GenAI semantic-convention names the OTLP metrics and the spans carry.

The conventions are in Development and have renamed things twice this year, so both sets
are pinned to commits of open-telemetry/semantic-conventions-genai:

  current (the default)
      docs/gen-ai/client-inference.md at ac48b1f9df15fdf281b96cccf15eb707e1fc1868:
      span `gen_ai.client.inference`; gen_ai.client.inference.duration,
      .time_to_first_chunk, .time_per_output_chunk;
      docs/gen-ai/gen-ai-token-metrics.md at 27f82f09c4e797dda0832f0030e3bd3e747e4b9d
      (model/gen-ai/token-metrics.yaml at 066d4a7f356f8600de6f10c42874626ab88692fb):
      counters gen_ai.client.inference.usage.{input_tokens, output_tokens,
      cache_read.input_tokens, cache_write.input_tokens, reasoning.output_tokens} by
      gen_ai.token.modality and histograms
      gen_ai.client.inference.operation.{input,output}_tokens; the span's cache writes
      are gen_ai.usage.cache_write.input_tokens (gen_ai.usage.cache_creation.input_tokens
      in the previous set)
  previous
      commit 004902b8cb70aa5ae6ca4ae07132b7daabcd3e10 (docs/gen-ai/gen-ai-metrics.md):
      gen_ai.client.operation.duration, .time_to_first_chunk, .time_per_output_chunk and
      the gen_ai.client.token.usage histogram by gen_ai.token.type

The switch is OpenTelemetry's own variable, read as the OpenTelemetry Python
instrumentations read it (opentelemetry-python-contrib, opentelemetry-instrumentation/
src/opentelemetry/instrumentation/_semconv.py: a comma-separated list, each item
stripped; `X/dup` emits the old and the new names together and wins over `X`):

  OTEL_SEMCONV_STABILITY_OPT_IN unset, or gen_ai_latest_experimental   current names
  OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_previous                        previous names
  OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_previous/dup                    both

Current is the default, unlike the instrumentations' (which keep old names unless asked):
tokenprobe has no installed base of instrumented applications to keep stable, and a
collector pipeline built on the previous names keeps working by setting one variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.core.apis import Api
from proxy.core.apis.chat import Chat
from proxy.core.apis.responses import Responses
from proxy.core.measurement import Measurement
from proxy.core.upstream_url import UpstreamURL
from proxy.core.wsbase import WsApi
from proxy.core.wsseam import seam_of

OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"
LATEST = "gen_ai_latest_experimental"
PREVIOUS = "gen_ai_previous"
BOTH = PREVIOUS + "/dup"

CURRENT_COMMIT = "ac48b1f9df15fdf281b96cccf15eb707e1fc1868"
PREVIOUS_COMMIT = "004902b8cb70aa5ae6ca4ae07132b7daabcd3e10"

#: The schema URL of the spans' and the OTLP metrics' scopes and resources, one for both:
#: the version of the core semantic conventions their attributes from there follow
#: (`server.address`, `server.port`, `error.type`, `http.response.status_code`, the
#: resource's `service.*`). The `gen_ai.*` names have no schema of their own to name:
#: semantic-conventions-genai publishes none yet (its README's "Schema URL" is a TODO),
#: and no version of the core's after 1.41.0 holds them (they moved out after it). Its
#: first release, v0.1.0, "Depends on semantic-conventions v1.45.0" (its CHANGELOG.md), so
#: that is the version named here; a schema-aware backend then translates the core names
#: from the version they follow, and leaves the `gen_ai.*` ones, which it has no rules
#: for, as they are.
SCHEMA_URL = "https://opentelemetry.io/schemas/1.45.0"


@dataclass(frozen=True, slots=True)
class Names:
    current: bool = True
    previous: bool = False


#: The default: the current names only.
DEFAULT = Names()


def names_from_env(env: Mapping[str, str]) -> Names:
    items = {item.strip() for item in env.get(OPT_IN, "").split(",") if item.strip()}
    if BOTH in items or (PREVIOUS in items and LATEST in items):
        return Names(current=True, previous=True)
    if PREVIOUS in items:
        return Names(current=False, previous=True)
    return DEFAULT


def optional(record: Any, name: str) -> Any:
    """A record field other parts of tokenprobe may add (None until they do): the one
    place the OTLP metrics and the spans read `reasoning_tokens`."""
    return getattr(record, name, None)


def reasoning_tokens(record: Any) -> int | None:
    value = optional(record, "reasoning_tokens")
    return value if isinstance(value, int) else None


def system_fingerprint(record: Measurement) -> str | None:
    """The span's `openai.response.system_fingerprint`: the backend's, on OpenAI's
    inference span (docs/gen-ai/openai.md, Recommended), so only where the record's
    provider is openai: `gen_ai.provider.name` "SHOULD be set consistently
    with provider-specific attributes" (its note 2). Not on the metrics, whose openai
    refinement also recommends it: a string the backend writes (any value a custom
    --fingerprint-value gives vLLM) is no closed set, and an OTLP backend keeps a series
    for each attribute set."""
    value = record.system_fingerprint
    if value is None or seam_of(record.endpoint).provider != "openai":
        return None
    return value


def server_attributes(upstream: str) -> tuple[tuple[str, str], tuple[str, int]]:
    """`server.address` and `server.port` of the backend (the spans' and the OTLP
    metrics' attributes), from the one parse of --upstream the data paths use."""
    where = UpstreamURL.parse(upstream)
    return ("server.address", where.host), ("server.port", where.port)


def operation_attributes(endpoint: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """`gen_ai.operation.name` and `gen_ai.provider.name` of a request, from its API seam
    ("openai" for the OpenAI shapes, "anthropic" for Messages): the spans' and the OTLP
    metrics' attributes."""
    api = seam_of(endpoint)
    return ("gen_ai.operation.name", api.operation), ("gen_ai.provider.name", api.provider)


#: `openai.api.type` of the two OpenAI APIs the conventions name a value for
#: (semantic-conventions-genai docs/gen-ai/openai.md, the OpenAI inference span:
#: Recommended, well-known values chat_completions and responses; model/openai/registry.yaml
#: in open-telemetry/semantic-conventions). By the Api's exact type: vLLM's batched chat
#: (/v1/chat/completions/batch) and the audio APIs subclass Chat but are no OpenAI Chat
#: Completions request, and the legacy Completions API has no value of its own there (a
#: custom one made up here could differ from the one the conventions come to name).
_OPENAI_API_TYPES: dict[type[Api | WsApi], str] = {Chat: "chat_completions", Responses: "responses"}


def openai_api_type(api: Api | WsApi) -> str | None:
    """The span's `openai.api.type` for a request to `api`, None where none applies. The
    conventions put it on the span only; no metric carries it."""
    return _OPENAI_API_TYPES.get(type(api))


def vouched_model(name: str | None, bounded: str) -> str | None:
    """A model name as the OTLP metrics' gen_ai.request.model / gen_ai.response.model
    carry it: the exact name, when the proxy vouches for it (`bounded`, the Prometheus
    model label made from it by proxy/core/labels.py ModelLabels, is that name: it is on
    --model-allowlist or the upstream's model list); else None and the attribute is left
    out. Never the label's `other`, nor the one model a llama-server serves whatever a
    request names: the conventions want "the exact name of the model requested" (and
    actually used), and an OTLP backend aggregates by attribute set, so a client's
    unvouched string (or a backend's echo of it: llama.cpp's server before about b7231,
    tools/server `oaicompat_model = json_value(data, "model", model_name)`) would be a
    series each. The label itself is `tokenprobe.model` on every point."""
    return name if name and name == bounded else None
