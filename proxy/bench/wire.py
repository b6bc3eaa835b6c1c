"""The bench's HTTP/1.1 client at the protocol level: each network read goes to the
observer from inside the socket's callback.

A stream client built on a reader (`await response.content.readany()`) pays for a future,
a task wake-up and a loop turn on every chunk; here `data_received` hands the bytes to
llhttp (httptools, uvicorn's parser), whose body callback timestamps them and feeds the
request's StreamObserver at once. Nothing else runs between the read and the timestamp.

One `Pool` per host keeps idle keep-alive connections; a connection whose response did
not end cleanly (an error, a cancel, `Connection: close`) is closed, never reused. The
silence limit (`--timeout`) is checked by one timer per connection that re-arms itself
from the last read, not by a timer per chunk.
"""

from __future__ import annotations

import asyncio
import ssl
from time import perf_counter

import httptools
import yarl

from proxy.core.observe import StreamObserver


class ConnectFailed(ConnectionRefusedError):
    """The connection could not be opened (refused, no route, unknown host)."""


class Truncated(ConnectionResetError):
    """The upstream closed the connection before the response ended."""


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.observer: StreamObserver | None = None
        self.done: asyncio.Future[int] | None = None
        self.status = 0
        self.content_type = b""
        self.framed = False  # Content-Length or Transfer-Encoding: else the body ends at close
        self.reusable = False
        self.last = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.last = perf_counter()
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # a broken response, or the observer itself
            cause = exc.__cause__ or exc.__context__
            self._fail(cause if isinstance(cause, Exception) else exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self.pool.forget(self)
        if exc is None and self.done is not None and self.status and not self.framed:
            self.on_message_complete()  # a body without length ends where the connection does
            self.reusable = False
            return
        self._fail(exc or Truncated("the upstream closed the connection"))

    # -- httptools callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value
        elif name in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.observer is not None:
            self.observer.open(self.status, self.content_type.decode("latin-1"), self.last)

    def on_body(self, body: bytes) -> None:
        if self.observer is not None:
            self.observer.feed(body, self.last)

    def on_message_complete(self) -> None:
        self.reusable = self.parser.should_keep_alive()
        if self.observer is not None:
            self.observer.end_of_stream(perf_counter())
        done, self.done, self.observer = self.done, None, None
        self._stop_timer()
        if done is not None and not done.done():
            done.set_result(self.status)

    # -- one exchange --------------------------------------------------------------------

    def send(self, request: bytes, observer: StreamObserver) -> asyncio.Future[int]:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.observer, self.status, self.content_type = observer, 0, b""
        self.framed = False
        self.done = loop.create_future()
        self.reusable = False
        self.last = perf_counter()
        self.timer = loop.call_later(self.pool.timeout, self._check_silence)
        self.transport.write(request)
        return self.done

    def _check_silence(self) -> None:
        silent = perf_counter() - self.last
        if silent >= self.pool.timeout:
            self._fail(TimeoutError(f"no data for {self.pool.timeout:g}s"))
            self.close()
        else:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.pool.timeout - silent, self._check_silence)

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fail(self, exc: Exception) -> None:
        done, self.done, self.observer = self.done, None, None
        self._stop_timer()
        self.reusable = False
        if done is not None and not done.done():
            done.set_exception(exc)

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to one host:port; `request` runs one exchange."""

    def __init__(
        self,
        url: yarl.URL,
        timeout: float,
        connect_timeout: float = 10.0,
        uds: str | None = None,
    ) -> None:
        self.uds = uds  # --uds: every connection to this Unix socket instead of host:port
        self.host = url.host or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if url.scheme == "https" else None
        )
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            opening = (
                loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self.ssl
                )
                if self.uds is None
                else loop.create_unix_connection(lambda: _Connection(self), self.uds)
            )
            _, conn = await asyncio.wait_for(opening, self.connect_timeout)
        except TimeoutError:
            raise
        except OSError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        self.open.add(conn)
        return conn

    def forget(self, conn: _Connection) -> None:
        self.open.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)

    async def request(self, head: bytes, body: bytes, observer: StreamObserver) -> int:
        """Send one request (`head` ends with the blank line); the status, once the
        response ended. Raises what the exchange failed with."""
        reused = bool(self.idle)
        conn = self.idle.pop() if reused else await self._connect()
        try:
            status = await conn.send(head + body, observer)
        except Truncated:
            conn.close()
            if not reused or conn.status:
                raise
            # The server closed a kept-alive connection as the request went out on it,
            # before its answer's head: it never took the request (llama.cpp's server
            # closes after every stream though its head says Keep-Alive). Once more, anew.
            conn = await self._connect()
            try:
                status = await conn.send(head + body, observer)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            conn.close()
            raise
        if conn.reusable:
            self.idle.append(conn)
        else:
            conn.close()
        return status

    def close(self) -> None:
        for conn in list(self.open):
            conn.close()
        self.open.clear()
        self.idle.clear()


def request_head(url: yarl.URL, headers: dict[str, str], length: int) -> bytes:
    """The request line and headers of a POST to `url` with a body of `length` bytes."""
    target = url.raw_path_qs or "/"
    host = url.raw_host or ""
    if url.port is not None and not url.is_default_port():
        host = f"{host}:{url.port}"
    lines = [f"POST {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {length}"]
    lines += [
        f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("host", "content-length")
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


__all__ = ["ConnectFailed", "Pool", "Truncated", "request_head"]
