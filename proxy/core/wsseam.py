"""The WebSocket API seam: what one WebSocket API measures from the messages of a session.

An HTTP API (proxy/core/apis) reads one request and one response; a WebSocket API reads a
session: messages both ways, each with the time of the network read that completed it.
The tunnel (proxy/server/tunnel/watch.py) opens a `WsSession` when the upstream answers 101 on
a path with a `WsApi`, feeds it every message of both directions (after the bytes went
on to the other side), and closes it once when the tunnel ends. A session hands each
finished Measurement (a turn, an utterance: the API decides) to `record`, which takes it
to the sinks. An exception raised here is caught by the tunnel, counted in
`tokenprobe_measurement_failures_total{stage="observe"}` (or `finish` from `close`), and
the session is no longer watched; the bytes keep flowing.

Adding a WebSocket API is one module defining a WsApi and one line in `WS_APIS` below.
The base classes live in proxy/core/wsbase.py, so a seam's module needs only that one.
"""

from __future__ import annotations

from proxy.core.apis import Api, api_of
from proxy.core.apis.realtime import Realtime
from proxy.core.wsbase import CLOSE_CAUSES, WsApi, WsSession

#: Every measured WebSocket API, one line each.
WS_APIS: tuple[WsApi, ...] = (Realtime(),)

_BY_PATH = {path: api for api in WS_APIS for path in api.paths}
#: The closed set of WebSocket `route` label values besides "other".
WS_ENDPOINTS = frozenset(api.endpoint for api in WS_APIS)


_BY_ENDPOINT = {api.endpoint: api for api in WS_APIS}


def ws_api_for(path: str) -> WsApi | None:
    """The WsApi serving this normalised path, or None (tunnelled unmeasured)."""
    return _BY_PATH.get(path)


def seam_of(endpoint: str) -> Api | WsApi:
    """The HTTP Api or WsApi behind a record's endpoint label: a WebSocket session's
    records (a realtime utterance) reach the same sinks as a request's."""
    ws = _BY_ENDPOINT.get(endpoint)
    return ws if ws is not None else api_of(endpoint)


__all__ = [
    "CLOSE_CAUSES",
    "WS_APIS",
    "WS_ENDPOINTS",
    "WsApi",
    "WsSession",
    "seam_of",
    "ws_api_for",
]
