"""One streamed request -> one Measurement, measured by the proxy's own StreamObserver.

The observer's `start` is the instant the request was *due* (in an open loop, its
scheduled time), so a request that waited for the client is not measured as fast.
Each network read gets one `perf_counter()` and goes to the observer; nothing else runs
between the read and the timestamp. `measure_wire` (the load's client) does it inside the
socket's callback (wire.py); `measure` on aiohttp is kept for one-off requests. Token counting with a tokenizer is left to `finalize`,
run after the level ends, so it never delays the reading of other streams.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterable
from dataclasses import dataclass
from time import perf_counter, time
from typing import Any

import aiohttp
import orjson
import yarl

from proxy.bench.options import Options
from proxy.bench.prompts import Prompt
from proxy.bench.wire import Pool, request_head
from proxy.core.apis import api_of
from proxy.core.apis.realtime import Realtime
from proxy.core.errors import classify_exception, describe
from proxy.core.measurement import ErrorType, Measurement, TokenSource
from proxy.core.observe import StreamObserver, TokenCounts, bare_record
from proxy.core.request import RequestInfo
from proxy.core.secrets import SECRET_HEADERS, redact
from proxy.core.tokens import count_choices, count_request
from proxy.core.wav import pcm16, wav
from proxy.core.wsframes import WsMessage

USER_AGENT = "tokenprobe-bench"


@dataclass(frozen=True, slots=True)
class Call:
    """A prepared request: the body is encoded once, before the clock starts."""

    info: RequestInfo
    body: bytes


@dataclass(slots=True)
class Result:
    level: int  # index into Options.levels
    index: int  # the request's number within its level
    scheduled: float  # perf_counter() instant the request was due
    sent: float  # perf_counter() instant it was handed to the HTTP client
    m: Measurement
    observer: StreamObserver | None = None  # kept only while a tokenizer count is pending


def prepare(options: Options, prompt: Prompt) -> Call:
    payload = prompt.payload(options.endpoint)
    endpoint = options.endpoint
    if endpoint in AUDIO:
        info = RequestInfo(endpoint, options.model, True, True, None, 0.0)
        return Call(info, audio_form(options))
    if endpoint == REALTIME:
        return Call(RequestInfo(endpoint, options.model, True, True, None, None), b"")
    api = api_of(endpoint)
    body = api.bench_body(options.model, payload, options.max_tokens, options.ignore_eos)
    stream = body.get("stream") is True
    ids = body.get("token_ids")
    info = RequestInfo(
        endpoint=api.endpoint,
        model=options.model,
        stream=stream,
        usage_requested=True,
        max_tokens=options.max_tokens if stream else None,
        temperature=0.0 if stream else None,
        prompt=ids if ids is not None else payload,
        prompt_tokens=len(ids) if ids is not None else None,
    )
    return Call(info, orjson.dumps(body))


#: The audio APIs, sent as a form; the realtime API, as a WebSocket session.
AUDIO = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
REALTIME = "/v1/realtime"
BOUNDARY = "tokenprobe-bench-7f3a"
AUDIO_SECONDS = 1.0


def audio_form(options: Options) -> bytes:
    """A streamed transcription (or translation) of a generated 1 s WAV, with usage."""
    fields = {
        "model": options.model,
        "stream": "true",
        "stream_include_usage": "true",
        "temperature": "0",
    }
    out = b""
    for name, value in fields.items():
        out += (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        ).encode()
    out += (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="bench.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    return out + wav(AUDIO_SECONDS) + f"\r\n--{BOUNDARY}--\r\n".encode()


def headers(options: Options) -> dict[str, str]:
    content_type = (
        f"multipart/form-data; boundary={BOUNDARY}"
        if options.endpoint in AUDIO
        else "application/json"
    )
    out = {
        "Content-Type": content_type,
        "Accept": "text/event-stream",
        "Accept-Encoding": "identity",  # the observer reads the bytes as they come
        "User-Agent": USER_AGENT,
    }
    if options.api_key:
        out["Authorization"] = f"Bearer {options.api_key}"
    out.update(options.headers)
    return out


def connector(uds: str | None, **options: Any) -> aiohttp.BaseConnector:
    """aiohttp's connector to the backend: its Unix socket with --uds, else TCP."""
    if uds is not None:
        return aiohttp.UnixConnector(uds, **options)
    return aiohttp.TCPConnector(ttl_dns_cache=None, **options)


