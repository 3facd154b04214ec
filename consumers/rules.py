"""The lane rules as pure functions.

A decision is ``decide(event, stored state, config) -> Decision`` (driver
commands + the state with the event applied + log intents), and the outcome of
running those commands is folded back by ``complete(decision, results, config)
-> Outcome`` (new state + output events + log intents). Nothing here does I/O,
reads a clock (time comes from the event) or mints a credential; that is what
makes replay and tests cheap.

Upstream mapping (``sandbox/steps.ts``): the session lane is
``ensureSessionSandboxForExecution``, the workflow lane
``ensureWorkflowSandboxForExecution``, the terminal observer
``newWorkflowSandboxTerminalObserver`` and session deletion
``deprovisionSessionSandboxBestEffort``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from consumers.constants import (
    LOG_SESSION_DEPROVISION_FAILED,
    LOG_SESSION_PROVISIONING_FAILED,
    LOG_SESSION_ROUTING_NOT_PER_SESSION,
    LOG_WORKFLOW_DEPROVISION_FAILED,
    LOG_WORKFLOW_DEPROVISIONED,
    LOG_WORKFLOW_PROVISIONING_FAILED,
    SANDBOX_PROVISIONING_FAILED_PREFIX,
    TERMINAL_WORKFLOW_PHASES,
    WORKFLOW_ROUTING_EXECUTION,
    WORKFLOW_SANDBOX_FAILED_MESSAGE,
)
from consumers.credentials import SandboxCredentialRequest
from consumers.dispatch import (
    AgentExecutionTemporalConfig,
    WorkflowExecutionTemporalConfig,
    format_session_task_queue,
    resolve_activity_task_queue,
    resolve_workflow_task_queue,
)
from drivers.contract import SandboxScope
from drivers.naming import sandbox_base_name
from events.codec import InputEvent, OutcomeEvent, derived_event_id
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2

#: How many applied input ids each execution remembers (the duplicate filter).
APPLIED_IDS_KEPT = 32
STATE_SCHEMA_VERSION = 1

_SCOPE_ENUM: dict[SandboxScope, int] = {
    "session": common_pb2.SANDBOX_SCOPE_SESSION,
    "workflow": common_pb2.SANDBOX_SCOPE_WORKFLOW,
    "connect": common_pb2.SANDBOX_SCOPE_CONNECT,
}


@dataclass(frozen=True)
class LaneConfig:
    """What the rules need to know: is the lane on, and the two routing configs."""

    enabled: bool
    agent: AgentExecutionTemporalConfig = field(default_factory=AgentExecutionTemporalConfig)
    workflow: WorkflowExecutionTemporalConfig = field(default_factory=WorkflowExecutionTemporalConfig)
    driver_name: str = ""
    source: str = "sandbox-lanes"


@dataclass(frozen=True)
class LogIntent:
    level: Literal["debug", "info", "warning", "error"]
    message: str
    fields: dict[str, str]


@dataclass(frozen=True)
class Ensure:
    scope: SandboxScope
    sandbox_id: str
    task_queue: str
    caller_class: str
    mint: SandboxCredentialRequest
    critical: bool


@dataclass(frozen=True)
class Deprovision:
    scope: SandboxScope
    sandbox_id: str
    phase: int


Command = Ensure | Deprovision


@dataclass(frozen=True)
class CommandResult:
    """What the edge reports back: success, or the error message (never a secret)."""

    ok: bool
    error: str = ""
    probe_state: str = ""
    token_minted: bool = False


@dataclass(frozen=True)
class Decision:
    event: InputEvent
    state: state_pb2.ExecutionState | None
    """The state with the event applied; ``None`` = nothing to write."""
    commands: tuple[Command, ...] = ()
    logs: tuple[LogIntent, ...] = ()
    reject: str | None = None
    """A reason to dead-letter the event instead of applying it."""
    duplicate: bool = False


@dataclass(frozen=True)
class Outcome:
    state: state_pb2.ExecutionState | None
    outputs: tuple[OutcomeEvent, ...]
    logs: tuple[LogIntent, ...]


class StateView:
    """Read access to stored state, handed to ``decide``.

    A protocol-like base so tests can pass a view that fails on any access,
    proving the disabled lane never reads state.
    """

    def __init__(self, state: state_pb2.ExecutionState | None) -> None:
        self._state = state

    def get(self) -> state_pb2.ExecutionState | None:
        return self._state


# --- decide --------------------------------------------------------------------------------------


def decide(event: InputEvent, stored: StateView, config: LaneConfig) -> Decision:
    """Apply one input event to the stored state; say which driver commands to run."""
    if not config.enabled:
        # Disabled lane: return before any state access (upstream test: the store proxy throws).
        return Decision(event=event, state=None)
    current = stored.get()
    event_id = event.meta.event_id
    if current is not None and event_id in current.applied_event_ids:
        return Decision(event=event, state=None, duplicate=True)
    if isinstance(event, inputs_pb2.ExecutionCreated):
        return _decide_created(event, current, config)
    if isinstance(event, inputs_pb2.PhaseChanged):
        return _decide_phase_changed(event, current)
    return _decide_session_deleted(event, current)


def _applied(
    current: state_pb2.ExecutionState | None, key: str, event: InputEvent
) -> state_pb2.ExecutionState:
    state = state_pb2.ExecutionState()
    if current is not None:
        state.CopyFrom(current)
    state.schema_version = STATE_SCHEMA_VERSION
    state.execution_id = key
    state.applied_event_ids.append(event.meta.event_id)
    if len(state.applied_event_ids) > APPLIED_IDS_KEPT:
        del state.applied_event_ids[: len(state.applied_event_ids) - APPLIED_IDS_KEPT]
    state.applied_count += 1
    if event.meta.HasField("occurred_at"):
        state.updated_at.CopyFrom(event.meta.occurred_at)
    return state


def _decide_created(
    event: inputs_pb2.ExecutionCreated, current: state_pb2.ExecutionState | None, config: LaneConfig
) -> Decision:
    already_created = current is not None and current.created
    state = _applied(current, event.execution_id, event)
    if already_created:
        # A second create for one execution (a producer retry under a new id) is a no-op.
        return Decision(event=event, state=state)
    state.created = True
    state.kind = event.kind
    state.session_id = event.session_id
    state.org = event.org
    if state.phase == common_pb2.EXECUTION_PHASE_UNSPECIFIED:
        state.phase = common_pb2.EXECUTION_PENDING
    if event.kind == common_pb2.AGENT_EXECUTION:
        return _session_lane(event, state, config)
    return _workflow_lane(event, state, config)


def _session_lane(
    event: inputs_pb2.ExecutionCreated, state: state_pb2.ExecutionState, config: LaneConfig
) -> Decision:
    session_id = event.session_id
    if session_id == "" or event.activity_task_queue != "":
        # No session, or the wfexec: override lane (child shares its parent's sandbox).
        return Decision(event=event, state=state)
    dispatch = resolve_activity_task_queue(session_id, event.session_execution_target, config.agent)
    if dispatch.execution_target != common_pb2.CLOUD:
        return Decision(event=event, state=state)
    if dispatch.task_queue != format_session_task_queue(session_id):
        warn = LogIntent(
            "warning",
            LOG_SESSION_ROUTING_NOT_PER_SESSION,
            {"executionId": event.execution_id, "sessionId": session_id, "taskQueue": dispatch.task_queue},
        )
        return Decision(event=event, state=state, logs=(warn,))
    ensure = Ensure(
        scope="session",
        sandbox_id=session_id,
        task_queue=dispatch.task_queue,
        caller_class=event.caller_class,
        mint=SandboxCredentialRequest(
            scope="session",
            session_id=session_id,
            execution_id=event.execution_id,
            org=event.org,
            caller_identity_id=event.caller_identity_id,
        ),
        critical=False,
    )
    return Decision(event=event, state=state, commands=(ensure,))


def _workflow_lane(
    event: inputs_pb2.ExecutionCreated, state: state_pb2.ExecutionState, config: LaneConfig
) -> Decision:
    execution_id = event.execution_id
    if execution_id == "" or config.workflow.workflow_activity_routing != WORKFLOW_ROUTING_EXECUTION:
        return Decision(event=event, state=state)
    dispatch = resolve_workflow_task_queue(execution_id, event.workflow_execution_target, config.workflow)
    if dispatch.execution_target != common_pb2.CLOUD:
        return Decision(event=event, state=state)
    ensure = Ensure(
        scope="workflow",
        sandbox_id=execution_id,
        task_queue=dispatch.task_queue,
        caller_class=event.caller_class,
        mint=SandboxCredentialRequest(
            scope="workflow",
            session_id="",
            execution_id=execution_id,
            org=event.org,
            caller_identity_id=event.caller_identity_id,
        ),
        critical=True,
    )
    return Decision(event=event, state=state, commands=(ensure,))


def _decide_phase_changed(
    event: inputs_pb2.PhaseChanged, current: state_pb2.ExecutionState | None
) -> Decision:
    if current is None or not current.created:
        return Decision(
            event=event,
            state=None,
            reject=(
                f"phase-changed for unknown execution '{event.execution_id}' (no execution-created applied)"
            ),
        )
    if current.kind != event.kind:
        return Decision(
            event=event,
            state=None,
            reject=(
                f"phase-changed kind {common_pb2.ExecutionKind.Name(event.kind)} does not match the "
                f"execution's kind {common_pb2.ExecutionKind.Name(current.kind)}"
            ),
        )
    state = _applied(current, event.execution_id, event)
    state.phase = event.new_phase
    if event.error and not state.status_error:
        state.status_error = event.error
    if (
        event.kind == common_pb2.WORKFLOW_EXECUTION
        and event.previous_phase != event.new_phase
        and event.new_phase in TERMINAL_WORKFLOW_PHASES
    ):
        command = Deprovision(scope="workflow", sandbox_id=event.execution_id, phase=event.new_phase)
        return Decision(event=event, state=state, commands=(command,))
    # Session sandboxes are long-lived: an agent execution's terminal phase tears nothing down.
    return Decision(event=event, state=state)


def _decide_session_deleted(
    event: inputs_pb2.SessionDeleted, current: state_pb2.ExecutionState | None
) -> Decision:
    state = _applied(current, event.session_id, event)
    command = Deprovision(
        scope="session", sandbox_id=event.session_id, phase=common_pb2.EXECUTION_PHASE_UNSPECIFIED
    )
    return Decision(event=event, state=state, commands=(command,))


# --- complete ------------------------------------------------------------------------------------


def complete(decision: Decision, results: Sequence[CommandResult], config: LaneConfig) -> Outcome:
    """Fold the commands' results into the state and the outcome events."""
    if len(results) != len(decision.commands):
        raise ValueError(f"{len(decision.commands)} commands but {len(results)} results")
    state = decision.state
    outputs: list[OutcomeEvent] = []
    logs: list[LogIntent] = list(decision.logs)
    for command, result in zip(decision.commands, results, strict=True):
        assert state is not None  # commands always come with a state
        if isinstance(command, Ensure):
            out, more_logs = _complete_ensure(decision.event, command, result, state, config)
        else:
            out, more_logs = _complete_deprovision(decision.event, command, result, state, config)
        outputs.append(out)
        logs.extend(more_logs)
    return Outcome(state=state, outputs=tuple(outputs), logs=tuple(logs))


