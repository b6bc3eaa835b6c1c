"""An upstream outage after a pair's first requests reaches the shipped rules on a real
Prometheus: `tokenprobe serve --workers 2` in front of the simulator, the simulator stopped.

A review saw 30 502s first scraped at 30: rate() and increase() read none of them, so
TokenprobeUpstreamUnreachable never fired and the error-ratio rule recorded nothing. The
pair's outcome series exist at 0 from its first request now (proxy/sinks/metrics.py
first_counted), so the scrape before the outage holds that 0.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.test_grafana_live import RULE_FILES, _cli, _processes, _wait_ready
from tests.prom import Prometheus, require_binary
from tests.servers import free_port

OK_REQUESTS = 10
OUTAGE_REQUESTS = 30
UNREACHABLE = 'tokenprobe_requests_total{error_type="upstream_unreachable"}'


def _alert_expr(name: str) -> str:
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") == name:
                    return str(rule["expr"])
    raise KeyError(name)


def _chat(client: httpx.Client, url: str) -> int:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return client.post(url + "/v1/chat/completions", json=body).status_code


def _scraped_since(prom: Prometheus, moment: float) -> None:
    prom.wait_for(f'timestamp(up{{job="tokenprobe"}} == 1) > {moment:.3f}', timeout=30)


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """10 answered requests, a scrape, the simulator stopped, 30 requests answered 502,
    and a scrape after them."""
    require_binary("prometheus")
    tmp = tmp_path_factory.mktemp("outage")
    sim_port, proxy_port = free_port(), free_port()
    sim, proxy = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{proxy_port}"
    sim_args = _cli("sim", "--host", "127.0.0.1", "--port", str(sim_port), "--ttft", "0.01")
    (tmp / "mp").mkdir()
    # the review's setting; `env` execs the proxy, so stopping it stops the proxy
    serve_args = [
        "env", f"PROMETHEUS_MULTIPROC_DIR={tmp / 'mp'}",
        *_cli("serve", "--upstream", sim, "--host", "127.0.0.1", "--port", str(proxy_port),
              "--workers", "2", "--access-log", "off"),
    ]  # fmt: skip
    simulator = _start(sim_args, sim, tmp / "sim.log")
    try:
        with (
            _processes((serve_args, proxy, tmp / "proxy.log", "/readyz")),
            Prometheus(
                tmp, {"tokenprobe": [f"127.0.0.1:{proxy_port}"]}, rule_files=RULE_FILES
            ) as prom,
        ):
            prom.wait_for('up{job="tokenprobe"} == 1')
            with httpx.Client(timeout=30) as client:
                codes = [_chat(client, proxy) for _ in range(OK_REQUESTS)]
                assert codes == [200] * OK_REQUESTS
                _scraped_since(prom, time.time())
                simulator.terminate()
                simulator.wait(timeout=30)
                codes = [_chat(client, proxy) for _ in range(OUTAGE_REQUESTS)]
                assert codes == [502] * OUTAGE_REQUESTS
            _scraped_since(prom, time.time())
            yield prom
    finally:
        if simulator.poll() is None:
            simulator.kill()
            simulator.wait()


def _start(args: list[str], url: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    _wait_ready(process, args, url, log, "/v1/models")
    return process


def test_prometheus_holds_the_unreachable_series_at_0_before_the_outage(
    outage: Prometheus,
) -> None:
    # the records reach the sinks after the answers: wait for a scrape that holds all 30
    outage.wait_for(f"max_over_time({UNREACHABLE}[5m]) == {OUTAGE_REQUESTS}")
    (first,) = outage.query(f"min_over_time({UNREACHABLE}[5m])")
    assert float(first["value"][1]) == 0  # the old code's first sample was already 30


def test_the_upstream_unreachable_alert_sees_the_outage(outage: Prometheus) -> None:
    expr = _alert_expr("TokenprobeUpstreamUnreachable")
    (fired,) = outage.wait_for(expr, timeout=20)
    assert fired["metric"]["error_type"] == "upstream_unreachable"


def test_the_error_ratio_rule_records_the_outage(outage: Prometheus) -> None:
    outage.wait_for(
        'model_error_type:tokenprobe_requests:ratio_rate5m{error_type="upstream_unreachable"}'
        " > 0.5",
        timeout=20,
    )
    # the 30 502s counted whole: increase() over the outage reads all of them
    (counted,) = outage.query(f"sum(increase({UNREACHABLE}[5m]))")
    assert float(counted["value"][1]) >= OUTAGE_REQUESTS - 0.5
