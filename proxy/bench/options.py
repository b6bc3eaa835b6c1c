"""`tokenprobe bench` flags -> a frozen, validated Options. Bad values fail here, with the flag named."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from proxy.core import slo
from proxy.core.apis import APIS, Api
from proxy.core.secrets import masked_url
from proxy.core.wsseam import WS_APIS, WsApi

#: `--endpoint` choices -> the API's path (the proxy's `endpoint` label): each seam that
#: names a `bench_name`, in the registries' order (HTTP APIs, then WebSocket ones).
_SEAMS: tuple[Api | WsApi, ...] = (*APIS, *WS_APIS)
ENDPOINTS = {api.bench_name: api.endpoint for api in _SEAMS if api.bench_name}

#: SLO names `--slo` accepts, all in seconds (proxy/core/slo.py, shared with serve).
SLO_NAMES = slo.NAMES


class OptionsError(ValueError):
    """A flag has a bad value; the message names it."""


@dataclass(frozen=True, slots=True)
class Options:
    base_url: str  # scheme://host:port[/prefix], without a trailing /v1
    model: str
    endpoint: str  # an API path, one of ENDPOINTS' values
    api_key: str | None
    mode: str  # "closed" (concurrency sweep) or "open" (Poisson arrivals)
    levels: tuple[float, ...]  # concurrencies (closed) or request rates per second (open)
    max_concurrency: int | None  # open loop: at most this many requests in flight
    ramp_up: float  # closed loop: seconds over which the workers start, evenly spaced
    requests: int | None  # per level
    duration: float | None  # seconds per level
    max_tokens: int
    ignore_eos: bool
    prompts_file: str | None
    input_tokens: tuple[int, ...] | None  # one prompt length, or a sweep over several
    tokenizer: str | None
    seed: int
    slo: dict[str, float]
    timeout: float  # the longest silence allowed within one response
    headers: tuple[tuple[str, str], ...]
    out: str | None
    plot: str | None
    compare_metrics: str | None
    progress: bool
    label: str | None = None  # names the run in `tokenprobe bench compare`
    cost_per_hour: float | None = None  # the deployment's cost, for cost per million tokens
    currency: str = "USD"
    workers: int = 1  # processes of this machine sharing the load (workers.py)
    shard: tuple[int, int] | None = None  # (I, N): this process's share of the load
    sync: bool = False  # a worker of --workers: wait for the shared start on stdin
    start_at: float | None = None  # wall-clock (Unix) start shared by shards on several machines
    uds: str | None = None  # connect through this Unix socket; the URL gives Host and path

    @property
    def url(self) -> str:
        return self.base_url + self.endpoint

    @property
    def max_requests(self) -> int:
        """The per-level request cap: `--requests`, or a bound for duration-only runs."""
        return self.requests if self.requests is not None else 1_000_000


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenprobe bench",
        description="Measure an OpenAI-compatible backend: time to first token, per-stream "
        "decode speed and aggregate throughput, at each load level.",
        epilog="'tokenprobe bench compare RUN.json RUN.json ...' compares saved runs "
        "(--out files): see 'tokenprobe bench compare --help'.",
    )
    a = p.add_argument
    a("--url", required=True, help="the backend's base URL, e.g. http://localhost:8000/v1")
    a("--model", required=True, help="the model name to request")
    a(
        "--endpoint",
        choices=tuple(ENDPOINTS),
        default="chat",
        help="the API to measure (embeddings: latency and prompt tokens only, not streamed; "
        "generate: token ids in and out; transcriptions, translations: a generated 1 s WAV; "
        "realtime: one WebSocket session per request, one utterance of 1 s audio)",
    )
    a("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    a(
        "--uds",
        metavar="PATH",
        help="connect through this Unix domain socket (a vLLM started with --uds), as curl's "
        "--unix-socket: --url still gives the Host header and the path, e.g. --url "
        "http://localhost/v1 --uds /run/vllm.sock",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", help="closed loop: comma-separated concurrencies (default 1)"
    )
    load.add_argument(
        "--rate", help="open loop: comma-separated request rates per second (Poisson)"
    )
    a("--max-concurrency", type=int, help="open loop: cap on requests in flight (default: none)")
    a(
        "--ramp-up",
        type=float,
        default=0.0,
        help="closed loop: start the workers evenly over S seconds",
    )
    a("--requests", type=int, help="requests per level (default 100 unless --duration is set)")
    a("--duration", type=float, help="seconds per level (requests started by then finish)")
    a("--max-tokens", type=int, default=256, help="output tokens per request (default 256)")
    a(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for backends that reject it)",
    )
    a(
        "--prompts",
        dest="prompts_file",
        help="JSONL ({prompt} or {messages}) or plain text, one per line",
    )
    a(
        "--input-tokens",
        help="synthetic prompts of exactly N tokens (needs --tokenizer); several, e.g. "
        "128,1024,4096, sweep prompt lengths and report TTFT and implied prefill rate by length",
    )
    a(
        "--tokenizer",
        help="local tokenizer directory: counts tokens when the backend sends no usage",
    )
    a("--seed", type=int, default=0, help="seed for open-loop arrival times and synthetic prompts")
    a("--slo", default="", help="goodput targets in seconds, e.g. ttft=0.5,tpot=0.05")
    a("--timeout", type=float, default=300.0, help="longest silence within a response (s)")
    a("--header", action="append", default=[], metavar="'NAME: VALUE'", help="extra request header")
    a("--out", help="write every per-request record and the summary to this JSON file")
    a("--plot", help="draw throughput-vs-latency charts to this PNG (needs matplotlib)")
    a("--compare-metrics", metavar="URL", help="a tokenprobe proxy's /metrics to cross-check")
    a("--label", help="name of this run in 'tokenprobe bench compare' (default: the file name)")
    a(
        "--cost-per-hour",
        type=float,
        help="the deployment's cost per hour: report cost per million output and input tokens "
        "at each level's aggregate throughput",
    )
    a("--currency", default="USD", help="currency of --cost-per-hour (default USD)")
    a("--quiet", action="store_true", help="no live progress line")
    a(
        "--workers",
        type=int,
        default=1,
        help="run on N processes of this machine, one clock, merged",
    )
    a(
        "--shard",
        metavar="I/N",
        help="only share I of N (0-based) of the load; join with bench merge",
    )
    a(
        "--start-at",
        type=float,
        metavar="UNIX",
        help="start at this wall-clock time (shards on several machines)",
    )
    a("--sync", action="store_true", help=argparse.SUPPRESS)
    return p


def parse(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Options:
    """Flags -> Options. argparse exits on unknown flags; bad values raise OptionsError."""
    env = os.environ if env is None else env
    ns = parser().parse_args(list(argv))
    mode = "open" if ns.rate else "closed"
    if mode == "open":
        levels = _numbers("--rate", ns.rate, float)
    else:
        levels = _numbers("--concurrency", ns.concurrency or "1", int)
    if ns.requests is None and ns.duration is None:
        ns.requests = 100
    _at_least("--requests", ns.requests, 1)
    _at_least("--max-tokens", ns.max_tokens, 1)
    input_tokens = (
        tuple(int(n) for n in _numbers("--input-tokens", ns.input_tokens, int))
        if ns.input_tokens is not None
        else None
    )
    if ns.cost_per_hour is not None and not ns.cost_per_hour >= 0:
        raise OptionsError("--cost-per-hour must be zero or a positive number")
    if not ns.currency.strip():
        raise OptionsError("--currency must not be empty")
    _at_least("--max-concurrency", ns.max_concurrency, 1)
    if ns.duration is not None:
        seconds("--duration", ns.duration)
    if not (math.isfinite(ns.ramp_up) and ns.ramp_up >= 0):
        raise OptionsError("--ramp-up must be zero or a positive number of seconds")
    seconds("--timeout", ns.timeout)
    if ns.max_concurrency is not None and mode == "closed":
        raise OptionsError("--max-concurrency applies to --rate (open loop) only")
    if ns.ramp_up and mode == "open":
        # Poisson arrivals at --rate begin at that rate: no burst of simultaneous first
        # requests for a ramp to spread, as N closed-loop streams starting at once are.
        raise OptionsError(
            "--ramp-up applies to --concurrency (closed loop) only: --rate arrivals start "
            "at that rate, one at a time (to ramp a rate, sweep it: --rate 1,2,4)"
        )
    _distinct("--rate" if mode == "open" else "--concurrency", levels, mode)
    if input_tokens is not None:
        _distinct("--input-tokens", input_tokens, None)
    if ns.input_tokens is not None and not ns.tokenizer:
        raise OptionsError("--input-tokens needs --tokenizer to build prompts of exact length")
    if ns.input_tokens is not None and ns.prompts_file:
        raise OptionsError("--input-tokens and --prompts exclude each other")
    _at_least("--workers", ns.workers, 1)
    if ns.workers > 1 and ns.shard:
        raise OptionsError("--workers and --shard exclude each other (each worker is a shard)")
    if ns.workers > 1 and len(levels) > 1:
        raise OptionsError("--workers runs one level: give one --concurrency or --rate")
    if ns.uds is not None and ns.url.lower().startswith("https://"):
        raise OptionsError("--uds takes an http:// --url: the bench speaks no TLS over a socket")
    return Options(
        base_url=_base_url(ns.url),
        model=ns.model,
        endpoint=ENDPOINTS[ns.endpoint],
        api_key=ns.api_key or env.get("OPENAI_API_KEY") or None,
        mode=mode,
        levels=levels,
        max_concurrency=ns.max_concurrency,
        ramp_up=ns.ramp_up,
        requests=ns.requests,
        duration=ns.duration,
        max_tokens=ns.max_tokens,
        ignore_eos=not ns.no_ignore_eos,
        prompts_file=ns.prompts_file,
        input_tokens=input_tokens,
        tokenizer=ns.tokenizer,
        seed=ns.seed,
        slo=parse_slo(ns.slo),
        timeout=ns.timeout,
        headers=tuple(_header(h) for h in ns.header),
        out=ns.out,
        plot=ns.plot,
        compare_metrics=ns.compare_metrics,
        progress=not ns.quiet,
        label=ns.label,
        cost_per_hour=ns.cost_per_hour,
        currency=ns.currency.strip(),
        workers=ns.workers,
        shard=parse_shard(ns.shard) if ns.shard else None,
        sync=ns.sync,
        start_at=ns.start_at,
        uds=ns.uds,
    )


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N), 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise OptionsError(f"--shard: expected I/N, got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise OptionsError(f"--shard: I must be in 0..N-1, got {text!r}")
    return i, n


def parse_slo(text: str) -> dict[str, float]:
    """--slo as proxy/core/slo.py reads it for `tokenprobe serve` too."""
    try:
        return slo.parse_slo(text)
    except slo.SloError as exc:
        raise OptionsError(str(exc)) from None


def _base_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        shown = masked_url(value)  # its user info and credential parameters
        raise OptionsError(f"--url: expected an http:// or https:// URL with a host, got {shown!r}")
    return value.rstrip("/").removesuffix("/v1")


def _numbers(flag: str, text: str, kind: type[int] | type[float]) -> tuple[float, ...]:
    try:
        values = tuple(kind(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise OptionsError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    # nan and inf parse as floats: a rate of nan sent every request at once
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise OptionsError(f"{flag}: values must be finite positive numbers, got {text!r}")
    return values


def _distinct(flag: str, values: Sequence[float], mode: str | None) -> None:
    """Each level once: a level is named by its label in the table, the JSON and
    `bench compare`, so two runs of one level would be pooled into one row."""
    seen: dict[str, float] = {}
    for value in values:
        name = label(mode, value) if mode is not None else str(value)
        if name in seen:
            twice = (
                f"{value:g} is given twice"
                if seen[name] == value
                else f"{seen[name]!r} and {value!r} are both {name}"
            )
            raise OptionsError(f"{flag}: {twice}; give each level once")
        seen[name] = value


def label(mode: str, value: float) -> str:
    """A level's name in the table, the JSON and `bench compare` (load.py uses it)."""
    return f"c={int(value)}" if mode == "closed" else f"rate={value:g}/s"


def seconds(flag: str, value: float) -> float:
    """A finite positive number of seconds: nan compares false to every bound and inf
    never ends, so a bare `<= 0` check let both through (a run without end)."""
    if not (math.isfinite(value) and value > 0):
        raise OptionsError(f"{flag} must be a finite positive number of seconds, got {value:g}")
    return value


def _at_least(flag: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        raise OptionsError(f"{flag} must be at least {minimum}")


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise OptionsError(f"--header: expected 'NAME: VALUE', got {text!r}")
    return name.strip(), value.strip()
