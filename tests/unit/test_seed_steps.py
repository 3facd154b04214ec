"""Python ports of the seed file ``sandbox/__tests__/steps.test.ts`` (@stigmer/server 3.14.0-dev).

One test per upstream ``it``, same name, same meaning, expressed over the pod's
model: an input event and the stored execution state go in; driver calls, the
new state (where ``status.error`` lives) and outcome events come out.
"""

from __future__ import annotations

import itertools
import logging

import pytest

from consumers.lanes.commands import StateView
from consumers.lanes.constants import SANDBOX_PROVISIONING_FAILED_PREFIX
from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.lanes.dispatch import AgentExecutionTemporalConfig, WorkflowExecutionTemporalConfig
from events.codec import new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2
from tests.support.lane_fakes import (
    SESSION_ROUTING_CLOUD_DEFAULT,
    TEST_CALLER_IDENTITY_ID,
    CapabilityCredentials,
    DisabledCredentials,
    FakeProvisioner,
    lane_processor,
)

_counter = itertools.count(1)


def seed(target: int, *, org: str = "") -> tuple[str, inputs_pb2.ExecutionCreated]:
    """An agent execution in a fresh session whose execution target is ``target``."""
    n = next(_counter)
    session_id = f"ses_sbx_{n}"
    execution = inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id=f"axr_sbx_{n}",
        name=f"axr_sbx_{n}",
        org=org,
        session_id=session_id,
        session_execution_target=target,  # type: ignore[arg-type]
        caller_identity_id=TEST_CALLER_IDENTITY_ID,
    )
    return session_id, execution


class ExplodingState(StateView):
    """A store that fails every read proves the disabled arm never reads."""

    def __init__(self) -> None:
        super().__init__(None)

    def get(self) -> state_pb2.ExecutionState | None:
        raise AssertionError("the disabled lane must not touch the store")


# --- the session lane ----------------------------------------------------------------------------


async def test_session_lane_fires_on_cloud_target_with_the_per_session_queue_and_the_minted_token() -> None:
    provisioner = FakeProvisioner()
    session_id, execution = seed(common_pb2.CLOUD)
    await lane_processor(provisioner).process(execution, StateView(None))
    assert [(e.scope, e.id, e.env.task_queue, e.env.stigmer_token) for e in provisioner.ensured] == [
        ("session", session_id, f"session:{session_id}", f"tok-{execution.execution_id}")
    ]


async def test_session_lane_delegates_the_mint_to_the_capability_provider_with_the_full_provisioning_context() -> (
    None
):
    provisioner = FakeProvisioner()
    credentials = CapabilityCredentials()
    session_id, execution = seed(common_pb2.CLOUD, org="org-test")
    await lane_processor(provisioner, credentials).process(execution, StateView(None))
    assert credentials.minted == [
        SandboxCredentialRequest(
            scope="session",
            session_id=session_id,
            execution_id=execution.execution_id,
            org="org-test",
            caller_identity_id=TEST_CALLER_IDENTITY_ID,
        )
    ]
    assert provisioner.ensured[0].env.stigmer_token == "cloud-tok-session"


async def test_session_lane_skips_on_resolved_local_target_the_roster_fast_path() -> None:
    provisioner = FakeProvisioner()
    _, execution = seed(common_pb2.LOCAL)
    processed = await lane_processor(provisioner).process(execution, StateView(None))
    assert provisioner.ensured == []
    assert processed.outcome is not None and processed.outcome.outputs == ()


async def test_session_lane_skips_when_the_lane_is_disabled_without_touching_the_store() -> None:
    provisioner = FakeProvisioner()
    execution = inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id="axr_disabled",
        session_id="ses_never_loaded",
        session_execution_target=common_pb2.CLOUD,
    )
    processed = await lane_processor(provisioner, enabled=False).process(execution, ExplodingState())
    assert processed.outcome is None and processed.decision.state is None
    assert provisioner.ensured == []


