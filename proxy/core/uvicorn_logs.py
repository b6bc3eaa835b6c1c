"""What a uvicorn serving tokenprobe (the proxy's, the simulator's) may log of a request's
target: never a credential a query carries (`?api_key=...`).

uvicorn logs each WebSocket handshake it answers, at info, with its path and query
(protocols/websockets/*_impl.py: '%s - "WebSocket %s" [accepted]', '... 403', '... %d'):
that line keeps the path alone. Its access log (on under `uvicorn --factory
proxy.asgi:create_app` and in the simulator; `tokenprobe serve` turns it off) writes each
request line with its query (protocols/http/httptools_impl.py and h11_impl.py: '%s - "%s
%s HTTP/%s" %d', the path from `get_path_with_query_string`): each credential parameter's
value is masked there (`masked_query`), the path and the other parameters stay, which an
operator reads.
"""

from __future__ import annotations

import logging

from proxy.core.secrets import masked_query

#: The logger uvicorn's WebSocket protocols log their handshake lines on.
UVICORN_ERROR = "uvicorn.error"
#: The logger of uvicorn's access lines.
UVICORN_ACCESS = "uvicorn.access"


class WebSocketPathOnly(logging.Filter):
    """A handshake line keeps its path; its query becomes `?[query]`."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if type(args) is tuple and len(args) >= 2 and '"WebSocket %s"' in str(record.msg):
            where = args[1]
            if type(where) is str and "?" in where:
                record.args = (args[0], where.split("?", 1)[0] + "?[query]", *args[2:])
        return True


class AccessLineMasked(logging.Filter):
    """An access line keeps its path and query, each credential parameter's value masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if type(args) is tuple and len(args) == 5 and type(args[2]) is str and "?" in args[2]:
            path, _, query = args[2].partition("?")
            record.args = (*args[:2], f"{path}?{masked_query(query)}", *args[3:])
        return True


def keep_queries_out_of_logs() -> None:
    """Install both filters on uvicorn's loggers, once however often a server starts in one
    process (a logger's filters outlive a server; uvicorn's logging config adds its own
    and removes none)."""
    for name, kind in ((UVICORN_ERROR, WebSocketPathOnly), (UVICORN_ACCESS, AccessLineMasked)):
        logger = logging.getLogger(name)
        if not any(isinstance(installed, kind) for installed in logger.filters):
            logger.addFilter(kind())