def sandbox_ref(
    config: LaneConfig, scope: SandboxScope, sandbox_id: str, task_queue: str = ""
) -> common_pb2.SandboxRef:
    return common_pb2.SandboxRef(
        scope=_SCOPE_ENUM[scope],  # type: ignore[arg-type]
        sandbox_id=sandbox_id,
        name=sandbox_base_name(scope, sandbox_id),
        driver=config.driver_name,
        task_queue=task_queue,
    )


def _meta(event: InputEvent, kind: str, scope: SandboxScope, config: LaneConfig) -> common_pb2.EventMeta:
    meta = common_pb2.EventMeta(
        event_id=derived_event_id(event.meta.event_id, kind, scope),
        schema_version=STATE_SCHEMA_VERSION,
        source=config.source,
        causation_id=event.meta.event_id,
    )
    if event.meta.HasField("occurred_at"):
        meta.occurred_at.CopyFrom(event.meta.occurred_at)
    return meta


def _record(
    state: state_pb2.ExecutionState, ref: common_pb2.SandboxRef, lifecycle: int, reason: str, outcome_id: str
) -> None:
    for existing in state.sandboxes:
        if existing.sandbox.scope == ref.scope and existing.sandbox.sandbox_id == ref.sandbox_id:
            target = existing
            break
    else:
        target = state.sandboxes.add()
    target.sandbox.CopyFrom(ref)
    target.lifecycle = lifecycle  # type: ignore[assignment]
    target.reason = reason
    target.outcome_event_id = outcome_id


