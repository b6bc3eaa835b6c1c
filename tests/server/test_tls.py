"""`tokenprobe serve --ssl-certfile --ssl-keyfile`: HTTPS and WSS, as vLLM serves them
with the same flags, so clients of a vLLM that speaks TLS change only the host and port.

The certificate (tests/fixtures/tls/test-only.crt, for 127.0.0.1 and localhost, valid
until 2126) and its key were made for these tests with `openssl req -x509 -newkey rsa:2048
-nodes -days 36500 -subj "/CN=tokenprobe test" -addext
"subjectAltName=IP:127.0.0.1,DNS:localhost"`; test-only-2.crt (CN "tokenprobe test 2") and
its key the same way, as a rotation's new pair. They protect nothing else."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.sim import SimConfig, create_sim_app
from proxy.sim.utility import VLLM_VERSION
from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.paths import ROOT
from tests.scrape import Scrape
from tests.server.conftest import no_proxy, paths
from tests.server.test_backend_identity import backend_info
from tests.server.test_certwatch import make_ca, make_leaf
from tests.servers import ThreadedServer, free_port, spawn, stop, wait_http
from tests.ws_upstream import EchoUpstream

TLS = ROOT / "tests" / "fixtures" / "tls"
CERT, KEY = str(TLS / "test-only.crt"), str(TLS / "test-only.key")
CERT2, KEY2 = str(TLS / "test-only-2.crt"), str(TLS / "test-only-2.key")  # the rotation
CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
CONTEXT = ssl.create_default_context(cafile=CERT)


@contextmanager
def serving_tls(upstream: str, *flags: str) -> Iterator[str]:
    """`tokenprobe serve` over TLS in front of `upstream`; its https:// base URL."""
    port = free_port()
    process = spawn(
        "serve", "--upstream", upstream, "--port", str(port), "--ssl-certfile", CERT,
        "--ssl-keyfile", KEY, "--access-log", "off", "--models-refresh", "0",
        "--model-allowlist", MODEL, *flags,
    )  # fmt: skip
    base = f"https://127.0.0.1:{port}"
    try:
        shown = ssl.create_default_context(cafile=CERT)
        shown.load_cert_chain(CERT, KEY)  # a client certificate, where one is asked for
        wait_http(base + "/healthz", verify=shown)
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


def test_a_backend_certified_by_a_private_ca_is_trusted_through_ssl_cert_file(
    start_proxy: Callable[..., ProxyUnderTest], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM serving TLS with a certificate of the operator's own CA (here the test
    certificate, which signs itself): SSL_CERT_FILE, OpenSSL's variable, makes every
    client the proxy has trust it (the data path, and httpx's for /v1/models and the
    identity probe). Without it the certificate is refused, and so is the request."""
    app = create_sim_app(SimConfig(models=(MODEL,), ttft=0.02, output_tokens=8))
    backend = ThreadedServer(app, ssl_certfile=CERT, ssl_keyfile=KEY).start()
    upstream = f"https://127.0.0.1:{backend.port}"
    try:
        untrusting = start_proxy(upstream, models_refresh=0.2)
        monkeypatch.setenv("SSL_CERT_FILE", CERT)  # read as each proxy makes its contexts
        trusting = start_proxy(upstream, models_refresh=0.2)
        refused = httpx.post(untrusting.url + CHAT, json=BODY, timeout=10)
        trusted = httpx.post(trusting.url + CHAT, json=BODY, timeout=10)
        identified = backend_info(trusting, "vllm", VLLM_VERSION)
        unidentified = backend_info(untrusting, "vllm", VLLM_VERSION, timeout=0.5)
        trusting.stop()  # before the backend: a TLS server's stop waits for its idle
        untrusting.stop()  # clients' close_notify, which httpx's pool sends as it closes
    finally:
        backend.stop()
    assert refused.status_code == 502 and "CERTIFICATE_VERIFY_FAILED" in refused.text
    assert trusted.status_code == 200 and trusted.json()["choices"][0]["message"]["content"]
    assert (identified, unidentified) == (1, 0)


@paths("wire", why="the listener's TLS is uvicorn's, the same on both data paths")
def test_clients_must_show_a_certificate_when_ssl_cert_reqs_is_2(
    start_sim: Callable[..., Running],
) -> None:
    """Mutual TLS on the listener, as vLLM's --ssl-ca-certs and --ssl-cert-reqs 2: a client
    with a certificate of the bundle is served, one without is refused in the handshake."""
    sim = start_sim(ttft=0.02, output_tokens=4)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with serving_tls(sim.url, "--ssl-ca-certs", CERT, "--ssl-cert-reqs", "2") as base:
        with pytest.raises(httpx.TransportError):  # no certificate: no TLS session
            httpx.post(base + "/v1/chat/completions", json=body, verify=CONTEXT, timeout=5)
        shown = ssl.create_default_context(cafile=CERT)
        shown.load_cert_chain(CERT, KEY)
        answer = httpx.post(base + "/v1/chat/completions", json=body, verify=shown, timeout=10)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]


def client_hello() -> bytes:
    """The first flight of a real TLS handshake with the proxy's certificate trusted."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = CONTEXT.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def closed_after(sock: socket.socket, started: float) -> float:
    """Seconds from `started` until the proxy closes `sock` (its recv times out after 10 s)."""
    sock.settimeout(10)
    try:
        while sock.recv(65536):  # the ServerHello of a handshake left half done
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def closes(base: str) -> Scrape:
    return Scrape.parse(httpx.get(base + "/metrics", verify=CONTEXT, timeout=5).text)


