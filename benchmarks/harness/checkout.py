"""Importing this makes `import proxy` mean this checkout's proxy/, whichever venv runs us.

A benchmark run as `python benchmarks/x.py` has benchmarks/ on sys.path, not the
repository root; a venv with another checkout installed editable would lend that one's.
Entry points import it first (`from harness import checkout`), before anything of proxy/.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # benchmarks/harness/checkout.py
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def tree_at(ref: str, into: Path) -> Path:
    """This repository's `proxy/` (and pyproject.toml) at git `ref`, unpacked under `into`:
    a tree `relay.py --ref` runs as arm tokenprobe@REF beside this checkout."""
    import subprocess

    tree = into / f"tree-{ref.replace('/', '_')}"
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "proxy", "pyproject.toml"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def compiled_tree(into: Path) -> Path:
    """A copy of this checkout's `proxy/` with its per-chunk path compiled in place by
    mypyc (setup.py, proxy/build.py): `relay.py --compiled` runs its tokenprobe arms from
    it. Fails, rather than benchmark the source under the compiled build's name, when
    setup.py falls back to the pure-Python source (no compiler, no mypyc)."""
    import shutil
    import subprocess

    tree = into / "tree-compiled"
    shutil.copytree(
        ROOT / "proxy", tree / "proxy", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, check=True
    )
    said = subprocess.run(
        [sys.executable, "-m", "proxy", "--version"],
        cwd=tree, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    if "compiled (mypyc" not in said:
        raise SystemExit(f"the compiled tree runs the source: {said.strip()}")
    return tree
