"""The pod end to end through real Kafka with the docker and kubernetes drivers on their real parts
(the kubernetes one on the harness's single-node cluster, so its runner pods really run).

execution-created → a real container / real API objects → terminal phase → gone; and an unreachable
engine → the lanes' failure paths with the engine's error as the reason.
"""

from __future__ import annotations

import base64
import secrets
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import docker
import pytest
from harness.dockerd import Dockerd
from harness.kube_node import RUNNER_IMAGE, KubeNode

from consumers.ops.reaper import start_periodic_reaper
from consumers.ops.settings import load_settings
from drivers.contract import SandboxEnvironment
from drivers.kubernetes.driver import new_kubernetes_provisioner
from drivers.naming import LABEL_MANAGED_BY, LABEL_SANDBOX_ID, sandbox_base_name
from events.codec import new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2
from tests.integration.test_kubernetes_node import (
    LOG,
    SMALL_RUNNER,
    env_inside,
    gone,
    node_driver_config,
    runner_pods,
    running_runner_pod,
    wait_for,
)
from tests.support.pod_harness import produce, read_topic, running_pod, unique_env, wf_terminal

TOKEN_KEY = base64.b64encode(secrets.token_bytes(32)).decode()


def created(execution_id: str, kind: int, **fields: Any) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=kind,
        execution_id=execution_id,
        caller_identity_id="ida_e2e",
        **fields,  # type: ignore[arg-type]
    )


def driver_env(bootstrap: str, tmp: Path, driver: str, options: str, **extra: str) -> dict[str, str]:
    return unique_env(
        bootstrap,
        tmp,
        SANDBOX_PROVISIONER_TYPE=driver,
        SANDBOX_LANES_DRIVER_OPTIONS=options,
        STIGMER_SANDBOX_BACKEND_ENDPOINT="http://127.0.0.1:7234",
        STIGMER_SANDBOX_TEMPORAL_ADDRESS="127.0.0.1:7233",
        STIGMER_RUNNER_TOKEN_KEY=TOKEN_KEY,
        **extra,
    )


@pytest.mark.kafka
@pytest.mark.docker
async def test_pod_with_the_docker_driver_runs_a_container_and_removes_it(
    kafka_bootstrap: str, dockerd: Dockerd, docker_image: str, tmp_path: Path
) -> None:
    execution_id = f"wfx_dk_{uuid.uuid4().hex[:8]}"
    env = driver_env(
        kafka_bootstrap,
        tmp_path,
        "docker",
        f"docker_host={dockerd.socket_url},image={docker_image},network=none",
    )
    topics = load_settings(env).topics
    client = docker.DockerClient(base_url=dockerd.socket_url, version="auto")
    name = sandbox_base_name("workflow", execution_id)
    try:
        async with running_pod(env):
            await produce(
                kafka_bootstrap,
                env,
                created(
                    execution_id, common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD
                ),
            )
            (provisioned,) = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
            message = provisioned.message
            assert isinstance(message, outcomes_pb2.SandboxProvisioned)
            assert (message.sandbox.driver, message.sandbox.name, message.probe_state) == (
                "docker",
                name,
                "running",
            )
            assert message.token_minted
            container = client.containers.get(name)
            assert container.status == "running"
            assert (
                container.labels[LABEL_SANDBOX_ID] == execution_id
                and container.labels[LABEL_MANAGED_BY] == "stigmer-server"
            )
            token = next(
                v.split("=", 1)[1] for v in container.attrs["Config"]["Env"] if v.startswith("STIGMER_TOKEN=")
            )
            assert token.count(".") == 2  # a real JWT reached the sandbox ...
            assert token.encode() not in (provisioned.value or b"")  # ... and never the outcome event
            assert token not in " ".join(container.attrs["Config"]["Cmd"] or []) + " ".join(
                container.attrs["Args"] or []
            )

            await produce(kafka_bootstrap, env, wf_terminal(execution_id))
            outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
            assert isinstance(outcomes[-1].message, outcomes_pb2.SandboxDeprovisioned)
            assert [c.name for c in client.containers.list(all=True, filters={"name": name})] == []
    finally:
        for c in client.containers.list(all=True, filters={"label": f"{LABEL_SANDBOX_ID}={execution_id}"}):
            c.remove(force=True)
        client.close()


