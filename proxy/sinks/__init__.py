"""Where finished measurements go: Prometheus metrics, OpenTelemetry traces, the access log, cost.

Each sink has one method, `record(measurement, labels)` (sink.py); `Sinks` (dispatch.py) calls
them in order and contains their failures. proxy/server/assemble.py decides which run.
"""
