"""The pod deployed by its own manifests (``compose/kubernetes/``) on the harness's single-node cluster.

The repo's Dockerfile is built on the test engine (``pod_image``), saved and imported into the
node's containerd. The manifests are applied as shipped, plus only what loopback needs (the
``loopback_overlay`` below says each change and why). The pod then talks to the API server
with its ServiceAccount's token (in-cluster config), so a runner pod coming up proves the
shipped Role is enough, and a Role missing one verb must fail the create with the API
server's reason, promptly, not hang.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest
import yaml
from harness.dockerd import Dockerd
from harness.kube_node import RUNNER_IMAGE, KubeNode
from kubernetes import client, utils

from consumers.ops.settings import load_settings
from events.sandbox_lanes.v1 import common_pb2, outcomes_pb2
from tests.fixtures.dockerd import POD_IMAGE
from tests.pod_harness import produce, read_topic, unique_env, wf_terminal
from tests.test_kubernetes_node import SMALL_RUNNER, env_inside, runner_pods, running_runner_pod, wait_for
from tests.test_ops_http import free_port
from tests.test_pod_drivers_e2e import created

pytestmark = [pytest.mark.kubernetes, pytest.mark.docker, pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "compose" / "kubernetes"
POD_NAMESPACE = "sandbox-lanes"
SANDBOX_NAMESPACE = "stigmer-sandboxes"
SERVICE_ACCOUNT = f"system:serviceaccount:{POD_NAMESPACE}:sandbox-lanes"
#: Applied in this order: namespaces first, the Deployment last.
ORDER = ("namespace", "serviceaccount", "role", "rolebinding", "service", "deployment")


def shipped_manifests() -> list[dict[str, Any]]:
    files = sorted(MANIFESTS.glob("*.yaml"), key=lambda p: ORDER.index(p.stem))
    assert [p.stem for p in files] == list(ORDER), "a manifest was added or renamed: order it here"
    return [doc for p in files for doc in yaml.safe_load_all(p.read_text()) if doc]


def loopback_overlay(docs: list[dict[str, Any]], env: dict[str, str], http_port: int) -> list[dict[str, Any]]:
    """What this node needs and a real cluster does not; nothing else changes."""
    out = copy.deepcopy(docs)
    for doc in out:
        if doc["kind"] == "Namespace" and doc["metadata"]["name"] == POD_NAMESPACE:
            # No pod network here: every pod runs with hostNetwork (the node's admission policy),
            # which the `restricted` Pod Security level refuses.
            doc["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] = "privileged"
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        container["image"] = POD_IMAGE  # imported into containerd: no registry to pull from
        container["imagePullPolicy"] = "Never"
        # hostNetwork: the metrics port is a host port, so a free one; probes on loopback.
        container["ports"][0]["containerPort"] = http_port
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            container[probe]["httpGet"]["host"] = "127.0.0.1"
        by_name = {e["name"]: e for e in container["env"]}
        for name, value in env.items():
            if name in by_name:
                by_name[name].pop("valueFrom", None)
                by_name[name]["value"] = value
            else:
                container["env"].append({"name": name, "value": value})
    return out


def _apply(api: Any, docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        utils.create_from_dict(api, doc)


def _delete_namespaces(core: Any) -> None:
    for ns in (POD_NAMESPACE, SANDBOX_NAMESPACE):
        try:
            core.delete_namespace(ns, grace_period_seconds=0)
        except client.exceptions.ApiException as exc:
            if exc.status != 404:
                raise


def _namespaces_gone(core: Any) -> bool:
    names = {n.metadata.name for n in core.list_namespace().items}
    return not names & {POD_NAMESPACE, SANDBOX_NAMESPACE}


def _import_pod_image(dockerd: Dockerd, node: KubeNode) -> None:
    assert node.workdir is not None
    engine = docker.DockerClient(base_url=dockerd.socket_url, version="auto", timeout=900)
    archive = node.workdir / "pod-image.tar"
    try:
        with archive.open("wb") as fh:
            for chunk in engine.images.get(POD_IMAGE).save(named=True):
                fh.write(chunk)
        node.import_image(archive)
    finally:
        archive.unlink(missing_ok=True)
        engine.close()


def _ready_pod(core: Any) -> Any:
    pods = core.list_namespaced_pod(
        POD_NAMESPACE, label_selector="app.kubernetes.io/name=sandbox-lanes"
    ).items
    for pod in pods:
        conditions = {c.type: c.status for c in pod.status.conditions or []}
        if conditions.get("Ready") == "True":
            return pod
    return None


@pytest.mark.timeout(1800)  # the first user of pod_image builds it: several minutes on vfs
async def test_the_pod_deployed_by_its_manifests_provisions_runners_under_its_least_privilege_role(
    dockerd: Dockerd,
    pod_image: dict[str, Any],
    kube_node: KubeNode,
    node_admin: Any,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    core, rbac = client.CoreV1Api(node_admin), client.RbacAuthorizationV1Api(node_admin)
    await wait_for("namespaces of an earlier run to go", lambda: _namespaces_gone(core), timeout=120)
    await asyncio.to_thread(_import_pod_image, dockerd, kube_node)

    isolated = unique_env(kafka_bootstrap, tmp_path)
    http_port = free_port()
    loopback = {
        **{
            k: v
            for k, v in isolated.items()
            if k.startswith(("SANDBOX_LANES_TOPIC_", "SANDBOX_LANES_GROUP_ID"))
        },
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SANDBOX_LANES_PARTITIONS": "2",
        "SANDBOX_LANES_HTTP_HOST": "127.0.0.1",
        "SANDBOX_LANES_HTTP_PORT": str(http_port),
        # in-cluster config: the API server's loopback address instead of the Service's ClusterIP
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(kube_node.port),
        "STIGMER_SANDBOX_BACKEND_ENDPOINT": "http://127.0.0.1:7234",
        "STIGMER_SANDBOX_TEMPORAL_ADDRESS": "127.0.0.1:7233",
        "STIGMER_SANDBOX_RUNNER_IMAGE": RUNNER_IMAGE,
        "SANDBOX_LANES_DRIVER_OPTIONS": ",".join(f"{k}={v}" for k, v in SMALL_RUNNER.items()),
    }
    topics = load_settings({**isolated, **loopback}).topics
    docs = loopback_overlay(shipped_manifests(), loopback, http_port)
    try:
        _apply(node_admin, docs[:1])  # the namespaces, then the token key the Deployment refers to
        core.create_namespaced_secret(
            POD_NAMESPACE,
            {
                "metadata": {"name": "sandbox-lanes-runner-token-key"},
                "data": {"key": base64.b64encode(base64.b64encode(secrets.token_bytes(32))).decode()},
            },
        )
        _apply(node_admin, docs[1:])
        started = time.monotonic()
        pod = await wait_for("the sandbox-lanes pod to be Ready", lambda: _ready_pod(core), timeout=180)
        ready_after = time.monotonic() - started
        assert pod.spec.service_account_name == "sandbox-lanes"

        # ExecutionCreated -> a runner pod, created by the pod under its own Role.
        execution = f"wfx_deploy_{uuid.uuid4().hex[:8]}"
        await produce(
            kafka_bootstrap,
            isolated,
            created(execution, common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD),
        )
        (provisioned,) = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1, timeout_s=60)
        assert isinstance(provisioned.message, outcomes_pb2.SandboxProvisioned), provisioned.message
        assert provisioned.message.sandbox.driver == "kubernetes"
        runner = await wait_for(
            "the runner pod", lambda: running_runner_pod(core, SANDBOX_NAMESPACE, execution), timeout=90
        )
        inside = env_inside(core, SANDBOX_NAMESPACE, runner.metadata.name)
        assert execution in inside["STIGMER_TASK_QUEUE"]
        assert inside["STIGMER_TOKEN"].count(".") == 2  # minted with the key from the pod's Secret
        assert "STIGMER_RUNNER_TOKEN_KEY" not in inside  # the pod's own secret never reaches a runner
        assert "KAFKA_BOOTSTRAP_SERVERS" not in inside

        await produce(kafka_bootstrap, isolated, wf_terminal(execution))
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=2, timeout_s=60)
        assert isinstance(outcomes[-1].message, outcomes_pb2.SandboxDeprovisioned)
        await wait_for(
            "the runner pod to go", lambda: not runner_pods(core, SANDBOX_NAMESPACE, execution), timeout=90
        )

        # The Role minus one verb: the create fails with the API server's reason, promptly.
        role = rbac.read_namespaced_role("sandbox-lanes-provisioner", SANDBOX_NAMESPACE)
        for rule in role.rules:
            if rule.resources == ["secrets"]:
                rule.verbs = [v for v in rule.verbs if v != "create"]
        rbac.replace_namespaced_role("sandbox-lanes-provisioner", SANDBOX_NAMESPACE, role)
        denied = f"wfx_denied_{uuid.uuid4().hex[:8]}"
        await asyncio.sleep(1)  # the authorizer's cache follows the Role through a watch
        sent = time.monotonic()
        await produce(
            kafka_bootstrap,
            isolated,
            created(denied, common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD),
        )
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=3, timeout_s=60)
        failed = outcomes[-1].message
        answered_after = time.monotonic() - sent
        assert isinstance(failed, outcomes_pb2.SandboxFailed), failed
        assert failed.execution_id == denied and failed.critical
        assert "forbidden" in failed.reason and SERVICE_ACCOUNT in failed.reason, failed.reason
        assert 'cannot create resource "secrets"' in failed.reason, failed.reason
        assert runner_pods(core, SANDBOX_NAMESPACE, denied) == []
        print(f"\npod Ready {ready_after:.1f}s after apply; denied create answered in {answered_after:.1f}s")
    finally:
        _delete_namespaces(core)
        await wait_for("the test namespaces to go", lambda: _namespaces_gone(core), timeout=120)
