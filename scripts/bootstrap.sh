#!/usr/bin/env bash
# Installs what sandbox-lanes needs on a fresh Debian machine, idempotently:
#   - system packages (only when missing): dockerd (docker.io), docker-compose, etcd, busybox-static,
#     debootstrap, openssl, Java, Maven, Go, Node with npm, chromium, prometheus
#   - a virtualenv at .venv with the project and its test dependencies
# Usage: scripts/bootstrap.sh [--system] [--python]   (no flag = both)
set -euo pipefail
cd "$(dirname "$0")/.."

want_system=1; want_python=1
if [[ $# -gt 0 ]]; then
  want_system=0; want_python=0
  for arg in "$@"; do
    case "$arg" in
      --system) want_system=1 ;;
      --python) want_python=1 ;;
      *) echo "unknown flag $arg" >&2; exit 2 ;;
    esac
  done
fi

log() { printf '[bootstrap] %s\n' "$*" >&2; }

if [[ $want_system -eq 1 ]]; then
  missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  # compose/docker-compose.yml is validated with `docker compose config` or Debian's docker-compose
  docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || missing+=(docker-compose)
  command -v etcd >/dev/null || missing+=(etcd-server)
  # the single-node Kubernetes of the tests (devtools/harness/kube_node.py)
  command -v containerd >/dev/null || missing+=(containerd)
  command -v runc >/dev/null || missing+=(runc)
  [[ -x /usr/lib/cni/loopback ]] || missing+=(containernetworking-plugins)
  [[ -x /bin/busybox ]] || missing+=(busybox-static)
  # the pod image test builds its Python base from Debian packages (devtools/harness/python_base_image.py)
  command -v debootstrap >/dev/null || [[ -x /usr/sbin/debootstrap ]] || missing+=(debootstrap)
  command -v openssl >/dev/null || missing+=(openssl)
  command -v javac >/dev/null || missing+=(openjdk-17-jdk-headless)  # javac: the Java producer of the codec test
  command -v mvn >/dev/null || missing+=(maven)
  # the TypeScript producer of the input-formats test (tests/support/node_producers.py)
  { command -v node >/dev/null && command -v npm >/dev/null; } || missing+=(nodejs npm)
  command -v go >/dev/null || [[ -x /usr/local/go/bin/go ]] || missing+=(golang-go)
  # the explain page is opened in a real headless browser (tests/integration/test_audit.py)
  command -v chromium >/dev/null || missing+=(chromium chromium-driver)
  # a real Prometheus (and promtool) evaluates the shipped alerts and dashboard queries on a running pod
  # (tests/integration/test_dashboard_alerts.py)
  command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
  # jemalloc, the allocator the soak can run the pod on (bench --soak-preload; its heap figures' test)
  [[ -e /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 ]] || missing+=(libjemalloc2)
  if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ $(id -u) -ne 0 ]]; then
      log "missing system packages: ${missing[*]} (run as root or install them)"; exit 1
    fi
    log "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    log "system packages present"
  fi
fi

if [[ $want_python -eq 1 ]]; then
  PY=${PYTHON:-python3}
  if [[ ! -x .venv/bin/python ]]; then
    log "creating .venv with $($PY --version)"
    "$PY" -m venv .venv
  fi
  log "installing sandbox-lanes and its test dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # pip's build backend chatters on stderr (editable-install notices); show it only when pip fails.
  pip_log=$(mktemp)
  # SANDBOX_LANES_DEVTOOLS_EXTRAS (e.g. bench): the dev tools' extras in the same install (scripts/test.sh)
  devtools="devtools${SANDBOX_LANES_DEVTOOLS_EXTRAS:+[$SANDBOX_LANES_DEVTOOLS_EXTRAS]}"
  if ! .venv/bin/python -m pip install -q -e '.[test,demo]' -e "$devtools" >"$pip_log" 2>&1; then
    cat "$pip_log" >&2
    rm -f "$pip_log"
    exit 1
  fi
  rm -f "$pip_log"
fi