def session(options: Options) -> aiohttp.ClientSession:
    # No connection cap: a cap would queue requests inside the client, unmeasured.
    connector_ = connector(options.uds, limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=options.timeout)
    return aiohttp.ClientSession(
        connector=connector_,
        timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),  # a benchmark keeps no state between requests
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )


def masked(text: str, request_headers: dict[str, str], url: yarl.URL) -> str:
    """An error message with the credentials the bench sent masked, as the proxy masks a
    client's (proxy/core/secrets.py): a backend may echo the key it refused."""
    sent = [(k.lower().encode(), v.encode("utf-8", "replace")) for k, v in request_headers.items()]
    return redact(text, sent, SECRET_HEADERS, url.raw_query_string)


async def measure(
    client: aiohttp.ClientSession,
    url: yarl.URL,
    request_headers: dict[str, str],
    call: Call,
    scheduled: float,
    keep_text: bool,
) -> tuple[Measurement, StreamObserver]:
    """Send one request; the latencies are measured from `scheduled`."""
    observer = StreamObserver(call.info, scheduled, collect_text=keep_text)
    started_at = time() - (perf_counter() - scheduled)
    status = 0
    error = message = None
    try:
        async with client.post(url, data=call.body, headers=request_headers) as response:
            status = response.status
            observer.open(status, response.headers.get("Content-Type", ""), perf_counter())
            read, feed = response.content.readany, observer.feed
            while chunk := await read():
                feed(chunk, perf_counter())
            observer.end_of_stream(perf_counter())
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # every failure becomes a measured error type
        error, message = classify_exception(exc, after_headers=status != 0), describe(exc)
    measurement = await observer.finish(
        end=perf_counter(),
        started_at=started_at,
        status_code=status,
        error_type=error,
        error_message=message,
        redact=lambda text: masked(text, request_headers, url),
    )
    return measurement, observer


async def measure_wire(
    pool: Pool,
    url: yarl.URL,
    request_headers: dict[str, str],
    call: Call,
    scheduled: float,
    keep_text: bool,
) -> tuple[Measurement, StreamObserver | None]:
    """`measure` on the protocol-level client (wire.py): the observer is fed from the
    socket's callback, so a chunk costs no task wake-up. A realtime session is a WebSocket
    (`measure_realtime`)."""
    if call.info.endpoint == REALTIME:
        return await measure_realtime(url, request_headers, call, scheduled, pool.uds), None
    observer = StreamObserver(call.info, scheduled, collect_text=keep_text)
    started_at = time() - (perf_counter() - scheduled)
    error = message = None
    try:
        await pool.request(request_head(url, request_headers, len(call.body)), call.body, observer)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # every failure becomes a measured error type
        after = observer.first_byte is not None
        error, message = classify_exception(exc, after_headers=after), describe(exc)
    measurement = await observer.finish(
        end=perf_counter(),
        started_at=started_at,
        status_code=observer.status if observer.first_byte is not None else 0,
        error_type=error,
        error_message=message,
        redact=lambda text: masked(text, request_headers, url),
    )
    return measurement, observer