@pytest.mark.kafka
@pytest.mark.docker
async def test_a_burst_of_docker_creates_never_holds_a_transaction_and_every_one_completes(
    kafka_bootstrap: str, dockerd: Dockerd, docker_image: str, tmp_path: Path
) -> None:
    # The burst that wedged the pod when driver calls ran inside the transaction: 100 CLOUD
    # workflows at once, a 5 s transaction timeout, ~0.2 s per container create on this engine.
    run = uuid.uuid4().hex[:8]
    executions = [f"wfx_burst_{run}_{i}" for i in range(100)]
    env = driver_env(
        kafka_bootstrap,
        tmp_path,
        "docker",
        f"docker_host={dockerd.socket_url},image={docker_image},memory=32m,cpus=0.1,network=none",
        SANDBOX_LANES_TRANSACTION_TIMEOUT_MS="5000",
    )
    topics = load_settings(env).topics
    client = docker.DockerClient(base_url=dockerd.socket_url, version="auto")
    label = f"{LABEL_MANAGED_BY}=stigmer-server"
    try:
        async with running_pod(env) as composed:
            await produce(
                kafka_bootstrap,
                env,
                *(
                    created(e, common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD)
                    for e in executions
                ),
            )
            provisioned = await read_topic(kafka_bootstrap, topics.outcomes, at_least=100, timeout_s=240)
            assert sorted(
                r.message.execution_id
                for r in provisioned
                if isinstance(r.message, outcomes_pb2.SandboxProvisioned)
            ) == sorted(executions)
            running = {c.name for c in client.containers.list(filters={"label": label})}
            assert {sandbox_base_name("workflow", e) for e in executions} <= running

            await produce(kafka_bootstrap, env, *(wf_terminal(e) for e in executions))
            outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=200, timeout_s=240)
            assert composed.pod.stats.commit_failures == 0
        torn_down = [r for r in outcomes if isinstance(r.message, outcomes_pb2.SandboxDeprovisioned)]
        assert sorted(r.message.execution_id for r in torn_down) == sorted(executions)
        assert len({r.message.meta.event_id for r in outcomes}) == len(outcomes) == 200
        names = {sandbox_base_name("workflow", e) for e in executions}
        assert names.isdisjoint(c.name for c in client.containers.list(all=True, filters={"label": label}))
    finally:
        for c in client.containers.list(all=True, filters={"label": label}):
            if c.labels.get(LABEL_SANDBOX_ID, "").startswith(f"wfx_burst_{run}"):
                c.remove(force=True)
        client.close()


