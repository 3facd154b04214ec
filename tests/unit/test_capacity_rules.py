"""The lane rules with a cap on (issue 44): an execution's side of the capacity ledger.

Broker-free, on the pure rules: the create asks, the ledger's answers come back as inputs, the
sandbox goes through the lane's own paths (its ensure, its upstream failure), and what frees a
sandbox writes a release. Expectations come from the issue's words, not from the module."""

from __future__ import annotations

import dataclasses
import datetime as dt

from consumers.lanes.commands import CommandResult, Decision, Deprovision, Ensure, LaneConfig, StateView
from consumers.lanes.constants import SANDBOX_PROVISIONING_FAILED_PREFIX, WORKFLOW_SANDBOX_FAILED_MESSAGE
from consumers.lanes.outbox import pending_of
from consumers.lanes.rules import complete_effect, decide
from drivers.naming import sandbox_base_name
from events.codec import derived_event_id, new_meta
from events.sandbox_lanes.v1 import capacity_pb2, common_pb2, inputs_pb2, outcomes_pb2, state_pb2
from tests.support.lane_fakes import EXECUTION_ROUTING_CONFIG, SESSION_ROUTING_CLOUD_DEFAULT

OFF = LaneConfig(
    enabled=True, agent=SESSION_ROUTING_CLOUD_DEFAULT, workflow=EXECUTION_ROUTING_CONFIG, driver_name="d"
)
ON = dataclasses.replace(OFF, capacity=True)
T0 = dt.datetime(2026, 7, 1, tzinfo=dt.UTC)
WF = "wfx_cap"
WF_KEY = sandbox_base_name("workflow", WF)
SESSION_KEY = sandbox_base_name("session", "ses_cap")


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def wf_created() -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(occurred_at=_at(0)),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=WF,
        org="org_a",
        workflow_execution_target=common_pb2.CLOUD,
        caller_identity_id="ida_1",
    )


def agent_created(execution_id: str = "axr_cap") -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(occurred_at=_at(0)),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id=execution_id,
        session_id="ses_cap",
        org="org_b",
        session_execution_target=common_pb2.CLOUD,
    )


def wf_phase(new: int, at: float = 5) -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(occurred_at=_at(at)),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=WF,
        new_phase=new,  # type: ignore[arg-type]
    )


def _answer_id(to: state_pb2.ExecutionState | None, kind: str) -> str:
    """The ledger's answer id to the wait ``to`` is in (derived from its request's id)."""
    wait = (
        to.capacity if to is not None else state_pb2.CapacityWait(request_event_id="none", sandbox_key=WF_KEY)
    )
    return derived_event_id(wait.request_event_id, kind, wait.sandbox_key)


def agent_phase(new: int, at: float = 5) -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(occurred_at=_at(at)),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id="axr_cap",
        session_id="ses_cap",
        new_phase=new,  # type: ignore[arg-type]
    )


def admitted(
    to: state_pb2.ExecutionState | None, key: str = WF_KEY, execution_id: str = WF, at: float = 3
) -> capacity_pb2.CapacityAdmitted:
    meta = new_meta(event_id=_answer_id(to, "CapacityAdmitted"), occurred_at=_at(at))
    return capacity_pb2.CapacityAdmitted(meta=meta, execution_id=execution_id, sandbox_key=key, waited_s=at)


def queued(
    to: state_pb2.ExecutionState | None, position: int = 4, key: str = WF_KEY, execution_id: str = WF
) -> capacity_pb2.CapacityQueued:
    return capacity_pb2.CapacityQueued(
        meta=new_meta(event_id=_answer_id(to, "CapacityQueued"), occurred_at=_at(1)),
        execution_id=execution_id,
        sandbox_key=key,
        reason="capacity: installation cap 20 reached",
        position=position,
    )


TIMED_OUT_REASON = "capacity: waited 600 s for a sandbox (installation cap 20 reached)"


