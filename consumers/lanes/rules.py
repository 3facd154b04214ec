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

from google.protobuf.timestamp_pb2 import Timestamp

from consumers.lanes import capacity_rules
from consumers.lanes.commands import (
    SCOPE_ENUM,
    CommandResult,
    Decision,
    Deprovision,
    Ensure,
    LaneConfig,
    LogIntent,
    Outcome,
    StateView,
)
from consumers.lanes.constants import (
    LOG_DISPATCH_RESOLVED,
    LOG_SESSION_DELETED_NOT_PROVISIONED,
    LOG_SESSION_DEPROVISION_FAILED,
    LOG_SESSION_PROVISIONING_FAILED,
    LOG_SESSION_ROUTING_NOT_PER_SESSION,
    LOG_WORKFLOW_DEPROVISION_FAILED,
    LOG_WORKFLOW_DEPROVISIONED,
    LOG_WORKFLOW_DISPATCH_PER_EXECUTION,
    LOG_WORKFLOW_PROVISIONING_FAILED,
    SANDBOX_PROVISIONING_FAILED_PREFIX,
    TERMINAL_WORKFLOW_PHASES,
    WORKFLOW_ROUTING_EXECUTION,
    WORKFLOW_SANDBOX_FAILED_MESSAGE,
)
from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.lanes.dispatch import (
    format_session_task_queue,
    resolve_activity_task_queue,
    resolve_workflow_task_queue,
)
from consumers.lanes.outbox import command_of, effect_id_of, fill_pending
from drivers.contract import SandboxScope
from drivers.naming import sandbox_base_name
from events.codec import CapacityAnswer, CapacityRecord, DecidedEvent, OutcomeEvent, derived_event_id
from events.sandbox_lanes.v1 import capacity_pb2, common_pb2, inputs_pb2, outcomes_pb2, state_pb2

#: How many applied input ids each execution remembers (the duplicate filter).
APPLIED_IDS_KEPT = 32
STATE_SCHEMA_VERSION = 1


# --- decide --------------------------------------------------------------------------------------


def decide(event: DecidedEvent, stored: StateView, config: LaneConfig) -> Decision:
    """Apply one input event to the stored state; say which driver commands to run."""
    if not config.enabled:
        # Disabled lane: return before any state access (upstream test: the store proxy throws).
        return Decision(event=event, state=None)
    current = stored.get()
    if current is not None and event.meta.event_id in current.applied_event_ids:
        return Decision(event, None, (), (), None, True)
    if isinstance(event, inputs_pb2.ExecutionCreated):
        decision = _decide_created(event, current, stored, config)
    elif isinstance(event, inputs_pb2.PhaseChanged):
        decision = _decide_phase_changed(event, current, stored, config)
    elif isinstance(event, inputs_pb2.SessionDeleted):
        decision = _decide_session_deleted(event, current)
    else:
        decision = _decide_capacity_answer(event, current, stored, config)
    if config.capacity:
        decision = capacity_rules.stop_waiting(capacity_rules.hold_ensures(decision, config), config)
    if decision.commands:
        assert decision.state is not None  # commands always come with a state
        fill_pending(decision.state, event, decision.commands)
    if config.stamp_fingerprint and decision.state is not None:
        decision.state.config_fingerprint = config.fingerprint  # the configuration it was made under
    return decision


_ExecutionState = state_pb2.ExecutionState


def _applied(
    current: state_pb2.ExecutionState | None, key: str, event: DecidedEvent
) -> state_pb2.ExecutionState:
    # Field by field: upb's attribute sets are cheaper than its keyword constructor.
    meta = event.meta
    state = _ExecutionState()
    if current is None:
        state.schema_version = STATE_SCHEMA_VERSION
        state.execution_id = key
        state.applied_event_ids.append(meta.event_id)
        state.applied_count = 1
    else:
        state.CopyFrom(current)
        state.schema_version = STATE_SCHEMA_VERSION
        state.execution_id = key
        ids = state.applied_event_ids
        ids.append(meta.event_id)
        if len(ids) > APPLIED_IDS_KEPT:
            del ids[: len(ids) - APPLIED_IDS_KEPT]
        state.applied_count += 1
    if meta.HasField("occurred_at"):
        state.updated_at.CopyFrom(meta.occurred_at)
    return state


