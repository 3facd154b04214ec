"""The kubernetes driver on a real single-node cluster (``harness.kube_node``): runner pods actually run.

The API-only tests (``test_kubernetes_driver.py``) pin object shapes against a bare apiserver;
these show what only a kubelet can: the runner pod reaches Running, sees upstream's
environment (read from inside the pod with exec, not from the API object), keeps its
workspace across a scale to 0 and back, and really goes away on deprovision, PVC and
volume included. Figures from this node are in the README's Kubernetes section.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from harness.kube_node import RUNNER_IMAGE, KubeNode
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import stream

from drivers.contract import DriverConfig, SandboxEnvironment
from drivers.kubernetes.driver import KubernetesProvisioner, new_kubernetes_provisioner
from drivers.kubernetes.manifests import pvc_name, secret_name
from drivers.naming import LABEL_SANDBOX_ID, sandbox_base_name

pytestmark = pytest.mark.kubernetes

LOG = logging.getLogger("test.kubernetes.node")
TOKEN = "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJub2RlLXRlc3QifQ.c2lnbmF0dXJl"
#: A 2-core node: upstream's default requests (500m each) would fit three runners.
SMALL_RUNNER = {
    "cpu_request": "10m",
    "memory_request": "16Mi",
    "cpu_limit": "250m",
    "memory_limit": "64Mi",
    "storage_size": "16Mi",
}


def node_driver_config(namespace: str, kubeconfig: Path, **options: str) -> DriverConfig:
    return DriverConfig(
        backend_endpoint="http://127.0.0.1:7234",
        temporal_address="127.0.0.1:7233",
        runner_image=RUNNER_IMAGE,
        kubernetes_namespace=namespace,
        temporal_namespace="sandboxes",
        mcp_public_endpoint="https://mcp.example.test",
        runner_env={"RUNNER_LOG_LEVEL": "debug"},
        runner_secret_env={"ANTHROPIC_API_KEY": "sk-ant-node-secret"},
        temporal_connection_env={"STIGMER_TEMPORAL_API_KEY": "temporal-node-key"},
        options={"kubeconfig": str(kubeconfig), **SMALL_RUNNER, **options},
    )


@pytest.fixture
async def node_driver(kube_node: KubeNode, node_namespace: str) -> AsyncIterator[KubernetesProvisioner]:
    p = new_kubernetes_provisioner(node_driver_config(node_namespace, kube_node.kubeconfig_path), LOG)
    try:
        yield p
    finally:
        await p.close()


async def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll ``probe`` (in a thread: the client blocks) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(probe)
        if last:
            return last
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def runner_pods(core: Any, namespace: str, sandbox_id: str) -> list[Any]:
    pods = core.list_namespaced_pod(namespace, label_selector=f"{LABEL_SANDBOX_ID}={sandbox_id}").items
    return list(pods)


def running_runner_pod(core: Any, namespace: str, sandbox_id: str) -> Any:
    pods = [
        p
        for p in runner_pods(core, namespace, sandbox_id)
        if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
    ]
    return pods[0] if len(pods) == 1 else None


def pod_exec(core: Any, namespace: str, pod: str, command: list[str]) -> str:
    """``exec`` in the runner container, on a client of its own: ``kubernetes.stream`` swaps the
    client's request method for the call, which would break concurrent REST calls on a shared one."""
    own = client.ApiClient(core.api_client.configuration)
    try:
        out: str = stream(
            client.CoreV1Api(own).connect_get_namespaced_pod_exec,
            pod,
            namespace,
            container="runner",
            command=command,
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
        )
        return out
    finally:
        own.close()


def env_inside(core: Any, namespace: str, pod: str) -> dict[str, str]:
    lines = pod_exec(core, namespace, pod, ["/bin/env"]).splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def gone(read: Callable[[], Any]) -> bool:
    try:
        read()
    except ApiException as exc:
        return exc.status == 404
    return False


