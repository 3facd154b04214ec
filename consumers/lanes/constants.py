"""Upstream constants, byte-identical to the stigmer server (see the spec's quick-reference table).

Log messages are constants too: operators grep for them and the seed tests pin
some of them (e.g. "sandbox may be leaked").
"""

from __future__ import annotations

from typing import Final

from events.sandbox_lanes.v1 import common_pb2

SANDBOX_PROVISIONING_FAILED_PREFIX: Final = "Sandbox provisioning failed: "
WORKFLOW_SANDBOX_FAILED_MESSAGE: Final = "failed to provision workflow sandbox"

SESSION_QUEUE_PREFIX: Final = "session:"
WFEXEC_QUEUE_PREFIX: Final = "wfexec:"

TOKEN_TYPE_EXECUTION_SCOPED: Final = "execution_scoped"
SANDBOX_TOKEN_TTL_SECONDS: Final = 4 * 60 * 60
DEFAULT_TOKEN_TTL_SECONDS: Final = 3600

ROUTING_GLOBAL: Final = "global"
ROUTING_SESSION: Final = "session"
WORKFLOW_ROUTING_GLOBAL: Final = "global"
WORKFLOW_ROUTING_EXECUTION: Final = "execution"
DEFAULT_EXECUTION_TARGET_LOCAL: Final = "local"
DEFAULT_EXECUTION_TARGET_CLOUD: Final = "cloud"
WORKFLOW_DEFAULT_EXECUTION_TARGET_LOCAL: Final = "local"
WORKFLOW_DEFAULT_EXECUTION_TARGET_CLOUD: Final = "cloud"

TERMINAL_WORKFLOW_PHASES: Final = frozenset(
    {
        common_pb2.EXECUTION_COMPLETED,
        common_pb2.EXECUTION_FAILED,
        common_pb2.EXECUTION_CANCELLED,
        common_pb2.EXECUTION_TERMINATED,
    }
)

# --- log lines (upstream wording) ---------------------------------------------------------------
LOG_SESSION_ROUTING_NOT_PER_SESSION: Final = (
    "Sandbox provisioning skipped: session routing is not per-session"
)
LOG_SESSION_PROVISIONING_FAILED: Final = (
    "Session sandbox provisioning failed - execution will time out unless a runner polls its queue"
)
LOG_PRESTAMP_FAILED: Final = "Failed to pre-stamp sandbox provisioning failure"
LOG_WORKFLOW_PROVISIONING_FAILED: Final = "Workflow sandbox provisioning failed - refusing the request"
LOG_WORKFLOW_DEPROVISIONED: Final = "Workflow sandbox deprovisioned on terminal phase"
LOG_WORKFLOW_DEPROVISION_FAILED: Final = "Workflow sandbox deprovision failed - sandbox may be leaked"
#: Not upstream's (its create of an execution in a deleted session fails before any lane runs).
LOG_SESSION_DELETED_NOT_PROVISIONED: Final = "session deleted - session sandbox not provisioned"
LOG_SESSION_DEPROVISION_FAILED: Final = "Session sandbox deprovision failed - sandbox may be leaked"
#: Era C text, the era of the drivers (caller class, the runner start script, the Temporal
#: connection handover); Era B said "— ExecutionContext reads will be redacted".
LOG_TOKENLESS_LAUNCH: Final = (
    "Sandbox launching without a runner token (credential lane disabled) — its values fetch will be refused"
)
LOG_PROVISIONER_COMPOSED: Final = "sandbox provisioner composed"
LOG_DISPATCH_OVERRIDE: Final = "Dispatch using activity_task_queue override (sandbox affinity)"
LOG_DISPATCH_RESOLVED: Final = "Dispatch resolved activity task queue"
LOG_WORKFLOW_DISPATCH_PER_EXECUTION: Final = "Workflow dispatch resolved per-execution queue"
LOG_WORKFLOW_DISPATCH_GLOBAL: Final = "Workflow dispatch resolved global queue"

# --- credential provider errors ------------------------------------------------------------------
MINTING_DISABLED_MESSAGE: Final = "runner token minting is disabled - no signing key configured"
INVALID_RUNNER_TOKEN_MESSAGE: Final = "invalid runner token"
EXECUTION_ID_REQUIRED_MESSAGE: Final = "execution id is required to mint a runner token"


def lane_not_provided_message(lane: str) -> str:
    return (
        f"runner credential lane '{lane}' is not provided by this implementation "
        f"(provides '{TOKEN_TYPE_EXECUTION_SCOPED}')"
    )


def routing_coherence_message(provisioner_type: str) -> str:
    return (
        f"SANDBOX_PROVISIONER_TYPE='{provisioner_type}' requires a per-queue routing mode — set "
        "STIGMER_ACTIVITY_ROUTING=session and/or STIGMER_WORKFLOW_ACTIVITY_ROUTING=execution "
        "(a provisioner no dispatch can reach must fail loudly, not sit dark)"
    )