def _decide_created(
    event: inputs_pb2.ExecutionCreated,
    current: state_pb2.ExecutionState | None,
    stored: StateView,
    config: LaneConfig,
) -> Decision:
    state = _applied(current, event.execution_id, event)
    if current is not None:
        if current.created:
            # A second create for one execution (a producer retry under a new id) is a no-op.
            return Decision(event, state)
        if state.phase == common_pb2.EXECUTION_PHASE_UNSPECIFIED:
            state.phase = common_pb2.EXECUTION_PENDING
    else:
        state.phase = common_pb2.EXECUTION_PENDING
    state.created = True
    kind = event.kind
    state.kind = kind
    state.session_id = event.session_id
    state.org = event.org
    state.created_event.CopyFrom(event)
    state.created_event.ClearField("meta")
    if kind == common_pb2.AGENT_EXECUTION:
        return _session_lane(event, state, stored, config)
    return _workflow_lane(event, state, config)


def _session_lane(
    event: inputs_pb2.ExecutionCreated, state: state_pb2.ExecutionState, stored: StateView, config: LaneConfig
) -> Decision:
    session_id = event.session_id
    if session_id == "" or event.activity_task_queue != "":
        # No session, or the wfexec: override lane (child shares its parent's sandbox).
        return Decision(event, state)
    session = stored.session(session_id)
    if session is not None and session.session_deleted:
        # Applied after its session's delete (same partition, in order): upstream's create fails
        # (the session row is gone), so nothing is provisioned for a session already torn down.
        state.refused = True
        state.refusal_reason = f"session '{session_id}' was deleted"
        deleted = LogIntent(
            "warning",
            LOG_SESSION_DELETED_NOT_PROVISIONED,
            {"executionId": event.execution_id, "sessionId": session_id},
        )
        return Decision(event, state, (), (deleted,))
    dispatch = resolve_activity_task_queue(session_id, event.session_execution_target, config.agent)
    task_queue = dispatch.task_queue
    resolved = LogIntent(
        "info",
        LOG_DISPATCH_RESOLVED,
        {
            "session_id": session_id,
            "task_queue": task_queue,
            "routing_mode": config.agent.activity_routing,
            "execution_target": common_pb2.ExecutionTarget.Name(dispatch.execution_target),  # type: ignore[arg-type]
        },
    )
    if dispatch.execution_target != common_pb2.CLOUD:
        return Decision(event, state, (), (resolved,))
    if task_queue != format_session_task_queue(session_id):
        warn = LogIntent(
            "warning",
            LOG_SESSION_ROUTING_NOT_PER_SESSION,
            {"executionId": event.execution_id, "sessionId": session_id, "taskQueue": task_queue},
        )
        return Decision(event, state, (), (resolved, warn))
    # Positional (field order: scope, sandbox_id, task_queue, caller_class, mint, critical).
    execution_id = event.execution_id
    mint = SandboxCredentialRequest("session", session_id, execution_id, event.org, event.caller_identity_id)
    ensure = Ensure("session", session_id, task_queue, event.caller_class, mint, False)
    return Decision(event, state, (ensure,), (resolved,))


def _workflow_lane(
    event: inputs_pb2.ExecutionCreated, state: state_pb2.ExecutionState, config: LaneConfig
) -> Decision:
    execution_id = event.execution_id
    workflow = config.workflow
    if execution_id == "" or workflow.workflow_activity_routing != WORKFLOW_ROUTING_EXECUTION:
        return Decision(event, state)
    dispatch = resolve_workflow_task_queue(execution_id, event.workflow_execution_target, workflow)
    task_queue = dispatch.task_queue
    resolved = LogIntent(
        "info",
        LOG_WORKFLOW_DISPATCH_PER_EXECUTION,  # the lane only runs under execution routing
        {"execution_id": execution_id, "task_queue": task_queue},
    )
    if dispatch.execution_target != common_pb2.CLOUD:
        return Decision(event, state, (), (resolved,))
    mint = SandboxCredentialRequest("workflow", "", execution_id, event.org, event.caller_identity_id)
    ensure = Ensure("workflow", execution_id, task_queue, event.caller_class, mint, True)
    return Decision(event, state, (ensure,), (resolved,))


