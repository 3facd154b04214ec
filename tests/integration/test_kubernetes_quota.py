"""Engine quota is capacity, on the real node (issue 44, items 3 and 7): a ``ResourceQuota`` in the
sandbox namespace, no cap set in the pod, more creates than the quota holds.

The pod (in-process, real Kafka, the kubernetes driver on the harness's single-node cluster) gets
every create at once. The engine refuses the ones over the quota; the pod waits them out and they run
as earlier executions complete. The test, not the pod, samples the API server every 100 ms: live
pods (and Deployments, and the quota's own ``used``) never above the quota (but for the engine's own
recount race, one over: kubernetes/kubernetes#123434), every execution's runner
pod seen Running, and each execution provisioned once and torn down once, none failed.

Two ways the engine refuses: a quota on ``pods`` lets the Deployment in and refuses its ReplicaSet's
pod (``ReplicaFailure``, read by the driver's admission wait); a quota on ``count/deployments.apps``
refuses the driver's own create (HTTP 403).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from harness.agent_sandbox import AgentSandboxController
from harness.kube_node import RUNNER_IMAGE, KubeNode

from consumers.ops.settings import load_settings
from drivers.agent_sandbox.driver import new_agent_sandbox_provisioner
from drivers.agent_sandbox.manifests import GROUP, PLURAL, VERSION
from drivers.contract import CapacityRefused, SandboxEnvironment
from drivers.naming import LABEL_SANDBOX_ID, sandbox_base_name
from events.codec import OUTCOME_TYPES, decode, header
from events.sandbox_lanes.v1 import outcomes_pb2
from tests.integration.test_kubernetes_node import (
    LOG,
    SMALL_RUNNER,
    gone,
    node_driver_config,
    running_runner_pod,
    wait_for,
)
from tests.integration.test_pod_drivers_e2e import driver_env
from tests.support.pod_harness import produce, running_pod, wf_created, wf_terminal

pytestmark = pytest.mark.kubernetes

QUOTA_NAME = "sandbox-quota"


@dataclass
class EngineSamples:
    """What the API server showed, sampled every 100 ms by the test."""

    samples: int = 0
    max_live_pods: int = 0
    max_deployments: int = 0
    max_used: int = 0
    running: set[str] = field(default_factory=set)

    def take(self, core: Any, apps: Any, ns: str, resource: str) -> None:
        pods = core.list_namespaced_pod(ns).items
        live = [
            p
            for p in pods
            if p.metadata.deletion_timestamp is None and p.status.phase not in ("Succeeded", "Failed")
        ]
        self.max_live_pods = max(self.max_live_pods, len(live))
        for p in live:
            if p.status.phase == "Running":
                self.running.add((p.metadata.labels or {}).get(LABEL_SANDBOX_ID, ""))
        self.max_deployments = max(self.max_deployments, len(apps.list_namespaced_deployment(ns).items))
        quota = core.read_namespaced_resource_quota(QUOTA_NAME, ns)
        used = (quota.status.used or {}).get(resource, "0")
        self.max_used = max(self.max_used, int(used))
        self.samples += 1


async def sample_engine(
    samples: EngineSamples, core: Any, apps: Any, ns: str, resource: str, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        await asyncio.to_thread(samples.take, core, apps, ns, resource)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


def quota_ready(core: Any, ns: str, resource: str) -> bool:
    """The quota controller has published the quota's usage: until then admission answers 'status
    unknown for quota', which is not a refusal for capacity."""
    status = core.read_namespaced_resource_quota(QUOTA_NAME, ns).status
    return status is not None and resource in (status.used or {})


