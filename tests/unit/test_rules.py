"""The pure core beyond the seed file: idempotency, rejects, target resolution, output ids."""

from __future__ import annotations

import datetime as dt

from consumers.lanes.commands import CommandResult, Deprovision, Ensure, LaneConfig, StateView
from consumers.lanes.constants import (
    LOG_TOKENLESS_LAUNCH,
    SANDBOX_PROVISIONING_FAILED_PREFIX,
    SANDBOX_TOKEN_TTL_SECONDS,
    SESSION_QUEUE_PREFIX,
    TOKEN_TYPE_EXECUTION_SCOPED,
    WFEXEC_QUEUE_PREFIX,
    WORKFLOW_SANDBOX_FAILED_MESSAGE,
)
from consumers.lanes.dispatch import (
    AgentExecutionTemporalConfig,
    WorkflowExecutionTemporalConfig,
    resolve_activity_task_queue,
    resolve_execution_target,
    resolve_workflow_task_queue,
)
from consumers.lanes.outbox import pending_of
from consumers.lanes.rules import complete, complete_effect, decide
from events.codec import new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2
from tests.support.lane_fakes import (
    EXECUTION_ROUTING_CONFIG,
    SESSION_ROUTING_CLOUD_DEFAULT,
    FakeProvisioner,
    MintingCredentials,
    lane_processor,
)

CONFIG = LaneConfig(
    enabled=True, agent=SESSION_ROUTING_CLOUD_DEFAULT, workflow=EXECUTION_ROUTING_CONFIG, driver_name="d"
)


def agent_created(event_id: str = "e1", target: int = common_pb2.CLOUD) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(event_id=event_id),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id="axr_1",
        session_id="ses_1",
        session_execution_target=target,  # type: ignore[arg-type]
    )


def test_upstream_constants_are_byte_identical() -> None:
    assert SANDBOX_PROVISIONING_FAILED_PREFIX == "Sandbox provisioning failed: "
    assert WORKFLOW_SANDBOX_FAILED_MESSAGE == "failed to provision workflow sandbox"
    assert SESSION_QUEUE_PREFIX == "session:" and WFEXEC_QUEUE_PREFIX == "wfexec:"
    assert TOKEN_TYPE_EXECUTION_SCOPED == "execution_scoped"
    assert SANDBOX_TOKEN_TTL_SECONDS == 14400
    assert LOG_TOKENLESS_LAUNCH == (
        "Sandbox launching without a runner token (credential lane disabled) — its values fetch will be refused"
    )
    assert (common_pb2.EXECUTION_COMPLETED, common_pb2.EXECUTION_FAILED) == (3, 4)
    assert (common_pb2.EXECUTION_CANCELLED, common_pb2.EXECUTION_TERMINATED, common_pb2.EXECUTION_PAUSED) == (
        5,
        6,
        7,
    )
    assert (common_pb2.EXECUTION_TARGET_UNSPECIFIED, common_pb2.LOCAL, common_pb2.CLOUD) == (0, 1, 2)


def test_unspecified_target_resolves_with_the_configured_default_and_only_exact_cloud_is_cloud() -> None:
    assert resolve_execution_target(common_pb2.EXECUTION_TARGET_UNSPECIFIED, "cloud") == common_pb2.CLOUD
    assert resolve_execution_target(common_pb2.EXECUTION_TARGET_UNSPECIFIED, "local") == common_pb2.LOCAL
    assert resolve_execution_target(common_pb2.EXECUTION_TARGET_UNSPECIFIED, "Cloud") == common_pb2.LOCAL
    assert resolve_execution_target(common_pb2.EXECUTION_TARGET_UNSPECIFIED, "") == common_pb2.LOCAL
    assert resolve_execution_target(common_pb2.LOCAL, "cloud") == common_pb2.LOCAL
    assert resolve_execution_target(common_pb2.CLOUD, "local") == common_pb2.CLOUD


