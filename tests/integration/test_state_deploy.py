"""The state store in the shipped manifests (issue 38): the base Deployment keeps its RocksDB
databases on an ``emptyDir`` at ``SANDBOX_LANES_STATE_DIR``; overlays/kubernetes-statefulset runs the
pod as a StatefulSet whose PersistentVolumeClaim per pod is mounted there instead, and its manifests
pass a server-side dry run on the real API server.

On the harness's single-node cluster the overlay is applied for real (``kubectl apply -k``, the pod
image built from the repo's Dockerfile, as tests/integration/test_kubernetes_deploy.py does): the
claim is bound, the pod's RocksDB databases are on it, and the pod deleted and brought back by the
StatefulSet controller resumes from its checkpoints, reading no state record again. The claim binds
to a static hostPath PersistentVolume made for it: the node's own provisioner (the
controller-manager's hostPath one) creates root-owned 0750 directories, which the pod, running as
uid 10001, cannot write (a hostPath volume ignores ``fsGroup``; a CSI provisioner honours it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from consumers.ops.settings import load_settings
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from tests.integration.test_packaging import manifests


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _state_dir(container: dict[str, Any]) -> str:
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    settings = load_settings(values)
    assert settings.state_store == "rocksdb"
    return settings.state_dir


@pytest.mark.kubernetes
@pytest.mark.parametrize("overlay", ["kubernetes", "agent-sandbox"])
def test_the_deployment_keeps_its_states_on_an_empty_dir(overlay: str) -> None:
    (dep,) = [d for d in manifests(overlay) if d["kind"] == "Deployment"]
    container = _container(dep)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = mounts[_state_dir(container)]
    (declared,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == volume]
    assert "emptyDir" in declared


@pytest.mark.kubernetes
def test_the_statefulset_overlay_mounts_a_claim_per_pod_and_passes_a_dry_run(kube_admin: Any) -> None:
    from kubernetes import dynamic

    docs = manifests("kubernetes-statefulset")
    assert [d for d in docs if d["kind"] == "Deployment"] == []
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    container = _container(sts)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    claim = mounts[_state_dir(container)]
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == [claim]
    assert claim not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
    (service,) = [d for d in docs if d["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"

    dyn = dynamic.DynamicClient(kube_admin)

    def apply(doc: dict[str, Any], *, dry_run: bool) -> Any:
        resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        return dyn.server_side_apply(
            resource,
            body=doc,
            namespace=doc["metadata"].get("namespace"),
            field_manager="sandbox-lanes-test",
            force_conflicts=True,
            dry_run="All" if dry_run else None,
            query_params=[("fieldValidation", "Strict")],
        )

    for doc in docs:
        if doc["kind"] in ("Namespace", "ServiceAccount"):
            apply(doc, dry_run=False)
    for doc in docs:
        assert apply(doc, dry_run=True).metadata.name == doc["metadata"]["name"]


# --------------------------------------------------------------------------- on the node

STATE_UID = 10001  # the image's user (Dockerfile), the pod's runAsUser
CLAIM = "state-sandbox-lanes-0"  # <volumeClaimTemplate>-<statefulset>-<ordinal>


def _statefulset_overlay(into: Path, env: dict[str, str], http_port: int) -> Path:
    """test_kubernetes_deploy's node overlay (image, loopback, the test's topics) over the
    StatefulSet overlay: its patches aimed at the workload kind the overlay ships."""
    from tests.integration.test_kubernetes_deploy import OVERLAYS, node_overlay

    token_key = base64.b64encode(secrets.token_bytes(32)).decode()
    overlay = node_overlay(into, OVERLAYS / "kubernetes-statefulset", env, http_port, token_key)
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    for patch in kustomization["patches"]:
        if patch.get("target", {}).get("kind") == "Deployment":
            patch["target"]["kind"] = "StatefulSet"
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    env_patch = yaml.safe_load((overlay / "env.yaml").read_text())
    env_patch["kind"] = "StatefulSet"
    (overlay / "env.yaml").write_text(yaml.safe_dump(env_patch))
    return overlay


def _static_volume(name: str, path: Path) -> dict[str, Any]:
    """A hostPath PersistentVolume bound in advance to the StatefulSet's first claim."""
    from harness.kube_node import STORAGE_CLASS

    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "4Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": STORAGE_CLASS,
            "hostPath": {"path": str(path), "type": "Directory"},
            "claimRef": {"namespace": "sandbox-lanes", "name": CLAIM},
        },
    }


def _restores(log: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.splitlines() if '"state restored"' in line]


