"""`tokenprobe serve`: settings -> app -> uvicorn (uvloop and httptools when installed)."""

from __future__ import annotations

import logging
import os
import sys

import uvicorn

from proxy.app import create_app
from proxy.settings import Settings, SettingsError, parse, require_upstream


def uvicorn_config(app: object, settings: Settings, **overrides: object) -> uvicorn.Config:
    options: dict[str, object] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "access_log": False,  # tokenprobe writes its own access log
        "timeout_graceful_shutdown": settings.drain_timeout,
        "server_header": False,
        "date_header": False,
        "loop": "auto",
        "http": "auto",
    }
    options.update(overrides)
    return uvicorn.Config(app, **options)  # type: ignore[arg-type]


def main(argv: list[str]) -> int:
    try:
        settings = parse(argv, os.environ)
        require_upstream(settings)
    except SettingsError as exc:
        print(f"tokenprobe serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    server = uvicorn.Server(uvicorn_config(app, settings))
    server.run()
    return 0
