"""The server: the assembly (assemble.py), the two data paths (the wire, wire/, and the ASGI
relay, forward.py) with what they share (admission.py, headers.py, exchange.py), the ASGI
app, the control plane, the WebSocket tunnel, the upstream client, process management."""
