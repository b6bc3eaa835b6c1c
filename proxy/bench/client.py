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
from proxy.core.errors import classify_exception, describe
from proxy.core.measurement import Measurement, TokenSource
from proxy.core.observe import StreamObserver, TokenCounts
from proxy.core.request import RequestInfo
from proxy.core.tokens import count_output, count_prompt

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
    body = _body(options, payload)
    stream = body.get("stream") is True
    info = RequestInfo(
        endpoint=api_of(options.endpoint).endpoint,
        model=options.model,
        stream=stream,
        usage_requested=True,
        max_tokens=options.max_tokens if stream else None,
        temperature=0.0 if stream else None,
        prompt=payload,
    )
    return Call(info, orjson.dumps(body))


def _body(options: Options, payload: Any) -> dict[str, Any]:
    """The request body each API takes; streamed with usage wherever the API can."""
    endpoint = options.endpoint
    if endpoint == "/v1/embeddings":
        return {"model": options.model, "input": payload}
    if endpoint == "/v1/responses":
        return {
            "model": options.model,
            "input": payload,
            "max_output_tokens": options.max_tokens,
            "temperature": 0,
            "stream": True,
        }
    body: dict[str, Any] = {
        "model": options.model,
        "messages" if isinstance(payload, list) else "prompt": payload,
        "max_tokens": options.max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if endpoint == "/v1/messages":
        return body  # Messages streams always carry usage
    body["stream_options"] = {"include_usage": True}
    if options.ignore_eos:
        body["ignore_eos"] = True
    return body


def headers(options: Options) -> dict[str, str]:
    out = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream",
        "Accept-Encoding": "identity",  # the observer reads the bytes as they come
        "User-Agent": USER_AGENT,
    }
    if options.api_key:
        out["Authorization"] = f"Bearer {options.api_key}"
    out.update(options.headers)
    return out


def session(options: Options) -> aiohttp.ClientSession:
    # No connection cap: a cap would queue requests inside the client, unmeasured.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=options.timeout)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),  # a benchmark keeps no state between requests
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )


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
    )
    return measurement, observer


async def measure_wire(
    pool: Pool,
    url: yarl.URL,
    request_headers: dict[str, str],
    call: Call,
    scheduled: float,
    keep_text: bool,
) -> tuple[Measurement, StreamObserver]:
    """`measure` on the protocol-level client (wire.py): the observer is fed from the
    socket's callback, so a chunk costs no task wake-up."""
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
    )
    return measurement, observer


def needs_tokenizer(m: Measurement) -> bool:
    """No usage from the backend: a successful response's counts should come from the tokenizer."""
    return m.ok and m.token_source is not TokenSource.USAGE


def finalize(result: Result, tokenizer: Any) -> None:
    """Recount a result's tokens with the tokenizer, as the proxy does without usage."""
    observer, m = result.observer, result.m
    result.observer = None
    if observer is None or tokenizer is None:
        return
    counts = TokenCounts(
        prompt=count_prompt(tokenizer, observer.request.prompt),
        output=count_output(tokenizer, observer.texts),
        cached=None,
        source=TokenSource.TOKENIZER,
    )
    result.m = observer.measurement(
        end=observer.start + m.e2e,
        started_at=m.started_at,
        status_code=m.status_code,
        counts=counts,
        error_type=m.error_type,
        error_message=m.error_message,
    )
