"""A folder of this test run's own, shared by its workers: for what one test makes once
and others read (tests/demo_run.py, tests/wheels.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Above the workers' temporary folders in a parallel run (xdist gives each worker one
    below the run's), the session's own in a serial one (its parent is shared by every run
    of the user, and would hand a later run what this one made)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
