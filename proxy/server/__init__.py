"""The server: the assembly (assemble.py), the ASGI app, the relay, the control plane, the
upstream client, process management."""