@paths(
    "wire",
    why="the listener's TLS and its head guard are uvicorn's and GuardedHttpToolsProtocol's on both data paths",
)
def test_a_tls_handshake_gets_the_header_timeout_and_then_the_head_its_own(
    start_sim: Callable[..., Running],
) -> None:
    """asyncio gives a server's TLS handshake 60 s; the proxy gives it --header-timeout,
    as nginx gives it client_header_timeout. A connection that says nothing, or stops
    half-way through its handshake, is closed then and counted as `tls_handshake`; one
    whose handshake ended gets the head's own timeout (`header_timeout`), and a client
    that goes on is served."""
    sim = start_sim(ttft=0.02, output_tokens=4)
    with serving_tls(sim.url, "--header-timeout", "0.5") as base:
        before = closes(base)
        port = int(base.rsplit(":", 1)[1])
        started = time.monotonic()
        with (
            socket.create_connection(("127.0.0.1", port)) as silent,
            socket.create_connection(("127.0.0.1", port)) as halfway,
        ):
            halfway.sendall(client_hello())
            waited = closed_after(silent, started), closed_after(halfway, started)
        started = time.monotonic()
        with CONTEXT.wrap_socket(
            socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1"
        ) as headless:
            headless_waited = closed_after(headless, started)
        answer = httpx.post(base + CHAT, json=BODY, verify=CONTEXT, timeout=10)
        deadline = time.monotonic() + 5
        while (after := closes(base)).total(
            "tokenprobe_connections_closed_total", reason="tls_handshake"
        ) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert all(0.4 < seconds < 3 for seconds in waited), waited
    assert 0.4 < headless_waited < 3, headless_waited
    counted = {
        reason: after.total("tokenprobe_connections_closed_total", reason=reason)
        - before.total("tokenprobe_connections_closed_total", reason=reason)
        for reason in ("tls_handshake", "header_timeout")
    }
    assert counted == {"tls_handshake": 2, "header_timeout": 1}
    assert answer.status_code == 200


