"""A request body orjson refuses but vLLM serves: vLLM's routes read JSON with Python's
`json.loads` on bytes (FastAPI through starlette's `Request.json`), which takes a UTF-8
BOM, UTF-16 and NaN. Such a request is measured as the one it is (its model, its stream
flag), and never rewritten: no usage request is spliced into it (proxy/core/request.py,
proxy/core/apis/base.py `python_json_object`), on both data paths. Once it was measured
as a malformed body: no model, no stream flag, and no measurement said so."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL, ProxyUnderTest
from tests.paths import ROOT
from tests.servers import ThreadedServer, request_body, serve

STREAM = (ROOT / "tests/fixtures/streams/vllm-0.32/chat_stream_no_usage.sse").read_bytes()
TEXT = '{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "hi"}]%s}'


def bodies() -> dict[str, bytes]:
    plain = TEXT % (MODEL, "")
    return {
        "bom": codecs.BOM_UTF8 + plain.encode(),
        "utf-16": plain.encode("utf-16"),
        "nan": (TEXT % (MODEL, ', "temperature": NaN')).encode(),
    }


class Recording:
    """An upstream that keeps each request's body and answers a real vLLM 0.32 stream."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:  # type: ignore[type-arg]
        if scope["type"] != "http":
            return
        body = await request_body(receive)
        self.bodies.append(body)
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": STREAM})


@pytest.fixture
def upstream() -> Iterator[tuple[ThreadedServer, Recording]]:
    recording = Recording()
    with serve(recording, lifespan="off") as server:
        yield server, recording


@pytest.mark.parametrize("kind", ["bom", "utf-16", "nan"])
def test_a_body_only_pythons_json_reads_is_measured_and_goes_as_it_came(
    upstream: tuple[ThreadedServer, Recording],
    start_proxy: Callable[..., ProxyUnderTest],
    kind: str,
) -> None:
    server, recording = upstream
    proxy = start_proxy(server.url)
    body = bodies()[kind]
    got = httpx.post(
        proxy.url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert got.status_code == 200 and got.content == STREAM
    assert recording.bodies == [body]  # not rewritten: no usage request spliced in
    (record,) = proxy.wait_records(1)
    assert (record.model, record.stream_requested, record.stream) == (MODEL, True, True)
    assert record.ok and record.output_tokens
