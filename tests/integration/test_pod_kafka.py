"""The pod end to end on a real Apache Kafka broker, with the real local-process driver.

Real protobuf events go to real topics; assertions read the outcome topic, the
compacted state topic and the dead-letter topic back, and check the runner
processes in /proc.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.partitioner import DefaultPartitioner

from consumers.ops.settings import load_settings
from consumers.runtime.kafka.topology import ensure_topics
from drivers.contract import SandboxEnvironment, SandboxProbeState, SandboxScope
from drivers.local_process import new_local_process_provisioner
from events.codec import encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2
from tests.support.barrier import barrier, read_settled
from tests.support.pod_harness import (
    PodProcess,
    latest_states,
    produce,
    produce_raw,
    read_topic,
    running_pod,
    unique_env,
)
from tests.support.proc_util import runner_pids

pytestmark = [pytest.mark.kafka, pytest.mark.usefixtures("no_leaked_runners")]


#: Ids are unique per run, so concurrent or earlier runs never see each other's processes.
RUN = uuid.uuid4().hex[:8]


def wf_created(
    execution_id: str, target: int = common_pb2.CLOUD, event_id: str | None = None
) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(event_id=event_id),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        workflow_execution_target=target,
        caller_identity_id="ida_test",  # type: ignore[arg-type]
    )


def agent_created(
    execution_id: str, session_id: str, target: int = common_pb2.CLOUD
) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id=execution_id,
        session_id=session_id,
        session_execution_target=target,
        caller_identity_id="ida_test",  # type: ignore[arg-type]
    )


def wf_phase(execution_id: str, previous: int, new: int, error: str = "") -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        previous_phase=previous,
        new_phase=new,
        error=error,  # type: ignore[arg-type]
    )


def outcome_types(records: list) -> list[str]:  # type: ignore[type-arg]
    return [type(r.message).__name__ for r in records]


async def gone(queue: str, timeout_s: float = 10.0) -> bool:
    """No runner process for ``queue`` any more (a torn-down runner may take a moment to be reaped)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while runner_pids(queue):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
async def test_end_to_end_both_lanes_with_real_runner_processes(
    kafka_bootstrap: str, tmp_path: Path, guarantee: str
) -> None:
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_PROCESSING_GUARANTEE=guarantee)
    topics = load_settings(env).topics
    async with running_pod(env):
        await produce(
            kafka_bootstrap,
            env,
            wf_created(f"wfx_e2e_{RUN}"),
            agent_created(f"axr_e2e_{RUN}", f"ses_e2e_{RUN}"),
        )
        provisioned = await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
        assert sorted(outcome_types(provisioned)) == ["SandboxProvisioned", "SandboxProvisioned"]
        by_scope = {r.message.sandbox.scope: r.message for r in provisioned}  # type: ignore[union-attr]
        wf = by_scope[common_pb2.SANDBOX_SCOPE_WORKFLOW]
        assert (wf.sandbox.task_queue, wf.sandbox.driver, wf.probe_state) == (
            f"wfexec:wfx_e2e_{RUN}",
            "local-process",
            "running",
        )
        assert by_scope[common_pb2.SANDBOX_SCOPE_SESSION].sandbox.task_queue == f"session:ses_e2e_{RUN}"
        assert (
            len(runner_pids(f"wfexec:wfx_e2e_{RUN}")) == 1 and len(runner_pids(f"session:ses_e2e_{RUN}")) == 1
        )

        await produce(
            kafka_bootstrap,
            env,
            wf_phase(f"wfx_e2e_{RUN}", common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_IN_PROGRESS),
            wf_phase(f"wfx_e2e_{RUN}", common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_COMPLETED),
            inputs_pb2.SessionDeleted(meta=new_meta(), session_id=f"ses_e2e_{RUN}"),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=4)
        await barrier(kafka_bootstrap, env)
        everything = await read_settled(kafka_bootstrap, topics.outcomes)
        assert sorted(outcome_types(everything)) == [
            "SandboxDeprovisioned",
            "SandboxDeprovisioned",
            "SandboxProvisioned",
            "SandboxProvisioned",
        ]
        assert await gone(f"wfexec:wfx_e2e_{RUN}") and await gone(f"session:ses_e2e_{RUN}")

    states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=5))
    wf_state = states[f"wfx_e2e_{RUN}"]
    assert wf_state.phase == common_pb2.EXECUTION_COMPLETED and wf_state.created
    assert [s.lifecycle for s in wf_state.sandboxes] == [state_pb2.SANDBOX_DEPROVISIONED]
    assert len(wf_state.applied_event_ids) == 3
    assert states[f"axr_e2e_{RUN}"].sandboxes[0].lifecycle == state_pb2.SANDBOX_PROVISIONED
    assert states[f"ses_e2e_{RUN}"].sandboxes[0].lifecycle == state_pb2.SANDBOX_DEPROVISIONED

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topics.state)])
        entries = {e[0]: e[1] for e in described.resources[0][4]}
        assert entries["cleanup.policy"] == "compact"
    finally:
        await admin.close()


