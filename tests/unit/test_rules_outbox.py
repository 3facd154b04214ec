"""The outbox in the pure rules: a decision's driver calls are pending entries of its state,
completed one by one later, with the same outcomes as the synchronous path and never twice."""

from __future__ import annotations

from consumers.lanes.commands import CommandResult, Deprovision, Ensure, LaneConfig, StateView
from consumers.lanes.outbox import effect_id_of, new_effects, pending_of
from consumers.lanes.rules import complete, complete_effect, decide
from events.codec import new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2
from tests.support.lane_fakes import EXECUTION_ROUTING_CONFIG, SESSION_ROUTING_CLOUD_DEFAULT

CONFIG = LaneConfig(
    enabled=True, agent=SESSION_ROUTING_CLOUD_DEFAULT, workflow=EXECUTION_ROUTING_CONFIG, driver_name="d"
)
OK = CommandResult(ok=True, probe_state="running", token_minted=True)


def wf_created(execution_id: str = "wfx_1") -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        org="org_1",
        caller_identity_id="usr_1",
        caller_class="user",
        workflow_execution_target=common_pb2.CLOUD,
    )


def agent_created() -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id="axr_1",
        session_id="ses_1",
        org="org_1",
        session_execution_target=common_pb2.CLOUD,
    )


def phase(execution_id: str, kind: int, new: int, error: str = "") -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=kind,  # type: ignore[arg-type]
        execution_id=execution_id,
        session_id="ses_1" if kind == common_pb2.AGENT_EXECUTION else "",
        previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
        new_phase=new,  # type: ignore[arg-type]
        error=error,
    )


def roundtrip(state: state_pb2.ExecutionState) -> state_pb2.ExecutionState:
    """What a restarted pod reads back from the compacted topic."""
    return state_pb2.ExecutionState.FromString(state.SerializeToString())


def test_a_decision_writes_its_driver_calls_as_pending_entries_with_deterministic_ids() -> None:
    event = wf_created()
    event.meta.event_id = "evt-literal-1"
    decision = decide(event, StateView(None), CONFIG)
    assert decision.state is not None
    ((effect_id, command),) = new_effects(decision)
    # uuid5(6f1d3c2e-5b7a-4e0b-9a51-2f4c8d7e9b10, "evt-literal-1/Ensure/workflow"), written out.
    assert effect_id == "65c86efd-6eb0-54a7-9bad-1dc0384a7ac9"
    assert effect_id_of("evt-literal-1", decision.commands[0]) == effect_id
    assert effect_id_of("evt-literal-1", Deprovision("session", "ses_1", 0)) == (
        "e8fbbaaf-1baf-574e-9191-474b66c7caae"
    )
    assert command == decision.commands[0]
    # Everything the call needs survives the state topic (a new owner re-runs it from there).
    assert pending_of(roundtrip(decision.state)) == [(effect_id, command)]
    assert isinstance(command, Ensure) and command.critical and command.mint.caller_identity_id == "usr_1"


def test_completing_later_gives_the_synchronous_outcome_and_state() -> None:
    event = wf_created()
    sync = decide(event, StateView(None), CONFIG)
    sync_outcome = complete(sync, [OK], CONFIG)

    later = decide(event, StateView(None), CONFIG)
    assert later.state is not None
    ((effect_id, _),) = pending_of(later.state)
    outcome = complete_effect(roundtrip(later.state), effect_id, OK, CONFIG)
    assert outcome.outputs == sync_outcome.outputs
    assert outcome.state == sync_outcome.state
    assert outcome.state is not None and not outcome.state.pending
    assert isinstance(outcome.outputs[0], outcomes_pb2.SandboxProvisioned)


def test_a_second_completion_of_one_call_writes_nothing() -> None:
    decision = decide(wf_created(), StateView(None), CONFIG)
    assert decision.state is not None
    ((effect_id, _),) = pending_of(decision.state)
    first = complete_effect(decision.state, effect_id, OK, CONFIG)
    assert first.state is not None and len(first.outputs) == 1
    # A new owner re-ran it after a crash, or a stale result arrives: no second outcome.
    again = complete_effect(first.state, effect_id, CommandResult(ok=False, error="late"), CONFIG)
    assert again.state is None and again.outputs == () and again.logs == ()
    # The input state is never changed in place.
    assert len(decision.state.pending) == 1


def test_a_terminal_phase_during_the_ensure_queues_the_teardown_behind_it() -> None:
    created = decide(wf_created(), StateView(None), CONFIG)
    terminal = decide(
        phase("wfx_1", common_pb2.WORKFLOW_EXECUTION, common_pb2.EXECUTION_COMPLETED),
        StateView(created.state),
        CONFIG,
    )
    assert terminal.state is not None
    pending = pending_of(terminal.state)
    assert [type(c) for _, c in pending] == [Ensure, Deprovision]
    ensure_id, deprovision_id = (effect_id for effect_id, _ in pending)
    after_ensure = complete_effect(terminal.state, ensure_id, OK, CONFIG)
    assert after_ensure.state is not None
    after_teardown = complete_effect(after_ensure.state, deprovision_id, OK, CONFIG)
    assert after_teardown.state is not None and not after_teardown.state.pending
    (box,) = after_teardown.state.sandboxes
    assert box.lifecycle == state_pb2.SANDBOX_DEPROVISIONED
    assert [type(o).__name__ for o in (*after_ensure.outputs, *after_teardown.outputs)] == [
        "SandboxProvisioned",
        "SandboxDeprovisioned",
    ]


def test_a_failed_session_ensure_still_prestamps_before_a_phase_error_that_arrived_meanwhile() -> None:
    created = decide(agent_created(), StateView(None), CONFIG)
    failing = decide(
        phase("axr_1", common_pb2.AGENT_EXECUTION, common_pb2.EXECUTION_FAILED, error="runner timeout"),
        StateView(created.state),
        CONFIG,
    )
    assert failing.state is not None and failing.state.status_error == ""
    ((effect_id, _),) = pending_of(failing.state)
    done = complete_effect(failing.state, effect_id, CommandResult(ok=False, error="quota"), CONFIG)
    assert done.state is not None
    assert done.state.status_error == "Sandbox provisioning failed: quota"  # first non-empty wins
    assert done.state.deferred_status_error == ""
    assert done.state.phase == common_pb2.EXECUTION_FAILED


def test_a_phase_error_with_nothing_pending_is_stamped_at_once() -> None:
    created = decide(agent_created(), StateView(None), CONFIG)
    assert created.state is not None
    ((effect_id, _),) = pending_of(created.state)
    provisioned = complete_effect(created.state, effect_id, OK, CONFIG).state
    failing = decide(
        phase("axr_1", common_pb2.AGENT_EXECUTION, common_pb2.EXECUTION_FAILED, error="runner timeout"),
        StateView(provisioned),
        CONFIG,
    )
    assert failing.state is not None and failing.state.status_error == "runner timeout"
