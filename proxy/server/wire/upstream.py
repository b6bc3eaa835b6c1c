"""The wire's upstream side: keep-alive connections to the backend and the per-chunk path.

`UpstreamConnection` is one connection, parsing responses with llhttp (httptools). Each
upstream read is handled in `data_received`, in one callback: the parser calls `on_body`
for each body piece, which writes it to the client's transport at once (re-framed for
the client) and then hands it to the exchange with the time of the read. No task, no
await, no ASGI message per chunk. Backpressure is the transports': a full client buffer
pauses reading this connection (`pause`/`resume`, driven by the client's
`pause_writing`/`resume_writing`). The other way holds nothing up: a backend slow to read
a request body leaves the body in this connection's buffers, and the client is read on
meanwhile (the wire sends a request only once its whole body is in, so what the client
sends then is a request pipelined behind, which the pipelining rules bound:
proxy/server/protocol.py), so a client that leaves is seen at once. It once paused the
client too: a 16 MiB upload's client, gone after a second, went unseen for 75 s, the
backend reading the whole body.

A connection given up on before its answer was whole while it still owes the backend
bytes of the request (the client left, or the first byte timed out, while the body went
out) is reset (`abandon`, proxy/server/backlog.py's `close_or_reset`), so the backend
learns of it at once. One closed after a whole answer (an answer before the body was
read: `release`) closes as ever, the rest of the body sent to a backend that is done.

`Pool` keeps idle connections, newest first, and drops one idle longer than
`KEEPALIVE_SECONDS` (uvicorn, vLLM's server, closes them after 5 s; reusing one it just
closed fails a request). A connection goes back only after a response that ended cleanly
and that the upstream will keep alive; one that carried an abandoned, broken or
unfinished response is closed.

What a misbehaving upstream cannot do (issue 32): make one request's response, or part of
one, reach another request. A response's end does not put its connection back in the pool
from inside the read that ended it: it *settles* first (`loop.call_soon`), so the rest of
that read is parsed before any request can take the connection, and a pipelined request
started by that response's end gets another connection. Any message that begins while the
connection carries no request (llhttp's `on_message_begin`: the first byte of a second
response in the same read, or of anything on an idle pooled connection) closes it at once
(`UpstreamProtocolError`, counted in `tokenprobe_upstream_protocol_errors_total{kind}`),
as does a 101 or a head llhttp refuses. None of this runs per chunk: `on_message_begin`
and `on_headers_complete` run once per message, the settling once per reuse.

What no proxy can tell apart: bytes an upstream sends late, once the next request went
out on the reused connection, are that request's answer as far as HTTP/1.1 can say. The
answers that by their nature invite a broken server to send a body (a HEAD's, whatever its
framing says; a 204; a 304; one after a 1xx) are rare in LLM traffic, so their connection
is never pooled: closed after the answer (`release`; a HEAD's request says so, the heads
of the others set `invites_a_body`, once per message). A HEAD request's answer ends at
its head, which llhttp cannot be told (httptools has no way to skip a body): the rest of
that read is no request's (`ended_at_head`).

A chunked body's trailer section is dropped, and bounded as the head is (MAX_RESPONSE_HEAD):
llhttp joins a trailer field's value across reads as it does a header's, so an endless one
would grow without bound at a quadratic cost, stalling every stream on the loop. Over the
bound the upstream is malformed (counted, the connection closed, never pooled); the body
itself came whole if a trailer field did, since trailers follow the last chunk: the client
then gets its last chunk and the exchange is measured complete, as the ASGI relay, which
drops trailers unread, delivers it (`trailers_over_bound`). Over the bound before any
trailer field the bytes may as well be a chunk's endless extensions: the body is cut (no
last chunk). llhttp tells no chunk's size (its `on_chunk_header` would be one more call per
chunk), so the bound is on the bytes of consecutive reads that brought no body data, which
in a well-formed response are only framing (a size line, a CRLF) a few bytes long: per
body piece one store (`data_at`), per read one comparison, false when the read had data.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from time import monotonic, perf_counter
from typing import Protocol

import httptools

from proxy.core.errors import fault_words
from proxy.core.upstream_url import UpstreamURL
from proxy.server.backlog import close_or_reset
from proxy.server.dial import dial
from proxy.server.headers import Headers
from proxy.server.protocol import (
    HEAD_OVER_BOUND,
    MAX_RESPONSE_HEAD,
    header_line_bytes,
    refused_transfer_encoding,
)
from proxy.server.upstream import KEEPALIVE_SECONDS
from proxy.server.upstream_errors import UpstreamProtocolError


class WireRequest(Protocol):
    """What a connection tells the request it carries (proxy/server/wire/connection.py)."""

    def response_head(self, status: int, headers: Headers, now: float) -> None: ...
    def response_end(self, now: float, reusable: bool) -> None: ...
    def upstream_lost(self, exc: Exception | None) -> None: ...
    def upstream_broke(self, exc: BaseException) -> None: ...


#: Chunked framing (RFC 9112 §7.1), the one writer of it: each piece the client gets of a
#: body the proxy re-frames, and the last chunk (no trailers).
LAST_CHUNK = b"0\r\n\r\n"


def frame_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _discard(data: bytes) -> None:
    pass


def _ignore(chunk: bytes, now: float) -> None:
    pass


def _past_the_end(chunk: bytes, now: float) -> None:
    """Body bytes after a response that ended at its head (see ended_at_head)."""
    raise UpstreamProtocolError("extra_bytes", "a body after a response to a HEAD request")


def reads_to_close(headers: Headers) -> bool:
    """A response framed by neither length nor chunks: its body ends with the connection.
    (A Transfer-Encoding here is `chunked` alone: any other is refused at the head,
    `refused_transfer_encoding`.)"""
    return not any(name in (b"content-length", b"transfer-encoding") for name, _ in headers)


#: The raw bytes of a head that reads have left unfinished, at most. The head's bound is
#: judged on its parsed lines (`on_header`, `header_line_bytes`), as the ASGI relay judges
#: it, however TCP split it; this only stops a line that never ends, which llhttp joins
#: across reads at a quadratic cost. Twice the bound leaves room for the status line,
#: the line ends and whitespace around values: a head of exactly 64 KiB of lines, whose
#: last CRLF came 0.3 s later, was a 502 on the wire only (a review).
_UNFINISHED_HEAD = 2 * MAX_RESPONSE_HEAD


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to the backend; carries one exchange at a time."""

    __slots__ = (
        "chunked",
        "codings",
        "data_at",
        "dry_bytes",
        "dry_since",
        "feed",
        "head_bytes",
        "header_bytes",
        "headers",
        "idle_since",
        "in_head",
        "interim",
        "invites_a_body",
        "lost",
        "now",
        "parser",
        "paused",
        "pool",
        "pooled",
        "request",
        "strip",
        "transport",
        "write",
    )

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpResponseParser(self)
        self.request: WireRequest | None = None
        self.headers: Headers = []
        self.codings: list[bytes] = []  # the head's Transfer-Encoding lines, judged together
        self.head_bytes = 0  # read of the response head so far
        self.header_bytes = 0  # its headers' names and values, as parsed
        self.in_head = True
        # The read (its `now`) that last brought body data, or the end of the head; the
        # bytes of the reads since, which brought none (framing, or trailers), and the
        # `data_at` they were counted from (see dry).
        self.data_at = 0.0
        self.dry_bytes = 0
        self.dry_since = 0.0
        self.interim = False  # a 1xx head: not the response yet
        # The answer invites a broken server's stray body: never pooled (release)
        self.invites_a_body = False
        self.lost = False
        self.paused = False
        self.pooled = False  # in the pool's idle list
        self.now = 0.0
        self.idle_since = 0.0
        # The per-chunk path's parts, set by the request at the response head.
        self.write: Callable[[bytes], None] = _discard
        self.chunked = False
        self.strip: Callable[[bytes], bytes] | None = None
        self.feed: Callable[[bytes, float], None] = _ignore

    def start(self, request: WireRequest, head: bytes) -> None:
        self.request, self.headers, self.in_head, self.interim = request, [], True, False
        self.invites_a_body = False
        self.head_bytes = self.header_bytes = 0
        self.codings.clear()  # (a head cut short closes its connection: empty already)
        self.now = 0.0  # until a byte of this request's answer arrives (`answered`)
        self.transport.write(head)

    # -- the hot path: one callback per upstream read ---------------------------------

    def data_received(self, data: bytes) -> None:
        self.now = perf_counter()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self.broke(exc)
            return
        if self.in_head and self.request is not None:  # the read left the head unfinished
            self.head_bytes += len(data)
            if self.head_bytes > _UNFINISHED_HEAD:
                # llhttp joins a header's value across reads: an endless one would grow
                # without bound, at a quadratic cost (nginx: "upstream sent too big header")
                self.broke(UpstreamProtocolError("malformed", HEAD_OVER_BOUND))
        elif self.data_at != self.now and self.request is not None:  # a read without data
            self.dry(len(data))

    def on_body(self, body: bytes) -> None:
        self.data_at = self.now
        out = body if self.strip is None else self.strip(body)
        if out:
            self.write(frame_chunk(out) if self.chunked else out)
        self.feed(body, self.now)

    # -- the rest of a response -------------------------------------------------------

    def dry(self, size: int) -> None:
        """A read of the body that brought none of its data: framing split across reads
        (a few bytes), or the trailer section after the last chunk, whose fields llhttp
        joins as it reads them. The reads since the last data are bounded as a head is."""
        if self.dry_since != self.data_at:  # data came since the last such read
            self.dry_since, self.dry_bytes = self.data_at, 0
        self.dry_bytes += size
        if self.dry_bytes > MAX_RESPONSE_HEAD:
            if self.header_bytes:  # a trailer field came, so the last chunk did
                self.broke(self.trailers_over_bound())
            else:
                self.broke(UpstreamProtocolError("malformed", "response framing over 64 KiB"))

    def trailers_over_bound(self) -> UpstreamProtocolError:
        """Trailers past the bound: the body is whole (they follow the last chunk), so the
        request ends as at the message's end, on a connection that is not reused; the
        error returned breaks (and counts) the connection, with no request left on it."""
        if self.request is not None:
            self.request.response_end(self.now, False)
        return UpstreamProtocolError("malformed", "response trailers over 64 KiB")

    def on_message_begin(self) -> None:
        if self.request is None:  # nothing asked for it
            if self.pooled:
                raise UpstreamProtocolError("idle_bytes", "a response on an idle connection")
            raise UpstreamProtocolError("extra_bytes", "bytes after the response's end")

    def broke(self, exc: BaseException) -> None:
        """The parser stopped: the connection closes, the request on it (if any) breaks."""
        cause = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else exc
        if isinstance(cause, UpstreamProtocolError):
            error: BaseException = cause
        elif isinstance(exc, httptools.HttpParserUpgrade):
            error = UpstreamProtocolError("upgrade", fault_words("unasked_switch"))
        elif isinstance(exc, httptools.HttpParserCallbackError):
            error = exc  # the proxy's own code failed in a callback: not the upstream's fault
        elif self.request is None:  # not a message start: bytes no request asked for
            kind = "idle_bytes" if self.pooled else "extra_bytes"
            error = UpstreamProtocolError(kind, f"bytes no request asked for: {exc}")
        else:
            error = UpstreamProtocolError("malformed", f"malformed response: {exc}")
        if isinstance(error, UpstreamProtocolError):
            self.pool.count(error.kind)
        request = self.request
        self.abandon()
        if request is not None:
            request.upstream_broke(error)

    def on_header(self, name: bytes, value: bytes) -> None:
        # The same bound on a head that came whole in one read as on one still coming
        # (data_received): what the client can be sent must not depend on how TCP split
        # the upstream's bytes. After the head: trailers, which neither data path relays,
        # under a bound of their own, the same.
        self.header_bytes += header_line_bytes(name, value)
        if self.header_bytes > MAX_RESPONSE_HEAD:
            if not self.in_head:
                raise self.trailers_over_bound()
            raise UpstreamProtocolError("malformed", HEAD_OVER_BOUND)
        if self.in_head:
            name = name.lower()
            if name == b"transfer-encoding":
                self.codings.append(value)  # judged once the head is in, all lines together
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status == 101:  # the wire never asks for a switch (WebSockets are the tunnel's)
            raise UpstreamProtocolError("upgrade", fault_words("unasked_switch"))
        if 100 <= status < 200:  # interim (103 Early Hints...): dropped, as httpx does
            self.interim = self.invites_a_body = True
            self.codings.clear()  # an interim head's lines frame nothing of the response
            # nor count against the final head's bound, as on the ASGI relay, whose
            # clients drop a 1xx before its head is judged
            self.head_bytes = self.header_bytes = 0
            return
        if not 200 <= status <= 599:  # llhttp reads any three digits: 099, 600, 999
            raise UpstreamProtocolError("malformed", fault_words("not_a_status", status=status))
        if self.codings:  # llhttp hands on the body still coded: `gzip, chunked`'s chunks,
            # or, for a last coding (`gzip`), the bytes up to the close; two lines
            # `chunked` are `chunked, chunked`, so each line alone proves nothing
            coded = refused_transfer_encoding(self.codings)
            self.codings.clear()
            if coded is not None:
                raise UpstreamProtocolError("malformed", coded)
        if status == 204 or status == 304:
            self.invites_a_body = True
        self.in_head = False
        self.header_bytes = 0  # the trailers' count, if any (on_header)
        self.data_at = self.now  # the head's read is no read without data (dry)
        if self.request is not None:
            self.request.response_head(status, self.headers, self.now)
            if self.request is None:  # it ended here: a HEAD's answer (release, from
                self.ended_at_head()  # response_end, let the request go)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim, self.headers = False, []
            return
        if self.request is not None:
            self.request.response_end(self.now, self.parser.should_keep_alive())

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        if self.request is not None:
            self.request.upstream_lost(exc)

    def ended_at_head(self) -> None:
        """The response ended at its head, as a HEAD request's does whatever its framing
        says (RFC 9112 §6.3, item 1), which llhttp cannot be told: it would go on to read
        the body that framing announces. The connection is closed already (a HEAD's
        answer is never pooled: `release`); the rest of this read (nothing, from a sound
        upstream) is no request's, and a body byte in it counts as one (`extra_bytes`),
        as at a message that begins unasked. Runs once per HEAD."""
        self.feed = _past_the_end

    # -- the request's side -----------------------------------------------------------

    @property
    def answered(self) -> bool:
        """A byte of the current request's answer arrived (`now` is its read's time)."""
        return self.now != 0.0

    def pause(self) -> None:
        if not self.paused and not self.lost:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def detach(self) -> None:
        """The response is over for the request: nothing more goes to its client, and the
        next response on the connection frames its own body (a bodiless one, HEAD's, a
        204's or a 304's, sets no framing and must not inherit a chunked one's)."""
        self.request = None
        self.write, self.strip, self.feed = _discard, None, _ignore
        self.chunked = False

    def release(self, reusable: bool) -> None:
        """The response ended. Called from inside this connection's read (the parser's
        `on_message_complete`), so a reusable connection settles before it is pooled:
        the rest of the read is parsed first, and no request starts on it from here.
        Whether it may be is decided here, once per response."""
        self.detach()
        self.resume()
        # A response that ended while the request was still being written (an early
        # answer, before the backend read the body) leaves the rest of that body on the
        # connection, where a next request would follow it: never reused (nginx keeps
        # none whose request body was not all sent). Nor one whose answer invites a
        # broken server's body: sent late, it would be the next request's answer.
        if (
            reusable
            and not self.invites_a_body
            and not self.lost
            and not self.transport.get_write_buffer_size()
        ):
            asyncio.get_running_loop().call_soon(self._settle)
        else:
            self.close()

    def _settle(self) -> None:
        """Back to the pool, unless something broke it since its response ended."""
        if self.request is None and not self.lost and not self.transport.is_closing():
            self.pool.put(self)

    def close(self) -> None:
        """Closed, after a whole answer (`release`) or idle (the pool)."""
        self.detach()
        if not self.lost:
            self.transport.close()

    def abandon(self) -> None:
        """Closed before the answer was whole (the client left, a timeout, a break), and
        reset where the backend has not taken all of the request yet (see the module's
        docstring): one look at the buffers per connection given up on."""
        self.detach()
        if not self.lost and not self.transport.is_closing():
            close_or_reset(self.transport)


