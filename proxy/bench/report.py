"""What a run leaves behind: the table on stdout, the JSON file, and a one-line diagnosis
when every request failed the same way."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from proxy.bench.client import Result
from proxy.bench.load import Level
from proxy.bench.options import Options
from proxy.bench.stats import Summary
from proxy.core.measurement import ErrorType, TokenSource
from proxy.core.pricing import per_million_tokens
from proxy.core.secrets import is_secret_header, masked_url

Cell = Callable[[Summary], str]

#: Event-loop lag (p99, seconds) above which the table warns that the bench was the bottleneck.
LAG_WARNING = 0.005


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# (group, column, cell). Three figures kept apart: TTFT, one stream's decode speed, and
# the output throughput of all streams together.
COLUMNS: tuple[tuple[str, str, Cell], ...] = (
    ("", "level", lambda s: s.label),
    ("requests", "ok", lambda s: str(s.ok)),
    ("requests", "errors", lambda s: str(s.requests - s.ok)),
    ("requests", "length", lambda s: str(s.truncated)),
    ("TTFT ms", "p50", lambda s: _ms(s.ttft["p50"])),
    ("TTFT ms", "p95", lambda s: _ms(s.ttft["p95"])),
    ("TTFT ms", "p99", lambda s: _ms(s.ttft["p99"])),
    ("TPOT ms", "p50", lambda s: _ms(s.tpot["p50"])),
    ("TPOT ms", "p95", lambda s: _ms(s.tpot["p95"])),
    ("ITL ms", "p95", lambda s: _ms(s.itl["p95"])),
    ("e2e s", "p50", lambda s: _s(s.e2e["p50"])),
    ("e2e s", "p95", lambda s: _s(s.e2e["p95"])),
    ("per-stream", "tok/s p50", lambda s: _num(s.decode_tokens_per_second["p50"])),
    ("all streams", "out tok/s", lambda s: _num(s.output_throughput)),
    ("all streams", "req/s", lambda s: _num(s.request_throughput, 2)),
    ("all streams", "goodput/s", lambda s: _num(s.goodput, 2)),
)

LEGEND = """\
length: finish_reason "length", cut at --max-tokens (all of them when ignore_eos is sent).
TTFT: request due -> first generated token. TPOT: (last token - first token) / (tokens - 1), per request.
per-stream tok/s: one request's decode speed after its first token (median over requests).
all streams out tok/s: output tokens of every request / wall time of the level (aggregate throughput)."""
GOODPUT = "goodput/s: requests per second that met every --slo target."


def cost_columns(cost_per_hour: float, currency: str) -> tuple[tuple[str, str, Cell], ...]:
    """Cost per million tokens at a level's aggregate throughput (see core.pricing.per_million_tokens)."""
    group = f"{currency} per 1M tok"

    def cell(tokens: Callable[[Summary], int]) -> Cell:
        return lambda s: _num(per_million_tokens(cost_per_hour, tokens(s) / s.duration), 3)

    return (
        (group, "output", cell(lambda s: s.output_tokens)),
        (group, "input", cell(lambda s: s.prompt_tokens)),
    )