def test_an_upstream_that_asks_for_a_client_certificate_gets_one(
    relay: str, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """A vLLM with --ssl-cert-reqs 2: the proxy presents --upstream-ssl-certfile on every
    path to it (the data path, the WebSocket tunnel, the identity probe), and checks the
    backend against --upstream-ca-certs; without the certificate the backend refuses it
    (the HTTP request and the WebSocket upgrade get the proxy's 502)."""
    app = create_sim_app(SimConfig(models=(MODEL,), ttft=0.02, output_tokens=8))
    backend = ThreadedServer(
        app, ssl_certfile=CERT, ssl_keyfile=KEY, ssl_ca_certs=CERT, ssl_cert_reqs=2
    ).start()
    asks = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=CERT)
    asks.load_cert_chain(CERT, KEY)
    asks.verify_mode = ssl.CERT_REQUIRED
    echo = EchoUpstream(ssl=asks).start()
    mine = {"upstream_ssl_certfile": CERT, "upstream_ssl_keyfile": KEY}
    answers, identities, echoes = [], [], []
    try:
        for flags in ({}, mine):
            proxy = start_proxy(
                f"https://127.0.0.1:{backend.port}", models_refresh=0.2,
                upstream_ca_certs=CERT, **flags,
            )  # fmt: skip
            answers.append(httpx.post(proxy.url + CHAT, json=BODY, timeout=10).status_code)
            wait = 10 if flags else 0.5
            identities.append(backend_info(proxy, "vllm", VLLM_VERSION, timeout=wait))
            proxy.stop()  # first: see the test above
            if relay == "wire":  # only the wire tunnels WebSockets (test_websockets.py)
                tunnel = start_proxy(
                    f"https://127.0.0.1:{echo.port}", upstream_ca_certs=CERT, **flags
                )
                echoes.append(asyncio.run(_echo_once(tunnel.url)))
    finally:
        backend.stop()
        echo.stop()
    assert answers == [502, 200]
    assert identities == [0, 1]
    assert echoes == (["refused", "through mutual TLS"] if relay == "wire" else [])


