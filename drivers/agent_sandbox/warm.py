"""Warm pools for the agent-sandbox tier (an option upstream does not have), pure.

agent-sandbox's extensions keep ``SandboxWarmPool`` replicas of a ``SandboxTemplate`` running; a
``SandboxClaim`` adopts one (about 0.1 s against about 1 s for a cold Sandbox on the test node).
A warm pod is already running when it is claimed, so nothing per-sandbox can be in its env:

* **non-secret assignment** (the task queue, the sandbox id): annotations on the claim's
  ``additionalPodMetadata``, which the controller propagates to the running pod; the pod reads
  them from its downward-API file ``/etc/stigmer/podinfo/annotations``;
* **secrets** (the token, the operator's runner secrets, the Temporal connection settings): never a
  label or an annotation. The driver writes them into the pod over ``exec`` stdin (TLS to the API
  server, then the kubelet), into ``/run/stigmer/assignment.env`` on a memory-backed emptyDir,
  mode 0600; they appear in no claim, Sandbox, pod, event or process argument. With the default
  ``warm_assignment=async`` they are also kept in the Secret ``<base>-env`` owned by the claim (as the
  cold path keeps a Sandbox's), which no pod mounts: the driver reads it back to deliver them after a
  restart of its own.

The warm runner contract (``WARM_RUNNER_SCRIPT``): wait until both the task-queue annotation and
the assignment file are there, export them, then exec the normal runner entry
(``/runner/bin/start /runner/dist/main.js``). Runners that only read env keep the cold path.

Warm pods carry no workspace claim (a claim on the claim forces a cold start), so warm adoption
serves the workflow and connect scopes; a session keeps its cold Sandbox and its own claim.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any, Final

from drivers.agent_sandbox.manifests import runner_container
from drivers.contract import DriverConfig, SandboxEnvironment, SandboxScope
from drivers.kubernetes.manifests import (
    PLAIN_ORDER,
    TERMINATION_GRACE_SECONDS,
    WORKSPACE_DIR,
    WORKSPACE_VOLUME,
    runner_env,
    sandbox_secret,
)
from drivers.naming import installation_labels, sandbox_base_name, sandbox_labels
from drivers.runner.launch import runner_command

EXT_GROUP: Final = "extensions.agents.x-k8s.io"
EXT_VERSION: Final = "v1beta1"
EXT_API_VERSION: Final = f"{EXT_GROUP}/{EXT_VERSION}"
TEMPLATES: Final = "sandboxtemplates"
POOLS: Final = "sandboxwarmpools"
CLAIMS: Final = "sandboxclaims"
WARM_SCOPES: Final[frozenset[SandboxScope]] = frozenset({"workflow", "connect"})
LAUNCH_TYPE_LABEL: Final = "agents.x-k8s.io/launch-type"
ANNOTATION_TASK_QUEUE: Final = "stigmer.ai/task-queue"
ANNOTATION_SANDBOX_ID: Final = "stigmer.ai/sandbox-id"
ANNOTATION_SCOPE: Final = "stigmer.ai/scope"
PODINFO_DIR: Final = "/etc/stigmer/podinfo"
ASSIGNMENT_DIR: Final = "/run/stigmer"
ASSIGNMENT_FILE: Final = f"{ASSIGNMENT_DIR}/assignment.env"
#: Plain values that are the same for every sandbox: baked into the warm template's env.
_PER_SANDBOX_PLAIN: Final = frozenset({"STIGMER_TASK_QUEUE"})

#: On every pod of a warm pool (idle or claimed): what the assignment sessions' pod list selects.
WARM_POD_LABEL: Final = "stigmer.ai/warm"
#: Sent to a waiting warm runner (PID 1 of its container) once its assignment file is in place.
WAKE_SIGNAL: Final = "WINCH"
#: How often a waiting warm runner looks for its file unwoken (a backstop: the writer's wake starts it).
WAIT_POLL_S: Final = 0.05


def warm_runner_script(poll_s: float = WAIT_POLL_S) -> str:
    """The warm pod's command: wait with shell builtins only until the assignment arrives (an idle pool
    costs little), exit on TERM, export the file (the task queue and the secrets), exec the runner.

    The wait cannot lose its wake-up. The wake (the ``WAKE_SIGNAL`` trap, which kills the sleep being
    waited on) is armed before the file is first looked at, and each look comes after that round's
    sleep is started and its pid is known: a signal that lands after a look ends the very sleep the
    runner then waits on, and one that lands before a look finds the file there (the writer signals
    after the file is in place). A file without the queue (written by an older driver) falls back to
    the queue annotation, whose downward-API file lags the claim by up to about a second."""
    return (
        # PID 1 ignores a signal it does not trap: without this a pool pod waits out its whole grace.
        "trap 'exit 0' TERM INT; "
        # The wake, armed first. Its default action is to ignore it, so one that lands after the exec
        # below leaves the runner alone. KILL, not TERM: a child just forked, not yet the sleep, still
        # has the shell's TERM trap and would swallow a TERM (then sleep its whole round).
        f"s=; trap '[ -n \"$s\" ] && kill -9 $s 2>/dev/null' {WAKE_SIGNAL}; "
        f"a={ASSIGNMENT_FILE}; p={PODINFO_DIR}/annotations; "
        f'until sleep {poll_s:g} & s=$!; [ -s "$a" ]; do '
        "wait $s 2>/dev/null; kill -9 $s 2>/dev/null; wait $s 2>/dev/null; done; "  # (a woken wait: reaped)
        "kill -9 $s 2>/dev/null; wait $s 2>/dev/null; s=; "
        'set -a; . "$a"; set +a; '
        'if [ -z "${STIGMER_TASK_QUEUE:-}" ]; then q=; while :; do '
        f'q=$(sed -n \'s/^stigmer\\.ai\\/task-queue="\\(.*\\)"$/\\1/p\' "$p" 2>/dev/null); '
        '[ -n "$q" ] && break; sleep 0.05; done; '
        'export STIGMER_TASK_QUEUE="$q"; fi; '
        f"exec {' '.join(runner_command())}"
    )


WARM_RUNNER_SCRIPT: Final = warm_runner_script()


def warm_pod_template(config: DriverConfig) -> dict[str, Any]:
    """The pool's pod template: the runner container waiting for its assignment."""
    contract = runner_env(config, SandboxEnvironment(task_queue=""))
    owned = [k for k in PLAIN_ORDER if k in contract.plain and k not in _PER_SANDBOX_PLAIN]
    operator = [k for k in contract.plain if k not in PLAIN_ORDER]
    container = runner_container(
        config,
        ["/bin/sh", "-c", WARM_RUNNER_SCRIPT],
        [{"name": k, "value": contract.plain[k]} for k in (*owned, *operator)],
        [
            {"name": WORKSPACE_VOLUME, "mountPath": WORKSPACE_DIR},
            {"name": "assignment", "mountPath": ASSIGNMENT_DIR},
            {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True},
        ],
    )
    return {
        "metadata": {"labels": {**installation_labels(config.installation), WARM_POD_LABEL: "true"}},
        "spec": {
            "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
            "automountServiceAccountToken": False,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container],
            "volumes": [
                {"name": WORKSPACE_VOLUME, "emptyDir": {}},
                {"name": "assignment", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                {
                    "name": "podinfo",
                    "downwardAPI": {
                        "items": [{"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]
                    },
                },
            ],
        },
    }


POOL_NAME_PREFIX: Final = "stigmer-runner-warm-"


def pool_name(config: DriverConfig) -> str:
    """One template and pool per runner template and installation: a config change names a new pair,
    and two installations in one namespace never share (nor delete) each other's (the pod template
    carries the installation's label, so it is part of the hash)."""
    digest = hashlib.sha256(json.dumps(warm_pod_template(config), sort_keys=True).encode()).hexdigest()
    return f"{POOL_NAME_PREFIX}{digest[:10]}"


def template_manifest(config: DriverConfig) -> dict[str, Any]:
    return {
        "apiVersion": EXT_API_VERSION,
        "kind": "SandboxTemplate",
        "metadata": {
            "name": pool_name(config),
            "namespace": config.kubernetes_namespace,
            "labels": installation_labels(config.installation),
        },
        # No NetworkPolicy of the controller's making: the operator owns network policy.
        "spec": {"podTemplate": warm_pod_template(config), "networkPolicyManagement": "Unmanaged"},
    }


def pool_manifest(config: DriverConfig, replicas: int) -> dict[str, Any]:
    name = pool_name(config)
    return {
        "apiVersion": EXT_API_VERSION,
        "kind": "SandboxWarmPool",
        "metadata": {
            "name": name,
            "namespace": config.kubernetes_namespace,
            "labels": installation_labels(config.installation),
        },
        "spec": {"replicas": replicas, "sandboxTemplateRef": {"name": name}},
    }


def claim_manifest(
    config: DriverConfig, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
) -> dict[str, Any]:
    """A claim on the pool, named like the Sandbox it stands for, with the non-secret assignment."""
    return {
        "apiVersion": EXT_API_VERSION,
        "kind": "SandboxClaim",
        "metadata": {
            "name": sandbox_base_name(scope, sandbox_id),
            "namespace": config.kubernetes_namespace,
            "labels": sandbox_labels(scope, sandbox_id, config.installation),
        },
        "spec": {
            "warmPoolRef": {"name": pool_name(config)},
            "additionalPodMetadata": {
                "annotations": {
                    ANNOTATION_TASK_QUEUE: env.task_queue,
                    ANNOTATION_SANDBOX_ID: sandbox_id,
                    ANNOTATION_SCOPE: scope,
                }
            },
        },
    }


def assignment_file(config: DriverConfig, env: SandboxEnvironment) -> bytes:
    """What a warm runner exports, one shell-quoted ``NAME=value`` per line: its task queue (not a
    secret; also the claim's annotation, but the pod's downward-API copy of that lags) and the secrets."""
    secret = runner_env(config, env).secret
    lines = ["# stigmer sandbox assignment\n"]  # never empty: the runner waits for a non-empty file
    lines.append(f"STIGMER_TASK_QUEUE={shlex.quote(env.task_queue)}\n")
    lines += [f"{k}={shlex.quote(v)}\n" for k, v in secret.items()]
    return "".join(lines).encode("utf-8")


ASSIGNMENT_SECRET_KEY: Final = "assignment.env"
#: On a claim whose pod holds its assignment (``warm_assignment=async``): what a restarted driver skips.
ANNOTATION_ASSIGNED: Final = "stigmer.ai/assigned"


def assignment_secret_manifest(
    config: DriverConfig, scope: SandboxScope, sandbox_id: str, data: bytes, claim_uid: str
) -> dict[str, Any]:
    """The claim's assignment kept for a later delivery: Secret ``<base>-env``, owned by the claim
    (deleted with it), mounted by no pod."""
    secret = sandbox_secret(config, scope, sandbox_id, {ASSIGNMENT_SECRET_KEY: data})
    secret["metadata"]["ownerReferences"] = [
        {
            "apiVersion": EXT_API_VERSION,
            "kind": "SandboxClaim",
            "name": sandbox_base_name(scope, sandbox_id),
            "uid": claim_uid,
        }
    ]
    return secret


def assigned_patch() -> dict[str, Any]:
    return {"metadata": {"annotations": {ANNOTATION_ASSIGNED: "true"}}}


#: After the file is in place: wake the waiting runner (a runner already started ignores it).
_WAKE: Final = f"{{ kill -{WAKE_SIGNAL} 1 2>/dev/null || :; }}"


def assignment_session_command() -> list[str]:
    """An exec opened ahead in an idle pool pod (``drivers.agent_sandbox.exec_sessions``): read a
    length line, then exactly that many bytes of stdin, into the assignment file (0600), atomically.
    ``read`` takes stdin a byte at a time, so the bytes after the line are left for ``head``."""
    return [
        "/bin/sh",
        "-c",
        f'umask 077; IFS= read -r n || exit 3; head -c "$n" > {ASSIGNMENT_FILE}.tmp '
        f"&& mv {ASSIGNMENT_FILE}.tmp {ASSIGNMENT_FILE} && {_WAKE}",
        "assign-session",
    ]


def assignment_session_payload(data: bytes) -> bytes:
    """What a session's stdin is given: the length line, then the assignment file's bytes."""
    return f"{len(data)}\n".encode() + data


def assignment_command(size: int) -> list[str]:
    """Read exactly ``size`` bytes of stdin into the assignment file (0600), atomically."""
    return [
        "/bin/sh",
        "-c",
        f'umask 077; head -c "$1" > {ASSIGNMENT_FILE}.tmp && mv {ASSIGNMENT_FILE}.tmp {ASSIGNMENT_FILE} '
        f"&& {_WAKE}",
        "assign",
        str(size),
    ]