def _decide_phase_changed(
    event: inputs_pb2.PhaseChanged,
    current: state_pb2.ExecutionState | None,
    stored: StateView,
    config: LaneConfig,
) -> Decision:
    if current is None or not current.created:
        return Decision(
            event=event,
            state=None,
            reject=(
                f"phase-changed for unknown execution '{event.execution_id}' (no execution-created applied)"
            ),
        )
    kind = event.kind
    if current.kind != kind:
        return Decision(
            event=event,
            state=None,
            reject=(
                f"phase-changed kind {common_pb2.ExecutionKind.Name(kind)} does not match the "
                f"execution's kind {common_pb2.ExecutionKind.Name(current.kind)}"
            ),
        )
    execution_id = event.execution_id
    if kind == common_pb2.AGENT_EXECUTION and event.session_id != current.session_id:
        return Decision(
            event=event,
            state=None,
            reject=(
                f"phase-changed session_id '{event.session_id}' does not match the execution's "
                f"session '{current.session_id}'"
            ),
        )
    new_phase = event.new_phase
    if new_phase == common_pb2.EXECUTION_PHASE_UNSPECIFIED:
        return Decision(
            event=event, state=None, reject=f"phase-changed for '{execution_id}' has no new_phase"
        )
    # The transition is judged against the stored phase, as upstream computes the previous phase
    # under the write lock; the producer's previous_phase is its own view and only informative.
    previous = current.phase
    state = _applied(current, execution_id, event)
    meta = event.meta
    if meta.HasField("occurred_at"):
        at = meta.occurred_at
        if current.HasField("phase_changed_at") and _earlier(at, current.phase_changed_at):
            # Written before the phase now stored (a late retry, a replayed producer): it moves
            # nothing, so a stale write can neither revive a terminal execution nor tear down twice.
            stale = LogIntent(
                "info",
                "stale phase change ignored",
                {
                    "executionId": execution_id,
                    "phase": common_pb2.ExecutionPhase.Name(new_phase),
                    "storedPhase": common_pb2.ExecutionPhase.Name(previous),
                },
            )
            if current.HasField("updated_at"):
                state.updated_at.CopyFrom(current.updated_at)  # time does not run backwards either
            return Decision(event, state, (), (stale,))
        state.phase_changed_at.CopyFrom(at)
    state.phase = new_phase
    recover = previous == common_pb2.EXECUTION_FAILED and new_phase == common_pb2.EXECUTION_IN_PROGRESS
    if recover and kind == common_pb2.AGENT_EXECUTION:
        # Upstream's agent recover persists IN_PROGRESS with the error cleared whatever its
        # (non-critical) session ensure did. A workflow's error is cleared once its critical
        # ensure succeeded: a refused recover leaves the execution FAILED, error and all.
        state.status_error = ""
        state.deferred_status_error = ""
        for entry in state.pending:
            if entry.op == state_pb2.EFFECT_OP_ENSURE and not entry.critical:
                # A session ensure decided before this recover and still out: upstream's pre-stamp
                # of its failure landed before the recover, which cleared it. It stamps nothing.
                entry.recover = True
    error = event.error
    if error:
        if _session_ensure_pending(state):
            # The pending ensure's failure pre-stamp would have won upstream (it stamps before
            # the execution moves on), or a recover's clears the error before this one: this
            # error waits for the ensure to complete.
            if not state.deferred_status_error:
                state.deferred_status_error = error
        elif not state.status_error:
            state.status_error = error
    if previous == new_phase:
        return Decision(event, state)  # no transition (e.g. FAILED -> FAILED re-sent): nothing fires
    if kind == common_pb2.WORKFLOW_EXECUTION and new_phase in TERMINAL_WORKFLOW_PHASES:
        if current.refused:
            return Decision(event, state)  # the create was refused: no sandbox ever existed
        return Decision(event, state, (Deprovision("workflow", execution_id, new_phase),))
    if recover and current.HasField("created_event"):
        # Recover re-runs the execution's lane from its create: the workflow lane ensures the
        # (deprovisioned on FAILED) sandbox again, critical; the session lane re-ensures the
        # session's sandbox. Same deterministic names; the commands' ids derive from this event.
        created = inputs_pb2.ExecutionCreated()
        created.CopyFrom(current.created_event)
        created.meta.CopyFrom(meta)
        if kind == common_pb2.AGENT_EXECUTION:
            lane = _session_lane(created, state, stored, config)
        else:
            lane = _workflow_lane(created, state, config)
        return Decision(event, state, lane.commands, lane.logs)
    # Session sandboxes are long-lived: an agent execution's terminal phase tears nothing down.
    return Decision(event, state)


