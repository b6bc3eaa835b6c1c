"""The opening handshake: which requests are one, what goes upstream, what comes back.

- `is_websocket_upgrade`: the one check both data paths make (RFC 6455 §4.1).
- `admit`: the handshake to send upstream. The request target is normalised as the HTTP
  relay normalises it (proxy/server/admission.py `target`; one that cannot be raises its
  `Refused(400, "invalid_request_target")`) and put under the upstream's base path
  (proxy/core/upstream_url.py, the one parse); the Host line is the upstream's authority,
  the client's headers pass the HTTP relay's policy (`handshake_headers`: hop-by-hop
  headers, those Connection names and Proxy-Authorization stop here; Sec-WebSocket-Key,
  -Version, -Protocol, -Extensions, Origin... pass as sent).
- `AnswerHead`: the gate on the upstream's answer until it switches: each head whole
  and judged by llhttp before it goes (`AnswerReader`), a refusal's body only up to its
  end (what follows is no answer to anything the client asked).
- `UpstreamAnswer`: the upstream's response head, read on the side of the bytes that
  already went to the client: its status, a 101's extensions, where the frames begin,
  and the end of a refusal's body.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import httptools

from proxy.core.errors import MAX_ERROR_BODY
from proxy.core.paths import Target
from proxy.core.upstream_url import UpstreamURL
from proxy.server.admission import Refused, target
from proxy.server.headers import handshake_headers, redirected

Headers = list[tuple[bytes, bytes]]


def is_websocket_upgrade(
    method: bytes, headers: Sequence[tuple[bytes, bytes]], *, http_11: bool = True
) -> bool:
    """A well-formed WebSocket opening handshake (RFC 6455 §4.1): a GET on HTTP/1.1 with
    `Upgrade: websocket`, `Connection: upgrade`, one Sec-WebSocket-Key that is 16 bytes
    in base64, `Sec-WebSocket-Version: 13`, and no body. The one request either data path
    tunnels (the ASGI relay refuses it itself); anything else asking to upgrade (h2c, a
    POST with `Upgrade: websocket`, a handshake with a body) is an ordinary request, its
    Upgrade dropped as hop-by-hop."""
    if method != b"GET" or not http_11:
        return False
    upgrade = connection = False
    keys: list[bytes] = []
    version = b""
    for name, value in headers:
        lower = name.lower()
        if lower == b"upgrade":
            upgrade = upgrade or b"websocket" in _tokens(value)
        elif lower == b"connection":
            connection = connection or b"upgrade" in _tokens(value)
        elif lower == b"sec-websocket-key":
            keys.append(value.strip())
        elif lower == b"sec-websocket-version":
            version = value.strip()
        elif lower == b"transfer-encoding" or (
            lower == b"content-length" and value.strip() != b"0"
        ):
            return False
    return upgrade and connection and version == b"13" and len(keys) == 1 and _nonce(keys[0])


def _nonce(key: bytes) -> bool:
    try:
        return len(base64.b64decode(key, validate=True)) == 16
    except binascii.Error:
        return False


def _tokens(value: bytes) -> list[bytes]:
    return [token.strip().lower() for token in value.split(b",")]


@dataclass(frozen=True, slots=True)
class Admitted:
    """An admitted handshake: what goes upstream, and what the session is labelled by."""

    request: bytes  # the handshake head to send upstream
    path: str  # the normalised path (no query): the WsApi and the error body's shape
    query: str
    headers: Headers  # the client's, names in lower case (the key label reads them)


def admit(
    method: bytes,
    request_target: bytes,
    raw_headers: Iterable[tuple[bytes, bytes]],
    upstream: UpstreamURL,
    client: str | None = None,
    where: Target | Refused | None = None,
) -> Admitted:
    """The handshake to send upstream for a head `is_websocket_upgrade` accepted, as the
    wire's llhttp parsed it (no second split of the head's bytes); raises `Refused` for a
    target that cannot be normalised (admission.target, the HTTP relay's one rule).
    `where`: the target as the wire normalised it already at the head (parsed once);
    None to read `request_target` here as the HTTP relay reads it (`httptools.parse_url`):
    an absolute form's path and query (RFC 9112 §3.2.2), never a fragment."""
    if where is None:
        try:
            url = httptools.parse_url(request_target)
        except httptools.HttpParserInvalidURLError:
            raise Refused(400, "invalid_request_target", "the request target is no URL") from None
        where = target(url.path or b"/", url.query or b"")
    if isinstance(where, Refused):
        raise where
    parsed = where
    headers = [(name.lower(), value) for name, value in raw_headers]
    out = [
        b"%s %s HTTP/1.1\r\nhost: %s\r\n"
        % (method, upstream.target(parsed.path, parsed.query).encode(), upstream.authority)
    ]
    out.extend(b"%s: %s\r\n" % pair for pair in handshake_headers(headers, client))
    out.append(b"\r\n")
    return Admitted(b"".join(out), parsed.path, parsed.query, headers)


#: A 101's status line, at the start of a read or of a line (a head's first line).
_STATUS_101 = re.compile(rb"(?:^|(?<=\n))HTTP/\d\.\d 101")

#: The longest head of the upstream's answer to a handshake the proxy reads (nginx's
#: proxy_buffer_size is 4 or 8 KiB; an answer's head is some 200 bytes).
MAX_ANSWER_HEAD = 64 * 1024


class AnswerHead:
    """The upstream's answer to the handshake held until its head is whole (a pipe's
    `gate`): a refusal's redirect into the upstream's URL then points at the proxy as
    the client named it, as the HTTP relay's does (nginx's `proxy_redirect default`);
    a 101's head and the frames after it go on as they came (`released`: the gate is no
    longer needed). An interim (1xx) head goes on at once and the next is held; a head
    over MAX_ANSWER_HEAD goes on as it is, and what follows it.

    Each whole head is read by llhttp before it goes (`AnswerReader`): one it refuses
    goes nowhere (`fault` says why, and nothing more passes), so the proxy can still
    answer the client the 502 an HTTP request gets for it; relayed first, its answer
    would be too late and the client would hold a head no parser takes.

    A refusal (any other final status) goes on as llhttp reads it, as the wire relays an
    HTTP response: its head as sent but for `connection: close` (the proxy closes the
    connection after it, whatever the upstream would), then its body up to its end, a
    chunked one framed anew (its trailers dropped, as both relays drop them). Bytes
    after that end (a second response in the same read: the answer to a request
    pipelined behind the handshake, which never went upstream) reach no client:
    `past_end` is called, once, and its owner counts them as the wire counts bytes after
    an HTTP response's end (`extra_bytes`). None of this runs after a 101."""

    __slots__ = ("_ends", "_held", "_past_end", "_reader", "_told", "done", "fault", "released")

    def __init__(
        self, ends: tuple[bytes, bytes] | None, past_end: Callable[[], None] = lambda: None
    ) -> None:
        """`ends`: `redirected`'s (proxy/server/headers.py `redirect_ends`), or None to
        leave a refusal's Location as it came. `past_end`: bytes came after a refusal's
        end, and were dropped."""
        self._ends = ends
        self._past_end = past_end
        self._told = False  # past_end was called
        self._held = b""
        self._reader = AnswerReader()
        # The final head went on (or bytes past MAX_ANSWER_HEAD did): the client's answer
        # has begun (1xx heads before it have not).
        self.done = False
        # A 101 went on (or bytes past MAX_ANSWER_HEAD did): the rest goes as it comes.
        self.released = False
        self.fault: str | None = None  # a head llhttp refused, in the wire's words

    def __call__(self, data: bytes) -> bytes:
        if self.released:  # its owner drops a released gate: nothing to hold
            return data
        if self.fault is not None:
            return b""
        if self.done:  # a refusal's head went: its body, up to its end
            return self._body(data)
        held = self._held + data
        self._held = b""
        out: list[bytes] = []
        while True:
            end = held.find(b"\r\n\r\n")
            if end < 0:
                if len(held) > MAX_ANSWER_HEAD:  # UpstreamAnswer ends such a tunnel
                    self.done = self.released = True
                    out.append(held)
                else:
                    self._held = held
                return b"".join(out)
            head, held = held[: end + 4], held[end + 4 :]
            self.fault = self._reader.judge(head)
            if self.fault is not None:
                return b"".join(out)  # the 1xx heads before it, already judged
            status = head[9:12]
            if status == b"101":
                self.done = self.released = True
                out += (head, held)
                return b"".join(out)
            if status[:1] != b"1":  # a refusal: its head, and its body as far as it came
                self.done = True
                if self._ends is not None:
                    head = _located(head, self._ends)
                out += (_closing(head), self._body(held))
                return b"".join(out)
            out.append(head)

    def _body(self, data: bytes) -> bytes:
        reader = self._reader
        out = reader.body(data)
        if reader.past_end and not self._told:
            self._told = True
            self._past_end()
        return out


class _PastTheEnd(Exception):
    """A message began after the refusal's end: llhttp is stopped there."""


class AnswerReader:
    """llhttp reading the answer before it goes to the client (AnswerHead's): `judge`
    reads each head, one after another, and gives the wire's words for one it refuses
    ("malformed response: Invalid character in Content-Length", proxy/server/wire/
    upstream.py `broke`), None for one it takes; past a refusal's head, `body` reads
    its body and gives what of each read goes to the client. After a 101 it reads
    nothing: the frames are UpstreamAnswer's to find."""

    __slots__ = ("_chunked", "_out", "_parser", "_status", "ended", "past_end")

    def __init__(self) -> None:
        self._status = 0
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._out: list[bytes] = []  # what of the read being parsed goes to the client
        self._chunked = False  # the body is chunked: each piece is framed anew
        self.ended = False  # the refusal's message ended (llhttp's on_message_complete)
        self.past_end = False  # and bytes came after its end

    def judge(self, head: bytes) -> str | None:
        parser = self._parser
        if parser is None:  # past a 101: never asked (the gate is gone)
            return None
        try:
            parser.feed_data(head)
        except httptools.HttpParserUpgrade:
            self._parser = None
        except httptools.HttpParserError as exc:
            self._parser = None
            # llhttp stops after any 101, an "error" when it came without `Connection:
            # upgrade`: the switch all the same (UpstreamAnswer.feed reads it so).
            if self._status != 101:
                return f"malformed response: {exc}"
        return None

    def body(self, data: bytes) -> bytes:
        """What of `data`, read past a refusal's head, goes to the client: the body's
        bytes as llhttp reads them, up to its end (a length's, the last chunk's, or the
        connection's). Bytes llhttp refuses in the body stop it (UpstreamAnswer, reading
        the same bytes, ends the tunnel on them); any after the end set `past_end`."""
        parser = self._parser
        if parser is None or not data:
            return b""
        out: list[bytes] = []
        self._out = out
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            # past the end: a message that began (on_message_begin stopped it), bytes no
            # message starts with, or any after a `Connection: close` answer's end
            self._parser = None
            self.past_end = self.ended
        return b"".join(out)

    # -- httptools callbacks --

    def on_message_begin(self) -> None:
        if self.ended:
            raise _PastTheEnd

    def on_headers_complete(self) -> None:
        parser = self._parser
        self._status = parser.get_status_code() if parser is not None else 0

    def on_chunk_header(self) -> None:
        self._chunked = True

    def on_body(self, body: bytes) -> None:
        # framed as the wire frames a client's chunked body (proxy/server/wire/upstream.py
        # frame_chunk, LAST_CHUNK: not imported, the wire imports the tunnel)
        self._out.append(b"%x\r\n%b\r\n" % (len(body), body) if self._chunked else body)

    def on_message_complete(self) -> None:
        if self._status >= 200:  # a 1xx is followed by more
            self.ended = True
            if self._chunked:
                self._out.append(b"0\r\n\r\n")


def _closing(head: bytes) -> bytes:
    """The head with `connection: close` as its first field, unless a Connection field
    says so already: the proxy closes the connection after a refusal, and a client that
    pipelined a request behind the handshake learns it was never answered."""
    lines = head.split(b"\r\n")
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if colon and name.strip().lower() == b"connection" and b"close" in _tokens(value):
            return head
    first = head.index(b"\r\n") + 2
    return head[:first] + b"connection: close\r\n" + head[first:]


def _located(head: bytes, ends: tuple[bytes, bytes]) -> bytes:
    """The head with its Location pointed at the proxy when it points into the upstream."""
    lines = head.split(b"\r\n")
    for i, line in enumerate(lines[1:], 1):
        name, colon, value = line.partition(b":")
        if colon and name.strip().lower() == b"location":
            ((_, value),) = redirected([(b"location", value.strip())], *ends)
            lines[i] = name + b": " + value
    return b"\r\n".join(lines)


class UpstreamAnswer:
    """httptools reading the upstream's answer to the handshake, after its bytes went to
    the client. `feed` returns the bytes after a 101's head once the head is complete
    (the tunnel opens: they are frames); a final status's body ending calls `refused`.
    Bytes that are not HTTP the proxy can follow stop the reading, and `fault` says why
    in the wire's words: the tunnel ends on them, as the wire closes such a connection
    (a refused head never reached the client: AnswerHead held it)."""

    __slots__ = (
        "_begun",
        "_carry",
        "_extensions",
        "_head",
        "_parser",
        "_refused",
        "body",
        "extensions",
        "fault",
        "status",
    )

    def __init__(self, refused: Callable[[], None]) -> None:
        self.status = 0  # the last response head's status (a 1xx is followed by more)
        self.extensions: str | None = None  # a 101's Sec-WebSocket-Extensions
        self.fault: str | None = None  # bytes llhttp refused, as the wire words them
        # A final answer's body, its first MAX_ERROR_BODY bytes: what a refusal says
        # (proxy/core/errors.py classify_response reads no more of an HTTP error's).
        self.body = bytearray()
        self._refused = refused
        self._extensions: list[bytes] = []
        self._head = 0  # bytes read of the current head, -1 once it is complete
        self._begun = False  # a head began in the read being parsed
        self._carry = b""  # the last read's last 3 bytes: a head's end may straddle reads
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)

    def feed(self, data: bytes) -> bytes | None:
        parser = self._parser
        if parser is None:
            return None
        self._begun = False
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._parser = None
            if self.status == 101:
                offset = exc.args[0] if exc.args else len(data)
                return data[offset:]
            # an Upgrade header on a final response: not a tunnel
        except httptools.HttpParserError as exc:
            self._parser = None
            if self.status == 101:
                # llhttp stops after every 101, but httptools calls that an upgrade only
                # when `Connection: upgrade` came with it. The 101 went to the client all
                # the same: it is the switch, as nginx takes any 101, and the tunnel opens
                # (else the upstream's frames reach the client and the client's never go).
                return data[self._after_switch(data) :]
            # Not HTTP the proxy can follow: its owner ends the tunnel (the client's bytes
            # stay held: the upstream never switched).
            self.fault = f"malformed response: {exc}"
            return None
        finally:
            self._carry = (self._carry + data)[-3:]
        if self._head >= 0:  # the read left a head unfinished
            self._head += len(data)
            if self._head > MAX_ANSWER_HEAD:
                # httptools joins a header's value across reads: an endless one would grow
                # without bound, at a quadratic cost. Such an upstream is answered as a
                # refusal: the tunnel ends (what it sent went to the client as it came).
                self._parser = None
                self._refused()
        return None

    def _after_switch(self, data: bytes) -> int:
        """Where the 101's head, completed in this read, ends in `data`: at the first blank
        line after its status line (llhttp takes CRLF only). One that began in this read
        follows any 1xx heads before it, and the blank lines llhttp skips between heads;
        one that began before ends at the first CRLF CRLF, which may straddle the reads."""
        if self._begun:
            status = _STATUS_101.search(data)
            end = data.find(b"\r\n\r\n", status.start() if status is not None else 0)
            return len(data) if end < 0 else end + 4  # (never: llhttp read that end)
        seen = self._carry + data
        end = seen.find(b"\r\n\r\n")
        return len(data) if end < 0 else max(0, end + 4 - len(self._carry))

    # -- httptools callbacks --

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"sec-websocket-extensions":
            self._extensions.append(value)

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code() if parser is not None else 0
        extensions = b", ".join(self._extensions).decode("latin-1") if self._extensions else None
        self._extensions = []
        self.status = status
        self._head = -1
        if status == 101:
            self.extensions = extensions

    def on_message_begin(self) -> None:
        self._head = 0  # a 1xx is followed by another head
        self._begun = True

    def on_body(self, body: bytes) -> None:
        room = MAX_ERROR_BODY - len(self.body)
        if room > 0 and self.status >= 200:
            self.body += body[:room]

    def on_message_complete(self) -> None:
        if self.status >= 200:  # a refusal's body has ended (a 1xx is followed by more)
            self._refused()
