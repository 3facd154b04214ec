"""The warm-pool path of the agent-sandbox driver: keep the pool, claim from it, hand the claim its secrets.

``warm_pool_size`` > 0 turns it on. The driver then applies one SandboxTemplate + SandboxWarmPool
(``drivers.agent_sandbox_warm``) on first use, and an ensure of a workflow or connect sandbox that
finds nothing first claims from the pool:

1. create SandboxClaim ``<base>`` (labels as a Sandbox would have; the task queue as an annotation);
2. wait until the claim names its Sandbox and is Ready (``warm_adopt_timeout_seconds``, default 10);
3. write the secrets into the pod over exec stdin (``assignment_file``).

A claim that is not Ready in time, or whose pod will not take the assignment, is an adoption miss:
the claim is deleted and the ensure falls back to a cold Sandbox of its own. The controller itself
cold-starts a claim when the pool is empty; that counts as launch type ``cold``.

Metrics (on the pod's registry once bound): time to sandbox by launch type, the pool's ready
replicas, adoption misses.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Final

from kubernetes import client as k8s
from kubernetes.stream import stream
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from drivers.agent_sandbox_manifests import GROUP, PLURAL, VERSION
from drivers.agent_sandbox_warm import (
    CLAIMS,
    EXT_GROUP,
    EXT_VERSION,
    LAUNCH_TYPE_LABEL,
    POOLS,
    TEMPLATES,
    assignment_command,
    assignment_file,
    claim_manifest,
    pool_manifest,
    pool_name,
    template_manifest,
)
from drivers.contract import SandboxEnvironment, SandboxError, SandboxScope
from drivers.kubernetes_driver import APPLY_CONTENT_TYPE, FIELD_MANAGER
from drivers.kubernetes_manifests import CONTAINER_NAME
from drivers.naming import sandbox_base_name

if TYPE_CHECKING:
    from drivers.agent_sandbox_driver import AgentSandboxProvisioner

DEFAULT_ADOPT_TIMEOUT_S: Final = 10.0
#: How long a missed claim may take to go (a foreground delete: its cold-made Sandbox and pod first).
GONE_TIMEOUT_S: Final = 60.0
POLL_S: Final = 0.02


def _ready(obj: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


class WarmPoolMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.time_to_sandbox = Histogram(
            "sandbox_lanes_agent_sandbox_time_to_sandbox_seconds",
            "Claim created to claim Ready (and the secrets delivered), by launch type",
            ["launch_type"],
            buckets=(0.05, 0.1, 0.15, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        self.pool_ready = Gauge(
            "sandbox_lanes_agent_sandbox_warm_pool_ready", "Ready sandboxes in the warm pool", registry=r
        )
        self.misses = Counter(
            "sandbox_lanes_agent_sandbox_adoption_misses",
            "Warm claims that fell back to a cold Sandbox, by reason",
            ["reason"],
            registry=r,
        )


class WarmPool:
    def __init__(self, driver: AgentSandboxProvisioner, size: int, adopt_timeout_s: float) -> None:
        self._driver = driver
        self.size = size
        self.adopt_timeout_s = adopt_timeout_s
        self.name = pool_name(driver.config)
        self._applied = False
        self._apply_lock = asyncio.Lock()
        self.metrics = WarmPoolMetrics()
        #: Claims by launch type, and misses, since start (the bench's figures; metrics carry the same).
        self.launches: dict[str, int] = {}
        self.missed = 0

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        self.metrics = WarmPoolMetrics(registry)

    async def prepare(self) -> None:
        """Apply the template and the pool (once per process; server-side apply is idempotent)."""
        async with self._apply_lock:
            if self._applied:
                return
            d = self._driver
            cfg = d.config
            for plural, manifest in (
                (TEMPLATES, template_manifest(cfg)),
                (POOLS, pool_manifest(cfg, self.size)),
            ):
                await d.call(
                    f"apply {manifest['kind']} {cfg.kubernetes_namespace}/{self.name}",
                    d.custom.patch_namespaced_custom_object,
                    EXT_GROUP,
                    EXT_VERSION,
                    cfg.kubernetes_namespace,
                    plural,
                    self.name,
                    manifest,
                    field_manager=FIELD_MANAGER,
                    force=True,
                    _content_type=APPLY_CONTENT_TYPE,
                )
            self._applied = True

    async def ready_replicas(self) -> int:
        d = self._driver
        pool = await d.call(
            f"read SandboxWarmPool {self.name}",
            d.custom.get_namespaced_custom_object,
            EXT_GROUP,
            EXT_VERSION,
            d.config.kubernetes_namespace,
            POOLS,
            self.name,
            tolerate=frozenset({404}),
        )
        ready = (
            int(((pool or {}).get("status") or {}).get("readyReplicas") or 0) if isinstance(pool, dict) else 0
        )
        self.metrics.pool_ready.set(ready)
        return ready

    async def read_claim(self, name: str) -> dict[str, Any] | None:
        d = self._driver
        obj = await d.call(
            f"read SandboxClaim {d.config.kubernetes_namespace}/{name}",
            d.custom.get_namespaced_custom_object,
            EXT_GROUP,
            EXT_VERSION,
            d.config.kubernetes_namespace,
            CLAIMS,
            name,
            tolerate=frozenset({404}),
        )
        return obj if isinstance(obj, dict) else None

    async def delete_claim(self, name: str) -> None:
        d = self._driver
        await d.call(
            f"delete SandboxClaim {d.config.kubernetes_namespace}/{name}",
            d.custom.delete_namespaced_custom_object,
            EXT_GROUP,
            EXT_VERSION,
            d.config.kubernetes_namespace,
            CLAIMS,
            name,
            propagation_policy="Foreground",
            tolerate=frozenset({404}),
        )

    async def claimed_sandbox(self, name: str) -> dict[str, Any] | None:
        """The Sandbox a live claim ``name`` adopted or made, if any."""
        claim = await self.read_claim(name)
        if claim is None or (claim.get("metadata") or {}).get("deletionTimestamp"):
            return None
        adopted = ((claim.get("status") or {}).get("sandbox") or {}).get("name")
        return await self._driver.read_sandbox(adopted) if adopted else None

    async def try_adopt(self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment) -> str | None:
        """The launch type (``warm`` / ``cold``) of a Ready claim holding the secrets, or ``None``
        (an adoption miss: the claim is gone again and the caller makes a cold Sandbox)."""
        d = self._driver
        base = sandbox_base_name(scope, sandbox_id)
        started = time.monotonic()
        try:
            await self.prepare()  # no extensions API or no RBAC for it: a miss, the cold path still works
            await d.call(
                f"create SandboxClaim {d.config.kubernetes_namespace}/{base}",
                d.custom.create_namespaced_custom_object,
                EXT_GROUP,
                EXT_VERSION,
                d.config.kubernetes_namespace,
                CLAIMS,
                claim_manifest(d.config, scope, sandbox_id, env),
                env=env,
                field_manager=FIELD_MANAGER,
                tolerate=frozenset({409}),
            )
            sandbox = await self._wait_ready(base, started)
            if sandbox is None:
                await self._miss(base, "not ready in time")
                return None
            name = str(sandbox["metadata"]["name"])
            await self._assign(name, env)
        except SandboxError as exc:
            d.logger.warning(
                "agent-sandbox warm adoption failed; falling back to a cold sandbox",
                extra={"sandbox": base, "error": str(exc)},
            )
            await self._miss(base, "error")
            return None
        launch = str(((sandbox.get("metadata") or {}).get("labels") or {}).get(LAUNCH_TYPE_LABEL) or "cold")
        self.metrics.time_to_sandbox.labels(launch).observe(time.monotonic() - started)
        self.launches[launch] = self.launches.get(launch, 0) + 1
        return launch

    async def _miss(self, base: str, reason: str) -> None:
        """Count the miss and delete the claim, waiting until it is gone: the controller may have
        cold-created a Sandbox named ``base`` for it, which the caller's own create would meet."""
        self.metrics.misses.labels(reason).inc()
        self.missed += 1
        await self.delete_claim(base)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while await self.read_claim(base) is not None:
            if time.monotonic() > deadline:
                raise SandboxError(
                    f"agent-sandbox SandboxClaim {base} still there {GONE_TIMEOUT_S:.0f}s after a miss"
                )
            await asyncio.sleep(0.2)

    async def reassign(self, name: str, env: SandboxEnvironment) -> None:
        """A live claim's pod gets its secrets again (a fresh token, as upstream's Running arm
        rewrites the Secret): an earlier delivery may have failed, or the pod been recreated."""
        await self._assign(name, env)

    async def _wait_ready(self, base: str, started: float) -> dict[str, Any] | None:
        """The claim's Sandbox once the claim is Ready; neither may be on its way out."""
        while time.monotonic() - started < self.adopt_timeout_s:
            claim = await self.read_claim(base)
            alive = claim is not None and not (claim.get("metadata") or {}).get("deletionTimestamp")
            adopted = ((claim or {}).get("status") or {}).get("sandbox", {}).get("name") if alive else None
            if claim is not None and adopted and _ready(claim):
                sandbox = await self._driver.read_sandbox(adopted)
                if sandbox is not None and not (sandbox.get("metadata") or {}).get("deletionTimestamp"):
                    return sandbox
            await asyncio.sleep(POLL_S)
        return None

    async def _assign(self, pod: str, env: SandboxEnvironment) -> None:
        """Write the secrets into the adopted pod over exec stdin; never into any API object."""
        d = self._driver
        data = assignment_file(d.config, env)

        def run() -> int | None:
            # kubernetes.stream swaps the ApiClient's request method for the call's duration, so an
            # exec on the shared client would send concurrent REST calls over websockets: a client
            # of its own per exec.
            exec_client: Any = k8s.ApiClient(d.api_client.configuration)
            try:
                return _exec(k8s.CoreV1Api(exec_client))
            finally:
                exec_client.close()

        def _exec(core: Any) -> int | None:
            resp: Any = stream(
                core.connect_get_namespaced_pod_exec,
                pod,
                d.config.kubernetes_namespace,
                container=CONTAINER_NAME,
                command=assignment_command(len(data)),
                stdin=True,
                stdout=True,
                stderr=True,
                tty=False,
                _preload_content=False,
            )
            try:
                resp.write_stdin(data)
                deadline = time.monotonic() + 30
                while resp.is_open() and time.monotonic() < deadline:
                    resp.update(timeout=1)
                code: int | None = resp.returncode
                return code
            finally:
                resp.close()

        try:
            code = await asyncio.to_thread(run)
        except Exception as exc:  # websocket errors, a Failure status without causes, ...
            raise SandboxError(
                f"agent-sandbox assignment to pod {pod} failed: {type(exc).__name__}"
            ) from None
        if code != 0:
            raise SandboxError(f"agent-sandbox assignment to pod {pod} failed (exit {code})")


__all__ = ["GROUP", "PLURAL", "VERSION", "WarmPool", "WarmPoolMetrics"]