def table(
    summaries: Sequence[Summary],
    cost_per_hour: float | None = None,
    currency: str = "USD",
    *,
    open_loop: bool = False,
) -> str:
    """The levels' table, its legend and notes; `open_loop`: requests were sent on a
    schedule (--rate, replay), so how late they went out is worth a note."""
    goodput = any(s.goodput is not None for s in summaries)
    columns = COLUMNS if goodput else COLUMNS[:-1]
    if cost_per_hour is not None:
        columns = (*columns, *cost_columns(cost_per_hour, currency))
    rows = [[cell(s) for _, _, cell in columns] for s in summaries]
    widths = [
        max(len(name), *(len(row[i]) for row in rows)) if rows else len(name)
        for i, (_, name, _) in enumerate(columns)
    ]
    groups, names = [], []
    for i, (group, name, _) in enumerate(columns):
        first = i == 0 or columns[i - 1][0] != group
        groups.append((group if first else "").ljust(widths[i]))
        names.append(name.ljust(widths[i]) if i == 0 else name.rjust(widths[i]))
    lines = ["  ".join(groups).rstrip(), "  ".join(names)]
    for row in rows:
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w)
                for i, (v, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    lines.append("")
    lines.append(LEGEND)
    if goodput:
        lines.append(GOODPUT)
    if cost_per_hour is not None:
        lines.append(
            f"{currency} per 1M tok: --cost-per-hour {cost_per_hour:g} / (tokens/s of all streams "
            "* 3600) * 1e6, for output and input tokens each (each charges the whole hour)."
        )
    lines.extend(_notes(summaries, open_loop))
    return "\n".join(lines)


def _notes(summaries: Sequence[Summary], open_loop: bool) -> list[str]:
    notes = []
    for s in summaries:
        for kind, count in sorted(s.errors.items()):
            example = s.error_examples.get(kind)
            notes.append(
                f"{s.label}: {count} failed with {kind}" + (f": {example}" if example else "")
            )
        if s.cancelled:
            notes.append(f"{s.label}: {s.cancelled} requests in flight when stopped (not counted)")
        notes.extend(_engine_notes(s))
        lag = s.loop_lag["p99"]
        if lag is not None and lag > LAG_WARNING:
            notes.append(
                f"{s.label}: warning: the bench's own event loop ran {_ms(lag)} ms late (p99); "
                "its timestamps are late by as much: use fewer streams per bench process"
            )
        if open_loop and s.send_delay["p50"] is not None:
            d = s.send_delay
            notes.append(
                f"{s.label}: sends were late by p50 {_ms(d['p50'])} ms, p99 {_ms(d['p99'])} ms, "
                f"max {_ms(d['max'])} ms (latencies count from the scheduled time)"
            )
    return notes


def _kinds_notes(s: Summary) -> list[str]:
    """Reasoning, the first answer and tool calls (issue 26), when the level had them."""
    notes = []
    ttfa, ttft = s.ttfa or {}, s.ttft
    if s.reasoned:
        notes.append(
            f"{s.label}: {s.reasoned} requests reasoned ({s.reasoning_tokens} reasoning "
            f"tokens); first answer p50 {_ms(ttfa.get('p50'))} ms, p95 "
            f"{_ms(ttfa.get('p95'))} ms against first token p50 {_ms(ttft['p50'])} ms"
        )
    if s.without_answer:
        notes.append(
            f"{s.label}: {s.without_answer} requests generated but delivered no answer and "
            "no tool call (cut off while reasoning, or a forced call cut before it began)"
        )
    if s.tool_calls:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(s.tool_calls.items()))
        notes.append(f"{s.label}: tool calls: {outcomes}")
    return notes


def _engine_notes(s: Summary) -> list[str]:
    """Where the first token's time went, when the engine said (vLLM per-request metrics)."""
    notes = []
    split = s.ttft_split
    if split is not None:
        parts = (split.get("queue", 0.0), split["engine"], split["outside"])
        whole = sum(parts) or 1.0
        queue, engine, outside = (f"{_ms(p)} ms ({100 * p / whole:.0f}%)" for p in parts)
        queue = f"queue {queue}" if "queue" in split else "queue not reported (it is outside)"
        notes.append(
            f"{s.label}: first token, mean of {split['requests']:g} streams the engine timed: "
            f"{queue} + engine {engine} + outside the engine {outside} = {_ms(whole)} ms"
        )
    spec = s.spec_decode
    if spec is not None:
        notes.append(
            f"{s.label}: speculative decoding: {spec['accepted']:g} of {spec['draft']:g} draft "
            f"tokens accepted ({100 * spec['acceptance_rate']:.0f}%), mean acceptance length "
            f"{spec['mean_acceptance_length']:.2f}"
        )
    notes.extend(_kinds_notes(s))
    counted = s.token_sources.get(TokenSource.CHUNKS.value, 0)
    if counted:
        notes.append(
            f"{s.label}: output tokens of {counted} of {s.ok} requests are content events "
            "counted (the backend sent no usage and no --tokenizer was given): their tok/s "
            "and TPOT are per event, not per token"
        )
    if s.tokens_per_chunk is not None and s.tokens_per_chunk > 1.05:
        notes.append(
            f"{s.label}: {s.tokens_per_chunk:.2f} output tokens per content event: the "
            "inter-chunk latency (ITL) is not the per-token latency"
        )
    return notes


