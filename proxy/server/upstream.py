"""The upstream HTTP client. What its exceptions mean is decided in proxy/core/errors.py.

httpx is the client; its transport is either httpx's own or aiohttp's (httpx-aiohttp),
chosen by `--upstream-transport` after benchmarking (see docs/performance.md).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
import yarl
from aiohttp.client_proto import ResponseHandler
from aiohttp.helpers import _EXC_SENTINEL
from httpx_aiohttp.transport import AiohttpResponseStream, AiohttpTransport
from multidict import CIMultiDict

from proxy.settings import Settings

KEEPALIVE_SECONDS = 4.0


def create_client(
    settings: Settings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The upstream client the settings ask for; `transport`, when given, replaces the one
    --upstream-transport picks (an in-process test's scripted upstream)."""
    timeout = httpx.Timeout(
        connect=settings.connect_timeout,
        read=None,  # the relay times the gaps between chunks itself (RelaySettings.idle_timeout)
        write=settings.idle_timeout,
        pool=settings.connect_timeout,
    )
    # A proxy must not queue streams behind a connection cap the backend doesn't have.
    # Idle connections are dropped before the backend drops them: uvicorn (vLLM's server)
    # closes keep-alive connections after 5 s, and reusing one it just closed fails a request.
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=1024, keepalive_expiry=KEEPALIVE_SECONDS
    )
    if transport is None:
        transport = _transport(settings, limits)
    client = UpstreamClient(transport=transport, timeout=timeout, limits=limits)
    client.limits = limits
    client.headers.clear()  # forward the client's headers, not httpx's defaults
    return client


def _transport(settings: Settings, limits: httpx.Limits) -> httpx.AsyncBaseTransport:
    """httpx's own transport, or aiohttp's (--upstream-transport)."""
    if settings.upstream_transport == "aiohttp":

        def session() -> aiohttp.ClientSession:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)
            connector._factory = functools.partial(_BodyErrorsHandler, loop=connector._loop)  # type: ignore[assignment]
            return aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                # No cookie jar: one client's Set-Cookie must not go out on other clients' requests.
                cookie_jar=aiohttp.DummyCookieJar(),
                # Send exactly the client's headers: no added Accept-Encoding (the reply
                # would come compressed to a client that did not ask), User-Agent or Accept.
                # Nor a Content-Type the client did not send.
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Accept", "Content-Type"),
            )

        return AiohttpTransport(client=session)
    return httpx.AsyncHTTPTransport(limits=limits)


class _BodyErrorsHandler(ResponseHandler):
    """aiohttp's connection protocol, failing the response body on a parse error.

    With aiohttp's C parser, a malformed body (a chunk size that is not hex) makes the
    protocol close the connection and record the error on itself, but the response's body
    stream is never told: a reader waits for the idle timeout and the break is counted as
    upstream_timeout. (The pure-Python parser fails the body itself.)
    """

    def set_exception(self, exc: BaseException, exc_cause: BaseException = _EXC_SENTINEL) -> None:
        payload = self._payload
        super().set_exception(exc, exc_cause)
        if payload is not None and payload.exception() is None and not payload.is_eof():
            payload.set_exception(aiohttp.ClientPayloadError(f"malformed response body: {exc}"))


class UpstreamClient(httpx.AsyncClient):
    """httpx's client, keeping a handle on its transport for `send` below."""

    def __init__(self, *, transport: httpx.AsyncBaseTransport, **kwargs: object) -> None:
        super().__init__(transport=transport, **kwargs)  # type: ignore[arg-type]
        self.upstream_transport = transport
        self.limits = httpx.Limits()
        self._bytes_transport: httpx.AsyncHTTPTransport | None = None

    def bytes_transport(self) -> httpx.AsyncBaseTransport:
        """httpx's own transport, for requests aiohttp cannot send byte for byte."""
        if isinstance(self.upstream_transport, httpx.AsyncHTTPTransport):
            return self.upstream_transport
        if self._bytes_transport is None:
            self._bytes_transport = httpx.AsyncHTTPTransport(limits=self.limits)
        return self._bytes_transport

    async def aclose(self) -> None:
        await super().aclose()
        if self._bytes_transport is not None:
            await self._bytes_transport.aclose()


