"""A real Prometheus server on loopback for tests: start, wait until ready, query, stop.

    with Prometheus(tmp_path, {"tokenprobe": ["127.0.0.1:4000"]}, rule_files=[...]) as prom:
        prom.wait_for_targets_up()
        prom.query('sum(rate(tokenprobe_requests_total[1m]))')

It scrapes every second, evaluates rules every second, keeps exemplars
(--enable-feature=exemplar-storage) and listens on an ephemeral 127.0.0.1 port. The
binary is $TOKENPROBE_TEST_PROMETHEUS or `prometheus` on PATH (Debian's package in CI);
`require_binary` skips a test without it, except under CI=true, where it fails.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.servers import free_port

Sample = dict[str, Any]  # one element of a query's "result": {"metric": {...}, "value": [t, "v"]}


def binary(name: str = "prometheus") -> str | None:
    override = os.environ.get(f"TOKENPROBE_TEST_{name.upper()}")
    return override or shutil.which(name)


def require_binary(name: str = "prometheus") -> str:
    """The path of `name`; skip the test when it is missing, fail when CI=true."""
    path = binary(name)
    if path is None:
        why = f"`{name}` not found on PATH (Debian: apt-get install prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI must install it")
        pytest.skip(why)
    return path


class PromQLError(AssertionError):
    """Prometheus refused a query (bad syntax, bad types); the message is Prometheus's own."""


class Prometheus:
    def __init__(
        self,
        workdir: Path,
        scrape_targets: Mapping[str, Sequence[str]],
        *,
        rule_files: Iterable[Path] = (),
        scrape_interval: str = "1s",
        binary_path: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.binary = binary_path or require_binary("prometheus")
        self.config_path = workdir / "prometheus.yml"
        self.log_path = workdir / "prometheus.log"
        config = {
            "global": {
                "scrape_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
                "evaluation_interval": scrape_interval,
            },
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": list(targets)}]}
                for job, targets in scrape_targets.items()
            ],
        }
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self._process: subprocess.Popen[bytes] | None = None
        self._client = httpx.Client(base_url=self.url, timeout=10)

    # --- lifecycle ---

    def start(self, timeout: float = 30) -> Prometheus:
        log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--enable-feature=exemplar-storage",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited at start:\n{self.log_tail()}")
            try:
                if self._client.get("/-/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        self._client.close()
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=5)

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # --- HTTP API ---

    def _api(self, path: str, params: Mapping[str, str]) -> Any:
        response = self._client.post(f"/api/v1/{path}", data=dict(params))
        body = response.json()
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        """Instant query; the result list (vector or scalar wrapped into one sample)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", params)
        if data["resultType"] == "vector":
            return list(data["result"])
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        raise PromQLError(f"{expr!r} returned a {data['resultType']}, not a vector")

    def query_exemplars(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        return list(
            self._api("query_exemplars", {"query": expr, "start": str(start), "end": str(end)})
        )

    def targets(self) -> list[dict[str, Any]]:
        return list(self._api_get("targets")["activeTargets"])

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(self._api_get("rules")["groups"])

    def _api_get(self, path: str) -> Any:
        body = self._client.get(f"/api/v1/{path}").json()
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    # --- waiting ---

    def wait_for(
        self,
        expr: str,
        predicate: Callable[[list[Sample]], bool] = lambda result: bool(result),
        timeout: float = 20,
    ) -> list[Sample]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr!r} still {result!r} after {timeout}s")
            time.sleep(0.25)

    def wait_for_targets_up(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            targets = self.targets()
            if targets and all(t["health"] == "up" for t in targets):
                return
            if time.monotonic() > deadline:
                states = [(t["scrapeUrl"], t["health"], t.get("lastError")) for t in targets]
                raise TimeoutError(f"targets not up after {timeout}s: {states}")
            time.sleep(0.25)


def finite_values(result: list[Sample]) -> list[float]:
    """The sample values of a query result that are real numbers (not NaN or +-Inf)."""
    values = [float(sample["value"][1]) for sample in result]
    return [v for v in values if math.isfinite(v)]
