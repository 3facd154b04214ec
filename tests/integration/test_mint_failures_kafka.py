"""The three ways an operator's credential provider can fail its mint, through a real pod on a real
broker, with the provider loaded by its entry point (``sandbox_lanes.credentials``: the dev harness's
``test-capability``, in its failing mode): a mint that raises, one that returns a non-string, one that
never answers. Spec 3.1/3.3: a capability failure takes the step's failure posture — the session lane
pre-stamps ``Sandbox provisioning failed: <message>``, the workflow lane refuses with Unavailable —
and the driver is never called (no runner, no token).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from consumers.ops.settings import load_settings
from events.codec import new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2
from tests.support.barrier import barrier, read_settled
from tests.support.pod_harness import PodProcess, latest_states, produce, read_topic, unique_env, wf_terminal
from tests.support.proc_util import runner_pids

pytestmark = [pytest.mark.kafka, pytest.mark.usefixtures("no_leaked_runners")]

RUN = uuid.uuid4().hex[:8]
PREFIX = "Sandbox provisioning failed: "
#: The error after the prefix, per failure, as the pod reports it (the ensure bound is 2 s here).
FAILURES = {
    "mint_raises": "credential service unavailable",
    "mint_non_string": "the credential provider's mint_sandbox_credential returned int, not a string",
    "mint_hangs": "sandbox ensure timed out after 2s",
}


def agent(execution_id: str, session_id: str) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id=execution_id,
        session_id=session_id,
        session_execution_target=common_pb2.CLOUD,
        caller_identity_id="ida_mint",
    )


def workflow(execution_id: str) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        workflow_execution_target=common_pb2.CLOUD,
        caller_identity_id="ida_mint",
    )


@pytest.mark.timeout(180)
async def test_a_provider_that_raises_returns_a_non_string_or_hangs_fails_the_ensure_never_the_pod(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_LANES_CREDENTIAL_PROVIDER="test-capability",
        TEST_CAPABILITY_FAILURES="1",
        TEST_CAPABILITY_PREFIX="op-token",
        SANDBOX_LANES_ENSURE_TIMEOUT_S="2",
        SANDBOX_LANES_REAP_INTERVAL_S="0",
    )
    topics = load_settings(env).topics
    control = f"wfx_mint_ok_{RUN}"
    agents = {mode: (f"axr_{mode}_{RUN}", f"ses_{mode}_{RUN}") for mode in FAILURES}
    workflows = {mode: f"wfx_{mode}_{RUN}" for mode in FAILURES}
    pod = PodProcess(env, tmp_path / "pod.log")
    pod.start()
    try:
        await pod.wait_for_log("state restored")
        await produce(
            kafka_bootstrap,
            env,
            *(agent(e, s) for e, s in agents.values()),
            *(workflow(w) for w in workflows.values()),
            workflow(control),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=7, timeout_s=60)
        await barrier(kafka_bootstrap, env)
        outcomes = await read_settled(kafka_bootstrap, topics.outcomes)
        states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=7))
        # The provider works for everything else: the control got its runner with the provider's token.
        (pid,) = runner_pids(f"wfexec:{control}")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        failed_queues = [f"session:{s}" for _, s in agents.values()] + [
            f"wfexec:{w}" for w in workflows.values()
        ]
        runners_of_failed = {q: runner_pids(q) for q in failed_queues}
        await produce(kafka_bootstrap, env, wf_terminal(control))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=8)
        assert pod.proc is not None and pod.proc.poll() is None, "the pod stopped"
    finally:
        code, _ = await asyncio.to_thread(pod.terminate)
    assert code == 0, pod.log()[-3000:]
    assert "test capability provider loaded" in pod.log()
    assert f"STIGMER_TOKEN=op-token-workflow-{control}".encode() in environ
    assert runners_of_failed == {q: [] for q in failed_queues}  # the driver was never called

    by_execution = {o.message.execution_id: o.message for o in outcomes}  # type: ignore[union-attr]
    assert len(outcomes) == 7 and set(by_execution) == {
        control,
        *workflows.values(),
        *(e for e, _ in agents.values()),
    }
    assert isinstance(by_execution[control], outcomes_pb2.SandboxProvisioned)
    assert by_execution[control].token_minted
    for mode, error in FAILURES.items():
        execution, session = agents[mode]
        session_failed = by_execution[execution]
        assert isinstance(session_failed, outcomes_pb2.SandboxFailed), mode
        assert (session_failed.reason, session_failed.message, session_failed.critical) == (
            error,
            PREFIX + error,
            False,
        )
        assert session_failed.sandbox.task_queue == f"session:{session}"
        assert states[execution].status_error == PREFIX + error
        assert states[execution].phase == common_pb2.EXECUTION_PENDING  # the pre-stamp never moves the phase
        refused = by_execution[workflows[mode]]
        assert isinstance(refused, outcomes_pb2.SandboxFailed), mode
        assert (refused.reason, refused.message, refused.critical, refused.code) == (
            error,
            "failed to provision workflow sandbox",
            True,
            common_pb2.STATUS_CODE_UNAVAILABLE,
        )
        wf_state = states[workflows[mode]]
        assert wf_state.refused and wf_state.refusal_reason == error and wf_state.status_error == ""
    assert "op-token-" not in pod.log()  # tokens never reach the log