async def test_session_lane_skips_on_the_wfexec_queue_override_lane_child_sandbox_affinity() -> None:
    provisioner = FakeProvisioner()
    _, execution = seed(common_pb2.CLOUD)
    execution.activity_task_queue = "wfexec:wfx_parent"
    await lane_processor(provisioner).process(execution, StateView(None))
    assert provisioner.ensured == []


async def test_session_lane_skips_with_warn_on_cloud_target_under_global_routing_the_dark_config_belt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    provisioner = FakeProvisioner()
    _, execution = seed(common_pb2.CLOUD)
    global_routing = AgentExecutionTemporalConfig(
        "agent_execution_stigmer", "stigmer_runner", "global", "cloud"
    )
    with caplog.at_level(logging.WARNING):
        await lane_processor(provisioner, agent=global_routing).process(execution, StateView(None))
    assert provisioner.ensured == []
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warned] == [
        "Sandbox provisioning skipped: session routing is not per-session"
    ]
    assert warned[0].taskQueue == "stigmer_runner"  # type: ignore[attr-defined]


async def test_session_lane_launches_token_less_when_the_mint_lane_is_disabled_redaction_posture(
    caplog: pytest.LogCaptureFixture,
) -> None:
    provisioner = FakeProvisioner()
    _, execution = seed(common_pb2.CLOUD)
    with caplog.at_level(logging.WARNING):
        processed = await lane_processor(provisioner, DisabledCredentials()).process(
            execution, StateView(None)
        )
    assert provisioner.ensured[0].env.stigmer_token == ""
    assert any(
        r.getMessage().startswith("Sandbox launching without a runner token (credential lane disabled)")
        for r in caplog.records
    )
    assert processed.outcome is not None
    provisioned = processed.outcome.outputs[0]
    assert isinstance(provisioned, outcomes_pb2.SandboxProvisioned) and not provisioned.token_minted


async def test_session_lane_a_provisioning_failure_never_throws_and_pre_stamps_status_error() -> None:
    provisioner = FakeProvisioner(ensure_error=RuntimeError("quota exhausted: count/secrets"))
    _, execution = seed(common_pb2.CLOUD)
    processed = await lane_processor(provisioner).process(execution, StateView(None))  # does not raise
    assert processed.outcome is not None and processed.outcome.state is not None
    stamped = processed.outcome.state
    assert stamped.status_error == f"{SANDBOX_PROVISIONING_FAILED_PREFIX}quota exhausted: count/secrets"
    assert stamped.status_error == "Sandbox provisioning failed: quota exhausted: count/secrets"
    assert stamped.phase == common_pb2.EXECUTION_PENDING  # the phase belongs to the runner
    (failed,) = processed.outcome.outputs
    assert isinstance(failed, outcomes_pb2.SandboxFailed)
    assert not failed.critical and failed.reason == "quota exhausted: count/secrets"


async def test_session_lane_the_pre_stamp_is_first_non_empty_wins_an_existing_error_survives() -> None:
    provisioner = FakeProvisioner(ensure_error=RuntimeError("second failure"))
    session_id, execution = seed(common_pb2.CLOUD)
    # The stored state already carries the first error (a runner write or an earlier stamp).
    stored = state_pb2.ExecutionState(
        execution_id=execution.execution_id, session_id=session_id, status_error="the real root cause"
    )
    processed = await lane_processor(provisioner).process(execution, StateView(stored))
    assert processed.outcome is not None and processed.outcome.state is not None
    assert processed.outcome.state.status_error == "the real root cause"
    assert stored.status_error == "the real root cause"  # the input state is never mutated
    # The failure path did run: the attempt is reported, only the stamp kept the first error.
    (failed,) = processed.outcome.outputs
    assert isinstance(failed, outcomes_pb2.SandboxFailed)
    assert failed.reason == "second failure" and not failed.critical


# --- the workflow lane ---------------------------------------------------------------------------


def workflow_execution(
    target: int, execution_id: str = "wfx_sbx_1", org: str = ""
) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        name=execution_id,
        org=org,
        workflow_execution_target=target,  # type: ignore[arg-type]
        caller_identity_id=TEST_CALLER_IDENTITY_ID,
    )


