"""The agent-sandbox controller of the harness really reconciles Sandboxes on the session's node.

One plain ``Sandbox`` (``agents.x-k8s.io/v1beta1``) with the runner stand-in image goes
through its whole life: Ready, Suspended (pod gone), Running again, foreground delete. The
timings are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import contextlib
import time
import urllib.error
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from harness.agent_sandbox import API_VERSION, AgentSandboxController
from harness.kube_node import RUNNER_IMAGE, KubeNode

pytestmark = pytest.mark.kubernetes

POLL = 0.02


def _get(node: KubeNode, path: str) -> Any:
    try:
        return node.api("GET", path)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def _wait(what: str, check: Callable[[], Any], timeout: float = 60.0) -> tuple[Any, float]:
    """Poll ``check`` until it returns something truthy; returns (that, seconds waited)."""
    started = time.monotonic()
    while True:
        result = check()
        if result:
            return result, time.monotonic() - started
        assert time.monotonic() - started < timeout, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(POLL)


def _condition(sandbox: Any, kind: str) -> dict[str, Any]:
    for cond in (sandbox or {}).get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return dict(cond)
    return {}


def test_a_sandbox_runs_suspends_resumes_and_is_deleted(
    kube_node: KubeNode, agent_sandbox: AgentSandboxController
) -> None:
    node = kube_node
    ns = f"as-{uuid.uuid4().hex[:10]}"
    name = "sb"
    sandboxes = f"/apis/{API_VERSION}/namespaces/{ns}/sandboxes"
    pods = f"/api/v1/namespaces/{ns}/pods"
    print(
        f"\ncontroller: install {agent_sandbox.install_seconds:.2f}s, start {agent_sandbox.start_seconds:.2f}s "
        f"(of which waiting for the garbage collector {agent_sandbox.gc_wait_seconds:.2f}s)"
    )

    node.api(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    )
    try:
        # Pod admission needs the namespace's default ServiceAccount, the kubelet its root CA ConfigMap.
        _wait(
            "the default ServiceAccount",
            lambda: _get(node, f"/api/v1/namespaces/{ns}/serviceaccounts/default"),
        )
        _wait("kube-root-ca.crt", lambda: _get(node, f"/api/v1/namespaces/{ns}/configmaps/kube-root-ca.crt"))

        def sandbox() -> Any:
            return _get(node, f"{sandboxes}/{name}")

        def running_pods() -> list[Any]:
            return [
                p
                for p in node.api("GET", pods)["items"]
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
            ]

        def no_pods() -> bool:
            return not node.api("GET", pods)["items"]

        def ready() -> bool:
            return _condition(sandbox(), "Ready").get("status") == "True"

        def set_mode(mode: str) -> None:
            node.api(
                "PATCH",
                f"{sandboxes}/{name}",
                {"spec": {"operatingMode": mode}},
                content_type="application/merge-patch+json",
            )

        times: dict[str, float] = {}
        created = time.monotonic()
        node.api(
            "POST",
            sandboxes,
            {
                "apiVersion": API_VERSION,
                "kind": "Sandbox",
                "metadata": {"name": name},
                "spec": {
                    "operatingMode": "Running",
                    "podTemplate": {
                        "metadata": {"labels": {"sandbox-lanes.test/role": "runner"}},
                        "spec": {
                            "terminationGracePeriodSeconds": 5,
                            "containers": [
                                {"name": "runner", "image": RUNNER_IMAGE, "imagePullPolicy": "Never"}
                            ],
                        },
                    },
                },
            },
        )
        _wait("the Sandbox's Ready condition", ready)
        times["create -> Ready"] = time.monotonic() - created
        (pod,), _ = _wait("a Running pod", running_pods)
        times["create -> pod Running"] = time.monotonic() - created
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner.get("controller")) == ("Sandbox", name, True)
        assert pod["metadata"]["labels"]["sandbox-lanes.test/role"] == "runner"
        print(f"pod {pod['metadata']['name']}; Sandbox status {sandbox()['status']}")

        set_mode("Suspended")
        _, times["suspend -> pod gone"] = _wait("the pod to go", no_pods)
        _, times["suspend -> Suspended=True"] = _wait(
            "Suspended=True", lambda: _condition(sandbox(), "Suspended").get("status") == "True"
        )
        suspended = sandbox()
        assert _condition(suspended, "Suspended")["reason"] == "PodTerminated"
        assert _condition(suspended, "Ready")["status"] == "False"
        assert _condition(suspended, "Ready")["reason"] == "SandboxSuspended"
        print(f"suspended: {suspended['status']}")

        resumed = time.monotonic()
        set_mode("Running")
        _wait("a Running pod again", running_pods)
        times["resume -> pod Running"] = time.monotonic() - resumed
        _wait("Ready again", ready)
        times["resume -> Ready"] = time.monotonic() - resumed
        print(f"resumed: {sandbox()['status']}")

        deleted = time.monotonic()
        node.api(
            "DELETE",
            f"{sandboxes}/{name}",
            {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Foreground"},
        )
        seen: list[Any] = []

        def gone() -> bool:
            current = sandbox()
            if current is not None and not seen:
                seen.append(current["metadata"])
            pods_gone = no_pods()
            if pods_gone and "delete -> pod gone" not in times:
                times["delete -> pod gone"] = time.monotonic() - deleted
            return current is None and pods_gone

        _wait("the Sandbox and its pod to go", gone)
        times["delete (foreground) -> Sandbox and pod gone"] = time.monotonic() - deleted
        if seen:
            meta = seen[0]
            print(
                f"during foreground delete: deletionTimestamp={meta.get('deletionTimestamp')} "
                f"finalizers={meta.get('finalizers')}"
            )
        for what, seconds in times.items():
            print(f"{what}: {seconds:.3f}s")
    finally:
        with contextlib.suppress(urllib.error.HTTPError):
            node.api("DELETE", f"/api/v1/namespaces/{ns}")