def test_dispatch_queues() -> None:
    session = AgentExecutionTemporalConfig(activity_routing="session")
    assert resolve_activity_task_queue("ses_1", common_pb2.CLOUD, session).task_queue == "session:ses_1"
    assert resolve_activity_task_queue("", common_pb2.CLOUD, session).task_queue == "stigmer_runner"
    override = resolve_activity_task_queue("ses_1", common_pb2.CLOUD, session, override="wfexec:wfx_9")
    assert (override.task_queue, override.execution_target) == ("wfexec:wfx_9", common_pb2.LOCAL)
    execution = WorkflowExecutionTemporalConfig(workflow_activity_routing="execution")
    # The TS port does not gate the queue on the target; the ensure does.
    assert resolve_workflow_task_queue("wfx_1", common_pb2.LOCAL, execution).task_queue == "wfexec:wfx_1"
    assert (
        resolve_workflow_task_queue("wfx_1", common_pb2.CLOUD, WorkflowExecutionTemporalConfig()).task_queue
        == "stigmer_runner"
    )


def test_unspecified_session_target_with_cloud_default_provisions() -> None:
    decision = decide(agent_created(target=common_pb2.EXECUTION_TARGET_UNSPECIFIED), StateView(None), CONFIG)
    assert [type(c) for c in decision.commands] == [Ensure]
    local_default = LaneConfig(enabled=True, agent=AgentExecutionTemporalConfig(activity_routing="session"))
    assert (
        decide(
            agent_created(target=common_pb2.EXECUTION_TARGET_UNSPECIFIED), StateView(None), local_default
        ).commands
        == ()
    )


def test_a_redelivered_event_is_a_duplicate_and_changes_nothing() -> None:
    first = decide(agent_created("e1"), StateView(None), CONFIG)
    assert first.state is not None and list(first.state.applied_event_ids) == ["e1"]
    again = decide(agent_created("e1"), StateView(first.state), CONFIG)
    assert again.duplicate and again.state is None and again.commands == ()


def test_a_second_create_under_a_new_event_id_does_not_provision_again() -> None:
    first = decide(agent_created("e1"), StateView(None), CONFIG)
    second = decide(agent_created("e2"), StateView(first.state), CONFIG)
    assert second.commands == () and not second.duplicate
    assert second.state is not None and list(second.state.applied_event_ids) == ["e1", "e2"]


def test_applied_ids_are_bounded() -> None:
    state: state_pb2.ExecutionState | None = None
    for i in range(100):
        state = decide(agent_created(f"e{i}"), StateView(state), CONFIG).state
    assert state is not None and len(state.applied_event_ids) == 32 and state.applied_event_ids[-1] == "e99"
    assert state.applied_count == 100


def test_phase_changed_for_an_unknown_execution_is_rejected_for_the_dead_letter_topic() -> None:
    event = inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id="wfx_x",
        previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
        new_phase=common_pb2.EXECUTION_COMPLETED,
    )
    decision = decide(event, StateView(None), CONFIG)
    assert decision.reject is not None and "unknown execution 'wfx_x'" in decision.reject
    agent_state = state_pb2.ExecutionState(
        execution_id="wfx_x", kind=common_pb2.AGENT_EXECUTION, created=True
    )
    mismatch = decide(event, StateView(agent_state), CONFIG)
    assert mismatch.reject is not None and "does not match" in mismatch.reject


def test_agent_terminal_phase_does_not_tear_down_the_long_lived_session_sandbox() -> None:
    state = decide(agent_created(), StateView(None), CONFIG).state
    event = inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id="axr_1",
        session_id="ses_1",
        previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
        new_phase=common_pb2.EXECUTION_COMPLETED,
        error="boom",
    )
    decision = decide(event, StateView(state), CONFIG)
    assert decision.commands == ()
    assert decision.state is not None and decision.state.phase == common_pb2.EXECUTION_COMPLETED
    # The session ensure decided with the create is still pending (its driver call runs off the
    # transaction): the phase's error waits for it, so the ensure's pre-stamp keeps upstream's
    # first-non-empty-wins order; a successful ensure then lets the phase's error through.
    assert decision.state.status_error == "" and decision.state.deferred_status_error == "boom"
    ((effect_id, _),) = pending_of(decision.state)
    done = complete_effect(decision.state, effect_id, CommandResult(ok=True, probe_state="running"), CONFIG)
    assert done.state is not None and done.state.status_error == "boom"
    assert done.state.deferred_status_error == "" and not done.state.pending


