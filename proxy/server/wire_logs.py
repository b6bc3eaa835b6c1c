"""What the libraries on the data paths log stays out of the proxy's log, at any --log-level.

The proxy's own lines carry no header value and no query (docs/proxying.md). The libraries
it runs on log what they see at DEBUG: the `websockets` library, which uvicorn's WebSocket
protocol hands its `uvicorn.error` logger, writes a handshake's request line (`?api_key=`
and all) and every header (`authorization: Bearer ...`); httpcore writes each response's
headers (an upstream's `set-cookie`); httpx writes each request's URL at INFO; urllib3,
under the OTLP/HTTP exporter (through requests), writes each export's request line at
DEBUG, with the endpoint's `?api-key=`. So their own loggers stop at WARNING, and
`uvicorn.error` drops what their code writes through it below INFO: --log-level debug is
for the proxy's lines and uvicorn's, never the wire's. (What the exporters write at
WARNING and above is masked: proxy/sinks/otel_env.py.)
"""

from __future__ import annotations

import importlib.util
import logging
import os

#: The libraries that read or write the wire (HTTP and WebSocket, either data path, and
#: the OTLP/HTTP exporter's requests and urllib3).
WIRE_LIBRARIES = (
    *("websockets", "wsproto", "httpx", "httpcore", "h11", "h2", "hpack", "aiohttp"),
    *("urllib3", "requests"),
)


def _package_dirs() -> tuple[str, ...]:
    """Where the installed ones live (found without importing them)."""
    dirs: list[str] = []
    for name in WIRE_LIBRARIES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.join(path, "") for path in spec.submodule_search_locations)
    return tuple(dirs)


class _NoWireTrace(logging.Filter):
    """Drops a record below INFO that a wire library's code wrote through this logger."""

    def __init__(self) -> None:
        super().__init__()
        self.dirs = _package_dirs()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.INFO or not record.pathname.startswith(self.dirs)


def keep_wire_libraries_quiet() -> None:
    """Once per process, before any server logs (proxy/server/app.py imports it)."""
    for name in WIRE_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").addFilter(_NoWireTrace())
