"""Compiled bytecode for the suite where PYTHONDONTWRITEBYTECODE is set: kept, but outside
the tree (PYTHONPYCACHEPREFIX), and seeded with the bytecode the installed packages came
with.

Without it the workers and the hundreds of Python processes the tests start would each
compile the project's modules (and pytest rewrite every test module) from source again:
5.2 s against 2.2 s a worker to collect, about 90 ms a started proxy. The prefix hides
the bytecode pip compiled beside each installed package, though: with an empty prefix, as
on a fresh machine, every worker and started process compiled the packages it imported
until one had written them, 112 s of CPU more than a run with the prefix filled (445
against 395 s here, 14,462 files). So the installed bytecode is linked into the prefix
before the workers start, once for each state of the installed folders.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from contextlib import suppress
from pathlib import Path

PYCACHE_ENV = "PYTHONPYCACHEPREFIX"


def keep_outside_the_tree() -> None:
    """Set at the conftest's import in the first process, before xdist starts its
    workers: they and every process started from them inherit it. The sources stay as
    clean as the variable asks."""
    if not os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        return
    folder = os.environ.setdefault(
        PYCACHE_ENV, os.path.join(tempfile.gettempdir(), "tokenprobe-pycache")
    )
    sys.pycache_prefix, sys.dont_write_bytecode = folder, False  # this process too (-n 0)
    paths = sysconfig.get_paths()  # the standard library's and the installed packages'
    for installed in {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]}:
        seed(Path(folder), Path(installed))


def seed(prefix: Path, installed: Path) -> None:
    """Link each `__pycache__/NAME.TAG.pyc` under `installed` to where the prefix keeps
    it (`PREFIX/<its source's folder>/NAME.TAG.pyc`), once for each state of the folder:
    Python still checks each against its source's time and size, as it does beside the
    source.

    The stamp names the folder's inode and modification time, so that a venv made again at
    the same path (a fresh clone's CI in a reused folder) or a package installed since is
    seeded again: a stamp by name alone kept the links to the deleted venv's bytecode,
    which the new sources' times no longer matched, and every process compiled its
    imports again (a clean clone's run in a reused folder took 410 s against 386)."""
    if not installed.is_dir() or not installed.is_absolute():
        return
    home = prefix / installed.relative_to(installed.anchor)
    state = installed.stat()
    tag = sys.implementation.cache_tag
    stamp = home / f".seeded-{tag}-{state.st_ino}-{state.st_mtime_ns}"
    if stamp.exists():
        return
    suffix = f".{tag}.pyc"  # not the -O ones
    for cache, _, names in os.walk(installed):
        if os.path.basename(cache) != "__pycache__":
            continue
        target = home / Path(cache).parent.relative_to(installed)
        made = False
        for name in names:
            if not name.endswith(suffix):
                continue
            if not made:
                target.mkdir(parents=True, exist_ok=True)
                made = True
            _place(os.path.join(cache, name), target / name)
    home.mkdir(parents=True, exist_ok=True)
    for old in home.glob(f".seeded-{tag}*"):
        old.unlink(missing_ok=True)
    stamp.touch()


def _place(source: str, kept: Path) -> None:
    """`kept` the same file as `source`: linked, or copied where links cannot be made; one
    left from an earlier state of the folder is replaced, atomically for a process that
    reads it meanwhile."""
    with suppress(FileNotFoundError):
        if os.path.samefile(source, kept):
            return
    fresh = kept.with_name(f"{kept.name}.{os.getpid()}.seeding")
    fresh.unlink(missing_ok=True)
    try:
        os.link(source, fresh)
    except OSError:  # another file system, or no links there
        shutil.copyfile(source, fresh)
    os.replace(fresh, kept)
