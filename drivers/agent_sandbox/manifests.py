"""The agent-sandbox tier's objects (upstream ``sandbox/agent-sandbox/manifest.ts``, Era D), pure.

One ``Sandbox`` custom resource of kubernetes-sigs/agent-sandbox (``agents.x-k8s.io/v1beta1``) per
sandbox, named ``sandbox_base_name``, plus its Secret ``<base>-env`` owned by it:

* created **Suspended** (the driver wakes it after writing the Secret), labelled, no Service;
* the session scope gets one ``workspace`` volumeClaimTemplate (RWO, 10Gi): the controller makes
  the claim ``workspace-<base>``, which survives a suspend; workflow and connect use an emptyDir;
* the pod template's runner container is the kubernetes tier's (root, HOME, /workspace,
  FallbackToLogsOnError, 500m/512Mi-2/2Gi, no probes, grace 600, no service-account token,
  RuntimeDefault seccomp), with every secretKeyRef ``optional: true`` and the capabilities
  SETUID, SETGID, CHOWN, KILL and DAC_OVERRIDE added back after dropping ALL (the runner starts
  the agent as its own user).
"""

from __future__ import annotations

from typing import Any, Final

from drivers.contract import DriverConfig, SandboxEnvironment, SandboxScope
from drivers.kubernetes.manifests import (
    CONTAINER_NAME,
    DEFAULT_RESOURCES,
    RUNNER_COMMAND,
    TERMINATION_GRACE_SECONDS,
    WORKSPACE_DIR,
    WORKSPACE_VOLUME,
    container_env,
    secret_manifest,
)
from drivers.naming import sandbox_base_name, sandbox_labels

GROUP: Final = "agents.x-k8s.io"
VERSION: Final = "v1beta1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "Sandbox"
PLURAL: Final = "sandboxes"
RUNNING: Final = "Running"
SUSPENDED: Final = "Suspended"
WORKSPACE_STORAGE: Final = "10Gi"
#: Added back after ``drop: [ALL]`` (upstream's newest manifest).
ADDED_CAPABILITIES: Final[tuple[str, ...]] = ("SETUID", "SETGID", "CHOWN", "KILL", "DAC_OVERRIDE")
#: Only the session scope keeps a workspace claim (the workflow scope shares connect's path).
CLAIM_SCOPES: Final[frozenset[SandboxScope]] = frozenset({"session"})


def workspace_claim_name(base: str) -> str:
    """The claim the controller makes from the ``workspace`` template: ``<template>-<sandbox>``."""
    return f"{WORKSPACE_VOLUME}-{base}"


def runner_container(
    config: DriverConfig, command: list[str], env: list[dict[str, Any]], mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The runner container of both the cold Sandbox and the warm pool's template."""
    opts = {k: config.options.get(k) or default for k, default in DEFAULT_RESOURCES.items()}
    return {
        "name": CONTAINER_NAME,
        "image": config.runner_image,
        "command": command,
        "workingDir": WORKSPACE_DIR,
        "env": env,
        "resources": {
            "requests": {"cpu": opts["cpu_request"], "memory": opts["memory_request"]},
            "limits": {"cpu": opts["cpu_limit"], "memory": opts["memory_limit"]},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": list(ADDED_CAPABILITIES)},
            "runAsUser": 0,
            "runAsGroup": 0,
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": mounts,
    }


def pod_template(
    config: DriverConfig, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
) -> dict[str, Any]:
    """``spec.podTemplate``: what the ensure's wake patch writes again (this server's template)."""
    base = sandbox_base_name(scope, sandbox_id)
    container = runner_container(
        config,
        list(RUNNER_COMMAND),
        container_env(config, base, env, optional_refs=True),
        [{"name": WORKSPACE_VOLUME, "mountPath": WORKSPACE_DIR}],
    )
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
    }
    if scope not in CLAIM_SCOPES:  # the session's volume comes from its volumeClaimTemplate
        spec["volumes"] = [{"name": WORKSPACE_VOLUME, "emptyDir": {}}]
    return {"metadata": {"labels": sandbox_labels(scope, sandbox_id, config.installation)}, "spec": spec}


def sandbox_manifest(
    config: DriverConfig, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
) -> dict[str, Any]:
    """The Sandbox as created: Suspended, so nothing starts before its Secret holds the token."""
    spec: dict[str, Any] = {
        "operatingMode": SUSPENDED,
        "podTemplate": pod_template(config, scope, sandbox_id, env),
    }
    if scope in CLAIM_SCOPES:
        claim: dict[str, Any] = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": config.options.get("storage_size") or WORKSPACE_STORAGE}},
        }
        if config.options.get("storage_class"):
            claim["storageClassName"] = config.options["storage_class"]
        spec["volumeClaimTemplates"] = [{"metadata": {"name": WORKSPACE_VOLUME}, "spec": claim}]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": sandbox_base_name(scope, sandbox_id),
            "namespace": config.kubernetes_namespace,
            "labels": sandbox_labels(scope, sandbox_id, config.installation),
        },
        "spec": spec,
    }


def owned_secret_manifest(
    config: DriverConfig, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment, owner_uid: str
) -> dict[str, Any]:
    """The kubernetes tier's Secret ``<base>-env`` (always written, empty when token-less), owned by
    the Sandbox: the garbage collector deletes it with its Sandbox. No ``blockOwnerDeletion``
    (upstream), so a foreground delete never waits on it."""
    secret = secret_manifest(config, scope, sandbox_id, env)
    base = sandbox_base_name(scope, sandbox_id)
    secret["metadata"]["ownerReferences"] = [
        {"apiVersion": API_VERSION, "kind": KIND, "name": base, "uid": owner_uid}
    ]
    return secret


def wake_patch(
    config: DriverConfig, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
) -> list[dict[str, Any]]:
    """One JSON Patch: ``operatingMode: Running`` together with this server's pod template."""
    return [
        {"op": "add", "path": "/spec/operatingMode", "value": RUNNING},
        {"op": "add", "path": "/spec/podTemplate", "value": pod_template(config, scope, sandbox_id, env)},
    ]


SUSPEND_PATCH: Final[list[dict[str, Any]]] = [
    {"op": "add", "path": "/spec/operatingMode", "value": SUSPENDED}
]
