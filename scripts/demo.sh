#!/usr/bin/env bash
# The main job on the embedded default: install the Python deps, then run `sandbox-lanes demo`
# (an embedded Tansu broker, the pod with the local-process driver, a short scenario, clean-up).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh --python
exec .venv/bin/sandbox-lanes demo "$@"
