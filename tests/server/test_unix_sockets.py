"""Unix domain sockets, as vLLM serves on one with `--uds`: `--upstream-uds` connects to a
backend's socket (the URL still gives the scheme, the Host header and the base path, as
curl's --unix-socket), and `--uds` listens on one, so the clients of a vLLM on a socket
change only the socket's path.

Both data paths, the ASGI relay on each of its transports, the WebSocket tunnel, and the
proxy's own calls to the backend (`/v1/models`, the identity probe) go through the socket.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from websockets.asyncio.client import connect

from proxy.cli import main
from proxy.core.measurement import ErrorType, TokenSource
from proxy.sim import SimConfig, create_sim_app
from proxy.sim.app import SimApp
from proxy.sim.utility import VLLM_VERSION
from tests.conftest import MODEL, ProxyUnderTest
from tests.paths import ROOT
from tests.server.conftest import no_proxy, paths
from tests.server.test_backend_identity import backend_info
from tests.servers import ThreadedServer, spawn, stop
from tests.ws_upstream import EchoUpstream

CHAT = "/v1/chat/completions"
TLS = ROOT / "tests" / "fixtures" / "tls"
CERT, KEY = str(TLS / "test-only.crt"), str(TLS / "test-only.key")
MESSAGES = [{"role": "user", "content": "hi"}]


class SimOnSocket:
    def __init__(self, path: str) -> None:
        self.path = path
        self.app: SimApp = create_sim_app(
            SimConfig(models=(MODEL,), ttft=0.05, tokens_per_second=200.0, output_tokens=8)
        )
        self.server = ThreadedServer(self.app, uds=path).start()

    def seen(self) -> list[tuple[str, str | None]]:
        """(path, Host header) of each request the simulator served."""
        return [(r.path, r.headers.get("host")) for r in self.app.state.requests()]


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[SimOnSocket]:
    sim = SimOnSocket(str(tmp_path / "sim.sock"))
    yield sim
    sim.server.stop()


def _chat(proxy: ProxyUnderTest) -> str:
    client = OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_a_stream_and_an_answer_go_through_the_backends_socket(
    backend: SimOnSocket, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy("http://localhost", upstream_uds=backend.path)
    text = _chat(proxy)
    answer = httpx.post(
        proxy.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, timeout=10
    ).json()
    streamed, whole = proxy.wait_records(2, exact=True)
    assert text and answer["choices"][0]["message"]["content"]
    assert (streamed.ok, streamed.output_tokens, streamed.token_source) == (
        True, 9, TokenSource.USAGE,  # 8 tokens of text and the EOS
    )  # fmt: skip
    assert streamed.ttft is not None and streamed.ttft >= 0.05
    assert (whole.ok, whole.stream, whole.output_tokens) == (True, False, 9)  # and the EOS
    # The URL gives the Host header and the path; the socket only where it goes.
    assert backend.seen() == [(CHAT, "localhost"), (CHAT, "localhost")]


async def _echo_target(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers with the request target and Host header it got."""
    if scope["type"] != "http":
        return
    host = dict(scope["headers"]).get(b"host", b"").decode()
    body = json.dumps(
        {"target": scope["raw_path"].decode() + "?" + scope["query_string"].decode(), "host": host}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def test_the_base_path_is_kept_on_the_socket(
    tmp_path: Path, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    path = str(tmp_path / "echo.sock")
    server = ThreadedServer(_echo_target, uds=path, lifespan="off").start()
    try:
        proxy = start_proxy("http://localhost:8000/tenant-a/", upstream_uds=path)
        got = httpx.get(proxy.url + "/v1/models?limit=1", timeout=10).json()
    finally:
        server.stop()
    assert got == {"target": "/tenant-a/v1/models?limit=1", "host": "localhost:8000"}


@paths("asgi", why="the ASGI relay's two upstream transports; the wire has its own pool")
@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
def test_each_asgi_transport_goes_through_the_socket(
    backend: SimOnSocket, start_proxy: Callable[..., ProxyUnderTest], transport: str
) -> None:
    proxy = start_proxy("http://localhost", upstream_uds=backend.path, upstream_transport=transport)
    assert _chat(proxy) and _chat(proxy)
    first, second = proxy.wait_records(2, exact=True)
    assert first.ok and second.ok and second.output_tokens == 9  # 8 tokens and the EOS
    assert len(backend.seen()) == 2
    # and a socket nobody listens on is unreachable on this transport too, named in the
    # record, not in the client's answer (which names no host:port either)
    missing = str(Path(backend.path).with_name("nobody.sock"))
    dead = start_proxy("http://localhost", upstream_uds=missing, upstream_transport=transport)
    error = httpx.post(dead.url + CHAT, json={"model": MODEL, "messages": MESSAGES}).json()
    assert error["error"]["type"] == "upstream_unreachable"
    assert missing not in error["error"]["message"]
    (record,) = dead.wait_records(1, exact=True)
    assert record.error_message is not None and missing in record.error_message


def test_tls_goes_over_the_socket_checked_against_the_urls_host(
    tmp_path: Path, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """https:// with --upstream-uds: TLS over the socket, the certificate checked for the
    URL's host (the test certificate is for localhost), on the wire and on httpx's
    transport (aiohttp's Unix connector speaks no TLS: the settings refuse it)."""
    path = str(tmp_path / "tls.sock")
    app = create_sim_app(SimConfig(models=(MODEL,), ttft=0.02, output_tokens=8))
    server = ThreadedServer(app, uds=path, ssl_certfile=CERT, ssl_keyfile=KEY).start()
    try:
        proxy = start_proxy(
            "https://localhost", upstream_uds=path, upstream_ca_certs=CERT,
            upstream_transport="httpx",
        )  # fmt: skip
        assert _chat(proxy)
        # a fully qualified name's trailing dot is no part of the name TLS checks
        qualified = start_proxy(
            "https://localhost.", upstream_uds=path, upstream_ca_certs=CERT,
            upstream_transport="httpx",
        )  # fmt: skip
        assert _chat(qualified)
        qualified.stop()
        wrong = start_proxy(
            "https://tokenprobe.invalid", upstream_uds=path, upstream_ca_certs=CERT,
            upstream_transport="httpx",
        )  # fmt: skip
        refused = httpx.post(wrong.url + CHAT, json={"model": MODEL, "messages": MESSAGES})
        proxy.stop()  # first: a TLS server's stop waits for its idle clients' close_notify,
        wrong.stop()  # which httpx's pool sends only as it closes
    finally:
        server.stop()
    assert proxy.wait_records(1, exact=True)[0].ok
    assert refused.status_code == 502 and "CERTIFICATE_VERIFY_FAILED" in refused.text
    assert [r.headers.get("host") for r in app.state.requests()] == ["localhost", "localhost."]


def test_the_proxys_own_calls_to_the_backend_use_the_socket(
    backend: SimOnSocket, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """/v1/models (the model labels), the identity probe, every `models_refresh`, and
    /readyz's check that the backend answers."""
    proxy = start_proxy(
        "http://localhost", upstream_uds=backend.path, models_refresh=0.2, model_allowlist=()
    )
    assert backend_info(proxy, "vllm", VLLM_VERSION) == 1
    assert "/v1/models" in {path for path, _ in backend.seen()}
    assert httpx.get(proxy.url + "/readyz", timeout=5).status_code == 200
    # a model the backend listed is its own label (none is allowed by the settings)
    _chat(proxy)
    (record,) = proxy.wait_records(1, exact=True)
    assert record.ok
    samples = [
        sample
        for metric in proxy.registry.collect()
        for sample in metric.samples
        if sample.name == "tokenprobe_requests_total"
    ]
    # one series counted; the others a pair starts with are at 0 (metrics.first_counted)
    assert [sample.labels["model"] for sample in samples if sample.value] == [MODEL]
    assert {sample.labels["model"] for sample in samples} == {MODEL}


@pytest.mark.parametrize("left", ["no_file", "stale_file"])
def test_a_socket_nobody_listens_on_is_an_unreachable_upstream_that_names_it(
    tmp_path: Path, start_proxy: Callable[..., ProxyUnderTest], left: str
) -> None:
    """No file at the path (ENOENT), or the file a stopped server left (ECONNREFUSED)."""
    missing = str(tmp_path / "nobody.sock")
    if left == "stale_file":
        with socket.socket(socket.AF_UNIX) as gone:
            gone.bind(missing)  # the file stays after the socket closes
    proxy = start_proxy("http://localhost", upstream_uds=missing)
    response = httpx.post(proxy.url + CHAT, json={"model": MODEL, "messages": MESSAGES})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "upstream_unreachable"
    assert ("No such file or directory" if left == "no_file" else "refused") in error["message"]
    assert missing not in error["message"]  # where the backend is: the record's alone
    (record,) = proxy.wait_records(1, exact=True)
    assert record.error_type is ErrorType.UPSTREAM_UNREACHABLE
    assert record.error_message is not None and missing in record.error_message
    assert httpx.get(proxy.url + "/readyz", timeout=5).status_code == 503


@paths("wire", why="only the wire tunnels WebSockets (tests/server/test_websockets.py)")
def test_a_websocket_is_tunnelled_to_the_backends_socket(
    tmp_path: Path, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    upstream = EchoUpstream(uds=str(tmp_path / "ws.sock")).start()
    try:
        proxy = start_proxy("http://localhost", upstream_uds=upstream.uds)

        async def echo() -> str:
            async with connect(proxy.url.replace("http://", "ws://") + "/v1/echo") as ws:
                await ws.send("through the socket")
                return str(await ws.recv())

        assert asyncio.run(echo()) == "through the socket"
        (session,) = upstream.wait_sessions(1)
        assert session.path == "/v1/echo"
        assert dict((k.lower(), v) for k, v in session.headers)["host"] == "localhost"
    finally:
        upstream.stop()


def test_serve_listens_on_a_socket_in_front_of_a_backend_on_one(backend: SimOnSocket) -> None:
    """The whole drop-in: vLLM's `--uds` client points at the proxy's socket instead.
    The socket is made as vLLM makes its own: its mode from the umask (here 077: the
    owner's alone), a stale socket file at the path replaced."""
    listen = str(Path(backend.path).with_name("proxy.sock"))
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(listen)  # a stopped server's file, left behind
    process = spawn(
        "serve", "--uds", listen, "--upstream", "http://localhost", "--upstream-uds",
        backend.path, "--access-log", "off", "--models-refresh", "0",
        "--model-allowlist", MODEL, preexec_fn=lambda: os.umask(0o077) and None,
    )  # fmt: skip
    try:
        through = httpx.Client(transport=httpx.HTTPTransport(uds=listen), timeout=10)
        deadline = time.monotonic() + 20
        while True:
            try:
                if through.get("http://localhost/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.05)
        assert os.stat(listen).st_mode & 0o777 == 0o700  # 0777 less the umask, as vLLM's
        client = OpenAI(base_url="http://localhost/v1", api_key="k", http_client=through)
        chunks = list(
            client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        )
        page = through.get("http://localhost/metrics").text
    finally:
        stop(process)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert 'tokenprobe_requests_total{code="200",endpoint="/v1/chat/completions"' in page


@no_proxy
def test_a_socket_path_that_cannot_be_listened_on_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "no-such-folder" / "proxy.sock")
    assert main(["serve", "--uds", path, "--upstream", "http://localhost"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"tokenprobe serve: --uds {path}: cannot listen there (No such file")
