"""The docs' "where does a change go" (docs/architecture.md) is true: each worked example,
applied to a copy of this tree exactly as the page says (its code, in the files it names,
plus the lines it names), works in a real `tokenprobe serve` in front of the simulator.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from proxy.bench.ports import free_port
from tests.paths import ROOT
from tests.scrape import scrape
from tests.servers import stop, wait_http

ROOT = ROOT
PAGE = (ROOT / "docs" / "architecture.md").read_text()


def docs_module(path: str) -> str:
    """The page's Python block that starts with the comment `# <path>` (dedented when
    the block sits in a list item)."""
    match = re.search(
        r"^( *)```python\n\1# " + re.escape(path) + r"\n(.*?)^\1```", PAGE, re.S | re.M
    )
    assert match is not None, f"docs/architecture.md has no worked example for {path}"
    indent = len(match.group(1))
    return "".join(line[indent:] for line in match.group(2).splitlines(keepends=True))


def tree_copy(tmp: Path) -> Path:
    copy = tmp / "tree"
    # the source only: a compiled module (.so, the compiled build's pass) would shadow
    # the edit, and its shared library lives outside proxy/
    shutil.copytree(
        ROOT / "proxy", copy / "proxy", ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    return copy


def add_import(file: Path, statement: str) -> None:
    """Add an import statement after the module's last top-level import."""
    text = file.read_text()
    tree = ast.parse(text)
    last = max(node.end_lineno or 0 for node in tree.body if isinstance(node, IMPORTS))
    _insert_lines(file, text, last, statement + "\n")


def add_to_registry(file: Path, name: str, entry: str) -> None:
    """Add `entry` as the last element of the module-level tuple or list assigned to `name`."""
    text = file.read_text()
    tree = ast.parse(text)
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, ast.Assign | ast.AnnAssign) and any(
            isinstance(t, ast.Name) and t.id == name for t in targets
        ):
            value = node.value
            assert isinstance(value, ast.Tuple | ast.List) and value.elts, f"{name} is no sequence"
            last = value.elts[-1]
            indent = " " * last.col_offset
            _insert_lines(file, text, last.end_lineno or 0, f"{indent}{entry},\n")
            return
    raise AssertionError(f"{file} assigns no {name}")


def add_to_function(file: Path, qualname: str, code: str, *, where: str) -> None:
    """Add `code` (already indented for the body) to the function `qualname` (`f` or
    `Class.method`): at its "top" (after a docstring) or just before its final "return"."""
    text = file.read_text()
    function = _find_function(ast.parse(text), qualname.split("."))
    body = function.body
    if where == "top":  # before the first statement that is not the docstring
        first = body[1] if _is_docstring(body[0]) and len(body) > 1 else body[0]
        line = first.lineno - 1
    else:
        assert where == "before return" and isinstance(body[-1], ast.Return), qualname
        line = body[-1].lineno - 1
    _insert_lines(file, text, line, code if code.endswith("\n") else code + "\n")


IMPORTS = (ast.Import, ast.ImportFrom)


def _find_function(tree: ast.Module, names: list[str]) -> ast.FunctionDef | ast.AsyncFunctionDef:
    scope: list[ast.stmt] = tree.body
    for i, name in enumerate(names):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if i == len(names) - 1 else ast.ClassDef
        found = [n for n in scope if isinstance(n, kinds) and n.name == name]
        assert len(found) == 1, f"no single {name!r} in the tree"
        node = found[0]
        if isinstance(node, ast.ClassDef):
            scope = node.body
        else:
            return node
    raise AssertionError(f"no function {'.'.join(names)}")


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _insert_lines(file: Path, text: str, after_line: int, code: str) -> None:
    """Insert `code` after the first `after_line` lines of `text` and write the file."""
    lines = text.splitlines(keepends=True)
    file.write_text("".join([*lines[:after_line], code, *lines[after_line:]]))


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


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_new_api_is_one_module_and_its_registry_lines(tmp_path: Path) -> None:
    tree = tree_copy(tmp_path)
    apis = tree / "proxy" / "core" / "apis"
    (apis / "tokenize.py").write_text(docs_module("proxy/core/apis/tokenize.py"))
    init = apis / "__init__.py"
    add_import(init, "from proxy.core.apis.tokenize import Tokenize")
    add_to_registry(init, "APIS", "Tokenize()")
    body = {"model": "sim-model", "prompt": "a b c d e f"}
    with proxy_before_sim(tree) as (sim, proxy, _):
        direct = httpx.post(sim + "/tokenize", json=body)
        proxied = httpx.post(proxy + "/tokenize", json=body)
        assert proxied.status_code == 200 and proxied.content == direct.content
        count = float(direct.json()["count"])
        requests = scrape(proxy).series("tokenprobe_requests_total", endpoint="/tokenize")
        prompt = scrape(proxy).series("tokenprobe_prompt_tokens_total", endpoint="/tokenize")
    assert any(s.value == 1.0 for s in requests)
    assert any(s.value == count for s in prompt)


def test_a_new_metric_is_declared_and_observed_in_the_metrics_sink(tmp_path: Path) -> None:
    tree = tree_copy(tmp_path)
    metrics = tree / "proxy" / "sinks" / "metrics.py"
    declare = docs_module("proxy/sinks/metrics.py: Metrics.__init__")
    observe = docs_module("proxy/sinks/metrics.py: Metrics.record")
    add_to_function(metrics, "Metrics.__init__", declare, where="top")
    add_to_function(metrics, "Metrics.record", observe, where="top")
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    with proxy_before_sim(tree) as (_, proxy, _):
        httpx.post(proxy + "/v1/chat/completions", json={**body, "stream": True}).raise_for_status()
        httpx.post(proxy + "/v1/chat/completions", json=body).raise_for_status()
        streamed = scrape(proxy).series("tokenprobe_streamed_requests_total")
    assert [(s.labels, s.value) for s in streamed] == [
        ({"endpoint": "/v1/chat/completions", "model": "sim-model"}, 1.0)
    ]


def test_a_new_sink_is_one_file_and_one_line_in_the_assembly(tmp_path: Path) -> None:
    tree = tree_copy(tmp_path)
    sink = docs_module("proxy/sinks/slow_requests.py")
    (tree / "proxy" / "sinks" / "slow_requests.py").write_text(sink)
    assemble = tree / "proxy" / "server" / "assemble.py"
    add_import(assemble, "from proxy.sinks.slow_requests import SlowRequests")
    add_to_function(assemble, "_sinks", "    sinks.append(SlowRequests())", where="before return")
    body = {"model": "sim-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with proxy_before_sim(tree, "--ttft", "1.1") as (_, proxy, process):
        httpx.post(proxy + "/v1/chat/completions", json=body, timeout=10).raise_for_status()
        # The record lands just after the last byte; the sinks get it in one call, the
        # metrics sink first, so once /metrics counts it the new sink has written its line.
        wait_until(
            lambda: any(s.value == 1.0 for s in scrape(proxy).series("tokenprobe_requests_total"))
        )
    assert process.stderr is not None
    stderr = process.stderr.read().decode()
    # the programmed 1.1 s and what a loaded machine adds: CI once failed on the exact
    # "1.1" (the figure it printed was cut from the report; one over 1.19 s fails so)
    found = re.search(r"slow first token: (\d+\.\d\d) s \(model sim-model, /v1/chat/completions\)", stderr)  # fmt: skip
    assert found is not None, stderr
    assert 1.1 <= float(found.group(1)) < 3.0, stderr
