# vLLM's OpenAI server image with the OpenTelemetry packages that --otlp-traces-endpoint
# needs (the official image does not ship them).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
RUN python3 -m pip install --no-cache-dir \
        "opentelemetry-sdk>=1.26,<2" \
        "opentelemetry-api>=1.26,<2" \
        "opentelemetry-exporter-otlp>=1.26,<2" \
        "opentelemetry-semantic-conventions-ai>=0.4.1,<0.5"
