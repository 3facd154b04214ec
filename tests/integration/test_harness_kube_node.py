"""The single-node cluster of the harness cleans up after itself: a real pod with real volumes, then stop.

Its own node (own workdir, containerd and kubelet cgroup root), so it can run beside the
session's ``kube_node``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from harness.kube_node import HOSTPATH_PV_ROOT, KUBELET_SYSCTLS, RUNNER_IMAGE, KubeNode, _cgroup_dirs

pytestmark = pytest.mark.kubernetes


def _sysctls() -> dict[str, str]:
    return {k: Path("/proc/sys", k).read_text().strip() for k in KUBELET_SYSCTLS}


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline[:120]}")
    return found


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path)
    return [
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[1].startswith(prefix)
    ]


def _listing(path: Path) -> set[str]:
    return set(os.listdir(path)) if path.is_dir() else set()


def test_a_stopped_node_leaves_no_process_mount_cgroup_netns_sysctl_or_volume_behind() -> None:
    sysctls_before = _sysctls()
    netns_before = _listing(Path("/run/netns"))
    hostpath_before = _listing(HOSTPATH_PV_ROOT)
    node = KubeNode()
    node.start()
    try:
        assert node.workdir is not None
        workdir = node.workdir
        ns = "default"
        node.api(
            "POST",
            f"/api/v1/namespaces/{ns}/secrets",
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v"}},
        )
        node.api(
            "POST",
            f"/api/v1/namespaces/{ns}/persistentvolumeclaims",
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "c"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Mi"}}},
            },
        )
        node.api(
            "POST",
            f"/api/v1/namespaces/{ns}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "p"},
                "spec": {
                    "containers": [
                        {
                            "name": "runner",
                            "image": RUNNER_IMAGE,
                            "volumeMounts": [
                                {"name": "s", "mountPath": "/s"},
                                {"name": "c", "mountPath": "/workspace"},
                                {"name": "e", "mountPath": "/e"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "s", "secret": {"secretName": "s"}},
                        {"name": "c", "persistentVolumeClaim": {"claimName": "c"}},
                        {"name": "e", "emptyDir": {}},
                    ],
                },
            },
        )
        deadline = time.monotonic() + 60
        while node.api("GET", f"/api/v1/namespaces/{ns}/pods/p")["status"].get("phase") != "Running":
            assert time.monotonic() < deadline, "the pod did not reach Running"
            time.sleep(0.25)
        # What stop() must undo is really there while the node runs.
        assert _processes_mentioning(str(workdir)), "no node process found by its workdir"
        assert _mounts_under(workdir), "no mount under the node's workdir"
        assert any(d.is_dir() and any(d.iterdir()) for d in _cgroup_dirs(node.cgroup_root))
        assert _listing(HOSTPATH_PV_ROOT) - hostpath_before, "the claim got no hostPath volume"
    finally:
        node.stop()
    assert _processes_mentioning(str(workdir)) == []
    assert _mounts_under(workdir) == []
    assert not workdir.exists()
    assert [d for d in _cgroup_dirs(node.cgroup_root) if d.exists()] == []
    assert _listing(Path("/run/netns")) == netns_before
    assert _listing(HOSTPATH_PV_ROOT) == hostpath_before
    assert _sysctls() == sysctls_before