def _uncounted(kind: str) -> None:
    pass


class Pool:
    """The backend's address and its idle keep-alive connections; `count` is told each
    upstream protocol error (Sinks.count_upstream_protocol_error)."""

    def __init__(
        self,
        upstream: UpstreamURL,
        connect_timeout: float,
        count: Callable[[str], None] = _uncounted,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.upstream = upstream
        self.host, self.port, self.authority = upstream.host, upstream.port, upstream.authority
        # the server's one upstream context (proxy.server.dial.upstream_tls), else the default
        self.ssl = (tls or ssl.create_default_context()) if upstream.tls else None
        self.connect_timeout = connect_timeout
        self.count = count
        self.idle: list[UpstreamConnection] = []
        self.closed = False  # the server stopped: a connection settling now is closed

    def take(self) -> UpstreamConnection | None:
        """The newest idle connection that is still fresh, else None."""
        idle = self.idle
        if idle:
            expired = monotonic() - KEEPALIVE_SECONDS
            while idle:
                conn = idle.pop()
                conn.pooled = False
                if conn.idle_since > expired and not conn.lost and not conn.transport.is_closing():
                    return conn
                conn.close()
        return None

    async def connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        _, conn = await dial(
            loop, lambda: UpstreamConnection(self), self.upstream, self.ssl, self.connect_timeout
        )
        return conn

    def put(self, conn: UpstreamConnection) -> None:
        if self.closed:
            conn.close()
            return
        conn.idle_since = monotonic()
        conn.pooled = True
        self.idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        if conn.pooled and conn in self.idle:  # closed while idle (by the backend, or broke)
            conn.pooled = False
            self.idle.remove(conn)

    def close(self) -> None:
        self.closed = True
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.pooled = False
            conn.close()
