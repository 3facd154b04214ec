"""The kubernetes tier's objects as manifests: the runner Secret, the workspace PVC, the Deployment.

Pure functions of the driver config and the sandbox; the driver applies them server-side."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any, Final

from drivers.contract import (
    DriverConfig,
    SandboxEnvironment,
    SandboxScope,
)
from drivers.naming import (
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    MANAGED_BY_VALUE,
    sandbox_base_name,
    sandbox_labels,
)
from drivers.runner.env import TOKEN_ENV, RunnerEnv, build_runner_env
from drivers.runner.launch import RUNNER_HOME as LAUNCH_HOME
from drivers.runner.launch import runner_command

CONTAINER_NAME: Final = "runner"
RUNNER_COMMAND: Final[tuple[str, ...]] = tuple(runner_command())
WORKSPACE_DIR: Final = "/workspace"
RUNNER_HOME: Final = LAUNCH_HOME
#: Rendering order of the driver-owned plain values (upstream's manifest order).
PLAIN_ORDER: Final[tuple[str, ...]] = (
    "MODE",
    "STIGMER_TASK_QUEUE",
    "STIGMER_BACKEND_ENDPOINT",
    "TEMPORAL_SERVICE_ADDRESS",
    "WORKSPACE_ROOT_DIR",
    "TEMPORAL_NAMESPACE",
    "HOME",
    "STIGMER_MCP_PUBLIC_ENDPOINT",
)
WORKSPACE_VOLUME: Final = "workspace"
TERMINATION_GRACE_SECONDS: Final = 600
DEFAULT_STORAGE_SIZE: Final = "10Gi"
DEFAULT_RESOURCES: Final[dict[str, str]] = {
    "cpu_request": "500m",
    "memory_request": "512Mi",
    "cpu_limit": "2",
    "memory_limit": "2Gi",
}
PERSISTENT_SCOPES: Final[frozenset[SandboxScope]] = frozenset({"session", "workflow"})


def secret_name(base: str) -> str:
    return f"{base}-env"


def pvc_name(base: str) -> str:
    return f"{base}-workspace"


# --------------------------------------------------------------------------- manifests (pure)


def runner_env(config: DriverConfig, env: SandboxEnvironment) -> RunnerEnv:
    """The shared runner env contract (``drivers.runner.env``), rooted at ``/workspace``."""
    return build_runner_env(config, env, workspace_dir=WORKSPACE_DIR, home=RUNNER_HOME)


def secret_manifest(
    config: DriverConfig, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
) -> dict[str, Any]:
    data = {k: v.encode("utf-8") for k, v in runner_env(config, env).secret.items()}
    return sandbox_secret(config, scope, sandbox_id, data)


def sandbox_secret(
    config: DriverConfig, scope: SandboxScope, sandbox_id: str, data: Mapping[str, bytes]
) -> dict[str, Any]:
    """A sandbox's Secret ``<base>-env``, labelled like the sandbox, holding ``data``."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(sandbox_base_name(scope, sandbox_id)),
            "namespace": config.kubernetes_namespace,
            "labels": sandbox_labels(scope, sandbox_id, config.installation),
        },
        "type": "Opaque",
        "data": {k: base64.b64encode(v).decode("ascii") for k, v in data.items()},
    }


def pvc_manifest(config: DriverConfig, scope: SandboxScope, sandbox_id: str) -> dict[str, Any]:
    base = sandbox_base_name(scope, sandbox_id)
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": config.options.get("storage_size") or DEFAULT_STORAGE_SIZE}},
    }
    storage_class = config.options.get("storage_class")
    if storage_class:
        spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": pvc_name(base),
            "namespace": config.kubernetes_namespace,
            "labels": sandbox_labels(scope, sandbox_id, config.installation),
        },
        "spec": spec,
    }


def container_env(
    config: DriverConfig, base: str, env: SandboxEnvironment, *, optional_refs: bool = False
) -> list[dict[str, Any]]:
    """Plain values by value (driver-owned first, then the operator's); secrets by secretKeyRef.

    ``optional_refs`` (the agent-sandbox tier) lets the pod start when a key was dropped from the Secret.
    """
    contract = runner_env(config, env)
    owned = [k for k in PLAIN_ORDER if k in contract.plain]
    operator = [k for k in contract.plain if k not in PLAIN_ORDER]
    out: list[dict[str, Any]] = [{"name": k, "value": contract.plain[k]} for k in (*owned, *operator)]
    secret_keys = [TOKEN_ENV] if TOKEN_ENV in contract.secret else []
    secret_keys += [k for k in contract.secret if k != TOKEN_ENV]
    for k in secret_keys:
        ref: dict[str, Any] = {"name": secret_name(base), "key": k}
        if optional_refs:
            ref["optional"] = True
        out.append({"name": k, "valueFrom": {"secretKeyRef": ref}})
    return out


def deployment_manifest(
    config: DriverConfig, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
) -> dict[str, Any]:
    base = sandbox_base_name(scope, sandbox_id)
    labels = sandbox_labels(scope, sandbox_id, config.installation)
    opts = {k: config.options.get(k) or default for k, default in DEFAULT_RESOURCES.items()}
    volume: dict[str, Any] = (
        {"name": WORKSPACE_VOLUME, "persistentVolumeClaim": {"claimName": pvc_name(base)}}
        if scope in PERSISTENT_SCOPES
        else {"name": WORKSPACE_VOLUME, "emptyDir": {}}
    )
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": config.runner_image,
        "command": list(RUNNER_COMMAND),
        "workingDir": WORKSPACE_DIR,
        "env": container_env(config, base, env),
        "resources": {
            "requests": {"cpu": opts["cpu_request"], "memory": opts["memory_request"]},
            "limits": {"cpu": opts["cpu_limit"], "memory": opts["memory_limit"]},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsUser": 0,
            "runAsGroup": 0,
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": WORKSPACE_VOLUME, "mountPath": WORKSPACE_DIR}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": base, "namespace": config.kubernetes_namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {
                "matchLabels": {LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_SANDBOX_ID: sandbox_id},
            },
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
                    "automountServiceAccountToken": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [volume],
                },
            },
        },
    }


# --------------------------------------------------------------------------- errors
