"""How the lane rules meet the capacity ledger (docs/guarantees.md "Capacity"). Pure.

With a cap on (``LaneConfig.capacity``), a decision's ``Ensure`` for a sandbox the ledger has not
admitted for this execution is held back: the state records the wait (``ExecutionState.capacity``)
and the decision writes a ``CapacityRequested`` to the capacity log instead. The ledger's answer
comes back as an input of the execution's partition: ``CapacityAdmitted`` re-runs the lane from the
stored create (the ``Ensure`` then goes through), ``CapacityQueued`` tells upstream it waits
(``SandboxQueued``), ``CapacityTimedOut`` ends as the lane's own provisioning failure. A sandbox
stops counting when its teardown is folded (``CapacityReleased``); an execution that stops waiting
(a terminal phase) releases its place.

Every record's id derives from the input that caused it, so a re-decided input writes the same
records and the ledger, which ignores what it has seen, counts it once.
"""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from consumers.lanes.commands import (
    SCOPE_ENUM,
    Command,
    CommandResult,
    Decision,
    Deprovision,
    Ensure,
    LaneConfig,
)
from consumers.lanes.constants import TERMINAL_WORKFLOW_PHASES
from consumers.lanes.outbox import command_of
from drivers.contract import SandboxScope
from drivers.naming import sandbox_base_name
from events.codec import CapacityAnswer, CapacityRecord, DecidedEvent, derived_event_id
from events.sandbox_lanes.v1 import capacity_pb2, common_pb2, inputs_pb2, outcomes_pb2, state_pb2

#: The phases after which an execution no longer wants a sandbox (both lanes).
TERMINAL_PHASES = frozenset(TERMINAL_WORKFLOW_PHASES)


def sandbox_key(scope: SandboxScope, sandbox_id: str) -> str:
    """What the ledger counts: the sandbox's deterministic name (a session's counts once)."""
    return sandbox_base_name(scope, sandbox_id)


def _meta(
    meta: common_pb2.EventMeta,
    causation_id: str,
    kind: str,
    key: str,
    at: Timestamp | None,
    config: LaneConfig,
) -> None:
    meta.event_id = derived_event_id(causation_id, kind, key)
    meta.causation_id = causation_id
    meta.schema_version = 1
    meta.source = config.source
    if config.stamp_fingerprint:
        meta.config_fingerprint = config.fingerprint
    if at is not None:
        meta.occurred_at.CopyFrom(at)


def _occurred(event: DecidedEvent) -> Timestamp | None:
    return event.meta.occurred_at if event.meta.HasField("occurred_at") else None


def released(
    causation_id: str,
    at: Timestamp | None,
    key: str,
    execution_id: str,
    reason: str,
    config: LaneConfig,
) -> capacity_pb2.CapacityReleased:
    """``execution_id`` empty: the sandbox no longer counts; set: only this execution lets go."""
    record = capacity_pb2.CapacityReleased(sandbox_key=key, execution_id=execution_id, reason=reason)
    _meta(record.meta, causation_id, "CapacityReleased", f"{key}/{execution_id}", at, config)
    return record


def hold_ensures(decision: Decision, config: LaneConfig) -> Decision:
    """The gate: an ``Ensure`` of a sandbox not admitted for this execution becomes a request."""
    state = decision.state
    if state is None or not any(isinstance(c, Ensure) for c in decision.commands):
        return decision
    event = decision.event
    wait = state.capacity
    kept: list[Command] = []
    records: list[CapacityRecord] = []
    for command in decision.commands:
        if not isinstance(command, Ensure):
            kept.append(command)
            continue
        key = sandbox_key(command.scope, command.sandbox_id)
        if wait.sandbox_key == key and wait.admitted and not wait.released:
            kept.append(command)  # admitted for this execution and still counted
            continue
        if wait.sandbox_key == key and wait.waiting:
            continue  # asked already: the answer will bring it
        wait.Clear()
        wait.sandbox_key = key
        wait.waiting = True
        at = _occurred(event)
        if at is not None:
            wait.requested_at.CopyFrom(at)
        request = capacity_pb2.CapacityRequested(
            sandbox_key=key,
            execution_id=state.execution_id,
            org=state.org,
            scope=SCOPE_ENUM[command.scope],  # type: ignore[arg-type]
        )
        _meta(request.meta, event.meta.event_id, "CapacityRequested", key, at, config)
        wait.request_event_id = request.meta.event_id
        records.append(request)
    return decision._replace(commands=tuple(kept), capacity=(*decision.capacity, *records))