def test_output_ids_are_deterministic_per_input_event() -> None:
    decision = decide(agent_created("same-id"), StateView(None), CONFIG)
    ok = CommandResult(ok=True, probe_state="running", token_minted=True)
    a = complete(decision, [ok], CONFIG).outputs[0]
    b = complete(decide(agent_created("same-id"), StateView(None), CONFIG), [ok], CONFIG).outputs[0]
    c = complete(decide(agent_created("other-id"), StateView(None), CONFIG), [ok], CONFIG).outputs[0]
    assert a.meta.event_id == b.meta.event_id != c.meta.event_id
    assert a.meta.causation_id == "same-id"
    assert isinstance(a, outcomes_pb2.SandboxProvisioned)
    assert a.sandbox.name.startswith("sbx-ses-") and a.sandbox.driver == "d"


def test_decide_is_pure_the_stored_state_is_never_mutated() -> None:
    stored = decide(agent_created("e1"), StateView(None), CONFIG).state
    assert stored is not None
    snapshot = stored.SerializeToString()
    decision = decide(agent_created("e2"), StateView(stored), CONFIG)
    complete(decision, [], CONFIG)
    assert stored.SerializeToString() == snapshot


def test_workflow_terminal_deprovision_command_and_success_outcome() -> None:
    created = inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id="wfx_1",
        workflow_execution_target=common_pb2.CLOUD,
    )
    state = decide(created, StateView(None), CONFIG).state
    event = inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id="wfx_1",
        previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
        new_phase=common_pb2.EXECUTION_CANCELLED,
    )
    decision = decide(event, StateView(state), CONFIG)
    assert decision.commands == (Deprovision("workflow", "wfx_1", common_pb2.EXECUTION_CANCELLED),)
    outcome = complete(decision, [CommandResult(ok=True)], CONFIG)
    (done,) = outcome.outputs
    assert (
        isinstance(done, outcomes_pb2.SandboxDeprovisioned) and done.phase == common_pb2.EXECUTION_CANCELLED
    )
    assert [log.message for log in outcome.logs] == ["Workflow sandbox deprovisioned on terminal phase"]
    assert outcome.logs[0].fields == {"executionId": "wfx_1", "phase": "EXECUTION_CANCELLED"}


async def test_default_mint_binds_the_agent_execution_id_on_the_execution_scoped_lane_for_4h() -> None:
    credentials = MintingCredentials()
    provisioner = FakeProvisioner()
    await lane_processor(provisioner, credentials).process(agent_created(), StateView(None))
    assert credentials.mints == [("execution_scoped", "axr_1", 14400)]


# --- the stored phase decides (spec 2.4), recover (spec 2.7) -----------------------------------

T0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def _at(seconds: int) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def wf_created_event(execution_id: str = "wfx_r", caller_class: str = "user") -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(occurred_at=_at(0)),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        org="org_1",
        workflow_execution_target=common_pb2.CLOUD,
        caller_identity_id="ida_1",
        caller_class=caller_class,
    )


def wf_phase(
    new: int, previous: int = common_pb2.EXECUTION_IN_PROGRESS, at: int = 1, error: str = ""
) -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(occurred_at=_at(at)),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id="wfx_r",
        previous_phase=previous,  # type: ignore[arg-type]
        new_phase=new,  # type: ignore[arg-type]
        error=error,
    )


def _apply(
    state: state_pb2.ExecutionState | None, event: object
) -> tuple[state_pb2.ExecutionState, tuple[object, ...]]:
    decision = decide(event, StateView(state), CONFIG)  # type: ignore[arg-type]
    assert decision.reject is None and decision.state is not None, decision
    return decision.state, decision.commands


