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

from starlette.requests import Request
from starlette.responses import Response

_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".LICENSE": b"text/plain; charset=utf-8",
}

# Nothing outside this origin: no CDN, no fonts, no beacons. uPlot styles its elements
# from script (CSSOM), which style-src does not restrict.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
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


def live_view(request: Request) -> Response:
    """`/ui` and `/ui/<name>`, whatever the method (others get a 405 of our own)."""
    method = request.method
    if method not in ("GET", "HEAD"):
        return _response(405, b"text/plain", b"GET only\n", {"allow": "GET, HEAD"})
    path: str = request.scope["path"]
    if path == "/ui/":  # relative asset URLs resolve against /ui, not /ui/
        return _response(308, b"text/plain", b"", {"location": "/ui"})
    asset = ASSETS.get(path[len("/ui/") :] if path != "/ui" else "")
    if asset is None:
        return _response(404, b"text/plain", b"no such file in the live view\n")
    kind, body = asset
    return _response(200, kind, b"" if method == "HEAD" else body, length=len(body))


def _response(
    status: int,
    kind: bytes,
    body: bytes,
    extra: dict[str, str] | None = None,
    *,
    length: int | None = None,
) -> Response:
    headers = {
        "content-type": kind.decode(),  # as given: Starlette would append a charset
        "content-length": str(len(body) if length is None else length),
        # Revalidate each load so an upgraded proxy never serves a stale script.
        "cache-control": "no-cache",
        "content-security-policy": _CSP,
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
        **(extra or {}),
    }
    return Response(body, status, headers)
