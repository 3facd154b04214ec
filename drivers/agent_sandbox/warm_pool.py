"""The warm-pool path of the agent-sandbox driver: keep the pool, claim from it, hand the claim its secrets.

``warm_pool_size`` > 0 turns it on. The driver then applies one SandboxTemplate + SandboxWarmPool
(``drivers.agent_sandbox.warm``) on first use, and an ensure of a workflow or connect sandbox that
finds nothing first claims from the pool:

1. create SandboxClaim ``<base>`` (labels as a Sandbox would have; the task queue as an annotation);
2. wait until the claim names its Sandbox and that Sandbox (or the claim) is Ready
   (``warm_adopt_timeout_seconds``, default 10), on the claim watch (``claim_watch``);
3. write the secrets (and the task queue) into the pod over exec stdin (``assignment_file``): into
   the exec opened ahead in that pod while it sat idle in the pool (``exec_sessions``), else a
   fresh exec.

A claim that is not Ready in time, or whose pod will not take the assignment, is an adoption miss:
the claim is deleted and the ensure falls back to a cold Sandbox of its own. The controller itself
cold-starts a claim when the pool is empty; that counts as launch type ``cold``.

``warm_assignment`` says when the ensure returns. ``async`` (the default): once the claim and its
assignment Secret exist (upstream's posture: no driver waits for readiness); steps 2 and 3, and a
miss's cold fallback, then run in a delivery task, and the claim is annotated
``stigmer.ai/assigned`` once its pod holds the secrets. A driver that starts finds claims without
that annotation and delivers their Secret's assignment (``recover``). ``sync``: after step 3, so
``SandboxProvisioned`` means the runner holds its assignment.

Metrics (on the pod's registry once bound): time to sandbox by launch type, the pool's ready
replicas, adoption misses.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from kubernetes import client as k8s
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from drivers.agent_sandbox.claim_watch import ClaimWatch
from drivers.agent_sandbox.exec_connect import CONNECT_TIMEOUT_S, close_exec, open_exec
from drivers.agent_sandbox.exec_sessions import (
    CLOSE_TIMEOUT_S,
    EXIT_TIMEOUT_S,
    ExecSessions,
    Session,
    feed_and_wait,
    write_and_wait,
)
from drivers.agent_sandbox.manifests import GROUP, PLURAL, VERSION
from drivers.agent_sandbox.warm import (
    ANNOTATION_ASSIGNED,
    ANNOTATION_SANDBOX_ID,
    ASSIGNMENT_SECRET_KEY,
    CLAIMS,
    EXT_GROUP,
    EXT_VERSION,
    LAUNCH_TYPE_LABEL,
    POOL_NAME_PREFIX,
    POOLS,
    TEMPLATES,
    WARM_POD_LABEL,
    WARM_SCOPES,
    assigned_patch,
    assignment_command,
    assignment_file,
    assignment_secret_manifest,
    assignment_session_command,
    assignment_session_payload,
    claim_manifest,
    pool_manifest,
    pool_name,
    template_manifest,
)
from drivers.contract import DriverConfig, SandboxCollision, SandboxEnvironment, SandboxError, SandboxScope
from drivers.kubernetes.driver import APPLY_CONTENT_TYPE, FIELD_MANAGER, WRITE_ATTEMPTS, Found
from drivers.kubernetes.manifests import CONTAINER_NAME, secret_name
from drivers.naming import LABEL_SANDBOX_ID, LABEL_SCOPE, is_installations, is_owned_by, sandbox_base_name
from resilience.backoff import Backoff


class PoolDriver(Protocol):
    """What the pool uses of its driver (``AgentSandboxProvisioner``), so that the pool never imports it."""

    @property
    def config(self) -> DriverConfig: ...
    @property
    def logger(self) -> logging.Logger: ...
    @property
    def custom(self) -> Any: ...  # the CustomObjectsApi
    @property
    def core(self) -> Any: ...  # the CoreV1Api
    @property
    def api_client(self) -> Any: ...  # for exec's own client
    @property
    def installation(self) -> str: ...
    @property
    def selector(self) -> str: ...  # this installation's objects
    def owns(self, found: Found, scope: SandboxScope, sandbox_id: str) -> bool: ...
    async def call(self, action: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...
    def found(self, obj: Mapping[str, Any], kind: str) -> Found: ...
    async def find(self, kind: str, name: str) -> Found | None: ...
    async def write_secret(
        self, manifest: dict[str, Any], scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> tuple[str, bool]: ...
    def check_owner(self, found: Found | None, name: str, scope: SandboxScope, sandbox_id: str) -> None: ...
    async def read_sandbox(self, name: str) -> dict[str, Any] | None: ...
    async def ensure_cold(self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment) -> None: ...


DEFAULT_ADOPT_TIMEOUT_S: Final = 10.0
ASSIGNMENT_MODES: Final = ("async", "sync")
#: Exec attempts per delivery (a pod just Ready may not take an exec at once), the pause before the
#: next one doubling from ASSIGN_RETRY_S (the one backoff, jittered).
ASSIGN_ATTEMPTS: Final = 3
ASSIGN_RETRY_S: Final = 0.2
#: How long a missed claim may take to go (a foreground delete: its cold-made Sandbox and pod first).
GONE_TIMEOUT_S: Final = 60.0
POLL_S: Final = 0.02
#: The refresh's list of the pool's idle pods gives up after this (the next refresh lists again).
LIST_TIMEOUT_S: Final = 10.0
#: How long a fresh exec's process may take to write the assignment and end.
FRESH_EXEC_TIMEOUT_S: Final = 30.0
#: The most a delivery awaits its fresh exec: the connect's deadline, the process's, the close's, and
#: time for one of the delivery threads to be free (past it the thread still ends on those deadlines).
FRESH_EXEC_AWAIT_S: Final = 2 * CONNECT_TIMEOUT_S + FRESH_EXEC_TIMEOUT_S + CLOSE_TIMEOUT_S
#: The most a delivery awaits its write into a session opened ahead (the process's deadline, the close's).
SESSION_AWAIT_S: Final = CONNECT_TIMEOUT_S + EXIT_TIMEOUT_S + CLOSE_TIMEOUT_S
#: With the claim watch up: the longest a delivery waits for a change before it reads its claim anew.
WATCH_FALLBACK_S: Final = 0.5
#: A named Sandbox not Ready yet is read again after POLL_S, then 1.5 x longer each time, up to this.
UNREADY_MAX_S: Final = 0.2
UNREADY_FACTOR: Final = 1.5
#: A warm claim's steps, in order (``warm_assignment=async``): its timeline records when each was
#: reached (``time.monotonic``), and the step histogram observes each one's seconds since the step
#: before it. ``ensure``: the driver's ensure began; ``claim_created``: the API answered the claim's
#: create; ``secret_kept``: its assignment Secret written (the ensure returns here); ``named``: the
#: claim names its Sandbox (the controller adopted a pool pod); ``ready``: that Sandbox seen Ready;
#: ``secrets_held``: the exec that writes the assignment file into the pod returned 0 (the runner
#: holds its secrets); ``marked``: the claim annotated ``stigmer.ai/assigned``.
WARM_STEPS: Final = ("ensure", "claim_created", "secret_kept", "named", "ready", "secrets_held", "marked")


def _ready(obj: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


def _kept_for(secret: Any, scope: SandboxScope, sandbox_id: str, installation: str, claim_uid: str) -> bool:
    """Is ``secret`` the kept assignment of the claim ``claim_uid`` (its labels and its owner)?"""
    meta = getattr(secret, "metadata", None)
    if meta is None or not is_owned_by(meta.labels, scope, sandbox_id, installation):
        return False
    return any(getattr(ref, "uid", None) == claim_uid for ref in meta.owner_references or [])


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
        self.handovers = Counter(
            "sandbox_lanes_agent_sandbox_assignment_handovers",
            "Assignments a pod took, by way: the exec session opened ahead in it, or a fresh exec",
            ["via"],
            registry=r,
        )
        self.warm_step = Histogram(
            "sandbox_lanes_agent_sandbox_warm_step_seconds",
            "A warm claim's delivery, step by step: seconds from the step before (WARM_STEPS)",
            ["step"],
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.25, 0.5, 1, 2, 5),
            registry=r,
        )


class WarmPool:
    def __init__(
        self, driver: PoolDriver, size: int, adopt_timeout_s: float, assignment: str = "async"
    ) -> None:
        self._driver = driver
        self.size = size
        self.adopt_timeout_s = adopt_timeout_s
        self.assignment = assignment
        #: Delivery tasks by claim name (``async``): cancelled by a deprovision and by ``close``.
        self._deliveries: dict[str, asyncio.Task[None]] = {}
        self.name = pool_name(driver.config)
        self._applied = False
        self._apply_lock = asyncio.Lock()
        self.metrics = WarmPoolMetrics()
        #: This installation's claims as a watch sees them, and the assignment sessions opened ahead in
        #: the pool's idle pods (both started with the pool's first use).
        self._watch: ClaimWatch | None = None
        self._sessions: ExecSessions | None = None
        #: Each warm claim's timeline by claim name, from its ensure until its delivery ends.
        self._timelines: dict[str, dict[str, float]] = {}
        #: Called with (claim name, timeline) when a claim made by an ensure holds its secrets
        #: (the bench's hook; the histogram and the delivery's log line carry the same steps).
        self.on_timeline: Callable[[str, dict[str, float]], None] | None = None

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        self.metrics = WarmPoolMetrics(registry)

    async def prepare(self) -> None:
        """Apply the template and the pool (once per process; server-side apply is idempotent)."""
        async with self._apply_lock:
            if self._applied:
                return
            cfg = self._driver.config
            for plural, manifest in (
                (TEMPLATES, template_manifest(cfg)),
                (POOLS, pool_manifest(cfg, self.size)),
            ):
                await self._write_pool_object(plural, manifest)
            await self._delete_stale_pairs()
            self._applied = True
            self._start_watch()
            self._start_sessions()

    @property
    def sessions_open(self) -> int:
        """Assignment sessions open in the pool's idle pods now."""
        return len(self._sessions) if self._sessions is not None else 0

    @property
    def watching(self) -> bool:
        """Is the claim watch up (its copy filled by a list, its watch open)?"""
        return self._watch is not None and self._watch.synced

    def _start_watch(self) -> None:
        """The claim watch the deliveries wait on (``claim_watch``), its own API client."""
        if self._watch is not None:
            return
        d = self._driver
        configuration = d.api_client.configuration
        self._watch = ClaimWatch(
            lambda: k8s.CustomObjectsApi(k8s.ApiClient(configuration)),
            d.config.kubernetes_namespace,
            d.selector,
            d.logger,
        )
        self._watch.start()

    def _start_sessions(self) -> None:
        """The assignment sessions kept open in the pool's idle pods (``exec_sessions``)."""
        if self._sessions is not None:
            return
        d = self._driver
        ns = d.config.kubernetes_namespace
        configuration = d.api_client.configuration

        def open_session(pod: str) -> Session:
            exec_client, resp = open_exec(
                configuration, pod, ns, CONTAINER_NAME, assignment_session_command()
            )
            return Session(pod, exec_client, resp)

        def idle_pods() -> list[str]:
            """This installation's Ready pods that belong to no sandbox yet (the pool's idle ones)."""
            listed: Any = k8s.CoreV1Api(d.api_client).list_namespaced_pod(
                ns,
                label_selector=f"{d.selector},{WARM_POD_LABEL}=true",
                resource_version="0",  # the API server's cache: a cheap read, at most a moment old
                _request_timeout=LIST_TIMEOUT_S,
            )
            pods: list[Any] = listed.items
            return [
                pod.metadata.name
                for pod in pods
                if not pod.metadata.deletion_timestamp
                and pod.status.phase == "Running"
                and LABEL_SANDBOX_ID not in (pod.metadata.labels or {})
                and ANNOTATION_SANDBOX_ID not in (pod.metadata.annotations or {})
                and any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))
            ]

        self._sessions = ExecSessions(open_session, idle_pods, d.logger, limit=max(1, self.size))
        self._sessions.start()

    async def _write_pool_object(self, plural: str, manifest: dict[str, Any]) -> None:
        """Create the template or pool, or apply it over this installation's own (at the
        resourceVersion listed); an object of the name that is not this installation's is refused."""
        d = self._driver
        ns = d.config.kubernetes_namespace
        where = f"{manifest['kind']} {ns}/{self.name}"
        for _ in range(WRITE_ATTEMPTS):
            ours = {
                str((item.get("metadata") or {}).get("name", "")): item
                for item in await self.list_ours(plural)
            }
            mine = ours.get(self.name)
            if mine is None:
                created = await d.call(
                    f"create {where}",
                    d.custom.create_namespaced_custom_object,
                    EXT_GROUP,
                    EXT_VERSION,
                    ns,
                    plural,
                    manifest,
                    field_manager=FIELD_MANAGER,
                    tolerate=frozenset({409}),
                )
                if created is not None:
                    return
                if self.name not in {
                    str((i.get("metadata") or {}).get("name", "")) for i in await self.list_ours(plural)
                }:
                    raise SandboxError(
                        f"agent-sandbox {where} exists and is not this installation's"
                        f" ({d.installation}): left untouched, the warm pool is not used"
                    )
                continue
            version = str((mine.get("metadata") or {}).get("resourceVersion", ""))
            applied = await d.call(
                f"apply {where}",
                d.custom.patch_namespaced_custom_object,
                EXT_GROUP,
                EXT_VERSION,
                ns,
                plural,
                self.name,
                {**manifest, "metadata": {**manifest["metadata"], "resourceVersion": version}},
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=APPLY_CONTENT_TYPE,
                tolerate=frozenset({404, 409}),
            )
            if applied is not None:
                return
        raise SandboxError(f"agent-sandbox {where} kept changing while the pool was prepared")

    async def _delete_stale_pairs(self) -> None:
        """Delete the pools and templates of an earlier runner template (a config change names a new
        pair): their warm pods would run for nothing. Sandboxes already claimed from them stay, since
        adoption makes the claim their owner."""
        d = self._driver
        ns = d.config.kubernetes_namespace
        for plural in (POOLS, TEMPLATES):
            for item in await self.list_ours(plural):  # this installation's only: never another's pool
                meta = item.get("metadata") or {}
                name, uid = str(meta.get("name", "")), str(meta.get("uid", ""))
                if name.startswith(POOL_NAME_PREFIX) and name != self.name and uid:
                    await d.call(
                        f"delete {plural} {ns}/{name}",
                        d.custom.delete_namespaced_custom_object,
                        EXT_GROUP,
                        EXT_VERSION,
                        ns,
                        plural,
                        name,
                        body={"preconditions": {"uid": uid}},
                        tolerate=frozenset({404, 409}),
                    )
                    d.logger.info(
                        "agent-sandbox stale warm pool object deleted", extra={"kind": plural, "object": name}
                    )

    async def list_ours(self, plural: str, tolerate: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
        """The extensions' objects of kind ``plural`` in the namespace that carry this installation's
        labels (listed by its selector, and each one's labels looked at again)."""
        d = self._driver
        listed = await d.call(
            f"list {plural} in {d.config.kubernetes_namespace}",
            d.custom.list_namespaced_custom_object,
            EXT_GROUP,
            EXT_VERSION,
            d.config.kubernetes_namespace,
            plural,
            label_selector=d.selector,
            tolerate=tolerate,
        )
        items = list((listed or {}).get("items") or []) if isinstance(listed, dict) else []
        return [i for i in items if is_installations((i.get("metadata") or {}).get("labels"), d.installation)]

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

    async def delete_claim(self, found: Found) -> None:
        """Delete exactly the claim checked (uid precondition: a replacement is never deleted)."""
        d = self._driver
        await d.call(
            f"delete SandboxClaim {found.where}",
            d.custom.delete_namespaced_custom_object,
            EXT_GROUP,
            EXT_VERSION,
            d.config.kubernetes_namespace,
            CLAIMS,
            found.name,
            propagation_policy="Foreground",
            body={"preconditions": {"uid": found.uid}},
            tolerate=frozenset({404, 409}),
        )

    async def _check_claim_owner(self, base: str, scope: SandboxScope, sandbox_id: str) -> str:
        """A claim found under the name (its create answered 409) must be this sandbox's: its uid."""
        claim = await self.read_claim(base)
        if claim is None:
            return ""
        found = self._driver.found(claim, "SandboxClaim")
        self._driver.check_owner(found, base, scope, sandbox_id)
        return found.uid

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
        uid = ""  # the claim this adoption made or found (and checked): the only one a miss deletes
        try:
            # (no extensions API or no RBAC for it: a miss, the cold path still works)
            created = await self._create_claim(scope, sandbox_id, env)
            if created is None:
                uid = await self._check_claim_owner(base, scope, sandbox_id)
            else:
                uid = str((created.get("metadata") or {}).get("uid", ""))
            sandbox = await self._wait_ready(base, started, uid)
            if sandbox is None:
                await self._miss(base, "not ready in time", scope, sandbox_id, uid)
                return None
            name = str(sandbox["metadata"]["name"])
            await self._assign(name, env)
        except SandboxCollision:
            raise  # another sandbox's claim: neither waited on, nor deleted as a miss
        except SandboxError as exc:
            d.logger.warning(
                "agent-sandbox warm adoption failed; falling back to a cold sandbox",
                extra={"sandbox": base, "error": str(exc)},
            )
            await self._miss(base, "error", scope, sandbox_id, uid)
            return None
        launch = str(((sandbox.get("metadata") or {}).get("labels") or {}).get(LAUNCH_TYPE_LABEL) or "cold")
        self.metrics.time_to_sandbox.labels(launch).observe(time.monotonic() - started)
        return launch

    # -- warm_assignment=async ---------------------------------------------------------------------

    async def claim_async(self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment) -> str:
        """The ``async`` ensure: the claim (or the live one) and its assignment Secret; the delivery
        runs behind. The arm: ``claimed`` (a live claim, its Secret refreshed) or ``warm-claimed``."""
        d = self._driver
        base = sandbox_base_name(scope, sandbox_id)
        data = assignment_file(d.config, env)
        started = time.monotonic()  # the adoption window and time to sandbox count from the claim's create
        timeline = {"ensure": started}
        # Create first (the common case costs one call); a 409 is a live claim or one on its way out.
        claim = await self._create_claim(scope, sandbox_id, env)
        timeline["claim_created"] = time.monotonic()
        arm = "warm-claimed"
        if claim is None:
            claim = await self.read_claim(base)
            if claim is not None and not (claim.get("metadata") or {}).get("deletionTimestamp"):
                d.check_owner(d.found(claim, "SandboxClaim"), base, scope, sandbox_id)
                arm = "claimed"
            else:
                if claim is not None:
                    await self._gone(base, str((claim.get("metadata") or {}).get("uid", "")))
                started = time.monotonic()  # the window is the new claim's, not the old one's exit
                claim = await self._create_claim(scope, sandbox_id, env) or await self.read_claim(base)
        if claim is None:
            raise SandboxError(f"agent-sandbox SandboxClaim {base} was created but cannot be read")
        d.check_owner(d.found(claim, "SandboxClaim"), base, scope, sandbox_id)
        uid = str((claim.get("metadata") or {}).get("uid", ""))
        secret = assignment_secret_manifest(d.config, scope, sandbox_id, data, uid)
        await d.write_secret(secret, scope, sandbox_id, env)  # absent or this sandbox's: conditional
        fallback = (scope, sandbox_id, env) if arm == "warm-claimed" else None
        if fallback is not None:
            timeline["secret_kept"] = time.monotonic()
            self._timelines[base] = timeline
        self._start_delivery(base, data, fallback, uid, started)
        return arm

    async def _create_claim(
        self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> dict[str, Any] | None:
        """The new claim, or ``None`` when one with the name exists (409)."""
        d = self._driver
        await self.prepare()
        created = await d.call(
            f"create SandboxClaim {d.config.kubernetes_namespace}/{sandbox_base_name(scope, sandbox_id)}",
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
        return created if isinstance(created, dict) else None

    def _start_delivery(
        self,
        base: str,
        data: bytes,
        fallback: tuple[SandboxScope, str, SandboxEnvironment] | None,
        uid: str,
        started: float | None = None,
    ) -> None:
        """Deliver ``data`` to the pod of the claim ``base`` whose uid is ``uid`` (checked by the caller)."""
        old = self._deliveries.pop(base, None)
        if old is not None:
            old.cancel()
        since = time.monotonic() if started is None else started
        task = asyncio.create_task(
            self._deliver(base, data, fallback, uid, since), name=f"agent-sandbox-assign-{base}"
        )
        self._deliveries[base] = task
        task.add_done_callback(
            lambda t: self._deliveries.pop(base, None) if self._deliveries.get(base) is t else None
        )

    async def _deliver(
        self,
        base: str,
        data: bytes,
        fallback: tuple[SandboxScope, str, SandboxEnvironment] | None,
        uid: str,
        started: float,
    ) -> None:
        """Wait for the claim's pod, hand it the secrets, mark the claim; a miss goes cold (when this
        process still holds the ensure's environment) or is logged for the operator. ``started`` is
        when the claim was created (or, after a restart, when its delivery began). Every step is on
        the claim ``uid`` only: a claim replaced meanwhile is neither waited on, marked nor deleted."""
        d = self._driver
        try:
            sandbox = await self._wait_ready(base, started, uid)
            reason = "not ready in time"
            if sandbox is not None:
                pod = str(sandbox["metadata"]["name"])
                retry = Backoff(first_s=ASSIGN_RETRY_S, cap_s=ASSIGN_RETRY_S * 2**ASSIGN_ATTEMPTS)
                for attempt in range(ASSIGN_ATTEMPTS):
                    try:
                        await self._assign_data(pod, data)
                        self._step(base, "secrets_held")
                        break
                    except SandboxError as exc:
                        if attempt == ASSIGN_ATTEMPTS - 1:
                            d.logger.warning(
                                "agent-sandbox warm assignment failed",
                                extra={"sandbox": base, "error": str(exc)},
                            )
                            reason, sandbox = "error", None
                        else:
                            await asyncio.sleep(retry.failed())
            if sandbox is not None:
                await self._mark_assigned(base, uid)
                self._step(base, "marked")
                launch = str(
                    ((sandbox.get("metadata") or {}).get("labels") or {}).get(LAUNCH_TYPE_LABEL) or "cold"
                )
                if fallback is not None:
                    # A claim this ensure created: one launch, timed from its create. A delivery to
                    # a live claim again (a re-run ensure, a restart's recovery) is neither.
                    self.metrics.time_to_sandbox.labels(launch).observe(time.monotonic() - started)
                d.logger.info(
                    "agent-sandbox warm assignment delivered",
                    extra={"sandbox": base, "launch": launch, "steps_ms": self._end_timeline(base)},
                )
                return
            if fallback is None:
                self.metrics.misses.labels(reason).inc()
                d.logger.error(
                    "agent-sandbox claim did not take its assignment (the next ensure delivers it again)",
                    extra={"sandbox": base, "reason": reason},
                )
                return
            scope, sandbox_id, env = fallback
            await self._miss(base, reason, scope, sandbox_id, uid)
            await d.ensure_cold(scope, sandbox_id, env)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the ensure has returned: nobody else would see this
            d.logger.error("agent-sandbox warm delivery failed", extra={"sandbox": base, "error": str(exc)})
        finally:
            self._timelines.pop(base, None)  # a miss, a failure or a cancel: no timeline of a launch

    def _step(self, base: str, step: str) -> None:
        """The claim ``base`` reached ``step`` now (its first time only; no timeline: not timed)."""
        timeline = self._timelines.get(base)
        if timeline is not None and step not in timeline:
            timeline[step] = time.monotonic()

    def _end_timeline(self, base: str) -> dict[str, float]:
        """Observe and hand on the timeline of the claim ``base``; its steps in ms since the one before."""
        timeline = self._timelines.pop(base, None)
        if timeline is None:
            return {}
        steps: dict[str, float] = {}
        before: float | None = None
        for step in WARM_STEPS:
            if step not in timeline:
                continue
            if before is not None:
                self.metrics.warm_step.labels(step).observe(timeline[step] - before)
                steps[step] = round((timeline[step] - before) * 1000, 1)
            before = timeline[step]
        if self.on_timeline is not None:
            self.on_timeline(base, timeline)
        return steps

    async def cancel_delivery(self, base: str) -> None:
        task = self._deliveries.pop(base, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def settled(self) -> None:
        """Every delivery running now has ended (tests and the bench)."""
        while self._deliveries:
            await asyncio.gather(*list(self._deliveries.values()), return_exceptions=True)

    async def close(self) -> None:
        for base in list(self._deliveries):
            await self.cancel_delivery(base)
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self._sessions is not None:
            await self._sessions.close()
            self._sessions = None

    async def recover(self) -> int:
        """Deliver the kept assignment of every claim of ours whose pod does not hold it yet (a
        restart between an ensure and its delivery); the number of deliveries started."""
        d = self._driver
        started = 0
        for claim in await self.list_ours(CLAIMS, tolerate=frozenset({404})):
            meta = claim.get("metadata") or {}
            base = str(meta.get("name", ""))
            labels = meta.get("labels") or {}
            scope, sandbox_id, uid = (
                labels.get(LABEL_SCOPE),
                labels.get(LABEL_SANDBOX_ID),
                str(meta.get("uid", "")),
            )
            if (
                not base
                or not uid
                or scope not in WARM_SCOPES
                or not sandbox_id
                or sandbox_base_name(scope, sandbox_id) != base  # a claim whose labels and name disagree
                or meta.get("deletionTimestamp")
                or (meta.get("annotations") or {}).get(ANNOTATION_ASSIGNED)
                or base in self._deliveries
            ):
                continue
            secret = await d.call(
                f"read Secret {d.config.kubernetes_namespace}/{secret_name(base)}",
                d.core.read_namespaced_secret,
                secret_name(base),
                d.config.kubernetes_namespace,
                tolerate=frozenset({404}),
            )
            if secret is None or not _kept_for(secret, scope, sandbox_id, d.installation, uid):
                continue  # not this claim's Secret (another's, or left from an earlier claim)
            raw = (getattr(secret, "data", None) or {}).get(ASSIGNMENT_SECRET_KEY)
            if not raw:
                continue  # made by a sync-mode ensure, or its Secret not written yet: the ensure's business
            self._start_delivery(base, base64.b64decode(raw), None, uid)
            started += 1
        return started

    async def _gone(self, base: str, uid: str) -> None:
        """Until the claim ``base`` with ``uid`` is gone (a claim made since under the name is not it)."""
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while (claim := await self.read_claim(base)) is not None and (
            str((claim.get("metadata") or {}).get("uid", "")) == uid
        ):
            if time.monotonic() > deadline:
                raise SandboxError(
                    f"agent-sandbox SandboxClaim {base} still being deleted after {GONE_TIMEOUT_S:.0f}s"
                )
            await asyncio.sleep(0.2)

    async def _miss(self, base: str, reason: str, scope: SandboxScope, sandbox_id: str, uid: str) -> None:
        """Count the miss and delete the claim this ensure made or checked (``uid``; "" = it made
        none: nothing is deleted), waiting until it is gone: the controller may have cold-created a
        Sandbox named ``base`` for it, which the caller's own create would meet. The claim is read
        and checked again first: another sandbox's (or installation's) is never deleted."""
        self.metrics.misses.labels(reason).inc()
        if not uid:
            return
        claim = await self.read_claim(base)
        if claim is None:
            return
        found = self._driver.found(claim, "SandboxClaim")
        if found.uid != uid:
            return  # replaced since: not the claim this ensure made
        self._driver.check_owner(found, base, scope, sandbox_id)
        await self.delete_claim(found)
        await self._gone(base, uid)

    async def _mark_assigned(self, base: str, uid: str) -> None:
        """Annotate the claim ``uid`` as holding its assignment: a merge patch at the resourceVersion of
        a read that found that very claim, still this installation's (409: read and tried again)."""
        d = self._driver
        for _ in range(WRITE_ATTEMPTS):
            claim = await self.read_claim(base)
            meta = (claim or {}).get("metadata") or {}
            if claim is None or str(meta.get("uid", "")) != uid:
                return  # gone or replaced: nothing of this delivery's to mark
            if not is_installations(meta.get("labels"), d.installation):
                return
            patch = assigned_patch()
            patch["metadata"]["resourceVersion"] = str(meta.get("resourceVersion", ""))
            done = await d.call(
                f"annotate SandboxClaim {d.config.kubernetes_namespace}/{base}",
                d.custom.patch_namespaced_custom_object,
                EXT_GROUP,
                EXT_VERSION,
                d.config.kubernetes_namespace,
                CLAIMS,
                base,
                patch,
                _content_type="application/merge-patch+json",
                tolerate=frozenset({404, 409}),
            )
            if done is not None:
                return
        raise SandboxError(f"agent-sandbox SandboxClaim {base} kept changing while it was marked assigned")

    async def reassign(self, name: str, env: SandboxEnvironment) -> None:
        """A live claim's pod gets its secrets again (a fresh token, as upstream's Running arm
        rewrites the Secret): an earlier delivery may have failed, or the pod been recreated."""
        await self._assign(name, env)

    async def _wait_ready(self, base: str, started: float, uid: str) -> dict[str, Any] | None:
        """The Sandbox of the claim ``uid`` once either is Ready; neither may be on its way out.

        The claim names a pool Sandbox (already Ready) a reconcile or more before the controller
        marks the claim itself Ready: the Sandbox's own Ready is enough to hand the secrets over.
        The claim is read from the claim watch's copy after each change it sees, and from the API
        server first, after ``WATCH_FALLBACK_S`` without a change, and while the watch is down
        (then every ``POLL_S``)."""
        watch = self._watch
        with contextlib.ExitStack() as stack:
            change = stack.enter_context(watch.listening(base)) if watch is not None else None
            fresh = True
            unready = Backoff(first_s=POLL_S, cap_s=UNREADY_MAX_S, factor=UNREADY_FACTOR, jitter=0.0)
            while time.monotonic() - started < self.adopt_timeout_s:
                if change is not None:
                    change.clear()  # a change from here on wakes the wait below
                claim = None if fresh or watch is None else watch.claim(base)
                if claim is None:
                    claim = await self.read_claim(base)
                meta = (claim or {}).get("metadata") or {}
                alive = (
                    claim is not None
                    and not meta.get("deletionTimestamp")
                    and str(meta.get("uid", "")) == uid
                )
                adopted = (
                    ((claim or {}).get("status") or {}).get("sandbox", {}).get("name") if alive else None
                )
                if claim is not None and adopted:
                    self._step(base, "named")
                    sandbox = await self._driver.read_sandbox(adopted)
                    if (
                        sandbox is not None
                        and not (sandbox.get("metadata") or {}).get("deletionTimestamp")
                        and (_ready(sandbox) or _ready(claim))
                    ):
                        self._step(base, "ready")
                        return sandbox
                    # Named, its Sandbox not Ready yet (still being adopted; or cold-made, the pool
                    # empty): the watch is on claims, not Sandboxes, so the Sandbox is read again
                    # soon, then less and less often.
                    fresh = False
                    await asyncio.sleep(unready.failed())
                    continue
                if change is not None and watch is not None and watch.synced:
                    left = self.adopt_timeout_s - (time.monotonic() - started)
                    fresh = not await change.wait(max(0.0, min(WATCH_FALLBACK_S, left)))
                else:
                    fresh = True
                    await asyncio.sleep(POLL_S)
        return None

    async def _hand_over(self, pod: str, data: bytes) -> bool:
        """Write ``data`` into the session opened ahead in ``pod``, if there is one: did its process
        write the assignment file (exit 0)? False sends the delivery to a fresh exec."""
        sessions = self._sessions
        session = sessions.take(pod) if sessions is not None else None
        if sessions is None or session is None:
            return False
        future = sessions.executor.submit(write_and_wait, session, assignment_session_payload(data))
        try:
            code = await asyncio.wait_for(asyncio.wrap_future(future), SESSION_AWAIT_S)
        except Exception as exc:  # a stream closed under it, or past its deadlines: a fresh exec does it
            if future.cancel():  # never started (no thread free in time): closed here instead
                sessions.close_later(session)
            self._driver.logger.info(
                "agent-sandbox exec session failed; handing over with a fresh exec",
                extra={"pod": pod, "error": type(exc).__name__},
            )
            code = None
        if code == 0:
            self.metrics.handovers.labels("session").inc()
        return code == 0

    async def _assign(self, pod: str, env: SandboxEnvironment) -> None:
        await self._assign_data(pod, assignment_file(self._driver.config, env))

    async def _assign_data(self, pod: str, data: bytes) -> None:
        """Write the secrets into the adopted pod over exec stdin (the session opened ahead in it, else
        a fresh exec); never into a label or annotation."""
        if await self._hand_over(pod, data):
            return
        d = self._driver
        configuration, ns = d.api_client.configuration, d.config.kubernetes_namespace
        command = assignment_command(len(data))

        def run() -> int | None:
            """(Blocking, each step with its deadline) a fresh exec that writes the assignment file."""
            exec_client, resp = open_exec(configuration, pod, ns, CONTAINER_NAME, command)
            try:
                return feed_and_wait(resp, data, FRESH_EXEC_TIMEOUT_S)
            finally:
                close_exec(exec_client, resp, CLOSE_TIMEOUT_S)

        try:
            if self._sessions is not None:
                future = self._sessions.executor.submit(run)
                code = await asyncio.wait_for(asyncio.wrap_future(future), FRESH_EXEC_AWAIT_S)
            else:
                code = await asyncio.wait_for(asyncio.to_thread(run), FRESH_EXEC_AWAIT_S)
        except Exception as exc:  # websocket errors, a Failure status without causes, past the deadlines, ...
            raise SandboxError(
                f"agent-sandbox assignment to pod {pod} failed: {type(exc).__name__}"
            ) from None
        if code != 0:
            raise SandboxError(f"agent-sandbox assignment to pod {pod} failed (exit {code})")
        self.metrics.handovers.labels("exec").inc()


__all__ = ["GROUP", "PLURAL", "VERSION", "WarmPool", "WarmPoolMetrics"]