def timed_out(
    to: state_pb2.ExecutionState | None, key: str = WF_KEY, execution_id: str = WF
) -> capacity_pb2.CapacityTimedOut:
    return capacity_pb2.CapacityTimedOut(
        meta=new_meta(event_id=_answer_id(to, "CapacityTimedOut"), occurred_at=_at(600)),
        execution_id=execution_id,
        sandbox_key=key,
        reason=TIMED_OUT_REASON,
        waited_s=600,
    )


def _decide(state: state_pb2.ExecutionState | None, event: object, config: LaneConfig = ON) -> Decision:
    decision = decide(event, StateView(state), config)  # type: ignore[arg-type]
    assert decision.reject is None, decision.reject
    return decision


def _waiting_workflow() -> state_pb2.ExecutionState:
    decision = _decide(None, wf_created())
    assert decision.state is not None
    return decision.state


def test_without_a_cap_a_create_ensures_at_once_and_writes_nothing_to_the_ledger() -> None:
    decision = _decide(None, wf_created(), OFF)
    assert [type(c) for c in decision.commands] == [Ensure]
    assert decision.capacity == () and decision.state is not None
    assert not decision.state.HasField("capacity")
    assert (
        OFF.fingerprint
        == LaneConfig(
            enabled=True,
            agent=SESSION_ROUTING_CLOUD_DEFAULT,
            workflow=EXECUTION_ROUTING_CONFIG,
            driver_name="d",
        ).fingerprint
    )
    assert ON.fingerprint != OFF.fingerprint  # the cap changes decisions: replay must know it


def test_with_a_cap_a_create_asks_the_ledger_instead_of_ensuring() -> None:
    decision = _decide(None, wf_created())
    assert decision.commands == ()
    assert decision.state is not None and not decision.state.pending
    (request,) = decision.capacity
    assert isinstance(request, capacity_pb2.CapacityRequested)
    assert (request.sandbox_key, request.execution_id, request.org) == (WF_KEY, WF, "org_a")
    assert request.scope == common_pb2.SANDBOX_SCOPE_WORKFLOW
    assert request.meta.occurred_at == wf_created().meta.occurred_at
    wait = decision.state.capacity
    assert wait.waiting and not wait.admitted and wait.sandbox_key == WF_KEY
    # The same input decided again (a redelivery after a failed transaction) derives the same
    # request id, so the ledger counts it once; another input, another id.
    same = _decide(None, wf_created()).capacity
    other = wf_created()
    other.meta.event_id = "another"
    assert decide(other, StateView(None), ON).capacity[0].meta.event_id != same[0].meta.event_id
    redelivered = wf_created()
    redelivered.meta.event_id = "e-fixed"
    first, second = (decide(redelivered, StateView(None), ON).capacity[0] for _ in range(2))
    assert first.meta.event_id == second.meta.event_id


def test_a_queued_answer_tells_upstream_it_waits_with_the_reason_and_the_position() -> None:
    waiting = _waiting_workflow()
    decision = _decide(waiting, queued(waiting, position=7))
    (out,) = decision.outputs
    assert isinstance(out, outcomes_pb2.SandboxQueued)
    assert (out.execution_id, out.position) == (WF, 7)
    assert out.reason.startswith("capacity:")
    assert out.sandbox.name == WF_KEY and out.sandbox.scope == common_pb2.SANDBOX_SCOPE_WORKFLOW
    assert decision.commands == ()
    assert decision.state is not None and decision.state.capacity.position == 7
    assert decision.state.capacity.waiting


