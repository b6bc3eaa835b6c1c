"""deploy/kubernetes/replay/: the Indexed Job that replays a log in shards and merges them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "deploy" / "kubernetes" / "replay" / "job.yaml"
VERSIONS = ("1.27", kubernetes_validate.latest_version())


def job() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(JOB.read_text())
    return doc


@pytest.mark.parametrize("version", VERSIONS)
def test_job_is_valid_against_the_kubernetes_schema(version: str) -> None:
    kubernetes_validate.validate(job(), version, strict=True)


def test_every_shard_runs_at_once_and_knows_how_many_there_are() -> None:
    spec = job()["spec"]
    assert spec["completionMode"] == "Indexed"
    env = {e["name"]: e["value"] for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert spec["completions"] == spec["parallelism"] == int(env["SHARDS"])


def test_the_script_replays_its_shard_and_shard_zero_merges() -> None:
    script = job()["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert '--shard "$I/$SHARDS"' in script and 'I="$JOB_COMPLETION_INDEX"' in script
    assert re.search(r"tokenprobe bench merge .*--out", script)
    assert subprocess.run(["sh", "-n", "-c", script], capture_output=True).returncode == 0
    mounts = {m["name"]: m for m in job()["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}  # fmt: skip
    assert mounts["logs"]["readOnly"] is True and mounts["results"]["mountPath"] == "/results"


def test_the_flags_the_script_uses_exist() -> None:
    from proxy.bench.replay import parser

    known = {o for a in parser()._actions for o in a.option_strings}
    script = job()["spec"]["template"]["spec"]["containers"][0]["args"][0]
    replay_line = script[script.index("tokenprobe bench replay") : script.index("if [")]
    used = set(re.findall(r"(--[a-z-]+)", replay_line))
    assert used and used <= known, used - known