@pytest.mark.kubernetes
@pytest.mark.docker
@pytest.mark.kafka
@pytest.mark.timeout(1800)  # the first user of pod_image builds it: several minutes on vfs
async def test_the_statefulset_on_the_node_keeps_its_states_on_its_claim_and_a_restart_reads_only_the_tail(
    dockerd: Any,
    pod_image: dict[str, Any],
    kube_node: Any,
    node_admin: Any,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    from kubernetes import client

    from tests.integration.test_kubernetes_deploy import (
        POD_NAMESPACE,
        _delete_namespaces,
        _diagnosis,
        _import_pod_image,
        _namespaces_gone,
        kubectl,
        node_pod_env,
    )
    from tests.integration.test_kubernetes_node import SMALL_RUNNER, wait_for
    from tests.integration.test_ops_http import free_port
    from tests.support.chaos_verify import read_all
    from tests.support.pod_harness import create_inputs, new_meta, produce, unique_env

    core = client.CoreV1Api(node_admin)
    await wait_for("namespaces of an earlier run to go", lambda: _namespaces_gone(core), timeout=120)
    await asyncio.to_thread(_import_pod_image, dockerd, kube_node)
    isolated = unique_env(kafka_bootstrap, tmp_path)
    http_port = free_port()
    env = node_pod_env(isolated, kafka_bootstrap, kube_node, http_port, SMALL_RUNNER)
    overlay = _statefulset_overlay(tmp_path / "node-overlay", env, http_port)
    pod_env = {**isolated, **env, "SANDBOX_PROVISIONER_TYPE": "kubernetes"}  # the overlay sets it
    await create_inputs(pod_env)
    topics = load_settings(pod_env).topics

    volume_dir = tmp_path / "state-volume"
    volume_dir.mkdir()
    shutil.chown(volume_dir, STATE_UID, STATE_UID)
    volume_dir.chmod(0o750)
    volume = f"sandbox-lanes-state-{uuid.uuid4().hex[:6]}"
    core.create_persistent_volume(_static_volume(volume, volume_dir))

    def ready_pod(not_uid: str | None = None) -> Any:
        try:
            pod = core.read_namespaced_pod("sandbox-lanes-0", POD_NAMESPACE)
        except client.exceptions.ApiException:
            return None
        conditions = {c.type: c.status for c in pod.status.conditions or []}
        return pod if conditions.get("Ready") == "True" and pod.metadata.uid != not_uid else None

    try:
        started = time.monotonic()
        await asyncio.to_thread(kubectl, kube_node, "apply", "-k", str(overlay))
        try:
            first = await wait_for("sandbox-lanes-0 to be Ready", ready_pod, timeout=180)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diagnosis(core)}") from None
        ready_after = time.monotonic() - started
        claim = core.read_namespaced_persistent_volume_claim(CLAIM, POD_NAMESPACE)
        assert claim.status.phase == "Bound" and claim.spec.volume_name == volume
        (mounted,) = [v for v in first.spec.volumes if v.persistent_volume_claim is not None]
        assert mounted.persistent_volume_claim.claim_name == CLAIM

        # Agent executions without a session: the pod keeps their states and calls no driver (the
        # kubernetes driver's runner pods on the node: test_kubernetes_deploy).
        def no_sandbox(execution_id: str) -> inputs_pb2.ExecutionCreated:
            return inputs_pb2.ExecutionCreated(
                meta=new_meta(), kind=common_pb2.AGENT_EXECUTION, execution_id=execution_id
            )

        async def states_written(n: int) -> Counter[str]:
            deadline = time.monotonic() + 90
            while True:
                keys = Counter((r.key or b"").decode() for r in await read_all(kafka_bootstrap, topics.state))
                if len(keys) >= n or time.monotonic() > deadline:
                    return keys
                await asyncio.sleep(0.5)

        executions = [f"sts_{i}" for i in range(20)]
        await produce(kafka_bootstrap, pod_env, *(no_sandbox(e) for e in executions))
        assert set(await states_written(20)) == set(executions)
        # The pod's RocksDB databases are on the claim's volume, one per partition.
        for partition in (0, 1):
            assert (volume_dir / topics.state / str(partition) / "CURRENT").is_file()
        first_log = core.read_namespaced_pod_log("sandbox-lanes-0", POD_NAMESPACE)
        assert [r["fromCheckpoint"] for r in _restores(first_log)] == [0]

        # Deleted (as a rolling update or an eviction does), brought back by the StatefulSet controller
        # with the same claim: it resumes from its checkpoints and reads no state record again.
        core.delete_namespaced_pod("sandbox-lanes-0", POD_NAMESPACE)
        deleted = time.monotonic()
        try:
            second = await wait_for(
                "sandbox-lanes-0 back and Ready", lambda: ready_pod(first.metadata.uid), timeout=240
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diagnosis(core)}") from None
        back_after = time.monotonic() - deleted
        assert second.spec.node_name == first.spec.node_name
        restores = _restores(core.read_namespaced_pod_log("sandbox-lanes-0", POD_NAMESPACE))
        assert [(r["fromCheckpoint"], r["records"], r["keys"]) for r in restores] == [(2, 0, 20)], restores

        later = [f"sts_later_{i}" for i in range(10)]
        await produce(kafka_bootstrap, pod_env, *(no_sandbox(e) for e in later))
        # Each execution's state written once: nothing of before the restart decided again.
        assert await states_written(30) == Counter(executions + later)
        print(
            f"\nStatefulSet pod Ready {ready_after:.1f}s after apply; back and Ready {back_after:.1f}s after "
            f"its deletion, restored {restores[0]['keys']} keys from its checkpoints in "
            f"{restores[0]['seconds']} s"
        )
    finally:
        _delete_namespaces(core)
        await wait_for("the test namespaces to go", lambda: _namespaces_gone(core), timeout=120)
        core.delete_persistent_volume(volume)
        shutil.rmtree(volume_dir, ignore_errors=True)
