"""The optional extras a flag needs (pyproject.toml's `tokenizer` and `plot`), and the one
way every command's message names them.

tokenprobe is installed from its clone (`pip install .`), so the command a message gives
is the clone's, `pip install '.[EXTRA]'`; the form with the project's name asks a package
index, where the docs do not install it from.
"""

from __future__ import annotations

import importlib.util


def install_hint(extra: str) -> str:
    """The command that installs `extra`, as a message gives it."""
    return f"pip install '.[{extra}]' in tokenprobe's clone"


def missing(module: str) -> bool:
    """Whether `module` cannot be imported here. Looked up, not imported: transformers and
    matplotlib take seconds to import, and the command may never need them."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package that fails, or a bad __spec__
        return True


def needs(what: str, module: str, extra: str) -> str:
    """The message for a flag whose `module` is not installed: what needs it, and the
    command that installs its extra."""
    return (
        f"{what} needs {module}, which is not installed; install the extra: {install_hint(extra)}"
    )
