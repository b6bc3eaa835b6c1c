"""Secrets stay secret, labels stay bounded, /metrics can be fenced off."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import string
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL, ProxyUnderTest, Running
from tests.scrape import Scrape
from tests.server.conftest import no_proxy
from tests.servers import free_port

CHAT = "/v1/chat/completions"


def body(model: str = MODEL) -> dict[str, object]:
    return {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def series_count(metrics_text: str) -> int:
    return len(Scrape.parse(metrics_text).samples)


def test_key_label_is_a_salted_hash_never_the_key(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(sim.url, key_label="hash", key_salt="pepper")
    for key in ("sk-alpha-SECRET", "sk-beta-SECRET", "sk-alpha-SECRET"):
        httpx.post(proxy.url + CHAT, json=body(), headers={"authorization": f"Bearer {key}"})
    deadline = time.monotonic() + 5
    while len(proxy.records) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    text = httpx.get(proxy.url + "/metrics").text
    assert "SECRET" not in text and "sk-" not in text
    keys = Scrape.parse(text).series("tokenprobe_key_requests_total")
    assert sorted(s.value for s in keys) == [1.0, 2.0]


@no_proxy
def test_key_labels_are_bounded() -> None:
    from proxy.sinks.keys import MAX_KEYS, KeyLabels
    from tests.factories import measurement

    labels = KeyLabels("salt")
    answered = measurement()  # each key accepted by the backend
    seen = {
        labels.settle(labels([(b"authorization", f"Bearer k{i}".encode())]), answered)
        for i in range(MAX_KEYS * 3)
    }
    assert len(seen) == MAX_KEYS + 1 and "other" in seen


def test_random_models_and_paths_leave_series_bounded(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """2,000 requests with random model names, keys and paths: the series count stays
    fixed. A label that took any of them as its value would add a series per request,
    a thousand or more, so more requests would show nothing more (10,000 took 20 s)."""
    proxy = start_proxy(sim.url, key_label="hash")
    rng = random.Random(7)

    def word() -> str:
        return "".join(rng.choices(string.ascii_letters, k=12))

    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for i in range(200):  # warm-up: every label combination the traffic below can make
            client.post(CHAT, json=body(word()), headers={"authorization": f"Bearer {word()}"})
            client.get(f"/v1/{word()}/{i}")
        before = series_count(client.get("/metrics").text)
        for i in range(2_000):
            if i % 2:
                client.post(
                    CHAT,
                    json=body(word()),
                    headers={"authorization": f"Bearer {word()}", "x-sim-error": "not_found"},
                )
            else:
                client.get(f"/v1/{word()}/{word()}")
        after = series_count(client.get("/metrics").text)
    assert after == before
    assert after < 1000


def test_metrics_port_serves_metrics_apart_from_the_proxy(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    port = free_port()
    proxy = start_proxy(sim.url, metrics_port=port)
    assert httpx.get(proxy.url + "/metrics").status_code == 404
    reply = httpx.get(f"http://127.0.0.1:{port}/metrics")
    assert reply.status_code == 200 and "tokenprobe_requests_total" in reply.text


def test_metrics_token_is_required_when_set(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    proxy = start_proxy(sim.url, metrics_token="let-me-in")
    assert httpx.get(proxy.url + "/metrics").status_code == 401
    assert (
        httpx.get(proxy.url + "/metrics", headers={"authorization": "Bearer nope"}).status_code
        == 401
    )
    assert (
        httpx.get(proxy.url + "/metrics", headers={"authorization": "Bearer let-me-in"}).status_code
        == 200
    )


def test_secret_headers_echoed_by_the_upstream_are_redacted_from_error_messages(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    """A backend that repeats the caller's credentials in its error text."""
    from tests.servers import echoing, serve

    def text(scope: dict[str, Any], headers: dict[bytes, bytes]) -> bytes:
        return (
            b"bad credentials: "
            + headers.get(b"authorization", b"")
            + b" and "
            + headers.get(b"x-tenant-token", b"")
        )

    with serve(echoing(text), lifespan="off") as upstream:
        proxy = start_proxy(upstream.url, secret_headers=("x-tenant-token",))
        httpx.post(
            proxy.url + CHAT,
            json=body(),
            headers={"authorization": "Bearer sk-TOPSECRET-1", "x-tenant-token": "tenant-SECRET-2"},
        )
        deadline = time.monotonic() + 5
        while not proxy.records and time.monotonic() < deadline:
            time.sleep(0.01)
    message = proxy.records[0].error_message or ""
    assert "bad credentials" in message
    assert "SECRET" not in message


