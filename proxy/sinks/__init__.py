"""Where finished measurements go: Prometheus metrics, OpenTelemetry traces, the access log, cost."""
