"""One request's rules, sans I/O: events in, decisions out, for both data paths.

The wire (proxy/server/wire/connection.py) and the ASGI relay (proxy/server/forward.py)
each create one `ExchangeRules` at a request's head and hand it the request's events; it
says what to do, and they only carry that out with their own I/O (transport writes on the
wire, ASGI messages and httpx in the relay). No socket, task or clock in here: the time
comes in as an argument, as the observer's does.

| event | method | decision |
|---|---|---|
| the head (method, normalised target, headers) | the constructor | `refusal` (400 a target that cannot be normalised, 431 headers too large, 413 a declared body over --max-body-bytes), the API seam (`api`) |
| a piece of the body | `body` | the refusal (413) once it passes --max-body-bytes |
| the body did not come in --body-timeout | `refuse(BODY_TIMEOUT)` | 408 |
| a refusal's answer goes out | `refusal_closes` | whether the connection closes after it (the body still owed, or a 100 Continue awaited) |
| a refusal answered, a client gone before its body was in | `refused`, `abandoned` | the record or count |
| the drain's end before the request went upstream: its body still coming in / pipelined, its turn not come | `shut_out` / `turn_lost` | the 503 (`Failure.answer`), `Ending.CLOSE`, and its record / a record of no answer (status 0) |
| the whole body | `admit` | `UpstreamRequest`: the target upstream (the upstream's base path in front), the headers that go, the body (usage asked for); a GET of a background Response whose tokens are still to count is read too (proxy/core/background.py) |
| the upstream's response head | `response_head` | `ClientHead`: the headers the client gets, and whether the body is stripped (only an event stream is) |
| an early end (client gone, a timeout, a break, shutdown) | `early_end` | a `Failure`: the proxy's answer while no head went out, and how the connection ends (`Failure.ending`, below); a client gone while the usage stripper held an event back did not get all the observer read (`MeasuredExchange.withheld`) |
| the connection is dropped mid-body | `held` | what the usage stripper holds that the client still gets, before the drop |

How the client's connection ends after an early end is decided with the failure
(proxy.core.errors.relay_failure) and only carried out by each path: the wire on its
transport (`WireRequest._end_connection`), the ASGI relay through the answer's
Connection header, `UpstreamBroke` and the ANSWER_CUT extension (forward.py).

| cause | before the response head | after it |
|---|---|---|
| CLIENT_GONE | `GONE`: nothing to answer | `GONE` |
| FIRST_BYTE_TIMEOUT | `KEEP`: the 504, the connection kept as the client asked | (only before) |
| UPSTREAM_BROKE | `KEEP`: the 502 or 504 | `CUT`: dropped, the requests pipelined behind lost to the upstream (LostTurn.CUT) |
| IDLE_TIMEOUT | (only after) | `CUT` |
| CLIENT_STALLED | (only after) | `ABORT`: closed at once, the unsent bytes thrown away (a close would wait for good on a client that takes none) |
| SHUTDOWN (and `shut_out`) | `CLOSE`: the 503 says Connection: close | `DROP`: dropped, the client sees the break |

`Stage` names where a request is, so neither path keeps flags whose combinations mean a
state. What is measured, and the one finish sequence, belong to the `MeasuredExchange`
that `admit` opens (proxy/server/exchange.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

from proxy.core.apis import Api
from proxy.core.background import retrieval
from proxy.core.errors import Cause, Ending, Failure, LostTurn, relay_failure
from proxy.core.measurement import ErrorType
from proxy.core.paths import Target, under_root
from proxy.core.strip import UsageEventStripper
from proxy.server.admission import (
    BODY_TIMEOUT,
    Refused,
    admit,
    body_too_large,
    check_head,
    count_refusal,
    measured_api,
)
from proxy.server.exchange import Context, MeasuredExchange
from proxy.server.headers import Headers, client_headers, redirect_ends, redirected

_EVENT_STREAM = b"text/event-stream"
#: The endings after which the client still gets what the stripper holds (`held`).
_HANDS_OVER = frozenset({Ending.DROP, Ending.CUT})


class Stage(Enum):
    RECEIVING = "receiving"  # the head is admitted; the body is coming in
    REFUSED = "refused"  # the proxy answers itself; the rest of the body is dropped
    UPSTREAM = "upstream"  # admitted and sent upstream: waiting for the response head
    RESPONDING = "responding"  # the response head went to the client
    DONE = "done"  # ended early; what ended cleanly is the data path's to say


# Plain slotted dataclasses, built once a request: a frozen one's __init__ goes through
# object.__setattr__ field by field (2.4 µs against 0.25 for these three fields, timeit).
@dataclass(slots=True)
class UpstreamRequest:
    """What goes upstream: `target` is the upstream's base path + the normalised target."""

    target: str
    headers: Headers
    body: bytes


@dataclass(slots=True)
class ClientHead:
    """What the client gets of the upstream's response head."""

    headers: Headers  # the client's, with the header policy applied (proxy/server/headers.py)
    stripper: UsageEventStripper | None  # the body goes through it (the usage asked for)
    length: bool  # the upstream framed its body by Content-Length


