"""--enable-ssl-refresh on the upstream's side: the client certificate the proxy presents
(--upstream-ssl-certfile) and the CAs it trusts (--upstream-ca-certs) are reloaded into the
one context every client uses, as the listener's are (tests/server/test_tls.py rotates the
listener's through a real serve)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.server.admission import relay_settings
from proxy.server.assemble import assemble
from proxy.server.certwatch import WATCH, CertWatch
from proxy.server.dial import client_tls, upstream_tls
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
    assert upstream_tls(settings) is not None  # the files as the settings give them
    watch = CertWatch()  # the process's WATCH holds other tests' contexts too
    context = watch.watched(
        functools.partial(client_tls, CERT, str(cert), str(key)), (CERT, str(cert), str(key))
    )
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


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=10)


def make_ca(folder: Path, name: str) -> tuple[str, str]:
    """A new CA's certificate and key (P-256: milliseconds), for these tests only."""
    pem, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(pem), "-subj", f"/CN={name}", "-days", "2",
    )  # fmt: skip
    return str(pem), str(key)


def make_leaf(folder: Path, name: str, ca: tuple[str, str]) -> tuple[str, str]:
    """A certificate `ca` signed, for 127.0.0.1 (a server's) or any client, and its key."""
    pem, key, csr = folder / f"{name}.pem", folder / f"{name}.key", folder / f"{name}.csr"
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}",
    )  # fmt: skip
    extensions = folder / f"{name}.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
        "-out", str(pem), "-days", "2", "-extfile", str(extensions),
    )  # fmt: skip
    return str(pem), str(key)


def _trusts(client: ssl.SSLContext, server: tuple[str, str]) -> bool:
    """Whether `client` completes a handshake with a server showing `server`'s certificate,
    on a blocking socket (wrap_socket) and on an event loop (wrap_bio: asyncio's SSL
    protocol, as the wire, the tunnel, httpx's anyio and aiohttp make theirs)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*server)
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def accept() -> None:
            for _ in range(2):
                conn, _ = listener.accept()
                try:
                    with context.wrap_socket(conn, server_side=True) as tls:
                        tls.sendall(b"x")
                except (ssl.SSLError, OSError):
                    pass  # the client refused the certificate

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        address = listener.getsockname()
        try:
            raw = socket.create_connection(address, timeout=5)
            with client.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                blocking = tls.recv(1) == b"x"
        except ssl.SSLCertVerificationError:
            blocking = False

        async def on_a_loop() -> bool:
            try:
                reader, writer = await asyncio.open_connection(*address, ssl=client)
            except ssl.SSLCertVerificationError:
                return False
            got = await reader.read(1)
            writer.transport.abort()  # the server closes on its own
            return got == b"x"

        looped = asyncio.run(on_a_loop())
        thread.join(5)
    assert blocking == looped
    return blocking


def test_a_ca_taken_out_of_upstream_ca_certs_is_no_longer_trusted_after_a_reload(
    tmp_path: Path,
) -> None:
    """OpenSSL only adds the CAs of a bundle loaded into a context: a new context is made
    on each change, so an upstream certified by a CA the bundle no longer holds is
    refused on new connections, and one certified by a CA it now holds is trusted."""
    ca1, ca2 = make_ca(tmp_path, "ca1"), make_ca(tmp_path, "ca2")
    server1, server2 = make_leaf(tmp_path, "server1", ca1), make_leaf(tmp_path, "server2", ca2)
    bundle = tmp_path / "bundle.pem"
    shutil.copy(ca1[0], bundle)
    watch = CertWatch()
    context = watch.watched(
        functools.partial(client_tls, str(bundle), None, None), (str(bundle), None, None)
    )
    assert (_trusts(context, server1), _trusts(context, server2)) == (True, False)
    _swap_in(ca2[0], bundle)
    assert watch.check() == (1, 0)
    assert (_trusts(context, server1), _trusts(context, server2)) == (False, True)


def test_a_bundle_that_does_not_load_keeps_the_cas_before(tmp_path: Path) -> None:
    ca1 = make_ca(tmp_path, "ca1")
    server1 = make_leaf(tmp_path, "server1", ca1)
    bundle = tmp_path / "bundle.pem"
    shutil.copy(ca1[0], bundle)
    watch = CertWatch()
    context = watch.watched(
        functools.partial(client_tls, str(bundle), None, None), (str(bundle), None, None)
    )
    bundle.write_text("-----BEGIN CERTIFICATE-----\nhalf-written\n")
    assert watch.check() == (0, 1)
    assert _trusts(context, server1)


@pytest.mark.parametrize("set_alpn", ["before the reload", "after the reload"])
def test_the_alpn_a_client_sets_on_the_context_reaches_the_reloaded_one(
    tmp_path: Path, set_alpn: str
) -> None:
    """httpcore sets its ALPN list on the context it is given before each connect."""
    bundle = tmp_path / "bundle.pem"
    shutil.copy(CERT, bundle)
    watch = CertWatch()
    context = watch.watched(
        functools.partial(client_tls, str(bundle), None, None), (str(bundle), None, None)
    )
    if set_alpn == "before the reload":
        context.set_alpn_protocols(["h2"])
    _swap_in(CERT2, bundle)
    assert watch.check() == (1, 0)
    if set_alpn == "after the reload":
        context.set_alpn_protocols(["h2"])
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(CERT2, KEY2)
    server.set_alpn_protocols(["http/1.1", "h2"])
    to_client, to_server = ssl.MemoryBIO(), ssl.MemoryBIO()
    hello = context.wrap_bio(to_client, to_server, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        hello.do_handshake()
    to_served = ssl.MemoryBIO()
    served = server.wrap_bio(to_served, ssl.MemoryBIO(), server_side=True)
    to_served.write(to_server.read())
    with pytest.raises(ssl.SSLWantReadError):
        served.do_handshake()  # the ClientHello read: the protocol is chosen
    assert served.selected_alpn_protocol() == "h2"
