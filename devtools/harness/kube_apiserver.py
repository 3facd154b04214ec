"""Build and run a real ``kube-apiserver`` (+ etcd) on loopback, envtest style.

Standard library only, so CI can call it before anything else is installed::

    python devtools/harness/kube_apiserver.py build        # compile all five once into the cache (idempotent)
    python devtools/harness/kube_apiserver.py start        # etcd + kube-apiserver; prints kubeconfig paths
    python devtools/harness/kube_apiserver.py stop         # stop what ``start`` left running
    python devtools/harness/kube_apiserver.py path kubectl # print a built binary's path

Build
    ``go install k8s.io/kubernetes/cmd/kube-apiserver@vX`` is refused by the go
    command because k8s.io/kubernetes' go.mod carries ``replace`` directives
    (every ``k8s.io/<staging>`` repository points at ``./staging/src/...``). The
    workaround: a throwaway module in the cache directory that requires
    ``k8s.io/kubernetes vX`` and replaces every staging repository named in that
    go.mod with its published ``v0.<minor>.<patch>`` tag, then ``go build`` the
    command packages. Everything is fetched through the Go module proxy. One
    ``go build`` makes all of ``COMMANDS`` (the single-node cluster of
    ``harness.kube_node`` needs the other three servers, and ``kubectl`` applies the
    shipped kustomize overlays as the README says); they land in
    ``$SANDBOX_LANES_CACHE/kube-<version>/`` (default cache root
    ``~/.cache/sandbox-lanes``), outside the repository. A cache that holds some of
    them (one built before a command was added) builds only the missing ones.

Start
    Like controller-runtime's envtest: etcd on free loopback ports with a temp
    data dir, a self-signed serving certificate (``openssl``), a service-account
    signing key, a static token file holding an admin token (``system:masters``)
    and an unprivileged user token, RBAC authorization and the ResourceQuota
    admission plugin. Waits for ``/readyz`` and writes two kubeconfigs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.cache import cache_root

DEFAULT_VERSION = "v1.34.4"
ETCD_BINARY = "etcd"
UNPRIVILEGED_USER = "sandbox-lanes-unprivileged"
ADMIN_USER = "sandbox-lanes-admin"


# --------------------------------------------------------------------------- build


def kube_version() -> str:
    return os.environ.get("SANDBOX_LANES_KUBE_VERSION", DEFAULT_VERSION)


#: Built together in one ``go build``: the apiserver alone for the API-only tests, the
#: controller-manager, scheduler and kubelet for the single-node cluster (``harness.kube_node``),
#: and kubectl (``cmd/kubectl``, with its kustomize) for ``kubectl apply -k`` of the shipped overlays.
COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl")
KUBECTL = "kubectl"


def binary_dir(version: str | None = None) -> Path:
    v = version or kube_version()
    return cache_root() / f"kube-{v}"


def binary_path(version: str | None = None, command: str = "kube-apiserver") -> Path:
    return binary_dir(version) / command


def kubectl_path(version: str | None = None) -> Path:
    """The kubectl built from the same Kubernetes source as the servers (``build``)."""
    return binary_path(version, KUBECTL)


def _built(version: str, command: str) -> bool:
    path = binary_path(version, command)
    return path.is_file() and os.access(path, os.X_OK)


def _all_built(version: str) -> bool:
    return all(_built(version, c) for c in COMMANDS)


def _staging_version(version: str) -> str:
    m = re.fullmatch(r"v1\.(\d+)\.(\d+)", version)
    if not m:
        raise SystemExit(f"unsupported kubernetes version {version!r} (expected v1.<minor>.<patch>)")
    return f"v0.{m.group(1)}.{m.group(2)}"


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env["GOFLAGS"] = "-mod=mod"
    env.setdefault("GOTOOLCHAIN", "local")
    env.setdefault("CGO_ENABLED", "0")
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout)
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return proc.stdout


def _parse_kubernetes_gomod(text: str) -> tuple[str, list[str], list[str]]:
    """Return (go directive, godebug lines, staging module paths replaced to ./staging)."""
    go_directive = "1.24.0"
    m = re.search(r"^go\s+(\S+)\s*$", text, re.MULTILINE)
    if m:
        go_directive = m.group(1)
    godebug: list[str] = re.findall(r"^godebug\s+.+$", text, re.MULTILINE)
    block = re.search(r"^godebug\s*\((.*?)^\)", text, re.MULTILINE | re.DOTALL)
    if block:
        godebug += [f"godebug {ln.strip()}" for ln in block.group(1).splitlines() if ln.strip()]
    staging = sorted(
        set(re.findall(r"^\s*(?:replace\s+)?(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", text, re.MULTILINE))
    )
    return go_directive, godebug, staging


def build(version: str | None = None) -> Path:
    version = version or kube_version()
    out_dir = binary_dir(version)
    if _all_built(version):
        print(f"kubernetes {version} already built: {out_dir}", flush=True)
        return out_dir
    if shutil.which("go") is None:
        raise SystemExit("the go toolchain is required to build kubernetes")
    missing = [c for c in COMMANDS if not _built(version, c)]
    work = out_dir / "build-module"
    work.mkdir(parents=True, exist_ok=True)
    env = _go_env()
    started = time.monotonic()

    info = json.loads(_run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{version}"], work, env))
    gomod_text = Path(info["GoMod"]).read_text()
    go_directive, godebug, staging = _parse_kubernetes_gomod(gomod_text)
    if not staging:
        raise SystemExit("found no staging replace directives in k8s.io/kubernetes' go.mod")
    sv = _staging_version(version)
    lines = [
        "// Throwaway module generated by devtools/harness/kube_apiserver.py: builds the kubernetes commands",
        "// from k8s.io/kubernetes with the staging repos pinned to their published tags.",
        "module sandbox-lanes.local/kube-apiserver-build",
        "",
        f"go {go_directive}",
        "",
        *godebug,
        "",
        f"require k8s.io/kubernetes {version}",
        "",
        "replace (",
        *[f"\t{mod} => {mod} {sv}" for mod in staging],
        ")",
        "",
    ]
    (work / "go.mod").write_text("\n".join(lines))
    (work / "go.sum").touch()
    # Resolve the full graph first so the build step itself is offline-clean.
    _run(["go", "get", *[f"k8s.io/kubernetes/cmd/{c}@{version}" for c in COMMANDS]], work, env)
    ldflags = " ".join(
        [
            "-s",
            "-w",
            *[
                flag
                # component-base for the servers, client-go for `kubectl version` (as hack/lib/version.sh)
                for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
                for flag in (
                    f"-X {pkg}.gitVersion={version}",
                    f"-X {pkg}.gitMajor={version.split('.')[0].lstrip('v')}",
                    f"-X {pkg}.gitMinor={version.split('.')[1]}",
                    f"-X {pkg}.gitTreeState=clean",
                )
            ],
        ]
    )
    partial = out_dir / "partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    # One go build of all five (or of the missing ones): they share most packages, so this costs
    # about what the apiserver alone did.
    _run(
        [
            "go",
            "build",
            "-p",
            str(max(1, os.cpu_count() or 1)),
            "-trimpath",
            f"-ldflags={ldflags}",
            "-o",
            str(partial) + "/",
            *[f"k8s.io/kubernetes/cmd/{c}" for c in missing],
        ],
        work,
        env,
    )
    for c in missing:
        (partial / c).chmod(0o755)
        (partial / c).replace(out_dir / c)
    partial.rmdir()
    elapsed = time.monotonic() - started
    print(f"built kubernetes {version} ({', '.join(missing)}) in {elapsed:.0f}s: {out_dir}", flush=True)
    return out_dir


# --------------------------------------------------------------------------- start / stop


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _openssl(args: list[str], cwd: Path) -> None:
    proc = subprocess.run(
        ["openssl", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {proc.stdout.strip()}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _terminate(pid: int, timeout: float = 15.0) -> None:
    """Stop one process we started, by its pid: SIGTERM, then SIGKILL after ``timeout``."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return
        except ChildProcessError:  # not our child (CLI stop): poll for existence instead
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


