"""The build (issue 29): the per-chunk path is compiled by mypyc where setup.py can, the
same source is its fallback, and `tokenprobe serve` says which one runs.

TOKENPROBE_EXPECT_BUILD says which build this run must be testing: "pure" (the default:
the README's test command installs editable, which always runs the source) or "compiled"
(.ci/run's second pass, in a tree built with `setup.py build_ext --inplace`). A run that
meant to test the compiled build and got the source fails here, not silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from proxy.build import PER_CHUNK_MODULES, compiled_modules, describe, module_names
from tests.servers import free_port, spawn, stop, wait_http
from tests.wheels import build_wheel, pure_wheel

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
def test_a_wheel_without_a_compiler_is_the_pure_source(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, why: str
) -> None:
    """`pip install .` where nothing can compile still builds: the same source, no
    extension, a wheel for any platform, and a warning that says why."""
    if why == "no C compiler":
        built = build_wheel(tmp_path, {"CC": "/nonexistent/cc"})
    else:
        built = pure_wheel(tmp_path_factory)  # the one tests/server/test_ui.py reads too
    assert built.returncode == 0, built.output[-6000:]
    assert f"building the pure-Python per-chunk path: {why}" in built.output
    (wheel,) = built.wheels()
    assert wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [name for name in names if name.endswith(".so")]
    assert set(PER_CHUNK_MODULES) <= set(names)
