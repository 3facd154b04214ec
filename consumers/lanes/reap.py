"""The reaper's decision: which managed sandboxes to remove, as a pure function.

:func:`plan_reap` judges (the sandboxes the driver lists by our labels, the execution
states, now, grace); :func:`reaped_event` is the outcome of one removal (deterministic
id: a second reaper reaping the same sandbox writes the same id). The I/O around it
is :mod:`consumers.ops.reaper`; the CLI ``sandbox-lanes reap`` is
:mod:`consumers.tools.reaper`.

Rules, per listed sandbox:

* workflow: reap when its execution's phase is terminal (COMPLETED, FAILED,
  CANCELLED, TERMINATED) and the lane's own teardown of it is not in flight (a
  deprovision decided and not folded back yet: the lane removes it and reports it),
  or when no state exists for it and the sandbox is older than the grace period;
  keep a live non-terminal execution's sandbox.
* session: reap when a ``SessionDeleted`` was applied (state keyed by the session
  id whose session record is DEPROVISIONED or TEARDOWN_FAILED) and no agent
  execution provisioned it again afterwards, or when no state references the
  session at all and the sandbox is older than the grace period.
* connect: never (the lanes do not create connect sandboxes).
* an age the driver cannot tell never counts as "past grace".
* a candidate the driver no longer finds when its removal starts (the listing is
  older than the state read; a lane's teardown may have run in between) is left
  alone: no second removal, no ``SandboxReaped``.

Only what ``list_managed()`` returns is ever considered, and drivers list by the
``stigmer.ai/managed-by`` label: a runtime object without our labels is never touched.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from consumers.lanes.commands import LaneConfig
from consumers.lanes.constants import TERMINAL_WORKFLOW_PHASES
from consumers.lanes.rules import STATE_SCHEMA_VERSION, sandbox_ref
from drivers.contract import ManagedSandbox
from events.codec import derived_event_id, timestamp
from events.sandbox_lanes.v1 import common_pb2, outcomes_pb2, state_pb2

_ENDED_LIFECYCLES = (state_pb2.SANDBOX_DEPROVISIONED, state_pb2.SANDBOX_TEARDOWN_FAILED)

Verdict = Literal["reap", "keep"]


@dataclass(frozen=True)
class ReapPlan:
    """What to do with one listed sandbox, and why."""

    sandbox: ManagedSandbox
    verdict: Verdict
    reason: str
    execution_id: str = ""
    phase: int = common_pb2.EXECUTION_PHASE_UNSPECIFIED
    age_seconds: float | None = None


def _age(sandbox: ManagedSandbox, now: float) -> float | None:
    return None if sandbox.created_at is None else max(0.0, now - sandbox.created_at)


def _past_grace(age: float | None, grace: float) -> bool:
    return age is not None and age > grace


def _stamp(state: state_pb2.ExecutionState) -> float:
    return state.updated_at.seconds + state.updated_at.nanos / 1e9 if state.HasField("updated_at") else 0.0


def _session_record(state: state_pb2.ExecutionState, session_id: str) -> state_pb2.SandboxStatus | None:
    for status in state.sandboxes:
        if (
            status.sandbox.scope == common_pb2.SANDBOX_SCOPE_SESSION
            and status.sandbox.sandbox_id == session_id
        ):
            return status
    return None


def sessions_referenced(state: state_pb2.ExecutionState) -> set[str]:
    """The session ids a state references: its session, and the session sandboxes it records."""
    referenced = {state.session_id} if state.session_id else set()
    referenced |= {
        s.sandbox.sandbox_id for s in state.sandboxes if s.sandbox.scope == common_pb2.SANDBOX_SCOPE_SESSION
    }
    return referenced


def index_references(
    states: Iterable[state_pb2.ExecutionState], into: dict[str, list[state_pb2.ExecutionState]]
) -> dict[str, list[state_pb2.ExecutionState]]:
    """Add each state to the lists of the sessions it references (session id → states); ``into``."""
    for state in states:
        for session_id in sessions_referenced(state):
            into.setdefault(session_id, []).append(state)
    return into


def needs_references(session_id: str, own: state_pb2.ExecutionState | None, *, states_expire: bool) -> bool:
    """Whether :func:`plan_reap`'s verdict on a session sandbox depends on the states that reference
    the session (beyond ``own``, the session-keyed state). False: the verdict is the same whatever
    references it, so a caller need not look for them (with expiring states, a session not deleted
    is kept either way). The reaper looks through a partition only for the sessions where it is True.
    """
    return _session_deleted(own, session_id) or not states_expire


def _session_deleted(own: state_pb2.ExecutionState | None, session_id: str) -> bool:
    return (
        own is not None
        and (record := _session_record(own, session_id)) is not None
        and record.lifecycle in _ENDED_LIFECYCLES
    )


def plan_reap(
    managed: Iterable[ManagedSandbox],
    states: Mapping[str, state_pb2.ExecutionState],
    now: float,
    grace: float,
    *,
    states_expire: bool = False,
    by_session: Mapping[str, Sequence[state_pb2.ExecutionState]] | None = None,
) -> list[ReapPlan]:
    """Decide, per listed sandbox, whether to reap it. Pure: no I/O, time comes in as ``now``.

    ``states_expire``: finished executions' states are removed after a retention, so a session
    sandbox that no state references may belong to a live session whose executions all finished
    long ago; it is kept (its session's delete removes it). Without retention no reference means
    an orphan. ``by_session``: :func:`index_references` of ``states``, when the caller built it
    already (a plan made a slice of sandboxes at a time).
    """
    # Session id → the states that reference it (agent executions, and the session-keyed teardown state).
    if by_session is None:
        by_session = index_references(states.values(), {})
    plans: list[ReapPlan] = []
    for sandbox in managed:
        age = _age(sandbox, now)
        if sandbox.scope == "workflow":
            plans.append(_plan_workflow(sandbox, states.get(sandbox.sandbox_id), age, grace))
        elif sandbox.scope == "session":
            plans.append(
                _plan_session(
                    sandbox,
                    states.get(sandbox.sandbox_id),
                    by_session.get(sandbox.sandbox_id, ()),
                    age,
                    grace,
                    states_expire,
                )
            )
        else:
            plans.append(ReapPlan(sandbox, "keep", "connect sandboxes are not the lanes'", age_seconds=age))
    return plans


def _plan_workflow(
    sandbox: ManagedSandbox, state: state_pb2.ExecutionState | None, age: float | None, grace: float
) -> ReapPlan:
    eid = sandbox.sandbox_id
    if state is None or not state.created:
        if _past_grace(age, grace):
            return ReapPlan(sandbox, "reap", "no execution state past grace", eid, age_seconds=age)
        why = "age unknown" if age is None else f"within grace ({age:.0f}s <= {grace:g}s)"
        return ReapPlan(sandbox, "keep", f"no execution state, {why}", eid, age_seconds=age)
    phase_name = common_pb2.ExecutionPhase.Name(state.phase)
    if state.refused and not any(e.op == state_pb2.EFFECT_OP_ENSURE for e in state.pending):
        # The create was refused (its critical ensure failed): no runner may exist for it, and no
        # terminal phase will ever tear down what a half-done ensure left.
        return ReapPlan(sandbox, "reap", "execution refused (create)", eid, state.phase, age)
    if state.phase in TERMINAL_WORKFLOW_PHASES:
        if _teardown_pending(state, common_pb2.SANDBOX_SCOPE_WORKFLOW, eid):
            # The lane's own teardown is decided and not folded back yet: it owns the removal (and
            # its SandboxDeprovisioned outcome); a reap now would race it and report it twice.
            why = f"execution terminal ({phase_name}), its teardown in flight"
            return ReapPlan(sandbox, "keep", why, eid, state.phase, age)
        return ReapPlan(sandbox, "reap", f"execution terminal ({phase_name})", eid, state.phase, age)
    return ReapPlan(sandbox, "keep", f"execution live ({phase_name})", eid, state.phase, age)


def _teardown_pending(state: state_pb2.ExecutionState, scope: int, sandbox_id: str) -> bool:
    return any(
        e.op == state_pb2.EFFECT_OP_DEPROVISION and e.scope == scope and e.sandbox_id == sandbox_id
        for e in state.pending
    )


def _plan_session(
    sandbox: ManagedSandbox,
    own: state_pb2.ExecutionState | None,
    referencing: Sequence[state_pb2.ExecutionState],
    age: float | None,
    grace: float,
    states_expire: bool,
) -> ReapPlan:
    sid = sandbox.sandbox_id
    if _session_deleted(own, sid):
        assert own is not None
        deleted_at = _stamp(own)
        # An agent execution that provisioned the session sandbox after the delete keeps it.
        newer = [
            s
            for s in referencing
            if s is not own
            and (rec := _session_record(s, sid)) is not None
            and rec.lifecycle == state_pb2.SANDBOX_PROVISIONED
            and _stamp(s) > deleted_at
        ]
        if not newer:
            return ReapPlan(sandbox, "reap", "session deleted", age_seconds=age)
        return ReapPlan(sandbox, "keep", "session re-provisioned after its deletion", age_seconds=age)
    if referencing:
        return ReapPlan(sandbox, "keep", "session referenced by execution state", age_seconds=age)
    if states_expire:
        why = "no execution state (finished executions' states expire; the session's delete removes it)"
        return ReapPlan(sandbox, "keep", why, age_seconds=age)
    if _past_grace(age, grace):
        return ReapPlan(sandbox, "reap", "no execution state past grace", age_seconds=age)
    why = "age unknown" if age is None else f"within grace ({age:.0f}s <= {grace:g}s)"
    return ReapPlan(sandbox, "keep", f"no execution state, {why}", age_seconds=age)


def reaped_event(plan: ReapPlan, lane: LaneConfig, now: float) -> outcomes_pb2.SandboxReaped:
    """The outcome of one removal; its id is uuid5 over (scope, sandbox id, creation time)."""
    sb = plan.sandbox
    identity = f"reap:{sb.scope}:{sb.sandbox_id}:{sb.created_at if sb.created_at is not None else ''}"
    meta = common_pb2.EventMeta(
        event_id=derived_event_id(identity, "SandboxReaped", sb.scope),
        occurred_at=timestamp(dt.datetime.fromtimestamp(now, dt.UTC)),
        schema_version=STATE_SCHEMA_VERSION,
        source=lane.source,
    )
    ref = sandbox_ref(lane, sb.scope, sb.sandbox_id)
    ref.name = sb.name
    return outcomes_pb2.SandboxReaped(
        meta=meta,
        execution_id=plan.execution_id,
        sandbox=ref,
        reason=plan.reason,
        phase=plan.phase,  # type: ignore[arg-type]
        age_seconds=plan.age_seconds or 0.0,
    )
