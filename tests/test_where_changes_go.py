"""The README's "where does a change go" is true: each worked example, applied to a copy
of this tree exactly as the README says (its code, in the files it names, plus the lines
it names), works in a real `tokenprobe serve` in front of the simulator.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.servers import free_port
from tests.test_serve import stop, wait_http

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def readme_module(path: str) -> str:
    """The README's Python block that starts with the comment `# <path>`."""
    match = re.search(r"```python\n# " + re.escape(path) + r"\n(.*?)```", README, re.S)
    assert match is not None, f"the README has no worked example for {path}"
    return match.group(1)


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


@contextmanager
def running(tree: Path, *args: str) -> Iterator[str]:
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
        yield url
    finally:
        stop(process)


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
    with (
        running(tree, "sim") as sim,
        running(
            tree, "serve", "--upstream", sim, "--access-log", "off", "--models-refresh", "0"
        ) as proxy,
    ):
        direct = httpx.post(sim + "/tokenize", json={"model": "sim-model", "prompt": "a b c d e f"})
        proxied = httpx.post(
            proxy + "/tokenize", json={"model": "sim-model", "prompt": "a b c d e f"}
        )
        assert proxied.status_code == 200 and proxied.content == direct.content
        count = direct.json()["count"]
        requests = metric_lines(proxy, "tokenprobe_requests_total{")
        assert any('endpoint="/tokenize"' in line and line.endswith(" 1.0") for line in requests)
        prompt = metric_lines(proxy, "tokenprobe_prompt_tokens_total{")
        assert any(
            'endpoint="/tokenize"' in line and line.endswith(f" {float(count)}") for line in prompt
        )
