"""The agent-sandbox driver on the real node with the real kubernetes-sigs/agent-sandbox controller.

Upstream's driver.test.ts pins the arms against a fake gateway; here each arm runs against the
controller: the runner pod comes up with its environment (read inside the pod), suspend removes the
pod and keeps the session's workspace claim, a wake brings it back with the file kept, and
deprovision leaves nothing. The idle sweep runs in the pod, through Kafka, judging the session by
the pod's own state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from harness.agent_sandbox import AgentSandboxController
from harness.kube_apiserver import KubeApiServer
from harness.kube_node import RUNNER_IMAGE, KubeNode
from kubernetes import client
from prometheus_client import CollectorRegistry

from consumers.ops.driver_background import start_driver_background
from consumers.ops.reaper import start_periodic_reaper
from consumers.ops.settings import load_settings
from drivers.agent_sandbox.driver import (
    LOG_ENSURED,
    LOG_LEFT_ALONE,
    NOT_INSTALLED,
    AgentSandboxProvisioner,
    new_agent_sandbox_provisioner,
)
from drivers.agent_sandbox.idle import SessionActivity
from drivers.agent_sandbox.manifests import GROUP, PLURAL, VERSION, sandbox_manifest, workspace_claim_name
from drivers.agent_sandbox.warm_pool import WARM_STEPS
from drivers.contract import SandboxCollision, SandboxEnvironment, SandboxError
from drivers.kubernetes.manifests import secret_name
from drivers.naming import sandbox_base_name
from events.codec import new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2
from tests.integration.test_kubernetes_node import (
    SMALL_RUNNER,
    env_inside,
    gone,
    node_driver_config,
    pod_exec,
    runner_pods,
    running_runner_pod,
    wait_for,
)
from tests.integration.test_pod_drivers_e2e import TOKEN_KEY
from tests.integration.test_pod_kafka import agent_created
from tests.integration.test_replay import replay_cli
from tests.support.collisions import FIRST, SECOND, assert_collide
from tests.support.pod_harness import produce, read_topic, running_pod, unique_env

pytestmark = pytest.mark.kubernetes

LOG = logging.getLogger("test.agent_sandbox")


@pytest.fixture
async def as_driver(
    kube_node: KubeNode, agent_sandbox: AgentSandboxController, node_namespace: str
) -> AsyncIterator[AgentSandboxProvisioner]:
    p = new_agent_sandbox_provisioner(node_driver_config(node_namespace, kube_node.kubeconfig_path), LOG)
    try:
        yield p
    finally:
        await p.close()


def _sandbox(custom: Any, ns: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    return obj


def _json_patch(custom: Any, ns: str, name: str, ops: list[dict[str, Any]]) -> None:
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, name, ops, _content_type="application/json-patch+json"
    )


def runner_process_env(core: Any, ns: str, pod: str) -> dict[str, str]:
    """The runner's own environment (PID 1's): what a warm runner exported from its assignment."""
    out = pod_exec(core, ns, pod, ["/bin/sh", "-c", "tr '\\0' '\\n' < /proc/1/environ"])
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _arms(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.__dict__["arm"] for r in caplog.records if r.getMessage() == LOG_ENSURED]


async def test_the_ensure_arms_on_the_real_controller_keep_the_session_workspace(
    kube_node: KubeNode,
    node_admin: Any,
    node_namespace: str,
    as_driver: AgentSandboxProvisioner,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="test.agent_sandbox")
    core, custom = client.CoreV1Api(node_admin), client.CustomObjectsApi(node_admin)
    ns, session = node_namespace, f"ses_as_{uuid.uuid4().hex[:8]}"
    base = sandbox_base_name("session", session)
    first = SandboxEnvironment(task_queue=f"session:{session}", stigmer_token="tok.first.value")

    # absent: created Suspended, its Secret owned by it, then woken.
    started = time.monotonic()
    assert await as_driver.ensure("session", session, first) == "running"
    pod = await wait_for("the runner pod", lambda: running_runner_pod(core, ns, session))
    LOG.info("agent-sandbox ensure -> runner pod Running in %.2fs", time.monotonic() - started)
    sandbox = _sandbox(custom, ns, base)
    assert sandbox["spec"]["operatingMode"] == "Running"
    secret = core.read_namespaced_secret(secret_name(base), ns)
    assert [(o.kind, o.name, o.uid) for o in secret.metadata.owner_references] == [
        ("Sandbox", base, sandbox["metadata"]["uid"])
    ]
    inside = env_inside(core, ns, pod.metadata.name)
    assert inside["STIGMER_TOKEN"] == "tok.first.value"
    assert inside["STIGMER_TASK_QUEUE"] == f"session:{session}"
    assert inside["STIGMER_TEMPORAL_API_KEY"] == "temporal-node-key"
    assert inside["ANTHROPIC_API_KEY"] == "sk-ant-node-secret"
    assert inside["STIGMER_BACKEND_ENDPOINT"] == "http://127.0.0.1:7234"
    claim = core.read_namespaced_persistent_volume_claim(workspace_claim_name(base), ns)
    pod_exec(core, ns, pod.metadata.name, ["/bin/sh", "-c", "echo kept > /workspace/marker"])
    assert await as_driver.probe("session", session) == "running"

    # Running: only the Secret is rewritten; the pod keeps running with the token it booted with.
    # The Sandbox's spec is untouched (same generation) and the controller has reconciled that
    # generation, so no replacement of the pod is under way when it is checked.
    generation = sandbox["metadata"]["generation"]
    second = SandboxEnvironment(task_queue=f"session:{session}", stigmer_token="tok.second.value")
    assert await as_driver.ensure("session", session, second) == "running"
    assert _sandbox(custom, ns, base)["metadata"]["generation"] == generation
    await wait_for(
        "the controller to have reconciled the Sandbox's generation",
        lambda: any(
            c.get("observedGeneration") == generation
            for c in (_sandbox(custom, ns, base).get("status") or {}).get("conditions") or []
        ),
    )
    same = running_runner_pod(core, ns, session)
    assert same is not None and same.metadata.uid == pod.metadata.uid
    assert env_inside(core, ns, same.metadata.name)["STIGMER_TOKEN"] == "tok.first.value"

    # Suspended (as the idle sweep leaves it): no pod, the claim stays Bound.
    _json_patch(custom, ns, base, [{"op": "add", "path": "/spec/operatingMode", "value": "Suspended"}])
    await wait_for("the suspended pod to go", lambda: not runner_pods(core, ns, session), timeout=90)
    assert await as_driver.probe("session", session) == "stopped"
    assert core.read_namespaced_persistent_volume_claim(claim.metadata.name, ns).status.phase == "Bound"

    # Suspended -> ensure: a fresh token in the Secret, woken with this server's template, file kept.
    third = SandboxEnvironment(task_queue=f"session:{session}", stigmer_token="tok.third.value")
    assert await as_driver.ensure("session", session, third) == "running"
    woken = await wait_for("the woken runner pod", lambda: running_runner_pod(core, ns, session))
    assert env_inside(core, ns, woken.metadata.name)["STIGMER_TOKEN"] == "tok.third.value"
    assert pod_exec(core, ns, woken.metadata.name, ["/bin/cat", "/workspace/marker"]).strip() == "kept"
    assert _arms(caplog) == ["created", "running", "suspended"]

    # deprovision: a foreground delete; the pod, the Secret and the claim go with the Sandbox.
    await as_driver.deprovision("session", session)
    assert await as_driver.probe("session", session) == "absent"
    for what, read in (
        ("the Sandbox", lambda: _sandbox(custom, ns, base)),
        ("the Secret", lambda: core.read_namespaced_secret(secret_name(base), ns)),
        ("the claim", lambda: core.read_namespaced_persistent_volume_claim(claim.metadata.name, ns)),
    ):
        await wait_for(f"{what} to be deleted", lambda read=read: gone(read), timeout=90)
    await wait_for("the runner pod to go", lambda: not runner_pods(core, ns, session), timeout=90)
    await as_driver.deprovision("session", session)  # missing is success


async def test_a_sandbox_being_deleted_is_waited_out_then_created_again(
    node_admin: Any, node_namespace: str, as_driver: AgentSandboxProvisioner, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="test.agent_sandbox")
    core, custom = client.CoreV1Api(node_admin), client.CustomObjectsApi(node_admin)
    ns, execution = node_namespace, f"wfx_as_{uuid.uuid4().hex[:8]}"
    base = sandbox_base_name("workflow", execution)
    env = SandboxEnvironment(task_queue=f"wfexec:{execution}")
    await as_driver.ensure("workflow", execution, env)
    first_uid = _sandbox(custom, ns, base)["metadata"]["uid"]
    # A finalizer holds the Sandbox in "being deleted" until the test lets go of it.
    _json_patch(custom, ns, base, [{"op": "add", "path": "/metadata/finalizers", "value": ["test/hold"]}])
    custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, base)
    assert await as_driver.probe("workflow", execution) == "absent"  # being deleted counts as absent
    as_driver.delete_poll_seconds = 0.2
    # Count the driver's reads that found the Sandbox still being deleted: the ensure is known to
    # be waiting once it has read it so twice (it polls), and then must not have returned.
    read_sandbox, deleting_reads = as_driver.read_sandbox, [0]

    async def counted_read(name: str) -> dict[str, Any] | None:
        obj = await read_sandbox(name)
        if obj is not None and (obj.get("metadata") or {}).get("deletionTimestamp"):
            deleting_reads[0] += 1
        return obj

    as_driver.read_sandbox = counted_read  # type: ignore[method-assign]
    ensuring = asyncio.create_task(as_driver.ensure("workflow", execution, env))
    deadline = time.monotonic() + 30
    while deleting_reads[0] < 2 and not ensuring.done():
        assert time.monotonic() < deadline, "the ensure never read the Sandbox being deleted twice"
        await asyncio.sleep(0.05)
    assert not ensuring.done(), "the ensure did not wait for the deletion"
    as_driver.read_sandbox = read_sandbox  # type: ignore[method-assign]
    _json_patch(custom, ns, base, [{"op": "remove", "path": "/metadata/finalizers"}])
    assert await asyncio.wait_for(ensuring, 60) == "running"
    again = _sandbox(custom, ns, base)
    assert again["metadata"]["uid"] != first_uid and again["spec"]["operatingMode"] == "Running"
    await wait_for("the new runner pod", lambda: running_runner_pod(core, ns, execution))
    assert _arms(caplog) == ["created", "created"]
    await as_driver.deprovision("workflow", execution)

    # One that is never let go fails after the polls, with the reason.
    await as_driver.ensure("workflow", execution, env)  # waits out the deprovision, then creates
    _json_patch(custom, ns, base, [{"op": "add", "path": "/metadata/finalizers", "value": ["test/hold"]}])
    custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, base)
    as_driver.delete_polls = 3
    with pytest.raises(SandboxError, match=f"{base} is still being deleted after"):
        await as_driver.ensure("workflow", execution, env)
    _json_patch(custom, ns, base, [{"op": "remove", "path": "/metadata/finalizers"}])


def _held(core: Any, custom: Any, ns: str, base: str) -> dict[str, Any]:
    """What the second id must never change: the Sandbox's identity, labels and spec, its Secret."""
    sandbox = _sandbox(custom, ns, base)
    secret = core.read_namespaced_secret(secret_name(base), ns)
    return {
        "uid": sandbox["metadata"]["uid"],
        "labels": sandbox["metadata"]["labels"],
        "deleting": sandbox["metadata"].get("deletionTimestamp"),
        "spec": sandbox["spec"],
        "secret": (
            secret.metadata.uid,
            secret.metadata.resource_version,
            secret.metadata.labels,
            secret.data,
        ),
    }


