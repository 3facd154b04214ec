"""The state store in the shipped manifests (issue 38): the base Deployment keeps its RocksDB
databases on an ``emptyDir`` at ``SANDBOX_LANES_STATE_DIR``; overlays/kubernetes-statefulset runs the
pod as a StatefulSet whose PersistentVolumeClaim per pod is mounted there instead, and its manifests
pass a server-side dry run on the real API server."""

from __future__ import annotations

from typing import Any

import pytest

from consumers.ops.settings import load_settings
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
