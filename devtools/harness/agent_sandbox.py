"""Build and run the kubernetes-sigs/agent-sandbox controller next to ``harness.kube_node``.

Standard library only (no PyYAML: the manifests go to the apiserver as YAML, see Install)::

    python -m harness.agent_sandbox build     # compile the controller once into the cache (idempotent)
    python -m harness.agent_sandbox path      # print the binary path

Build
    The Go module ``sigs.k8s.io/agent-sandbox`` at ``VERSION`` comes from the Go module
    cache (``go mod download`` through the proxy when absent). The module cache is
    read-only, so the module is copied to a writable build directory and
    ``go build ./cmd/agent-sandbox-controller`` runs there (``GOFLAGS=-mod=mod``: the
    build fetches about 60 dependencies; needs go >= 1.26; ``nice -n 19 ... -p 2``, so it
    yields to whatever else the machine runs). The static binary and a copy of the
    module's ``k8s/`` manifests land in ``$SANDBOX_LANES_CACHE/agent-sandbox-<VERSION>/``,
    so installing later needs neither the module cache nor the network.

Install (``AgentSandboxController.start``)
    The four CRDs of ``k8s/crds/`` (too large for client-side apply's annotation), the
    two generated ClusterRoles, and the Namespace, ServiceAccount and two
    ClusterRoleBindings of ``k8s/controller.yaml`` and ``k8s/extensions.yaml`` are applied
    server-side (``PATCH`` with ``application/apply-patch+yaml``, so the apiserver parses
    the YAML itself). The Deployment and Service of those files are skipped: the
    controller runs as a host process instead. It authenticates as its ServiceAccount
    (a TokenRequest token in a kubeconfig of its own), not as admin, so the shipped RBAC
    is what is exercised.

Run
    ``agent-sandbox-controller --extensions --leader-elect=false
    --metrics-bind-address=127.0.0.1:P --health-probe-bind-address=127.0.0.1:Q
    --kubeconfig=...``:

    * ``--extensions``: the SandboxClaim / SandboxTemplate / SandboxWarmPool controllers too.
    * ``--leader-elect=false``: one replica on a throwaway cluster; leader election would
      only add a Lease round-trip (and a wait for an old lease after a restart).
    * metrics and health-probe addresses: the defaults are ``:8080`` / ``:8081`` on all
      interfaces; both are bound to free loopback ports instead (only loopback is used).

    ``start()`` returns when ``/readyz`` answers on the probe address and the Sandbox
    controller's workers have started; it raises ``RuntimeError`` with the log tail
    otherwise. ``stop()`` sends SIGTERM, then SIGKILL after a timeout. The CRDs and RBAC
    stay: the node is torn down by its own owner.

Garbage collector
    kube-controller-manager's garbage collector re-reads API discovery only every 30 s
    (hard-coded). Until then it has no REST mapping and no informer for CRDs installed
    after it started ("unable to get REST mapping for agents.x-k8s.io/v1beta1/Sandbox"),
    so anything that needs it for a Sandbox's dependents stalls: a foreground delete took
    about 24 s instead of about 3 s. ``start()`` therefore also waits (``wait_for_gc``)
    until a throwaway Suspended Sandbox, deleted with ``propagationPolicy: Foreground``
    right after the CRDs are installed, is really gone: only the GC removes the
    ``foregroundDeletion`` finalizer. This overlaps the controller's own start and costs
    at most the rest of the GC's 30 s period, once per node.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Final

from harness.cache import cache_root, locked
from harness.kube_apiserver import _free_port, _go_env, _run, _tail
from harness.kube_node import KubeNode

VERSION: Final = "v1.0.1"
MODULE: Final = "sigs.k8s.io/agent-sandbox"
BINARY: Final = "agent-sandbox-controller"
NAMESPACE: Final = "agent-sandbox-system"
SERVICE_ACCOUNT: Final = "agent-sandbox-controller"
FIELD_MANAGER: Final = "sandbox-lanes-harness"
#: The Sandbox API (core controller) and the extensions API (claims, templates, warm pools).
API_VERSION: Final = "agents.x-k8s.io/v1beta1"
EXTENSIONS_API_VERSION: Final = "extensions.agents.x-k8s.io/v1beta1"
#: Manifests applied from the module's ``k8s/`` dir, in order; for the last two only these kinds.
CRD_DIR: Final = "crds"
RBAC_FILES: Final = ("rbac.generated.yaml", "extensions-rbac.generated.yaml")
IDENTITY_FILES: Final = ("controller.yaml", "extensions.yaml")
IDENTITY_KINDS: Final = ("Namespace", "ServiceAccount", "ClusterRoleBinding")

#: The throwaway Sandbox whose foreground delete shows the garbage collector knows the CRDs.
GC_PROBE: Final = "gc-probe"
#: kind -> (plural, namespaced) for what the install applies.
_RESOURCES: Final = {
    "CustomResourceDefinition": ("customresourcedefinitions", False),
    "ClusterRole": ("clusterroles", False),
    "ClusterRoleBinding": ("clusterrolebindings", False),
    "Namespace": ("namespaces", False),
    "ServiceAccount": ("serviceaccounts", True),
}


# --------------------------------------------------------------------------- build


def build_dir() -> Path:
    return cache_root() / f"agent-sandbox-{VERSION}"


def binary_path() -> Path:
    return build_dir() / BINARY


def manifests_dir() -> Path:
    """The copy of the module's ``k8s/`` directory kept next to the binary."""
    return build_dir() / "k8s"


