"""The arms of a benchmark: the simulator, the load generator and each arm in front.

`Stack` starts the backend and the load generator, then each arm as it is asked for
(direct, the byte relay, nginx, tokenprobe from this or another tree, LiteLLM), all
pinned and torn down together through harness/procs.py.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.procs import (
    BENCH,
    HARNESS,
    PARTS_ENV,
    PEERS,
    PY,
    ROOT,
    cores,
    descendants,
    spawn,
    stop,
    wait_ready,
)

from proxy.bench.ports import free_port

NGINX = "/usr/sbin/nginx"
NGINX_HINT = "nginx not found: install it with `apt-get install nginx-light` to add the nginx arm"
LITELLM_VENV = BENCH / ".litellm-venv"


# -- arms -----------------------------------------------------------------------------------------


@dataclass
class Arm:
    """Something the load goes through. `direct` has no process: the client hits the sim."""

    name: str
    port: int
    path: str = "/v1/chat/completions"
    headers: dict[str, str] = field(default_factory=dict)  # sent on every request
    proc: subprocess.Popen[Any] | None = None
    start: Callable[[], subprocess.Popen[Any]] | None = None
    start_limit: float = 30.0
    notes: list[str] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)

    def pids(self) -> list[int]:
        return [] if self.proc is None else descendants(self.proc.pid)

    def launch(self) -> None:
        """Start it and time start-to-first-request."""
        if self.start is None:
            return
        t0 = time.monotonic()
        self.proc = self.start()
        try:
            wait_ready(self.proc, self.port, self.path, self.start_limit, self.headers)
        except RuntimeError:
            stop(self.proc)
            raise
        self.start_s.append(time.monotonic() - t0)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


class Stack:
    """The simulator, the load generator and the arms, created and torn down together."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.proxy_cpus, self.sim_cpus, self.gen_cpus = cores()
        self.sim_port, self.otlp_port = free_port(), free_port()
        self.sim: subprocess.Popen[Any] | None = None
        self.gen: subprocess.Popen[Any] | None = None
        self.otlp_sink: subprocess.Popen[Any] | None = None  # beside the emitter backend
        self.ws: subprocess.Popen[Any] | None = None  # the WebSocket echo backend
        self.ws_port = 0
        self.arms: list[Arm] = []

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    def start_backend(self, shape: str = "apart", backend: str = "sim") -> None:
        """The backend and the load generator: two processes (`apart`), or one process
        whose event loop runs both (`together`). The backend is tokenprobe's simulator
        (`sim`), or the lean emitter.py (`emitter`), which writes each step's chunks back
        to back, as a tight burst, where the simulator spaces them by its own cost."""
        sim_cmd = ["--port", str(self.sim_port), "--otlp-port", str(self.otlp_port)]
        gen_cmd = [PY, str(HARNESS / "loadgen.py")]
        if backend == "emitter":
            self.sim = spawn(
                [PY, str(PEERS / "emitter.py"), "--port", str(self.sim_port)],
                self.sim_cpus,
                log=self.work / "emitter.log",
            )
            wait_ready(self.sim, self.sim_port, "/v1/chat/completions", 30)
            self.otlp_sink = spawn(
                [PY, str(PEERS / "sim_server.py"), "--port", str(free_port()), *sim_cmd[2:]],
                self.sim_cpus,
                log=self.work / "otlp.log",
            )
        elif shape == "together":
            gen_cmd += ["--sim-port", str(self.sim_port), "--otlp-port", str(self.otlp_port)]
        else:
            self.sim = spawn(
                [PY, str(PEERS / "sim_server.py"), *sim_cmd],
                self.sim_cpus,
                log=self.work / "sim.log",
            )
            wait_ready(self.sim, self.sim_port, "/v1/chat/completions", 30)
        self.gen = spawn(
            gen_cmd,
            self.gen_cpus,
            log=self.work / "loadgen.log",
            env=PARTS_ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        if self.read_gen(30).get("event") != "ready":
            raise RuntimeError("load generator did not start")
        if shape == "together" and backend == "sim":
            wait_ready(self.gen, self.sim_port, "/v1/chat/completions", 30)

    def generator_pids(self) -> list[int]:
        return [p.pid for p in (self.sim, self.gen) if p is not None]

    def peer_pids(self) -> list[int]:
        """The benchmark's own processes besides the arm and the generator: the OTLP sink
        beside the emitter (in the other shapes the simulator's process is the sink). Their
        CPU is no other load on the machine: a traced arm's exports keep the sink busy."""
        return [p.pid for p in (self.otlp_sink,) if p is not None]

    def tell_gen(self, cmd: dict[str, Any]) -> None:
        assert self.gen is not None and self.gen.stdin is not None
        self.gen.stdin.write((json.dumps(cmd) + "\n").encode())
        self.gen.stdin.flush()

    def read_gen(self, timeout: float) -> dict[str, Any]:
        assert self.gen is not None and self.gen.stdout is not None
        ready, _, _ = select.select([self.gen.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"load generator silent for {timeout:.0f} s")
        line = self.gen.stdout.readline()
        if not line:
            raise RuntimeError(f"load generator exited ({self.work / 'loadgen.log'})")
        return json.loads(line)  # type: ignore[no-any-return]

    def otlp_exports(self) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.otlp_port, timeout=2)
        try:
            conn.request("GET", "/count")
            return int(conn.getresponse().read() or 0)
        except (OSError, ValueError):
            return -1
        finally:
            conn.close()

    def close(self) -> None:
        for arm in self.arms:
            arm.stop()
        if self.gen is not None and self.gen.poll() is None:
            try:
                self.tell_gen({"op": "quit"})
                self.gen.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for proc in (self.gen, self.sim, self.otlp_sink, self.ws):
            if proc is not None:
                stop(proc)

    # -- the arms ---------------------------------------------------------------------------------

    def direct(self) -> Arm:
        return Arm("direct", self.sim_port)

    def tokenprobe(
        self,
        name: str,
        transport: str,
        full: bool,
        tree: Path = ROOT,
        log_level: str | None = None,
        traced: bool | None = None,
        access_log: bool | None = None,
        relay: str | None = None,
        upstream: str | None = None,
    ) -> Arm:
        """tokenprobe from this checkout, or from another source tree (A/B of a change).

        `full`: JSON access log and tracing (each overridable: `access_log`, `traced`);
        `relay`: the data path (`--relay asgi`), where the tree has that setting."""
        port = free_port()
        logged = full if access_log is None else access_log
        cmd = [
            PY,
            "-m",
            "proxy",
            "serve",
            "--upstream",
            upstream or self.sim_url,
            "--port",
            str(port),
            "--upstream-transport",
            transport,
            "--access-log",
            "json" if logged else "off",
        ]
        if relay is not None:
            cmd += ["--relay", relay]
        if log_level is not None:
            cmd += ["--log-level", log_level]
        env: dict[str, str] = {}
        arm = Arm(name, port)
        arm.notes.append(
            f"transport {transport}, access log {'json to /dev/null' if logged else 'off'}"
            + (f", --relay {relay}" if relay else "")
        )
        if full if traced is None else traced:
            if any((tree / "proxy" / p).exists() for p in ("sinks/tracing.py", "tracing.py")):
                env = {
                    "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.otlp_port}",
                    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                    "OTEL_SERVICE_NAME": "tokenprobe-bench",
                }
                arm.notes.append("tracing: every request sampled, OTLP/HTTP to a local sink")
            else:
                arm.notes.append("tracing: proxy/sinks/tracing.py absent, so no tracing")
        log = self.work / f"{name}.log"
        arm.start = lambda: spawn(cmd, self.proxy_cpus, log=log, env=env, tree=tree)
        if tree != ROOT:
            arm.notes.append(f"code from {tree}")
        return arm

    def ws_backend(self) -> None:
        """The WebSocket echo server (peers/ws_echo.py), on the simulator's cores."""
        if self.ws is None:
            self.ws_port = free_port()
            cmd = [PY, str(PEERS / "ws_echo.py"), "serve", "--port", str(self.ws_port)]
            self.ws = spawn(cmd, self.sim_cpus, log=self.work / "ws_echo.log")

    def byte_relay(self) -> Arm:
        port = free_port()
        cmd = [
            PY,
            str(PEERS / "byte_relay.py"),
            "--port",
            str(port),
            "--upstream-port",
            str(self.sim_port),
        ]
        arm = Arm("relay", port)
        arm.start = lambda: spawn(cmd, self.proxy_cpus, log=self.work / "relay.log")
        return arm

    def nginx(self) -> Arm | None:
        if not os.path.exists(NGINX):
            return None
        port = free_port()
        prefix = self.work / "nginx"
        prefix.mkdir(exist_ok=True)
        conf = prefix / "nginx.conf"
        user = "user root;" if os.geteuid() == 0 else ""
        conf.write_text(
            NGINX_CONF.format(
                user=user, prefix=prefix, port=port, sim=self.sim_port, ws=self.ws_port or 9
            )
        )
        cmd = [NGINX, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
        arm = Arm("nginx", port)
        arm.notes.append("1 worker, proxy_buffering off, HTTP/1.1 keep-alive upstream")
        arm.start = lambda: spawn(cmd, self.proxy_cpus, log=self.work / "nginx.log")
        return arm

    def litellm(self) -> Arm:
        python = ensure_litellm()
        port = free_port()
        config = self.work / "litellm.yaml"
        key = "sk-bench-" + secrets.token_hex(16)
        config.write_text(LITELLM_CONF.format(sim=self.sim_url, key=key))
        cmd = [
            str(python.parent / "litellm"),
            "--config",
            str(config),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--num_workers",
            "1",
        ]
        arm = Arm(
            "litellm",
            port,
            path="/sim/v1/chat/completions",
            start_limit=120,
            headers={"authorization": f"Bearer {key}"},
        )
        arm.notes.append("pass-through endpoint /sim -> simulator, prometheus callback on")
        # Everything stays on 127.0.0.1: no fetch of the remote model price map, no telemetry.
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}
        arm.start = lambda: spawn(cmd, self.proxy_cpus, log=self.work / "litellm.log", env=env)
        return arm


NGINX_CONF = """\
{user}
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
worker_rlimit_nofile 65536;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream sim {{ server 127.0.0.1:{sim}; keepalive 1024; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location /ws {{
            proxy_pass http://127.0.0.1:{ws};
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection "upgrade";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
        location / {{
            proxy_pass http://sim;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""

LITELLM_CONF = """\
model_list: []
litellm_settings:
  callbacks: ["prometheus"]
  telemetry: false
general_settings:
  master_key: "{key}"
  pass_through_endpoints:
    - path: "/sim"
      target: "{sim}"
      include_subpath: true
      forward_headers: true
"""


def ensure_litellm() -> Path:
    """LiteLLM's proxy in its own venv under benchmarks/.litellm-venv (created on first use)."""
    python = LITELLM_VENV / "bin" / "python"
    if not (LITELLM_VENV / "bin" / "litellm").exists():
        print(f"installing LiteLLM into {LITELLM_VENV} (once) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "litellm[proxy]", "prometheus-client"],
            check=True,
        )
    return python


def has_relay_setting(tree: Path) -> bool:
    """Whether this tree's `tokenprobe serve` takes `--relay` (the wire's ASGI fallback)."""
    run = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--help"],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    return "--relay" in run.stdout
