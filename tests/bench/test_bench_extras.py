"""A bench flag whose extra is not installed stops the run before it starts, naming the
extra as a reader installs it from tokenprobe's clone, in the words `tokenprobe serve`
uses for the same flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

#: `tokenprobe` with `hidden` modules not importable: as if `pip install .` had installed
#: no extras.
WITHOUT = """
import sys

hidden = sys.argv.pop(1).split(",")

class Hide:
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in hidden):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, Hide())
from proxy.cli import main
sys.exit(main(sys.argv[1:]))
"""

BENCH = ["bench", "--url", "http://127.0.0.1:9/v1", "--model", "m", "--requests", "1"]


def _without(module: str, *argv: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT, module, *argv], capture_output=True, text=True, timeout=60
    )
    return done.returncode, done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("module", "flag", "extra"),
    [("transformers", "--tokenizer", "tokenizer"), ("matplotlib", "--plot", "plot")],
)
def test_bench_names_the_extra_its_flag_needs(
    module: str, flag: str, extra: str, tmp_path: Path
) -> None:
    value = str(tmp_path / "chart.png") if flag == "--plot" else str(tmp_path)
    status, message = _without(module, *BENCH, flag, value)
    assert status == 2
    assert f"{flag} {value}: " in message and f"needs {module}, which is not installed" in message
    assert message.endswith(f"install the extra: pip install '.[{extra}]' in tokenprobe's clone")


def test_bench_and_serve_say_the_same_of_a_tokenizer_without_transformers(
    tmp_path: Path,
) -> None:
    _, bench = _without("transformers", *BENCH, "--tokenizer", str(tmp_path))
    _, serve = _without(
        "transformers", "serve", "--upstream", "http://127.0.0.1:9", "--tokenizer", str(tmp_path)
    )
    said = f"--tokenizer {tmp_path}: "
    assert bench.split(said, 1)[1] == serve.split(said, 1)[1]


def test_bench_compare_names_the_extra_its_plot_needs(tmp_path: Path) -> None:
    """`bench compare --plot` without matplotlib: the same refusal, before any run is read
    (it was an ImportError's traceback once the table was printed)."""
    chart = str(tmp_path / "overlay.png")
    runs = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    status, message = _without("matplotlib", "bench", "compare", *runs, "--plot", chart)
    assert status == 2
    assert message.endswith(
        f"--plot {chart}: the chart needs matplotlib, which is not installed; "
        "install the extra: pip install '.[plot]' in tokenprobe's clone"
    )
