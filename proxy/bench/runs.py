"""Saved runs (`tokenprobe bench --out RUN.json`) read back, and whether two can be compared.

Two runs compare when they asked the same question: the same model name, endpoint,
prompts, output length, load shape and levels, and the same SLO (goodput depends on
it). The backend URL may differ: that is usually the point (an FP16 and an INT4 build).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import orjson


class RunError(ValueError):
    """A run file that cannot be read or compared; the message names the file."""


@dataclass(frozen=True, slots=True)
class SavedLevel:
    label: str
    value: float
    duration: float  # wall time of the level (s), the denominator of every throughput
    records: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True, slots=True)
class SavedRun:
    path: str
    label: str  # --label at bench time, else the file name without .json
    config: Mapping[str, Any]
    levels: tuple[SavedLevel, ...]

    @property
    def slo(self) -> dict[str, float]:
        return dict(self.config.get("slo") or {})


def load(path: str) -> SavedRun:
    try:
        doc = orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise RunError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError:
        raise RunError(f"{path}: not JSON (expected a file from tokenprobe bench --out)") from None
    if not isinstance(doc, dict) or doc.get("tool") != "tokenprobe bench":
        raise RunError(f"{path}: not a tokenprobe bench result")
    if "records" not in doc:
        raise RunError(f"{path}: has no per-request records; rerun tokenprobe bench with --out")
    config = doc.get("config") or {}
    if not isinstance(config, dict):
        raise RunError(f"{path}: its config is not an object")
    levels = _levels(path, doc["records"], doc.get("summary") or [])
    label = config.get("label") or Path(path).name.removesuffix(".json")
    return SavedRun(path, str(label), config, levels)


def _levels(path: str, records: Any, summary: Any) -> tuple[SavedLevel, ...]:
    """The summary's levels with their records; a file edited or cut short by hand fails
    here, naming itself, not later as a KeyError deep in the comparison."""
    if not isinstance(records, list) or not all(
        isinstance(r, dict) and isinstance(r.get("level"), str) for r in records
    ):
        raise RunError(f"{path}: its records are not a list of records each naming its level")
    if not isinstance(summary, list) or not all(_is_level(s) for s in summary):
        raise RunError(
            f"{path}: its summary is not a list of levels each with a label, a value and "
            "a positive duration"
        )
    by_level: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        by_level.setdefault(record["level"], []).append(record)
    return tuple(
        SavedLevel(s["label"], s["value"], s["duration"], tuple(by_level.get(s["label"], ())))
        for s in summary
    )


def _is_level(summary: Any) -> bool:
    """A summary row: a label, a value, and a duration to divide throughputs by."""
    if not isinstance(summary, dict) or not isinstance(summary.get("label"), str):
        return False
    value, duration = summary.get("value"), summary.get("duration")
    if not (_number(value) and _number(duration)):
        return False
    return math.isfinite(duration) and duration > 0


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _prompts(config: Mapping[str, Any]) -> Any:
    """What identifies a run's prompts: their digest, else where they came from."""
    if config.get("prompts_sha256"):
        return config["prompts_sha256"]
    return (config.get("prompts_file"), config.get("input_tokens"))


#: (what the message calls it, how to read it from a run's config)
COMPARED: tuple[tuple[str, Any], ...] = (
    ("model", lambda c: c.get("model")),
    ("endpoint", lambda c: c.get("endpoint")),
    ("prompts", _prompts),
    ("input tokens", lambda c: c.get("input_tokens")),
    ("max tokens", lambda c: c.get("max_tokens")),
    ("ignore_eos", lambda c: c.get("ignore_eos")),
    ("load shape", lambda c: c.get("mode")),
    ("SLO", lambda c: c.get("slo") or {}),
)


def differences(first: SavedRun, other: SavedRun) -> list[str]:
    """Why `other` does not answer the same question as `first` (empty when it does)."""
    found = []
    for name, read in COMPARED:
        a, b = read(first.config), read(other.config)
        if a != b:
            if name == "prompts":
                found.append(f"prompts differ ({first.label} and {other.label} sent other prompts)")
            else:
                found.append(f"{name}: {first.label} has {_show(a)}, {other.label} has {_show(b)}")
    a_levels = [level.label for level in first.levels]
    b_levels = [level.label for level in other.levels]
    if a_levels != b_levels:
        found.append(f"levels: {first.label} has {a_levels}, {other.label} has {b_levels}")
    return found


def _show(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return repr(value)
