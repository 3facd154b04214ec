"""The reaper's I/O and its periodic task in a pod (the decision is :mod:`consumers.lanes.reap`).

:class:`Reaper` lists the managed sandboxes through the configured driver, reads the
execution states (inside a pod: its own restored ones, for the partitions it owns; from
the CLI: the whole compacted state topic, read-only), plans, and with ``apply``
deprovisions each candidate and writes one ``SandboxReaped`` outcome per removal. Only
what ``list_managed()`` returns is ever considered, and drivers list by the
``stigmer.ai/managed-by`` and ``stigmer.ai/installation`` labels: a runtime object without them (or of
another installation) is never touched.

Inside a pod a pass reads only the states its plan depends on, a bounded slice per turn of the event
loop (:mod:`consumers.ops.reaper_states`): a point lookup per listed sandbox, and a deleted session's
partition looked through for what references it; never every held state at once.

Inside a pod each removal takes the sandbox's turn in the effect runner's per-sandbox order
(``order``: :meth:`~consumers.runtime.effects.EffectRunner.exclusive`), and judges the sandbox again
there, from the pod's states as they are then: a take-over or a new execution that ensured it after
the plan (its ensure ran before the turn, or waits for it) keeps it, whatever the plan said.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from consumers.lanes.capacity_rules import released, sandbox_key
from consumers.lanes.commands import LaneConfig
from consumers.lanes.reap import ReapPlan, plan_reap, reaped_event
from consumers.ops import reaper_states
from consumers.ops.reaper_states import ReadCounts, ReapStates, StoreStates, owned, states_for
from consumers.ops.settings import Settings
from consumers.runtime.executor import error_message
from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.topology import Topics
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.shutdown import stopped_within
from consumers.runtime.state.store import MemoryStore
from drivers.contract import SandboxProvisioner
from events.codec import encode
from events.sandbox_lanes.v1 import state_pb2

if TYPE_CHECKING:
    from consumers.ops.compose import Composed

logger = logging.getLogger("sandbox_lanes.reaper")

#: Runs work in a sandbox's turn (scope, sandbox id, work): the pod's effect runner's ``exclusive``.
Order = Callable[[str, str, Callable[[], Awaitable[str]]], Awaitable[str]]


@dataclass
class ReapResult:
    plan: ReapPlan
    removed: bool = False
    error: str = ""
    event_id: str = ""


@dataclass
class ReapReport:
    results: list[ReapResult]
    applied: bool
    states: int

    @property
    def removed(self) -> int:
        return sum(1 for r in self.results if r.removed)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if r.error)

    @property
    def candidates(self) -> int:
        return sum(1 for r in self.results if r.plan.verdict == "reap")


async def partitions_of(
    bootstrap: str, topics: Iterable[str], *, security: KafkaSecurity = PLAINTEXT
) -> dict[str, list[int]]:
    """Partition ids of each existing topic (a missing topic is absent from the result)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **security.client_options())
    await admin.start()
    try:
        described: list[dict[str, Any]] = await admin.describe_topics(list(topics))
    finally:
        await admin.close()
    return {
        t["topic"]: sorted(p["partition"] for p in t["partitions"])
        for t in described
        if t.get("error_code", 0) == 0 and t.get("partitions")
    }


async def read_all_states(
    bootstrap: str,
    topic: str,
    *,
    isolation_level: str = "read_committed",
    security: KafkaSecurity = PLAINTEXT,
) -> dict[str, state_pb2.ExecutionState]:
    """Every execution's latest state: the whole compacted topic, all partitions, read-only."""
    partitions = (await partitions_of(bootstrap, [topic], security=security)).get(topic, [])
    store = MemoryStore(topic)
    await store.restore(bootstrap, partitions, isolation_level=isolation_level, security=security)
    return dict(store.items())