class ExchangeRules:
    """One request's rules; `exchange` is its measuring once admitted."""

    __slots__ = (
        "api",
        "client",
        "context",
        "exchange",
        "headers",
        "method",
        "parts",
        "path",
        "query",
        "refusal",
        "route",
        "size",
        "stage",
        "start",
        "started_at",
        "stripper",
    )

    def __init__(
        self,
        context: Context,
        method: str,
        where: Target | Refused,
        raw_path: bytes,
        headers: Headers,
        start: float,
        started_at: float,
        client: str | None = None,
    ) -> None:
        """`where`: the request's normalised target, or the refusal of one that cannot be
        (admission.where_to: the data path decided on it whether the request is the
        proxy's own already); `client` the client's address (X-Forwarded-For)."""
        self.context, self.method, self.headers = context, method, headers
        self.client = client
        self.start, self.started_at = start, started_at
        self.api: Api | None = None
        self.exchange: MeasuredExchange | None = None
        self.stripper: UsageEventStripper | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.refusal: Refused | None = None
        self.stage = Stage.RECEIVING
        if isinstance(where, Refused):
            self.path, self.query = raw_path.decode("latin-1"), ""
            self.route = self.path
            self.refuse(where)
            return
        self.path, self.query = where.path, where.query
        # measured, labelled and keyed by the path the backend routes (after --root-path);
        # forwarded as sent
        self.route = under_root(self.path, context.settings.root_path)
        try:
            self.api = measured_api(method, self.route, context.backend.kind)
            check_head(headers, context.settings)
        except Refused as refusal:
            self.refuse(refusal)

    # -- the request ------------------------------------------------------------------

    def body(self, piece: bytes) -> Refused | None:
        """A piece of the request body: kept, or the refusal once the body passes
        --max-body-bytes. After a refusal the rest is dropped."""
        if self.stage is not Stage.RECEIVING:
            return None
        self.size += len(piece)
        limit = self.context.settings.max_body_bytes
        if self.size > limit:
            return self.refuse(body_too_large(limit))
        self.parts.append(piece)
        return None

    def refuse(self, refusal: Refused) -> Refused:
        """The proxy answers this request itself; nothing goes upstream."""
        self.stage, self.refusal, self.parts = Stage.REFUSED, refusal, []
        return refusal

    def refusal_closes(self, continue_owed: bool, body_whole: bool) -> bool:
        """Whether the refusal's answer ends the connection. After --body-timeout the rest
        of the body is still owed. A client still waiting for its 100 Continue
        (`continue_owed`: it asked, on HTTP/1.1, and none was sent) may keep its body
        back for good (RFC 9110 §10.1.1). Either way its next request would be read as
        the rest of this body, so the answer says the connection closes, as nginx's
        does after any 413. A client that sends its body unasked keeps its connection:
        the rest is read and dropped."""
        return self.refusal is BODY_TIMEOUT or (continue_owed and not body_whole)

    def refused(self) -> None:
        """The refusal was answered: a bare record for a measured API, else a count."""
        refusal = self.refusal
        assert refusal is not None
        self._count(refusal.status, ErrorType.BAD_REQUEST, refusal.message)

    def abandoned(self) -> None:
        """The client left before its request was all in (nothing went upstream)."""
        if self.stage is Stage.RECEIVING:
            self.stage = Stage.DONE
            self._count(0, ErrorType.CLIENT_CANCELLED)

    def shut_out(self) -> Failure:
        """The server's drain time ran out while the request's body was still coming in:
        its `answer` is the proxy's 503, after which the connection closes (Ending.CLOSE),
        recorded as any request the drain's end finds unanswered (upstream_error)."""
        failure = relay_failure(Cause.SHUTDOWN, after_headers=False)
        assert failure.answer is not None
        self.stage = Stage.DONE
        self._count(failure.answer[0], failure.error, failure.message)
        return failure

    def turn_lost(self, lost: LostTurn) -> None:
        """Pipelined behind another request, its turn never came: the connection closed
        first, for the reason `lost` gives. Nothing went out to it (status 0); recorded
        whether its body was still coming in or it was refused at its head."""
        if self.stage is Stage.RECEIVING or self.stage is Stage.REFUSED:
            self.stage = Stage.DONE
            self._count(0, *lost.recorded())

    def _count(self, status: int, error: ErrorType, message: str | None = None) -> None:
        context = self.context
        count_refusal(
            context.sinks, self.route, self.api, status, self.start, self.started_at, error, message
        )

    def admit(self, now: float) -> UpstreamRequest:
        """The body is in (at `now`, when the proxy's own time starts): the request as it
        goes upstream, measured from here by the exchange this opens."""
        context, parts = self.context, self.parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        self.parts = []
        info = None
        retrieves = None
        if self.api is not None:
            info, body, self.stripper = admit(
                self.api, body, context.settings, context.backend.kind, self.headers
            )
        elif self.method == "GET":
            # a background Response this process started whose tokens no answer counted
            # yet: read as its POST's answer would be, to count them once it is finished
            found = retrieval(context.background, self.route, self.query)
            if found is not None:
                info, retrieves = found
        exchange = self.exchange = MeasuredExchange(
            context,
            self.route,
            self.headers,
            info,
            self.start,
            self.started_at,
            now,
            self.query,
            self.client,
            retrieves,
        )
        self.stage = Stage.UPSTREAM
        target = context.upstream.target(self.path, self.query)
        return UpstreamRequest(target, exchange.upstream_headers(), body)

    # -- the response -----------------------------------------------------------------

    def response_head(self, status: int, headers: Headers, now: float) -> ClientHead:
        """The upstream's response head (lower-case names), read at `now`."""
        exchange = self.exchange
        assert exchange is not None, "a response head before the request went upstream"
        content_type = b""
        metadata: bytes | None = None
        length = encoded = located = False
        for name, value in headers:
            if name == b"content-type":
                content_type = value
            elif name == b"location":
                located = True
            elif name == b"content-length":
                length = True
            elif name == b"content-encoding":
                encoded = value.strip().lower() != b"identity"
            elif name == b"metadata":
                metadata = value
        exchange.open(status, content_type.decode("latin-1"), now, metadata)
        streamed = status < 400 and content_type.startswith(_EVENT_STREAM)
        if encoded:
            # Compressed though a measured request asks for identity: the body goes to the
            # client as it comes, and nothing in it can be read (no event to time, no
            # usage to strip): unmeasured, counted, never judged truncated. A stream the
            # proxy asked usage of then brings the client that usage chunk: asking that
            # upstream stops (Injection.leaked), so it happens once. Only on a stream:
            # a gateway that compresses its JSON answers alone (nginx's gzip_types), an
            # error's say, leaks nothing, and its streams are still asked.
            if self.stripper is not None and streamed:
                self.stripper.encoded()
            self.stripper = None
            if exchange.measuring:
                exchange.observer_failed("encoded")
        elif not streamed:
            # Only an event stream has a usage event to drop: any other body (a JSON
            # answer to a stream request, an error) passes whole. So does a stream sent
            # under another label (some gateways say application/json), which the
            # observer still measures as one (StreamObserver._sniff): this head, its
            # framing with it, goes out before the body's first bytes say what it is.
            # Then its client gets the usage chunk the proxy asked for, and asking that
            # upstream stops (Injection.leaked), as for a compressed stream.
            if self.stripper is not None and exchange.observer is not None:
                label = content_type.decode("latin-1") or "no Content-Type"
                exchange.observer.on_relabelled = functools.partial(
                    self.context.settings.injection.leaked, f"under {label}"
                )
            self.stripper = None
        self.stage = Stage.RESPONDING
        out = client_headers(headers, content_type, body_changes=self.stripper is not None)
        if status == 204 and length:  # RFC 9110 §8.6: never in a 204 (nginx clears it too)
            out, length = [(k, v) for k, v in out if k != b"content-length"], False
        if located:
            out = self._located(out)
        return ClientHead(out, self.stripper, length)

    def _located(self, headers: Headers) -> Headers:
        """A redirect into the upstream's URL, pointed at the proxy as the client named it
        (a path on it when the client named no Host)."""
        tls = bool(self.context.settings.ssl_certfile)
        return redirected(headers, *redirect_ends(self.context.upstream, tls, self.headers))

    def early_end(self, cause: Cause, exc: BaseException | None = None) -> Failure:
        """The relay stops early. The failure's `answer`, when set, is what the client gets
        (no response head went out yet); its `ending`, how the client's connection ends."""
        exchange = self.exchange
        assert exchange is not None, "an early end before the request went upstream"
        failure = exchange.failure(cause, exc)
        if failure.answer is not None:
            exchange.status = failure.answer[0]
        elif failure.ending is Ending.GONE and self._withholds():
            exchange.withheld = True
        self.stage = Stage.DONE
        return failure

    def _withholds(self) -> bool:
        """Whether the usage stripper holds a whole event, which the observer has read and
        the client was never given: a finish chunk that waited for the usage chunk
        (`UsageEventStripper.withholds`). Half an event is no part of what the observer
        read: its decoder holds the same bytes unread."""
        stripper = self.stripper
        return stripper is not None and stripper.withholds()

    def held(self, failure: Failure) -> bytes:
        """After an early end (`early_end`'s failure): the bytes of the body the usage
        stripper still holds that the client gets, after what it got and before its
        connection is dropped: a terminal chunk that waited for the usage chunk, and
        what came of the next event (UsageEventStripper.at_break). Direct, the client
        gets every byte up to the break; so it does here, less the usage it never
        asked for. Only for a drop mid-body (Ending.DROP, CUT: the upstream broke or
        went silent, the drain's end): a client that left takes nothing, and a stalled
        one's connection is aborted with what it did not take."""
        stripper = self.stripper
        if stripper is None or failure.ending not in _HANDS_OVER:
            return b""
        return stripper.at_break()