def test_a_recovered_workflow_gets_its_sandbox_ensured_again_critical_same_name_error_cleared() -> None:
    state, commands = _apply(None, wf_created_event())
    (first,) = commands
    state, commands = _apply(
        state, wf_phase(common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_PENDING, at=1)
    )
    assert commands == ()
    state, commands = _apply(state, wf_phase(common_pb2.EXECUTION_FAILED, at=2, error="boom"))
    assert [type(c) for c in commands] == [Deprovision] and state.status_error == "boom"
    state.ClearField("pending")  # the teardown completed
    state, commands = _apply(
        state, wf_phase(common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_FAILED, at=3)
    )
    (again,) = commands
    assert isinstance(again, Ensure) and again == first  # same sandbox, queue, caller, mint, critical
    assert again.critical and again.sandbox_id == "wfx_r" and again.mint.caller_identity_id == "ida_1"
    assert state.phase == common_pb2.EXECUTION_IN_PROGRESS
    # Its outbox entry is a new one (the id derives from the recover event), marked as a recover.
    (entry,) = state.pending
    assert entry.op == state_pb2.EFFECT_OP_ENSURE and entry.recover
    # Upstream clears the error when it persists the recovered execution, after the ensure.
    assert state.status_error == "boom"
    done = complete_effect(state, entry.effect_id, CommandResult(ok=True, probe_state="running"), CONFIG)
    assert done.state is not None and done.state.status_error == "" and not done.state.pending


def test_a_refused_recover_leaves_the_workflow_failed_with_its_error_and_can_be_retried() -> None:
    state, _ = _apply(None, wf_created_event())
    state.ClearField("pending")
    state, _ = _apply(state, wf_phase(common_pb2.EXECUTION_FAILED, at=2, error="boom"))
    state.ClearField("pending")
    state, _ = _apply(state, wf_phase(common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_FAILED, at=3))
    refused = complete_effect(
        state, state.pending[0].effect_id, CommandResult(ok=False, error="no capacity"), CONFIG
    )
    assert refused.state is not None
    (failed,) = refused.outputs
    assert isinstance(failed, outcomes_pb2.SandboxFailed) and failed.critical
    assert refused.state.phase == common_pb2.EXECUTION_FAILED and refused.state.status_error == "boom"
    assert refused.state.refusal_reason == "no capacity" and not refused.state.refused
    _, commands = _apply(
        refused.state, wf_phase(common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_FAILED, at=4)
    )
    assert [type(c) for c in commands] == [Ensure]  # retried


def test_a_refused_create_is_recorded_and_its_terminal_phase_tears_nothing_down() -> None:
    state, commands = _apply(None, wf_created_event())
    refused = complete_effect(
        state, state.pending[0].effect_id, CommandResult(ok=False, error="no capacity"), CONFIG
    )
    assert (
        refused.state is not None and refused.state.refused and refused.state.refusal_reason == "no capacity"
    )
    failed, commands = _apply(
        refused.state, wf_phase(common_pb2.EXECUTION_FAILED, common_pb2.EXECUTION_PENDING, at=2)
    )
    assert commands == ()
    # Recovered anyway (upstream would have no row to recover): once its ensure succeeds a sandbox
    # exists, so the execution is no longer refused and its end tears the sandbox down.
    recovering, _ = _apply(
        failed, wf_phase(common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_FAILED, at=3)
    )
    ok = complete_effect(recovering, recovering.pending[0].effect_id, CommandResult(ok=True), CONFIG)
    assert ok.state is not None and not ok.state.refused
    _, commands = _apply(ok.state, wf_phase(common_pb2.EXECUTION_COMPLETED, at=4))
    assert [type(c) for c in commands] == [Deprovision]


def test_an_agent_recover_clears_the_error_even_when_its_session_ensure_fails() -> None:
    created = agent_created("e1")
    state, _ = _apply(None, created)
    state.ClearField("pending")
    failed_phase = inputs_pb2.PhaseChanged(
        meta=new_meta(), kind=common_pb2.AGENT_EXECUTION, execution_id="axr_1", session_id="ses_1",
        new_phase=common_pb2.EXECUTION_FAILED, error="model refused",
    )  # fmt: skip
    state, _ = _apply(state, failed_phase)
    assert state.status_error == "model refused"
    recover = inputs_pb2.PhaseChanged(
        meta=new_meta(), kind=common_pb2.AGENT_EXECUTION, execution_id="axr_1", session_id="ses_1",
        new_phase=common_pb2.EXECUTION_IN_PROGRESS,
    )  # fmt: skip
    state, _ = _apply(state, recover)
    assert state.status_error == ""
    out = complete_effect(state, state.pending[0].effect_id, CommandResult(ok=False, error="quota"), CONFIG)
    assert out.state is not None and out.state.status_error == ""  # no pre-stamp: upstream clears after
    (failed,) = out.outputs
    assert isinstance(failed, outcomes_pb2.SandboxFailed) and not failed.critical
    assert out.state.phase == common_pb2.EXECUTION_IN_PROGRESS