def test_credentials_in_a_long_echo_a_named_header_or_the_query_are_redacted(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    """A key the 300-character cut would split (its start once survived: whole-value
    redaction ran on the cut text), a header whose name says it carries a key
    (`x-goog-api-key`: not in the fixed list), and a key in the query string (`?key=`,
    `?access_token=`, percent-encoded too): none reaches the record's error message."""
    from tests.servers import echoing, serve

    named = (b"authorization", b"x-goog-api-key", b"ocp-apim-subscription-key", b"x-functions-key")

    def text(scope: dict[str, Any], headers: dict[bytes, bytes]) -> bytes:
        cookie = headers.get(b"cookie", b"").partition(b";")[0].partition(b"=")[2]
        return (
            b"x" * int(headers.get(b"x-pad", b"0"))
            + b" bad credentials "
            + b" ".join(headers.get(name, b"") for name in named)
            + b" invalid session "
            + cookie  # a cookie's value alone
            + b" for "
            + bytes(scope["query_string"]).replace(b"%2B", b"+")
        )

    cases = [
        ("", {"authorization": "Bearer tpk-LEAKCANARY0123456789", "x-pad": "270"}),
        ("", {"x-goog-api-key": "GOOGHEADERCANARY55555"}),
        ("?key=AIzaQUERYCANARY12345&alt=json", {}),
        ("?access_token=ya29.TOKEN%2BCANARY", {}),
        # Azure API Management's and Azure Functions' key headers and parameters
        ("?subscription-key=SUBKEYCANARY1&code=FUNCCODECANARY2", {}),
        ("", {"ocp-apim-subscription-key": "APIMCANARY77", "x-functions-key": "FUNCKEYCANARY3"}),
        ("", {"cookie": "session=COOKIECANARY99; theme=dark"}),
        # signed URLs: AWS SigV4's and Google Cloud's signature parameters
        ("?X-Amz-Signature=AMZSIGCANARY0123&X-Goog-Signature=GOOGSIGCANARY6", {}),
    ]
    with serve(echoing(text), lifespan="off") as upstream:
        proxy = start_proxy(upstream.url)
        for query, headers in cases:
            httpx.post(proxy.url + CHAT + query, json=body(), headers=headers)
        deadline = time.monotonic() + 5
        while len(proxy.records) < len(cases) and time.monotonic() < deadline:
            time.sleep(0.01)
    messages = [record.error_message or "" for record in proxy.records]
    assert len(messages) == len(cases)
    assert all("bad credentials" in message for message in messages), messages
    canaries = ("LEAKCA", "GOOGHEADER", "QUERYCANARY", "TOKEN+CANARY", "TOKEN%2BCANARY",
                "SUBKEYCANARY", "FUNCCODECANARY", "APIMCANARY", "FUNCKEYCANARY", "COOKIECANARY",
                "AMZSIGCANARY", "GOOGSIGCANARY")  # fmt: skip
    for canary in canaries:
        assert not any(canary in message for message in messages), (canary, messages)


def test_the_answer_to_a_broken_upstream_never_quotes_the_callers_credentials(
    start_proxy: Callable[..., ProxyUnderTest],
) -> None:
    """An upstream that answers bytes no HTTP parser takes, echoing the request in them:
    the proxy's 502 says what the upstream client's parser said, which quoted those bytes
    (the ASGI relay's clients did: `BadStatusLine: b'... Bearer ...'`; no path quotes an
    upstream's bytes now, tests/hostile/test_upstream_faults.py). The caller's key and its
    `?key=` are masked there as in the record."""
    import asyncio

    from tests.edge_backend import backend

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen = upstream.seen[-1]  # the request this answers, as the backend read it
        auth = b" ".join(value for name, value in seen.headers if name == b"authorization")
        writer.write(b"HELLO " + seen.request_line + b" " + auth + b"\r\n\r\n")
        await writer.drain()
        writer.close()

    with backend(responder=answer) as upstream:
        proxy = start_proxy(upstream.url)
        reply = httpx.post(
            proxy.url + CHAT + "?key=QKEYCANARY99",
            json=body(),
            headers={"authorization": "Bearer tpk-AUTHCANARY123"},
        )
        record = proxy.wait_records(1)[0]
    assert reply.status_code == 502 and "upstream" in reply.text, reply.text
    for canary in ("AUTHCANARY", "QKEYCANARY"):
        assert canary not in reply.text, reply.text
        assert canary not in (record.error_message or ""), record.error_message


def test_a_websocket_handshake_logs_neither_its_query_nor_a_line_of_the_clients(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest], caplog: pytest.LogCaptureFixture
) -> None:
    """A handshake whose path decodes to a newline and an escape, with a key in its query:
    no log line carries the key, and none is split or coloured by the client (the ASGI
    relay's refusal logged the decoded path as it came, and uvicorn's own line the query)."""
    proxy = start_proxy(sim.url)
    port = int(proxy.url.rsplit(":", 1)[1])
    head = (
        b"GET /v1/realtime%0AERROR%20tokenprobe:%20forged%1b[31m?api_key=sk-WSQUERYCANARY1 "
        b"HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    with caplog.at_level(logging.DEBUG), socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(head)
        conn.settimeout(5)
        assert conn.recv(64).startswith(b"HTTP/1.1 ")
        time.sleep(0.2)  # the server logs after it answers
    lines = [record.getMessage() for record in caplog.records]
    assert not any("WSQUERYCANARY" in line for line in lines), lines
    assert not any("\n" in line or "\x1b" in line for line in lines), lines


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@contextlib.contextmanager
def _every_line_at_debug() -> Iterator[list[str]]:
    """What `--log-level debug` writes: the root logger and uvicorn's at DEBUG (uvicorn's
    own do not propagate), every line kept as formatted."""
    handler = _Lines()
    root, server, errors = (logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error"))
    levels = [(logger, logger.level) for logger in (root, server, errors)]
    for logger in (root, server):
        logger.addHandler(handler)
    for logger, _ in levels:
        logger.setLevel(logging.DEBUG)
    try:
        yield handler.lines
    finally:
        for logger in (root, server):
            logger.removeHandler(handler)
        for logger, level in levels:
            logger.setLevel(level)


def test_no_line_at_debug_carries_a_handshakes_or_a_requests_credentials(
    sim: Running, start_proxy: Callable[..., ProxyUnderTest]
) -> None:
    """At `--log-level debug` the `websockets` library, which uvicorn hands its
    `uvicorn.error` logger, wrote the ASGI relay's refused handshake's request line
    (`?api_key=`) and every header (`authorization: Bearer ...`); on the wire the
    simulator's uvicorn, in this process, wrote the tunnelled one's. No library on either
    data path writes a credential, a WebSocket handshake's or a request's."""
    proxy = start_proxy(sim.url)
    port = int(proxy.url.rsplit(":", 1)[1])
    head = (
        b"GET /v1/realtime?api_key=QLOGCANARY1 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer HLOGCANARY2\r\n\r\n"
    )
    with _every_line_at_debug() as lines:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(head)
            conn.settimeout(5)
            assert conn.recv(64).startswith(b"HTTP/1.1 ")
        request = urllib.request.Request(  # urllib: a client that logs nothing itself
            proxy.url + CHAT + "?api_key=QLOGCANARY3",
            data=json.dumps(body()).encode(),
            headers={"authorization": "Bearer HLOGCANARY4", "content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.status == 200
            reply.read()
        time.sleep(0.2)  # the server logs after it answers
    assert lines, "nothing was logged at DEBUG: the test saw nothing"
    leaked = [line for line in lines if "LOGCANARY" in line]
    assert not leaked, leaked