async def test_workflow_lane_fires_on_cloud_plus_per_execution_routing_with_the_wfexec_queue() -> None:
    provisioner = FakeProvisioner()
    await lane_processor(provisioner).process(workflow_execution(common_pb2.CLOUD), StateView(None))
    assert [(e.scope, e.id, e.env.task_queue, e.env.stigmer_token) for e in provisioner.ensured] == [
        ("workflow", "wfx_sbx_1", "wfexec:wfx_sbx_1", "tok-wfx_sbx_1")
    ]


async def test_workflow_lane_delegates_the_mint_to_the_capability_provider_on_the_workflow_scope() -> None:
    provisioner = FakeProvisioner()
    credentials = CapabilityCredentials()
    event = workflow_execution(common_pb2.CLOUD, "wfx_sbx_cap", org="org-test")
    await lane_processor(provisioner, credentials).process(event, StateView(None))
    assert credentials.minted == [
        SandboxCredentialRequest(
            scope="workflow",
            session_id="",
            execution_id="wfx_sbx_cap",
            org="org-test",
            caller_identity_id=TEST_CALLER_IDENTITY_ID,
        )
    ]
    assert provisioner.ensured[0].env.stigmer_token == "cloud-tok-workflow"


async def test_workflow_lane_skips_on_local_target_and_on_global_routing() -> None:
    provisioner = FakeProvisioner()
    await lane_processor(provisioner).process(workflow_execution(common_pb2.LOCAL), StateView(None))
    global_routing = WorkflowExecutionTemporalConfig(
        "workflow_execution_stigmer", "stigmer_runner", "global", "cloud"
    )
    await lane_processor(provisioner, workflow=global_routing).process(
        workflow_execution(common_pb2.CLOUD), StateView(None)
    )
    assert provisioner.ensured == []


async def test_workflow_lane_a_provisioning_failure_is_critical_unavailable_the_create_refused() -> None:
    provisioner = FakeProvisioner(ensure_error=RuntimeError("no capacity"))
    processed = await lane_processor(provisioner).process(
        workflow_execution(common_pb2.CLOUD), StateView(None)
    )
    assert processed.outcome is not None
    (failed,) = processed.outcome.outputs
    assert isinstance(failed, outcomes_pb2.SandboxFailed)
    assert failed.critical is True
    assert failed.code == common_pb2.STATUS_CODE_UNAVAILABLE
    assert failed.message == "failed to provision workflow sandbox"
    assert failed.reason == "no capacity"
    # "The create refused": recorded in the execution's state, with the reason.
    state = processed.outcome.state
    assert state is not None and state.refused and state.refusal_reason == "no capacity"


# --- the terminal observer -----------------------------------------------------------------------

P = common_pb2


def created_workflow_state(
    execution_id: str, phase: int = P.EXECUTION_IN_PROGRESS
) -> state_pb2.ExecutionState:
    """A created workflow whose stored phase is ``phase``: upstream's observer is handed the
    previous phase read under the write lock, i.e. the stored one."""
    return state_pb2.ExecutionState(
        execution_id=execution_id,
        kind=common_pb2.WORKFLOW_EXECUTION,
        created=True,
        phase=phase,  # type: ignore[arg-type]
    )


def phase_changed(execution_id: str, previous: int, current: int) -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        previous_phase=previous,  # type: ignore[arg-type]
        new_phase=current,  # type: ignore[arg-type]
    )


