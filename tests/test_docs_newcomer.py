"""What a newcomer meets first works as written: on a stock Debian 12, whose system pip
refuses to install outside a venv ("externally-managed-environment"), the README's and
Getting started's two commands make their venv, say where the clone comes from, and come
before the rest; the extras a page's commands need are named before them, in the form
that installs from the clone; and every page is listed where a reader looks for it."""

from __future__ import annotations

import re

from tests.paths import ROOT

README = (ROOT / "README.md").read_text()
GETTING_STARTED = (ROOT / "docs" / "getting-started.md").read_text()
VENV = "python3 -m venv .venv && . .venv/bin/activate && "
DEMO = VENV + "pip install . && tokenprobe demo"
TESTS = VENV + "pip install -e '.[dev]' && pytest"


def _fenced(text: str) -> list[str]:
    return [body.strip() for body in re.findall(r"^```\w*\n(.*?)^```", text, re.S | re.M)]


def test_the_two_commands_make_their_venv_and_ci_runs_the_same() -> None:
    for page in (README, GETTING_STARTED):
        assert DEMO in _fenced(page) and TESTS in _fenced(page)
    assert TESTS in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_readme_says_to_clone_first_and_gives_the_commands_before_the_contract() -> None:
    commands = README.index("## Two commands")
    assert README.index("git clone ") < README.index(DEMO)
    assert commands < README.index("**Forwarded") and commands < README.index("![")
    assert len(README[:commands].splitlines()) <= 6  # a title and two or three lines


def test_no_page_or_message_sends_a_reader_to_a_package_index_for_an_extra() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    code = sorted((ROOT / "proxy").rglob("*.py"))
    said = [str(p.relative_to(ROOT)) for p in pages + code if "tokenprobe[" in p.read_text()]
    assert said == []


def test_the_benchmarking_page_names_the_extras_before_its_first_command() -> None:
    page = (ROOT / "docs" / "benchmarking.md").read_text()
    first = page.index("```")
    assert "pip install '.[tokenizer,plot]'" in page[:first]
    example = page.index("--plot example.png")
    assert "pip install '.[plot]'" in page[page.rindex("Worked example", 0, example) : example]


def test_every_docs_page_is_listed_in_the_readme_and_on_the_index() -> None:
    pages = sorted(
        str(p.relative_to(ROOT / "docs"))
        for p in (ROOT / "docs").rglob("*.md")
        if p.name != "index.md"
    )
    index = (ROOT / "docs" / "index.md").read_text()
    documentation = README[README.index("## Documentation") :]
    assert [p for p in pages if f"](docs/{p})" not in documentation] == []
    assert [p for p in pages if f"]({p})" not in index] == []


def test_getting_started_shows_the_port_a_plain_demo_uses() -> None:
    assert "tokenprobe proxy         http://127.0.0.1:4000/v1" in GETTING_STARTED


def test_no_page_points_outside_the_repository() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert [str(p.relative_to(ROOT)) for p in pages if "../shared/" in p.read_text()] == []