def test_an_admission_ensures_the_sandbox_through_the_lane_and_its_teardown_releases_it() -> None:
    waiting = _waiting_workflow()
    decision = _decide(waiting, admitted(waiting))
    (ensure,) = decision.commands
    assert isinstance(ensure, Ensure) and ensure.critical and ensure.sandbox_id == WF
    state = decision.state
    assert state is not None and len(state.pending) == 1
    assert state.capacity.admitted and not state.capacity.waiting
    provisioned = complete_effect(state, state.pending[0].effect_id, CommandResult(ok=True), ON)
    assert provisioned.capacity == ()  # a sandbox running counts: nothing released
    assert provisioned.state is not None
    done = _decide(provisioned.state, wf_phase(common_pb2.EXECUTION_COMPLETED))
    (teardown,) = done.commands
    assert isinstance(teardown, Deprovision)
    assert done.state is not None
    folded = complete_effect(done.state, pending_of(done.state)[0][0], CommandResult(ok=True), ON)
    assert [type(o) for o in folded.outputs] == [outcomes_pb2.SandboxDeprovisioned]
    (release,) = folded.capacity
    assert isinstance(release, capacity_pb2.CapacityReleased)
    assert (release.sandbox_key, release.execution_id) == (WF_KEY, "")  # the sandbox no longer counts


def test_a_failed_teardown_keeps_the_sandbox_counted() -> None:
    waiting = _waiting_workflow()
    state = _decide(waiting, admitted(waiting)).state
    assert state is not None
    state = complete_effect(state, state.pending[0].effect_id, CommandResult(ok=True), ON).state
    done = _decide(state, wf_phase(common_pb2.EXECUTION_COMPLETED))
    assert done.state is not None
    folded = complete_effect(done.state, pending_of(done.state)[0][0], CommandResult(ok=False, error="x"), ON)
    assert [type(o) for o in folded.outputs] == [outcomes_pb2.SandboxTeardownFailed]
    assert folded.capacity == ()


def test_a_time_out_is_the_workflow_lanes_critical_failure_with_a_capacity_reason() -> None:
    waiting = _waiting_workflow()
    decision = _decide(waiting, timed_out(waiting))
    (failed,) = decision.outputs
    assert isinstance(failed, outcomes_pb2.SandboxFailed)
    assert failed.critical and failed.code == common_pb2.STATUS_CODE_UNAVAILABLE
    assert failed.message == WORKFLOW_SANDBOX_FAILED_MESSAGE
    assert failed.reason.startswith("capacity:")
    assert decision.commands == ()
    assert decision.state is not None and decision.state.refused  # upstream refused the create
    # Its terminal phase then tears nothing down: no sandbox was ever made.
    after = _decide(decision.state, wf_phase(common_pb2.EXECUTION_FAILED))
    assert after.commands == ()


def test_a_time_out_on_the_session_lane_is_non_critical_and_pre_stamps_the_status() -> None:
    first = _decide(None, agent_created())
    assert first.state is not None and first.capacity
    decision = _decide(first.state, timed_out(first.state, SESSION_KEY, "axr_cap"))
    (failed,) = decision.outputs
    assert isinstance(failed, outcomes_pb2.SandboxFailed) and not failed.critical
    assert decision.state is not None
    assert decision.state.status_error == SANDBOX_PROVISIONING_FAILED_PREFIX + TIMED_OUT_REASON
    assert decision.state.phase == common_pb2.EXECUTION_PENDING  # the phase is never touched


def test_a_terminal_phase_while_waiting_leaves_the_queue_without_a_sandbox() -> None:
    waiting = _waiting_workflow()
    decision = _decide(waiting, wf_phase(common_pb2.EXECUTION_CANCELLED))
    assert decision.commands == ()  # no teardown of a sandbox that never was
    (release,) = decision.capacity
    assert isinstance(release, capacity_pb2.CapacityReleased)
    # A workflow's sandbox is its alone: the whole place goes (an admission on its way included).
    assert (release.sandbox_key, release.execution_id) == (WF_KEY, "")
    assert decision.state is not None and not decision.state.capacity.waiting
    # The ledger's admission crossing that release in the log changes nothing.
    assert _decide(decision.state, admitted(waiting)).state is None


