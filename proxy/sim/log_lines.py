"""What the simulator's uvicorn may log: a WebSocket handshake's path, never its query.

uvicorn logs each WebSocket handshake it answers, at info, with its path and query
(protocols/websockets/*_impl.py: '%s - "WebSocket %s" [accepted]', '... 403', '... %d'),
and a query can carry a key (`/v1/realtime?api_key=...`). The proxy's own uvicorn has the
same filter (proxy/server/app.py `_WebSocketPathOnly`); the simulator may not import the
server, so it keeps this copy until the filter has a home in the core both can import.
"""

from __future__ import annotations

import logging

#: The logger uvicorn's WebSocket protocols log their handshake lines on.
UVICORN_ERROR = "uvicorn.error"


class WebSocketPathOnly(logging.Filter):
    """A handshake line keeps its path; its query becomes `?[query]`."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if type(args) is tuple and len(args) >= 2 and '"WebSocket %s"' in str(record.msg):
            where = args[1]
            if type(where) is str and "?" in where:
                record.args = (args[0], where.split("?", 1)[0] + "?[query]", *args[2:])
        return True


def keep_queries_out_of_logs() -> None:
    """Install the filter on uvicorn's logger, once however often the simulator starts in
    one process (a logger's filters outlive a server; uvicorn's logging config adds its
    own and removes none)."""
    logger = logging.getLogger(UVICORN_ERROR)
    if not any(isinstance(installed, WebSocketPathOnly) for installed in logger.filters):
        logger.addFilter(WebSocketPathOnly())
