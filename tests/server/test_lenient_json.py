"""A request body orjson refuses but vLLM serves: vLLM's routes read JSON with Python's
`json.loads` on bytes (FastAPI through starlette's `Request.json`), which takes a UTF-8
BOM, UTF-16 and NaN. Such a request is measured as the one it is (its model, its stream
flag), and never rewritten: no usage request is spliced into it (proxy/core/request.py,
proxy/core/lenient_json.py `python_json_object`), on both data paths. Once it was measured
as a malformed body: no model, no stream flag, and no measurement said so.

Read again only where json.loads may take what orjson refused (a body both refuse was
read twice, on the event loop), and with its strings free of the lone surrogates
json.loads gives and no encoder takes (they lost the access-log line and the OTLP batch).
The sinks guard against them too, for strings that came through no orjson."""

from __future__ import annotations

import codecs
import io
import json
import types
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from proxy.core import lenient_json
from proxy.core.request import parse_request
from proxy.server.assemble import assemble
from proxy.settings import Settings
from proxy.sinks.logs import AccessLog
from proxy.sinks.sink import Recorder
from proxy.sinks.tracing import Tracing
from tests.conftest import MODEL, ProxyUnderTest, relay_config
from tests.paths import ROOT
from tests.server.conftest import no_proxy
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


# -- what json.loads gives and orjson never does: a lone surrogate -------------------------

#: A model and a prompt with lone surrogate escapes: orjson refuses the body ("no low
#: surrogate in string"), json.loads takes it with "\\ud800" as a str of its own, which
#: no UTF-8 encoder takes (orjson in the access log, protobuf in the OTLP exporter).
SURROGATES = (
    b'{"model": "%s\\ud800", "stream": true, "messages": [{"role": "user", "content": "hi \\udc00"}]}'
    % MODEL.encode()
)


class Traced:
    """A proxy with a JSON access log and a tracer that keeps its spans (trace_content)."""

    def __init__(self, upstream: str) -> None:
        self.log = io.StringIO()
        self.spans = InMemorySpanExporter()
        tracer = Tracing([SimpleSpanProcessor(self.spans)], upstream=upstream, trace_content=True)
        recorder = Recorder()
        settings = Settings(upstream=upstream, model_allowlist=(MODEL,), models_refresh=None)
        app = assemble(
            settings,
            {},
            registry=CollectorRegistry(),
            tracer=tracer,
            extra_sinks=[AccessLog("json", self.log), recorder],
        )
        server = ThreadedServer(app, server_header=False, date_header=False, **relay_config())
        server.start()
        self.proxy = ProxyUnderTest(server, app, recorder.records)


@pytest.fixture
def traced(upstream: tuple[ThreadedServer, Recording]) -> Iterator[Traced]:
    running = Traced(upstream[0].url)
    yield running
    running.proxy.stop()


