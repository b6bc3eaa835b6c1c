"""A real llama.cpp `llama-server` on loopback, with a real `tokenprobe serve` in front of
it, for the tests marked `llamacpp`.

`.ci/llama` builds the server from the llama-cpp-python sdist's vendor/llama.cpp and
converts the tiny random-weight Llama to GGUF (tests/llama_model.py); both are cached in
TOKENPROBE_LLAMA_DIR (default /opt/llama-server). The session starts one server on
127.0.0.1 and an ephemeral port: one slot (`--parallel 1`, so a repeated prompt meets its
own cache), one thread, a 512-token context. Without the server the tests skip, saying
why; under CI=true they fail instead, since CI runs `.ci/llama` first.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import access_records, free_port, serve_in_front, stop, stop_group

LLAMA_DIR = Path(os.environ.get("TOKENPROBE_LLAMA_DIR", "/opt/llama-server"))
SERVER = LLAMA_DIR / "bin" / "llama-server"
MODEL = LLAMA_DIR / "tiny.gguf"
SERVED = "tiny"
#: Loading a 9 MB model takes about a second; a loaded 2-core machine may take far longer.
START_TIMEOUT = 120.0
FLAGS = (
    "--ctx-size", "512", "--parallel", "1", "--threads", "1", "--threads-batch", "1",
    "--alias", SERVED, "--no-webui",
)  # fmt: skip


def llama_server() -> Path:
    """The built server; skip without it, fail under CI=true (CI runs .ci/llama)."""
    why = None
    if not SERVER.exists():
        why = f"no llama-server at {SERVER}"
    elif not MODEL.exists():
        why = f"no tiny GGUF model at {MODEL}"
    if why is not None:
        why += " (run .ci/llama)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI must run it before the tests")
        pytest.skip(why)
    return SERVER


@dataclass
class Llama:
    """The llama-server and the `tokenprobe serve` in front of it."""

    process: subprocess.Popen[bytes]
    log: Path
    url: str  # llama-server direct
    proxy_url: str = ""
    proxy: subprocess.Popen[bytes] | None = None
    access_log: Path | None = None  # the proxy's JSON access log, one line per request

    def log_lines(self, since: int = 0) -> list[dict[str, Any]]:
        """The access log's records from line `since` on."""
        assert self.access_log is not None
        return access_records(self.access_log, since)


def _start(server: Path, logs: Path) -> Llama:
    """llama-server on a free port; another port if it could not bind the one picked."""
    log = logs / "llama-server.log"
    for _ in range(5):
        port = free_port()
        argv = [str(server), "--model", str(MODEL), "--host", "127.0.0.1", "--port", str(port)]
        with log.open("wb") as out:
            process = subprocess.Popen(
                [*argv, *FLAGS], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        llama = Llama(process, log, f"http://127.0.0.1:{port}")
        if _wait_healthy(llama, time.monotonic() + START_TIMEOUT):
            return llama
        _stop(llama)
    raise AssertionError(f"llama-server did not start: see {log}")


def _wait_healthy(llama: Llama, deadline: float) -> bool:
    """True once it answers /health with 200 as itself; False if it exited (port taken)."""
    while time.monotonic() < deadline:
        if llama.process.poll() is not None:
            tail = llama.log.read_text(errors="replace")[-3000:]
            if "bind" in tail or "address" in tail.lower():
                return False
            raise AssertionError(f"llama-server exited ({llama.process.returncode}):\n{tail}")
        try:
            answer = httpx.get(llama.url + "/health", timeout=2)
            if answer.status_code == 200 and answer.json().get("status") == "ok":
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"llama-server not healthy in {START_TIMEOUT:.0f}s: see {llama.log}")


def _stop(llama: Llama) -> None:
    if llama.proxy is not None:
        stop(llama.proxy)
    stop_group(llama.process)


def _start_proxy(llama: Llama, logs: Path) -> None:
    """A `tokenprobe serve` in front of llama-server (tests.servers.serve_in_front)."""
    llama.access_log = logs / "proxy.jsonl"
    llama.proxy, llama.proxy_url = serve_in_front(llama.url, llama.access_log, "llama-server")


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llama]:
    server = llama_server()
    logs = tmp_path_factory.mktemp("llama")
    started = _start(server, logs)
    try:
        _start_proxy(started, logs)
        yield started
    finally:
        _stop(started)
