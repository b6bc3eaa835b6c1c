"""Where the tests find the repository and their fixtures, wherever a test file sits."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
STREAMS = FIXTURES / "streams"  # real backend streams, byte for byte
ERRORS = FIXTURES / "errors"  # real upstream error bodies, with index.toml naming sources
