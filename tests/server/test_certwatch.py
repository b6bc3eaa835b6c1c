"""--enable-ssl-refresh on the upstream's side: the client certificate the proxy presents
(--upstream-ssl-certfile) is reloaded into the one context every client uses, as the
listener's is (tests/server/test_tls.py rotates the listener's through a real serve)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import ssl
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry

from proxy.server.admission import relay_settings
from proxy.server.assemble import assemble
from proxy.server.certwatch import WATCH, CertWatch
from proxy.server.dial import upstream_tls
from proxy.server.tunnel import tunnel_context
from proxy.server.upstream import UpstreamClient, create_client
from proxy.settings import Settings
from tests.paths import ROOT
from tests.server.conftest import no_proxy

pytestmark = no_proxy

TLS = ROOT / "tests" / "fixtures" / "tls"
CERT, KEY = str(TLS / "test-only.crt"), str(TLS / "test-only.key")
CERT2, KEY2 = str(TLS / "test-only-2.crt"), str(TLS / "test-only-2.key")


def _der(pem_file: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(Path(pem_file).read_text())


def _presented(client: ssl.SSLContext) -> bytes:
    """The certificate `client` shows a server that asks for one."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=CERT)
    server.load_verify_locations(CERT2)
    server.load_cert_chain(CERT, KEY)
    server.verify_mode = ssl.CERT_REQUIRED
    seen: list[bytes | None] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def accept() -> None:
            conn, _ = listener.accept()
            with server.wrap_socket(conn, server_side=True) as tls:
                seen.append(tls.getpeercert(binary_form=True))

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        raw = socket.create_connection(listener.getsockname(), timeout=5)
        with client.wrap_socket(raw, server_hostname="127.0.0.1"):  # the handshake
            thread.join(5)
    (certificate,) = seen
    assert certificate is not None
    return certificate


def _swap_in(source: str, path: Path) -> None:
    shutil.copy(source, f"{path}.new")
    os.replace(f"{path}.new", path)


def test_the_upstream_client_certificate_is_reloaded_when_its_files_change(
    tmp_path: Path,
) -> None:
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    shutil.copy(CERT, cert)
    shutil.copy(KEY, key)
    settings = Settings(
        upstream="https://127.0.0.1:9",
        upstream_ca_certs=CERT,
        upstream_ssl_certfile=str(cert),
        upstream_ssl_keyfile=str(key),
    )
    context = upstream_tls(settings)
    assert context is not None
    watch = CertWatch()
    watch.add(context, str(cert), str(key), CERT, server=False)
    assert _presented(context) == _der(CERT)
    assert watch.check() == (0, 0)  # nothing changed
    _swap_in(CERT2, cert)  # half-way: the new certificate beside the old key
    assert watch.check() == (0, 1)
    assert watch.check() == (0, 0)  # the same half-way files are not tried again
    assert _presented(context) == _der(CERT)  # the old pair is kept
    _swap_in(KEY2, key)
    assert watch.check() == (1, 0)
    assert _presented(context) == _der(CERT2)


def test_upstream_tls_registers_its_context_with_the_process_watch(tmp_path: Path) -> None:
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    shutil.copy(CERT, cert)
    shutil.copy(KEY, key)
    context = upstream_tls(
        Settings(
            upstream="https://127.0.0.1:9",
            upstream_ca_certs=CERT,
            upstream_ssl_certfile=str(cert),
            upstream_ssl_keyfile=str(key),
        )
    )
    assert context is not None
    _swap_in(CERT2, cert)
    _swap_in(KEY2, key)
    WATCH.check()  # what the app's lifespan runs every second with --enable-ssl-refresh
    assert _presented(context) == _der(CERT2)


def test_every_client_of_one_upstream_gets_the_one_context() -> None:
    """The wire's pool, the tunnel and the ASGI relay's client each ask: one context, made
    (and its CA bundle read) once, and reloaded once."""
    settings = Settings(upstream="https://127.0.0.1:9", upstream_ca_certs=CERT)
    relay = relay_settings(settings)
    tunnel = tunnel_context(settings, assemble(settings, {}, registry=CollectorRegistry()).sinks)
    client = create_client(dataclasses.replace(settings, upstream_transport="httpx"))
    assert isinstance(client, UpstreamClient)
    assert relay.upstream_ssl is not None
    assert relay.upstream_ssl is tunnel.ssl is client.tls is upstream_tls(settings)
    assert upstream_tls(Settings(upstream="http://127.0.0.1:9")) is None
