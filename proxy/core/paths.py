"""One normalised request target: what the proxy routes and measures by, and forwards.

The server hands the ASGI app a decoded `path` and the `raw_path` the client sent. Routing
on one and forwarding the other (or letting an HTTP client re-normalise the URL) lets
`/v1/x/../chat/completions` or `/v1/%2e%2e/x` reach the backend as a different path than
the one the proxy decided on. So the proxy works from the raw bytes only, once:

1. Percent-encodings of unreserved characters (ALPHA, DIGIT, `-._~`) are decoded and the
   hex of every other percent-encoding is upper-cased (RFC 3986 §6.2.2.1-2), so
   `/v1/chat/%63ompletions` is recognised as the endpoint it is.
2. Dot segments are removed (RFC 3986 §5.2.4), after step 1, so `%2e%2e` counts as `..`.
3. Bytes that may not appear raw in a path (space, quotes, braces, non-ASCII...) are
   percent-encoded, so no HTTP client has a reason to re-encode the result.

Refused (`BadTarget`, a 400): what cannot be normalised without guessing how the backend
would read it: an encoded slash or backslash, or a raw backslash (`%2F`, `%5C`, `\\`: one
server splits segments there, another does not; a raw `\\` encoded as `%5C` would forward
what the proxy refuses), an encoded NUL (`%00`), a malformed percent sign, a path not
starting with `/`, and a `..` that would climb above the root.

The query string is forwarded as received; only bytes that cannot go on a request line
raw (controls, space, non-ASCII) are percent-encoded. An empty one (`/v1/models?`) goes
as none (`request_target` has no `?`): an ASGI server gives the relay `query_string`
b"" for both (uvicorn's httptools and h11 protocols), so the wire does the same. Empty
segments (`//`) are kept, as RFC 3986 keeps them.

The proxy's own routes (/healthz, /metrics, ...) are matched on `route_key` of the
normalised path: empty segments merged and a trailing slash dropped, because many servers
read a path that way (nginx merges slashes by default, `merge_slashes`; frameworks
redirect `/x/` to `/x`), so `//metrics` or `/healthz/` must not reach a backend route
that the proxy's own shadows.

A backend started with a root path (vLLM's --root-path, FastAPI's `root_path`) serves
every route under it as well as at the root: `under_root` gives the path such a backend
routes by, which the proxy measures by (--root-path, `root_path` its parse). The path
forwarded stays the one sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class BadTarget(ValueError):
    """The request target cannot be normalised safely; the message says why."""


@dataclass(frozen=True, slots=True)
class Target:
    path: str  # normalised, percent-encoding preserved: route, measure and forward by it
    query: str  # "" when none; forwarded as received

    @property
    def request_target(self) -> str:
        return self.path + "?" + self.query if self.query else self.path


_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
# pchar minus "%" plus "/": what may stay raw in a path (RFC 3986 §3.3).
_PATH_SAFE = _UNRESERVED | frozenset(b"!$&'()*+,;=:@/")

# Any byte that is not _PATH_SAFE ("%" included): none found, the path is already normal.
_NOT_PATH_SAFE = re.compile(rb"[^A-Za-z0-9\-._~!$&'()*+,;=:@/]")

_HEX = frozenset(b"0123456789abcdefABCDEF")
_REFUSED_ESCAPES = {0x2F: "an encoded slash (%2F)", 0x5C: "an encoded backslash (%5C)", 0: "%00"}
_QUERY_UNSAFE = re.compile(rb"[^\x21-\x22\x24-\x7e]")
_SLASHES = re.compile("//+")


def normalise(raw_path: bytes, query: bytes = b"") -> Target:
    """The normalised target for a raw path and query; raises BadTarget."""
    if not raw_path.startswith(b"/"):
        raise BadTarget("the request path must start with '/'")
    path = _remove_dot_segments(_normalise_escapes(raw_path))
    return Target(path, _encode_query(query))


def _normalise_escapes(raw: bytes) -> str:
    if _NOT_PATH_SAFE.search(raw) is None:
        return raw.decode("ascii")  # the common case: nothing to do
    out: list[str] = []
    i, n = 0, len(raw)
    while i < n:
        byte = raw[i]
        if byte == 0x25:  # "%"
            pair = raw[i + 1 : i + 3]
            if len(pair) < 2 or pair[0] not in _HEX or pair[1] not in _HEX:
                raise BadTarget("malformed percent-encoding in the request path")
            value = int(pair, 16)
            if value in _REFUSED_ESCAPES:
                raise BadTarget(f"the request path contains {_REFUSED_ESCAPES[value]}")
            out.append(chr(value) if value in _UNRESERVED else "%" + pair.decode().upper())
            i += 3
            continue
        if byte == 0x5C:  # a raw backslash is read as "/" by some servers, as %5C is
            raise BadTarget("the request path contains a backslash")
        out.append(chr(byte) if byte in _PATH_SAFE else f"%{byte:02X}")
        i += 1
    return "".join(out)


def _remove_dot_segments(path: str) -> str:
    if "." not in path:
        return path  # the common case: no segment can be a dot segment
    segments = path.split("/")[1:]  # the path starts with "/": drop the empty first one
    if "." not in segments and ".." not in segments:
        return path
    out: list[str] = []
    for segment in segments:
        if segment == "..":
            if not out:
                raise BadTarget("the request path climbs above the root ('..')")
            out.pop()
        elif segment != ".":
            out.append(segment)
    # A final "." or ".." leaves a directory: keep its trailing slash (RFC 3986 §5.2.4).
    if segments[-1] in (".", ".."):
        out.append("")
    return "/" + "/".join(out)


def _encode_query(query: bytes) -> str:
    if _QUERY_UNSAFE.search(query) is None:
        return query.decode("ascii")
    return _QUERY_UNSAFE.sub(lambda m: b"%%%02X" % m.group()[0], query).decode("ascii")


def route_key(path: str) -> str:
    """A normalised path as the proxy's own routes are matched: `//` merged, no trailing `/`."""
    if "//" in path:
        path = _SLASHES.sub("/", path)
    if path.endswith("/"):
        path = path.rstrip("/") or "/"
    return path