def _lane_again(
    created_from: inputs_pb2.ExecutionCreated,
    meta: common_pb2.EventMeta,
    state: state_pb2.ExecutionState,
    stored: StateView,
    config: LaneConfig,
) -> Decision:
    """The execution's lane re-run from its stored create, its commands caused by ``meta``."""
    created = inputs_pb2.ExecutionCreated()
    created.CopyFrom(created_from)
    created.meta.CopyFrom(meta)
    if state.kind == common_pb2.AGENT_EXECUTION:
        return _session_lane(created, state, stored, config)
    return _workflow_lane(created, state, config)


def _decide_capacity_answer(
    answer: CapacityAnswer,
    current: state_pb2.ExecutionState | None,
    stored: StateView,
    config: LaneConfig,
) -> Decision:
    """The capacity ledger's answer to this execution's request (capacity_rules' docstring)."""
    if current is None or not current.created or not current.HasField("created_event"):
        return Decision(answer, None)  # nothing asked it (a state removed meanwhile): nothing to do
    wait = current.capacity
    key = answer.sandbox_key
    at = answer.meta.occurred_at if answer.meta.HasField("occurred_at") else None
    if not wait.waiting or wait.sandbox_key != key or not capacity_rules.answers_this_wait(answer, wait):
        # Not an answer to the wait it is in: it stopped waiting (its release, written then, freed
        # the place in the log), or an answer to an earlier request crossed a newer one.
        return Decision(answer, None)
    state = _applied(current, answer.execution_id, answer)
    lane = _lane_again(current.created_event, answer.meta, state, stored, config)
    ensure = next((c for c in lane.commands if isinstance(c, Ensure)), None)
    wait = state.capacity
    if isinstance(answer, capacity_pb2.CapacityQueued):
        wait.reason = answer.reason
        wait.position = answer.position
        if ensure is None:
            return Decision(answer, state)
        return Decision(answer, state, outputs=(capacity_rules.queued_outcome(answer, ensure, config),))
    wait.waiting = False
    if isinstance(answer, capacity_pb2.CapacityAdmitted):
        wait.admitted = True
        if ensure is None:
            # The lane no longer asks for it (its session was deleted meanwhile): let it go.
            wait.released = True
            release = capacity_rules.released(
                answer.meta.event_id, at, key, answer.execution_id, "no longer needed when admitted", config
            )
            return Decision(answer, state, lane.commands, lane.logs, capacity=(release,))
        return Decision(answer, state, lane.commands, lane.logs)
    # Timed out: the lane's own provisioning failure, its reason the ledger's ("capacity: ...").
    wait.reason = answer.reason
    wait.released = True
    if ensure is None:
        return Decision(answer, state)
    failed = CommandResult(ok=False, error=answer.reason)
    out, logs = _complete_ensure(answer.meta.event_id, at, ensure, failed, state, config)
    return Decision(answer, state, (), (*lane.logs, *logs), outputs=(out,))


