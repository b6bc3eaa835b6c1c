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
