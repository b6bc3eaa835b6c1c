"""`tokenprobe sim`: run the simulated vLLM server on uvicorn.

Every flag has an environment variable TOKENPROBE_SIM_<NAME> (e.g. TOKENPROBE_SIM_TTFT);
a flag on the command line wins. TOKENPROBE_SIM_MODEL takes a comma-separated list.
uvicorn's "auto" loop and parser pick uvloop and httptools when they are installed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any

from proxy.core.uvicorn_logs import keep_queries_out_of_logs
from proxy.sim.app import create_sim_app
from proxy.sim.config import SimConfig

ENV_PREFIX = "TOKENPROBE_SIM_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def port_number(raw: str) -> int:
    """A TCP port (argparse's `type`; its ValueError becomes argparse's usage error): 70000
    was taken modulo 65536 by the socket, and served on another port."""
    port = int(raw)
    if not 0 <= port <= 65535:
        raise ValueError(raw)
    return port


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    defaults = SimConfig()
    parser = argparse.ArgumentParser(
        prog="tokenprobe sim",
        description="A simulated OpenAI-compatible backend that behaves like vLLM on the wire.",
        epilog="Every flag also reads TOKENPROBE_SIM_<NAME> (e.g. TOKENPROBE_SIM_TTFT, "
        "TOKENPROBE_SIM_HOST); a flag on the command line wins. A default shown is the "
        "variable's value when it is set.",
    )

    def env(name: str, conv: Callable[[str], Any], default: Any) -> Any:
        key = ENV_PREFIX + name
        raw = environ.get(key)
        if raw is None or raw == "":
            return default
        try:
            return conv(raw)
        except ValueError:
            parser.error(f"{key}: invalid value {raw!r}")

    def flag(raw: str) -> bool:  # as `serve` reads a bool: "maybe" is an error, not false
        lowered = raw.strip().lower()
        if lowered not in _TRUE + _FALSE:
            raise ValueError(raw)
        return lowered in _TRUE

    def models(raw: str) -> list[str]:
        return [m.strip() for m in raw.split(",") if m.strip()]

    add = parser.add_argument
    add(
        "--host",
        default=env("HOST", str, "127.0.0.1"),
        help="address to listen on; 0.0.0.0 to be reached from outside a container "
        "(TOKENPROBE_HOST, the proxy's, does not apply) (default: %(default)s)",
    )
    add(
        "--port",
        type=port_number,
        default=env("PORT", port_number, 8000),
        help="port to listen on (default: %(default)s)",
    )
    add(
        "--model",
        action="append",
        default=None,
        help=f"served model name, repeatable (default: {defaults.models[0]})",
    )
    add(
        "--ttft",
        type=float,
        default=env("TTFT", float, defaults.ttft),
        help="seconds to the first content token (default: %(default)s)",
    )
    add(
        "--ttft-per-prompt-token",
        type=float,
        default=env("TTFT_PER_PROMPT_TOKEN", float, defaults.ttft_per_prompt_token),
        help="seconds added to the TTFT per prompt token (prefill) (default: %(default)s)",
    )
    add(
        "--tps",
        "--tokens-per-second",
        dest="tps",
        type=float,
        default=env("TPS", float, defaults.tokens_per_second),
        help="decode speed of one stream, tokens/s (default: %(default)s)",
    )
    add(
        "--cached-tokens",
        type=int,
        default=env("CACHED_TOKENS", int, defaults.cached_tokens),
        help="prompt tokens reported as cached (capped at the prompt) (default: %(default)s)",
    )
    add(
        "--prefix-cache",
        type=int,
        default=env("PREFIX_CACHE", int, defaults.prefix_cache),
        help="remember this many message prefixes and report the tokens a prompt shares "
        "with an earlier one as cached (0: off) (default: %(default)s)",
    )
    add(
        "--prefix-cache-block",
        type=int,
        default=env("PREFIX_CACHE_BLOCK", int, defaults.prefix_cache_block),
        help="cached tokens come in whole blocks of this many (vLLM's --block-size; 128 "
        "plays vLLM's CPU build) "
        "(default: %(default)s)",
    )
    add(
        "--cpu-per-token-us",
        type=float,
        default=env("CPU_PER_TOKEN_US", float, defaults.cpu_per_token_us),
        help="busy-loop CPU per generated token, microseconds (default: %(default)s)",
    )
    add(
        "--output-tokens",
        type=int,
        default=env("OUTPUT_TOKENS", int, defaults.output_tokens),
        help=(
            "text tokens per answer, then the EOS, which usage counts as vLLM does (N "
            "report N + 1); a request's max_tokens at or below it cuts the answer there, "
            "without the EOS (default: %(default)s)"
        ),
    )
    add(
        "--max-model-len",
        type=int,
        default=env("MAX_MODEL_LEN", int, defaults.max_model_len),
        help="the context: a longer prompt plus max_tokens is refused (default: %(default)s)",
    )
    add(
        "--per-request-metrics",
        action="store_true",
        default=env("PER_REQUEST_METRICS", flag, defaults.per_request_metrics),
        help="vLLM's --enable-per-request-metrics: the metrics object on usage and bodies",
    )
    add(
        "--max-num-seqs",
        type=int,
        default=env("MAX_NUM_SEQS", int, None),
        help="requests beyond this many queue for a slot (their queue time) (default: no limit)",
    )
    add(
        "--spec-tokens",
        type=int,
        default=env("SPEC_TOKENS", int, defaults.spec_tokens),
        help="speculative decoding: drafts per step (0: off) (default: %(default)s)",
    )
    add(
        "--acceptance-rate",
        type=float,
        default=env("ACCEPTANCE_RATE", float, defaults.acceptance_rate),
        help="share of drafts accepted; chunks carry round(rate * k) + 1 tokens "
        "(default: %(default)s)",
    )
    add(
        "--system-fingerprint",
        default=env("SYSTEM_FINGERPRINT", str, None),
        help="vLLM 0.32's system_fingerprint (finish chunk, or the usage chunk with usage)",
    )
    add(
        "--ollama-load-time",
        type=float,
        default=env("OLLAMA_LOAD_TIME", float, defaults.ollama_load_time),
        help="Ollama: seconds a model not yet loaded takes to load (its first request) "
        "(default: %(default)s)",
    )
    add(
        "--ollama-version",
        default=env("OLLAMA_VERSION", str, None),
        help="what Ollama's /api/version answers",
    )
    add(
        "--backend-kind",
        choices=("vllm", "llamacpp"),
        default=env("BACKEND_KIND", str, defaults.backend_kind),
        help="whose wire shapes chat and completions take (llamacpp: llama-server's "
        "timings, /props) (default: %(default)s)",
    )
    add(
        "--api-key",
        nargs="+",  # vLLM's: several keys, any one of them opens; given again, the last wins
        default=env("API_KEY", lambda raw: [raw], None),
        help="vLLM's --api-key: requests under /v1, /v2, /inference and /cohere need "
        "`Authorization: Bearer KEY` with one of these keys (TOKENPROBE_SIM_API_KEY: one "
        "key). vLLM's VLLM_API_KEY is not read: a shell set up for a real vLLM would lock "
        "the simulator's tests and demos out",
    )
    add("--step-ms", type=float, default=env("STEP_MS", float, None), help="lockstep mode")
    add("--stamp", action="store_true", default=env("STAMP", flag, False))
    add(
        "--stamp-in-text",
        action="store_true",
        default=env("STAMP_IN_TEXT", flag, False),
        help='with --stamp: "@<send time ns> " before each text, not a key before it',
    )
    add(
        "--early-role",
        action="store_true",
        default=env("EARLY_ROLE", flag, defaults.early_role),
        help="send chat's role-only chunk (Messages' message_start, Cohere's message-start) "
        "with the headers, not with the first token as vLLM does (x-sim-early-role: 0 per "
        "request turns it off)",
    )
    add("--record-bodies", action="store_true", default=env("RECORD_BODIES", flag, False))
    add(
        "--log-level",
        default=env("LOG_LEVEL", str, "warning"),
        help="uvicorn's log level (default: %(default)s)",
    )
    parser.set_defaults(env_models=env("MODEL", models, None))
    # vLLM's own variables (vllm/envs.py: int(os.environ.get(...))), read as it reads
    # them; no flags of ours
    for name, dest in (
        ("VLLM_MAX_STOP_STRINGS", "max_stop_strings"),
        ("VLLM_MAX_N_SEQUENCES", "max_n_sequences"),
    ):
        raw = environ.get(name, str(getattr(defaults, dest)))
        try:
            parser.set_defaults(**{dest: int(raw)})
        except ValueError:
            parser.error(f"{name}: invalid value {raw!r}")
    return parser


def api_keys(given: list[str] | None) -> tuple[str, ...] | None:
    """The keys as vLLM 0.32 takes --api-key's values (vllm/entrypoints/serve/middleware/
    register.py `init_entrypoints_middleware`), empty ones dropped; None: no key needed."""
    return tuple(key for key in given or () if key) or None


def parse(
    argv: list[str] | None, environ: Mapping[str, str]
) -> tuple[SimConfig, argparse.Namespace]:
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    try:
        config = SimConfig(
            models=tuple(args.model or args.env_models or SimConfig().models),
            ttft=args.ttft,
            tokens_per_second=args.tps,
            ttft_per_prompt_token=args.ttft_per_prompt_token,
            cached_tokens=args.cached_tokens,
            cpu_per_token_us=args.cpu_per_token_us,
            prefix_cache=args.prefix_cache,
            prefix_cache_block=args.prefix_cache_block,
            output_tokens=args.output_tokens,
            max_model_len=args.max_model_len,
            api_key=api_keys(args.api_key),
            per_request_metrics=args.per_request_metrics,
            max_num_seqs=args.max_num_seqs,
            spec_tokens=args.spec_tokens,
            acceptance_rate=args.acceptance_rate,
            system_fingerprint=args.system_fingerprint,
            ollama_load_time=args.ollama_load_time,
            ollama_version=args.ollama_version,
            backend_kind=args.backend_kind,
            step_ms=args.step_ms,
            stamp=args.stamp,
            stamp_in_text=args.stamp_in_text,
            early_role=args.early_role,
            record_bodies=args.record_bodies,
            max_stop_strings=args.max_stop_strings,
            max_n_sequences=args.max_n_sequences,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return config, args


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    config, args = parse(argv, os.environ)
    keep_queries_out_of_logs()  # --log-level info logs each WebSocket handshake's line
    uvicorn.run(
        create_sim_app(config),
        host=args.host,
        port=args.port,
        loop="auto",
        http="auto",
        lifespan="on",
        access_log=False,
        log_level=args.log_level,
    )
    return 0
