"""Importing this makes `import proxy` mean this checkout's proxy/, whichever venv runs us.

A benchmark run as `python benchmarks/x.py` has benchmarks/ on sys.path, not the
repository root; a venv with another checkout installed editable would lend that one's.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
