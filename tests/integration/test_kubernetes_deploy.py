"""The pod deployed by the shipped kustomize overlays (``compose/kubernetes/overlays/<driver>``) on the
harness's single-node cluster, with exactly the README's command: ``kubectl apply -k <overlay>``.

``kubectl`` is the harness's, built from the same Kubernetes source as the node's servers
(``harness.kube_apiserver``). The repo's Dockerfile is built on the test engine (``pod_image``), saved
and imported into the node's containerd. What kubectl applies is a test-only kustomization generated
into a tmp dir (``node_overlay``): its one resource is the shipped overlay, plus only what this node
needs, each change said there and why; a render of both proves nothing else differs. The pod then
talks to the API server with its ServiceAccount's token (in-cluster config), so a runner coming up
proves the overlay's Role is enough, and a Role missing one verb must fail with the API server's
reason, promptly, not hang.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest
import yaml
from harness.agent_sandbox import AgentSandboxController
from harness.dockerd import Dockerd
from harness.kube_apiserver import kubectl_path
from harness.kube_node import RUNNER_IMAGE, KubeNode
from kubernetes import client
from prometheus_client import CollectorRegistry

from consumers.ops.settings import load_settings
from consumers.runtime.capacity_metrics import CapacityMetrics
from consumers.runtime.metrics import PodMetrics
from drivers.agent_sandbox.manifests import GROUP, PLURAL, VERSION
from drivers.agent_sandbox.warm import ANNOTATION_ASSIGNED, CLAIMS, EXT_GROUP, EXT_VERSION
from drivers.naming import sandbox_base_name
from events.sandbox_lanes.v1 import common_pb2, outcomes_pb2
from tests.integration.test_agent_sandbox_driver import runner_process_env
from tests.integration.test_kubernetes_node import (
    SMALL_RUNNER,
    env_inside,
    gone,
    runner_pods,
    running_runner_pod,
    wait_for,
)
from tests.integration.test_ops_http import free_port
from tests.integration.test_pod_drivers_e2e import created
from tests.support.fixtures.dockerd import POD_IMAGE
from tests.support.pod_harness import create_inputs, produce, read_topic, unique_env, wf_terminal

pytestmark = [pytest.mark.kubernetes, pytest.mark.docker, pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "compose" / "kubernetes"
OVERLAYS = KUSTOMIZE / "overlays"
POD_NAMESPACE = "sandbox-lanes"
SANDBOX_NAMESPACE = "stigmer-sandboxes"
SERVICE_ACCOUNT = f"system:serviceaccount:{POD_NAMESPACE}:sandbox-lanes"
ROLE = "sandbox-lanes-provisioner"
TOKEN_KEY_SECRET = "sandbox-lanes-runner-token-key"
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


# --------------------------------------------------------------------------- the node's overlay


def node_overlay(into: Path, shipped: Path, env: dict[str, str], http_port: int, token_key: str) -> Path:
    """A kustomization whose one resource is ``shipped``, plus what this node needs and a real
    cluster does not; nothing else changes (``test_the_node_overlay_changes_only_what_the_node_needs``)."""
    into.mkdir(parents=True, exist_ok=True)
    image, _, tag = POD_IMAGE.partition(":")
    container = "/spec/template/spec/containers/0"
    deployment_ops = [
        # imported into containerd: there is no registry to pull from
        {"op": "replace", "path": f"{container}/imagePullPolicy", "value": "Never"},
        # hostNetwork: the metrics port is a host port, so a free one, and the probes on loopback
        {"op": "replace", "path": f"{container}/ports/0/containerPort", "value": http_port},
        *[{"op": "add", "path": f"{container}/{p}/httpGet/host", "value": "127.0.0.1"} for p in PROBES],
    ]
    # Kafka, the API server, the backend and Temporal on loopback; the test's own topics and group.
    env_patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "sandbox-lanes", "namespace": POD_NAMESPACE},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": "sandbox-lanes", "env": [{"name": k, "value": v} for k, v in env.items()]}
                    ]
                }
            }
        },
    }
    # The signing key, as the README asks the operator to add it.
    (into / "token-key.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": TOKEN_KEY_SECRET, "namespace": POD_NAMESPACE},
                "data": {"key": base64.b64encode(token_key.encode()).decode()},
            }
        )
    )
    (into / "env.yaml").write_text(yaml.safe_dump(env_patch))
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(shipped, into), "token-key.yaml"],
        # The README's way to point at another image.
        "images": [{"name": "sandbox-lanes", "newName": image, "newTag": tag}],
        "patches": [
            # No pod network here: every pod runs with hostNetwork (the node's admission policy),
            # which the `restricted` and `baseline` Pod Security levels refuse.
            *[
                {
                    "target": {"kind": "Namespace", "name": ns},
                    "patch": json.dumps(
                        [
                            {
                                "op": "replace",
                                "path": "/metadata/labels/pod-security.kubernetes.io~1enforce",
                                "value": "privileged",
                            }
                        ]
                    ),
                }
                for ns in (POD_NAMESPACE, SANDBOX_NAMESPACE)
            ],
            {"target": {"kind": "Deployment", "name": "sandbox-lanes"}, "patch": json.dumps(deployment_ops)},
            {"path": "env.yaml"},
        ],
    }
    (into / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return into


def _node_paths(env: dict[str, str]) -> list[tuple[str, ...]]:
    """Where a render of the node overlay may differ from the shipped overlay's (path prefixes)."""
    c = ("Deployment", "spec", "template", "spec", "containers", "sandbox-lanes")
    return [
        *[("Namespace", "metadata", "labels", "pod-security.kubernetes.io/enforce")],
        (*c, "image"),
        (*c, "imagePullPolicy"),
        (*c, "ports", "metrics", "containerPort"),
        *[(*c, p, "httpGet", "host") for p in PROBES],
        *[(*c, "env", name) for name in env],
    ]