def _earlier(a: Timestamp, b: Timestamp) -> bool:
    return (a.seconds, a.nanos) < (b.seconds, b.nanos)


def _session_ensure_pending(state: state_pb2.ExecutionState) -> bool:
    """An ensure is out whose completion writes status_error: a session ensure (its pre-stamp) or a
    workflow recover's (its success clears the error): a phase error waits behind it."""
    return any(e.op == state_pb2.EFFECT_OP_ENSURE and (not e.critical or e.recover) for e in state.pending)


def _decide_session_deleted(
    event: inputs_pb2.SessionDeleted, current: state_pb2.ExecutionState | None
) -> Decision:
    session_id = event.session_id
    state = _applied(current, session_id, event)
    state.session_deleted = True
    command = Deprovision("session", session_id, common_pb2.EXECUTION_PHASE_UNSPECIFIED)
    return Decision(event, state, (command,))


# --- complete ------------------------------------------------------------------------------------


def complete(decision: Decision, results: Sequence[CommandResult], config: LaneConfig) -> Outcome:
    """Fold the results of the decision's own commands into its state (in place), in order.

    The synchronous path: replay and the seed tests run a decision's commands at once. The pod
    completes each pending effect on its own, later, with :func:`complete_effect`; both give the
    same outcome events and the same final state.
    """
    commands = decision.commands
    if len(results) != len(commands):
        raise ValueError(f"{len(commands)} commands but {len(results)} results")
    state = decision.state
    logs = decision.logs
    if not commands:
        return Outcome(state, decision.outputs, tuple(logs), decision.capacity)
    assert state is not None  # commands always come with a state
    outputs: list[OutcomeEvent] = list(decision.outputs)
    freed: list[CapacityRecord] = list(decision.capacity)
    causation_id = decision.event.meta.event_id
    for command, result in zip(commands, results, strict=True):
        out, more_logs, more_freed = _fold(state, effect_id_of(causation_id, command), result, config)
        if out is not None:
            outputs.append(out)
        if more_logs:
            logs = (*logs, *more_logs)
        freed.extend(more_freed)
    return Outcome(state, tuple(outputs), tuple(logs), tuple(freed))


def complete_effect(
    state: state_pb2.ExecutionState, effect_id: str, result: CommandResult, config: LaneConfig
) -> Outcome:
    """Fold one pending driver call's result into a copy of ``state``.

    Not pending (already completed, by this pod or the partition's previous owner): nothing to
    write, ``Outcome(None, (), ())`` — which is what makes the outcome exist exactly once.
    """
    if not any(entry.effect_id == effect_id for entry in state.pending):
        return Outcome(None, (), ())
    new = state_pb2.ExecutionState()
    new.CopyFrom(state)
    out, logs, freed = _fold(new, effect_id, result, config)
    return Outcome(new, (out,) if out is not None else (), logs, freed)


def _fold(
    state: state_pb2.ExecutionState, effect_id: str, result: CommandResult, config: LaneConfig
) -> tuple[OutcomeEvent | None, tuple[LogIntent, ...], tuple[CapacityRecord, ...]]:
    pending = state.pending
    index = next((i for i, e in enumerate(pending) if e.effect_id == effect_id), -1)
    if index < 0:
        return None, (), ()
    entry = pending[index]
    if config.stamp_fingerprint:
        state.config_fingerprint = config.fingerprint
    command = command_of(entry)
    occurred_at = entry.occurred_at if entry.HasField("occurred_at") else None
    causation_id = entry.causation_id
    del pending[index]
    freed: tuple[CapacityRecord, ...] = ()
    if config.capacity:
        freed = capacity_rules.released_by_fold(causation_id, occurred_at, command, result, state, config)
    if isinstance(command, Ensure):
        out, logs = _complete_ensure(causation_id, occurred_at, command, result, state, config, entry.recover)
        if state.deferred_status_error and not _session_ensure_pending(state):
            if not state.status_error:
                state.status_error = state.deferred_status_error
            state.deferred_status_error = ""
        return out, logs, freed
    out, logs = _complete_deprovision(causation_id, occurred_at, command, result, state, config)
    return out, logs, freed