@pytest.mark.kafka
async def test_an_unreachable_docker_engine_is_each_lanes_failure_path(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = driver_env(kafka_bootstrap, tmp_path, "docker", f"docker_host=unix://{tmp_path}/no-engine.sock")
    topics = load_settings(env).topics
    async with running_pod(env):
        await produce(
            kafka_bootstrap,
            env,
            created(
                "wfx_noengine", common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD
            ),
            created(
                "axr_noengine",
                common_pb2.AGENT_EXECUTION,
                session_id="ses_noengine",
                session_execution_target=common_pb2.CLOUD,
            ),
        )
        failures = await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
    by_id = {r.message.execution_id: r.message for r in failures}  # type: ignore[union-attr]
    workflow, session = by_id["wfx_noengine"], by_id["axr_noengine"]
    assert isinstance(workflow, outcomes_pb2.SandboxFailed) and isinstance(
        session, outcomes_pb2.SandboxFailed
    )
    assert workflow.critical and workflow.message == "failed to provision workflow sandbox"
    assert not session.critical and session.message == "Sandbox provisioning failed: " + session.reason
    assert "no-engine.sock" in workflow.reason and "docker engine error" in workflow.reason


@pytest.mark.kafka
@pytest.mark.kubernetes
async def test_pod_with_the_kubernetes_driver_runs_a_runner_pod_removes_it_and_reaps_an_orphan(
    kafka_bootstrap: str, kube_node: KubeNode, node_admin: Any, node_namespace: str, tmp_path: Path
) -> None:
    """On the real node: ExecutionCreated -> a Running runner pod with a real token; COMPLETED -> no pod.

    The pod's periodic reaper also removes a runner no execution state knows of.
    """
    from kubernetes import client

    ns = node_namespace
    execution_id = f"wfx_k8s_{uuid.uuid4().hex[:8]}"
    orphan = f"wfx_k8s_orphan_{uuid.uuid4().hex[:8]}"
    options = ",".join(
        f"{k}={v}" for k, v in {"kubeconfig": str(kube_node.kubeconfig_path), **SMALL_RUNNER}.items()
    )
    env = driver_env(
        kafka_bootstrap,
        tmp_path,
        "kubernetes",
        options,
        STIGMER_SANDBOX_K8S_NAMESPACE=ns,
        STIGMER_SANDBOX_RUNNER_IMAGE=RUNNER_IMAGE,
        SANDBOX_LANES_REAP_INTERVAL_S="0.5",
        SANDBOX_LANES_REAP_GRACE_S="1",
    )
    settings = load_settings(env)
    core, apps = client.CoreV1Api(node_admin), client.AppsV1Api(node_admin)
    base = sandbox_base_name("workflow", execution_id)
    # A runner left behind by a crashed pod of this installation (the pod's, from its group): our
    # labels, no execution state.
    leaker = new_kubernetes_provisioner(
        replace(node_driver_config(ns, kube_node.kubeconfig_path), installation=settings.driver.installation),
        LOG,
    )
    await leaker.ensure("workflow", orphan, SandboxEnvironment(task_queue=f"wfexec:{orphan}"))
    await leaker.close()
    await wait_for("the orphan's runner pod", lambda: running_runner_pod(core, ns, orphan))
    async with running_pod(env) as composed:
        await produce(
            kafka_bootstrap,
            env,
            created(execution_id, common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD),
        )
        (provisioned,) = await read_topic(kafka_bootstrap, settings.topics.outcomes, at_least=1)
        assert isinstance(provisioned.message, outcomes_pb2.SandboxProvisioned), provisioned.message
        assert (provisioned.message.sandbox.driver, provisioned.message.sandbox.name) == ("kubernetes", base)
        pod = await wait_for("the runner pod to run", lambda: running_runner_pod(core, ns, execution_id))
        inside = env_inside(core, ns, pod.metadata.name)
        assert execution_id in inside["STIGMER_TASK_QUEUE"]
        token = inside["STIGMER_TOKEN"]
        assert token.count(".") == 2  # a real JWT minted by the pod reached the runner ...
        assert token.encode() not in (provisioned.value or b"")  # ... and never the outcome event

        assert start_periodic_reaper(settings, composed) is not None
        await wait_for(
            "the reaper to remove the orphan", lambda: not runner_pods(core, ns, orphan), timeout=90
        )
        await wait_for(
            "the orphan's Deployment to go",
            lambda: gone(lambda: apps.read_namespaced_deployment(sandbox_base_name("workflow", orphan), ns)),
        )
        assert running_runner_pod(core, ns, execution_id) is not None  # a live execution's runner stays

        await produce(kafka_bootstrap, env, wf_terminal(execution_id))
        outcomes = await read_topic(kafka_bootstrap, settings.topics.outcomes, at_least=3)
        # Across partitions the read order is the fetch order: compare each sandbox's own sequence.
        mine = [type(o.message).__name__ for o in outcomes if o.message.sandbox.sandbox_id == execution_id]
        assert mine == ["SandboxProvisioned", "SandboxDeprovisioned"], mine
        reaped = [o.message for o in outcomes if isinstance(o.message, outcomes_pb2.SandboxReaped)]
        assert [r.sandbox.sandbox_id for r in reaped] == [orphan] and len(outcomes) == 3
        await wait_for(
            "the runner pod to terminate", lambda: not runner_pods(core, ns, execution_id), timeout=90
        )
    for what, read in (
        ("Deployment", lambda: apps.read_namespaced_deployment(base, ns)),
        ("Secret", lambda: core.read_namespaced_secret(f"{base}-env", ns)),
        ("PVC", lambda: core.read_namespaced_persistent_volume_claim(f"{base}-workspace", ns)),
    ):
        await wait_for(f"the {what} to be deleted", lambda read=read: gone(read))