def _leaves(obj: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every scalar by its path; list items with a ``name`` are keyed by it (env, containers, ports)."""
    if isinstance(obj, dict):
        out: dict[tuple[str, ...], Any] = {}
        for k, v in obj.items():
            out.update(_leaves(v, (*prefix, str(k))))
        return out
    if isinstance(obj, list):
        named = all(isinstance(i, dict) and "name" in i for i in obj) and obj
        out = {}
        for n, item in enumerate(obj):
            out.update(_leaves(item, (*prefix, str(item["name"]) if named else str(n))))
        return out
    return {prefix: obj}


# --------------------------------------------------------------------------- kubectl


def kubectl(node: KubeNode, *args: str) -> str:
    proc = node.kubectl(*args)
    assert proc.returncode == 0, f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
    return proc.stdout


def render(kustomization: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """``kubectl kustomize`` (no cluster): the objects by (kind, name)."""
    proc = subprocess.run(
        [str(kubectl_path()), "kustomize", str(kustomization)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{proc.stderr}"
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


# --------------------------------------------------------------------------- the cluster


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


_IMPORTED: set[str] = set()  # the node workdirs the pod image went into (once per session's node)


def _import_pod_image(dockerd: Dockerd, node: KubeNode) -> None:
    assert node.workdir is not None
    if str(node.workdir) in _IMPORTED:
        return
    engine = docker.DockerClient(base_url=dockerd.socket_url, version="auto", timeout=900)
    archive = node.workdir / "pod-image.tar"
    try:
        with archive.open("wb") as fh:
            for chunk in engine.images.get(POD_IMAGE).save(named=True):
                fh.write(chunk)
        node.import_image(archive)
        _IMPORTED.add(str(node.workdir))
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


def _diagnosis(core: Any) -> str:
    """What a pod that never got Ready says: its status and its log's tail."""
    out = []
    for pod in core.list_namespaced_pod(POD_NAMESPACE).items:
        out.append(f"pod {pod.metadata.name}: {pod.status.phase} {pod.status.container_statuses}")
        try:
            log = core.read_namespaced_pod_log(pod.metadata.name, POD_NAMESPACE, tail_lines=20)
        except client.exceptions.ApiException as exc:
            log = f"(no log: {exc.reason})"
        out.append(log)
    events = core.list_namespaced_event(POD_NAMESPACE).items
    out += [f"event {e.reason}: {e.message}" for e in events[-10:]]
    return "\n".join(out)


class Deployed:
    """The overlay applied with ``kubectl apply -k``, the pod Ready; its topics and Kafka settings."""

    def __init__(self, isolated: dict[str, str], topics: Any, ready_after: float, applied: str) -> None:
        self.isolated = isolated
        self.topics = topics
        self.ready_after = ready_after
        self.applied = applied


def node_pod_env(
    isolated: dict[str, str],
    kafka_bootstrap: str,
    kube_node: KubeNode,
    http_port: int,
    driver_options: dict[str, str],
) -> dict[str, str]:
    """What a node overlay sets on the pod: its own topics and group (of ``isolated``), the broker,
    the HTTP port, the API server on loopback, the runner image and the driver's options."""
    return {
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
        "SANDBOX_LANES_DRIVER_OPTIONS": ",".join(f"{k}={v}" for k, v in driver_options.items()),
    }


async def deploy(
    driver: str,
    *,
    dockerd: Dockerd,
    kube_node: KubeNode,
    core: Any,
    kafka_bootstrap: str,
    tmp_path: Path,
    driver_options: dict[str, str],
) -> Deployed:
    await wait_for("namespaces of an earlier run to go", lambda: _namespaces_gone(core), timeout=120)
    await asyncio.to_thread(_import_pod_image, dockerd, kube_node)
    isolated = unique_env(kafka_bootstrap, tmp_path)
    http_port = free_port()
    env = node_pod_env(isolated, kafka_bootstrap, kube_node, http_port, driver_options)
    shipped = OVERLAYS / driver
    token_key = base64.b64encode(secrets.token_bytes(32)).decode()
    overlay = node_overlay(tmp_path / "node-overlay", shipped, env, http_port, token_key)

    # The node overlay changes only what it says: a render of each, object by object.
    ours, theirs = render(overlay), render(shipped)
    assert set(ours) - set(theirs) == {("Secret", TOKEN_KEY_SECRET)}
    assert set(theirs) <= set(ours)
    allowed = _node_paths(env)
    for key, doc in theirs.items():
        a, b = _leaves(doc, (key[0],)), _leaves(ours[key], (key[0],))
        changed = {p for p in a.keys() | b.keys() if a.get(p) != b.get(p)}
        unexpected = {p for p in changed if not any(p[: len(q)] == q for q in allowed)}
        assert not unexpected, f"{key}: the node overlay changed {sorted(unexpected)}"
    deployment = ours[("Deployment", "sandbox-lanes")]["spec"]["template"]["spec"]["containers"][0]
    assert deployment["image"] == POD_IMAGE
    assert {"name": "SANDBOX_PROVISIONER_TYPE", "value": driver} in deployment["env"]

    # The pod's settings as it will see them (the overlay sets the driver).
    pod_env = {**isolated, **env, "SANDBOX_PROVISIONER_TYPE": driver}
    await create_inputs(pod_env)  # the producing side's part: the pod never creates its inputs

    # The README's command, as the operator runs it.
    started = time.monotonic()
    applied = await asyncio.to_thread(kubectl, kube_node, "apply", "-k", str(overlay))
    assert re.search(r"^namespace/sandbox-lanes created$", applied, re.MULTILINE), applied
    assert re.search(rf"^role\.rbac\.authorization\.k8s\.io/{ROLE} created$", applied, re.MULTILINE), applied
    try:
        pod = await wait_for("the sandbox-lanes pod to be Ready", lambda: _ready_pod(core), timeout=180)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_diagnosis(core)}") from None
    ready_after = time.monotonic() - started
    assert pod.spec.service_account_name == "sandbox-lanes"
    return Deployed(isolated, load_settings(pod_env).topics, ready_after, applied)