@dataclass
class Reaper:
    provisioner: SandboxProvisioner
    bootstrap: str
    topics: Topics
    lane: LaneConfig
    grace_s: float = 600.0
    isolation_level: str = "read_committed"
    metrics: PodMetrics | None = None
    teardown_timeout_s: float = 60.0
    security: KafkaSecurity = PLAINTEXT
    #: Inside a pod: its own restored states and which sandbox ids its partitions own. Each
    #: replica then judges only its own sandboxes, from its store, instead of every replica reading
    #: the whole state topic each pass. None (the CLI): the whole topic, every sandbox.
    local: ReapStates | None = None
    #: Finished executions' states are removed after a retention (see :func:`plan_reap`).
    states_expire: bool = False
    #: Inside a pod: each removal in the sandbox's turn of the effect runner's order, judged again
    #: there. None (the CLI, beside the pods): the removal runs on its plan.
    order: Order | None = None

    async def plan(
        self, now: float | None = None, counts: ReadCounts | None = None
    ) -> tuple[list[ReapPlan], int]:
        """Each listed sandbox judged (inside a pod: those of its partitions); and the states held.
        ``counts``: what the pass read of the pod's store, slice by slice."""
        # List first, then read state: the state view is never older than the listing.
        managed = await self.provisioner.list_managed()
        if self.local is not None:
            managed = await owned(self.local, managed)
            states = await states_for(self.local, managed, states_expire=self.states_expire, counts=counts)
            at = time.time() if now is None else now
            plans = await reaper_states.plan(
                managed, states, at, self.grace_s, states_expire=self.states_expire
            )
            return plans, len(self.local)
        states = await read_all_states(
            self.bootstrap, self.topics.state, isolation_level=self.isolation_level, security=self.security
        )
        at = time.time() if now is None else now
        return plan_reap(managed, states, at, self.grace_s, states_expire=self.states_expire), len(states)

    async def run_once(
        self, *, apply: bool, now: float | None = None, stop: asyncio.Event | None = None
    ) -> ReapReport:
        plans, n_states = await self.plan(now)
        results = [ReapResult(p) for p in plans]
        candidates = [r for r in results if r.plan.verdict == "reap"]
        if not apply or not candidates:
            return ReapReport(results, apply, n_states)
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap, acks="all", linger_ms=0, **self.security.client_options()
        )
        await producer.start()
        try:
            for result in candidates:
                if stop is not None and stop.is_set():
                    break
                await self._remove(result, producer)
        finally:
            await producer.stop()
        return ReapReport(results, apply, n_states)

    async def _still_reaped(self, result: ReapResult) -> str:
        """ "" when the sandbox is still to be reaped by the pod's states now, else why it is kept."""
        if self.local is None:
            return ""
        sb = result.plan.sandbox
        if not self.local.owns(sb.sandbox_id):
            return "its partition is no longer this pod's"
        states = await states_for(self.local, [sb], states_expire=self.states_expire)
        if not self.local.owns(sb.sandbox_id):  # released while its partition was read
            return "its partition is no longer this pod's"
        (again,) = plan_reap([sb], states, time.time(), self.grace_s, states_expire=self.states_expire)
        return "" if again.verdict == "reap" else again.reason

    async def _remove(self, result: ReapResult, producer: AIOKafkaProducer) -> None:
        sb = result.plan.sandbox

        async def remove() -> str:
            # In the sandbox's turn (inside a pod): judged again from the states as they are now.
            kept = await self._still_reaped(result)
            if kept:
                return kept
            # One bound for the probe and the removal: neither may hold the pass up.
            return await asyncio.wait_for(probe_and_remove(), self.teardown_timeout_s)

        async def probe_and_remove() -> str:
            # The listing is older than the state read: a lane's teardown may have removed the
            # sandbox in between. Gone now is nothing to reap, and no SandboxReaped claims otherwise.
            if await self.provisioner.probe(sb.scope, sb.sandbox_id) == "absent":
                return "already gone"
            await self.provisioner.deprovision(sb.scope, sb.sandbox_id)
            return ""

        try:
            kept = await (remove() if self.order is None else self.order(sb.scope, sb.sandbox_id, remove))
            if kept:
                logger.info(
                    "Reaper candidate already gone" if kept == "already gone" else "Reaper candidate kept",
                    extra={
                        "scope": sb.scope,
                        "sandboxId": sb.sandbox_id,
                        "sandboxName": sb.name,
                        "reason": kept,
                    },
                )
                return
        except Exception as exc:
            result.error = error_message(exc) if not isinstance(exc, TimeoutError) else "teardown timed out"
            logger.error(
                "Reaper could not remove sandbox - it may be leaked",
                extra={
                    "scope": sb.scope,
                    "sandboxId": sb.sandbox_id,
                    "sandboxName": sb.name,
                    "error": result.error,
                },
            )
            if self.metrics is not None:
                self.metrics.leaked.labels(self.provisioner.driver_name).inc()
            return
        result.removed = True
        event = reaped_event(result.plan, self.lane, time.time())
        result.event_id = event.meta.event_id
        if self.topics.capacity_on:
            # A cap on: the sandbox no longer counts. Written before the outcome: a pass that ends
            # between the two finds it gone next time and writes neither (docs/guarantees.md "Capacity").
            at = event.meta.occurred_at if event.meta.HasField("occurred_at") else None
            why = f"reaped: {result.plan.reason}"
            key = sandbox_key(sb.scope, sb.sandbox_id)
            out = encode(released(event.meta.event_id, at, key, "", why, self.lane), source=self.lane.source)
            await producer.send_and_wait(
                self.topics.capacity, out.value, key=out.key, headers=out.headers, partition=0
            )
        record = encode(event, source=self.lane.source)
        await producer.send_and_wait(
            self.topics.outcomes, record.value, key=record.key, headers=record.headers
        )
        if self.metrics is not None:
            self.metrics.reaped.labels(self.provisioner.driver_name).inc()
        logger.info(
            "Sandbox reaped",
            extra={
                "scope": sb.scope,
                "sandboxId": sb.sandbox_id,
                "sandboxName": sb.name,
                "reason": result.plan.reason,
                "eventId": result.event_id,
            },
        )