def sandbox_ref(
    config: LaneConfig, scope: SandboxScope, sandbox_id: str, task_queue: str = ""
) -> common_pb2.SandboxRef:
    return common_pb2.SandboxRef(
        scope=SCOPE_ENUM[scope],  # type: ignore[arg-type]
        sandbox_id=sandbox_id,
        name=sandbox_base_name(scope, sandbox_id),
        driver=config.driver_name,
        task_queue=task_queue,
    )


def _fill_ref(
    ref: common_pb2.SandboxRef, config: LaneConfig, scope: SandboxScope, sandbox_id: str, task_queue: str = ""
) -> None:
    """:func:`sandbox_ref` written into the outcome's own sub-message (no message built and copied)."""
    ref.scope = SCOPE_ENUM[scope]  # type: ignore[assignment]
    ref.sandbox_id = sandbox_id
    ref.name = sandbox_base_name(scope, sandbox_id)
    ref.driver = config.driver_name
    ref.task_queue = task_queue


def _fill_meta(
    meta: common_pb2.EventMeta,
    causation_id: str,
    occurred_at: Timestamp | None,
    kind: str,
    scope: SandboxScope,
    config: LaneConfig,
) -> str:
    """The outcome's meta, written in place; returns its (deterministic) event id."""
    event_id = derived_event_id(causation_id, kind, scope)
    meta.event_id = event_id
    meta.schema_version = STATE_SCHEMA_VERSION
    meta.source = config.source
    meta.causation_id = causation_id
    if config.stamp_fingerprint:
        meta.config_fingerprint = config.fingerprint
    if occurred_at is not None:
        meta.occurred_at.CopyFrom(occurred_at)
    return event_id


def _record(
    state: state_pb2.ExecutionState, ref: common_pb2.SandboxRef, lifecycle: int, reason: str, outcome_id: str
) -> None:
    scope = ref.scope
    sandbox_id = ref.sandbox_id
    for existing in state.sandboxes:
        box = existing.sandbox
        if box.scope == scope and box.sandbox_id == sandbox_id:
            target = existing
            break
    else:
        target = state.sandboxes.add()
    target.sandbox.CopyFrom(ref)
    target.lifecycle = lifecycle  # type: ignore[assignment]
    target.reason = reason
    target.outcome_event_id = outcome_id


_PHASE_NAMES: dict[int, str] = {v.number: v.name for v in common_pb2.ExecutionPhase.DESCRIPTOR.values}


def _phase_name(phase: int) -> str:
    name = _PHASE_NAMES.get(phase)
    return name if name is not None else common_pb2.ExecutionPhase.Name(phase)  # type: ignore[arg-type]


