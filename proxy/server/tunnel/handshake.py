"""The opening handshake: which requests are one, what goes upstream, what comes back.

- `is_websocket_upgrade`: the one check both data paths make (RFC 6455 §4.1).
- `admit`: the handshake to send upstream. The request target is normalised as the HTTP
  relay normalises it (proxy/server/admission.py `target`; one that cannot be raises its
  `Refused(400, "invalid_request_target")`) and put under the upstream's base path
  (proxy/core/upstream_url.py, the one parse); the Host line is the upstream's authority,
  the client's headers pass the HTTP relay's policy (`handshake_headers`: hop-by-hop
  headers, those Connection names and Proxy-Authorization stop here; Sec-WebSocket-Key,
  -Version, -Protocol, -Extensions, Origin... pass as sent).
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
    a 101's head and the frames after it go on as they came. An interim (1xx) head goes
    on at once and the next is held; a head over MAX_ANSWER_HEAD goes on as it is.

    Each whole head is read by llhttp before it goes (`HeadJudge`): one it refuses goes
    nowhere (`fault` says why, and nothing more passes), so the proxy can still answer
    the client the 502 an HTTP request gets for it; relayed first, its answer would be
    too late and the client would hold a head no parser takes."""

    __slots__ = ("_ends", "_held", "_judge", "done", "fault")

    def __init__(self, ends: tuple[bytes, bytes] | None) -> None:
        """`ends`: `redirected`'s (proxy/server/headers.py `redirect_ends`), None when the
        client named no Host (nothing to point at)."""
        self._ends = ends
        self._held = b""
        self._judge = HeadJudge()
        # The final head went on (or bytes past MAX_ANSWER_HEAD did): the gate is no
        # longer needed, and the client's answer has begun (1xx heads before it have not).
        self.done = False
        self.fault: str | None = None  # a head llhttp refused, in the wire's words

    def __call__(self, data: bytes) -> bytes:
        if self.fault is not None:
            return b""
        held = self._held + data
        out: list[bytes] = []
        while not self.done:
            end = held.find(b"\r\n\r\n")
            if end < 0:
                if len(held) > MAX_ANSWER_HEAD:  # UpstreamAnswer ends such a tunnel
                    self.done = True
                    break
                self._held = held
                return b"".join(out)
            head, held = held[: end + 4], held[end + 4 :]
            self.fault = self._judge.judge(head)
            if self.fault is not None:
                self._held = b""
                return b"".join(out)  # the 1xx heads before it, already judged
            status = head[9:12]
            if status[:1] != b"1" or status == b"101":
                self.done = True
                if status != b"101" and self._ends is not None:
                    head = _located(head, self._ends)
            out.append(head)
        self._held = b""
        out.append(held)
        return b"".join(out)


class HeadJudge:
    """llhttp reading the answer's heads only, one after another, before they go to the
    client: `judge` gives the wire's words for one it refuses ("malformed response:
    Invalid character in Content-Length", proxy/server/wire/upstream.py `broke`), None
    for one it takes. What follows the final head is UpstreamAnswer's to read."""

    __slots__ = ("_parser", "_status")

    def __init__(self) -> None:
        self._status = 0
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)

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

    def on_headers_complete(self) -> None:
        parser = self._parser
        self._status = parser.get_status_code() if parser is not None else 0


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