def is_built() -> bool:
    binary = binary_path()
    return binary.is_file() and os.access(binary, os.X_OK) and any((manifests_dir() / CRD_DIR).glob("*.yaml"))


def _go() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").is_file() else None)
    if go is None:
        raise SystemExit("the go toolchain (>= 1.26) is required to build agent-sandbox")
    return go


def _module_dir(go: str, work: Path) -> Path:
    """The module's directory in the Go module cache, downloaded through the proxy if absent."""
    env = dict(os.environ)
    env.setdefault("GOTOOLCHAIN", "local")
    env.pop("GOFLAGS", None)  # -mod=mod is meaningless outside a module
    info = json.loads(_run([go, "mod", "download", "-json", f"{MODULE}@{VERSION}"], work, env))
    if info.get("Error"):
        raise SystemExit(f"go mod download {MODULE}@{VERSION}: {info['Error']}")
    return Path(info["Dir"])


def _copy_writable(src: Path, dst: Path) -> None:
    """Copy a module-cache tree (files 0444, dirs 0555) and make the copy writable."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, symlinks=True)
    for root, dirs, files in os.walk(dst):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644)
    os.chmod(dst, 0o755)


def build() -> Path:
    """Compile the controller into ``build_dir()`` (skipped when already there); returns the binary."""
    out = build_dir()
    if is_built():
        print(f"agent-sandbox {VERSION} already built: {binary_path()}", flush=True)
        return binary_path()
    go = _go()
    out.mkdir(parents=True, exist_ok=True)
    with locked(out.parent / f"agent-sandbox-{VERSION}.lock"):
        if is_built():  # another run built it while we waited for the lock
            return binary_path()
        started = time.monotonic()
        src = out / "src"
        _copy_writable(_module_dir(go, out), src)
        env = _go_env()
        env["GOFLAGS"] = "-mod=mod"
        env["GOTOOLCHAIN"] = "local"
        env["CGO_ENABLED"] = "0"
        partial = out / f"{BINARY}.partial"
        partial.unlink(missing_ok=True)
        _run(
            [
                *(["nice", "-n", "19"] if shutil.which("nice") else []),
                go,
                "build",
                "-p",
                "2",
                "-trimpath",
                "-ldflags=-s -w",
                "-o",
                str(partial),
                f"./cmd/{BINARY}",
            ],
            src,
            env,
        )
        k8s = manifests_dir()
        shutil.rmtree(k8s, ignore_errors=True)
        shutil.copytree(src / "k8s", k8s)
        partial.chmod(0o755)
        partial.replace(binary_path())  # last: the binary's presence marks a finished build
        shutil.rmtree(src, ignore_errors=True)
        elapsed = time.monotonic() - started
    print(f"built agent-sandbox-controller {VERSION} in {elapsed:.0f}s: {binary_path()}", flush=True)
    return binary_path()


# --------------------------------------------------------------------------- manifests


class Manifest:
    """One YAML document of a manifest file: its text, plus the few header fields the install needs."""

    def __init__(self, text: str, api_version: str, kind: str, name: str, namespace: str) -> None:
        self.text = text
        self.api_version = api_version
        self.kind = kind
        self.name = name
        self.namespace = namespace

    def path(self) -> str:
        """The object's API path (the target of a server-side apply)."""
        plural, namespaced = _RESOURCES[self.kind]
        group = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if namespaced:
            return f"{group}/namespaces/{self.namespace}/{plural}/{self.name}"
        return f"{group}/{plural}/{self.name}"

    def __repr__(self) -> str:
        return f"{self.kind}/{self.name}"