async def _without_verbs(rbac: Any, resource: str, verbs: set[str]) -> None:
    """The applied Role with ``verbs`` taken off ``resource`` (a rule left with none is dropped)."""
    role = rbac.read_namespaced_role(ROLE, SANDBOX_NAMESPACE)
    rules = []
    for rule in role.rules:
        if resource in rule.resources:
            rule.verbs = [v for v in rule.verbs if v not in verbs]
        if rule.verbs:
            rules.append(rule)
    role.rules = rules
    rbac.replace_namespaced_role(ROLE, SANDBOX_NAMESPACE, role)
    # The authorizer's cache follows the Role through a watch: wait until the API server's own
    # answer for the pod's ServiceAccount (a SubjectAccessReview) is "denied" for every verb taken.
    authz = client.AuthorizationV1Api(rbac.api_client)
    name, _, sub = resource.partition("/")

    def allowed(verb: str) -> bool:
        review = authz.create_subject_access_review(
            {
                "spec": {
                    "user": SERVICE_ACCOUNT,
                    "groups": [
                        "system:serviceaccounts",
                        f"system:serviceaccounts:{POD_NAMESPACE}",
                        "system:authenticated",
                    ],
                    "resourceAttributes": {
                        "namespace": SANDBOX_NAMESPACE,
                        "group": "",
                        "resource": name,
                        "subresource": sub,
                        "verb": verb,
                    },
                }
            }
        )
        return bool(review.status.allowed)

    await wait_for(
        f"{resource} {sorted(verbs)} denied to the pod's ServiceAccount",
        lambda: not any(allowed(v) for v in verbs),
        timeout=30,
    )


