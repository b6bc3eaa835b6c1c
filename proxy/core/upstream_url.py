"""The upstream's address, parsed once: `UpstreamURL.parse(settings.upstream)`.

Every data path that opens a connection to the backend reads the same fields: the scheme
(and so TLS), the host to connect to, the port, the authority for the Host header, and the
base path that every forwarded request target goes under (`--upstream
http://gateway/tenant-a` puts `/v1/chat/completions` at `/tenant-a/v1/chat/completions`).
With `--upstream-uds` the connection goes to that Unix socket instead of host and port;
the URL still gives the scheme, the Host header and the base path (curl's --unix-socket).
`target` joins the base path and a normalised request path without doubling the slash
(`/tenant-a/` + `/v1/x` is `/tenant-a/v1/x`, never `//v1/x`).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, urlsplit

__all__ = ["UpstreamURL"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class UpstreamURL:
    scheme: str  # "http" or "https"
    host: str  # to connect to: a name or an address, IPv6 without brackets
    port: int  # given, else the scheme's default
    authority: bytes  # the Host header's value: the port only when not the default
    base_path: str  # "" or "/prefix", never a trailing slash
    uds: str | None = None  # the Unix socket connections go to, else host and port

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def server_name(self) -> str:
        """The name TLS sends (SNI) and checks the certificate against: the host without
        the trailing dot of a fully qualified name (`vllm.ns.svc.cluster.local.`), which
        SNI never carries (RFC 6066 §3) and no certificate names."""
        return self.host.rstrip(".")

    @property
    def origin(self) -> str:
        """scheme://authority, no path: where the ASGI relay's client sends its URLs."""
        return f"{self.scheme}://{self.authority.decode('ascii')}"

    @classmethod
    def parse(cls, url: str, uds: str | None = None) -> UpstreamURL:
        """`url` as the settings accept it (http or https, a host, an optional port and
        base path), reached through the Unix socket `uds` when given. A query or fragment
        on the upstream itself is ignored."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"expected an http:// or https:// URL with a host: {url!r}")
        host = parts.hostname
        port = parts.port or _DEFAULT_PORTS[scheme]
        shown = f"[{host}]" if ":" in host else host
        authority = shown if port == _DEFAULT_PORTS[scheme] else f"{shown}:{port}"
        base = quote(parts.path.rstrip("/"), safe="/%:@!$&'()*+,;=-._~")  # ASCII on the wire
        if not authority.isascii():
            raise ValueError(f"write a non-ASCII host in its IDNA form (xn--...): {url!r}")
        return cls(scheme, host, port, authority.encode("ascii"), base, uds)

    def target(self, path: str, query: str = "") -> str:
        """The request target upstream: base path + `path` (which starts with "/"),
        then `?query` when there is one."""
        where = self.base_path + path if path.startswith("/") else f"{self.base_path}/{path}"
        return where + "?" + query if query else where