def _header(doc: str) -> tuple[str, str, str, str]:
    """apiVersion, kind, metadata.name and metadata.namespace from a YAML document's block layout.

    Enough for kubebuilder's and the project's own manifests (top-level keys at column 0,
    metadata's fields two spaces in); the apiserver parses the full document itself.
    """
    top: dict[str, str] = {}
    meta: dict[str, str] = {}
    in_meta = False
    for line in doc.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z]\w*):\s*(.*?)\s*", line)
        if m:
            top[m.group(1)] = m.group(2).strip("\"'")
            in_meta = m.group(1) == "metadata"
            continue
        m = re.fullmatch(r"  ([A-Za-z]\w*):\s*(.*?)\s*", line)
        if in_meta and m:
            meta.setdefault(m.group(1), m.group(2).strip("\"'"))
    return top.get("apiVersion", ""), top.get("kind", ""), meta.get("name", ""), meta.get("namespace", "")


def load_manifests(path: Path, kinds: tuple[str, ...] | None = None) -> list[Manifest]:
    """The non-empty documents of a multi-document YAML file (only ``kinds``, when given)."""
    found = []
    for doc in re.split(r"^---[ \t]*$", path.read_text(), flags=re.MULTILINE):
        if not any(ln.strip() and not ln.lstrip().startswith("#") for ln in doc.splitlines()):
            continue
        api_version, kind, name, namespace = _header(doc)
        if not (api_version and kind and name):
            raise RuntimeError(f"{path.name}: a document without apiVersion/kind/metadata.name")
        if kinds is not None and kind not in kinds:
            continue
        if kind not in _RESOURCES:
            raise RuntimeError(f"{path.name}: unexpected kind {kind} ({name})")
        found.append(Manifest(doc.strip() + "\n", api_version, kind, name, namespace))
    return found


def install_manifests(root: Path | None = None) -> list[Manifest]:
    """Everything ``start()`` applies, in order: CRDs, ClusterRoles, Namespace, ServiceAccount, bindings."""
    root = root or manifests_dir()
    crds = [m for f in sorted((root / CRD_DIR).glob("*.yaml")) for m in load_manifests(f)]
    rbac = [m for f in RBAC_FILES for m in load_manifests(root / f)]
    identity = [m for f in IDENTITY_FILES for m in load_manifests(root / f, IDENTITY_KINDS)]
    order = {k: i for i, k in enumerate(IDENTITY_KINDS)}
    identity.sort(key=lambda m: order[m.kind])
    return [*crds, *rbac, *identity]


# --------------------------------------------------------------------------- run


