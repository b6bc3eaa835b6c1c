"""How the simulated backend behaves when a request does not say otherwise.

Every timing and size here can be overridden per request with an `x-sim-*` header
(see `controls.py`); the config is the default a whole test or benchmark shares.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SimConfig:
    """Defaults of the simulated vLLM server. Times in seconds unless named `_ms`."""

    #: Served model names; the first one is used when a request names none.
    models: tuple[str, ...] = ("sim-model",)
    #: Request received -> first content token.
    ttft: float = 0.05
    #: Decode speed of one stream after its first token (free-running mode only).
    tokens_per_second: float = 50.0
    #: Prefill model: TTFT grows by this many seconds per prompt token.
    ttft_per_prompt_token: float = 0.0
    #: Planned completion length; the text ends with an EOS (`finish_reason` "stop").
    output_tokens: int = 32
    #: Prompt tokens + max_tokens above this is vLLM's 400 context-length error.
    max_model_len: int = 4096
    #: Prompt tokens reported as served from the prefix cache (capped at the prompt):
    #: chat/completions `prompt_tokens_details.cached_tokens`, Responses
    #: `input_tokens_details.cached_tokens`, Messages `cache_read_input_tokens`.
    #: 0 leaves chat/completions usage without details, as vLLM does by default.
    cached_tokens: int = 0
    #: A prefix cache (proxy/sim/prefix_cache.py): remember this many message prefixes and
    #: report the prompt tokens a request shares with an earlier one as cached (vLLM's
    #: automatic prefix caching with --enable-prompt-tokens-details); 0 = off. An
    #: x-sim-cached-tokens header or `cached_tokens` wins over it.
    prefix_cache: int = 0
    #: Cached tokens, and the `created_cache_tokens` a chat writes to the cache, come in
    #: whole blocks of this many tokens (vLLM's --block-size). 16 is vLLM 0.32's default
    #: (vllm/config/cache.py:72 DEFAULT_BLOCK_SIZE) on GPUs; its CPU build defaults to 128
    #: (vllm/platforms/cpu.py:292-293, where no --block-size is given and the model has no
    #: MLA): 128 plays the CPU build that tests/vllm start.
    prefix_cache_block: int = 16
    #: CPU seconds burnt (a busy loop) per generated token, in microseconds, to
    #: emulate a CPU-bound backend sharing cores with the proxy.
    cpu_per_token_us: float = 0.0
    #: vLLM's --api-key, one key or several: requests under /v1, /v2, /inference and
    #: /cohere then need `Authorization: Bearer <one of them>` (else vLLM's 401), read as
    #: vLLM reads it (proxy/sim/app.py `ApiKeys`). Empty keys are dropped, as vLLM drops
    #: them; None or none left: no key needed.
    api_key: str | tuple[str, ...] | None = None
    #: Lockstep mode: one global decode step every `step_ms`, like continuous batching;
    #: every active stream gets its next chunk on the same tick. None = free-running.
    step_ms: float | None = None
    #: Put `"sent_ns": time.time_ns()` as the first key of every content chunk.
    stamp: bool = False
    #: With `stamp`: put the send time in the text instead, `"@<time_ns> "` before it, so
    #: the chunks of a stream differ only in their text, as vLLM's do (the proxy's
    #: template match then applies, where a stamp key before the text defeats it).
    stamp_in_text: bool = False
    #: Send chat's role-only chunks (and Messages' message_start, Cohere's message-start,
    #: which vLLM builds from them) with the response headers (t~0), not with the first
    #: engine output just before the first token, as vLLM does: a shape that shows at once
    #: a client or proxy that takes the first chunk for the first token. Also per request:
    #: `x-sim-early-role: 1` (`0` turns it off).
    early_role: bool = False
    #: Keep a running SHA-256 of every response-body byte in each request's record.
    record_bodies: bool = False
    #: vLLM's `--enable-per-request-metrics`: the `metrics` object on the usage chunk and
    #: on non-streamed bodies (proxy/sim/engine.py). Also per request: `x-sim-metrics: 1`.
    per_request_metrics: bool = False
    #: vLLM's `--max-num-seqs`: requests beyond this many wait for a slot (their queue
    #: time) before their TTFT starts. None = no limit.
    max_num_seqs: int | None = None
    #: Speculative decoding: drafts per verify step (0 = off) and the share of them the
    #: target accepts; each content chunk then carries round(rate * k) + 1 tokens.
    spec_tokens: int = 0
    acceptance_rate: float = 0.0
    #: vLLM 0.32's `system_fingerprint`: on the finish chunk, or with include_usage on the
    #: usage chunk instead (vllm/entrypoints/openai/*/serving.py). None = never sent.
    system_fingerprint: str | None = None
    #: Ollama: the seconds a model that is not loaded takes to load, paid by the first
    #: request for each model (server/routes.go load_duration); 0 = every model warm.
    #: Also per request: `x-sim-load-time`.
    ollama_load_time: float = 0.0
    #: What /api/version answers: the simulator plays Ollama there. None: it is not served
    #: (a vLLM has no /api/version), so the simulator identifies as vLLM (/version).
    ollama_version: str | None = None
    #: Whose shapes chat and completions take: "vllm", or "llamacpp" (llama-server's chunks,
    #: `timings`, /props with build_info and no /version: proxy/sim/llamacpp.py). Also per
    #: request: `x-sim-backend-kind`.
    backend_kind: str = "vllm"
    #: vLLM's VLLM_MAX_STOP_STRINGS: a `stop` list longer than this is a 400 (the CLI reads
    #: that variable, as vLLM does, at start).
    max_stop_strings: int = 4
    #: vLLM's VLLM_MAX_N_SEQUENCES (vllm/envs.py:1149-1151): an `n` over it is a 400
    #: (vllm/sampling_params.py:46-59); the CLI reads that variable, as vLLM does, at start.
    max_n_sequences: int = 16384
    #: How many request records `SimState` keeps (oldest dropped), so long benchmarks
    #: do not grow memory without bound.
    max_records: int = 10_000

    def api_keys(self) -> tuple[str, ...]:
        """The keys a guarded request may bring; () when it needs none."""
        given = (self.api_key,) if isinstance(self.api_key, str) else self.api_key or ()
        return tuple(key for key in given if key)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("SimConfig.models must name at least one model")
        if self.ttft < 0:
            raise ValueError(f"SimConfig.ttft must be >= 0, got {self.ttft}")
        if self.tokens_per_second <= 0:
            raise ValueError(
                f"SimConfig.tokens_per_second must be > 0, got {self.tokens_per_second}"
            )
        for name in ("ttft_per_prompt_token", "cached_tokens", "cpu_per_token_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.output_tokens < 0:
            raise ValueError(f"SimConfig.output_tokens must be >= 0, got {self.output_tokens}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"SimConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.spec_tokens < 0 or not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError("SimConfig.spec_tokens must be >= 0 and acceptance_rate in [0, 1]")
        if self.prefix_cache < 0 or self.prefix_cache_block < 1:
            raise ValueError("SimConfig.prefix_cache must be >= 0 and prefix_cache_block >= 1")
        if self.backend_kind not in ("vllm", "llamacpp"):
            raise ValueError(f"SimConfig.backend_kind: unknown value {self.backend_kind!r}")
        if self.step_ms is not None and self.step_ms <= 0:
            raise ValueError(f"SimConfig.step_ms must be > 0, got {self.step_ms}")
