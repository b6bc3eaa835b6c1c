"""`tokenprobe serve --ssl-certfile --ssl-keyfile`: HTTPS and WSS, as vLLM serves them
with the same flags, so clients of a vLLM that speaks TLS change only the host and port.

The certificate (tests/fixtures/tls/test-only.crt, for 127.0.0.1 and localhost, valid
until 2126) and its key were made for these tests with `openssl req -x509 -newkey rsa:2048
-nodes -days 36500 -subj "/CN=tokenprobe test" -addext
"subjectAltName=IP:127.0.0.1,DNS:localhost"`; they protect nothing else."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
from openai import OpenAI
from websockets.asyncio.client import connect

from tests.conftest import MODEL, Running
from tests.paths import ROOT
from tests.server.conftest import no_proxy, paths
from tests.servers import free_port, spawn, stop, wait_http
from tests.ws_upstream import EchoUpstream

TLS = ROOT / "tests" / "fixtures" / "tls"
CERT, KEY = str(TLS / "test-only.crt"), str(TLS / "test-only.key")
CONTEXT = ssl.create_default_context(cafile=CERT)


@contextmanager
def serving_tls(upstream: str) -> Iterator[str]:
    """`tokenprobe serve` over TLS in front of `upstream`; its https:// base URL."""
    port = free_port()
    process = spawn(
        "serve", "--upstream", upstream, "--port", str(port), "--ssl-certfile", CERT,
        "--ssl-keyfile", KEY, "--access-log", "off", "--models-refresh", "0",
        "--model-allowlist", MODEL,
    )  # fmt: skip
    base = f"https://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz", verify=CONTEXT)
        yield base
    finally:
        stop(process)


def test_a_stream_over_https_is_relayed_whole_and_measured(
    start_sim: Callable[..., Running],
) -> None:
    sim = start_sim(ttft=0.05, tokens_per_second=200.0, output_tokens=8)
    with serving_tls(sim.url) as base:
        client = OpenAI(
            base_url=base + "/v1", api_key="k", http_client=httpx.Client(verify=CONTEXT)
        )
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        page = httpx.get(base + "/metrics", verify=CONTEXT).text
        with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):  # TLS only
            httpx.get(base.replace("https://", "http://") + "/healthz", timeout=2)
    assert text
    counted = [
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith("tokenprobe_requests_total{") and 'code="200"' in line
    ]
    assert sum(counted) == 1, counted
    assert "tokenprobe_time_to_first_token_seconds_count" in page


@paths("wire", why="only the wire tunnels WebSockets (tests/server/test_websockets.py)")
def test_a_websocket_over_wss_is_tunnelled() -> None:
    upstream = EchoUpstream().start()
    try:
        with serving_tls(f"http://127.0.0.1:{upstream.port}") as base:

            async def echo() -> list[str]:
                url = base.replace("https://", "wss://") + "/v1/realtime"
                async with connect(url, ssl=CONTEXT) as ws:
                    answers = []
                    for text in ("one", "two"):
                        await ws.send(text)
                        answers.append(str(await ws.recv()))
                    return answers

            assert asyncio.run(echo()) == ["one", "two"]
    finally:
        upstream.stop()


@no_proxy
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--ssl-certfile", CERT], "--ssl-certfile needs --ssl-keyfile"),
        (["--ssl-keyfile", KEY], "--ssl-keyfile needs --ssl-certfile"),
        (
            ["--ssl-certfile", KEY, "--ssl-keyfile", KEY],
            f"--ssl-certfile {KEY} --ssl-keyfile {KEY}: not a certificate and its key",
        ),
    ],
    ids=["no-key", "no-certificate", "not-a-certificate"],
)
def test_a_missing_or_wrong_tls_file_is_refused_at_start(flags: list[str], said: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9", *flags],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.startswith(f"tokenprobe serve: {said}"), run.stderr