class AgentSandboxController:
    """The controller as a host process against a started ``KubeNode``, as its own ServiceAccount.

    ``start()`` installs CRDs/RBAC/ServiceAccount, starts the controller and waits until
    it is ready (and, with ``wait_for_gc``, until the garbage collector handles Sandboxes);
    ``stop()`` stops the process (CRDs and RBAC stay). Timings of the last start:
    ``install_seconds`` (manifests applied, CRDs Established), ``start_seconds`` (all of
    ``start()``) and ``gc_wait_seconds`` (the part after the controller was ready).
    """

    def __init__(
        self,
        node: KubeNode,
        binary: Path | None = None,
        ready_timeout: float = 60.0,
        wait_for_gc: bool = True,
    ) -> None:
        self.node = node
        self.binary = binary or binary_path()
        self.ready_timeout = ready_timeout
        self.wait_for_gc = wait_for_gc
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0
        self.probe_port = 0
        self.install_seconds = 0.0
        self.start_seconds = 0.0
        self.gc_wait_seconds = 0.0

    @property
    def log_path(self) -> Path:
        assert self.node.workdir is not None, "the node is not started"
        return self.node.workdir / "agent-sandbox-controller.log"

    @property
    def kubeconfig_path(self) -> Path:
        assert self.node.workdir is not None, "the node is not started"
        return self.node.workdir / "agent-sandbox-controller.kubeconfig"

    def __enter__(self) -> AgentSandboxController:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
            raise RuntimeError(
                f"{BINARY} missing at {self.binary} (run: python -m harness.agent_sandbox build)"
            )
        if self.node.workdir is None:
            raise RuntimeError("the KubeNode is not started")
        started = time.monotonic()
        try:
            self.install()
            self.install_seconds = time.monotonic() - started
            if self.wait_for_gc:
                self._start_gc_probe()
            self._write_kubeconfig()
            self._start_process()
            if self.wait_for_gc:
                gc_started = time.monotonic()
                self._wait_gc_probe()
                self.gc_wait_seconds = time.monotonic() - gc_started
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # -- install
    def _apply(self, manifest: Manifest) -> Any:
        query = urllib.parse.urlencode({"fieldManager": FIELD_MANAGER, "force": "true"})
        try:
            return self.node.api(
                "PATCH",
                f"{manifest.path()}?{query}",
                manifest.text.encode(),
                content_type="application/apply-patch+yaml",
            )
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise RuntimeError(f"server-side apply of {manifest!r} failed ({exc.code}): {detail}") from exc

    def install(self) -> None:
        """Apply the CRDs, RBAC and ServiceAccount (idempotent) and wait for the CRDs to be Established."""
        manifests = install_manifests()
        for manifest in manifests:
            self._apply(manifest)
        pending = {m.name for m in manifests if m.kind == "CustomResourceDefinition"}
        deadline = time.monotonic() + 30
        while pending:
            for name in sorted(pending):
                crd = self.node.api("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                conditions = crd.get("status", {}).get("conditions", [])
                if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                    pending.discard(name)
            if not pending:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"CRDs not Established within 30s: {sorted(pending)}")
            time.sleep(0.2)

    def _gc_probe_path(self) -> str:
        return f"/apis/{API_VERSION}/namespaces/{NAMESPACE}/sandboxes/{GC_PROBE}"

    def _start_gc_probe(self) -> None:
        """Create a Suspended Sandbox (no pod, no controller needed) and delete it in the foreground."""
        path = self._gc_probe_path()
        try:
            self.node.api(
                "POST",
                path.rsplit("/", 1)[0],
                {
                    "apiVersion": API_VERSION,
                    "kind": "Sandbox",
                    "metadata": {"name": GC_PROBE},
                    "spec": {
                        "operatingMode": "Suspended",
                        "podTemplate": {
                            "spec": {"containers": [{"name": "probe", "image": "gc-probe:none"}]}
                        },
                    },
                },
            )
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # left over from an earlier start on this node: delete that one
                raise
        try:
            self.node.api(
                "DELETE",
                path,
                {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Foreground"},
            )
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise

    def _wait_gc_probe(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.node.api("GET", self._gc_probe_path())
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return
                raise
            time.sleep(0.1)
        raise RuntimeError(
            f"the garbage collector did not finish a foreground delete of Sandbox {NAMESPACE}/{GC_PROBE} "
            f"within {timeout:.0f}s (it has not picked up the agent-sandbox CRDs)"
        )

    def _write_kubeconfig(self) -> None:
        """A kubeconfig with a fresh TokenRequest token of the controller's ServiceAccount."""
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 2 * 24 * 3600},
        }
        resp = self.node.api(
            "POST",
            f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{SERVICE_ACCOUNT}/token",
            request,
        )
        user = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
        self.kubeconfig_path.write_text(self.node._kubeconfig(user, resp["status"]["token"]))
        self.kubeconfig_path.chmod(0o600)

    # -- process
    def _command(self) -> list[str]:
        return [
            str(self.binary),
            "--extensions",
            "--leader-elect=false",
            f"--metrics-bind-address=127.0.0.1:{self.metrics_port}",
            f"--health-probe-bind-address=127.0.0.1:{self.probe_port}",
            f"--kubeconfig={self.kubeconfig_path}",
            # tuning flags of the controller's own, e.g. for the bench's warm bursts
            *os.environ.get("SANDBOX_LANES_AGENT_SANDBOX_ARGS", "").split(),
        ]

    def _start_process(self) -> None:
        last = ""
        for _attempt in range(3):
            self.metrics_port, self.probe_port = _free_port(), _free_port()
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            with self.log_path.open("ab") as fh:
                fh.write(f"\n# {' '.join(self._command())}\n".encode())
                fh.flush()
                self.proc = subprocess.Popen(
                    self._command(),
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            if self._wait_ready(offset):
                return
            last = _tail(self.log_path)
            code = self.proc.poll()
            if code is None:
                self.stop()
                raise RuntimeError(
                    f"{BINARY} did not become ready within {self.ready_timeout:.0f}s "
                    f"(log {self.log_path}):\n{last}"
                )
            self.proc = None
            if "address already in use" not in last:
                raise RuntimeError(f"{BINARY} exited with code {code} (log {self.log_path}):\n{last}")
        raise RuntimeError(f"{BINARY} could not bind its loopback ports (3 attempts):\n{last}")

    def _wait_ready(self, log_offset: int) -> bool:
        """``/readyz`` (a plain ping once the manager runs), then the Sandbox controller's workers."""
        assert self.proc is not None
        url = f"http://127.0.0.1:{self.probe_port}/readyz"
        probe_ok = False
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if not probe_ok:
                try:
                    with urllib.request.urlopen(url, timeout=2) as resp:
                        probe_ok = resp.status == 200
                except (urllib.error.URLError, OSError):
                    pass
            if probe_ok and self._workers_started(log_offset):
                return True
            time.sleep(0.1)
        return False

    def _workers_started(self, log_offset: int) -> bool:
        with self.log_path.open("rb") as fh:
            fh.seek(log_offset)
            log = fh.read().decode(errors="replace")
        return any("Starting workers" in ln and '"sandbox"' in ln for ln in log.splitlines())


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "build", help=f"compile agent-sandbox-controller {VERSION} into the cache (skipped when present)"
    )
    sub.add_parser("path", help="print the binary path")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        build()
        return 0
    print(binary_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
