"""The kubernetes burst: time from create to runner pod Running, on a cluster with a kubelet.

The kubernetes driver's ensure returns once the Secret, PVC and Deployment are applied (no
readiness wait, as upstream), so ``SandboxProvisioned`` is committed before anything runs. The
figure an operator feels is create -> runner pod Running: a watch on the sandbox namespace
records when each runner's pod first reports phase Running.

The cluster is ``--kubeconfig`` (with ``--runner-image``), or a private single-node one from the
dev harness (``harness.kube_node``: kube-apiserver, controller-manager, scheduler, containerd and
a kubelet on loopback), started for the burst and stopped after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.common import pct
from sandbox_lanes_bench.containerd_events import ContainerdEvents
from sandbox_lanes_bench.launch_steps import (
    COLD_STEPS,
    COLD_STEPS_API,
    WARM_STEPS,
    SpanRecorder,
    breakdown,
    merge_marks,
    pod_marks,
    runner_started,
    wall_offset,
)

logger = logging.getLogger("sandbox_lanes.bench")

#: Runner pods sized for a small node: upstream's default requests (500m CPU each) fit 3 on 2 cores.
BENCH_RUNNER_OPTIONS = {
    "cpu_request": "10m",
    "memory_request": "16Mi",
    "cpu_limit": "250m",
    "memory_limit": "64Mi",
    "storage_size": "16Mi",
}
RUNNING_TIMEOUT_S = 600.0


@contextlib.asynccontextmanager
async def kube_cluster(args: Any) -> AsyncIterator[tuple[str, str, str, Any]]:
    """``(kubeconfig, runner image, description, harness node or None)``: ``--kubeconfig`` as given
    (agent-sandbox must then be installed there), or a private node."""
    if args.kubeconfig:
        if not args.runner_image:
            raise RuntimeError("--kubeconfig needs --runner-image (an image the cluster can run)")
        yield args.kubeconfig, args.runner_image, "given cluster", None
        return
    from harness.kube_node import RUNNER_IMAGE, KubeNode

    loop = asyncio.get_running_loop()
    node = KubeNode()
    await loop.run_in_executor(None, node.start)
    try:
        yield str(node.kubeconfig_path), RUNNER_IMAGE, "single-node cluster", node
    finally:
        await loop.run_in_executor(None, node.stop)


@contextlib.asynccontextmanager
async def agent_sandbox_controller(node: Any) -> AsyncIterator[None]:
    """The agent-sandbox controller on the private node (a given cluster must have it installed)."""
    if node is None:
        yield
        return
    from harness.agent_sandbox import AgentSandboxController, build

    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, build)
    controller = AgentSandboxController(node)
    await loop.run_in_executor(None, controller.start)
    try:
        yield
    finally:
        await loop.run_in_executor(None, controller.stop)


class FirstSeen:
    """A watch on one kind of object in one namespace: when (``time.monotonic``) each sandbox id's
    object was first seen meeting each named condition. ``list_objects(*args)`` is the API's list call
    (the watch needs the call itself, not a partial: it reads the call's docstring for the type)."""

    def __init__(
        self,
        list_objects: Callable[..., Any],
        args: tuple[Any, ...],
        sandbox_id: Callable[[Any], str | None],
        conditions: dict[str, Callable[[Any], bool]],
    ) -> None:
        self._list = list_objects
        self._args = args
        self._sandbox_id = sandbox_id
        self._conditions = conditions
        self.seen: dict[str, dict[str, float]] = {name: {} for name in conditions}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-watch", daemon=True)

    def __enter__(self) -> FirstSeen:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def reached(self, condition: str, ids: list[str], timeout_s: float) -> int:
        """How many of ``ids`` were seen meeting ``condition``, waiting up to ``timeout_s`` for all."""
        deadline = time.monotonic() + timeout_s
        seen = self.seen[condition]
        while any(i not in seen for i in ids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return sum(1 for i in ids if i in seen)

    def _run(self) -> None:
        from kubernetes import watch

        new_watch: Any = watch.Watch
        while not self._stop.is_set():
            stream: Any = new_watch()
            try:
                for event in stream.stream(self._list, *self._args, timeout_seconds=2):
                    obj = event["object"]
                    now = time.monotonic()
                    sandbox_id = self._sandbox_id(obj)
                    for name, met in self._conditions.items():
                        if sandbox_id and met(obj):
                            self.seen[name].setdefault(sandbox_id, now)
                    if self._stop.is_set():
                        break
            except Exception as exc:  # a dropped watch is re-opened; the figures only need the first sight
                logger.debug("watch restarted", extra={"error": str(exc)})
            finally:
                stream.stop()


def _condition(pod: Any, kind: str) -> bool:
    return any(c.type == kind and c.status == "True" for c in (pod.status.conditions or []))


def running_pods(api: Any, namespace: str) -> FirstSeen:
    """When each sandbox id's pod was first seen: at all (``pod_created``), bound to a node
    (``scheduled``), with its pod sandbox made (``sandbox_ready``: PodReadyToStartContainers), its
    runner container started (``container_running``) and in phase Running (``running``)."""
    from kubernetes import client

    from drivers.naming import LABEL_SANDBOX_ID

    core: Any = client.CoreV1Api(api)
    return FirstSeen(
        core.list_namespaced_pod,
        (namespace,),
        lambda pod: (pod.metadata.labels or {}).get(LABEL_SANDBOX_ID),
        {
            "pod_created": lambda pod: True,
            "scheduled": lambda pod: bool(pod.spec.node_name),
            "sandbox_ready": lambda pod: _condition(pod, "PodReadyToStartContainers"),
            "container_running": lambda pod: any(
                s.state is not None and s.state.running is not None
                for s in (pod.status.container_statuses or [])
            ),
            "running": lambda pod: pod.status.phase == "Running",
        },
    )


def _runners_by_label(
    api: Any, namespace: str, ids: list[str], offset: float, pods: dict[str, str]
) -> dict[str, float]:
    """When each sandbox id's runner printed its first line (monotonic), from its pod's log; and
    each of those pods' sandbox id by pod name, into ``pods``."""
    from kubernetes import client

    from drivers.kubernetes.manifests import CONTAINER_NAME
    from drivers.naming import LABEL_SANDBOX_ID

    core: Any = client.CoreV1Api(api)
    wanted = set(ids)
    found: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while wanted - set(found) and time.monotonic() < deadline:
        for pod in core.list_namespaced_pod(namespace).items:
            sandbox_id = (pod.metadata.labels or {}).get(LABEL_SANDBOX_ID)
            if sandbox_id not in wanted or sandbox_id in found or pod.metadata.deletion_timestamp:
                continue
            try:
                text = core.read_namespaced_pod_log(
                    pod.metadata.name, namespace, container=CONTAINER_NAME, timestamps=True
                )
            except Exception:  # not started yet: read again
                continue
            started = runner_started(text, offset)
            if started is not None:
                found[sandbox_id] = started
                pods[pod.metadata.name] = sandbox_id
        if wanted - set(found):
            time.sleep(0.2)
    return found


def claims_assigned(api: Any, namespace: str) -> FirstSeen:
    """When each sandbox id's SandboxClaim was first seen (``seen["created"]``) and first seen annotated
    as holding its assignment (``seen["assigned"]``, the driver's ``stigmer.ai/assigned`` once the pod
    has its secrets): the bench's own view of a warm delivery, from the Kubernetes objects."""
    from kubernetes import client

    from drivers.agent_sandbox.warm import ANNOTATION_ASSIGNED, CLAIMS, EXT_GROUP, EXT_VERSION
    from drivers.naming import LABEL_SANDBOX_ID

    custom: Any = client.CustomObjectsApi(api)

    def meta(claim: Any) -> dict[str, Any]:
        found: dict[str, Any] = claim.get("metadata") or {}
        return found

    return FirstSeen(
        custom.list_namespaced_custom_object,
        (EXT_GROUP, EXT_VERSION, namespace, CLAIMS),
        lambda claim: (meta(claim).get("labels") or {}).get(LABEL_SANDBOX_ID),
        {
            "created": lambda claim: True,
            "assigned": lambda claim: ANNOTATION_ASSIGNED in (meta(claim).get("annotations") or {}),
        },
    )


def warm_counts(metrics: Any) -> tuple[dict[str, int], int]:
    """Launches by type and adoption misses, from the warm pool's own metrics (``WarmPoolMetrics``: the
    time-to-sandbox histogram's count per launch type, the misses counter). Each pod the bench starts
    binds them to its registry afresh (as ``compose`` does for ``/metrics``): read them per pod."""
    launches: dict[str, int] = {}
    for family in metrics.time_to_sandbox.collect():
        for sample in family.samples:
            if sample.name.endswith("_count") and sample.value:
                launches[sample.labels["launch_type"]] = int(sample.value)
    misses = sum(
        int(sample.value)
        for family in metrics.misses.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    )
    return launches, misses


PodBurst = Callable[..., Awaitable[dict[str, Any]]]
#: The cluster bursts ``--burst-kube`` chooses from (all by default).
KUBE_PARTS = "kubernetes,agent-sandbox-cold,agent-sandbox-warm"
MakeEnv = Callable[[str], dict[str, str]]


async def kubernetes_burst(
    args: Any, make_env: MakeEnv, show: bool, n: int, pod_burst: PodBurst
) -> dict[str, Any]:
    """The kubernetes burst, then agent-sandbox cold and warm, on one cluster in one run."""
    from drivers.agent_sandbox.driver import new_agent_sandbox_provisioner
    from drivers.kubernetes.driver import new_kubernetes_provisioner

    parts = {part.strip() for part in str(getattr(args, "burst_kube", KUBE_PARTS)).split(",") if part.strip()}
    if parts - set(KUBE_PARTS.split(",")):
        raise ValueError(f"--burst-kube: unknown {sorted(parts - set(KUBE_PARTS.split(',')))}")
    if not args.burst_agent_sandbox:
        parts -= {"agent-sandbox-cold", "agent-sandbox-warm"}
    out: dict[str, Any] = {"n": n, "cluster": ""}
    async with kube_cluster(args) as (kubeconfig, image, cluster, node):
        if "kubernetes" in parts:
            out = await _running_burst(
                kubeconfig,
                image,
                make_env("k8s"),
                show,
                n,
                pod_burst,
                new_kubernetes_provisioner,
                "kubernetes",
                {},
                node,
            )
        out["cluster"] = cluster
        if parts & {"agent-sandbox-cold", "agent-sandbox-warm"}:
            try:
                async with agent_sandbox_controller(node):
                    if "agent-sandbox-cold" in parts:
                        out["agent_sandbox_cold"] = await _running_burst(
                            kubeconfig, image, make_env("as-cold"), show, n, pod_burst,
                            new_agent_sandbox_provisioner, "agent-sandbox cold", {}, node,
                        )  # fmt: skip
                    if "agent-sandbox-warm" in parts:
                        out["agent_sandbox_warm"] = await _warm_burst(
                            kubeconfig,
                            image,
                            make_env("as-warm"),
                            make_env("as-warm-seq"),
                            show,
                            n,
                            pod_burst,
                        )
            except Exception as exc:
                logger.error("agent-sandbox burst failed", extra={"error": str(exc)})
                out["agent_sandbox_error"] = f"{type(exc).__name__}: {exc}"
    return out


@contextlib.asynccontextmanager
async def _namespace(kubeconfig: str) -> AsyncIterator[tuple[Any, str]]:
    from kubernetes import client, config

    cfg = client.Configuration()
    load: Any = config.load_kube_config
    load(config_file=kubeconfig, client_configuration=cfg)
    api: Any = client.ApiClient(cfg)
    core: Any = client.CoreV1Api(api)
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(core.create_namespace, {"metadata": {"name": namespace}})
    try:
        yield api, namespace
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(core.delete_namespace, namespace)
        api.close()


def _driver_config(kubeconfig: str, image: str, namespace: str, **options: str) -> Any:
    from drivers.contract import DriverConfig

    return DriverConfig(
        backend_endpoint="http://127.0.0.1:7234",
        temporal_address="127.0.0.1:7233",
        runner_image=image,
        kubernetes_namespace=namespace,
        options={"kubeconfig": kubeconfig, **BENCH_RUNNER_OPTIONS, **options},
    )


async def _running_burst(
    kubeconfig: str,
    image: str,
    env: dict[str, str],
    show: bool,
    n: int,
    pod_burst: PodBurst,
    factory: Callable[..., Any],
    label: str,
    options: dict[str, str],
    node: Any = None,
) -> dict[str, Any]:
    """N creates through the pod; each runner's time to its pod's first Running (a namespace watch),
    and step by step (``launch_steps``; containerd's steps on the private ``node``)."""
    async with _namespace(kubeconfig) as (api, namespace):
        provisioner = factory(_driver_config(kubeconfig, image, namespace, **options), logger)
        running_ms: list[float] = []
        all_running_s = 0.0
        offset = wall_offset()
        recorder = SpanRecorder()
        runners: dict[str, float] = {}
        pod_names: dict[str, str] = {}
        sent_at: dict[str, float] = {}
        events = ContainerdEvents(node.containerd_socket) if node is not None else None
        try:
            with (
                running_pods(api, namespace) as watch,
                recorder.recording(),
                events if events is not None else contextlib.nullcontext(),
            ):
                running = watch.seen["running"]

                async def until_running(ids: list[str], sent: dict[str, float]) -> None:
                    nonlocal all_running_s
                    deadline = time.monotonic() + RUNNING_TIMEOUT_S
                    shown = 0
                    with progress(f"{label} burst: runner pods Running", n, enabled=show) as bar:
                        while (done := sum(1 for i in ids if i in running)) < n:
                            if time.monotonic() > deadline:
                                raise TimeoutError(
                                    f"{done}/{n} runner pods Running in {RUNNING_TIMEOUT_S:.0f}s"
                                )
                            bar.advance(done - shown)
                            shown = done
                            await asyncio.sleep(0.1)
                        bar.advance(n - shown)
                    running_ms.extend((running[i] - sent[i]) * 1000 for i in ids)
                    all_running_s = max(running[i] for i in ids) - min(sent.values())
                    sent_at.update(sent)
                    runners.update(
                        await asyncio.to_thread(_runners_by_label, api, namespace, ids, offset, pod_names)
                    )

                result = await pod_burst(
                    env, provisioner, n, show, f"{label} burst of {n}", 900, after_provision=until_running
                )
        finally:
            await provisioner.close()
    result["samples_ms"]["runner_ready"] = running_ms
    pod, _names = pod_marks(recorder.spans, offset)
    seen = {step: watch.seen[step] for step in ("pod_created", "scheduled")}
    api_marks = {i: {step: at[i] for step, at in seen.items() if i in at} for i in sent_at}
    node_marks = await asyncio.to_thread(events.marks, pod_names, offset) if events is not None else {}
    # event sent -> each step: the pod's spans, the namespace's pods, containerd's events, the logs
    result["steps"] = breakdown(
        COLD_STEPS if events is not None else COLD_STEPS_API,
        sent_at,
        merge_marks(pod, api_marks, node_marks, {i: {"runner_started": at} for i, at in runners.items()}),
        held="runner_started",
    )
    result.update(
        running_p50_ms=pct(running_ms, 50),
        running_p99_ms=pct(running_ms, 99),
        all_running_seconds=all_running_s,
    )
    return result


#: Creates sent one at a time on a full pool after the burst: the uncontended warm latency.
SEQUENTIAL_WARM = 10
#: The longest the bench waits for a settled pool's assignment sessions before it sends anyway.
SESSIONS_TIMEOUT_S = 15.0


async def _warm_burst(
    kubeconfig: str,
    image: str,
    env: dict[str, str],
    sequential_env: dict[str, str],
    show: bool,
    n: int,
    pod_burst: PodBurst,
) -> dict[str, Any]:
    """A pool of N, filled; N creates through the pod claim from it (time to SandboxProvisioned
    committed = claim Ready + the secrets delivered); how fast the pool refills; then creates one
    at a time on the refilled pool (what a single user waits). Launches and misses are the pool's
    metrics; claim created -> secrets held is the bench's watch on the claims."""
    from kubernetes import client

    from drivers.agent_sandbox.driver import new_agent_sandbox_provisioner

    async with _namespace(kubeconfig) as (api, namespace):
        provisioner = new_agent_sandbox_provisioner(
            _driver_config(kubeconfig, image, namespace, warm_pool_size=str(n)), logger
        )
        warm = provisioner.warm
        assert warm is not None
        refill: dict[str, float] = {}
        burst_ids: list[str] = []
        sequential_ids: list[str] = []
        launches: dict[str, int] = {}
        misses = 0

        handovers: dict[str, int] = {}

        def count_pod_metrics() -> None:
            """Add the launches, misses and handovers of the pod that just ran (its registry, its counts)."""
            nonlocal misses
            pod_launches, pod_misses = warm_counts(warm.metrics)
            for launch, count in pod_launches.items():
                launches[launch] = launches.get(launch, 0) + count
            misses += pod_misses
            for family in warm.metrics.handovers.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        via = sample.labels["via"]
                        handovers[via] = handovers.get(via, 0) + int(sample.value)

        async def until_full(timeout_s: float = RUNNING_TIMEOUT_S) -> float:
            started = time.monotonic()
            while await warm.ready_replicas() < n:
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"the warm pool did not reach {n} ready in {timeout_s:.0f}s")
                await asyncio.sleep(0.1)
            return time.monotonic() - started

        async def until_sessions(timeout_s: float = SESSIONS_TIMEOUT_S) -> None:
            """A settled pool has its assignment sessions open (each idle pod's, opened ahead); a
            pod without one is handed its secrets by a fresh exec, which the handovers count."""
            deadline = time.monotonic() + timeout_s
            while warm.sessions_open < n and time.monotonic() < deadline:
                await asyncio.sleep(0.1)

        refilling: asyncio.Task[float] | None = None
        # each create's way, step by step: the pod's spans, the pool's timelines, the runners' logs
        offset = wall_offset()
        recorder = SpanRecorder()
        timelines: dict[str, dict[str, float]] = {}
        runners: dict[str, float] = {}
        burst_sent: dict[str, float] = {}
        sequential_sent: dict[str, float] = {}
        warm.on_timeline = timelines.__setitem__

        async def read_runners() -> None:
            for name in [name for name in timelines if name not in runners]:
                started = await asyncio.to_thread(_runner_started, api, namespace, name, offset)
                if started is not None:
                    runners[name] = started

        with claims_assigned(api, namespace) as claims, recorder.recording():
            try:
                await warm.prepare()
                fill_s = await until_full()
                await until_sessions()

                async def start_refill_clock(ids: list[str], sent: dict[str, float]) -> None:
                    nonlocal refilling
                    burst_ids.extend(ids)
                    burst_sent.update(sent)
                    # warm_assignment=async: every runner gets its secrets before the burst is torn down
                    # (a deprovision cancels a delivery still running); the pool refills from there.
                    await warm.settled()
                    refill["from"] = time.monotonic()
                    refilling = asyncio.create_task(until_full())
                    await read_runners()

                result = await pod_burst(
                    env,
                    provisioner,
                    n,
                    show,
                    f"agent-sandbox warm burst of {n}",
                    900,
                    after_provision=start_refill_clock,
                )
                count_pod_metrics()
                assert refilling is not None
                refill_s = await refilling
                core: Any = client.CoreV1Api(api)

                def settled() -> bool:
                    """No pod of the burst still terminating: what a single user meets on a quiet node."""
                    pods = core.list_namespaced_pod(namespace).items
                    return not any(pod.metadata.deletion_timestamp for pod in pods)

                async def sequential(ids: list[str], sent: dict[str, float]) -> None:
                    sequential_ids.extend(ids)
                    sequential_sent.update(sent)
                    await warm.settled()  # the last one's delivery too
                    await read_runners()

                async def quiet_and_full() -> None:
                    await warm.settled()
                    await until_full()
                    while not await asyncio.to_thread(settled):
                        await asyncio.sleep(0.2)
                    await until_sessions()

                one_by_one = await pod_burst(
                    sequential_env,
                    provisioner,
                    min(SEQUENTIAL_WARM, n),
                    show,
                    "agent-sandbox warm, one at a time",
                    600,
                    one_at_a_time=True,
                    before_each=quiet_and_full,
                    after_provision=sequential,
                )
                count_pod_metrics()
                # Every delivery has ended; a missed claim (gone cold) is never annotated: no long wait.
                await claims.reached("assigned", burst_ids + sequential_ids, timeout_s=10)
            finally:
                if refilling is not None and not refilling.done():
                    refilling.cancel()
                await provisioner.close()
    marks = _warm_marks(recorder.spans, timelines, runners, offset)
    created, assigned = claims.seen["created"], claims.seen["assigned"]
    burst_assigned = [assigned[i] - created[i] for i in burst_ids if i in assigned and i in created]
    sequential_assigned = [assigned[i] - created[i] for i in sequential_ids if i in assigned and i in created]
    result.update(
        pool_fill_seconds=fill_s,
        pool_refill_seconds=refill_s,
        pool_refill_per_s=n / refill_s if refill_s else 0.0,
        sequential_n=one_by_one["n"],
        sequential_p50_ms=one_by_one["time_to_sandbox_p50_ms"],
        sequential_p99_ms=one_by_one["time_to_sandbox_p99_ms"],
        sequential_samples_ms=one_by_one["samples_ms"],
        launches=launches,
        adoption_misses=misses,
        # how each runner got its secrets: the session opened ahead in its pod, or a fresh exec
        handovers=handovers,
        assignment=warm.assignment,
        # claim created -> the claim annotated stigmer.ai/assigned (after the secrets are held), as the
        # bench's watch first saw them
        assigned_p50_ms=pct(burst_assigned, 50) * 1000,
        assigned_p99_ms=pct(burst_assigned, 99) * 1000,
        sequential_assigned_p50_ms=pct(sequential_assigned, 50) * 1000,
        sequential_assigned_p99_ms=pct(sequential_assigned, 99) * 1000,
        # event sent -> each step (launch_steps.WARM_STEPS), one at a time and in the burst
        sequential_steps=breakdown(WARM_STEPS, sequential_sent, marks),
        burst_steps=breakdown(WARM_STEPS, burst_sent, marks),
    )
    return result


def _warm_marks(
    spans: list[Any], timelines: dict[str, dict[str, float]], runners: dict[str, float], offset: float
) -> dict[str, dict[str, float]]:
    """Every warm step's mark by execution id: the pod's spans, the pool's timelines and the
    runners' first lines (both by claim name, which the driver span names)."""
    pod, names = pod_marks(spans, offset)
    return merge_marks(
        pod,
        {names[name]: timeline for name, timeline in timelines.items() if name in names},
        {names[name]: {"runner_started": at} for name, at in runners.items() if name in names},
    )


def _runner_started(api: Any, namespace: str, claim: str, offset: float) -> float | None:
    """When the runner of the claim ``claim``'s pod printed its first line (monotonic), or None."""
    from kubernetes import client

    from drivers.agent_sandbox.warm import CLAIMS, EXT_GROUP, EXT_VERSION
    from drivers.kubernetes.manifests import CONTAINER_NAME

    custom: Any = client.CustomObjectsApi(api)
    core: Any = client.CoreV1Api(api)
    try:
        found = custom.get_namespaced_custom_object(EXT_GROUP, EXT_VERSION, namespace, CLAIMS, claim)
        pod = ((found.get("status") or {}).get("sandbox") or {}).get("name")
        if not pod:
            return None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the runner starts just after the secrets land
            text = core.read_namespaced_pod_log(pod, namespace, container=CONTAINER_NAME, timestamps=True)
            started = runner_started(text, offset)
            if started is not None:
                return started
            time.sleep(0.1)
    except Exception as exc:
        logger.warning("runner log not read", extra={"claim": claim, "error": str(exc)})
    return None
