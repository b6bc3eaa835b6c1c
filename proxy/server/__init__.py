"""The server: the ASGI app, the relay, the upstream client, process management."""