# --------------------------------------------------------------------------- tests


def test_the_metrics_components_render_one_scrape_path_and_alerts_on_real_metrics(tmp_path: Path) -> None:
    """The optional components on an overlay: a ServiceMonitor instead of the Pod's annotations, and
    alerts whose every metric is one the pod serves."""
    mine = tmp_path / "with-monitoring"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(OVERLAYS / "kubernetes", mine)],
                "components": [
                    os.path.relpath(KUSTOMIZE / "components" / c, mine)
                    for c in ("service-monitor", "prometheus-rule")
                ],
            }
        )
    )
    plain, monitored = render(OVERLAYS / "kubernetes"), render(mine)
    annotations = plain[("Deployment", "sandbox-lanes")]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert "annotations" not in plain[("Service", "sandbox-lanes-metrics")]["metadata"]
    template = monitored[("Deployment", "sandbox-lanes")]["spec"]["template"]["metadata"]
    assert not [k for k in template.get("annotations") or {} if k.startswith("prometheus.io/")]
    monitor = monitored[("ServiceMonitor", "sandbox-lanes")]["spec"]
    service = monitored[("Service", "sandbox-lanes-metrics")]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]

    registry = CollectorRegistry()
    PodMetrics(registry)
    CapacityMetrics(registry)  # the capacity ledger's, registered beside them when a cap is set
    families = list(registry.collect())
    served = {f.name for f in families} | {f"{f.name}_total" for f in families if f.type == "counter"}
    rules = monitored[("PrometheusRule", "sandbox-lanes")]["spec"]["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {
        "SandboxLanesConsumerLag",
        "SandboxLanesCommitFailures",
        "SandboxLanesDeadLetters",
        "SandboxLanesLeakedSandboxes",
        "SandboxLanesCapacityFull",
    }
    for rule in rules:
        names = set(re.findall(r"\bsandbox_lanes_[a-z_]+", rule["expr"]))
        assert names and names <= served, (rule["alert"], names - served)