async def test_colliding_ids_never_touch_each_others_sandbox(
    node_admin: Any, node_namespace: str, as_driver: AgentSandboxProvisioner, caplog: pytest.LogCaptureFixture
) -> None:
    """Two real ids with one sandbox name on the real controller: the second's ensure fails naming
    the first's Sandbox (running or suspended: never woken, its Secret never written), and the
    second's deprovision leaves it and its pod alone."""
    caplog.set_level(logging.INFO, logger="test.agent_sandbox")
    core, custom = client.CoreV1Api(node_admin), client.CustomObjectsApi(node_admin)
    ns, base = node_namespace, assert_collide("workflow")
    first_env = SandboxEnvironment(task_queue=f"wfexec:{FIRST}", stigmer_token="tok.first.value")
    second_env = SandboxEnvironment(task_queue=f"wfexec:{SECOND}", stigmer_token="tok.second.value")
    collision = (
        f"agent-sandbox sandbox name collision: Sandbox {ns}/{base} belongs to workflow '{FIRST}', not to "
        f"workflow '{SECOND}' (both map to the name {base}); the Sandbox was left untouched"
    )

    await as_driver.ensure("workflow", FIRST, first_env)
    pod = await wait_for("the first's runner pod", lambda: running_runner_pod(core, ns, FIRST))
    held = _held(core, custom, ns, base)

    # Running: no token written into its Secret.
    with pytest.raises(SandboxCollision) as err:
        await as_driver.ensure("workflow", SECOND, second_env)
    assert str(err.value) == collision
    assert _held(core, custom, ns, base) == held
    assert env_inside(core, ns, pod.metadata.name)["STIGMER_TOKEN"] == "tok.first.value"
    assert await as_driver.probe("workflow", SECOND) == "absent"
    assert await as_driver.probe("workflow", FIRST) == "running"

    # Suspended: not woken onto the second's queue.
    _json_patch(custom, ns, base, [{"op": "add", "path": "/spec/operatingMode", "value": "Suspended"}])
    await wait_for("the pod to go", lambda: not runner_pods(core, ns, FIRST))
    suspended = _held(core, custom, ns, base)
    with pytest.raises(SandboxCollision) as err:
        await as_driver.ensure("workflow", SECOND, second_env)
    assert str(err.value) == collision
    assert _held(core, custom, ns, base) == suspended  # still Suspended: the controller starts nothing
    assert runner_pods(core, ns, FIRST) == [] and runner_pods(core, ns, SECOND) == []
    await as_driver.ensure("workflow", FIRST, first_env)  # the first's own ensure wakes it
    pod = await wait_for("the first's pod again", lambda: running_runner_pod(core, ns, FIRST))
    held = _held(core, custom, ns, base)

    # The second's deprovision: nothing of the first's is deleted.
    await as_driver.deprovision("workflow", SECOND)
    left = [
        r.__dict__["leftAlone"] for r in caplog.records if r.getMessage() == f"agent-sandbox {LOG_LEFT_ALONE}"
    ]
    assert left == [f"Sandbox {ns}/{base} (owned by workflow '{FIRST}')"]
    assert _held(core, custom, ns, base) == held  # no deletionTimestamp: a foreground delete sets it at once
    assert running_runner_pod(core, ns, FIRST).metadata.uid == pod.metadata.uid

    # The first's deprovision: gone.
    await as_driver.deprovision("workflow", FIRST)
    await wait_for("the Sandbox to go", lambda: gone(lambda: _sandbox(custom, ns, base)))
    await wait_for(
        "its Secret to go", lambda: gone(lambda: core.read_namespaced_secret(secret_name(base), ns))
    )
    await wait_for("its pod to go", lambda: not runner_pods(core, ns, FIRST))
    assert await as_driver.probe("workflow", FIRST) == "absent"

    # A Secret of the first's left without its Sandbox (orphaned): the second's token is not written
    # into it; the second's own Suspended Sandbox is its own to deprovision.
    await as_driver.ensure("workflow", FIRST, first_env)
    orphan = core.read_namespaced_secret(secret_name(base), ns)
    custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, base, propagation_policy="Orphan")
    await wait_for("the first's Sandbox to go", lambda: gone(lambda: _sandbox(custom, ns, base)))
    with pytest.raises(SandboxCollision) as err:
        await as_driver.ensure("workflow", SECOND, second_env)
    assert str(err.value) == (
        f"agent-sandbox sandbox name collision: Secret {ns}/{secret_name(base)} belongs to workflow "
        f"'{FIRST}', not to workflow '{SECOND}' (both map to the name {base}); the Secret was left untouched"
    )
    kept = core.read_namespaced_secret(secret_name(base), ns)
    assert (kept.metadata.uid, kept.data) == (orphan.metadata.uid, orphan.data)
    assert _sandbox(custom, ns, base)["metadata"]["labels"]["stigmer.ai/sandbox-id"] == SECOND
    assert _sandbox(custom, ns, base)["spec"]["operatingMode"] == "Suspended", "never woken"
    await as_driver.deprovision("workflow", SECOND)
    await wait_for("the second's Sandbox to go", lambda: gone(lambda: _sandbox(custom, ns, base)))
    assert core.read_namespaced_secret(secret_name(base), ns).metadata.uid == orphan.metadata.uid
    core.delete_namespaced_secret(secret_name(base), ns)