def _complete_ensure(
    event: InputEvent,
    command: Ensure,
    result: CommandResult,
    state: state_pb2.ExecutionState,
    config: LaneConfig,
) -> tuple[OutcomeEvent, list[LogIntent]]:
    ref = sandbox_ref(config, command.scope, command.sandbox_id, command.task_queue)
    execution_id = command.mint.execution_id
    if result.ok:
        provisioned = outcomes_pb2.SandboxProvisioned(
            meta=_meta(event, "SandboxProvisioned", command.scope, config),
            execution_id=execution_id,
            sandbox=ref,
            probe_state=result.probe_state,
            token_minted=result.token_minted,
        )
        _record(state, ref, state_pb2.SANDBOX_PROVISIONED, "", provisioned.meta.event_id)
        return provisioned, []
    failed = outcomes_pb2.SandboxFailed(
        meta=_meta(event, "SandboxFailed", command.scope, config),
        execution_id=execution_id,
        sandbox=ref,
        reason=result.error,
        critical=command.critical,
        code=common_pb2.STATUS_CODE_UNAVAILABLE,
    )
    if command.critical:
        failed.message = WORKFLOW_SANDBOX_FAILED_MESSAGE
        logs = [
            LogIntent(
                "error",
                LOG_WORKFLOW_PROVISIONING_FAILED,
                {"executionId": execution_id, "error": result.error},
            )
        ]
    else:
        # The pre-stamp: first non-empty status.error wins; the phase is never touched.
        stamp = SANDBOX_PROVISIONING_FAILED_PREFIX + result.error
        if not state.status_error:
            state.status_error = stamp
        failed.message = stamp
        logs = [
            LogIntent(
                "error",
                LOG_SESSION_PROVISIONING_FAILED,
                {"executionId": execution_id, "sessionId": command.sandbox_id, "error": result.error},
            )
        ]
    _record(state, ref, state_pb2.SANDBOX_FAILED, result.error, failed.meta.event_id)
    return failed, logs


