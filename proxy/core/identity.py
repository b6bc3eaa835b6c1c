"""Which backend answers, from what its own routes say: the kind and version behind
`tokenprobe_backend_info{kind, version}`. I/O-free: the server asks (proxy/server/identity.py)
and hands each answer here.

Each engine has a route that names its version, checked at its source:

  ollama    GET /api/version      {"version": "0.13.0"}       ollama/ollama server/routes.go
                                  (r.GET("/api/version", ... gin.H{"version": version.Version}))
  llamacpp  GET /props            {"build_info": "b1234-ab12", ...}   llama.cpp
                                  tools/server/server-context.cpp (the /props handler's json)
  sglang    GET /get_server_info  {..., "version": __version__}   sgl-project/sglang
                                  python/sglang/srt/entrypoints/http_server.py @ 0025436e
  tgi       GET /info             {"model_id", ..., "router": "text-generation-router",
                                  "version": "3.x"}  huggingface/text-generation-inference
                                  router/src/lib.rs (struct Info) @ db931fcf
  vllm      GET /version          {"version": "0.32.0"}   vllm/entrypoints/openai/api_server.py

The unique routes win over vLLM's generic `/version` (which others may also serve), in
the order of PROBES. A version is cut to a bounded label; nothing answering is `unknown`.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from proxy.core.labels import sanitise

UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Probe:
    kind: str
    path: str
    field: str  # the answer's field holding the version
    requires: tuple[str, str] | None = None  # (field, value) the answer must also carry


#: Most specific first: the first that answers names the backend.
PROBES: tuple[Probe, ...] = (
    Probe("ollama", "/api/version", "version"),
    Probe("llamacpp", "/props", "build_info"),
    Probe("sglang", "/get_server_info", "version"),
    Probe("tgi", "/info", "version", ("router", "text-generation-router")),
    Probe("vllm", "/version", "version"),
)
#: The closed set of `kind` label values.
KINDS = frozenset({UNKNOWN, *(p.kind for p in PROBES)})
#: The backends that serve their model whatever a request's `model` names: llama-server
#: answers every request as its own model (tools/server/server-context.cpp, the handler
#: that makes the tasks: `task.params.oaicompat_model = meta->model_name`), and native
#: /completion takes no model at all (proxy/core/labels.py, `ModelLabels.names_ignored`).
IGNORES_MODEL_NAMES = frozenset({"llamacpp"})


@dataclass(slots=True)
class Backend:
    """What the upstream last said it is: shared by the data paths (admission asks it), and
    updated in place by the server's background questions."""

    kind: str = UNKNOWN
    version: str = UNKNOWN


def version_of(probe: Probe, status: int, body: bytes) -> str | None:
    """The version this answer gives, or None when it is not the probe's backend."""
    if status != 200:
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(obj) is not dict:
        return None
    if probe.requires is not None and obj.get(probe.requires[0]) != probe.requires[1]:
        return None
    value = obj.get(probe.field)
    if type(value) is not str or not value:
        return None
    return sanitise(value.encode("utf-8", "replace")) or None


def identify(answers: dict[str, tuple[int, bytes] | None]) -> tuple[str, str]:
    """(kind, version) from each probe path's (status, body), None where nothing came
    back; ("unknown", "unknown") when no probe is answered."""
    for probe in PROBES:
        answer = answers.get(probe.path)
        if answer is not None and (version := version_of(probe, *answer)) is not None:
            return probe.kind, version
    return UNKNOWN, UNKNOWN