def stop_waiting(decision: Decision, config: LaneConfig) -> Decision:
    """A phase change that ends an execution while it waits: its place is released, and the
    teardown of a sandbox it never had is not asked for."""
    state = decision.state
    event = decision.event
    if state is None or not isinstance(event, inputs_pb2.PhaseChanged):
        return decision
    wait = state.capacity
    if not wait.waiting or state.phase not in TERMINAL_PHASES:
        return decision
    key = wait.sandbox_key
    wait.waiting = False
    wait.released = True
    phase = common_pb2.ExecutionPhase.Name(state.phase)
    # A workflow's sandbox serves it alone: the whole place goes (an admission already on its way
    # would otherwise count for no one); a session's may serve others: only this wait goes.
    holder = "" if state.kind == common_pb2.WORKFLOW_EXECUTION else state.execution_id
    reason = f"reached {phase} while waiting"
    release = released(event.meta.event_id, _occurred(event), key, holder, reason, config)
    commands = tuple(
        c
        for c in decision.commands
        if not (isinstance(c, Deprovision) and sandbox_key(c.scope, c.sandbox_id) == key)
    )
    return decision._replace(commands=commands, capacity=(*decision.capacity, release))


def released_by_fold(
    causation_id: str,
    at: Timestamp | None,
    command: Command,
    result: CommandResult,
    state: state_pb2.ExecutionState,
    config: LaneConfig,
) -> tuple[CapacityRecord, ...]:
    """What a folded result frees: a teardown done frees the sandbox; a failed ensure frees the
    execution's place (a workflow's whole sandbox: it serves that execution alone). A failed
    teardown frees nothing: the sandbox may still run (the reaper's removal frees it then)."""
    key = sandbox_key(command.scope, command.sandbox_id)
    if isinstance(command, Deprovision):
        if not result.ok:
            return ()
        if any(
            e.op == state_pb2.EFFECT_OP_ENSURE and sandbox_key(command_of(e).scope, e.sandbox_id) == key
            for e in state.pending
        ):
            return ()  # a recover's ensure of the same sandbox is out: it goes on counting for it
        if state.capacity.sandbox_key == key:
            state.capacity.released = True
        return (released(causation_id, at, key, "", "torn down", config),)
    if result.ok or _may_still_run(state, command):
        return ()  # running, or it may be (made before, its teardown failed): it counts on
    if state.capacity.sandbox_key == key:
        state.capacity.released = True
    holder = "" if command.scope == "workflow" else state.execution_id
    return (released(causation_id, at, key, holder, "its provisioning failed", config),)


def _may_still_run(state: state_pb2.ExecutionState, command: Command) -> bool:
    """The state records this sandbox made (provisioned, or a teardown that failed)."""
    scope = SCOPE_ENUM[command.scope]
    return any(
        s.sandbox.scope == scope
        and s.sandbox.sandbox_id == command.sandbox_id
        and s.lifecycle in (state_pb2.SANDBOX_PROVISIONED, state_pb2.SANDBOX_TEARDOWN_FAILED)
        for s in state.sandboxes
    )


def answers_this_wait(answer: CapacityAnswer, wait: state_pb2.CapacityWait) -> bool:
    """The answer is the ledger's to this execution's current request (its id derives from it)."""
    kind = answer.DESCRIPTOR.name
    return answer.meta.event_id == derived_event_id(wait.request_event_id, kind, wait.sandbox_key)


def queued_outcome(
    answer: capacity_pb2.CapacityQueued, ensure: Ensure, config: LaneConfig
) -> outcomes_pb2.SandboxQueued:
    """``SandboxQueued``: upstream learns the execution waits, why and where."""
    out = outcomes_pb2.SandboxQueued(
        execution_id=answer.execution_id, reason=answer.reason, position=answer.position
    )
    _meta(out.meta, answer.meta.event_id, "SandboxQueued", ensure.scope, _occurred(answer), config)
    ref = out.sandbox
    ref.scope = SCOPE_ENUM[ensure.scope]  # type: ignore[assignment]
    ref.sandbox_id = ensure.sandbox_id
    ref.name = sandbox_base_name(ensure.scope, ensure.sandbox_id)
    ref.driver = config.driver_name
    ref.task_queue = ensure.task_queue
    return out


__all__ = [
    "TERMINAL_PHASES",
    "answers_this_wait",
    "hold_ensures",
    "queued_outcome",
    "released",
    "released_by_fold",
    "sandbox_key",
    "stop_waiting",
]