async def test_without_the_agent_sandbox_api_the_create_says_to_install_it(
    kube_apiserver: KubeApiServer, kube_namespace: str
) -> None:
    driver = new_agent_sandbox_provisioner(
        node_driver_config(kube_namespace, kube_apiserver.kubeconfig_path), LOG
    )
    try:
        with pytest.raises(SandboxError) as err:
            await driver.ensure("session", "ses_none", SandboxEnvironment(task_queue="session:ses_none"))
        assert NOT_INSTALLED in str(err.value)
    finally:
        await driver.close()


def agent_completed(execution_id: str, session_id: str) -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id=execution_id,
        session_id=session_id,
        previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
        new_phase=common_pb2.EXECUTION_COMPLETED,
    )


@pytest.mark.kafka
async def test_the_pods_idle_sweep_suspends_an_idle_session_and_the_next_execution_wakes_it(
    kafka_bootstrap: str,
    kube_node: KubeNode,
    agent_sandbox: AgentSandboxController,
    node_admin: Any,
    node_namespace: str,
    tmp_path: Path,
) -> None:
    core, custom = client.CoreV1Api(node_admin), client.CustomObjectsApi(node_admin)
    ns, session = node_namespace, f"ses_idle_{uuid.uuid4().hex[:8]}"
    base = sandbox_base_name("session", session)
    options = ",".join(
        f"{k}={v}" for k, v in {"kubeconfig": str(kube_node.kubeconfig_path), **SMALL_RUNNER}.items()
    )
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="agent-sandbox",
        SANDBOX_LANES_DRIVER_OPTIONS=options,
        STIGMER_SANDBOX_K8S_NAMESPACE=ns,
        STIGMER_SANDBOX_RUNNER_IMAGE=RUNNER_IMAGE,
        STIGMER_SANDBOX_BACKEND_ENDPOINT="http://127.0.0.1:7234",
        STIGMER_SANDBOX_TEMPORAL_ADDRESS="127.0.0.1:7233",
        STIGMER_RUNNER_TOKEN_KEY=TOKEN_KEY,
        STIGMER_SANDBOX_AGENT_SANDBOX_SUSPEND_AFTER_SECONDS="3",
        STIGMER_SANDBOX_AGENT_SANDBOX_SWEEP_INTERVAL_SECONDS="1",
        SANDBOX_LANES_REAP_INTERVAL_S="0.5",
        SANDBOX_LANES_REAP_GRACE_S="1",
    )
    settings = load_settings(env)
    topics = settings.topics
    # A Sandbox left behind by a crashed pod of this installation (the pod's, from its group): our
    # labels, no execution state.
    orphan = f"wfx_as_orphan_{uuid.uuid4().hex[:8]}"
    installation = settings.driver.installation
    leaker = new_agent_sandbox_provisioner(
        replace(node_driver_config(ns, kube_node.kubeconfig_path), installation=installation), LOG
    )
    await leaker.ensure("workflow", orphan, SandboxEnvironment(task_queue=f"wfexec:{orphan}"))
    await leaker.close()
    async with running_pod(env) as composed:
        # When each idle-sweep pass started and ended (the driver's own sweep, counted here).
        driver: Any = composed.provisioner
        sweep_once, sweeps = driver.sweep_once, []

        async def counted_sweep(*args: Any, **kwargs: Any) -> int:
            started = time.monotonic()
            try:
                suspended: int = await sweep_once(*args, **kwargs)
                return suspended
            finally:
                sweeps.append((started, time.monotonic()))

        driver.sweep_once = counted_sweep
        assert start_driver_background(composed) is not None
        first = f"axr_idle_{uuid.uuid4().hex[:8]}"
        await produce(kafka_bootstrap, env, agent_created(first, session))
        (provisioned,) = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
        provisioned_at = time.monotonic()
        assert isinstance(provisioned.message, outcomes_pb2.SandboxProvisioned), provisioned.message
        assert provisioned.message.sandbox.driver == "agent-sandbox"
        pod = await wait_for("the session's runner pod", lambda: running_runner_pod(core, ns, session))
        assert env_inside(core, ns, pod.metadata.name)["STIGMER_TOKEN"].count(".") == 2
        pod_exec(core, ns, pod.metadata.name, ["/bin/sh", "-c", "echo kept > /workspace/marker"])

        # The reaper knows the Sandbox type: the orphan goes, the live session's Sandbox stays.
        assert start_periodic_reaper(settings, composed) is not None
        orphan_base = sandbox_base_name("workflow", orphan)
        await wait_for(
            "the reaper to remove the orphan", lambda: gone(lambda: _sandbox(custom, ns, orphan_base))
        )

        # Busy: the execution runs, so the sweep leaves the session alone past the window. A
        # positive barrier first: a whole sweep pass that started once the 3 s window since the
        # session's last activity (at the latest, its provisioning) had passed, and one more.
        window_over = provisioned_at + 3 + 0.5
        await wait_for(
            "two sweep passes started past the idle window",
            lambda: sum(1 for started, _ in sweeps if started > window_over) >= 2,
        )
        assert _sandbox(custom, ns, base)["spec"]["operatingMode"] == "Running"

        # Idle: the execution completed; after the window the sweep suspends (never deletes).
        done_at = time.monotonic()
        await produce(kafka_bootstrap, env, agent_completed(first, session))
        await wait_for(
            "the sweep to suspend the idle session",
            lambda: _sandbox(custom, ns, base)["spec"]["operatingMode"] == "Suspended",
            timeout=60,
        )
        assert time.monotonic() - done_at >= 3 - 0.5  # not before the window (the clock is the state's stamp)
        await wait_for("the suspended pod to go", lambda: not runner_pods(core, ns, session), timeout=90)
        claim = core.read_namespaced_persistent_volume_claim(workspace_claim_name(base), ns)
        assert claim.status.phase == "Bound"

        # The session's next execution wakes the same Sandbox, workspace kept.
        uid = _sandbox(custom, ns, base)["metadata"]["uid"]
        second = f"axr_idle_{uuid.uuid4().hex[:8]}"
        await produce(kafka_bootstrap, env, agent_created(second, session))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
        woken = await wait_for("the woken runner pod", lambda: running_runner_pod(core, ns, session))
        assert _sandbox(custom, ns, base)["metadata"]["uid"] == uid
        assert pod_exec(core, ns, woken.metadata.name, ["/bin/cat", "/workspace/marker"]).strip() == "kept"

        # The session deleted: deprovisioned, nothing left.
        await produce(kafka_bootstrap, env, inputs_pb2.SessionDeleted(meta=new_meta(), session_id=session))
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=4)
        # Across partitions the read order is the fetch order: compare the session's own sequence.
        of_session = [type(o.message).__name__ for o in outcomes if o.message.sandbox.sandbox_id == session]
        assert of_session == ["SandboxProvisioned", "SandboxProvisioned", "SandboxDeprovisioned"], of_session
        reaped = [o.message for o in outcomes if isinstance(o.message, outcomes_pb2.SandboxReaped)]
        assert [r.sandbox.sandbox_id for r in reaped] == [orphan]
    await wait_for("the Sandbox to go", lambda: gone(lambda: _sandbox(custom, ns, base)), timeout=90)
    await wait_for("the runner pod to go", lambda: not runner_pods(core, ns, session), timeout=90)
    # Replay knows the type too: every recorded decision re-derived, no driver built.
    replayed = replay_cli(env, "--from-beginning")
    assert replayed.returncode == 0 and "no divergence" in replayed.stdout, replayed.stdout + replayed.stderr