def test_a_recovered_agent_execution_re_ensures_its_session_sandbox_non_critical() -> None:
    created = agent_created("e1")
    created.meta.occurred_at.FromDatetime(_at(0))
    state, commands = _apply(None, created)
    (first,) = commands

    def agent_phase(new: int, at: int) -> inputs_pb2.PhaseChanged:
        return inputs_pb2.PhaseChanged(
            meta=new_meta(occurred_at=_at(at)),
            kind=common_pb2.AGENT_EXECUTION,
            execution_id="axr_1",
            session_id="ses_1",
            new_phase=new,  # type: ignore[arg-type]
        )

    state.ClearField("pending")
    state, commands = _apply(state, agent_phase(common_pb2.EXECUTION_FAILED, 1))
    assert commands == ()  # session sandboxes outlive their executions
    state, commands = _apply(state, agent_phase(common_pb2.EXECUTION_IN_PROGRESS, 2))
    assert commands == (first,) and isinstance(first, Ensure) and not first.critical
    # Recover of an execution already IN_PROGRESS is upstream's idempotent no-op.
    state.ClearField("pending")
    _, commands = _apply(state, agent_phase(common_pb2.EXECUTION_IN_PROGRESS, 3))
    assert commands == ()


def test_the_observer_judges_the_transition_by_the_stored_phase_not_the_producers_word() -> None:
    state, _ = _apply(None, wf_created_event())
    state.ClearField("pending")
    state, commands = _apply(state, wf_phase(common_pb2.EXECUTION_COMPLETED, at=2))
    assert [type(c) for c in commands] == [Deprovision]
    state.ClearField("pending")
    # The same terminal write re-sent under a new event id (the producer still says IN_PROGRESS
    # before it): the stored phase is already COMPLETED, no second teardown.
    state, commands = _apply(state, wf_phase(common_pb2.EXECUTION_COMPLETED, at=3))
    assert commands == ()
    # A producer that says FAILED -> FAILED while the store holds PENDING did move the execution.
    fresh, _ = _apply(None, wf_created_event("wfx_r"))
    fresh.ClearField("pending")
    _, commands = _apply(fresh, wf_phase(common_pb2.EXECUTION_FAILED, common_pb2.EXECUTION_FAILED, at=2))
    assert [type(c) for c in commands] == [Deprovision]


def test_a_stale_phase_change_moves_nothing_backwards() -> None:
    state, _ = _apply(None, wf_created_event())
    state.ClearField("pending")
    state, commands = _apply(state, wf_phase(common_pb2.EXECUTION_COMPLETED, at=10))
    state.ClearField("pending")
    # An IN_PROGRESS written before the COMPLETED, delivered after it.
    late, commands = _apply(
        state, wf_phase(common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_PENDING, at=5)
    )
    assert commands == () and late.phase == common_pb2.EXECUTION_COMPLETED
    assert late.updated_at == state.updated_at
    assert late.applied_count == state.applied_count + 1  # applied (its id is remembered), moved nothing


def test_a_phase_change_without_a_new_phase_goes_to_the_dead_letter_topic() -> None:
    state, _ = _apply(None, wf_created_event())
    decision = decide(wf_phase(common_pb2.EXECUTION_PHASE_UNSPECIFIED), StateView(state), CONFIG)
    assert decision.reject == "phase-changed for 'wfx_r' has no new_phase" and decision.state is None