def _complete_ensure(
    causation_id: str,
    occurred_at: Timestamp | None,
    command: Ensure,
    result: CommandResult,
    state: state_pb2.ExecutionState,
    config: LaneConfig,
    recover: bool = False,
) -> tuple[OutcomeEvent, tuple[LogIntent, ...]]:
    scope = command.scope
    execution_id = command.mint.execution_id
    if result.ok:
        provisioned = outcomes_pb2.SandboxProvisioned()
        outcome_id = _fill_meta(
            provisioned.meta, causation_id, occurred_at, "SandboxProvisioned", scope, config
        )
        provisioned.execution_id = execution_id
        ref = provisioned.sandbox
        _fill_ref(ref, config, scope, command.sandbox_id, command.task_queue)
        provisioned.probe_state = result.probe_state
        provisioned.token_minted = result.token_minted
        _record(state, ref, state_pb2.SANDBOX_PROVISIONED, "", outcome_id)
        if command.critical:
            state.refused = False  # a sandbox exists now: its terminal phase must tear it down
            if recover:
                # The recover went through: upstream persists it error-free. An error deferred
                # behind this ensure came after the recover and is stamped next (by _fold).
                state.status_error = ""
        return provisioned, ()
    error = result.error
    failed = outcomes_pb2.SandboxFailed()
    outcome_id = _fill_meta(failed.meta, causation_id, occurred_at, "SandboxFailed", scope, config)
    failed.execution_id = execution_id
    ref = failed.sandbox
    _fill_ref(ref, config, scope, command.sandbox_id, command.task_queue)
    failed.reason = error
    failed.critical = command.critical
    failed.code = common_pb2.STATUS_CODE_UNAVAILABLE
    if command.critical:
        failed.message = WORKFLOW_SANDBOX_FAILED_MESSAGE
        fields = {"executionId": execution_id, "error": error}
        log = LogIntent("error", LOG_WORKFLOW_PROVISIONING_FAILED, fields)
        # Upstream refuses the request. A refused create: the execution does not exist for
        # upstream (no row, no workflow), so nothing of it is torn down later. A refused recover:
        # the execution stays FAILED and the recover can be retried.
        state.refusal_reason = error
        if recover:
            state.phase = common_pb2.EXECUTION_FAILED
        else:
            state.refused = True
    elif recover:
        # Upstream's agent recover clears the error after its session ensure, failed or not.
        failed.message = SANDBOX_PROVISIONING_FAILED_PREFIX + error
        log = LogIntent(
            "error",
            LOG_SESSION_PROVISIONING_FAILED,
            {"executionId": execution_id, "sessionId": command.sandbox_id, "error": error},
        )
    else:
        # The pre-stamp: first non-empty status.error wins; the phase is never touched.
        stamp = SANDBOX_PROVISIONING_FAILED_PREFIX + error
        if not state.status_error:
            state.status_error = stamp
        failed.message = stamp
        log = LogIntent(
            "error",
            LOG_SESSION_PROVISIONING_FAILED,
            {"executionId": execution_id, "sessionId": command.sandbox_id, "error": error},
        )
    _record(state, ref, state_pb2.SANDBOX_FAILED, error, outcome_id)
    return failed, (log,)


def _complete_deprovision(
    causation_id: str,
    occurred_at: Timestamp | None,
    command: Deprovision,
    result: CommandResult,
    state: state_pb2.ExecutionState,
    config: LaneConfig,
) -> tuple[OutcomeEvent, tuple[LogIntent, ...]]:
    scope = command.scope
    workflow = scope == "workflow"
    execution_id = command.sandbox_id if workflow else ""
    if result.ok:
        done = outcomes_pb2.SandboxDeprovisioned()
        outcome_id = _fill_meta(done.meta, causation_id, occurred_at, "SandboxDeprovisioned", scope, config)
        done.execution_id = execution_id
        ref = done.sandbox
        _fill_ref(ref, config, scope, command.sandbox_id)
        done.phase = command.phase  # type: ignore[assignment]
        _record(state, ref, state_pb2.SANDBOX_DEPROVISIONED, "", outcome_id)
        if workflow:
            phase = _phase_name(command.phase)
            return done, (
                LogIntent("info", LOG_WORKFLOW_DEPROVISIONED, {"executionId": execution_id, "phase": phase}),
            )
        return done, ()
    error = result.error
    failed = outcomes_pb2.SandboxTeardownFailed()
    outcome_id = _fill_meta(failed.meta, causation_id, occurred_at, "SandboxTeardownFailed", scope, config)
    failed.execution_id = execution_id
    ref = failed.sandbox
    _fill_ref(ref, config, scope, command.sandbox_id)
    failed.reason = error
    failed.phase = command.phase  # type: ignore[assignment]
    _record(state, ref, state_pb2.SANDBOX_TEARDOWN_FAILED, error, outcome_id)
    if workflow:
        fields = {"executionId": execution_id, "error": error}
        log = LogIntent("error", LOG_WORKFLOW_DEPROVISION_FAILED, fields)
    else:
        fields = {"sessionId": command.sandbox_id, "error": error}
        log = LogIntent("error", LOG_SESSION_DEPROVISION_FAILED, fields)
    return failed, (log,)
