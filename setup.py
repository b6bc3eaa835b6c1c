"""tokenprobe's build: pyproject.toml holds the metadata; this adds the compiled per-chunk
path (issue 29) where it can be built, and leaves it out where it cannot.

mypyc compiles the modules in proxy/build.py's PER_CHUNK_MODULES to C extensions, from the
same source that stays in the wheel as their fallback. It is skipped, and the install is
the pure-Python source, when:
  - the install is editable (`pip install -e .`): edits must take effect, and a compiled
    module next to its source would shadow them;
  - TOKENPROBE_PURE=1 is set;
  - mypyc or a C compiler is missing, or compiling fails (a warning says why).
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
EDITABLE = {"editable_wheel", "develop"}


def _warn(why: str) -> None:
    print(f"tokenprobe: building the pure-Python per-chunk path: {why}", file=sys.stderr)


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(os.environ.get("CC", cc).split()[0])


#: The commands that build extensions. The others (egg_info, dist_info: pip asking for
#: requirements and metadata) need none, and an editable install must get none.
BUILDS = {"bdist_wheel", "build", "build_ext", "install"}


def _ext_modules() -> list[Any]:
    if EDITABLE & set(sys.argv):
        return []  # the source runs, as edited
    if not BUILDS & set(sys.argv):
        return []
    if os.environ.get("TOKENPROBE_PURE") == "1":
        _warn("TOKENPROBE_PURE=1")
        return []
    if _compiler() is None:
        _warn("no C compiler")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypyc is not installed")
        return []
    modules = runpy.run_path(str(HERE / "proxy" / "build.py"))["PER_CHUNK_MODULES"]
    # An isolated build has none of the dependencies installed: their types are Any there,
    # which pyproject.toml's strict mypy settings refuse (subclassing Any, unused ignores).
    # mypyc compiles under mypy's defaults instead, and reports nothing of the modules it
    # only reads (follow-imports=silent); `mypy` in CI keeps the strict checks of them all.
    options = ["--config-file", os.devnull, "--ignore-missing-imports", "--follow-imports=silent"]
    try:
        return list(mypycify([*options, *modules], group_name="tokenprobe_perchunk"))
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error it cannot compile
        _warn(f"mypyc refused the modules: {exc}")
        return []


class _OptionalBuildExt(build_ext):
    """A compile that fails leaves the pure-Python source, never a broken install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # CompileError, LinkError, a missing Python.h...
            _warn(f"compiling failed: {exc}")
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            self.extensions = []


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": _OptionalBuildExt})