@paths("wire", why="the listener's TLS is uvicorn's, the same on both data paths")
def test_a_rotated_certificate_reaches_new_connections_with_enable_ssl_refresh(
    tmp_path: Path,
) -> None:
    """As vLLM's --enable-ssl-refresh: the files change on disk, new connections get the
    new certificate without a restart. A rotation caught half-way (the new certificate
    beside the old key) is not loaded: the old pair stays in use until the key follows."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(CERT, cert)
    shutil.copy(KEY, key)
    port = free_port()
    process = spawn(
        "serve", "--upstream", "http://127.0.0.1:9", "--port", str(port), "--ssl-certfile",
        str(cert), "--ssl-keyfile", str(key), "--enable-ssl-refresh", "--access-log", "off",
        "--models-refresh", "0", "--model-allowlist", MODEL,
    )  # fmt: skip
    trusted = ssl.create_default_context(cafile=CERT)
    trusted.load_verify_locations(CERT2)
    base = f"https://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz", verify=trusted)
        assert _served_certificate(port) == _der(CERT)
        _swap_in(CERT2, cert)  # half-way: the key is still the old one
        failed = 'tokenprobe_tls_reloads_total{outcome="failed"} 1.0'
        deadline = time.monotonic() + 10
        while failed not in httpx.get(base + "/metrics", verify=trusted).text:
            assert time.monotonic() < deadline, "the half-way files were never checked"
            time.sleep(0.1)  # a check (one a second) sees the half-way files
        assert _served_certificate(port) == _der(CERT)
        _swap_in(KEY2, key)
        deadline = time.monotonic() + 10
        while _served_certificate(port) != _der(CERT2):
            assert time.monotonic() < deadline, "the new certificate was never served"
            time.sleep(0.1)
        page = httpx.get(base + "/metrics", verify=trusted).text
    finally:
        stop(process)
    assert 'tokenprobe_tls_reloads_total{outcome="failed"} 1.0' in page
    assert 'tokenprobe_tls_reloads_total{outcome="loaded"} 1.0' in page


@paths("wire", why="the listener's TLS is uvicorn's, the same on both data paths")
def test_a_ca_taken_out_of_ssl_ca_certs_is_refused_after_a_reload(tmp_path: Path) -> None:
    """--ssl-ca-certs rotated to revoke a CA: the clients it certified are refused on new
    connections, those of the CA put in its place are served, and a session from before
    the reload is not resumed (which would skip the check of the client's certificate).
    OpenSSL only adds a bundle's CAs to a context: each reload makes a new one."""
    ca1, ca2 = make_ca(tmp_path, "ca1"), make_ca(tmp_path, "ca2")
    client1 = _shown(make_leaf(tmp_path, "client1", ca1))
    client2 = _shown(make_leaf(tmp_path, "client2", ca2))
    bundle = tmp_path / "bundle.pem"
    shutil.copy(ca1[0], bundle)
    port = free_port()
    process = spawn(
        "serve", "--upstream", "http://127.0.0.1:9", "--port", str(port), "--ssl-certfile",
        CERT, "--ssl-keyfile", KEY, "--ssl-ca-certs", str(bundle), "--ssl-cert-reqs", "2",
        "--enable-ssl-refresh", "--access-log", "off", "--models-refresh", "0",
        "--model-allowlist", MODEL,
    )  # fmt: skip
    try:
        wait_http(f"https://127.0.0.1:{port}/healthz", verify=client1)
        assert _served(port, client2) == "refused"
        session = _served(port, client1)
        assert isinstance(session, ssl.SSLSession)
        assert _served(port, client1, session) == "resumed"
        _swap_in(ca2[0], bundle)
        deadline = time.monotonic() + 10
        while _served(port, client2) == "refused":
            assert time.monotonic() < deadline, "the new bundle was never loaded"
            time.sleep(0.1)
        assert _served(port, client1) == "refused"
        assert _served(port, client1, session) == "refused"  # not resumed unchecked
        page = httpx.get(f"https://127.0.0.1:{port}/metrics", verify=client2, timeout=5).text
    finally:
        stop(process)
    assert 'tokenprobe_tls_reloads_total{outcome="loaded"} 1.0' in page


def _shown(client: tuple[str, str]) -> ssl.SSLContext:
    """The proxy's certificate trusted, and `client`'s shown when asked."""
    context = ssl.create_default_context(cafile=CERT)
    context.load_cert_chain(*client)
    return context


def _served(
    port: int, client: ssl.SSLContext, session: ssl.SSLSession | None = None
) -> ssl.SSLSession | str:
    """A GET /healthz on a new connection `client` makes, resuming `session` when given:
    "refused"; "resumed" when served on `session`; else the new session it was served
    on (to resume later)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        with client.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as tls:
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = tls.recv(65536)  # TLS 1.3 refuses a certificate after the handshake
            while tls.recv(65536):  # the session ticket arrives with the answer
                pass
            if not head.startswith(b"HTTP/1.1 200"):
                return "refused"
            return "resumed" if tls.session_reused else tls.session
    except (ssl.SSLError, ConnectionResetError):
        return "refused"


def _swap_in(source: str, path: Path) -> None:
    """A new file in the old one's place at once, as a Secret's update swaps it."""
    shutil.copy(source, f"{path}.new")
    os.replace(f"{path}.new", path)


def _der(pem_file: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(Path(pem_file).read_text())


def _served_certificate(port: int) -> bytes:
    """The certificate a new TLS connection to the port is served."""
    any_certificate = ssl.create_default_context()
    any_certificate.check_hostname = False
    any_certificate.verify_mode = ssl.CERT_NONE
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    with any_certificate.wrap_socket(raw) as tls:
        served = tls.getpeercert(binary_form=True)
    assert served is not None
    return served


async def _echo_once(base: str) -> str:
    try:
        async with connect(base.replace("http://", "ws://") + "/v1/echo") as ws:
            await ws.send("through mutual TLS")
            return str(await ws.recv())
    except InvalidStatus as refused:  # the proxy's answer: the upstream closed first
        assert refused.response.status_code == 502
        return "refused"


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