class KubeApiServer:
    """etcd + kube-apiserver on loopback, with an admin and an unprivileged kubeconfig.

    ``start()`` blocks until ``/readyz`` answers ok; ``stop()`` kills both
    processes and removes the temporary directory. Usable as a context manager.
    """

    def __init__(
        self,
        binary: Path | None = None,
        etcd_binary: str | None = None,
        ready_timeout: float = 120.0,
    ) -> None:
        self.binary = binary or binary_path()
        self.etcd_binary = etcd_binary or shutil.which(ETCD_BINARY) or ETCD_BINARY
        self.ready_timeout = ready_timeout
        self.workdir: Path | None = None
        self.etcd_proc: subprocess.Popen[bytes] | None = None
        self.apiserver_proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.etcd_url = ""
        self.admin_token = ""
        self.unprivileged_token = ""
        self.unprivileged_user = UNPRIVILEGED_USER

    # -- public surface
    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def kubeconfig_path(self) -> Path:
        assert self.workdir is not None, "not started"
        return self.workdir / "admin.kubeconfig"

    @property
    def unprivileged_kubeconfig_path(self) -> Path:
        assert self.workdir is not None, "not started"
        return self.workdir / "unprivileged.kubeconfig"

    @property
    def ca_path(self) -> Path:
        assert self.workdir is not None, "not started"
        return self.workdir / "pki" / "ca.crt"

    def kubectl(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``kubectl <args>`` (the harness's build) as admin against this server; never raises on exit."""
        return subprocess.run(
            [str(kubectl_path()), f"--kubeconfig={self.kubeconfig_path}", *args],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=timeout,
        )

    def __enter__(self) -> KubeApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, workdir: Path | None = None) -> None:
        if not (self.binary.is_file() and os.access(self.binary, os.X_OK)):
            raise RuntimeError(
                f"kube-apiserver binary missing at {self.binary} (run: kube_apiserver.py build)"
            )
        if shutil.which(self.etcd_binary) is None:
            raise RuntimeError(f"etcd binary {self.etcd_binary!r} not found")
        if shutil.which("openssl") is None:
            raise RuntimeError("openssl not found")
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="sandbox-lanes-kube-"))
        try:
            self._write_pki()
            self._start_etcd()
            self._start_apiserver()
            self._write_kubeconfigs()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for attr in ("apiserver_proc", "etcd_proc"):
            proc: subprocess.Popen[bytes] | None = getattr(self, attr)
            if proc is not None and proc.poll() is None:
                _terminate(proc.pid)
            setattr(self, attr, None)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    # -- internals
    def _write_pki(self) -> None:
        assert self.workdir is not None
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        (pki / "ca.ext").write_text(
            "basicConstraints=critical,CA:TRUE\n"
            "keyUsage=critical,keyCertSign,cRLSign,digitalSignature\n"
            "subjectKeyIdentifier=hash\n"
        )
        (pki / "serving.ext").write_text(
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid\n"
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        )
        _openssl(["genrsa", "-out", "ca.key", "2048"], pki)
        _openssl(
            ["req", "-new", "-key", "ca.key", "-subj", "/CN=sandbox-lanes-test-ca", "-out", "ca.csr"], pki
        )
        _openssl(
            [
                "x509",
                "-req",
                "-in",
                "ca.csr",
                "-signkey",
                "ca.key",
                "-days",
                "2",
                "-sha256",
                "-extfile",
                "ca.ext",
                "-out",
                "ca.crt",
            ],
            pki,
        )
        _openssl(["genrsa", "-out", "serving.key", "2048"], pki)
        _openssl(["req", "-new", "-key", "serving.key", "-subj", "/CN=127.0.0.1", "-out", "serving.csr"], pki)
        _openssl(
            [
                "x509",
                "-req",
                "-in",
                "serving.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-sha256",
                "-extfile",
                "serving.ext",
                "-out",
                "serving.crt",
            ],
            pki,
        )
        _openssl(["genrsa", "-out", "sa.key", "2048"], pki)
        _openssl(["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"], pki)
        self.admin_token = secrets.token_hex(24)
        self.unprivileged_token = secrets.token_hex(24)
        tokens = pki / "tokens.csv"
        tokens.write_text(
            f'{self.admin_token},{ADMIN_USER},uid-admin,"system:masters"\n'
            f"{self.unprivileged_token},{UNPRIVILEGED_USER},uid-unprivileged\n"
        )
        tokens.chmod(0o600)

    def _start_etcd(self) -> None:
        assert self.workdir is not None
        last = ""
        for _attempt in range(3):
            client, peer = _free_port(), _free_port()
            self.etcd_url = f"http://127.0.0.1:{client}"
            log = self.workdir / "etcd.log"
            cmd = [
                self.etcd_binary,
                "--name=sandbox-lanes",
                f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=sandbox-lanes=http://127.0.0.1:{peer}",
                "--listen-metrics-urls=",
                "--logger=zap",
                "--log-level=warn",
            ]
            with log.open("ab") as fh:
                self.etcd_proc = subprocess.Popen(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
                )
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if self.etcd_proc.poll() is not None:
                    break
                try:
                    with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2) as resp:
                        if b"true" in resp.read():
                            return
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.2)
            last = _tail(log)
            if self.etcd_proc.poll() is None:
                _terminate(self.etcd_proc.pid)
            self.etcd_proc = None
        raise RuntimeError(f"etcd did not become healthy:\n{last}")

    def apiserver_flags(self) -> list[str]:
        assert self.workdir is not None
        pki = self.workdir / "pki"
        return [
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.port}",
            "--advertise-address=127.0.0.1",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--authorization-mode=RBAC",
            f"--token-auth-file={pki / 'tokens.csv'}",
            f"--tls-cert-file={pki / 'serving.crt'}",
            f"--tls-private-key-file={pki / 'serving.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--enable-admission-plugins=ResourceQuota",
            f"--cert-dir={pki}",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ]

    def _start_apiserver(self) -> None:
        assert self.workdir is not None
        log = self.workdir / "kube-apiserver.log"
        last, code = "", None
        for _attempt in range(3):
            self.port = _free_port()
            with log.open("ab") as fh:
                self.apiserver_proc = subprocess.Popen(
                    [str(self.binary), *self.apiserver_flags()],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            if self._wait_ready():
                return
            last = _tail(log)
            code = self.apiserver_proc.poll()
            if code is None:
                _terminate(self.apiserver_proc.pid)
                self.apiserver_proc = None
                raise RuntimeError(
                    f"kube-apiserver did not become ready within {self.ready_timeout:.0f}s:\n{last}"
                )
            self.apiserver_proc = None  # exited: maybe a lost port race, so retry on a new port
        raise RuntimeError(f"kube-apiserver exited with code {code} (3 attempts):\n{last}")

    def _wait_ready(self) -> bool:
        assert self.apiserver_proc is not None
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        req = urllib.request.Request(
            f"{self.url}/readyz", headers={"Authorization": f"Bearer {self.admin_token}"}
        )
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.apiserver_proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
                    if resp.status == 200 and resp.read().strip() == b"ok":
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        return False

    def _kubeconfig(self, user: str, token: str) -> str:
        import base64

        ca = base64.b64encode(self.ca_path.read_bytes()).decode()
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "sandbox-lanes", "cluster": {"server": self.url, "certificate-authority-data": ca}}
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "sandbox-lanes", "user": user}}],
            "current-context": user,
            "preferences": {},
        }
        return json.dumps(doc, indent=2)  # JSON is valid YAML; every kubeconfig loader accepts it

    def _write_kubeconfigs(self) -> None:
        for path, user, token in (
            (self.kubeconfig_path, ADMIN_USER, self.admin_token),
            (self.unprivileged_kubeconfig_path, UNPRIVILEGED_USER, self.unprivileged_token),
        ):
            path.write_text(self._kubeconfig(user, token))
            path.chmod(0o600)