async def test_provisioning_failures_on_a_real_driver_prestamp_and_refuse(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A runner command that does not exist: the session lane pre-stamps, the workflow lane refuses."""
    env = unique_env(kafka_bootstrap, tmp_path, STIGMER_SANDBOX_RUNNER_COMMAND="/nonexistent/stigmer-runner")
    topics = load_settings(env).topics
    async with running_pod(env):
        await produce(kafka_bootstrap, env, agent_created("axr_fail", "ses_fail"), wf_created("wfx_fail"))
        failed = await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
        by_scope = {r.message.sandbox.scope: r.message for r in failed}  # type: ignore[union-attr]
        session = by_scope[common_pb2.SANDBOX_SCOPE_SESSION]
        workflow = by_scope[common_pb2.SANDBOX_SCOPE_WORKFLOW]
        assert isinstance(session, outcomes_pb2.SandboxFailed) and not session.critical
        assert session.message.startswith("Sandbox provisioning failed: ") and session.reason
        assert isinstance(workflow, outcomes_pb2.SandboxFailed) and workflow.critical
        assert workflow.code == common_pb2.STATUS_CODE_UNAVAILABLE
        assert workflow.message == "failed to provision workflow sandbox"
        # The pod kept going: a later event is still processed; the refused create's terminal
        # phase tears nothing down (no sandbox ever existed).
        await produce(
            kafka_bootstrap,
            env,
            wf_phase("wfx_fail", common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_FAILED),
        )

        await barrier(kafka_bootstrap, env)
        assert len(await read_settled(kafka_bootstrap, topics.outcomes)) == 2
    states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=3))
    assert states["axr_fail"].status_error == session.message
    assert states["axr_fail"].phase == common_pb2.EXECUTION_PENDING
    refused = states["wfx_fail"]
    assert refused.refused and refused.refusal_reason == workflow.reason and refused.sandboxes
    assert refused.phase == common_pb2.EXECUTION_FAILED


async def test_a_redelivered_input_changes_nothing(kafka_bootstrap: str, tmp_path: Path) -> None:
    env = unique_env(kafka_bootstrap, tmp_path)
    topics = load_settings(env).topics
    real = new_local_process_provisioner(load_settings(env).driver, __import__("logging").getLogger("t"))
    calls: list[str] = []

    class Counting:
        """The real driver, counting ensures."""

        driver_name = "local-process"

        async def ensure(
            self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
        ) -> SandboxProbeState:
            calls.append(sandbox_id)
            return await real.ensure(scope, sandbox_id, env)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    created = wf_created(f"wfx_dup_{RUN}", event_id="fixed-event-id")
    async with running_pod(env, provisioner=Counting()):  # type: ignore[arg-type]
        await produce(kafka_bootstrap, env, created, created, created)
        await produce(kafka_bootstrap, env, wf_created(f"wfx_dup_{RUN}"))  # a second create under a new id
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
        await barrier(kafka_bootstrap, env)
        outcomes = await read_settled(kafka_bootstrap, topics.outcomes)
    assert outcome_types(outcomes) == ["SandboxProvisioned"]
    assert calls == [f"wfx_dup_{RUN}"]
    await real.deprovision("workflow", f"wfx_dup_{RUN}")


async def test_bad_input_goes_to_the_dead_letter_topic_with_its_reason_and_the_pod_keeps_going(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory")
    topics = load_settings(env).topics
    good = encode(wf_created("wfx_ok"))
    headers = list(good.headers)
    without_type = [h for h in headers if h[0] != "ce_type"]
    unknown_type = [h if h[0] != "ce_type" else ("ce_type", b"sandbox_lanes.v1.Mystery") for h in headers]
    async with running_pod(env) as composed:
        await produce_raw(
            kafka_bootstrap, topics.execution_created, b"\x08\xff\xff garbage", b"wfx_g", headers
        )
        await produce_raw(kafka_bootstrap, topics.execution_created, good.value, b"wfx_ok", unknown_type)
        await produce_raw(kafka_bootstrap, topics.execution_created, good.value, None, headers)
        await produce_raw(
            kafka_bootstrap, topics.execution_created, good.value + b"\x10\x63", b"wfx_ok", headers
        )
        # Without ce_type the topic says the type (issue 43): refused only for its missing event id.
        no_id = wf_created("wfx_ok", event_id="")
        no_id.meta.event_id = ""
        await produce_raw(
            kafka_bootstrap, topics.execution_created, no_id.SerializeToString(), b"wfx_ok", without_type
        )
        await produce(
            kafka_bootstrap,
            env,
            wf_phase("wfx_never", common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_COMPLETED),
        )
        await produce_raw(kafka_bootstrap, topics.execution_created, good.value, good.key, headers)
        await read_topic(kafka_bootstrap, topics.dead_letter, at_least=6)
        await barrier(kafka_bootstrap, env)
        outcomes = await read_settled(kafka_bootstrap, topics.outcomes)
        dead = await read_settled(kafka_bootstrap, topics.dead_letter)
        assert composed.pod.stats.dead_lettered == 6
    assert outcome_types(outcomes) == ["SandboxProvisioned"]
    reasons = [r.headers["dlq_reason"] for r in dead]
    assert len(reasons) == 6
    expected = [
        "payload does not decode",
        "unknown event type 'sandbox_lanes.v1.Mystery'",
        "missing record key",
        "unknown enum value 99 for field kind",
        "missing meta.event_id",
        "phase-changed for unknown execution 'wfx_never'",
    ]
    for reason, want in zip(sorted(reasons), sorted(expected), strict=True):
        assert want in reason, (reason, want)
    garbage = next(r for r in dead if "does not decode" in r.headers["dlq_reason"])
    assert garbage.value == b"\x08\xff\xff garbage"  # nothing is lost: the original bytes are kept
    assert (
        garbage.headers["dlq_source_topic"] == topics.execution_created
        and "dlq_source_offset" in garbage.headers
    )


async def test_a_killed_pod_restarts_recovers_state_from_the_compacted_topic_and_does_not_provision_twice(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(kafka_bootstrap, tmp_path)
    topics = load_settings(env).topics
    created = wf_created(f"wfx_crash_{RUN}", event_id="crash-create")
    first = PodProcess(env, tmp_path / "pod-1.log")
    first.start()
    await first.wait_for_log("state restored")
    await produce(kafka_bootstrap, env, created)
    provisioned = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
    assert outcome_types(provisioned) == ["SandboxProvisioned"]
    (runner,) = runner_pids(f"wfexec:wfx_crash_{RUN}")
    first.kill9()  # no shutdown path at all

    # The upstream producer retries the create; then the workflow runs to completion.
    await produce(
        kafka_bootstrap,
        env,
        created,
        wf_phase(f"wfx_crash_{RUN}", common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_IN_PROGRESS),
        wf_phase(f"wfx_crash_{RUN}", common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_COMPLETED),
    )
    second = PodProcess({**env, "SANDBOX_LANES_POD_ID": "pod-b"}, tmp_path / "pod-2.log")
    second.start()
    try:
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=2, timeout_s=60)
        await barrier(kafka_bootstrap, env)
        outcomes = await read_settled(kafka_bootstrap, topics.outcomes)
        assert outcome_types(outcomes) == ["SandboxProvisioned", "SandboxDeprovisioned"], (
            first.log()[-4000:] + "\n----\n" + second.log()[-4000:]
        )
        await second.wait_for_log("duplicate input ignored")
        assert '"keys": 1' in second.log() or '"keys": 1,' in second.log()
        assert await gone(f"wfexec:wfx_crash_{RUN}")  # the new pod found and ended the old pod's child
        assert (
            not Path(f"/proc/{runner}").exists() or "Z" in Path(f"/proc/{runner}/stat").read_text().split()[2]
        )
        dead = await read_settled(kafka_bootstrap, topics.dead_letter)
    finally:
        code, seconds = second.terminate()
    assert code == 0 and seconds < 30
    assert dead == []


async def test_a_recovered_workflow_gets_a_runner_again_through_kafka(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """FAILED tears the workflow's runner down; the recover (FAILED -> IN_PROGRESS) ensures it again,
    under the same deterministic name, with a real runner process; a terminal write re-sent under
    a new event id does not tear down twice."""
    env = unique_env(kafka_bootstrap, tmp_path)
    topics = load_settings(env).topics
    wf = f"wfx_recover_{RUN}"
    queue = f"wfexec:{wf}"
    async with running_pod(env):
        await produce(kafka_bootstrap, env, wf_created(wf))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
        assert len(runner_pids(queue)) == 1
        await produce(
            kafka_bootstrap,
            env,
            wf_phase(wf, common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_IN_PROGRESS),
            wf_phase(
                wf, common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_FAILED, error="step 3 failed"
            ),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
        assert runner_pids(queue) == []
        await produce(
            kafka_bootstrap, env, wf_phase(wf, common_pb2.EXECUTION_FAILED, common_pb2.EXECUTION_IN_PROGRESS)
        )
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=3)
        assert len(runner_pids(queue)) == 1
        states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=1))
        assert states[wf].phase == common_pb2.EXECUTION_IN_PROGRESS and states[wf].status_error == ""
        # The end, written twice (the second under a new id, as a retrying producer would).
        done = wf_phase(wf, common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_COMPLETED)
        await produce(
            kafka_bootstrap,
            env,
            done,
            wf_phase(wf, common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_COMPLETED),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=4)
        await barrier(kafka_bootstrap, env)
        outcomes = await read_settled(kafka_bootstrap, topics.outcomes)
    assert outcome_types(outcomes) == [
        "SandboxProvisioned",
        "SandboxDeprovisioned",
        "SandboxProvisioned",
        "SandboxDeprovisioned",
    ]
    assert len({r.message.sandbox.name for r in outcomes}) == 1  # type: ignore[union-attr]
    assert runner_pids(queue) == []


def _partition(key: str, partitions: int) -> int:
    """Where the producers' default partitioner puts a key (murmur2, as every Kafka client)."""
    return DefaultPartitioner()(key.encode(), list(range(partitions)), list(range(partitions)))


async def test_a_sessions_creates_and_its_delete_are_applied_in_order_through_kafka(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Spec 2.5: a create produced before its session's delete is applied before it (the pod
    reads a backlog of both topics); a create applied after the delete provisions nothing. The
    execution ids hash to another partition than the session id, as they did when creates were
    keyed by execution id (the re-provisioning bug); now they travel on the session's partition."""
    # Small fetches: the pod takes the backlog in many turns, so the delete (alone on its topic)
    # is fetched long before the create queued behind others on the execution-created partition.
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_MAX_BATCH="2")
    settings = load_settings(env)
    topics = settings.topics
    session = f"ses_order_{RUN}"
    home = _partition(session, settings.partitions)
    first, late = [
        e for e in (f"axr_order_{RUN}_{i}" for i in range(100)) if _partition(e, settings.partitions) != home
    ][:2]
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await ensure_topics(admin, topics, settings.partitions, settings.replication)
    finally:
        await admin.close()
    # A backlog (the pod is down): other executions' creates on the session's partition (local
    # workflows: state only), the create, then the delete, on separate topics.
    fillers = [
        wf_created(e, common_pb2.LOCAL)
        for e in (f"wfx_order_{RUN}_{i}" for i in range(800))
        if _partition(e, settings.partitions) == home
    ][:100]
    await produce(kafka_bootstrap, env, *fillers, agent_created(first, session))
    await produce(kafka_bootstrap, env, inputs_pb2.SessionDeleted(meta=new_meta(), session_id=session))
    queue = f"session:{session}"
    async with running_pod(env):
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
        assert sorted(outcome_types(outcomes)) == ["SandboxDeprovisioned", "SandboxProvisioned"]
        provisioned = next(r for r in outcomes if isinstance(r.message, outcomes_pb2.SandboxProvisioned))
        deprovisioned = next(r for r in outcomes if isinstance(r.message, outcomes_pb2.SandboxDeprovisioned))
        assert provisioned.message.sandbox.name == deprovisioned.message.sandbox.name  # type: ignore[union-attr]
        assert runner_pids(queue) == []
        # A create applied after the delete (the pod saw the delete): nothing provisioned.
        await produce(kafka_bootstrap, env, agent_created(late, session))
        await barrier(kafka_bootstrap, env)
        states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=1))
        outcomes = await read_settled(kafka_bootstrap, topics.outcomes)
        dead = await read_settled(kafka_bootstrap, topics.dead_letter)
        assert runner_pids(queue) == []
    assert len(outcomes) == 2
    assert states[late].created and states[late].refused
    assert states[late].refusal_reason == f"session '{session}' was deleted"
    assert states[session].session_deleted and not states[first].refused
    # Every input of the session's lane travelled on the session's partition.
    inputs = [
        *await read_topic(kafka_bootstrap, topics.execution_created, at_least=2 + len(fillers)),
        *await read_topic(kafka_bootstrap, topics.session_deleted, at_least=1),
    ]
    keyed = [(r.key, r.partition) for r in inputs if r.key in (session, first, late)]
    assert keyed == [(session, home)] * 3
    assert dead == []
