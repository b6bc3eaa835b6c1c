"""Every link into a heading of the docs or the README resolves on GitHub, where most
readers meet these pages, as it does on the mkdocs site: GitHub ignores mkdocs' `{#id}`
attributes and makes each anchor from the heading's words, so a page must not rely on
them."""

from __future__ import annotations

import re
from pathlib import Path

from tests.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]*?)#([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercased, punctuation dropped except `-` and `_`
    (backticks and the rest of inline Markdown go too), each space a `-`."""
    words = re.sub(r"\]\([^)]*\)", "", heading)  # a link keeps its text only
    return re.sub(r"[^\w\- ]", "", words.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        anchor = github_anchor(heading)
        n = 0
        while (anchor if n == 0 else f"{anchor}-{n}") in found:
            n += 1  # GitHub numbers a repeated heading's anchor
        found.add(anchor if n == 0 else f"{anchor}-{n}")
    return found


def test_no_page_gives_a_heading_an_id_github_does_not_read() -> None:
    with_ids = [
        f"{page.relative_to(ROOT)}: {line}"
        for page in PAGES
        for line in FENCE.sub("", page.read_text()).splitlines()
        if line.startswith("#") and re.search(r"\{#[^}]+\}\s*$", line)
    ]
    assert with_ids == []


def test_every_link_to_a_heading_finds_it_by_githubs_anchor() -> None:
    broken = []
    for page in PAGES:
        for target, anchor in LINK.findall(FENCE.sub("", page.read_text())):
            if "://" in target or not (target == "" or target.endswith(".md")):
                continue
            linked = (page.parent / target).resolve() if target else page
            if not linked.is_file() or anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    assert broken == []
