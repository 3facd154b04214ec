"""A real single-node Kubernetes on loopback: the apiserver of ``harness.kube_apiserver`` plus
kube-controller-manager, kube-scheduler, containerd and a kubelet, so pods actually run.

Standard library only. The binaries come from the one cached ``go build`` of
``harness.kube_apiserver``; containerd, runc and the CNI loopback plugin are Debian's.

What this node can and cannot do (``../shared/notes/kubelet-node.md`` has the study):

* Pods run with ``hostNetwork: true`` only: the CNI config is loopback-only, so a pod
  with its own network namespace never gets an address. A MutatingAdmissionPolicy
  (``HOST_NETWORK_POLICY``) sets it on every pod created, so the driver's manifests stay
  exactly what a real cluster receives. (A namespace enforcing the ``baseline`` or
  ``restricted`` Pod Security level then refuses pods: a test relaxes that label.)
* PVCs are bound by the controller-manager's hostPath provisioner (testing only; it
  writes under ``/tmp/hostpath_pv``), through a default StorageClass.
* Images come from ``ctr images import`` (no registry): a pause image and the runner
  stand-in, both the busybox rootfs of ``harness.dockerd``, plus whatever a test imports.
* containerd must clamp oom_score_adj (``restrict_oom_score_adj``): root lacks
  CAP_SYS_RESOURCE here, and runc fails every pod sandbox otherwise.
* The kubelet changes three sysctls; ``stop()`` restores them and leaves no process,
  mount, kubepods cgroup or hostPath volume behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Final

from harness.dockerd import DEFAULT_BUSYBOX, build_rootfs_tar, unmount_under
from harness.image_archive import docker_archive
from harness.kube_apiserver import KubeApiServer, _free_port, _tail, _terminate, binary_path

PAUSE_IMAGE: Final = "localhost/sandbox-lanes/pause:local"
#: The runner stand-in (``/runner/bin/start`` + ``/runner/dist/main.js`` of harness.dockerd).
RUNNER_IMAGE: Final = "localhost/sandbox-lanes/runner:test"
CONTAINERD_NAMESPACE: Final = "k8s.io"
HOSTPATH_PV_ROOT: Final = Path("/tmp/hostpath_pv")
STORAGE_CLASS: Final = "test-node-hostpath"
HOST_NETWORK_POLICY: Final = "test-node-host-network"
#: The kubelet sets these (``protectKernelDefaults: false``); saved at start, restored at stop.
KUBELET_SYSCTLS: Final = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
NODE_USER_UID: Final = "uid-node"
_PAUSE_SCRIPT: Final = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"


def _sh(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Never raises on a hung tool: stop() must go on to the next step."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, -1, "", f"timed out after {timeout:.0f}s")


def _cgroup_dirs(name: str) -> list[Path]:
    """``name`` under every cgroup v1 controller hierarchy (and the v2 root, if unified)."""
    root = Path("/sys/fs/cgroup")
    found = []
    with contextlib.suppress(OSError):
        if (root / "cgroup.controllers").exists():
            return [root / name]
        for controller in root.iterdir():
            if controller.is_dir() and not controller.is_symlink() and (controller / "tasks").exists():
                found.append(controller / name)
    return found


def _remove_cgroup_tree(top: Path) -> None:
    """rmdir bottom-up (a cgroup directory goes away with rmdir once it has no tasks)."""
    dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
    for d in [*dirs, top]:
        with contextlib.suppress(OSError):
            d.rmdir()


class KubeNode(KubeApiServer):
    """etcd, kube-apiserver, controller-manager, scheduler, containerd and kubelet on 127.0.0.1.

    ``start()`` returns once the node is Ready, the default StorageClass exists and the
    pause and runner images are imported; ``stop()`` undoes everything.
    """

    def __init__(self, ready_timeout: float = 120.0) -> None:
        super().__init__(binary=binary_path(command="kube-apiserver"), ready_timeout=ready_timeout)
        self.node_name = socket.gethostname()
        self.node_token = ""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._saved_sysctls: dict[str, str] = {}
        self._hostpath_before: set[str] = set()
        #: The kubelet's cgroup root, its own so two nodes (or a leftover) never share ``kubepods``.
        self.cgroup_root = f"sandbox-lanes-kube-{os.getpid()}-{id(self) & 0xFFFF:x}"

    # -- paths
    @property
    def containerd_socket(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "containerd" / "containerd.sock"

    def _log(self, name: str) -> Path:
        assert self.workdir is not None
        return self.workdir / f"{name}.log"

    # -- lifecycle
    def start(self, workdir: Path | None = None) -> None:
        for command in ("kube-controller-manager", "kube-scheduler", "kubelet"):
            path = binary_path(command=command)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise RuntimeError(
                    f"{command} missing at {path} (run: python -m harness.kube_apiserver build)"
                )
        for tool in ("containerd", "runc", "ctr"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} not found (install Debian's containerd and runc)")
        if not Path("/usr/lib/cni/loopback").is_file():
            raise RuntimeError("/usr/lib/cni/loopback not found (install containernetworking-plugins)")
        super().start(workdir)
        try:
            self._hostpath_before = set(os.listdir(HOSTPATH_PV_ROOT)) if HOSTPATH_PV_ROOT.is_dir() else set()
            self._start_controllers()
            self._start_containerd()
            self.import_image(
                docker_archive(
                    build_rootfs_tar(DEFAULT_BUSYBOX),
                    PAUSE_IMAGE,
                    entrypoint=["/bin/sh", "-c", _PAUSE_SCRIPT],
                )
            )
            self.import_image(
                docker_archive(
                    build_rootfs_tar(DEFAULT_BUSYBOX),
                    RUNNER_IMAGE,
                    entrypoint=["/runner/bin/start"],
                    cmd=["/runner/dist/main.js"],
                    workdir="/workspace",
                )
            )
            self._start_kubelet()
            self._wait_node_ready()
            self._apply_cluster_defaults()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for name in ("kubelet", "kube-scheduler", "kube-controller-manager"):
            proc = self.procs.pop(name, None)
            if proc is not None and proc.poll() is None:
                _terminate(proc.pid, timeout=10)
        if "containerd" in self.procs:
            self._kill_pod_containers()
            proc = self.procs.pop("containerd")
            if proc.poll() is None:
                _terminate(proc.pid, timeout=10)
            self._kill_leftover_shims()
        if self.workdir is not None:
            unmount_under(self.workdir)
        for top in _cgroup_dirs(self.cgroup_root):
            _remove_cgroup_tree(top)
        self._restore_sysctls()
        if HOSTPATH_PV_ROOT.is_dir():
            for name in set(os.listdir(HOSTPATH_PV_ROOT)) - self._hostpath_before:
                shutil.rmtree(HOSTPATH_PV_ROOT / name, ignore_errors=True)
            with contextlib.suppress(OSError):
                HOSTPATH_PV_ROOT.rmdir()
        super().stop()

    # -- the apiserver, as a node's
    def _write_pki(self) -> None:
        import secrets

        super()._write_pki()
        assert self.workdir is not None
        self.node_token = secrets.token_hex(24)
        tokens = self.workdir / "pki" / "tokens.csv"
        with tokens.open("a") as fh:
            fh.write(f'{self.node_token},system:node:{self.node_name},{NODE_USER_UID},"system:nodes"\n')

    def apiserver_flags(self) -> list[str]:
        flags = [
            f
            for f in super().apiserver_flags()
            if not f.startswith(("--authorization-mode=", "--enable-admission-plugins="))
        ]
        return [
            *flags,
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction,ResourceQuota,MutatingAdmissionPolicy",
            # exec and logs reach the kubelet by the hostname, which resolves to 127.0.0.1 here
            "--kubelet-preferred-address-types=Hostname",
            "--feature-gates=MutatingAdmissionPolicy=true",
            "--runtime-config=admissionregistration.k8s.io/v1beta1=true",
        ]

    # -- processes
    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        with self._log(name).open("ab") as fh:
            proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.procs[name] = proc
        return proc

    def _start_controllers(self) -> None:
        assert self.workdir is not None
        pki = self.workdir / "pki"
        kubeconfig = str(self.kubeconfig_path)
        common = [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            "--v=1",
        ]
        self._spawn(
            "kube-controller-manager",
            [
                str(binary_path(command="kube-controller-manager")),
                *common,
                f"--secure-port={_free_port()}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                "--enable-hostpath-provisioner=true",
                # the garbage collector and namespace controller must act within a test's time
                "--concurrent-gc-syncs=5",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [str(binary_path(command="kube-scheduler")), *common, f"--secure-port={_free_port()}"],
        )

    def _start_containerd(self) -> None:
        assert self.workdir is not None
        base = self.workdir / "containerd"
        (base / "root").mkdir(parents=True)
        (base / "state").mkdir()
        cni = self.workdir / "cni" / "net.d"
        cni.mkdir(parents=True)
        (cni / "10-lo.conflist").write_text(
            json.dumps({"cniVersion": "0.4.0", "name": "lo-only", "plugins": [{"type": "loopback"}]})
        )
        config = base / "config.toml"
        config.write_text(
            f"""version = 2
