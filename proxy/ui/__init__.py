"""The live view: `GET /ui`, one page that polls `/metrics` and draws what it measures.

The page does all the work in the browser from successive scrapes (rates from counter
deltas, quantiles from bucket deltas the way PromQL's histogram_quantile does), so the
proxy only serves a few static files, held in memory from start-up. It is served
wherever `/metrics` is (the proxy's port, or the --metrics-port listener) and fetches
`metrics` relative to itself. The page shows no data by itself, so it needs no token;
with --metrics-token the page asks for the token and sends it on each poll.

Assets: `/ui` is the page, `/ui/<name>` the files in `static/` (a fixed set, read once).
"""

from __future__ import annotations

from importlib.resources import files

from proxy.types import Receive, Scope, Send

_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".LICENSE": b"text/plain; charset=utf-8",
}

# Nothing outside this origin: no CDN, no fonts, no beacons. uPlot styles its elements
# from script (CSSOM), which style-src does not restrict.
_CSP = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    b"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _load() -> dict[str, tuple[bytes, bytes]]:
    """name -> (content type, body) for every shipped asset; `` is the page itself."""
    assets: dict[str, tuple[bytes, bytes]] = {}
    for entry in files(__package__).joinpath("static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        kind = _TYPES.get(suffix)
        if kind is not None and entry.is_file():
            name = "" if entry.name == "index.html" else entry.name
            assets[name] = (kind, entry.read_bytes())
    return assets


ASSETS = _load()


def is_ui_path(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


async def serve_ui(scope: Scope, receive: Receive, send: Send) -> None:
    path: str = scope["path"]
    if scope["method"] not in ("GET", "HEAD"):
        await _send(send, 405, b"text/plain", b"GET only\n", [(b"allow", b"GET, HEAD")])
        return
    if path == "/ui/":  # relative asset URLs resolve against /ui, not /ui/
        await _send(send, 308, b"text/plain", b"", [(b"location", b"/ui")])
        return
    asset = ASSETS.get(path[len("/ui/") :] if path != "/ui" else "")
    if asset is None:
        await _send(send, 404, b"text/plain", b"no such file in the live view\n")
        return
    kind, body = asset
    await _send(send, 200, kind, b"" if scope["method"] == "HEAD" else body, length=len(body))


async def _send(
    send: Send,
    status: int,
    kind: bytes,
    body: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
    *,
    length: int | None = None,
) -> None:
    headers = [
        (b"content-type", kind),
        (b"content-length", str(len(body) if length is None else length).encode()),
        # Revalidate each load so an upgraded proxy never serves a stale script.
        (b"cache-control", b"no-cache"),
        (b"content-security-policy", _CSP),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
