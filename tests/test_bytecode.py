"""tests/bytecode.py: the installed bytecode is linked into the suite's prefix, and linked
again when the installed folder is not the one seeded (a venv made again at the same path,
a package installed since)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from tests.bytecode import seed

TAG = sys.implementation.cache_tag


def install(site: Path, package: str, code: bytes) -> None:
    """A package's module with its bytecode beside it, as pip leaves it."""
    cache = site / package / "__pycache__"
    cache.mkdir(parents=True)
    (site / package / "m.py").write_text("x = 1\n")
    (cache / f"m.{TAG}.pyc").write_bytes(code)
    (cache / f"m.{TAG}.opt-1.pyc").write_bytes(b"optimised: not seeded")


def kept(prefix: Path, site: Path, package: str) -> Path:
    return prefix / site.relative_to(site.anchor) / package / f"m.{TAG}.pyc"


def test_the_installed_bytecode_is_linked_where_the_prefix_looks(tmp_path: Path) -> None:
    site, prefix = tmp_path / "venv" / "site-packages", tmp_path / "prefix"
    install(site, "a", b"a's bytecode")
    seed(prefix, site)
    found = kept(prefix, site, "a")
    assert found.read_bytes() == b"a's bytecode"
    assert os.path.samefile(found, site / "a" / "__pycache__" / f"m.{TAG}.pyc")
    assert not found.with_name(f"m.{TAG}.opt-1.pyc").exists()


def test_a_venv_made_again_at_the_same_path_is_seeded_again(tmp_path: Path) -> None:
    site, prefix = tmp_path / "venv" / "site-packages", tmp_path / "prefix"
    install(site, "a", b"the old venv's bytecode")
    seed(prefix, site)
    # The new venv is made before the old one goes, so that its folder cannot take the
    # old one's inode: a fresh clone's `python -m venv .venv` in a reused folder.
    again = tmp_path / "again"
    install(again, "a", b"the new venv's bytecode")
    shutil.rmtree(site)
    again.rename(site)
    seed(prefix, site)
    assert kept(prefix, site, "a").read_bytes() == b"the new venv's bytecode"
    assert len(list(kept(prefix, site, "").parent.glob(".seeded-*"))) == 1


def test_a_package_installed_since_is_seeded_and_the_rest_kept(tmp_path: Path) -> None:
    site, prefix = tmp_path / "venv" / "site-packages", tmp_path / "prefix"
    install(site, "a", b"a's bytecode")
    seed(prefix, site)
    before = site.stat().st_mtime_ns
    install(site, "b", b"b's bytecode")
    # The folder's time as pip's install, seconds later, leaves it (a test is quicker than
    # the file system's clock tick).
    os.utime(site, ns=(before + 10**9, before + 10**9))
    seed(prefix, site)
    assert kept(prefix, site, "b").read_bytes() == b"b's bytecode"
    assert kept(prefix, site, "a").read_bytes() == b"a's bytecode"