def record(result: Result, label: str, origin: float) -> dict[str, Any]:
    m = result.m
    out: dict[str, Any] = {
        "level": label,
        "index": result.index,
        "scheduled": result.scheduled - origin,  # seconds since the run began
        "send_delay": result.sent - result.scheduled,
    }
    for f in dataclasses.fields(m):
        if f.name != "prefix":  # the prefix digests leave only keyed (the access log)
            out[f.name] = getattr(m, f.name)
    return out


def document(
    options: Options,
    levels: Sequence[Level],
    summaries: Sequence[Summary],
    *,
    status: str,
    problem: str | None,
    compare: dict[str, Any] | None,
    prompts_sha256: str | None = None,
) -> dict[str, Any]:
    config = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    config["prompts_sha256"] = prompts_sha256
    config["api_key"] = "***" if options.api_key else None
    config["headers"] = [
        [k, "***" if is_secret_header(k.lower()) else v] for k, v in options.headers
    ]
    # the URLs as shown everywhere (`masked_url`): user info and credential parameters
    config["base_url"] = masked_url(options.base_url)
    if options.compare_metrics is not None:  # a /metrics behind auth: `http://u:p@`, `?token=`
        config["compare_metrics"] = masked_url(options.compare_metrics)
    origin = levels[0].start if levels else 0.0
    return {
        "tool": "tokenprobe bench",
        "status": status,  # complete | interrupted | failing
        "problem": problem,
        "config": config,
        # perf_counter() at the first level's start: `scheduled` + `ttft` + this is the
        # first token's instant on the machine's monotonic clock (CLOCK_MONOTONIC on Linux).
        "clock_origin": origin,
        "summary": [dataclasses.asdict(s) for s in summaries],
        "compare": compare,
        "cost": _cost(options, summaries),
        # What `bench merge` needs besides the records: each level's loop-lag samples;
        # and the bench's own CPU seconds in the level (what a chunk costs the client).
        "levels": [
            {"label": level.label, "loop_lag": level.loop_lag, "cpu_s": level.cpu}
            for level in levels
        ],
        "records": [record(r, level.label, origin) for level in levels for r in level.results],
    }


def _cost(options: Options, summaries: Sequence[Summary]) -> dict[str, Any] | None:
    if options.cost_per_hour is None:
        return None
    return cost_block(options.cost_per_hour, options.currency, summaries)


def cost_block(hourly: float, currency: str, summaries: Sequence[Summary]) -> dict[str, Any]:
    """The JSON's `cost`: each level's price per million tokens at `hourly` (a run's, or
    the merged shards' from their records: bench merge)."""
    return {
        "cost_per_hour": hourly,
        "currency": currency,
        "per_million_tokens": {
            s.label: {
                "output": per_million_tokens(hourly, s.output_tokens / s.duration),
                "input": per_million_tokens(hourly, s.prompt_tokens / s.duration),
            }
            for s in summaries
        },
    }


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a file, and an old file survives a failure."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    os.replace(tmp, path)


def diagnose(result: Result, options: Options, served: Sequence[str] = ()) -> str:
    """One line naming why every request failed."""
    m = result.m
    kind = m.error_type
    said = " ".join((m.error_message or "").split()) or "no details"
    http = f"HTTP {m.status_code}: " if m.status_code else ""
    # the URLs masked, as in the report's config (its user info: --url's)
    base_url, url = masked_url(options.base_url), masked_url(options.url)
    if kind is ErrorType.AUTH:
        hint = (
            "check --api-key or OPENAI_API_KEY"
            if options.api_key
            else "no API key was sent: pass --api-key or set OPENAI_API_KEY"
        )
        return f"auth: the backend rejected the API key ({http}{said}); {hint}"
    if kind is ErrorType.UPSTREAM_UNREACHABLE:
        return f"upstream_unreachable: cannot connect to {base_url} ({said})"
    if kind is ErrorType.UPSTREAM_TIMEOUT:
        return f"upstream_timeout: {url} went silent for over {options.timeout:g}s ({said})"
    if kind is ErrorType.NOT_FOUND:
        known = f"; served models: {', '.join(served)}" if served else ""
        return (
            f"not_found: unknown model {options.model!r} or wrong URL {url} ({http}{said}){known}"
        )
    if kind is ErrorType.CONTEXT_LENGTH:
        return (
            f"context_length: the prompt plus --max-tokens {options.max_tokens} exceed the "
            f"model's context length ({http}{said})"
        )
    name = kind.value if kind is not None else "error"
    return f"{name}: every request failed the same way ({http}{said})"