async def measure_realtime(
    url: yarl.URL,
    request_headers: dict[str, str],
    call: Call,
    scheduled: float,
    uds: str | None = None,
) -> Measurement:
    """One /v1/realtime session with one utterance (1 s of audio: half, the commit that
    starts the transcription, the other half, the final commit), measured by the proxy's
    own realtime seam from the frames as they are sent and read."""
    records: list[Measurement] = []
    started_at = time() - (perf_counter() - scheduled)
    session = Realtime().open(
        start=scheduled, started_at=started_at, path=REALTIME, query="", record=records.append
    )
    half = len(PCM) // 2
    sends = [
        {"type": "session.update", "model": call.info.model},
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(PCM[:half]).decode()},
        {"type": "input_audio_buffer.commit"},
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(PCM[half:]).decode()},
        {"type": "input_audio_buffer.commit", "final": True},
    ]
    headers = {k: v for k, v in request_headers.items() if k.lower() != "content-type"}
    cause, error = "closed_by_client", None
    try:
        async with (
            aiohttp.ClientSession(connector=connector(uds)) as client,
            client.ws_connect(
                url.with_scheme("ws" if url.scheme == "http" else "wss"), headers=headers
            ) as ws,
        ):
            for event in sends:
                data = orjson.dumps(event)
                await ws.send_str(data.decode())
                session.message(WsMessage(True, "text", data, perf_counter()))
            async for frame in ws:
                if frame.type is not aiohttp.WSMsgType.TEXT:  # binary, or one aiohttp refused
                    cause = "error"
                    break
                text = frame.data.encode()
                session.message(WsMessage(False, "text", text, perf_counter()))
                if records:
                    break
            else:
                cause = "upstream_vanished"
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        cause, error = "error", exc
    session.close(perf_counter(), cause)
    if records:
        record = records[0]
        if record.error_message is not None:
            record.error_message = masked(record.error_message, request_headers, url)
        return record
    return bare_record(
        call.info,
        status_code=0,
        started_at=started_at,
        e2e=perf_counter() - scheduled,
        error_type=ErrorType.STREAM_TRUNCATED
        if error is None
        else classify_exception(error, after_headers=False),
        error_message="session ended before transcription.done"
        if error is None
        else describe(error),
    )


PCM = pcm16(AUDIO_SECONDS)


def needs_tokenizer(m: Measurement) -> bool:
    """No usage from the backend: a successful response's counts should come from the
    tokenizer (exact token ids and the engine's own count are as good as usage: the
    proxy's order, TokenSource)."""
    return m.ok and m.token_source not in (
        TokenSource.USAGE,
        TokenSource.TOKEN_IDS,
        TokenSource.ENGINE,
    )


def finalize(result: Result, tokenizer: Any) -> None:
    """Recount a result's tokens with the tokenizer, as the proxy does without usage."""
    observer, m = result.observer, result.m
    result.observer = None
    if observer is None or tokenizer is None:
        return
    counts = TokenCounts(
        prompt=count_request(tokenizer, observer.request),
        output=count_choices(tokenizer, observer.choice_outputs()),
        cached=None,
        source=TokenSource.TOKENIZER,
    )
    reasoning = observer.choice_reasoning()
    counted = (
        count_choices(tokenizer, [(texts, None) for texts in reasoning])
        if reasoning and not observer.reasoning_from_usage()
        else None
    )
    result.m = observer.measurement(
        end=observer.start + m.e2e,
        started_at=m.started_at,
        status_code=m.status_code,
        counts=counts,
        error_type=m.error_type,
        error_message=m.error_message,
        reasoning=observer.reasoning(counted),
    )


def uncounted_prompts(results: Iterable[Result], tokenizer: str) -> str | None:
    """Why successful requests counted by the tokenizer (no usage from the backend) have
    no prompt tokens, or None when every one has them. Chat messages are counted only
    through the tokenizer's chat template (count_request, as the proxy's records): the
    backend tokenized the template's rendering, role markers included, and a count of the
    texts alone would be labelled `tokenizer` without being that. A tokenizer directory
    without a template is the usual cause (vLLM refuses chat without one unless started
    with --chat-template: vllm/renderers/hf.py, "default chat template is no longer
    allowed"), so say it rather than leave the figure silently empty."""
    missing = sum(
        1
        for r in results
        if r.m.ok and r.m.token_source is TokenSource.TOKENIZER and r.m.prompt_tokens is None
    )
    if not missing:
        return None
    return (
        f"{missing} requests have no prompt tokens: the backend sent no usage and "
        f"--tokenizer {tokenizer} counts chat messages only through its chat template, "
        "which it lacks or which refused them (the message texts alone miss the template's "
        "tokens); give a tokenizer directory with the backend's chat template"
    )
