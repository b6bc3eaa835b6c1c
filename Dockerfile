# syntax=docker/dockerfile:1
# tokenprobe, the measuring proxy.   docker build -t tokenprobe .
#   docker run -p 4000:4000 -e TOKENPROBE_UPSTREAM=http://vllm:8000 tokenprobe
# Also runs the other commands, each with --no-healthcheck (the HEALTHCHECK below asks
# serve's /healthz on :4000, so another command's container would be marked unhealthy):
#   docker run --no-healthcheck -p 8000:8000 tokenprobe sim --host 0.0.0.0
# (the simulator reads TOKENPROBE_SIM_HOST, not the TOKENPROBE_HOST set below, and would
# listen on the container's 127.0.0.1 only), and `... tokenprobe bench --url ...`.
#
# Pinned to a patch release of a Debian-slim Python; pin the digest too for reproducible
# builds: docker buildx imagetools inspect python:3.11.13-slim-bookworm
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler for the build stage only: setup.py compiles the per-chunk path with mypyc
# (proxy/build.py); the image that runs has the extensions, not the compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/tokenprobe
WORKDIR /src
# README.md* : the build works before the README exists (pyproject names it).
COPY pyproject.toml setup.py README.md* ./
COPY proxy ./proxy
# The tokenizer extra (transformers, tokenizers, sentencepiece) counts tokens when the
# backend sends no usage (--tokenizer); it pulls no torch.
RUN /opt/tokenprobe/bin/pip install ".[tokenizer]"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/tokenprobe/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/tmp/huggingface \
    TOKENPROBE_HOST=0.0.0.0 \
    TOKENPROBE_PORT=4000
RUN groupadd --system --gid 10001 tokenprobe \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin tokenprobe
COPY --from=build /opt/tokenprobe /opt/tokenprobe
# Numeric, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
USER 10001:10001
EXPOSE 4000
# Liveness only (the process answers). No curl in slim images: Python does the request,
# over https when the proxy serves TLS (its certificate names the service, not 127.0.0.1:
# not verified here; with --ssl-cert-reqs 2 give the container a healthcheck of its own).
# It learns the port and the scheme from TOKENPROBE_PORT and TOKENPROBE_SSL_CERTFILE
# alone: set them as variables (-e TOKENPROBE_PORT=8080), not as arguments (serve --port
# 8080, --ssl-certfile), which it cannot see, or the container stays unhealthy.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, ssl, urllib.request; tls = bool(os.environ.get('TOKENPROBE_SSL_CERTFILE')); urllib.request.urlopen(('https' if tls else 'http') + '://127.0.0.1:%s/healthz' % os.environ.get('TOKENPROBE_PORT', '4000'), timeout=2, context=ssl._create_unverified_context() if tls else None)"]
# The proxy drains in-flight streams on SIGTERM (--drain-timeout, 30 s by default):
# give `docker stop` a longer -t / compose a longer stop_grace_period.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenprobe"]
CMD ["serve"]
