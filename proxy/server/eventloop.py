"""The event loop `tokenprobe serve` runs: uvloop where it is installed, else asyncio's
own (uvicorn's "auto" choice), with one change: a TLS handshake gets --header-timeout.

asyncio gives a server's TLS handshake 60 s (`ssl_handshake_timeout`'s default, in uvloop
too), and uvicorn passes no other value to `create_server`. The app's protocol hears of a
TLS connection only once its handshake has ended, so the head timer
(proxy.server.protocol) starts after it: without a bound here, a client that opens
connections and never finishes a handshake holds each one for 60 s whatever
--header-timeout says. nginx bounds the handshake by client_header_timeout (its listener's
`post_accept_timeout`, set from it in src/http/ngx_http.c, is the timer
ngx_http_ssl_handshake arms), then gives the request head its own: so does this.

uvicorn takes the loop as a factory (its `loop` option); a `functools.partial` of a
module-level function survives the pickling that --workers' spawned processes need.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any


class _HandshakeBounded(asyncio.AbstractEventLoop):
    """Listeners with TLS get `handshake_timeout` as their `ssl_handshake_timeout`
    (None: the loop's own default)."""

    handshake_timeout: float | None = None

    async def create_server(self, *args: Any, **kwargs: Any) -> asyncio.Server:
        return await super().create_server(*args, **self._bounded(kwargs))

    async def create_unix_server(self, *args: Any, **kwargs: Any) -> asyncio.Server:
        return await super().create_unix_server(*args, **self._bounded(kwargs))

    def _bounded(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if kwargs.get("ssl") is None or kwargs.get("ssl_handshake_timeout") is not None:
            return kwargs
        return {**kwargs, "ssl_handshake_timeout": self.handshake_timeout}


@functools.cache
def _loop_class() -> type[_HandshakeBounded]:
    try:
        import uvloop
    except ImportError:  # uvicorn's "auto" then runs asyncio's loop

        class AsyncioLoop(_HandshakeBounded, asyncio.SelectorEventLoop):
            pass

        return AsyncioLoop

    class UvLoop(_HandshakeBounded, uvloop.Loop):  # type: ignore[misc]
        pass

    return UvLoop


def new_event_loop(handshake_timeout: float | None) -> asyncio.AbstractEventLoop:
    loop = _loop_class()()
    loop.handshake_timeout = handshake_timeout
    return loop


def loop_factory(handshake_timeout: float | None) -> Callable[[], asyncio.AbstractEventLoop]:
    """uvicorn's `loop` option for a server whose TLS handshakes get `handshake_timeout`
    seconds (--header-timeout; None where that is off: asyncio's 60 s)."""
    return functools.partial(new_event_loop, handshake_timeout)