def _complete_deprovision(
    event: InputEvent,
    command: Deprovision,
    result: CommandResult,
    state: state_pb2.ExecutionState,
    config: LaneConfig,
) -> tuple[OutcomeEvent, list[LogIntent]]:
    ref = sandbox_ref(config, command.scope, command.sandbox_id)
    execution_id = command.sandbox_id if command.scope == "workflow" else ""
    if result.ok:
        done = outcomes_pb2.SandboxDeprovisioned(
            meta=_meta(event, "SandboxDeprovisioned", command.scope, config),
            execution_id=execution_id,
            sandbox=ref,
            phase=command.phase,  # type: ignore[arg-type]
        )
        _record(state, ref, state_pb2.SANDBOX_DEPROVISIONED, "", done.meta.event_id)
        logs = []
        if command.scope == "workflow":
            phase = common_pb2.ExecutionPhase.Name(command.phase)  # type: ignore[arg-type]
            logs.append(
                LogIntent("info", LOG_WORKFLOW_DEPROVISIONED, {"executionId": execution_id, "phase": phase})
            )
        return done, logs
    failed = outcomes_pb2.SandboxTeardownFailed(
        meta=_meta(event, "SandboxTeardownFailed", command.scope, config),
        execution_id=execution_id,
        sandbox=ref,
        reason=result.error,
        phase=command.phase,  # type: ignore[arg-type]
    )
    _record(state, ref, state_pb2.SANDBOX_TEARDOWN_FAILED, result.error, failed.meta.event_id)
    if command.scope == "workflow":
        log = LogIntent(
            "error", LOG_WORKFLOW_DEPROVISION_FAILED, {"executionId": execution_id, "error": result.error}
        )
    else:
        log = LogIntent(
            "error", LOG_SESSION_DEPROVISION_FAILED, {"sessionId": command.sandbox_id, "error": result.error}
        )
    return failed, [log]
