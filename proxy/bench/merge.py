"""`tokenprobe bench merge RUN.json ...`: shards of one run (`--shard I/N`, `--workers N`)
joined into the run file one process would have written.

Every shard ran the same schedule from its own start (the same instant on one machine,
`--workers`; each machine's own on several): a record's `scheduled` offset is the
shared schedule's, its latencies were measured on its own machine. The merged level
holds every shard's records, ordered as one process orders them; its wall time is the
longest shard's; every figure is recomputed from the records by the same code
(`stats.summarize`) as a one-process run, so merging is exact, and the cost from those.
The shards' --compare-metrics blocks are left out: each set its share of the requests
against what the proxy saw of all of them, and no merge can part those (`--workers`
scrapes once around the whole run instead).

Exit status: 0, or 2 when a file cannot be read or the shards are not of one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from proxy.bench.client import Result
from proxy.bench.load import Level
from proxy.bench.report import cost_block, write_json
from proxy.bench.stats import Summary, summarize
from proxy.core.engine import EngineMetrics, SpecDecode
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.toolcalls import ToolCall

PROG = "tokenprobe bench merge"
#: Config keys that differ between the shards of one run.
PER_SHARD = frozenset({"out", "shard", "start_at", "progress", "workers", "label", "plot"})
_FIELDS = {f.name for f in dataclasses.fields(Measurement)} - {"extra", "prefix"}


class MergeError(ValueError):
    """Files that are not shards of one run; the message names the file."""


def read(path: str) -> dict[str, Any]:
    try:
        doc = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise MergeError(f"{path}: cannot read a run file: {exc}") from None
    if not isinstance(doc, dict) or doc.get("tool") != "tokenprobe bench" or "records" not in doc:
        raise MergeError(f"{path}: not a tokenprobe bench run file with records")
    return doc


def measurement(record: Mapping[str, Any]) -> Measurement:
    """A run file's record back as the Measurement it was written from."""
    values = {k: record[k] for k in _FIELDS if k in record}
    values["inter_token_latencies"] = tuple(values.get("inter_token_latencies") or ())
    values["token_source"] = TokenSource(values["token_source"])
    if values.get("error_type") is not None:
        values["error_type"] = ErrorType(values["error_type"])
    # The objects orjson writes as JSON objects and arrays, as the record holds them (a
    # document that did not go through a file, --workers', holds them still).
    values["tool_calls"] = tuple(
        call if isinstance(call, ToolCall) else ToolCall(**call)
        for call in values.get("tool_calls") or ()
    )
    values["finish_reasons"] = tuple(values.get("finish_reasons") or ())
    values.setdefault("stream_requested", values["stream"])  # a run saved before it was kept
    engine = values.get("engine")
    if isinstance(engine, dict):
        spec = engine.get("spec")
        values["engine"] = EngineMetrics(
            **{
                **engine,
                "spec": None if spec is None else SpecDecode(**spec),
                "invalid": tuple(engine.get("invalid") or ()),
            }
        )
    return Measurement(**values)


def levels_of(docs: Sequence[dict[str, Any]]) -> list[Level]:
    """The merged levels: each shard's records and loop-lag samples, one level per label."""
    merged: dict[str, Level] = {}
    for doc in docs:
        extra = {x["label"]: x for x in doc.get("levels") or ()}
        for position, s in enumerate(doc["summary"]):
            level = merged.setdefault(s["label"], Level(position, s["value"], s["label"]))
            level.end = max(level.end, s["duration"])  # every shard's level starts at 0
            level.cancelled += s.get("cancelled") or 0
            level.loop_lag.extend(extra.get(s["label"], {}).get("loop_lag") or ())
            level.cpu += extra.get(s["label"], {}).get("cpu_s") or 0.0
        for record in doc["records"]:
            level = merged[record["level"]]
            level.results.append(
                Result(
                    level.index,
                    record["index"],
                    record["scheduled"],
                    record["scheduled"] + record["send_delay"],
                    measurement(record),
                )
            )
    for level in merged.values():
        level.results.sort(key=lambda r: (r.scheduled, r.index))
    return sorted(merged.values(), key=lambda level: level.index)


def merge(docs: Sequence[dict[str, Any]], paths: Sequence[str]) -> dict[str, Any]:
    first = docs[0]
    base = {k: v for k, v in first["config"].items() if k not in PER_SHARD}
    for doc, path in zip(docs[1:], paths[1:], strict=True):
        other = {k: v for k, v in doc["config"].items() if k not in PER_SHARD}
        if other != base:
            keys = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            raise MergeError(f"{path}: not a shard of the same run as {paths[0]} ({', '.join(keys)} differ)")  # fmt: skip
    levels = levels_of(docs)
    slo = dict(first["config"].get("slo") or {})
    summaries = [summarize(level, slo) for level in levels]
    statuses = {doc.get("status") for doc in docs}
    status = next((s for s in ("interrupted", "failing") if s in statuses), "complete")
    out = {
        **first,
        "status": status,
        "problem": next((d["problem"] for d in docs if d.get("problem")), None),
        "config": {**first["config"], "shard": None, "shards": len(docs)},
        "clock_origin": first.get("clock_origin"),
        "summary": [dataclasses.asdict(s) for s in summaries],
        "levels": [{"label": lv.label, "loop_lag": lv.loop_lag, "cpu_s": lv.cpu} for lv in levels],
        "records": [record_of(r, lv.label) for lv in levels for r in lv.results],
    }
    # A shard's cost is its share's (half the tokens in the same wall time: twice the
    # price); its --compare-metrics block set its share of the requests against every
    # request the proxy saw, all shards' (a false 2x mismatch): the one is recomputed,
    # the other cannot be, and --workers scrapes once around the whole run instead.
    out["cost"] = _cost(first.get("cost"), summaries)
    out["compare"] = None
    if "replay" in first:
        out["replay"] = {**first["replay"], "shard": None, "shards": len(docs)}
    return out


def _cost(shard: Mapping[str, Any] | None, summaries: Sequence[Summary]) -> dict[str, Any] | None:
    """The cost block of the merged run, from its summaries (the shards' own rate)."""
    if not shard:
        return None
    return cost_block(float(shard["cost_per_hour"]), str(shard["currency"]), summaries)


def record_of(result: Result, label: str) -> dict[str, Any]:
    from proxy.bench.report import record

    return record(result, label, 0.0)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog=PROG, description="Join the shards of one bench run.")
    p.add_argument("runs", nargs="+", metavar="RUN.json", help="the shards' --out files")
    p.add_argument("--out", required=True, help="the merged run file")
    ns = p.parse_args(list(argv))
    try:
        doc = merge([read(path) for path in ns.runs], ns.runs)
    except MergeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    write_json(ns.out, doc)
    total = sum(len(s["label"]) >= 0 for s in doc["summary"])
    print(f"{PROG}: merged {len(ns.runs)} shards, {len(doc['records'])} records in {total} levels into {ns.out}", file=sys.stderr)  # fmt: skip
    return 0
