"""deploy/systemd: the unit a bare VM runs tokenprobe with, and its environment file.

systemd itself checks the unit where `systemd-analyze` is installed (`verify` loads it as
systemd would, and warns of an unknown key or a value it cannot read); the rest is
tokenprobe's own reading: the command line parses with `tokenprobe serve`'s parser
together with the example file's variables, each variable the file names is one the
proxy reads, and the stop and open-file limits fit what the proxy does."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from proxy.openfiles import TARGET
from proxy.settings import SPECS, Settings, parse
from tests.paths import ROOT

SYSTEMD = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD / "tokenprobe.service"
ENV_FILE = SYSTEMD / "tokenprobe.env"
#: The seconds a stop leaves after the drain: uvicorn's shutdown once the drain time is
#: over (tasks cancelled, the app's shutdown), and a margin.
STOP_MARGIN = 10


def unit() -> dict[str, dict[str, list[str]]]:
    """The unit's sections and their keys, each key with its values in order (systemd
    lets a key repeat); comments dropped."""
    sections: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key, []).append(value)
    return sections


def service(key: str) -> str:
    """The [Service] section's one value of `key`."""
    (value,) = unit()["Service"][key]
    return value


def environment() -> dict[str, str]:
    """The variables the example file sets, as systemd's EnvironmentFile= reads them (a
    `#` comments a whole line only)."""
    found = re.findall(r"^([A-Za-z_]\w*)=(.*)$", ENV_FILE.read_text(), re.M)
    return {name: value for name, value in found}


def named() -> set[str]:
    """Every variable the example file names, set or in a commented-out line."""
    return set(re.findall(r"^#? *([A-Z][A-Z0-9_]*)=", ENV_FILE.read_text(), re.M))


def serve_settings() -> Settings:
    """What `tokenprobe serve` makes of the unit's command line and the example file."""
    program, command, *args = shlex.split(service("ExecStart"))
    venv_bin = Path(program).parent.name
    assert (venv_bin, Path(program).name, command) == ("bin", "tokenprobe", "serve")
    return parse(args, environment())


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package has it)")
    # verify refuses an ExecStart whose program is not there: this tree's tokenprobe
    program = Path(sys.executable).parent / "tokenprobe"
    assert program.is_file(), f"{program}: install the tree (pip install -e .)"
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={program}", UNIT.read_text(), flags=re.M)
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    said = [line for line in (done.stdout + done.stderr).splitlines() if UNIT.name in line]
    assert done.returncode == 0 and said == [], done.stdout + done.stderr


def test_the_command_and_the_example_file_make_the_settings_they_say() -> None:
    settings = serve_settings()
    env = environment()
    assert settings.upstream == env["TOKENPROBE_UPSTREAM"]
    assert (settings.host, settings.port) == (env["TOKENPROBE_HOST"], int(env["TOKENPROBE_PORT"]))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tokenprobe"] == "proxy.cli:main"


def test_every_variable_the_example_file_names_is_one_the_proxy_reads() -> None:
    settings = {spec.env for spec in SPECS}
    otel = set(re.findall(r'"(OTEL_[A-Z_]+)"', (ROOT / "proxy/sinks/otel_env.py").read_text()))
    unknown = named() - settings - otel
    assert unknown == set(), "not a setting (docs/reference/settings.md) nor an OTEL_* variable"
    assert "TOKENPROBE_UPSTREAM" in environment()


def test_the_unit_runs_the_file_and_restarts_on_failure_and_on_sighup() -> None:
    assert service("EnvironmentFile") == "/etc/tokenprobe/tokenprobe.env"
    assert service("Restart") == "on-failure"
    # systemd counts an end by SIGHUP as clean; a single process ends so after draining
    assert service("RestartForceExitStatus") == "SIGHUP"
    assert unit()["Install"]["WantedBy"] == ["multi-user.target"]


def test_a_stop_waits_out_the_drain_before_sigkill() -> None:
    assert service("KillSignal") == "SIGTERM"
    assert "KillMode" not in unit()["Service"]  # every process gets the SIGTERM, as Ctrl-C
    stop = float(service("TimeoutStopSec"))
    assert stop >= serve_settings().drain_timeout + STOP_MARGIN


def test_the_open_file_limit_carries_what_the_proxy_raises_to() -> None:
    limit = int(service("LimitNOFILE"))
    assert limit >= TARGET  # the proxy raises its soft limit to 65535, or the hard one
    tunnels = serve_settings().ws_max_tunnels
    assert limit >= 2 * tunnels  # each tunnel holds two descriptors


def test_the_hardening_leaves_the_proxy_a_private_tmp_for_its_metrics() -> None:
    """With --workers and no PROMETHEUS_MULTIPROC_DIR, the metrics files go to a folder
    made under $TMPDIR (proxy/server/serve.py `_run_workers`): ProtectSystem=strict leaves
    /tmp writable only with PrivateTmp. Setting PROMETHEUS_MULTIPROC_DIR would put even
    one process in multiprocess mode (no exemplars), so the unit does not."""
    hardening = {key: service(key) for key in ("NoNewPrivileges", "ProtectSystem", "PrivateTmp")}
    assert hardening == {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes"}
    assert "PROMETHEUS_MULTIPROC_DIR" not in ENV_FILE.read_text() + UNIT.read_text()
    assert service("User") != "root"
