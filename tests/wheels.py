"""tokenprobe's wheel as `pip install .` builds it where nothing is compiled.

tests/test_build.py checks that such a wheel is the pure source, and
tests/server/test_ui.py that a built wheel carries the live view's assets. Each built
its own (2 s apiece on a quiet machine, 7.5 s beside the other workers); the
TOKENPROBE_PURE=1 build serves both, made by the first test to ask and kept in the run's
temporary folder for the other (`pure_wheel`), which waits on its lock meanwhile.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from tests.paths import ROOT
from tests.run_folder import run_folder


@dataclass(frozen=True)
class Built:
    returncode: int
    output: str  # pip's stdout and stderr, -v
    folder: str  # where the wheel is, if one was built

    def wheels(self) -> list[Path]:
        return sorted(Path(self.folder).glob("tokenprobe-*.whl"))


def build_wheel(folder: Path, env: dict[str, str]) -> Built:
    """`pip wheel` of a copy of the sources (pip builds in the tree it is given), with
    `env`'s variables over this process's."""
    source = folder / "src"
    shutil.copytree(ROOT / "proxy", source / "proxy", ignore=shutil.ignore_patterns("*.so"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
         "-w", str(folder), str(source)],
        capture_output=True, text=True, env={**os.environ, **env}, cwd=folder,
    )  # fmt: skip
    return Built(built.returncode, built.stdout + built.stderr, str(folder))


def pure_wheel(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The TOKENPROBE_PURE=1 build, once per test run."""
    folder = run_folder(tmp_path_factory) / "wheel-pure"
    saved = folder.with_suffix(".json")
    with open(folder.with_suffix(".lock"), "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released with the file
        if saved.exists():
            return Built(**json.loads(saved.read_text()))
        folder.mkdir()
        built = build_wheel(folder, {"TOKENPROBE_PURE": "1"})
        saved.write_text(json.dumps(asdict(built)))  # whole before the lock goes
        return built
