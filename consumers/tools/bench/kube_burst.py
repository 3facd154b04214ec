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
from consumers.tools.bench.common import pct

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
async def kube_cluster(args: Any) -> AsyncIterator[tuple[str, str, str]]:
    """``(kubeconfig, runner image, description)``: ``--kubeconfig`` as given, or a private node."""
    if args.kubeconfig:
        if not args.runner_image:
            raise RuntimeError("--kubeconfig needs --runner-image (an image the cluster can run)")
        yield args.kubeconfig, args.runner_image, "given cluster"
        return
    try:
        from harness.kube_node import RUNNER_IMAGE, KubeNode
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            "a private single-node cluster needs the dev harness (a checkout set up by"
            " scripts/bootstrap.sh); otherwise pass --kubeconfig and --runner-image"
        ) from exc
    loop = asyncio.get_running_loop()
    node = KubeNode()
    await loop.run_in_executor(None, node.start)
    try:
        yield str(node.kubeconfig_path), RUNNER_IMAGE, "single-node cluster"
    finally:
        await loop.run_in_executor(None, node.stop)


class RunningWatch:
    """A watch on one namespace's pods: when each sandbox id's pod first reported Running."""

    def __init__(self, api: Any, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.running: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-running-watch", daemon=True)

    def __enter__(self) -> RunningWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        from kubernetes import client, watch

        from drivers.naming import LABEL_SANDBOX_ID

        core: Any = client.CoreV1Api(self.api)
        new_watch: Any = watch.Watch
        while not self._stop.is_set():
            stream: Any = new_watch()
            try:
                for event in stream.stream(core.list_namespaced_pod, self.namespace, timeout_seconds=2):
                    pod = event["object"]
                    sandbox_id = (pod.metadata.labels or {}).get(LABEL_SANDBOX_ID)
                    if sandbox_id and pod.status.phase == "Running":
                        self.running.setdefault(sandbox_id, time.perf_counter())
                    if self._stop.is_set():
                        break
            except Exception as exc:  # a dropped watch is re-opened; the figure only needs the first Running
                logger.debug("pod watch restarted", extra={"error": str(exc)})
            finally:
                stream.stop()


async def kubernetes_burst(
    args: Any,
    env: dict[str, str],
    show: bool,
    n: int,
    pod_burst: Callable[..., Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    from kubernetes import client, config

    from drivers.contract import DriverConfig
    from drivers.kubernetes_driver import new_kubernetes_provisioner

    async with kube_cluster(args) as (kubeconfig, image, cluster):
        cfg = client.Configuration()
        load: Any = config.load_kube_config
        load(config_file=kubeconfig, client_configuration=cfg)
        api: Any = client.ApiClient(cfg)
        core: Any = client.CoreV1Api(api)
        namespace = f"bench-{uuid.uuid4().hex[:8]}"
        await asyncio.to_thread(core.create_namespace, {"metadata": {"name": namespace}})
        provisioner = new_kubernetes_provisioner(
            DriverConfig(
                backend_endpoint="http://127.0.0.1:7234",
                temporal_address="127.0.0.1:7233",
                runner_image=image,
                kubernetes_namespace=namespace,
                options={"kubeconfig": kubeconfig, **BENCH_RUNNER_OPTIONS},
            ),
            logger,
        )
        running_ms: list[float] = []
        all_running_s = 0.0
        try:
            with RunningWatch(api, namespace) as watch:

                async def until_running(ids: list[str], sent: dict[str, float]) -> None:
                    nonlocal all_running_s
                    deadline = time.monotonic() + RUNNING_TIMEOUT_S
                    shown = 0
                    with progress("kubernetes burst: runner pods Running", n, enabled=show) as bar:
                        while (done := sum(1 for i in ids if i in watch.running)) < n:
                            if time.monotonic() > deadline:
                                raise TimeoutError(
                                    f"{done}/{n} runner pods Running in {RUNNING_TIMEOUT_S:.0f}s"
                                )
                            bar.advance(done - shown)
                            shown = done
                            await asyncio.sleep(0.1)
                        bar.advance(n - shown)
                    running_ms.extend((watch.running[i] - sent[i]) * 1000 for i in ids)
                    all_running_s = max(watch.running[i] for i in ids) - min(sent.values())

                result = await pod_burst(
                    env, provisioner, n, show, f"kubernetes burst of {n}", 900, after_provision=until_running
                )
        finally:
            await provisioner.close()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(core.delete_namespace, namespace)
            api.close()
    result.update(
        cluster=cluster,
        running_p50_ms=pct(running_ms, 50),
        running_p99_ms=pct(running_ms, 99),
        all_running_seconds=all_running_s,
    )
    return result