def root_path(value: str) -> str:
    """--root-path as `under_root` compares it: its escapes normalised as a request
    path's are, so `/tenant%2Da` and `/tenant-a` are one. Refused: no leading `/`, a
    query or fragment, a dot segment, `/` alone (no root path: leave it unset), and a
    trailing `/` (vLLM started with `--root-path /tenant-a/` routes only
    `/tenant-a//v1/...`: Starlette strips the root path only where a `/` follows it)."""
    if not value.startswith("/"):
        raise ValueError("expected a path such as /tenant-a")
    if "?" in value or "#" in value:
        raise ValueError("a root path takes no query (?...) or fragment (#...)")
    try:
        path = _normalise_escapes(value.encode("utf-8"))
    except BadTarget as exc:
        raise ValueError(str(exc).replace("request path", "root path")) from None
    if {".", ".."} & set(path.split("/")):
        raise ValueError("a root path takes no dot segments (. or ..)")
    if path == "/":
        raise ValueError("`/` is no root path: leave it unset")
    if path.endswith("/"):
        raise ValueError(f"no trailing slash: {path.rstrip('/')!r}, as vLLM's --root-path")
    return path


def under_root(path: str, root: str | None) -> str:
    """A normalised path as a backend served under the root path `root` routes it: what
    follows `root` where the path starts with it and a `/` comes next, else the path as it
    is (that backend serves its routes at the root too). Starlette's `get_route_path`,
    which vLLM's routes go through (`build_app` sets `app.root_path = args.root_path`;
    FastAPI puts it in the scope), so its API-key middleware's `removeprefix` too
    (vllm/entrypoints/serve/middleware/authenticate.py)."""
    if root and path.startswith(root) and path[len(root) : len(root) + 1] == "/":
        return path[len(root) :]
    return path