def test_an_admission_to_an_earlier_request_is_not_taken_for_a_newer_one() -> None:
    """The review's race: admitted (on its way), FAILED while waiting (released), recovered (a new
    request): the old admission must not start the ensure of the new wait."""
    waiting = _waiting_workflow()
    stale = admitted(waiting)
    failed = _decide(waiting, wf_phase(common_pb2.EXECUTION_FAILED, at=2)).state
    recovered = _decide(failed, wf_phase(common_pb2.EXECUTION_IN_PROGRESS, at=3))
    assert recovered.state is not None and recovered.state.capacity.waiting
    (again,) = recovered.capacity
    assert isinstance(again, capacity_pb2.CapacityRequested)
    assert _decide(recovered.state, stale).state is None
    fresh = _decide(recovered.state, admitted(recovered.state))
    assert [type(c) for c in fresh.commands] == [Ensure]


def test_a_recover_while_the_failed_teardown_is_out_keeps_the_sandbox_counted() -> None:
    waiting = _waiting_workflow()
    state = _decide(waiting, admitted(waiting)).state
    assert state is not None
    state = complete_effect(state, state.pending[0].effect_id, CommandResult(ok=True), ON).state
    failed = _decide(state, wf_phase(common_pb2.EXECUTION_FAILED, at=5))
    assert [type(c) for c in failed.commands] == [Deprovision]
    recover = _decide(failed.state, wf_phase(common_pb2.EXECUTION_IN_PROGRESS, at=6))
    assert recover.capacity == ()  # admitted and not released: the ensure goes through
    assert recover.state is not None
    teardown_id = next(e.effect_id for e in recover.state.pending if e.op == state_pb2.EFFECT_OP_DEPROVISION)
    folded = complete_effect(recover.state, teardown_id, CommandResult(ok=True), ON)
    assert folded.capacity == ()  # the recover's ensure of the same sandbox is out: no release


def test_a_failed_re_ensure_of_a_sandbox_made_before_frees_nothing() -> None:
    first = _decide(None, agent_created()).state
    state = _decide(first, admitted(first, SESSION_KEY, "axr_cap")).state
    assert state is not None
    state = complete_effect(state, state.pending[0].effect_id, CommandResult(ok=True), ON).state
    assert state is not None
    failed = _decide(state, agent_phase(common_pb2.EXECUTION_FAILED, at=5)).state
    recover = _decide(failed, agent_phase(common_pb2.EXECUTION_IN_PROGRESS, at=6))
    assert recover.state is not None and recover.state.pending
    folded = complete_effect(
        recover.state, recover.state.pending[0].effect_id, CommandResult(ok=False, error="boom"), ON
    )
    assert folded.capacity == ()  # the session's sandbox was made: it may still run, it counts on


def test_a_sessions_second_execution_asks_for_the_same_sandbox_key() -> None:
    one = _decide(None, agent_created("axr_1"))
    two = _decide(None, agent_created("axr_2"))
    keys = {
        r.sandbox_key for r in (*one.capacity, *two.capacity) if isinstance(r, capacity_pb2.CapacityRequested)
    }
    assert keys == {SESSION_KEY}  # one sandbox, counted once by the ledger
    state = _decide(one.state, admitted(one.state, SESSION_KEY, "axr_1")).state
    assert state is not None
    (entry,) = state.pending
    assert entry.op == state_pb2.EFFECT_OP_ENSURE and not entry.critical


def test_an_answer_nobody_asked_for_changes_nothing() -> None:
    waiting = _waiting_workflow()
    assert _decide(None, admitted(waiting)).state is None
    done = _decide(waiting, admitted(waiting)).state
    assert _decide(done, queued(waiting)).state is None  # admitted already: a stale queue notice is ignored
    # An answer whose id does not derive from the wait's request (another request's) is ignored.
    assert _decide(waiting, admitted(None)).state is None


def test_a_session_ensure_failure_releases_only_its_execution() -> None:
    first = _decide(None, agent_created()).state
    state = _decide(first, admitted(first, SESSION_KEY, "axr_cap")).state
    assert state is not None
    folded = complete_effect(state, state.pending[0].effect_id, CommandResult(ok=False, error="boom"), ON)
    (release,) = folded.capacity
    assert isinstance(release, capacity_pb2.CapacityReleased)
    assert (release.sandbox_key, release.execution_id) == (SESSION_KEY, "axr_cap")