async def send_upstream(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> httpx.Response:
    """Send one proxied request; the response comes back with its body unread.

    It goes straight to the transport: a reverse proxy needs none of the client's
    per-request layers (auth flow, redirects, event hooks, an INFO log line, the cookie
    jar), which cost more CPU than the rest of the request. The cookie jar would even be
    wrong here: it would replay one client's Set-Cookie on every later client's request.

    `url` is sent exactly: its path is already normalised (proxy.core.paths), and neither
    client may normalise or re-encode it again. Header values go out byte for byte.
    """
    # The relay times the gaps between chunks itself (proxy.server.exchange.IdleTimer): a transport's
    # read timeout would cost a timer per chunk, and would also cut the wait for the
    # response headers, which first_byte_timeout governs.
    timeout = {**client.timeout.as_dict(), "read": None}
    if not isinstance(client, UpstreamClient):
        request = httpx.Request(method, url, headers=headers, content=body)
        return await client.send(request, stream=True)
    transport = client.upstream_transport
    if isinstance(transport, AiohttpTransport):
        text_headers = _utf8_headers(headers)
        if text_headers is not None:
            return await _send_aiohttp(transport, method, url, text_headers, body, timeout)
        # aiohttp writes header values as UTF-8 text: other bytes go through httpcore,
        # which writes them as they are.
        transport = client.bytes_transport()
    request = httpx.Request(
        method, url, headers=headers, content=body, extensions={"timeout": timeout}
    )
    # httpx.URL removes dot segments and re-quotes; httpcore sends this target instead.
    request.extensions["target"] = _request_target(url)
    response = await transport.handle_async_request(request)
    response.request = request
    return response


def _request_target(url: str) -> bytes:
    after_scheme = url.partition("//")[2]
    slash = after_scheme.find("/")
    return after_scheme[slash:].encode("ascii") if slash >= 0 else b"/"


def _utf8_headers(headers: list[tuple[bytes, bytes]]) -> CIMultiDict[str] | None:
    out: CIMultiDict[str] = CIMultiDict()
    try:
        for name, value in headers:
            out.add(name.decode("latin-1"), value.decode("utf-8"))
    except UnicodeDecodeError:
        return None
    return out


async def _send_aiohttp(
    transport: AiohttpTransport,
    method: str,
    url: str,
    headers: CIMultiDict[str],
    body: bytes,
    timeout: dict[str, float | None],
) -> httpx.Response:
    """httpx-aiohttp's request, minus what changes the wire: it hands aiohttp the URL as
    text (yarl then normalises and re-quotes it) and headers httpx decoded with one
    guessed encoding for all of them."""
    if not isinstance(transport.client, aiohttp.ClientSession):
        transport.client = transport.get_client()
    session = transport.client
    response = await session.request(
        method,
        yarl.URL(url, encoded=True),
        headers=headers,
        data=body or None,
        allow_redirects=False,
        auto_decompress=False,
        compress=False,
        timeout=aiohttp.ClientTimeout(
            sock_connect=timeout.get("connect"), connect=timeout.get("pool")
        ),
    ).__aenter__()
    return httpx.Response(
        status_code=response.status,
        headers=response.raw_headers,
        stream=AiohttpResponseStream(response),
        extensions={"http_version": b"HTTP/1.1"},
    )


def body_reader(response: httpx.Response) -> Callable[[], Awaitable[bytes]]:
    """A coroutine function giving the next raw chunk of the body on each call, b"" at its end.

    With the aiohttp transport it reads aiohttp's stream itself: httpx would pass each
    chunk through three more async iterators for the same bytes. aiohttp's errors then
    arrive unwrapped, and `proxy.core.errors.classify_exception` knows them.
    """
    inner = getattr(response.stream, "_aiohttp_response", None)  # httpx-aiohttp's stream
    if isinstance(inner, aiohttp.ClientResponse):
        return inner.content.readany
    chunks = response.aiter_raw()

    async def read() -> bytes:
        return await anext(chunks, b"")

    return read