def test_a_lone_surrogate_read_leniently_reaches_the_sinks_as_u_fffd(
    upstream: tuple[ThreadedServer, Recording], traced: Traced
) -> None:
    proxy = traced.proxy
    got = httpx.post(
        proxy.url + "/v1/chat/completions",
        content=SURROGATES,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert got.status_code == 200 and got.content == STREAM
    assert upstream[1].bodies == [SURROGATES]  # the bytes go on as they came
    (record,) = proxy.wait_records(1)
    assert record.model == MODEL + "\ufffd"
    (line,) = traced.log.getvalue().splitlines()  # the line is written, not a traceback
    assert orjson.loads(line)["model"] == MODEL + "\ufffd"
    assert not proxy.sample("tokenprobe_measurement_failures_total", stage="sink")
    (span,) = traced.spans.get_finished_spans()
    assert span.name == f"chat {MODEL}\ufffd"
    assert "hi \ufffd" in str((span.attributes or {})["gen_ai.input.messages"])
    # What the OTLP exporter does with a batch: one bad string failed all of it.
    assert encode_spans([span]).SerializeToString()


# -- a body both readers refuse is read once, not twice ------------------------------------

#: 4 MiB of JSON and one stray byte after it: orjson and json.loads both refuse it, after
#: reading all of it. The second reading, on the event loop, was 3x the first.
BIG_REFUSED = b'{"model": "m", "x": [' + b"0," * (2 << 20) + b"0]}x"


@pytest.fixture
def json_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the texts proxy/core/lenient_json.py hands to json.loads (the real one)."""
    sizes: list[int] = []

    def loads(text: str | bytes) -> Any:
        sizes.append(len(text))
        return json.loads(text)

    spy = types.SimpleNamespace(loads=loads, detect_encoding=json.detect_encoding)
    monkeypatch.setattr(lenient_json, "json", spy)
    return sizes


@no_proxy
def test_a_big_body_both_readers_refuse_is_not_read_again(json_reads: list[int]) -> None:
    info, obj = parse_request("/v1/chat/completions", BIG_REFUSED)
    assert (info.valid_json, obj) == (False, None)
    assert json_reads == []


@no_proxy
@pytest.mark.parametrize("kind", ["bom", "utf-16", "nan"])
def test_a_body_only_pythons_json_reads_is_still_read_again(
    json_reads: list[int], kind: str
) -> None:
    info, obj = parse_request("/v1/chat/completions", bodies()[kind])
    assert (info.model, info.valid_json, obj) == (MODEL, True, None)
    assert len(json_reads) == 1


#: Bodies orjson refuses, each with whether json.loads (vLLM's reader) takes it.
REFUSED = {
    "utf-8 bom": (codecs.BOM_UTF8 + b'{"a": 1}', True),
    "utf-16 bom": ('{"a": 1}'.encode("utf-16"), True),
    "utf-16-le": ('{"a": 1}'.encode("utf-16-le"), True),
    "utf-16-be": ('{"a": 1}'.encode("utf-16-be"), True),
    "utf-32": ('{"a": 1}'.encode("utf-32"), True),
    "utf-32-be": ('{"a": 1}'.encode("utf-32-be"), True),
    "nan": (b'{"a": NaN}', True),
    "nan after non-ascii": ('{"\u00e9\u00e9": [1, NaN]}'.encode(), True),
    "infinity": (b'{"a": Infinity}', True),
    "-infinity": (b'{"a": -Infinity}', True),
    "-nan": (b'{"a": -NaN}', False),
    "overflowing number": (b'{"a": 1e999}', True),
    "lone high surrogate": (b'{"a": "\\ud800"}', True),
    "lone low surrogate": (b'{"a": "x\\udc00y"}', True),
    "surrogate in a key": (b'{"\\ud800": 1}', True),
    "encoded surrogate": (b'{"a": "\xed\xa0\x80"}', True),
    "invalid utf-8": (b'{"a": "\xff"}', False),
    "stray byte after": (b'{"a": 1}x', False),
    "trailing comma": (b'{"a": 1,}', False),
    "control character": (b'{"a": "\x01"}', False),
    "nan after a refusal": (b'{"a": 1,, "b": NaN}', False),
    "empty": (b"", False),
}


@no_proxy
@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refusal_is_read_again_exactly_when_json_loads_may_take_it(name: str) -> None:
    body, takes = REFUSED[name]
    with pytest.raises(orjson.JSONDecodeError) as refused:
        orjson.loads(body)
    try:
        json.loads(body)
    except ValueError:
        taken = False
    else:
        taken = True
    assert taken is takes  # the table is right about Python's reader
    assert lenient_json.lenient_may_read(body, refused.value) is takes


@no_proxy
def test_every_string_read_leniently_is_free_of_lone_surrogates() -> None:
    body = (
        b'{"model": "m\\udfff", "temperature": NaN, "\\ud800": ["\xed\xb0\x80", {"k\\udc00": "'
        b'\\ud83d\\ude00"}], "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    )
    obj = lenient_json.python_json_object(body)
    assert obj is not None
    assert obj["model"] == "m\ufffd" and obj["messages"][0]["content"] == "a\ufffdb"
    assert obj["\ufffd"] == ["\ufffd", {"k\ufffd": "\U0001f600"}]  # a whole pair stays
    orjson.dumps(obj)  # takes no lone surrogate


# -- the sinks' own guard, for strings that came through no orjson ------------------------


@no_proxy
@pytest.mark.parametrize("mode", ["json", "text"])
def test_the_access_log_writes_a_lone_surrogate_as_u_fffd(mode: str) -> None:
    from proxy.sinks.sink import Labels
    from tests.factories import measurement

    out = io.StringIO()
    log = AccessLog(mode, out, ("team",))
    log.record(measurement(model="m\ud800", error_message="x\udc00"), Labels("m", None, ("r",)))
    line = out.getvalue()
    line.encode()  # what a UTF-8 stdout does with it
    assert "m\ufffd" in (orjson.loads(line)["model"] if mode == "json" else line)


@no_proxy
def test_the_access_log_writes_an_integer_beyond_64_bits_as_its_digits() -> None:
    """`"max_tokens": 100000000000000000000000` beside a NaN: json.loads keeps the
    integer, which orjson will not write ("Integer exceeds 64-bit range"): the line was
    lost with a traceback. Now its digits are written as a string."""
    from proxy.sinks.sink import Labels
    from tests.factories import measurement

    out = io.StringIO()
    AccessLog("json", out, ()).record(measurement(max_tokens=10**23), Labels("m", None, ()))
    assert orjson.loads(out.getvalue())["max_tokens"] == str(10**23)


@no_proxy
@pytest.mark.parametrize(
    ("escape", "walked"), [("\\u00e9", False), ("\\ud800", True), ("\\uDFFF", True)]
)
def test_only_a_surrogate_escape_makes_the_strings_walked(
    monkeypatch: pytest.MonkeyPatch, escape: str, walked: bool
) -> None:
    """Any `\\u` made every string of a leniently read body walked (Python's json.dumps
    escapes all non-ASCII): 2.5 s more on the event loop for 24 MiB. Only an escape in
    D800-DFFF can make a lone surrogate."""
    walks: list[object] = []
    real = lenient_json.clean_surrogates
    monkeypatch.setattr(
        lenient_json, "clean_surrogates", lambda obj: walks.append(obj) or real(obj)
    )
    body = b'{"model": "m", "t": NaN, "text": "' + escape.encode() + b'"}'
    obj = lenient_json.python_json_object(body)
    assert obj is not None and bool(walks) is walked
    obj["text"].encode()  # no lone surrogate left either way


@no_proxy
def test_a_span_with_a_lone_surrogate_still_encodes() -> None:
    from proxy.core.apis import RequestInfo
    from tests.factories import measurement

    spans = InMemorySpanExporter()
    tracing = Tracing([SimpleSpanProcessor(spans)], upstream="http://vllm:8000")
    info = RequestInfo("/v1/chat/completions", "m\ud800", False, False, None, None)
    span, _, _ = tracing.start(info, [])
    tracing.finish(span, measurement(model="m\ud800", response_model="r\udc00"))
    (done,) = spans.get_finished_spans()
    assert done.name == "chat m\ufffd"
    assert encode_spans([done]).SerializeToString()