async def test_a_runner_pod_runs_with_upstreams_environment_keeps_its_workspace_and_goes_away(
    kube_node: KubeNode, node_admin: Any, node_namespace: str, node_driver: KubernetesProvisioner
) -> None:
    core, apps = client.CoreV1Api(node_admin), client.AppsV1Api(node_admin)
    ns = node_namespace
    session = f"ses_node_{uuid.uuid4().hex[:8]}"
    base = sandbox_base_name("session", session)
    started = time.monotonic()
    state = await node_driver.ensure(
        "session", session, SandboxEnvironment(task_queue=f"session:{session}", stigmer_token=TOKEN)
    )
    assert state == "running"
    pod = await wait_for("the runner pod to run", lambda: running_runner_pod(core, ns, session))
    time_to_running = time.monotonic() - started
    LOG.info("ensure -> runner pod Running in %.2fs", time_to_running)

    # Upstream's environment, as the process inside the pod sees it.
    env = env_inside(core, ns, pod.metadata.name)
    assert env["STIGMER_TASK_QUEUE"] == f"session:{session}"
    assert env["STIGMER_BACKEND_ENDPOINT"] == "http://127.0.0.1:7234"
    assert env["TEMPORAL_SERVICE_ADDRESS"] == "127.0.0.1:7233"
    assert env["TEMPORAL_NAMESPACE"] == "sandboxes"
    assert env["STIGMER_TEMPORAL_API_KEY"] == "temporal-node-key"
    assert env["STIGMER_TOKEN"] == TOKEN  # from the Secret, through secretKeyRef
    assert env["ANTHROPIC_API_KEY"] == "sk-ant-node-secret"
    assert env["STIGMER_MCP_PUBLIC_ENDPOINT"] == "https://mcp.example.test"
    assert env["RUNNER_LOG_LEVEL"] == "debug"
    assert (env["MODE"], env["WORKSPACE_ROOT_DIR"], env["HOME"]) == ("local", "/workspace", "/root")
    # The runner got no service account token: it cannot talk to the API server as anyone.
    assert "No such file" in pod_exec(
        core, ns, pod.metadata.name, ["/bin/ls", "/var/run/secrets/kubernetes.io/serviceaccount"]
    )
    # The stand-in runner's own log: it started as root in /workspace (the launch contract).
    logs = core.read_namespaced_pod_log(pod.metadata.name, ns, container="runner")
    assert "runner stand-in up: uid=0 cwd=/workspace" in logs

    # The session's workspace is a bound claim; what the runner writes there survives a stop.
    claim = core.read_namespaced_persistent_volume_claim(pvc_name(base), ns)
    assert claim.status.phase == "Bound"
    pod_exec(core, ns, pod.metadata.name, ["/bin/sh", "-c", "echo kept > /workspace/marker"])

    # Upstream's "stopped" arm: a Deployment at 0 replicas has no pod; ensure scales it back to 1.
    apps.patch_namespaced_deployment_scale(base, ns, {"spec": {"replicas": 0}})
    await wait_for("the pod of the stopped sandbox to go", lambda: not runner_pods(core, ns, session))
    assert (await node_driver.probe("session", session)) == "stopped"
    await node_driver.ensure(
        "session", session, SandboxEnvironment(task_queue=f"session:{session}", stigmer_token=TOKEN)
    )
    again = await wait_for("the runner pod to run again", lambda: running_runner_pod(core, ns, session))
    assert again.metadata.name != pod.metadata.name
    assert pod_exec(core, ns, again.metadata.name, ["/bin/cat", "/workspace/marker"]).strip() == "kept"

    # Deprovision: the pod terminates (the runner exits on SIGTERM), and every object is gone,
    # the claim too (the controller-manager drops its protection finalizer once no pod uses it)
    # and the volume behind it (reclaim policy Delete).
    volume = claim.spec.volume_name
    await node_driver.deprovision("session", session)
    await wait_for("the runner pod to terminate", lambda: not runner_pods(core, ns, session), timeout=90)
    for what, read in (
        ("the Deployment", lambda: apps.read_namespaced_deployment(base, ns)),
        ("the Secret", lambda: core.read_namespaced_secret(secret_name(base), ns)),
        ("the PVC", lambda: core.read_namespaced_persistent_volume_claim(pvc_name(base), ns)),
        ("the PV", lambda: core.read_persistent_volume(volume)),
    ):
        await wait_for(f"{what} to be deleted", lambda read=read: gone(read), timeout=60)
    assert (await node_driver.probe("session", session)) == "absent"


async def test_a_workflow_runner_launched_token_less_runs_without_the_token_variable(
    kube_node: KubeNode, node_admin: Any, node_namespace: str, node_driver: KubernetesProvisioner
) -> None:
    core = client.CoreV1Api(node_admin)
    execution = f"wfx_node_{uuid.uuid4().hex[:8]}"
    await node_driver.ensure("workflow", execution, SandboxEnvironment(task_queue=f"wfexec:{execution}"))
    try:
        pod = await wait_for(
            "the runner pod to run", lambda: running_runner_pod(core, node_namespace, execution)
        )
        env = env_inside(core, node_namespace, pod.metadata.name)
        assert env["STIGMER_TASK_QUEUE"] == f"wfexec:{execution}"
        assert "STIGMER_TOKEN" not in env
    finally:
        await node_driver.deprovision("workflow", execution)
    await wait_for("the runner pod to terminate", lambda: not runner_pods(core, node_namespace, execution))
