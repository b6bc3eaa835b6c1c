"""Every command the docs show is run by the tests, or says why it cannot be.

A fenced block whose first line is a command (or a `$ ` transcript) carries a marker in
the line above it, an HTML comment the site does not show:

- `<!-- docs-test: run -->`: this file runs the block as written, in a scratch directory:
  `tokenprobe` is this tree's `python -m proxy`, the ports it names are swapped for free
  ones and hosts for 127.0.0.1, servers (`tokenprobe serve`, `sim`, hypercorn, uvicorn)
  run in the background until the block ends and must still be up then, every other
  command must succeed;
- `<!-- docs-test: tests/PATH.py::NAME (what it runs) -->`: that test runs the command;
- `<!-- docs-test: not run: REASON -->`: it needs what a test cannot have (a GPU, Docker,
  a cluster, a production log, minutes of load);
- `<!-- docs-test: output -->`: the block is output, not a command.

Every `tokenprobe serve | sim | bench` command in any marked block, run or not, is also
parsed by that command's own argument parser, so a renamed flag or a bad value fails here.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.bench.ports import free_port
from tests.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PROGRAMS = (
    "tokenprobe ",
    "pip ",
    "pytest",
    "python ",
    "python3 ",
    "curl ",
    "docker ",
    "kubectl ",
    "bash ",
    "ruff ",
    "mypy",
    "cd ",
    "hypercorn ",
    "uvicorn ",
    "mkdocs ",
    ".venv/",
    "$ ",
    "MODEL=",
    "TOKENPROBE_",
)
MARKER = re.compile(r"<!-- docs-test: (.+?) -->")
SERVERS = ("tokenprobe serve", "tokenprobe sim", "hypercorn ", "uvicorn ")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    body: str
    marker: str | None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"

    def commands(self) -> list[str]:
        """The block's commands: `$ ` lines of a transcript (output skipped), else every
        line; backslash continuations joined, trailing `  # comments` dropped."""
        lines = self.body.splitlines()
        transcript = any(line.startswith("$ ") for line in lines)
        out: list[str] = []
        joining = False
        for line in lines:
            if joining:
                out[-1] += " " + line.strip()
            elif transcript and not line.startswith("$ "):
                continue
            elif line.strip():
                out.append(line.removeprefix("$ "))
            joining = out[-1].endswith("\\") if out else False
            if joining:
                out[-1] = out[-1][:-1].rstrip()
        return [re.sub(r"\s{2,}#.*$", "", command).strip() for command in out]


def blocks() -> list[Block]:
    found = []
    for path in PAGES:
        text = path.read_text()
        for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.S | re.M):
            body = match.group(3)
            if match.group(2) == "python" or not body.strip():
                continue
            first = body.strip().splitlines()[0].strip()
            if not first.startswith(PROGRAMS):
                continue
            before = text[: match.start()].rstrip().splitlines()
            marker = MARKER.search(before[-1]) if before else None
            line = text[: match.start()].count("\n") + 1
            body = "\n".join(row[len(match.group(1)) :] for row in body.splitlines())
            name = str(path.relative_to(ROOT))
            found.append(Block(name, line, body, marker.group(1) if marker else None))
    return found


BLOCKS = blocks()
RUN = [b for b in BLOCKS if b.marker == "run"]


def test_every_command_block_is_run_or_says_why_not() -> None:
    unmarked = [str(b) for b in BLOCKS if b.marker is None]
    assert unmarked == [], (
        "mark each with <!-- docs-test: run | tests/x.py::test_y (...) | not run: REASON | output -->"
    )
    for block in BLOCKS:
        marker = block.marker or ""
        if marker.startswith("not run:"):
            assert len(marker) > len("not run: ") + 10, f"{block}: say why it is not run"
        elif marker not in ("run", "output"):
            _assert_test_exists(block, marker)
    assert len(RUN) >= 5  # the blocks below really run


def _assert_test_exists(block: Block, marker: str) -> None:
    target = marker.split(" ", 1)[0]
    file, _, name = target.partition("::")
    path = ROOT / file
    assert path.is_file() and name, f"{block}: {marker!r} names no test file::function"
    tree = ast.parse(path.read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert name in names, f"{block}: {file} has no test {name}"


# -- every tokenprobe command parses --------------------------------------------------


def _parsers() -> dict[str, Callable[[list[str]], object]]:
    from proxy.bench import compare_runs, replay
    from proxy.bench.options import parse as bench
    from proxy.settings import parse as serve
    from proxy.sim.cli import parse as sim

    return {
        "serve": lambda argv: serve(argv, {}),
        "sim": lambda argv: sim(argv, {}),
        "bench": lambda argv: bench(argv, {}),
        "bench compare": lambda argv: compare_runs.parser().parse_args(argv),
        "bench replay": lambda argv: replay.parser().parse_args(argv),
    }


def _tokenprobe_commands() -> list[tuple[Block, str, list[str]]]:
    """(block, subcommand, its arguments) for each tokenprobe invocation shown."""
    found = []
    for block in BLOCKS:
        if block.marker == "output":
            continue
        for command in block.commands():
            for words in _simple_commands(command):
                while words and "=" in words[0] and not words[0].startswith("-"):
                    words.pop(0)  # VARIABLE=value before the program
                if len(words) < 2 or words[0] != "tokenprobe":
                    continue
                sub = words[1]
                if sub == "bench" and len(words) > 2 and words[2] in ("compare", "replay"):
                    sub = f"bench {words[2]}"
                args = words[len(sub.split()) + 1 :]
                found.append((block, sub, args))
    return found


OPERATORS = frozenset({"&&", "||", "|", ";", "&"})


def _simple_commands(command: str) -> list[list[str]]:
    """A shell line's simple commands, as words, redirections dropped."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    redirect = False
    for word in lexer:
        if word in OPERATORS:
            commands.append([])
        elif word in (">", ">>", "<", "2>", "2>&1"):
            redirect = True
        elif redirect:
            redirect = False  # the redirection's target
        else:
            commands[-1].append(word)
    return [words for words in commands if words]


