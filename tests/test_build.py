"""The build (issue 29): the per-chunk path is compiled by mypyc where setup.py can, the
same source is its fallback, and `tokenprobe serve` says which one runs.

TOKENPROBE_EXPECT_BUILD says which build this run must be testing: "pure" (the default:
the README's test command installs editable, which always runs the source) or "compiled"
(.ci/run's second pass, in a tree built with `setup.py build_ext --inplace`). A run that
meant to test the compiled build and got the source fails here, not silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from proxy.build import PER_CHUNK_MODULES, compiled_modules, describe, module_names
from tests.paths import ROOT
from tests.servers import free_port, spawn, stop, wait_http

EXPECTED = os.environ.get("TOKENPROBE_EXPECT_BUILD", "pure")


def test_this_run_tests_the_build_it_meant_to() -> None:
    assert compiled_modules() == (module_names() if EXPECTED == "compiled" else [])


def test_serve_and_version_say_which_build_runs() -> None:
    wanted = "compiled (mypyc" if EXPECTED == "compiled" else "pure Python"
    version = subprocess.run(
        [sys.executable, "-m", "proxy", "--version"], capture_output=True, text=True, check=True
    )
    assert wanted in version.stdout and describe() in version.stdout
    port = free_port()
    proxy = spawn("serve", "--upstream", "http://127.0.0.1:9", "--port", str(port))
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
    finally:
        stop(proxy)
    assert proxy.stderr is not None
    first = proxy.stderr.read().decode().splitlines()[0]
    assert first == f"tokenprobe serve: {describe()}"


@pytest.mark.parametrize("why", ["no C compiler", "TOKENPROBE_PURE=1"])
def test_a_wheel_without_a_compiler_is_the_pure_source(tmp_path: Path, why: str) -> None:
    """`pip install .` where nothing can compile still builds: the same source, no
    extension, a wheel for any platform, and a warning that says why."""
    source = tmp_path / "src"  # a copy: pip builds in the tree it is given
    shutil.copytree(ROOT / "proxy", source / "proxy", ignore=shutil.ignore_patterns("*.so"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    env = {**os.environ}
    if why == "no C compiler":
        env["CC"] = "/nonexistent/cc"
    else:
        env["TOKENPROBE_PURE"] = "1"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
         "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert f"building the pure-Python per-chunk path: {why}" in built.stdout + built.stderr
    (wheel,) = tmp_path.glob("tokenprobe-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [name for name in names if name.endswith(".so")]
    assert set(PER_CHUNK_MODULES) <= set(names)
