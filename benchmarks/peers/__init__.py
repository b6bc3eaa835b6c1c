"""The peers: the other servers a benchmark runs beside the proxy (backends, the byte
relay, the WebSocket echo, a SO_REUSEPORT worker)."""