def test_every_tokenprobe_command_shown_parses_with_its_own_parser() -> None:
    parsers = _parsers()
    checked = 0
    for block, sub, args in _tokenprobe_commands():
        if sub not in parsers:
            continue  # demo: every one is run (marker run or a named test)
        elided = "..." in args
        try:
            if elided:  # `tokenprobe bench ... --flag`: the flags shown must exist
                _known_flags(sub, [a for a in args if a != "..."], block)
            else:
                parsers[sub](args)
        except SystemExit as exc:
            pytest.fail(f"{block}: `tokenprobe {sub} {' '.join(args)}` does not parse ({exc})")
        checked += 1
    assert checked >= 20


def _known_flags(sub: str, args: list[str], block: Block) -> None:
    from proxy.bench import options

    assert sub == "bench", f"{block}: only bench commands may be elided with ..."
    known = set(options.parser()._option_string_actions)
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in known]
    assert unknown == [], f"{block}: unknown flags {unknown}"


# -- the blocks marked run, run ---------------------------------------------------------

WAIT_PORT = """
wait_port() {  # a server's port accepts connections within 15 s
    for _ in $(seq 150); do
        (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0
        sleep 0.1
    done
    echo "nothing listens on port $1" >&2; return 1
}
"""


#: A program at a command's start (after any VARIABLE=value), to run from this tree and
#: this interpreter; a plain command, so that `$!` of a background one is its own pid.
PROGRAM = re.compile(r"(^|&& |; |\| )((?:[A-Z_]+=\S+ )*)(tokenprobe|hypercorn|uvicorn|python) ")


def _program(match: re.Match[str]) -> str:
    """This tree's Python for the commands a reader's venv would give: the tests may run
    without the venv on PATH, where `python` is another one (without the extras)."""
    if match.group(3) == "python":
        return f'{match.group(1)}{match.group(2)}"$PY" '
    module = "proxy" if match.group(3) == "tokenprobe" else match.group(3)
    return f'{match.group(1)}{match.group(2)}"$PY" -m {module} '


def script(block: Block) -> str:
    """The block as a bash script: tokenprobe is this tree's proxy, ports are free ones,
    servers run in the background and must still be alive when the block is done."""
    ports: dict[str, str] = {}

    def port(match: re.Match[str]) -> str:
        number = ports.setdefault(match.group(2), str(free_port()))
        return match.group(1) + number

    lines = [
        "set -euo pipefail",
        f"PY={shlex.quote(sys.executable)}",
        "servers=()",
        "trap 'kill ${servers[@]} 2>/dev/null || true' EXIT",
        WAIT_PORT,
    ]
    for block_command in block.commands():
        command = re.sub(
            r"(--port |--bind [0-9.]+:|//[a-z0-9.]+:|localhost:)(\d{4,5})\b", port, block_command
        )
        command = re.sub(r"//vllm:|//0\.0\.0\.0:", "//127.0.0.1:", command)
        command = command.replace("0.0.0.0", "127.0.0.1")
        command = PROGRAM.sub(_program, command)
        shown = re.sub(r"^([A-Z_]+=\S+ )+", "", block_command)
        if shown.startswith(SERVERS):
            listen = re.search(r"(?:--port |--bind [0-9.]+:)(\d+)", command)
            assert listen, f"{block}: a server command must name its port: {command}"
            lines.append(command.rstrip("& ") + " > /dev/null 2>&1 &")
            lines.append("servers+=($!)")
            lines.append(f"wait_port {listen.group(1)}")
        else:
            lines.append(command)
    lines.append('for pid in "${servers[@]}"; do kill -0 "$pid"; done  # still up')
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("block", RUN, ids=str)
def test_the_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    done = subprocess.run(
        ["bash", "-c", script(block)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{block}:\n{script(block)}\n{done.stdout}\n{done.stderr}"
