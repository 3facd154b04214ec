"""The kubernetes driver against a REAL kube-apiserver + etcd (no kubelet, no controllers).

Ports upstream ``kubernetes.test.ts`` (which ran over a fake gateway) onto the real
API: object shapes, the absent/stopped/running state machine, deprovision, probe,
token-less launch; plus what only a real server can show: idempotence measured
by resourceVersion, RBAC denials, quota denials, manifest dry-runs and the Role's
exact reach through impersonation.

No controller-manager runs, so nothing reconciles: Deployments never get pods,
PVCs keep their ``pvc-protection`` finalizer after delete (they go Terminating),
and ResourceQuota status is written by the test through the status subresource.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.kube_apiserver import KubeApiServer
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from drivers.contract import (
    DEFAULT_INSTALLATION,
    DriverConfig,
    SandboxCollision,
    SandboxEnvironment,
    SandboxError,
    SandboxScope,
)
from drivers.kubernetes.driver import (
    BACKEND_ENDPOINT_REQUIRED,
    LOG_LEFT_ALONE,
    TEMPORAL_ADDRESS_REQUIRED,
    KubernetesProvisioner,
    new_kubernetes_provisioner,
)
from drivers.kubernetes.manifests import deployment_manifest, pvc_name, secret_name
from drivers.naming import sandbox_base_name, sandbox_labels
from drivers.registry import new_sandbox_provisioner
from tests.support.collisions import FIRST, SECOND, assert_collide

pytestmark = pytest.mark.kubernetes

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = REPO_ROOT / "compose" / "kubernetes"
LOG = logging.getLogger("test.kubernetes")
TOKEN = "tok-SECRET-0123456789abcdef"


def _config(namespace: str, kubeconfig: Path, **overrides: Any) -> DriverConfig:
    base: dict[str, Any] = {
        "backend_endpoint": "http://stigmer-server.stigmer.svc:7234",
        "temporal_address": "temporal-frontend.temporal.svc:7233",
        "runner_image": "ghcr.io/stigmer/runner:test",
        "kubernetes_namespace": namespace,
        "temporal_namespace": "sandboxes",
        "mcp_public_endpoint": "https://mcp.example.test",
        "runner_env": {"RUNNER_LOG_LEVEL": "debug"},
        "runner_secret_env": {"ANTHROPIC_API_KEY": "sk-ant-secret-value"},
        "temporal_connection_env": {"STIGMER_TEMPORAL_TLS_CLIENT_KEY_DATA": "-----BEGIN KEY-----x"},
        "options": {"kubeconfig": str(kubeconfig)},
    }
    base.update(overrides)
    # No controller runs beside this apiserver: no pod is ever made, so there is no admission to wait for.
    base["options"] = {"admission_wait_seconds": "0", **base["options"]}
    return DriverConfig(**base)


@pytest.fixture
async def driver(kube_apiserver: KubeApiServer, kube_namespace: str) -> AsyncIterator[KubernetesProvisioner]:
    p = new_kubernetes_provisioner(_config(kube_namespace, kube_apiserver.kubeconfig_path), LOG)
    try:
        yield p
    finally:
        await p.close()


def _apps(api: Any) -> Any:
    return client.AppsV1Api(api)


def _core(api: Any) -> Any:
    return client.CoreV1Api(api)


def _rbac(api: Any) -> Any:
    return client.RbacAuthorizationV1Api(api)


def _read_or_none(fn: Any, name: str, ns: str) -> Any:
    try:
        return fn(name, ns)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _decoded(secret: Any) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}


def _env(container: Any) -> dict[str, Any]:
    return {e.name: e for e in container.env or []}


def _scale_to(api: Any, name: str, ns: str, n: int) -> None:
    _apps(api).patch_namespaced_deployment_scale(
        name, ns, {"spec": {"replicas": n}}, _content_type="application/merge-patch+json"
    )


def _write_running_status(api: Any, name: str, ns: str) -> None:
    """Play the (absent) deployment controller: mark one replica available."""
    _apps(api).patch_namespaced_deployment_status(
        name,
        ns,
        {"status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1, "updatedReplicas": 1}},
        _content_type="application/merge-patch+json",
    )


# --------------------------------------------------------------------------- objects


async def test_absent_provisions_secret_pvc_deployment_with_the_contract(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    ns, sid = kube_namespace, "ses_k8s_objects"
    base = sandbox_base_name("session", sid)
    assert await driver.probe("session", sid) == "absent"

    await driver.ensure_session_sandbox(sid, SandboxEnvironment(f"session:{sid}", TOKEN, "user"))

    labels = sandbox_labels("session", sid, DEFAULT_INSTALLATION)
    secret = _core(kube_admin).read_namespaced_secret(secret_name(base), ns)
    assert secret.type == "Opaque"
    assert secret.metadata.labels == labels
    assert _decoded(secret) == {
        "ANTHROPIC_API_KEY": "sk-ant-secret-value",
        "STIGMER_TEMPORAL_TLS_CLIENT_KEY_DATA": "-----BEGIN KEY-----x",
        "STIGMER_TOKEN": TOKEN,
    }

    pvc = _core(kube_admin).read_namespaced_persistent_volume_claim(pvc_name(base), ns)
    assert pvc.metadata.labels == labels
    assert pvc.spec.access_modes == ["ReadWriteOnce"]
    assert pvc.spec.resources.requests == {"storage": "10Gi"}
    assert pvc.spec.storage_class_name is None

    dep = _apps(kube_admin).read_namespaced_deployment(base, ns)
    assert dep.metadata.labels == labels
    assert dep.spec.replicas == 1
    assert dep.spec.strategy.type == "Recreate"
    assert dep.spec.selector.match_labels == {
        "stigmer.ai/managed-by": "stigmer-server",
        "stigmer.ai/sandbox-id": sid,
    }
    pod = dep.spec.template
    assert pod.metadata.labels == labels
    assert pod.spec.termination_grace_period_seconds == 600
    assert pod.spec.automount_service_account_token is False
    assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
    assert [c.name for c in pod.spec.containers] == ["runner"]
    runner = pod.spec.containers[0]
    assert runner.image == "ghcr.io/stigmer/runner:test"
    assert runner.command == ["/runner/bin/start", "/runner/dist/main.js"]
    assert runner.working_dir == "/workspace"
    assert runner.resources.requests == {"cpu": "500m", "memory": "512Mi"}
    assert runner.resources.limits == {"cpu": "2", "memory": "2Gi"}
    sc = runner.security_context
    assert sc.allow_privilege_escalation is False
    assert sc.capabilities.drop == ["ALL"]
    assert (sc.run_as_user, sc.run_as_group) == (0, 0)
    assert runner.termination_message_policy == "FallbackToLogsOnError"
    assert [(m.name, m.mount_path) for m in runner.volume_mounts] == [("workspace", "/workspace")]
    [volume] = pod.spec.volumes
    assert volume.name == "workspace"
    assert volume.persistent_volume_claim.claim_name == pvc_name(base)
    assert volume.empty_dir is None

    env = _env(runner)
    plain = {k: e.value for k, e in env.items() if e.value_from is None}
    assert plain == {
        "MODE": "local",
        "STIGMER_TASK_QUEUE": f"session:{sid}",
        "STIGMER_BACKEND_ENDPOINT": "http://stigmer-server.stigmer.svc:7234",
        "TEMPORAL_SERVICE_ADDRESS": "temporal-frontend.temporal.svc:7233",
        "WORKSPACE_ROOT_DIR": "/workspace",
        "TEMPORAL_NAMESPACE": "sandboxes",
        "HOME": "/root",
        "STIGMER_MCP_PUBLIC_ENDPOINT": "https://mcp.example.test",
        "RUNNER_LOG_LEVEL": "debug",
    }
    refs = {k: e.value_from.secret_key_ref for k, e in env.items() if e.value_from is not None}
    assert set(refs) == {"STIGMER_TOKEN", "ANTHROPIC_API_KEY", "STIGMER_TEMPORAL_TLS_CLIENT_KEY_DATA"}
    for key, ref in refs.items():
        assert (ref.name, ref.key) == (secret_name(base), key)
    # No secret value ever sits in the Deployment.
    rendered = str(kube_admin.sanitize_for_serialization(dep))
    for value in (TOKEN, "sk-ant-secret-value", "-----BEGIN KEY-----x"):
        assert value not in rendered

    # Created (never applied over an object that might be another's) under our field manager.
    for obj in (dep, secret):
        assert [(m.manager, m.operation) for m in obj.metadata.managed_fields] == [
            ("sandbox-lanes", "Update")
        ]
    assert await driver.probe("session", sid) == "running"


async def test_connect_scope_rides_empty_dir_and_applies_no_pvc(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    ns, rid = kube_namespace, "mcpc_req_1"
    base = sandbox_base_name("connect", rid)
    assert await driver.create_connect_sandbox(rid, SandboxEnvironment(f"mcpconnect:{rid}", TOKEN)) == rid
    dep = _apps(kube_admin).read_namespaced_deployment(base, ns)
    [volume] = dep.spec.template.spec.volumes
    assert volume.name == "workspace"
    assert volume.persistent_volume_claim is None
    assert volume.empty_dir is not None
    assert (
        _read_or_none(_core(kube_admin).read_namespaced_persistent_volume_claim, pvc_name(base), ns) is None
    )
    assert _core(kube_admin).list_namespaced_persistent_volume_claim(ns).items == []
    await driver.deprovision_connect_sandbox(rid)
    assert await driver.probe("connect", rid) == "absent"
    assert _read_or_none(_core(kube_admin).read_namespaced_secret, secret_name(base), ns) is None


async def test_options_override_resources_and_storage(
    kube_apiserver: KubeApiServer, kube_admin: Any, kube_namespace: str
) -> None:
    options = {
        "kubeconfig": str(kube_apiserver.kubeconfig_path),
        "storage_size": "3Gi",
        "storage_class": "fast-ssd",
        "cpu_request": "250m",
        "memory_request": "256Mi",
        "cpu_limit": "1",
        "memory_limit": "1Gi",
    }
    p = new_kubernetes_provisioner(
        _config(kube_namespace, kube_apiserver.kubeconfig_path, options=options), LOG
    )
    try:
        await p.ensure("workflow", "wfx_opts", SandboxEnvironment("wfexec:wfx_opts", TOKEN))
    finally:
        await p.close()
    base = sandbox_base_name("workflow", "wfx_opts")
    pvc = _core(kube_admin).read_namespaced_persistent_volume_claim(pvc_name(base), kube_namespace)
    assert pvc.spec.resources.requests == {"storage": "3Gi"}
    assert pvc.spec.storage_class_name == "fast-ssd"
    runner = (
        _apps(kube_admin).read_namespaced_deployment(base, kube_namespace).spec.template.spec.containers[0]
    )
    assert runner.resources.requests == {"cpu": "250m", "memory": "256Mi"}
    assert runner.resources.limits == {"cpu": "1", "memory": "1Gi"}


# --------------------------------------------------------------------------- state machine


def _versions(api: Any, ns: str, base: str) -> dict[str, str | None]:
    pvc = _read_or_none(_core(api).read_namespaced_persistent_volume_claim, pvc_name(base), ns)
    return {
        "deployment": _apps(api).read_namespaced_deployment(base, ns).metadata.resource_version,
        "secret": _core(api).read_namespaced_secret(secret_name(base), ns).metadata.resource_version,
        "pvc": pvc.metadata.resource_version if pvc is not None else None,
    }


async def test_second_ensure_applies_nothing(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    sid = "ses_idem"
    base = sandbox_base_name("session", sid)
    env = SandboxEnvironment(f"session:{sid}", TOKEN)
    await driver.ensure("session", sid, env)
    before = _versions(kube_admin, kube_namespace, base)
    await driver.ensure("session", sid, env)
    await driver.ensure("session", sid, SandboxEnvironment(f"session:{sid}", "a-fresher-token"))
    assert _versions(kube_admin, kube_namespace, base) == before
    # Fast path: the pod keeps the token it booted with (defer-restart posture).
    secret = _core(kube_admin).read_namespaced_secret(secret_name(base), kube_namespace)
    assert _decoded(secret)["STIGMER_TOKEN"] == TOKEN


async def test_running_fast_path_touches_nothing(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    sid = "wfx_running"
    base = sandbox_base_name("workflow", sid)
    await driver.ensure_workflow_sandbox(sid, SandboxEnvironment(f"wfexec:{sid}", TOKEN))
    _write_running_status(kube_admin, base, kube_namespace)
    before = _versions(kube_admin, kube_namespace, base)
    await driver.ensure_workflow_sandbox(sid, SandboxEnvironment(f"wfexec:{sid}", TOKEN))
    assert _versions(kube_admin, kube_namespace, base) == before
    assert await driver.probe("workflow", sid) == "running"


async def test_stopped_scales_to_one_and_reapplies_nothing(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    ns, sid = kube_namespace, "ses_scaled_down"
    base = sandbox_base_name("session", sid)
    await driver.ensure("session", sid, SandboxEnvironment(f"session:{sid}", TOKEN))
    _scale_to(kube_admin, base, ns, 0)
    assert await driver.probe("session", sid) == "stopped"
    before = _versions(kube_admin, ns, base)
    dep_before = _apps(kube_admin).read_namespaced_deployment(base, ns)

    await driver.ensure("session", sid, SandboxEnvironment(f"session:{sid}", "a-fresher-token"))

    after = _versions(kube_admin, ns, base)
    assert after["secret"] == before["secret"]
    assert after["pvc"] == before["pvc"]
    dep = _apps(kube_admin).read_namespaced_deployment(base, ns)
    assert dep.spec.replicas == 1
    # Only replicas changed: the pod template is byte-identical.
    assert kube_admin.sanitize_for_serialization(dep.spec.template) == kube_admin.sanitize_for_serialization(
        dep_before.spec.template
    )
    assert await driver.probe("session", sid) == "running"
    secret = _core(kube_admin).read_namespaced_secret(secret_name(base), ns)
    assert _decoded(secret)["STIGMER_TOKEN"] == TOKEN


async def test_repair_keeps_the_claim_and_writes_the_freshest_secret(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    """Deployment gone, Secret + PVC survive: re-apply Secret, keep PVC, recreate Deployment."""
    ns, sid = kube_namespace, "ses_repair"
    base = sandbox_base_name("session", sid)
    await driver.ensure("session", sid, SandboxEnvironment(f"session:{sid}", TOKEN))
    pvc_before = _core(kube_admin).read_namespaced_persistent_volume_claim(pvc_name(base), ns)
    _apps(kube_admin).delete_namespaced_deployment(base, ns, propagation_policy="Background")
    assert await driver.probe("session", sid) == "absent"

    # Token-less repair: the old token must not survive in the Secret.
    await driver.ensure("session", sid, SandboxEnvironment(f"session:{sid}", ""))

    pvc = _core(kube_admin).read_namespaced_persistent_volume_claim(pvc_name(base), ns)
    assert (pvc.metadata.uid, pvc.metadata.resource_version) == (
        pvc_before.metadata.uid,
        pvc_before.metadata.resource_version,
    )
    secret = _core(kube_admin).read_namespaced_secret(secret_name(base), ns)
    assert "STIGMER_TOKEN" not in _decoded(secret)
    runner = _apps(kube_admin).read_namespaced_deployment(base, ns).spec.template.spec.containers[0]
    assert "STIGMER_TOKEN" not in _env(runner)
    assert await driver.probe("session", sid) == "running"


async def test_token_less_omits_the_env_but_keeps_an_empty_secret(
    kube_apiserver: KubeApiServer, kube_admin: Any, kube_namespace: str
) -> None:
    cfg = _config(
        kube_namespace, kube_apiserver.kubeconfig_path, runner_secret_env={}, temporal_connection_env={}
    )
    p = new_kubernetes_provisioner(cfg, LOG)
    sid = "ses_tokenless"
    base = sandbox_base_name("session", sid)
    try:
        await p.ensure("session", sid, SandboxEnvironment(f"session:{sid}", ""))
    finally:
        await p.close()
    secret = _core(kube_admin).read_namespaced_secret(secret_name(base), kube_namespace)
    assert secret.metadata.labels == sandbox_labels("session", sid, DEFAULT_INSTALLATION)
    assert not secret.data
    runner = (
        _apps(kube_admin).read_namespaced_deployment(base, kube_namespace).spec.template.spec.containers[0]
    )
    env = _env(runner)
    assert "STIGMER_TOKEN" not in env
    assert all(e.value_from is None for e in env.values())


async def test_deprovision_deletes_all_three_and_tolerates_absence(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    ns, sid = kube_namespace, "wfx_teardown"
    base = sandbox_base_name("workflow", sid)
    await driver.ensure("workflow", sid, SandboxEnvironment(f"wfexec:{sid}", TOKEN))
    await driver.deprovision_workflow_sandbox(sid)

    assert _read_or_none(_apps(kube_admin).read_namespaced_deployment, base, ns) is None
    assert _read_or_none(_core(kube_admin).read_namespaced_secret, secret_name(base), ns) is None
    # pvc-protection keeps the claim until a controller releases it; the delete was accepted.
    pvc = _read_or_none(_core(kube_admin).read_namespaced_persistent_volume_claim, pvc_name(base), ns)
    assert pvc is None or pvc.metadata.deletion_timestamp is not None
    assert await driver.probe("workflow", sid) == "absent"

    await driver.deprovision_workflow_sandbox(sid)  # second time: success
    await driver.deprovision_session_sandbox("ses_never_existed")


def _owned_objects(admin: Any, ns: str, base: str) -> dict[str, Any]:
    """uid, resourceVersion and labels of the three objects (plus the Secret's data and the replicas)."""
    dep = _read_or_none(_apps(admin).read_namespaced_deployment, base, ns)
    secret = _read_or_none(_core(admin).read_namespaced_secret, secret_name(base), ns)
    pvc = _read_or_none(_core(admin).read_namespaced_persistent_volume_claim, pvc_name(base), ns)
    out: dict[str, Any] = {}
    for kind, obj in (("Deployment", dep), ("Secret", secret), ("PersistentVolumeClaim", pvc)):
        if obj is not None:
            m = obj.metadata
            out[kind] = (m.uid, m.resource_version, m.labels, m.deletion_timestamp)
    if secret is not None:
        out["data"] = _decoded(secret)
    if dep is not None:
        out["replicas"] = dep.spec.replicas
    return out


def _collision(kind: str, where: str, name: str) -> str:
    return (
        f"kubernetes sandbox name collision: {kind} {where} belongs to workflow '{FIRST}', not to "
        f"workflow '{SECOND}' (both map to the name {name}); the {kind} was left untouched"
    )


async def test_colliding_ids_never_touch_each_others_objects(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two real ids with one sandbox name: every arm of the second's ensure (fast path, scale-up,
    Secret write, claim) fails naming the first's object and writes nothing of it; the second's
    deprovision deletes nothing of the first's."""
    caplog.set_level(logging.INFO, logger=LOG.name)
    ns, base = kube_namespace, assert_collide("workflow")
    await driver.ensure_workflow_sandbox(FIRST, SandboxEnvironment(f"wfexec:{FIRST}", TOKEN, "user"))
    first = _owned_objects(kube_admin, ns, base)
    assert set(first) == {"Deployment", "Secret", "PersistentVolumeClaim", "data", "replicas"}
    assert all(
        first[k][2] == sandbox_labels("workflow", FIRST, DEFAULT_INSTALLATION)
        for k in ("Deployment", "Secret")
    )
    second_env = SandboxEnvironment(f"wfexec:{SECOND}", "tok-second-execution", "user")

    # The fast path onto a running Deployment.
    with pytest.raises(SandboxCollision) as err:
        await driver.ensure_workflow_sandbox(SECOND, second_env)
    assert str(err.value) == _collision("Deployment", f"{ns}/{base}", base)
    assert _owned_objects(kube_admin, ns, base) == first
    assert await driver.probe("workflow", SECOND) == "absent"
    assert await driver.probe("workflow", FIRST) == "running"

    # The scale-up of a stopped one.
    _scale_to(kube_admin, base, ns, 0)
    stopped = _owned_objects(kube_admin, ns, base)
    with pytest.raises(SandboxCollision, match=f"Deployment {ns}/{base} belongs to workflow '{FIRST}'"):
        await driver.ensure_workflow_sandbox(SECOND, second_env)
    assert _owned_objects(kube_admin, ns, base) == stopped
    _scale_to(kube_admin, base, ns, 1)
    first = _owned_objects(kube_admin, ns, base)

    # The second's deprovision: all three are the first's, all three stay.
    await driver.deprovision_workflow_sandbox(SECOND)
    assert _owned_objects(kube_admin, ns, base) == first, "nothing deleted, nothing written"
    left = [
        r.__dict__["leftAlone"] for r in caplog.records if r.getMessage() == f"kubernetes {LOG_LEFT_ALONE}"
    ]
    assert left == [
        f"Deployment {ns}/{base} (owned by workflow '{FIRST}')",
        f"Secret {ns}/{secret_name(base)} (owned by workflow '{FIRST}')",
        f"PersistentVolumeClaim {ns}/{pvc_name(base)} (owned by workflow '{FIRST}')",
    ]

    # The first's Deployment gone (a teardown cut short): its Secret is not written over.
    _apps(kube_admin).delete_namespaced_deployment(base, ns)
    partial = _owned_objects(kube_admin, ns, base)
    with pytest.raises(SandboxCollision) as err:
        await driver.ensure_workflow_sandbox(SECOND, second_env)
    assert str(err.value) == _collision("Secret", f"{ns}/{secret_name(base)}", base)
    assert _owned_objects(kube_admin, ns, base) == partial

    # ... and with its Secret gone too, its claim is never mounted: the second's own Secret, just
    # written, is deleted again and no Deployment is made.
    _core(kube_admin).delete_namespaced_secret(secret_name(base), ns)
    partial = _owned_objects(kube_admin, ns, base)
    with pytest.raises(SandboxCollision) as err:
        await driver.ensure_workflow_sandbox(SECOND, second_env)
    assert str(err.value) == _collision("PersistentVolumeClaim", f"{ns}/{pvc_name(base)}", base)
    assert _owned_objects(kube_admin, ns, base) == partial
    assert set(partial) == {"PersistentVolumeClaim"}

    # The first's next ensure repairs it onto its own kept claim; the first's deprovision removes it.
    await driver.ensure_workflow_sandbox(FIRST, SandboxEnvironment(f"wfexec:{FIRST}", TOKEN, "user"))
    repaired = _owned_objects(kube_admin, ns, base)
    assert repaired["PersistentVolumeClaim"] == partial["PersistentVolumeClaim"]
    assert repaired["data"]["STIGMER_TOKEN"] == TOKEN
    await driver.deprovision_workflow_sandbox(SECOND)
    assert _owned_objects(kube_admin, ns, base) == repaired
    await driver.deprovision_workflow_sandbox(FIRST)
    gone = _owned_objects(kube_admin, ns, base)
    assert set(gone) <= {"PersistentVolumeClaim"}
    assert "PersistentVolumeClaim" not in gone or gone["PersistentVolumeClaim"][3] is not None  # Terminating
    assert await driver.probe("workflow", FIRST) == "absent"


async def test_probe_maps_replicas_onto_absent_stopped_running(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    sid = "ses_probe"
    base = sandbox_base_name("session", sid)
    assert await driver.probe("session", sid) == "absent"
    await driver.ensure("session", sid, SandboxEnvironment(f"session:{sid}", TOKEN))
    assert await driver.probe("session", sid) == "running"
    _scale_to(kube_admin, base, kube_namespace, 0)
    assert await driver.probe("session", sid) == "stopped"
    _scale_to(kube_admin, base, kube_namespace, 3)
    assert await driver.probe("session", sid) == "running"
    assert await driver.probe("workflow", sid) == "absent"  # scope is part of the key


async def test_list_managed_finds_labelled_deployments_only(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    ns = kube_namespace
    await driver.ensure("session", "ses_a", SandboxEnvironment("session:ses_a", TOKEN))
    await driver.ensure("workflow", "wfx_b", SandboxEnvironment("wfexec:wfx_b", TOKEN))
    await driver.ensure("connect", "mcp_c", SandboxEnvironment("mcpconnect:mcp_c", TOKEN))
    _scale_to(kube_admin, sandbox_base_name("workflow", "wfx_b"), ns, 0)
    _apps(kube_admin).create_namespaced_deployment(
        ns,
        client.V1Deployment.from_dict(
            {
                "metadata": {"name": "bystander", "labels": {"app": "other"}},
                "spec": {
                    "selector": {"matchLabels": {"app": "other"}},
                    "template": {
                        "metadata": {"labels": {"app": "other"}},
                        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
                    },
                },
            }
        ),
    )
    found = await driver.list_managed()
    assert [(m.scope, m.sandbox_id, m.name, m.state) for m in found] == [
        ("connect", "mcp_c", sandbox_base_name("connect", "mcp_c"), "running"),
        ("session", "ses_a", sandbox_base_name("session", "ses_a"), "running"),
        ("workflow", "wfx_b", sandbox_base_name("workflow", "wfx_b"), "stopped"),
    ]


async def test_list_managed_follows_pages(driver: KubernetesProvisioner) -> None:
    ids = [f"ses_page_{i}" for i in range(5)]
    for sid in ids:
        await driver.ensure("session", sid, SandboxEnvironment(f"session:{sid}", ""))
    driver.list_page_size = 2
    found = await driver.list_managed()
    assert sorted(m.sandbox_id for m in found) == ids


async def test_concurrent_ensures_for_one_id_converge(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    sid = "ses_race"
    env = SandboxEnvironment(f"session:{sid}", TOKEN)
    await asyncio.gather(*(driver.ensure("session", sid, env) for _ in range(4)))
    assert await driver.probe("session", sid) == "running"
    assert len(await driver.list_managed()) == 1


# --------------------------------------------------------------------------- failures


async def test_rbac_forbidden_is_a_sandbox_error_with_the_server_message(
    kube_apiserver: KubeApiServer, kube_namespace: str
) -> None:
    cfg = _config(kube_namespace, kube_apiserver.unprivileged_kubeconfig_path)
    p = new_kubernetes_provisioner(cfg, LOG)
    try:
        with pytest.raises(SandboxError) as err:
            await p.ensure("session", "ses_forbidden", SandboxEnvironment("session:ses_forbidden", TOKEN))
        message = str(err.value)
        assert "forbidden" in message
        assert f'User "{kube_apiserver.unprivileged_user}" cannot get resource "deployments"' in message
        assert kube_namespace in message
        assert kube_apiserver.unprivileged_token not in message
        assert TOKEN not in message
        for op in (p.probe("session", "x"), p.deprovision("session", "x"), p.list_managed()):
            with pytest.raises(SandboxError, match="forbidden"):
                await op
    finally:
        await p.close()


async def test_rbac_forbidden_write_names_the_verb(
    kube_apiserver: KubeApiServer, kube_admin: Any, kube_namespace: str
) -> None:
    """Allowed to read Deployments but not to write Secrets: the denial of the first Secret call (the
    owner read, a dry-run patch) surfaces, naming the verb."""
    rbac = _rbac(kube_admin)
    rbac.create_namespaced_role(
        kube_namespace,
        {
            "metadata": {"name": "read-only"},
            "rules": [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        kube_namespace,
        {
            "metadata": {"name": "read-only"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-only"},
            "subjects": [{"kind": "User", "name": kube_apiserver.unprivileged_user}],
        },
    )
    _wait_for_rbac(
        kube_admin,
        kube_apiserver.unprivileged_user,
        kube_namespace,
        [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get"]}],
    )
    p = new_kubernetes_provisioner(_config(kube_namespace, kube_apiserver.unprivileged_kubeconfig_path), LOG)
    try:
        with pytest.raises(SandboxError) as err:
            await p.ensure("session", "ses_ro", SandboxEnvironment("session:ses_ro", TOKEN))
        assert f"read Secret {kube_namespace}/" in str(err.value)
        assert 'cannot patch resource "secrets"' in str(err.value)
        assert TOKEN not in str(err.value)
    finally:
        await p.close()


def _quota(api: Any, ns: str, hard: dict[str, str]) -> None:
    core = _core(api)
    core.create_namespaced_resource_quota(ns, {"metadata": {"name": "sandbox-quota"}, "spec": {"hard": hard}})
    # No quota controller runs: publish the usage the admission plugin needs ourselves.
    core.patch_namespaced_resource_quota_status(
        "sandbox-quota",
        ns,
        {"status": {"hard": hard, "used": dict.fromkeys(hard, "0")}},
        _content_type="application/merge-patch+json",
    )


@pytest.mark.parametrize(
    ("hard", "failing"),
    [
        ({"count/secrets": "0"}, "create Secret"),
        ({"persistentvolumeclaims": "0"}, "create PersistentVolumeClaim"),
    ],
)
async def test_exceeded_quota_is_a_sandbox_error(
    driver: KubernetesProvisioner,
    kube_admin: Any,
    kube_namespace: str,
    hard: dict[str, str],
    failing: str,
) -> None:
    _quota(kube_admin, kube_namespace, hard)
    # The admission plugin reads quotas through an informer; until it has seen the status
    # we wrote it answers "status unknown". Retry briefly past that window only.
    for _ in range(50):
        with pytest.raises(SandboxError) as err:
            await driver.ensure("session", "ses_quota", SandboxEnvironment("session:ses_quota", TOKEN))
        if "status unknown for quota" not in str(err.value):
            break
        await asyncio.sleep(0.1)
    message = str(err.value)
    assert failing in message
    assert "exceeded quota: sandbox-quota" in message
    assert TOKEN not in message
    assert await driver.probe("session", "ses_quota") == "absent"  # no Deployment without its parts


async def test_unreachable_api_server_is_a_sandbox_error(
    kube_apiserver: KubeApiServer, tmp_path: Path
) -> None:
    text = kube_apiserver.kubeconfig_path.read_text().replace(kube_apiserver.url, "https://127.0.0.1:9")
    dead = tmp_path / "dead.kubeconfig"
    dead.write_text(text)
    cfg = _config("nowhere", dead, options={"kubeconfig": str(dead), "request_timeout": "2"})
    p = new_kubernetes_provisioner(cfg, LOG)
    try:
        with pytest.raises(SandboxError, match="read Deployment"):
            await p.probe("session", "x")
    finally:
        await p.close()


# --------------------------------------------------------------------------- boot


def test_boot_checks_mirror_docker_with_pod_wording(kube_apiserver: KubeApiServer) -> None:
    kubeconfig = kube_apiserver.kubeconfig_path
    with pytest.raises(ValueError) as err:
        new_kubernetes_provisioner(_config("ns", kubeconfig, backend_endpoint=""), LOG)
    assert (
        str(err.value)
        == BACKEND_ENDPOINT_REQUIRED
        == (
            "sandbox provisioner 'kubernetes' requires STIGMER_SANDBOX_BACKEND_ENDPOINT"
            " — a pod cannot reach the server on this process's localhost"
        )
    )
    with pytest.raises(ValueError) as err:
        new_kubernetes_provisioner(_config("ns", kubeconfig, temporal_address=""), LOG)
    assert (
        str(err.value)
        == TEMPORAL_ADDRESS_REQUIRED
        == (
            "sandbox provisioner 'kubernetes' requires STIGMER_SANDBOX_TEMPORAL_ADDRESS"
            " (or TEMPORAL_HOST_PORT) reachable from inside the cluster"
        )
    )
    with pytest.raises(ValueError, match="no usable Kubernetes client config"):
        new_kubernetes_provisioner(_config("ns", kubeconfig, options={"kubeconfig": "/nonexistent"}), LOG)
    for bad in ("0", "many"):
        with pytest.raises(ValueError) as err:
            new_kubernetes_provisioner(
                _config("ns", kubeconfig, options={"kubeconfig": str(kubeconfig), "max_pool_size": bad}), LOG
            )
        assert str(err.value) == (
            f"sandbox provisioner 'kubernetes': max_pool_size must be a whole number >= 1, got {bad!r}"
        )


@pytest.mark.parametrize(("option", "expected"), [(None, 32), ("48", 48)])
async def test_the_connection_pool_holds_max_pool_size_connections(
    kube_apiserver: KubeApiServer, option: str | None, expected: int
) -> None:
    options = {"kubeconfig": str(kube_apiserver.kubeconfig_path)}
    if option is not None:
        options["max_pool_size"] = option
    p = new_kubernetes_provisioner(_config("ns", kube_apiserver.kubeconfig_path, options=options), LOG)
    try:  # what urllib3 keeps: a burst at the pod's driver concurrency reuses its connections
        assert p._api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] == expected
    finally:
        await p.close()


async def test_operator_lists_cannot_override_driver_owned_names(
    kube_apiserver: KubeApiServer, kube_admin: Any, kube_namespace: str
) -> None:
    cfg = _config(
        kube_namespace,
        kube_apiserver.kubeconfig_path,
        runner_env={"MODE": "cloud", "RUNNER_LOG_LEVEL": "debug"},
        runner_secret_env={"STIGMER_TOKEN": "smuggled", "ANTHROPIC_API_KEY": "k"},
    )
    p = new_kubernetes_provisioner(cfg, LOG)
    try:
        await p.ensure("session", "ses_owned", SandboxEnvironment("session:ses_owned", ""))
    finally:
        await p.close()
    base = sandbox_base_name("session", "ses_owned")
    runner = (
        _apps(kube_admin).read_namespaced_deployment(base, kube_namespace).spec.template.spec.containers[0]
    )
    env = _env(runner)
    assert env["MODE"].value == "local"
    assert "STIGMER_TOKEN" not in env
    secret = _core(kube_admin).read_namespaced_secret(secret_name(base), kube_namespace)
    assert "STIGMER_TOKEN" not in _decoded(secret)


async def test_registry_selects_this_driver(kube_apiserver: KubeApiServer) -> None:
    p = new_sandbox_provisioner("kubernetes", _config("ns", kube_apiserver.kubeconfig_path), LOG)
    assert isinstance(p, KubernetesProvisioner)
    assert p.driver_name == "kubernetes"
    await p.close()


# --------------------------------------------------------------------------- manifests + RBAC reach


def _manifest_docs() -> list[dict[str, Any]]:
    """The kubernetes overlay's RBAC as shipped (its server-side dry run as rendered by kustomize:
    tests/integration/test_packaging.py)."""
    docs: list[dict[str, Any]] = []
    for name in (
        "base/namespaces.yaml",
        "base/serviceaccount.yaml",
        "overlays/kubernetes/role.yaml",
        "base/rolebinding.yaml",
        "base/deployment.yaml",
    ):
        docs.extend(d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d)
    return docs


def _create(api: Any, doc: dict[str, Any], **kwargs: Any) -> Any:
    kind, ns = doc["kind"], doc["metadata"].get("namespace")
    core, rbac, apps = _core(api), _rbac(api), _apps(api)
    if kind == "Namespace":
        return core.create_namespace(doc, **kwargs)
    creators = {
        "ServiceAccount": core.create_namespaced_service_account,
        "Role": rbac.create_namespaced_role,
        "RoleBinding": rbac.create_namespaced_role_binding,
        "Deployment": apps.create_namespaced_deployment,
    }
    return creators[kind](ns, doc, **kwargs)


def _ensure_real(api: Any, doc: dict[str, Any]) -> None:
    try:
        _create(api, doc)
    except ApiException as exc:
        if exc.status != 409:
            raise


def _impersonating_driver(kube_apiserver: KubeApiServer, namespace: str, user: str) -> KubernetesProvisioner:
    from kubernetes import config as kconfig

    load: Any = kconfig.load_kube_config
    cfg = client.Configuration()
    load(config_file=str(kube_apiserver.kubeconfig_path), client_configuration=cfg)
    api: Any = client.ApiClient(cfg)
    api.set_default_header("Impersonate-User", user)
    return KubernetesProvisioner(_config(namespace, kube_apiserver.kubeconfig_path), LOG, api)


def _wait_for_rbac(api: Any, user: str, ns: str, rules: list[dict[str, Any]]) -> None:
    """RBAC reads roles through informers: wait until every granted verb is visible to the authorizer."""
    import time

    authz: Any = client.AuthorizationV1Api(api)
    checks = [
        (group, res, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for res in rule["resources"]
        for verb in rule["verbs"]
    ]
    deadline = time.monotonic() + 20
    while True:
        pending = []
        for group, res, verb in checks:
            resource, _, sub = res.partition("/")
            review = authz.create_subject_access_review(
                {
                    "spec": {
                        "user": user,
                        "groups": ["system:serviceaccounts", "system:authenticated"],
                        "resourceAttributes": {
                            "namespace": ns,
                            "group": group,
                            "resource": resource,
                            "subresource": sub,
                            "verb": verb,
                        },
                    }
                }
            )
            if not review.status.allowed:
                pending.append((res, verb))
        if not pending:
            return
        assert time.monotonic() < deadline, f"RBAC never granted {pending} to {user}"
        time.sleep(0.1)


async def _every_driver_operation(p: KubernetesProvisioner, admin: Any, ns: str) -> None:
    """Each arm of ensure, probe, list_managed and deprovision, for a persistent and a connect scope."""
    arms: tuple[tuple[SandboxScope, str], ...] = (("session", "ses_sa"), ("connect", "mcp_sa"))
    for scope, sid in arms:
        env = SandboxEnvironment(f"q:{sid}", TOKEN)
        await p.ensure(scope, sid, env)  # absent → apply Secret, create PVC, apply Deployment
        await p.ensure(scope, sid, env)  # fast path
        _scale_to(admin, sandbox_base_name(scope, sid), ns, 0)
        await p.ensure(scope, sid, env)  # scale subresource
        assert await p.probe(scope, sid) == "running"
    # Repair arm: Secret re-applied over an existing one, PVC create → 409 kept.
    _apps(admin).delete_namespaced_deployment(sandbox_base_name("session", "ses_sa"), ns)
    await p.ensure("session", "ses_sa", SandboxEnvironment("q:ses_sa", TOKEN))
    assert {m.sandbox_id for m in await p.list_managed()} >= {"ses_sa", "mcp_sa"}
    await p.deprovision("session", "ses_sa")
    await p.deprovision("connect", "mcp_sa")
    await p.deprovision("session", "ses_sa")
    assert await p.probe("session", "ses_sa") == "absent"


async def test_service_account_role_reaches_exactly_the_driver_operations(
    kube_apiserver: KubeApiServer, kube_admin: Any
) -> None:
    """Impersonate the pod's ServiceAccount with the shipped Role: the driver works, nothing else does."""
    docs = _manifest_docs()
    for doc in docs:
        if doc["kind"] in ("Namespace", "ServiceAccount", "Role", "RoleBinding"):
            _ensure_real(kube_admin, doc)
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]
    role = next(d for d in docs if d["kind"] == "Role")
    sandbox_ns = role["metadata"]["namespace"]
    _wait_for_rbac(
        kube_admin, f"system:serviceaccount:{sa['namespace']}:{sa['name']}", sandbox_ns, role["rules"]
    )
    p = _impersonating_driver(
        kube_apiserver, sandbox_ns, f"system:serviceaccount:{sa['namespace']}:{sa['name']}"
    )
    api = p._api_client
    try:
        await _every_driver_operation(p, kube_admin, sandbox_ns)

        # Beyond the driver's needs: denied.
        core, apps = _core(api), _apps(api)
        denied: list[Callable[[], Any]] = [
            lambda: core.list_namespaced_secret(sandbox_ns),
            lambda: core.read_namespaced_secret("anything", sandbox_ns),
            lambda: core.list_namespaced_pod(sandbox_ns),
            lambda: core.create_namespaced_pod(
                sandbox_ns, {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
            ),
            lambda: apps.list_namespaced_deployment("default"),
            lambda: apps.read_namespaced_deployment_scale("anything", sandbox_ns),
            lambda: core.delete_namespace(sandbox_ns),
        ]
        for call in denied:
            with pytest.raises(ApiException) as err:
                call()
            assert err.value.status == 403
    finally:
        await p.close()


def _role_rules_without(resource: str, verb: str) -> list[dict[str, Any]]:
    role = next(d for d in _manifest_docs() if d["kind"] == "Role")
    rules = []
    for rule in role["rules"]:
        verbs = [v for v in rule["verbs"] if not (resource in rule["resources"] and v == verb)]
        if verbs:
            rules.append({**rule, "verbs": verbs})
    return rules


_ROLE_GRANTS = [
    (res, verb)
    for rule in next(d for d in _manifest_docs() if d["kind"] == "Role")["rules"]
    for res in rule["resources"]
    for verb in rule["verbs"]
]


@pytest.mark.parametrize(("resource", "verb"), _ROLE_GRANTS, ids=[f"{r}:{v}" for r, v in _ROLE_GRANTS])
async def test_every_role_grant_is_needed(
    kube_apiserver: KubeApiServer, kube_admin: Any, kube_namespace: str, resource: str, verb: str
) -> None:
    """Drop any single verb from the shipped Role and some driver operation is forbidden."""
    ns = kube_namespace
    rbac = _rbac(kube_admin)
    _core(kube_admin).create_namespaced_service_account(ns, {"metadata": {"name": "lanes"}})
    rules = _role_rules_without(resource, verb)
    rbac.create_namespaced_role(ns, {"metadata": {"name": "lanes"}, "rules": rules})
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "lanes"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lanes"},
            "subjects": [{"kind": "ServiceAccount", "name": "lanes", "namespace": ns}],
        },
    )
    _wait_for_rbac(kube_admin, f"system:serviceaccount:{ns}:lanes", ns, rules)
    p = _impersonating_driver(kube_apiserver, ns, f"system:serviceaccount:{ns}:lanes")
    try:
        with pytest.raises(SandboxError) as err:
            await _every_driver_operation(p, kube_admin, ns)
        assert f'cannot {verb} resource "{resource}"' in str(err.value)
    finally:
        await p.close()


# --------------------------------------------------------------------------- issue 34: owned and ordered


async def test_colliding_ids_creating_at_the_same_instant_end_with_one_owner_and_one_collision(
    kube_apiserver: KubeApiServer, kube_admin: Any, kube_namespace: str
) -> None:
    """Two pods ensure two colliding ids at once, both finding nothing: every object is created (never
    applied over), so one create wins each name and the other ensure fails with a SandboxCollision,
    having written nothing of the winner's. Five rounds, each side starting first in turn."""
    ns, base = kube_namespace, assert_collide("workflow")
    pods = [new_kubernetes_provisioner(_config(ns, kube_apiserver.kubeconfig_path), LOG) for _ in range(2)]
    try:
        for round_ in range(5):
            ids = (FIRST, SECOND) if round_ % 2 == 0 else (SECOND, FIRST)
            results = await asyncio.gather(
                *(
                    pod.ensure("workflow", sid, SandboxEnvironment(f"wfexec:{sid}", f"tok-{sid}", "user"))
                    for pod, sid in zip(pods, ids, strict=True)
                ),
                return_exceptions=True,
            )
            won = [sid for sid, r in zip(ids, results, strict=True) if r == "running"]
            lost = [r for r in results if isinstance(r, SandboxCollision)]
            assert len(won) == 1 and len(lost) == 1, results
            (winner,) = won
            objects = _owned_objects(kube_admin, ns, base)
            assert {k for k in objects if k in ("Deployment", "Secret", "PersistentVolumeClaim")} == {
                "Deployment",
                "Secret",
                "PersistentVolumeClaim",
            }
            for kind in ("Deployment", "Secret", "PersistentVolumeClaim"):
                assert objects[kind][2] == sandbox_labels("workflow", winner, DEFAULT_INSTALLATION), kind
            assert objects["data"]["STIGMER_TOKEN"] == f"tok-{winner}", "the loser's token was written"
            assert await pods[0].probe("workflow", winner) == "running"
            for kind, name, read in (
                ("Deployment", base, _apps(kube_admin).read_namespaced_deployment),
                ("Secret", secret_name(base), _core(kube_admin).read_namespaced_secret),
                (
                    "PersistentVolumeClaim",
                    pvc_name(base),
                    _core(kube_admin).read_namespaced_persistent_volume_claim,
                ),
            ):
                await pods[0]._delete(kind, name)
                deadline = asyncio.get_running_loop().time() + 30
                while _read_or_none(read, name, ns) is not None:  # a claim's protection finalizer
                    assert asyncio.get_running_loop().time() < deadline, f"{kind} not gone"
                    _strip_finalizers(kube_admin, kind, name, ns)
                    await asyncio.sleep(0.05)
    finally:
        for pod in pods:
            await pod.close()


def _strip_finalizers(admin: Any, kind: str, name: str, ns: str) -> None:
    if kind != "PersistentVolumeClaim":
        return
    try:
        _core(admin).patch_namespaced_persistent_volume_claim(
            name, ns, {"metadata": {"finalizers": None}}, _content_type="application/merge-patch+json"
        )
    except ApiException as exc:
        if exc.status != 404:
            raise


async def test_a_scale_up_checked_against_a_deployment_replaced_since_changes_nothing(
    driver: KubernetesProvisioner, kube_admin: Any, kube_namespace: str
) -> None:
    """The scale-up's JSON Patch tests the uid and labels it read: a Deployment replaced in between
    (here by another installation's, stopped) is not scaled, and the ensure then names the new owner."""
    ns, sid = kube_namespace, "wfx_replaced"
    base = sandbox_base_name("workflow", sid)
    await driver.ensure("workflow", sid, SandboxEnvironment(f"wfexec:{sid}", TOKEN))
    _scale_to(kube_admin, base, ns, 0)
    stale = driver._found_deployment(await driver.read_deployment(base), base)
    _apps(kube_admin).delete_namespaced_deployment(base, ns)
    replacement = _apps(kube_admin).read_namespaced_deployment  # (read below, after it is made)
    manifest = deployment_manifest(
        replace(driver._config, installation="staging"), "workflow", sid, SandboxEnvironment("q")
    )
    manifest["spec"]["replicas"] = 0
    _apps(kube_admin).create_namespaced_deployment(ns, manifest)
    before = replacement(base, ns)
    assert not await driver._scale_up(stale, sid)
    after = replacement(base, ns)
    assert (after.metadata.uid, after.metadata.resource_version, after.spec.replicas) == (
        before.metadata.uid,
        before.metadata.resource_version,
        0,
    )
    with pytest.raises(SandboxCollision, match="of installation 'staging'"):
        await driver.ensure("workflow", sid, SandboxEnvironment(f"wfexec:{sid}", TOKEN))
    assert replacement(base, ns).metadata.resource_version == before.metadata.resource_version


async def test_two_installations_in_one_namespace_on_the_node_never_touch_each_others_objects(
    kube_node: Any, node_admin: Any, node_namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Production and staging in one namespace of the real node, and objects without our labels (a
    plain Deployment under a sandbox's name, one made before installations were labelled): each
    installation lists, probes, ensures, scales and deletes only its own. Staging's ensure of an id
    production holds fails naming production's objects; its deprovision and its reaper's listing leave
    them; production's runner pod runs on, the same pod."""
    from tests.integration.test_kubernetes_node import node_driver_config, running_runner_pod, wait_for

    caplog.set_level(logging.INFO, logger=LOG.name)
    ns, core, apps = node_namespace, _core(node_admin), _apps(node_admin)
    config = node_driver_config(ns, kube_node.kubeconfig_path)
    production = new_kubernetes_provisioner(replace(config, installation="production"), LOG)
    staging = new_kubernetes_provisioner(replace(config, installation="staging"), LOG)
    shared, own, legacy, plain = "wfx_shared", "wfx_staging_own", "wfx_legacy", "wfx_plain"
    try:
        await production.ensure("workflow", shared, SandboxEnvironment(f"wfexec:{shared}", TOKEN))
        pod = await wait_for("production's runner pod", lambda: running_runner_pod(core, ns, shared))
        await staging.ensure("workflow", own, SandboxEnvironment(f"wfexec:{own}", "tok-staging"))
        # Beside them, objects of no installation: a Deployment made before installations were
        # labelled (our other labels, stopped) and a plain one under a sandbox's name (no labels).
        for sid, labels in (
            (legacy, {"stigmer.ai/managed-by": "stigmer-server", "stigmer.ai/sandbox-id": legacy}),
            (plain, {"app": "someone-elses"}),
        ):
            manifest = deployment_manifest(config, "workflow", sid, SandboxEnvironment("q"))
            manifest["metadata"]["labels"] = labels
            manifest["spec"]["replicas"] = 0
            apps.create_namespaced_deployment(ns, manifest)
        base = sandbox_base_name("workflow", shared)
        held = {
            sid: _node_objects(node_admin, ns, sandbox_base_name("workflow", sid))
            for sid in (shared, legacy, plain)
        }

        assert [m.sandbox_id for m in await production.list_managed()] == [shared]
        assert [m.sandbox_id for m in await staging.list_managed()] == [own]
        assert await staging.probe("workflow", shared) == "absent"
        with pytest.raises(SandboxCollision) as err:
            await staging.ensure("workflow", shared, SandboxEnvironment(f"wfexec:{shared}", "tok-staging"))
        assert str(err.value) == (
            f"kubernetes sandbox name collision: Deployment {ns}/{base} belongs to workflow '{shared}' of "
            f"installation 'production', not to workflow '{shared}' (both map to the name {base}); the "
            "Deployment was left untouched"
        )
        await staging.deprovision("workflow", shared)
        left = [
            r.__dict__["leftAlone"]
            for r in caplog.records
            if r.getMessage() == f"kubernetes {LOG_LEFT_ALONE}"
        ]
        assert f"Deployment {ns}/{base} (owned by workflow '{shared}' of installation 'production')" in left
        for sid in (legacy, plain):
            with pytest.raises(SandboxCollision):
                await production.ensure("workflow", sid, SandboxEnvironment(f"wfexec:{sid}", TOKEN))
            assert await production.probe("workflow", sid) == "absent"
            await production.deprovision("workflow", sid)
        assert {
            sid: _node_objects(node_admin, ns, sandbox_base_name("workflow", sid))
            for sid in (shared, legacy, plain)
        } == held, "nothing of another installation's, nor of none, was written or deleted"
        same = running_runner_pod(core, ns, shared)
        assert same is not None and same.metadata.uid == pod.metadata.uid

        await production.deprovision("workflow", shared)
        await staging.deprovision("workflow", own)
        assert await production.list_managed() == [] and await staging.list_managed() == []
        assert {d.metadata.name for d in apps.list_namespaced_deployment(ns).items} == {
            sandbox_base_name("workflow", legacy),
            sandbox_base_name("workflow", plain),
        }
    finally:
        await production.close()
        await staging.close()


def _node_objects(admin: Any, ns: str, base: str) -> dict[str, Any]:
    """What a writer changes, on a node where controllers write status: uid, generation (a spec write
    bumps it), labels, deletion, the Secret's data and the replicas."""
    out = _owned_objects(admin, ns, base)
    dep = _read_or_none(_apps(admin).read_namespaced_deployment, base, ns)
    for kind in ("Deployment", "Secret", "PersistentVolumeClaim"):
        if kind in out:
            uid, _, labels, deleting = out[kind]
            out[kind] = (uid, dep.metadata.generation if kind == "Deployment" else None, labels, deleting)
    return out