@pytest.mark.kafka
@pytest.mark.parametrize(
    ("resource", "limit", "creates"),
    [("pods", 10, 30), ("count/deployments.apps", 3, 9)],
    ids=["pods-quota", "deployments-quota"],
)
async def test_quota_refusals_are_waited_out_and_every_execution_runs(
    kafka_bootstrap: str,
    kube_node: KubeNode,
    node_admin: Any,
    node_namespace: str,
    tmp_path: Path,
    resource: str,
    limit: int,
    creates: int,
) -> None:
    from kubernetes import client

    started = time.monotonic()
    ns = node_namespace
    core, apps = client.CoreV1Api(node_admin), client.AppsV1Api(node_admin)
    quota: Any = {"metadata": {"name": QUOTA_NAME}, "spec": {"hard": {resource: str(limit)}}}
    core.create_namespaced_resource_quota(ns, quota)
    await wait_for("the quota's usage to be published", lambda: quota_ready(core, ns, resource))
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
    )
    settings = load_settings(env)
    ids = [f"wfx_quota_{n:02d}_{uuid.uuid4().hex[:6]}" for n in range(creates)]
    samples = EngineSamples()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_engine(samples, core, apps, ns, resource, stop))
    provisioned: Counter[str] = Counter()
    deprovisioned: Counter[str] = Counter()
    failed: list[str] = []
    completed: set[str] = set()
    consumer = AIOKafkaConsumer(
        settings.topics.outcomes,
        bootstrap_servers=kafka_bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    try:
        async with running_pod(env) as composed:
            await consumer.start()
            await produce(kafka_bootstrap, env, *(wf_created(i) for i in ids))
            deadline = time.monotonic() + 240
            while sum(deprovisioned.values()) < creates and time.monotonic() < deadline and not failed:
                batch = await consumer.getmany(timeout_ms=100)
                for records in batch.values():
                    for rec in records:
                        if header(rec.headers, "ce_type") not in OUTCOME_TYPES:
                            continue
                        out = decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
                        sandbox_id = out.sandbox.sandbox_id  # type: ignore[attr-defined]
                        if isinstance(out, outcomes_pb2.SandboxProvisioned):
                            provisioned[sandbox_id] += 1
                        elif isinstance(out, outcomes_pb2.SandboxDeprovisioned):
                            deprovisioned[sandbox_id] += 1
                        elif isinstance(out, outcomes_pb2.SandboxFailed):
                            failed.append(f"{sandbox_id}: {out.reason}")
                # An execution completes once the test has seen its runner pod Running.
                ready = [i for i in provisioned if i in samples.running and i not in completed]
                if ready:
                    completed.update(ready)
                    await produce(kafka_bootstrap, env, *(wf_terminal(i) for i in ready))
            waits = composed.metrics.engine_quota_waits.labels("kubernetes")._value.get()
            timeouts = composed.metrics.engine_quota_timeouts.labels("kubernetes")._value.get()
    finally:
        await consumer.stop()
        stop.set()
        await sampler
    elapsed = time.monotonic() - started
    print(
        f"\n{resource}={limit}, {creates} creates: {elapsed:.1f} s; engine sampled {samples.samples} times;"
        f" max live pods {samples.max_live_pods}, Deployments {samples.max_deployments}, quota used"
        f" {samples.max_used}; quota waits begun {waits:.0f}, timed out {timeouts:.0f}"
    )
    assert failed == [], failed
    assert provisioned == Counter(dict.fromkeys(ids, 1)), provisioned  # each provisioned once
    assert deprovisioned == Counter(dict.fromkeys(ids, 1)), deprovisioned  # ... and torn down once
    assert samples.running >= set(ids), sorted(set(ids) - samples.running)  # every runner pod ran
    # What the engine held, never above the quota by more than the engine's own race: the quota
    # controller's recount, started by the deletion of an object the quota counts (a teardown here),
    # reads the objects from its informer cache, which can miss one admitted a moment before; it then
    # writes a `used` one short over admission's fresher one, and admission lets one more in
    # (kubernetes/kubernetes#123434, open: "the controller may has not seen the new created pod from
    # informer, then the controller will rollback the resourcequota used"). The recount is the same
    # for every counted kind, Deployments as pods. Seen once in CI: 11 pods live of 10, quota used 11.
    held = samples.max_live_pods if resource == "pods" else samples.max_deployments
    assert held <= limit + 1, (held, limit)
    # ... and the quota was what held the creates back: it was reached, and creates were refused and
    # waited out (not all of the ones over it need be: one decided after a teardown may find room).
    # The quota's published `status.used` is that recount's, so it can be off by one either way (one
    # short as above; one over while a deleted pod is still counted: 11 of 10 once in CI, with at
    # most 10 pods live in the same samples): a figure, not the verdict.
    assert samples.max_used >= limit and waits >= 1 and timeouts == 0
    await wait_for("every runner pod to go", lambda: not core.list_namespaced_pod(ns).items, timeout=90)
    assert apps.list_namespaced_deployment(ns).items == []


async def test_agent_sandbox_pod_refused_for_quota_is_capacity_refused_and_leaves_nothing(
    kube_node: KubeNode, agent_sandbox: AgentSandboxController, node_admin: Any, node_namespace: str
) -> None:
    """The agent-sandbox controller's refused pod (the Sandbox's Ready condition: ReconcilerError,
    'exceeded quota') is :class:`CapacityRefused`; the refused Sandbox is gone; with room, it runs."""
    from kubernetes import client

    ns = node_namespace
    core, custom = client.CoreV1Api(node_admin), client.CustomObjectsApi(node_admin)
    quota: Any = {"metadata": {"name": QUOTA_NAME}, "spec": {"hard": {"pods": "1"}}}
    core.create_namespaced_resource_quota(ns, quota)
    await wait_for("the quota's usage to be published", lambda: quota_ready(core, ns, "pods"))
    driver = new_agent_sandbox_provisioner(node_driver_config(ns, kube_node.kubeconfig_path), LOG)
    first, second = (f"wfx_asq_{n}_{uuid.uuid4().hex[:6]}" for n in (1, 2))
    try:
        await driver.ensure("workflow", first, SandboxEnvironment(task_queue=f"wfexec:{first}"))
        await wait_for("the first runner pod", lambda: running_runner_pod(core, ns, first))
        started = time.monotonic()
        with pytest.raises(CapacityRefused) as refused:
            await driver.ensure("workflow", second, SandboxEnvironment(task_queue=f"wfexec:{second}"))
        print(f"\nagent-sandbox refusal seen in {time.monotonic() - started:.2f} s: {refused.value}")
        assert "exceeded quota: sandbox-quota" in str(refused.value)
        base = sandbox_base_name("workflow", second)
        await wait_for(
            "the refused Sandbox to go",
            lambda: gone(lambda: custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, base)),
        )
        await driver.deprovision("workflow", first)
        # Room again once the first pod is gone: the next ensure is admitted (the pod's wait does this).
        deadline = time.monotonic() + 90
        while True:
            try:
                await driver.ensure("workflow", second, SandboxEnvironment(task_queue=f"wfexec:{second}"))
                break
            except CapacityRefused:
                assert time.monotonic() < deadline, "still refused 90 s after the first sandbox went"
                await asyncio.sleep(1.0)
        await wait_for("the second runner pod", lambda: running_runner_pod(core, ns, second))
        await driver.deprovision("workflow", second)
    finally:
        await driver.close()