root = "{base / "root"}"
state = "{base / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{base / "containerd.sock.ttrpc"}"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # root lacks CAP_SYS_RESOURCE here: without this every pod sandbox fails in runc
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"""
        )
        proc = self._spawn("containerd", ["containerd", "--config", str(config)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"containerd exited ({proc.returncode}):\n{_tail(self._log('containerd'))}"
                )
            if self._ctr("version").returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"containerd did not answer within 30s:\n{_tail(self._log('containerd'))}")

    def _ctr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return _sh(
            ["ctr", "--address", str(self.containerd_socket), "-n", CONTAINERD_NAMESPACE, *args], timeout
        )

    def import_image(self, archive: bytes | Path) -> None:
        """``ctr images import`` of a docker-archive tarball (bytes or a file) into the CRI namespace."""
        assert self.workdir is not None
        if isinstance(archive, Path):
            path, owned = archive, False
        else:
            path, owned = self.workdir / "import.tar", True
            path.write_bytes(archive)
        try:
            result = self._ctr("images", "import", str(path), timeout=600)
        finally:
            if owned:
                path.unlink(missing_ok=True)
        if result.returncode != 0:
            raise RuntimeError(f"ctr images import failed: {result.stderr.strip() or result.stdout.strip()}")

    def images(self) -> list[str]:
        return self._ctr("images", "ls", "-q").stdout.split()

    def _save_sysctls(self) -> None:
        for key in KUBELET_SYSCTLS:
            with contextlib.suppress(OSError):
                self._saved_sysctls[key] = Path("/proc/sys", key).read_text().strip()

    def _restore_sysctls(self) -> None:
        for key, value in self._saved_sysctls.items():
            with contextlib.suppress(OSError):
                Path("/proc/sys", key).write_text(value)
        self._saved_sysctls.clear()

    def _start_kubelet(self) -> None:
        assert self.workdir is not None
        kubelet_dir = self.workdir / "kubelet"
        kubelet_dir.mkdir()
        node_kubeconfig = self.workdir / "node.kubeconfig"
        node_kubeconfig.write_text(self._kubeconfig(f"system:node:{self.node_name}", self.node_token))
        node_kubeconfig.chmod(0o600)
        config: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": _free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": _free_port(),
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_root}",
            "failSwapOn": False,
            "failCgroupV1": False,
            "oomScoreAdj": 0,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "podLogsDir": str(self.workdir / "pod-logs"),
            "volumePluginDir": str(self.workdir / "volume-plugins"),
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "maxPods": 250,
        }
        config_path = self.workdir / "kubelet-config.json"
        config_path.write_text(json.dumps(config, indent=2))
        self._save_sysctls()
        for d in _cgroup_dirs(self.cgroup_root):  # the kubelet requires its cgroup root to exist
            d.mkdir(exist_ok=True)
        self._spawn(
            "kubelet",
            [
                str(binary_path(command="kubelet")),
                f"--config={config_path}",
                f"--kubeconfig={node_kubeconfig}",
                f"--root-dir={kubelet_dir}",
                f"--hostname-override={self.node_name}",
                "--v=1",
            ],
        )

    # -- API helpers (stdlib, admin token)
    def api(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.admin_token}", "Content-Type": content_type},
        )
        with urllib.request.urlopen(req, timeout=30, context=ctx) as resp:
            return json.loads(resp.read() or b"null")

    def _wait_node_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        last = "node not registered"
        while time.monotonic() < deadline:
            for name in ("kubelet", "kube-controller-manager", "kube-scheduler", "containerd"):
                if self.procs[name].poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({self.procs[name].returncode}):\n{_tail(self._log(name))}"
                    )
            try:
                node = self.api("GET", f"/api/v1/nodes/{self.node_name}")
                ready = [c for c in node["status"].get("conditions", []) if c["type"] == "Ready"]
                if ready and ready[0]["status"] == "True" and not node["spec"].get("taints"):
                    return
                last = json.dumps(ready)
            except (urllib.error.URLError, OSError, KeyError) as exc:
                last = str(exc)
            time.sleep(0.3)
        raise RuntimeError(
            f"node {self.node_name} not Ready within {self.ready_timeout:.0f}s ({last}):\n"
            f"{_tail(self._log('kubelet'))}"
        )

    def _apply_cluster_defaults(self) -> None:
        self.api(
            "POST",
            "/apis/storage.k8s.io/v1/storageclasses",
            {
                "apiVersion": "storage.k8s.io/v1",
                "kind": "StorageClass",
                "metadata": {
                    "name": STORAGE_CLASS,
                    "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
                },
                "provisioner": "kubernetes.io/host-path",
                "reclaimPolicy": "Delete",
                "volumeBindingMode": "Immediate",
            },
        )
        policy = "/apis/admissionregistration.k8s.io/v1beta1/mutatingadmissionpolicies"
        self.api(
            "POST",
            policy,
            {
                "apiVersion": "admissionregistration.k8s.io/v1beta1",
                "kind": "MutatingAdmissionPolicy",
                "metadata": {"name": HOST_NETWORK_POLICY},
                "spec": {
                    "matchConstraints": {
                        "resourceRules": [
                            {
                                "apiGroups": [""],
                                "apiVersions": ["v1"],
                                "operations": ["CREATE"],
                                "resources": ["pods"],
                            }
                        ]
                    },
                    "failurePolicy": "Fail",
                    "reinvocationPolicy": "Never",
                    "mutations": [
                        {
                            "patchType": "ApplyConfiguration",
                            "applyConfiguration": {
                                "expression": "Object{spec: Object.spec{hostNetwork: true}}"
                            },
                        }
                    ],
                },
            },
        )
        self.api(
            "POST",
            policy.replace("policies", "policybindings"),
            {
                "apiVersion": "admissionregistration.k8s.io/v1beta1",
                "kind": "MutatingAdmissionPolicyBinding",
                "metadata": {"name": HOST_NETWORK_POLICY},
                "spec": {"policyName": HOST_NETWORK_POLICY},
            },
        )
        self._wait_host_network_policy()

    def _wait_host_network_policy(self) -> None:
        """The apiserver loads a new policy asynchronously: dry-run a pod until it comes back mutated."""
        probe = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "host-network-probe", "namespace": "default"},
            "spec": {"containers": [{"name": "probe", "image": RUNNER_IMAGE}]},
        }
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            created = self.api("POST", "/api/v1/namespaces/default/pods?dryRun=All", probe)
            if created["spec"].get("hostNetwork"):
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"the {HOST_NETWORK_POLICY} MutatingAdmissionPolicy did not take effect within 30s"
        )

    # -- teardown
    def _kill_pod_containers(self) -> None:
        tasks = self._ctr("tasks", "ls", "-q").stdout.split()
        for task in tasks:
            self._ctr("tasks", "kill", "-s", "SIGKILL", task, timeout=15)
        deadline = time.monotonic() + 15
        for task in tasks:
            while time.monotonic() < deadline:
                if self._ctr("tasks", "delete", task, timeout=15).returncode == 0:
                    break
                if task not in self._ctr("tasks", "ls", "-q").stdout.split():
                    break
                time.sleep(0.2)
        for container in self._ctr("containers", "ls", "-q").stdout.split():
            self._ctr("containers", "delete", container, timeout=15)

    def _kill_leftover_shims(self) -> None:
        marker = str(self.containerd_socket)
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "containerd-shim" in cmdline and marker in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGKILL)