def test_the_lanes_emit_upstreams_dispatch_log_lines() -> None:
    decision = decide(agent_created("e1"), StateView(None), CONFIG)
    (resolved,) = [log for log in decision.logs if log.message == "Dispatch resolved activity task queue"]
    assert resolved.level == "info" and resolved.fields == {
        "session_id": "ses_1",
        "task_queue": "session:ses_1",
        "routing_mode": "session",
        "execution_target": "CLOUD",
    }
    wf = decide(wf_created_event(), StateView(None), CONFIG)
    assert [(log.level, log.message) for log in wf.logs] == [
        ("info", "Workflow dispatch resolved per-execution queue")
    ]


# --- session deletes ordered with the session lane (spec 2.5) -------------------------------------


def _deleted(session_id: str = "ses_1") -> inputs_pb2.SessionDeleted:
    return inputs_pb2.SessionDeleted(meta=new_meta(), session_id=session_id)


def _sessions(*states: state_pb2.ExecutionState) -> StateView:
    by_key = {s.execution_id: s for s in states}
    return StateView(None, by_key.get)


def test_a_session_delete_records_the_session_as_deleted_and_tears_its_sandbox_down() -> None:
    decision = decide(_deleted(), StateView(None), CONFIG)
    assert decision.state is not None and decision.state.session_deleted
    assert decision.state.execution_id == "ses_1"
    assert decision.commands == (Deprovision("session", "ses_1", common_pb2.EXECUTION_PHASE_UNSPECIFIED),)


def test_a_create_applied_after_its_sessions_delete_provisions_nothing_and_says_why() -> None:
    session = decide(_deleted(), StateView(None), CONFIG).state
    assert session is not None
    decision = decide(agent_created(), _sessions(session), CONFIG)
    assert decision.commands == ()
    assert decision.state is not None and decision.state.created and decision.state.refused
    assert decision.state.refusal_reason == "session 'ses_1' was deleted"
    assert [(log.level, log.message, log.fields) for log in decision.logs] == [
        (
            "warning",
            "session deleted - session sandbox not provisioned",
            {"executionId": "axr_1", "sessionId": "ses_1"},
        )
    ]
    # Another session's delete changes nothing for this one.
    other = decide(_deleted("ses_2"), StateView(None), CONFIG).state
    assert other is not None
    assert [type(c) for c in decide(agent_created(), _sessions(other), CONFIG).commands] == [Ensure]


def test_a_recover_after_the_sessions_delete_does_not_bring_the_sandbox_back() -> None:
    state, (ensure,) = _apply(None, agent_created())
    assert isinstance(ensure, Ensure)
    state.ClearField("pending")
    failed = inputs_pb2.PhaseChanged(
        meta=new_meta(), kind=common_pb2.AGENT_EXECUTION, execution_id="axr_1", session_id="ses_1",
        new_phase=common_pb2.EXECUTION_FAILED,
    )  # fmt: skip
    state, _ = _apply(state, failed)
    session = decide(_deleted(), StateView(None), CONFIG).state
    assert session is not None
    recover = inputs_pb2.PhaseChanged(
        meta=new_meta(), kind=common_pb2.AGENT_EXECUTION, execution_id="axr_1", session_id="ses_1",
        new_phase=common_pb2.EXECUTION_IN_PROGRESS,
    )  # fmt: skip
    decision = decide(recover, StateView(state, {"ses_1": session}.get), CONFIG)
    assert decision.commands == ()
    assert decision.state is not None and decision.state.phase == common_pb2.EXECUTION_IN_PROGRESS
    assert decision.state.refusal_reason == "session 'ses_1' was deleted"


def test_an_agent_phase_change_naming_another_session_is_refused() -> None:
    state, _ = _apply(None, agent_created())
    event = inputs_pb2.PhaseChanged(
        meta=new_meta(), kind=common_pb2.AGENT_EXECUTION, execution_id="axr_1", session_id="ses_9",
        new_phase=common_pb2.EXECUTION_COMPLETED,
    )  # fmt: skip
    decision = decide(event, StateView(state), CONFIG)
    assert (
        decision.reject == "phase-changed session_id 'ses_9' does not match the execution's session 'ses_1'"
    )