# --------------------------------------------------------------------------- CLI


def _state_file() -> Path:
    return cache_root() / "run" / "kube-apiserver.json"


def cmd_start() -> int:
    state = _state_file()
    if state.exists():
        print(f"already started (state in {state}); run `stop` first", file=sys.stderr)
        return 1
    server = KubeApiServer()
    server.start()
    assert server.workdir and server.etcd_proc and server.apiserver_proc
    state.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "url": server.url,
        "workdir": str(server.workdir),
        "kubeconfig": str(server.kubeconfig_path),
        "unprivileged_kubeconfig": str(server.unprivileged_kubeconfig_path),
        "etcd_pid": server.etcd_proc.pid,
        "apiserver_pid": server.apiserver_proc.pid,
    }
    state.write_text(json.dumps(info, indent=2))
    # Detach: the processes run in their own sessions and outlive this command.
    server.etcd_proc = server.apiserver_proc = None
    server.workdir = None
    print(json.dumps(info, indent=2))
    return 0


def cmd_stop() -> int:
    state = _state_file()
    if not state.exists():
        print("not started", file=sys.stderr)
        return 0
    info = json.loads(state.read_text())
    for key in ("apiserver_pid", "etcd_pid"):
        _terminate(int(info[key]))
    shutil.rmtree(info["workdir"], ignore_errors=True)
    state.unlink()
    print("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the kubernetes commands into the cache (skipped when present)")
    b.add_argument("--version", default=None, help=f"kubernetes version (default {DEFAULT_VERSION})")
    sub.add_parser("start", help="start etcd + kube-apiserver in the background")
    sub.add_parser("stop", help="stop what `start` started")
    p = sub.add_parser("path", help="print a binary's path (default kube-apiserver)")
    p.add_argument("command", nargs="?", default="kube-apiserver", choices=COMMANDS)
    args = parser.parse_args(argv)
    if args.cmd == "build":
        build(args.version)
        return 0
    if args.cmd == "start":
        return cmd_start()
    if args.cmd == "stop":
        return cmd_stop()
    print(binary_path(command=args.command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