def isolation(settings: Settings) -> str:
    return "read_committed" if settings.guarantee == "exactly_once" else "read_uncommitted"


def reaper_for(settings: Settings, composed: Composed) -> Reaper | None:
    if composed.provisioner is None:
        return None
    return Reaper(
        composed.provisioner,
        settings.bootstrap,
        settings.topics,
        composed.lane,
        grace_s=settings.reap_grace_s,
        isolation_level=isolation(settings),
        metrics=composed.metrics,
        teardown_timeout_s=settings.teardown_timeout_s,
        security=settings.kafka_security,
        local=StoreStates(composed.pod.states, composed.pod.input_partition_of),
        states_expire=settings.state_retention_s > 0,
        order=composed.pod.effects.exclusive,
    )


async def periodic(reaper: Reaper, interval_s: float, stop: asyncio.Event, ready: asyncio.Event) -> None:
    """One pass every ``interval_s`` once the pod is ready, until ``stop``; a failed pass is logged."""
    await _first(stop, ready)
    while not stop.is_set():
        if await stopped_within(stop, interval_s):
            return
        try:
            report = await reaper.run_once(apply=True, stop=stop)
        except Exception as exc:
            logger.error("reaper pass failed", extra={"error": error_message(exc)})
            continue
        logger.info(
            "reaper pass",
            extra={
                "listed": len(report.results),
                "removed": report.removed,
                "failed": report.failed,
                "states": report.states,
            },
        )


async def _first(stop: asyncio.Event, ready: asyncio.Event) -> None:
    waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(ready.wait())}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def start_periodic_reaper(settings: Settings, composed: Composed) -> asyncio.Task[None] | None:
    """Start the pod's periodic reaper (``SANDBOX_LANES_REAP_INTERVAL_S``, 0 = off); the pod awaits it."""
    interval = settings.reap_interval_s
    reaper = reaper_for(settings, composed)
    if interval == 0 or reaper is None:
        return None
    pod = composed.pod
    task = asyncio.create_task(periodic(reaper, interval, pod.stopping, pod.ready), name="reaper")
    pod.run_beside(task)
    logger.info("periodic reaper on", extra={"intervalSeconds": interval, "graceSeconds": reaper.grace_s})
    return task