@pytest.mark.timeout(1800)  # the first user of pod_image builds it: several minutes on vfs
async def test_kubectl_apply_k_the_kubernetes_overlay_and_the_pod_provisions_under_its_role(
    dockerd: Dockerd,
    pod_image: dict[str, Any],
    kube_node: KubeNode,
    node_admin: Any,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    core, rbac = client.CoreV1Api(node_admin), client.RbacAuthorizationV1Api(node_admin)
    try:
        d = await deploy(
            "kubernetes",
            dockerd=dockerd,
            kube_node=kube_node,
            core=core,
            kafka_bootstrap=kafka_bootstrap,
            tmp_path=tmp_path,
            driver_options=SMALL_RUNNER,
        )
        # The guardrails went in with it.
        assert core.read_namespace(SANDBOX_NAMESPACE).metadata.labels["pod-security.kubernetes.io/warn"] == (
            "restricted"
        )
        assert core.read_namespaced_resource_quota("sandbox-quota", SANDBOX_NAMESPACE)
        assert core.read_namespaced_limit_range("sandbox-limits", SANDBOX_NAMESPACE)
        policies = client.NetworkingV1Api(node_admin).list_namespaced_network_policy(SANDBOX_NAMESPACE)
        assert "sandbox-default-deny" in {p.metadata.name for p in policies.items}
        assert client.PolicyV1Api(node_admin).read_namespaced_pod_disruption_budget(
            "sandbox-lanes", POD_NAMESPACE
        )

        # ExecutionCreated -> a runner pod, created by the pod under its own Role.
        execution = f"wfx_deploy_{uuid.uuid4().hex[:8]}"
        await produce(
            kafka_bootstrap,
            d.isolated,
            created(execution, common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD),
        )
        (provisioned,) = await read_topic(kafka_bootstrap, d.topics.outcomes, at_least=1, timeout_s=60)
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

        await produce(kafka_bootstrap, d.isolated, wf_terminal(execution))
        outcomes = await read_topic(kafka_bootstrap, d.topics.outcomes, at_least=2, timeout_s=60)
        assert isinstance(outcomes[-1].message, outcomes_pb2.SandboxDeprovisioned)
        await wait_for(
            "the runner pod to go", lambda: not runner_pods(core, SANDBOX_NAMESPACE, execution), timeout=90
        )

        # The Role minus one verb: the create fails with the API server's reason, promptly.
        await _without_verbs(rbac, "secrets", {"create"})
        denied = f"wfx_denied_{uuid.uuid4().hex[:8]}"
        sent = time.monotonic()
        await produce(
            kafka_bootstrap,
            d.isolated,
            created(denied, common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD),
        )
        outcomes = await read_topic(kafka_bootstrap, d.topics.outcomes, at_least=3, timeout_s=60)
        failed = outcomes[-1].message
        answered_after = time.monotonic() - sent
        assert isinstance(failed, outcomes_pb2.SandboxFailed), failed
        assert failed.execution_id == denied and failed.critical
        assert "forbidden" in failed.reason and SERVICE_ACCOUNT in failed.reason, failed.reason
        assert 'cannot create resource "secrets"' in failed.reason, failed.reason
        assert runner_pods(core, SANDBOX_NAMESPACE, denied) == []
        print(
            f"\npod Ready {d.ready_after:.1f}s after apply; denied create answered in {answered_after:.1f}s"
        )
    finally:
        _delete_namespaces(core)
        await wait_for("the test namespaces to go", lambda: _namespaces_gone(core), timeout=120)


def _claim(custom: Any, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = custom.get_namespaced_custom_object(
        EXT_GROUP, EXT_VERSION, SANDBOX_NAMESPACE, CLAIMS, name
    )
    return obj


def _sandbox(custom: Any, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = custom.get_namespaced_custom_object(GROUP, VERSION, SANDBOX_NAMESPACE, PLURAL, name)
    return obj


def _delivered(custom: Any, name: str) -> dict[str, Any] | None:
    try:
        claim = _claim(custom, name)
    except client.exceptions.ApiException:
        return None
    annotations = claim["metadata"].get("annotations") or {}
    return claim if annotations.get(ANNOTATION_ASSIGNED) == "true" else None


@pytest.mark.timeout(1800)
async def test_kubectl_apply_k_the_agent_sandbox_overlay_and_the_pod_provisions_warm_under_its_role(
    dockerd: Dockerd,
    pod_image: dict[str, Any],
    kube_node: KubeNode,
    agent_sandbox: AgentSandboxController,
    node_admin: Any,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    """The warm path, the one that needs the most of the Role: the pool's objects (server-side apply),
    a SandboxClaim, the secrets over pods/exec, the claim's `assigned` annotation (patch)."""
    core, rbac = client.CoreV1Api(node_admin), client.RbacAuthorizationV1Api(node_admin)
    custom = client.CustomObjectsApi(node_admin)
    try:
        d = await deploy(
            "agent-sandbox",
            dockerd=dockerd,
            kube_node=kube_node,
            core=core,
            kafka_bootstrap=kafka_bootstrap,
            tmp_path=tmp_path,
            driver_options={**SMALL_RUNNER, "warm_pool_size": "1", "warm_adopt_timeout_seconds": "60"},
        )
        execution = f"wfx_deploy_{uuid.uuid4().hex[:8]}"
        base = sandbox_base_name("workflow", execution)
        await produce(
            kafka_bootstrap,
            d.isolated,
            created(execution, common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD),
        )
        (provisioned,) = await read_topic(kafka_bootstrap, d.topics.outcomes, at_least=1, timeout_s=60)
        assert isinstance(provisioned.message, outcomes_pb2.SandboxProvisioned), provisioned.message
        assert provisioned.message.sandbox.driver == "agent-sandbox"
        # Delivered: the claim's pod took its secrets over exec, and the claim was annotated (patch).
        claim = await wait_for("the claim's delivery", lambda: _delivered(custom, base), timeout=120)
        pod = claim["status"]["sandbox"]["name"]
        token = await wait_for(
            "the runner to start with its assignment",
            lambda: runner_process_env(core, SANDBOX_NAMESPACE, pod).get("STIGMER_TOKEN"),
            timeout=60,
        )
        assert token.count(".") == 2  # minted with the key from the pod's Secret
        inside = runner_process_env(core, SANDBOX_NAMESPACE, pod)
        assert inside["STIGMER_TASK_QUEUE"] == f"wfexec:{execution}"
        assert "STIGMER_RUNNER_TOKEN_KEY" not in inside
        assert "KAFKA_BOOTSTRAP_SERVERS" not in inside

        await produce(kafka_bootstrap, d.isolated, wf_terminal(execution))
        outcomes = await read_topic(kafka_bootstrap, d.topics.outcomes, at_least=2, timeout_s=60)
        assert isinstance(outcomes[-1].message, outcomes_pb2.SandboxDeprovisioned)
        await wait_for("the claim to go", lambda: gone(lambda: _claim(custom, base)), timeout=90)
        await wait_for("its Sandbox to go", lambda: gone(lambda: _sandbox(custom, pod)), timeout=90)

        # The Role without pods/exec: the warm delivery is refused, a miss, and the runner goes cold
        # (a Sandbox of its own, under the claim's name).
        await _without_verbs(rbac, "pods/exec", {"get", "create"})
        # An assignment session opened ahead (while exec was allowed) would still take the secrets:
        # the pool's idle pods are replaced, and the new ones can get no session.
        idle = [
            pod.metadata.name
            for pod in core.list_namespaced_pod(SANDBOX_NAMESPACE).items
            if "stigmer.ai/sandbox-id" not in (pod.metadata.annotations or {})
            and "stigmer.ai/sandbox-id" not in (pod.metadata.labels or {})
        ]
        assert idle, "the warm pool has an idle pod"
        for name in idle:
            core.delete_namespaced_pod(name, SANDBOX_NAMESPACE, grace_period_seconds=0)
        missed = f"wfx_noexec_{uuid.uuid4().hex[:8]}"
        missed_base = sandbox_base_name("workflow", missed)
        sent = time.monotonic()
        await produce(
            kafka_bootstrap,
            d.isolated,
            created(missed, common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD),
        )
        outcomes = await read_topic(kafka_bootstrap, d.topics.outcomes, at_least=3, timeout_s=60)
        assert isinstance(outcomes[-1].message, outcomes_pb2.SandboxProvisioned)  # async: claimed

        def cold_runner() -> Any:
            pod = running_runner_pod(core, SANDBOX_NAMESPACE, missed)
            return pod if pod is not None and pod.metadata.name == missed_base else None

        cold = await wait_for("the cold fallback", cold_runner, timeout=120)
        fell_back_after = time.monotonic() - sent
        assert gone(lambda: _claim(custom, missed_base))
        assert env_inside(core, SANDBOX_NAMESPACE, cold.metadata.name)["STIGMER_TOKEN"].count(".") == 2
        print(
            f"\npod Ready {d.ready_after:.1f}s after apply; without pods/exec the runner went cold "
            f"{fell_back_after:.1f}s after the create"
        )
    finally:
        _delete_namespaces(core)
        await wait_for("the test namespaces to go", lambda: _namespaces_gone(core), timeout=180)