async def test_terminal_observer_deprovisions_on_every_transition_into_a_terminal_phase() -> None:
    provisioner = FakeProvisioner()
    processor = lane_processor(provisioner)
    transitions = [
        ("wfx_1", P.EXECUTION_IN_PROGRESS, P.EXECUTION_COMPLETED),
        ("wfx_2", P.EXECUTION_IN_PROGRESS, P.EXECUTION_FAILED),
        ("wfx_3", P.EXECUTION_PENDING, P.EXECUTION_CANCELLED),
        ("wfx_4", P.EXECUTION_PAUSED, P.EXECUTION_TERMINATED),
    ]
    for execution_id, previous, current in transitions:
        await processor.process(
            phase_changed(execution_id, previous, current),
            StateView(created_workflow_state(execution_id, previous)),
        )
    assert [d[1] for d in provisioner.deprovisioned] == ["wfx_1", "wfx_2", "wfx_3", "wfx_4"]
    assert all(d[0] == "workflow" for d in provisioner.deprovisioned)


async def test_terminal_observer_ignores_non_terminal_phases_non_transitions_and_the_disabled_lane() -> None:
    provisioner = FakeProvisioner()
    processor = lane_processor(provisioner)
    await processor.process(
        phase_changed("wfx_a", P.EXECUTION_PENDING, P.EXECUTION_IN_PROGRESS),
        StateView(created_workflow_state("wfx_a", P.EXECUTION_PENDING)),
    )
    await processor.process(
        phase_changed("wfx_b", P.EXECUTION_FAILED, P.EXECUTION_FAILED),
        StateView(created_workflow_state("wfx_b", P.EXECUTION_FAILED)),
    )
    await processor.process(
        phase_changed("wfx_p", P.EXECUTION_IN_PROGRESS, P.EXECUTION_PAUSED),
        StateView(created_workflow_state("wfx_p", P.EXECUTION_IN_PROGRESS)),
    )
    disabled = lane_processor(provisioner, enabled=False)
    await disabled.process(
        phase_changed("wfx_c", P.EXECUTION_IN_PROGRESS, P.EXECUTION_COMPLETED), ExplodingState()
    )
    assert provisioner.deprovisioned == []


async def test_terminal_observer_a_teardown_failure_is_logged_never_thrown_fire_and_forget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    provisioner = FakeProvisioner(deprovision_error=RuntimeError("api unreachable"))
    with caplog.at_level(logging.ERROR):
        processed = await lane_processor(provisioner).process(
            phase_changed("wfx_leak", P.EXECUTION_IN_PROGRESS, P.EXECUTION_FAILED),
            StateView(created_workflow_state("wfx_leak")),
        )
    assert "sandbox may be leaked" in caplog.text
    assert processed.outcome is not None
    (failed,) = processed.outcome.outputs
    assert isinstance(failed, outcomes_pb2.SandboxTeardownFailed) and failed.reason == "api unreachable"
    assert processed.outcome.state is not None and processed.outcome.state.phase == P.EXECUTION_FAILED


# --- deprovisionSessionSandboxBestEffort --------------------------------------------------------


def session_deleted(session_id: str) -> inputs_pb2.SessionDeleted:
    return inputs_pb2.SessionDeleted(meta=new_meta(), session_id=session_id)


async def test_deprovision_session_sandbox_best_effort_tears_down_through_the_lane_and_swallows_failures() -> (
    None
):
    ok = FakeProvisioner()
    await lane_processor(ok).process(session_deleted("ses_1"), StateView(None))
    assert ok.deprovisioned == [("session", "ses_1")]

    failing = FakeProvisioner(deprovision_error=RuntimeError("gone wrong"))
    processed = await lane_processor(failing).process(session_deleted("ses_2"), StateView(None))
    # Reaching here IS the assertion: the failure was swallowed (and recorded as an outcome).
    assert processed.outcome is not None
    assert isinstance(processed.outcome.outputs[0], outcomes_pb2.SandboxTeardownFailed)

    untouched = FakeProvisioner()
    await lane_processor(untouched, enabled=False).process(session_deleted("ses_3"), ExplodingState())
    assert untouched.deprovisioned == []


def test_fixture_configs_match_upstream_positional_shape() -> None:
    assert (
        AgentExecutionTemporalConfig(
            stigmer_queue="agent_execution_stigmer",
            runner_queue="stigmer_runner",
            activity_routing="session",
            default_execution_target="cloud",
        )
        == SESSION_ROUTING_CLOUD_DEFAULT
    )