async def pool_ready(driver: AgentSandboxProvisioner, replicas: int, timeout: float = 90) -> None:
    assert driver.warm is not None
    deadline = time.monotonic() + timeout
    while (ready := await driver.warm.ready_replicas()) != replicas:
        assert time.monotonic() < deadline, f"the pool has {ready} ready, not {replicas}"
        await asyncio.sleep(0.1)


def _claim(custom: Any, ns: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = custom.get_namespaced_custom_object(
        "extensions.agents.x-k8s.io", "v1beta1", ns, "sandboxclaims", name
    )
    return obj


async def test_a_warm_claim_adopts_a_running_pool_sandbox_and_hands_it_the_secrets_out_of_band(
    kube_node: KubeNode,
    agent_sandbox: AgentSandboxController,
    node_admin: Any,
    node_namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="test.agent_sandbox")
    core, custom = client.CoreV1Api(node_admin), client.CustomObjectsApi(node_admin)
    ns = node_namespace
    driver = new_agent_sandbox_provisioner(
        node_driver_config(
            ns,
            kube_node.kubeconfig_path,
            warm_pool_size="2",
            warm_adopt_timeout_seconds="10",
            warm_assignment="sync",
        ),
        LOG,
    )
    assert driver.warm is not None
    try:
        await driver.warm.prepare()
        await pool_ready(driver, 2)

        execution = f"wfx_warm_{uuid.uuid4().hex[:8]}"
        base = sandbox_base_name("workflow", execution)
        token = "tok.warm.secret"
        started = time.monotonic()
        assert (
            await driver.ensure("workflow", execution, SandboxEnvironment(f"wfexec:{execution}", token))
            == "running"
        )
        took = time.monotonic() - started
        LOG.info("warm ensure (claim Ready + secrets delivered) in %.3fs", took)
        assert _arms(caplog) == ["warm"]
        claim = _claim(custom, ns, base)
        adopted = claim["status"]["sandbox"]["name"]
        assert adopted != base  # the pool's sandbox, adopted under its own name
        sandbox = _sandbox(custom, ns, adopted)
        assert sandbox["metadata"]["labels"]["agents.x-k8s.io/launch-type"] == "warm"

        # The runner started with its assignment: the queue from the annotation, the secrets from exec.
        started_env = await wait_for(
            "the runner to start", lambda: runner_process_env(core, ns, adopted).get("STIGMER_TOKEN")
        )
        assert started_env == token
        inside = runner_process_env(core, ns, adopted)
        assert inside["STIGMER_TASK_QUEUE"] == f"wfexec:{execution}"
        assert inside["ANTHROPIC_API_KEY"] == "sk-ant-node-secret"
        assert inside["STIGMER_TEMPORAL_API_KEY"] == "temporal-node-key"
        assert "runner stand-in up" in core.read_namespaced_pod_log(adopted, ns, container="runner")
        # ... and the secrets are in no API object: not the claim, the Sandbox, the pod or an event.
        pod = core.read_namespaced_pod(adopted, ns)
        visible = str(claim) + str(_sandbox(custom, ns, adopted)) + str(pod.to_dict())
        visible += str(core.list_namespaced_event(ns).to_dict())
        for secret in (token, "sk-ant-node-secret", "temporal-node-key"):
            assert secret not in visible
        mode = pod_exec(core, ns, adopted, ["/bin/stat", "-c", "%a", "/run/stigmer/assignment.env"]).strip()
        assert mode == "600"

        assert await driver.probe("workflow", execution) == "running"
        assert await driver.ensure("workflow", execution, SandboxEnvironment(f"wfexec:{execution}", token))
        assert _arms(caplog) == ["warm", "claimed"]
        assert {m.sandbox_id for m in await driver.list_managed()} == {execution}
        refill_from = time.monotonic()
        await wait_for(
            "the pool to refill", lambda: asyncio.run(driver.warm.ready_replicas()) == 2, timeout=90
        )
        LOG.info("pool refilled in %.2fs", time.monotonic() - refill_from)

        await driver.deprovision("workflow", execution)
        await wait_for("the claim to go", lambda: gone(lambda: _claim(custom, ns, base)), timeout=90)
        await wait_for(
            "the adopted Sandbox to go", lambda: gone(lambda: _sandbox(custom, ns, adopted)), timeout=90
        )
        assert await driver.probe("workflow", execution) == "absent"

        # An adoption miss (a claim not Ready in time) falls back to a cold Sandbox of its own.
        driver.warm.adopt_timeout_s = 0.0  # no wait at all: a miss whatever the node's speed
        missed = f"wfx_miss_{uuid.uuid4().hex[:8]}"
        await driver.ensure("workflow", missed, SandboxEnvironment(f"wfexec:{missed}", token))
        assert _arms(caplog)[-1] == "created"
        assert driver.warm.metrics.misses.labels("not ready in time")._value.get() == 1
        miss_base = sandbox_base_name("workflow", missed)
        await wait_for(
            "the missed claim to go", lambda: gone(lambda: _claim(custom, ns, miss_base)), timeout=90
        )
        await wait_for("the cold runner", lambda: running_runner_pod(core, ns, missed))
        await driver.deprovision("workflow", missed)
    finally:
        await driver.close()


async def test_async_warm_assignment_returns_once_claimed_and_a_restarted_driver_delivers_the_kept_secrets(
    kube_node: KubeNode,
    agent_sandbox: AgentSandboxController,
    node_admin: Any,
    node_namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="test.agent_sandbox")
    core, custom = client.CoreV1Api(node_admin), client.CustomObjectsApi(node_admin)
    ns = node_namespace
    config = node_driver_config(ns, kube_node.kubeconfig_path, warm_pool_size="2")  # async: the default
    driver = new_agent_sandbox_provisioner(config, LOG)
    metrics = CollectorRegistry()  # the pool's metrics, as the pod binds them for /metrics
    driver.bind_metrics(metrics)
    restarted_driver: AgentSandboxProvisioner | None = None
    assert driver.warm is not None and driver.warm.assignment == "async"

    def launches(registry: CollectorRegistry, launch_type: str) -> float | None:
        return registry.get_sample_value(
            "sandbox_lanes_agent_sandbox_time_to_sandbox_seconds_count", {"launch_type": launch_type}
        )

    def annotations(name: str) -> dict[str, str]:
        found: dict[str, str] = _claim(custom, ns, name)["metadata"].get("annotations") or {}
        return found

    try:
        await driver.warm.prepare()
        await pool_ready(driver, 2)

        await wait_for("the claim watch", lambda: driver.warm.watching)  # its deliveries wait on it
        # an assignment session opened ahead in each idle pod of the pool
        await wait_for("the assignment sessions", lambda: driver.warm.sessions_open == 2)
        # 1. The ensure returns once the claim and its kept assignment exist; the delivery follows.
        timelines: dict[str, dict[str, float]] = {}
        driver.warm.on_timeline = timelines.__setitem__
        execution = f"wfx_async_{uuid.uuid4().hex[:8]}"
        base = sandbox_base_name("workflow", execution)
        token = "tok.async.secret"
        started = time.monotonic()
        assert (
            await driver.ensure("workflow", execution, SandboxEnvironment(f"wfexec:{execution}", token))
            == "running"
        )
        LOG.info("async warm ensure returned in %.3fs", time.monotonic() - started)
        assert _arms(caplog) == ["warm-claimed"]
        claim = _claim(custom, ns, base)
        kept = core.read_namespaced_secret(secret_name(base), ns)
        owner = kept.metadata.owner_references[0]
        assert (owner.kind, owner.name, owner.uid) == ("SandboxClaim", base, claim["metadata"]["uid"])
        await driver.warm.settled()
        assert annotations(base).get("stigmer.ai/assigned") == "true"
        assert launches(metrics, "warm") == 1 and launches(metrics, "cold") is None  # one launch, timed
        # ... through the session opened ahead in the pod the claim names (no exec of its own)
        assert (
            metrics.get_sample_value(
                "sandbox_lanes_agent_sandbox_assignment_handovers_total", {"via": "session"}
            )
            == 1
        )
        # ... step by step: every step reached once, in order, each observed once by the step histogram
        assert list(timelines) == [base]
        assert tuple(timelines[base]) == WARM_STEPS
        marks = list(timelines[base].values())
        assert marks == sorted(marks)
        for step in WARM_STEPS[1:]:
            assert (
                metrics.get_sample_value(
                    "sandbox_lanes_agent_sandbox_warm_step_seconds_count", {"step": step}
                )
                == 1
            ), step
        adopted = _claim(custom, ns, base)["status"]["sandbox"]["name"]
        assert (
            await wait_for(
                "the runner to start", lambda: runner_process_env(core, ns, adopted).get("STIGMER_TOKEN")
            )
            == token
        )
        assert runner_process_env(core, ns, adopted)["STIGMER_TASK_QUEUE"] == f"wfexec:{execution}"
        # The secrets are kept in the claim's Secret only: not the claim, the Sandbox, the pod or an event.
        visible = str(_claim(custom, ns, base)) + str(_sandbox(custom, ns, adopted))
        visible += str(core.read_namespaced_pod(adopted, ns).to_dict())
        visible += str(core.list_namespaced_event(ns).to_dict())
        for secret in (token, "sk-ant-node-secret", "temporal-node-key"):
            assert secret not in visible
        # An ensure again (a re-run decision) delivers to the live claim: no second launch.
        again = SandboxEnvironment(f"wfexec:{execution}", token)
        assert await driver.ensure("workflow", execution, again) == "running"
        await driver.warm.settled()
        assert _arms(caplog)[-1] == "claimed"
        assert launches(metrics, "warm") == 1 and launches(metrics, "cold") is None  # one launch, timed

        # 2. A driver that stops between an ensure and its delivery: the next one delivers the kept Secret.
        restarted = f"wfx_restart_{uuid.uuid4().hex[:8]}"
        rbase = sandbox_base_name("workflow", restarted)
        await driver.ensure("workflow", restarted, SandboxEnvironment(f"wfexec:{restarted}", "tok.restart.x"))
        await driver.close()  # the claim is not Ready yet: its delivery is cancelled
        assert "stigmer.ai/assigned" not in annotations(rbase)
        restarted_driver = new_agent_sandbox_provisioner(config, LOG)
        restarted_metrics = CollectorRegistry()
        restarted_driver.bind_metrics(restarted_metrics)
        assert restarted_driver.warm is not None
        assert not restarted_driver.warm.watching  # recover runs before any ensure: its deliveries poll
        assert await restarted_driver.warm.recover() == 1  # the assigned claim of step 1 is left alone
        await restarted_driver.warm.settled()
        assert annotations(rbase).get("stigmer.ai/assigned") == "true"
        radopted = _claim(custom, ns, rbase)["status"]["sandbox"]["name"]
        assert (
            await wait_for(
                "the recovered runner", lambda: runner_process_env(core, ns, radopted).get("STIGMER_TOKEN")
            )
            == "tok.restart.x"
        )

        # 3. Deprovision: the claim, its Secret and the adopted Sandbox go.
        for done in (execution, restarted):
            await restarted_driver.deprovision("workflow", done)
        for name, adopted_name in ((base, adopted), (rbase, radopted)):
            await wait_for("the claim to go", lambda n=name: gone(lambda: _claim(custom, ns, n)), timeout=90)
            await wait_for(
                "its Secret to go",
                lambda n=name: gone(lambda: core.read_namespaced_secret(secret_name(n), ns)),
                timeout=90,
            )
            await wait_for(
                "the adopted Sandbox to go",
                lambda a=adopted_name: gone(lambda: _sandbox(custom, ns, a)),
                timeout=90,
            )

        # 4. A miss (not Ready in time) goes cold behind the ensure, with the ensure's environment.
        restarted_driver.warm.adopt_timeout_s = 0.0  # no wait at all: a miss whatever the node's speed
        missed = f"wfx_amiss_{uuid.uuid4().hex[:8]}"
        await restarted_driver.ensure("workflow", missed, SandboxEnvironment(f"wfexec:{missed}", "tok.m"))
        await restarted_driver.warm.settled()
        assert _arms(caplog)[-2:] == ["warm-claimed", "created"], _arms(caplog)
        assert (
            restarted_metrics.get_sample_value(
                "sandbox_lanes_agent_sandbox_adoption_misses_total", {"reason": "not ready in time"}
            )
            == 1
        )
        cold = await wait_for("the cold runner", lambda: running_runner_pod(core, ns, missed))
        assert runner_process_env(core, ns, cold.metadata.name)["STIGMER_TOKEN"] == "tok.m"
        assert len(restarted_driver._locks) == 0  # a lock lives only while an action holds or awaits it
        await restarted_driver.deprovision("workflow", missed)
        assert len(restarted_driver._locks) == 0
    finally:
        await driver.close()
        if restarted_driver is not None:
            await restarted_driver.close()


async def test_an_idle_session_whose_exec_ended_is_noticed_opened_again_and_used(
    kube_node: KubeNode, agent_sandbox: AgentSandboxController, node_admin: Any, node_namespace: str
) -> None:
    """An assignment session's exec ends while it sits idle (here its process is killed; in production
    a stream timeout of the kubelet or API server, a container restart): the kubelet ends the stream.
    The refresh reads every idle session, so it sees that, and opens a new one; the next claim of that
    pod is handed its secrets through it. (The client's ``is_open()`` alone stays True for ever: the
    dead session was kept, no new one opened, and the delivery fell back to a fresh exec.)"""
    core = client.CoreV1Api(node_admin)
    ns = node_namespace
    driver = new_agent_sandbox_provisioner(
        node_driver_config(ns, kube_node.kubeconfig_path, warm_pool_size="1"), LOG
    )
    metrics = CollectorRegistry()
    driver.bind_metrics(metrics)
    assert driver.warm is not None
    try:
        await driver.warm.prepare()
        await pool_ready(driver, 1)
        await wait_for("the assignment session", lambda: driver.warm.sessions_open == 1)
        pods = core.list_namespaced_pod(ns, label_selector="stigmer.ai/warm=true").items
        idle = [
            p.metadata.name for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp
        ]
        assert len(idle) == 1
        pod = idle[0]

        # The session processes in the pod (the image has no pgrep): each /proc entry whose command line
        # holds the session command's name ([n]: this shell's own line, which spells the pattern, does not)
        scan = (
            "for d in /proc/[0-9]*; do case \"$(tr '\\0' ' ' 2>/dev/null < $d/cmdline)\" in "
            "*assign-sessio[n]*) {act} ${{d#/proc/}};; esac; done"
        )

        def sessions_in_pod() -> list[str]:
            return pod_exec(core, ns, pod, ["/bin/sh", "-c", scan.format(act="echo")]).split()

        first = await wait_for("the session's process in the pod", sessions_in_pod)
        assert len(first) == 1, first
        pod_exec(core, ns, pod, ["/bin/sh", "-c", scan.format(act="kill")])
        ended = time.monotonic()
        again = await wait_for(
            "a session opened again", lambda: [p for p in sessions_in_pod() if p not in first], timeout=30
        )
        LOG.info("a session ended while idle was replaced within %.2fs", time.monotonic() - ended)
        assert len(again) == 1 and driver.warm.sessions_open == 1

        execution = f"wfx_reopen_{uuid.uuid4().hex[:8]}"
        base = sandbox_base_name("workflow", execution)
        await driver.ensure("workflow", execution, SandboxEnvironment(f"wfexec:{execution}", "tok.reopen"))
        await driver.warm.settled()
        via = {
            way: metrics.get_sample_value(
                "sandbox_lanes_agent_sandbox_assignment_handovers_total", {"via": way}
            )
            for way in ("session", "exec")
        }
        assert via == {"session": 1.0, "exec": None}, via
        adopted = _claim(client.CustomObjectsApi(node_admin), ns, base)["status"]["sandbox"]["name"]
        assert adopted == pod
        assert (
            await wait_for("the runner", lambda: runner_process_env(core, ns, pod).get("STIGMER_TOKEN"))
            == "tok.reopen"
        )
        await driver.deprovision("workflow", execution)
        custom = client.CustomObjectsApi(node_admin)
        await wait_for("the claim to go", lambda: gone(lambda: _claim(custom, ns, base)), timeout=90)
    finally:
        await driver.close()


async def test_a_changed_runner_template_deletes_the_previous_warm_pool_and_template(
    kube_node: KubeNode, agent_sandbox: AgentSandboxController, node_admin: Any, node_namespace: str
) -> None:
    custom = client.CustomObjectsApi(node_admin)
    ns = node_namespace
    ext = ("extensions.agents.x-k8s.io", "v1beta1", ns)
    before = new_agent_sandbox_provisioner(
        node_driver_config(ns, kube_node.kubeconfig_path, warm_pool_size="1"), LOG
    )
    after = new_agent_sandbox_provisioner(
        node_driver_config(ns, kube_node.kubeconfig_path, warm_pool_size="1", cpu_request="11m"), LOG
    )
    try:
        assert before.warm is not None and after.warm is not None
        old, new = before.warm.name, after.warm.name
        assert old != new  # the runner template differs: a new pair
        await before.warm.prepare()
        for plural in ("sandboxwarmpools", "sandboxtemplates"):
            custom.get_namespaced_custom_object(*ext, plural, old)  # there
        await after.warm.prepare()
        for plural in ("sandboxwarmpools", "sandboxtemplates"):
            await wait_for(
                f"the old {plural} to go",
                lambda p=plural: gone(lambda: custom.get_namespaced_custom_object(*ext, p, old)),
            )
            assert custom.get_namespaced_custom_object(*ext, plural, new)["metadata"]["name"] == new
        await wait_for("the new pool's sandbox", lambda: asyncio.run(after.warm.ready_replicas()) == 1)  # type: ignore[union-attr]
    finally:
        await before.close()
        await after.close()


class _Idle:
    """A session reader saying every session it is asked about is idle since long ago."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def activity(self, session_id: str) -> SessionActivity:
        self.asked.append(session_id)
        return SessionActivity(busy=False, last_active_at=0.0, executions=1)


async def test_two_installations_in_one_namespace_never_touch_each_others_sandboxes_claims_or_pools(
    kube_node: KubeNode,
    agent_sandbox: AgentSandboxController,
    node_admin: Any,
    node_namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Production and staging in one namespace, on the real controller, with warm pools, beside a
    session Sandbox without the sandbox-id label and one made before installations were labelled.
    Each installation's pool is its own (a new runner template replaces only its own pair); the idle
    sweep suspends only its installation's own idle session Sandboxes; an ensure, probe, deprovision,
    listing or warm recovery of one never writes, wakes, suspends, claims or deletes the other's."""
    caplog.set_level(logging.INFO, logger="test.agent_sandbox")
    core, custom = client.CoreV1Api(node_admin), client.CustomObjectsApi(node_admin)
    ns = node_namespace
    ext = ("extensions.agents.x-k8s.io", "v1beta1", ns)
    base_config = node_driver_config(ns, kube_node.kubeconfig_path, warm_pool_size="1")
    production = new_agent_sandbox_provisioner(replace(base_config, installation="production"), LOG)
    staging = new_agent_sandbox_provisioner(replace(base_config, installation="staging"), LOG)
    renewed: AgentSandboxProvisioner | None = None
    session, no_id, legacy = (f"ses_inst_{uuid.uuid4().hex[:8]}" for _ in range(3))
    warm_id = f"wfx_inst_{uuid.uuid4().hex[:8]}"
    try:
        # Pools: one pair per installation, labelled with it; a new template replaces only its own.
        assert production.warm is not None and staging.warm is not None
        assert production.warm.name != staging.warm.name
        await production.warm.prepare()
        await staging.warm.prepare()
        pools = {
            p["metadata"]["name"]: p["metadata"]["labels"]["stigmer.ai/installation"]
            for p in custom.list_namespaced_custom_object(*ext, "sandboxwarmpools")["items"]
        }
        assert pools == {production.warm.name: "production", staging.warm.name: "staging"}
        renewed = new_agent_sandbox_provisioner(
            replace(
                node_driver_config(ns, kube_node.kubeconfig_path, warm_pool_size="1", cpu_request="11m"),
                installation="production",
            ),
            LOG,
        )
        assert renewed.warm is not None
        await renewed.warm.prepare()
        for plural in ("sandboxwarmpools", "sandboxtemplates"):
            old = production.warm.name
            await wait_for(
                f"production's previous {plural} to go",
                lambda p=plural, o=old: gone(lambda: custom.get_namespaced_custom_object(*ext, p, o)),
            )
            kept = custom.get_namespaced_custom_object(*ext, plural, staging.warm.name)
            assert kept["metadata"]["labels"]["stigmer.ai/installation"] == "staging", "staging's pair stays"
        await renewed.close()
        renewed = None

        # Sessions (always cold): production's, and two of no installation's making, all Running.
        env = SandboxEnvironment(task_queue=f"session:{session}", stigmer_token="tok.production")
        await production.ensure("session", session, env)
        for sid, drop in ((no_id, "stigmer.ai/sandbox-id"), (legacy, "stigmer.ai/installation")):
            manifest = sandbox_manifest(
                replace(base_config, installation="production"),
                "session",
                sid,
                SandboxEnvironment(f"q:{sid}"),
            )
            del manifest["metadata"]["labels"][drop]
            manifest["spec"]["operatingMode"] = "Running"
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)
        names = {sid: sandbox_base_name("session", sid) for sid in (session, no_id, legacy)}
        held = {sid: _held(core, custom, ns, name) for sid, name in names.items() if sid == session}

        # Staging meets production's session under its name: refused, nothing written or woken.
        with pytest.raises(SandboxCollision) as err:
            await staging.ensure("session", session, SandboxEnvironment(f"session:{session}", "tok.staging"))
        assert f"belongs to session '{session}' of installation 'production'" in str(err.value)
        assert await staging.probe("session", session) == "absent"
        await staging.deprovision("session", session)
        assert {m.sandbox_id for m in await staging.list_managed()} == set()
        assert {m.sandbox_id for m in await production.list_managed()} == {session}

        # The idle sweeps, with every session idle for ever: staging's suspends nothing of
        # production's; production's suspends its own session only, never one without the sandbox-id
        # label or without an installation.
        idle = _Idle()
        assert await staging.sweep_once(idle) == 0 and idle.asked == []
        assert _held(core, custom, ns, names[session]) == held[session]
        production._clock = lambda: time.time() + 3600  # its own ensure is an hour old
        assert list(production.last_ensured) == [names[session]]  # sessions only: the sweep's floor
        assert await production.sweep_once(idle) == 1
        assert idle.asked == [session]
        assert production.last_ensured == {}, "a floor a window old is dropped: it can keep nothing running"
        modes = {sid: _sandbox(custom, ns, name)["spec"]["operatingMode"] for sid, name in names.items()}
        assert modes == {session: "Suspended", no_id: "Running", legacy: "Running"}
        for sid in (no_id, legacy):
            with pytest.raises(SandboxCollision):
                await production.ensure("session", sid, SandboxEnvironment(f"session:{sid}"))
            await production.deprovision("session", sid)
            assert not _sandbox(custom, ns, names[sid])["metadata"].get("deletionTimestamp")

        # Warm claims: staging's claim is never claimed, recovered, nor deleted by production.
        await staging.ensure("workflow", warm_id, SandboxEnvironment(f"wfexec:{warm_id}", "tok.warm.staging"))
        warm_base = sandbox_base_name("workflow", warm_id)
        claim_uid = _claim(custom, ns, warm_base)["metadata"]["uid"]
        assert staging.last_ensured == {}, "a workflow ensure leaves no idle-clock entry"
        with pytest.raises(SandboxCollision, match=r"SandboxClaim .* of installation 'staging'"):
            await production.ensure("workflow", warm_id, SandboxEnvironment(f"wfexec:{warm_id}", "tok.p"))
        assert await production.warm.recover() == 0
        assert await production.probe("workflow", warm_id) == "absent"
        await production.deprovision("workflow", warm_id)
        await staging.warm.settled()
        claim = _claim(custom, ns, warm_base)
        assert claim["metadata"]["uid"] == claim_uid and not claim["metadata"].get("deletionTimestamp")
        assert (
            core.read_namespaced_secret(secret_name(warm_base), ns).metadata.labels["stigmer.ai/installation"]
            == "staging"
        )
        assert {m.sandbox_id for m in await staging.list_managed()} == {warm_id}
        assert {m.sandbox_id for m in await production.list_managed()} == {session}
        assert len(production._locks) == 0 and len(staging._locks) == 0
    finally:
        for driver in (production, staging):
            for m in await driver.list_managed():
                await driver.deprovision(m.scope, m.sandbox_id)
            await driver.close()
        if renewed is not None:
            await renewed.close()
        for sid in (no_id, legacy):
            with contextlib.suppress(Exception):
                custom.delete_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, sandbox_base_name("session", sid)
                )
