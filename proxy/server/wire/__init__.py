"""The wire: tokenprobe's protocol-level data path (the default of `tokenprobe serve`).

`connection.py`: the client connection (uvicorn's httptools protocol, with the head
limits) and one `WireRequest` per request; `upstream.py`: the upstream keep-alive pool
and the per-chunk path. Admission, the header policy and the measured exchange are the
same modules the ASGI relay uses (proxy/server/admission.py, headers.py, exchange.py).
"""

from proxy.server.wire.connection import WIRE_STATE, Wire, WireProtocol

__all__ = ["WIRE_STATE", "Wire", "WireProtocol"]
