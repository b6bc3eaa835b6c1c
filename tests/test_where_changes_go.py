"""The README's "where does a change go" is true: each worked example, applied to a copy
of this tree exactly as the README says (its code, in the files it names, plus the lines
it names), works in a real `tokenprobe serve` in front of the simulator.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from proxy.bench.ports import free_port
from tests.paths import ROOT
from tests.servers import stop, wait_http

ROOT = ROOT
README = (ROOT / "README.md").read_text()


def readme_module(path: str) -> str:
    """The README's Python block that starts with the comment `# <path>` (dedented when
    the block sits in a list item)."""
    match = re.search(
        r"^( *)```python\n\1# " + re.escape(path) + r"\n(.*?)^\1```", README, re.S | re.M
    )
    assert match is not None, f"the README has no worked example for {path}"
    indent = len(match.group(1))
    return "".join(line[indent:] for line in match.group(2).splitlines(keepends=True))


def tree_copy(tmp: Path) -> Path:
    copy = tmp / "tree"
    shutil.copytree(ROOT / "proxy", copy / "proxy", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def add_line(file: Path, after: str, line: str) -> None:
    """Insert `line` after the first line containing `after` (the README names both)."""
    text = file.read_text()
    assert after in text, f"{after!r} is not in {file}"
    head, tail = text.split(after, 1)
    rest_of_line, newline, tail = tail.partition("\n")
    file.write_text(head + after + rest_of_line + newline + line + "\n" + tail)


SERVE = ("--access-log", "off", "--models-refresh", "0", "--model-allowlist", "sim-model")


@contextmanager
def running(tree: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`python -m proxy ARGS` from the copy; its stderr is read once it has stopped."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", *args, "--port", str(port)],
        cwd=tree,  # `-m proxy` imports the copy
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + ("/healthz" if args[0] == "serve" else "/health"))
        yield url, process
    finally:
        stop(process)


@contextmanager
def proxy_before_sim(
    tree: Path, *sim_args: str
) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    """The copy's simulator, and the copy's proxy in front of it: (sim, proxy, proxy process)."""
    with (
        running(tree, "sim", *sim_args) as (sim, _),
        running(tree, "serve", "--upstream", sim, *SERVE) as (proxy, process),
    ):
        yield sim, proxy, process


def insert_after(file: Path, anchor: str, code: str) -> None:
    """Insert `code` right after the line `anchor` (the README names the place)."""
    text = file.read_text()
    assert text.count(anchor + "\n") == 1, f"{anchor!r} is not one line of {file}"
    file.write_text(text.replace(anchor + "\n", anchor + "\n" + code, 1))


def metric_lines(url: str, name: str) -> list[str]:
    text = httpx.get(url + "/metrics").text
    return [line for line in text.splitlines() if line.startswith(name)]


def test_a_new_api_is_one_module_and_its_registry_lines(tmp_path: Path) -> None:
    tree = tree_copy(tmp_path)
    apis = tree / "proxy" / "core" / "apis"
    (apis / "tokenize.py").write_text(readme_module("proxy/core/apis/tokenize.py"))
    init = apis / "__init__.py"
    add_line(
        init,
        "from proxy.core.apis.responses import",
        "from proxy.core.apis.tokenize import Tokenize",
    )
    add_line(init, "    Classify(),", "    Tokenize(),")
    body = {"model": "sim-model", "prompt": "a b c d e f"}
    with proxy_before_sim(tree) as (sim, proxy, _):
        direct = httpx.post(sim + "/tokenize", json=body)
        proxied = httpx.post(proxy + "/tokenize", json=body)
        assert proxied.status_code == 200 and proxied.content == direct.content
        count = float(direct.json()["count"])
        requests = metric_lines(proxy, "tokenprobe_requests_total{")
        prompt = metric_lines(proxy, "tokenprobe_prompt_tokens_total{")
    assert any('endpoint="/tokenize"' in line and line.endswith(" 1.0") for line in requests)
    assert any('endpoint="/tokenize"' in line and line.endswith(f" {count}") for line in prompt)


def test_a_new_metric_is_declared_and_observed_in_the_metrics_sink(tmp_path: Path) -> None:
    tree = tree_copy(tmp_path)
    metrics = tree / "proxy" / "sinks" / "metrics.py"
    declare = readme_module("proxy/sinks/metrics.py: Metrics.__init__")
    observe = readme_module("proxy/sinks/metrics.py: Metrics.record")
    insert_after(metrics, "    def __init__(self, registry: CollectorRegistry) -> None:", declare)
    insert_after(metrics, "    def record(self, m: Measurement, labels: Labels) -> None:", observe)
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    with proxy_before_sim(tree) as (_, proxy, _):
        httpx.post(proxy + "/v1/chat/completions", json={**body, "stream": True}).raise_for_status()
        httpx.post(proxy + "/v1/chat/completions", json=body).raise_for_status()
        lines = metric_lines(proxy, "tokenprobe_streamed_requests_total{")
    assert lines == [
        'tokenprobe_streamed_requests_total{endpoint="/v1/chat/completions",model="sim-model"} 1.0'
    ]


def test_a_new_sink_is_one_file_and_one_line_in_the_assembly(tmp_path: Path) -> None:
    tree = tree_copy(tmp_path)
    sink = readme_module("proxy/sinks/slow_requests.py")
    (tree / "proxy" / "sinks" / "slow_requests.py").write_text(sink)
    assemble = tree / "proxy" / "server" / "assemble.py"
    add_line(
        assemble,
        "from proxy.sinks.logs import",
        "from proxy.sinks.slow_requests import SlowRequests",
    )
    insert_after(assemble, "    sinks: list[Sink] = []", "    sinks.append(SlowRequests())\n")
    body = {"model": "sim-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with proxy_before_sim(tree, "--ttft", "1.1") as (_, proxy, process):
        httpx.post(proxy + "/v1/chat/completions", json=body, timeout=10).raise_for_status()
        time.sleep(0.2)  # the record lands just after the last byte
    assert process.stderr is not None
    stderr = process.stderr.read().decode()
    assert "slow first token: 1.1" in stderr
    assert "(model sim-model, /v1/chat/completions)" in stderr
