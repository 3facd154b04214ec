"""The reaper (reconciler): remove managed sandboxes whose execution is over, or unknown past a grace period.

The decision is the pure :func:`plan_reap` over (the sandboxes the driver lists by
our labels, every execution state in the compacted state topic, now, grace). The
I/O is around it: :class:`Reaper` lists through the configured driver, restores
the whole state topic read-only (every partition, not only this pod's), plans,
and with ``apply`` deprovisions each candidate and writes one ``SandboxReaped``
outcome per removal (deterministic id: a second reaper reaping the same sandbox
writes the same id).

Rules, per listed sandbox:

* workflow: reap when its execution's phase is terminal (COMPLETED, FAILED,
  CANCELLED, TERMINATED) and the lane's own teardown of it is not in flight (a
  deprovision decided and not folded back yet: the lane removes it and reports it),
  or when no state exists for it and the sandbox is older than the grace period;
  keep a live non-terminal execution's sandbox.
* session: reap when a ``SessionDeleted`` was applied (state keyed by the session
  id whose session record is DEPROVISIONED or TEARDOWN_FAILED) and no agent
  execution provisioned it again afterwards, or when no state references the
  session at all and the sandbox is older than the grace period.
* connect: never (the lanes do not create connect sandboxes).
* an age the driver cannot tell never counts as "past grace".
* a candidate the driver no longer finds when its removal starts (the listing is
  older than the state read; a lane's teardown may have run in between) is left
  alone: no second removal, no ``SandboxReaped``.

Only what ``list_managed()`` returns is ever considered, and drivers list by the
``stigmer.ai/managed-by`` label: a runtime object without our labels is never touched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from consumers.lanes.commands import LaneConfig
from consumers.lanes.constants import TERMINAL_WORKFLOW_PHASES
from consumers.lanes.rules import STATE_SCHEMA_VERSION, sandbox_ref
from consumers.ops.settings import Settings
from consumers.runtime.executor import error_message
from consumers.runtime.kafka_security import PLAINTEXT, KafkaSecurity
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.state_store import StateStore
from consumers.runtime.topology import Topics
from drivers.contract import ManagedSandbox, SandboxProvisioner
from events.codec import derived_event_id, encode, timestamp
from events.sandbox_lanes.v1 import common_pb2, outcomes_pb2, state_pb2

if TYPE_CHECKING:
    from consumers.ops.compose import Composed
    from consumers.runtime.pod import Pod

logger = logging.getLogger("sandbox_lanes.reaper")

REAP_GRACE_ENV = "SANDBOX_LANES_REAP_GRACE_S"
DEFAULT_REAP_GRACE_S = 600.0

_ENDED_LIFECYCLES = (state_pb2.SANDBOX_DEPROVISIONED, state_pb2.SANDBOX_TEARDOWN_FAILED)

Verdict = Literal["reap", "keep"]


# --- the pure decision ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReapPlan:
    """What to do with one listed sandbox, and why."""

    sandbox: ManagedSandbox
    verdict: Verdict
    reason: str
    execution_id: str = ""
    phase: int = common_pb2.EXECUTION_PHASE_UNSPECIFIED
    age_seconds: float | None = None


def _age(sandbox: ManagedSandbox, now: float) -> float | None:
    return None if sandbox.created_at is None else max(0.0, now - sandbox.created_at)


def _past_grace(age: float | None, grace: float) -> bool:
    return age is not None and age > grace


def _stamp(state: state_pb2.ExecutionState) -> float:
    return state.updated_at.seconds + state.updated_at.nanos / 1e9 if state.HasField("updated_at") else 0.0


def _session_record(state: state_pb2.ExecutionState, session_id: str) -> state_pb2.SandboxStatus | None:
    for status in state.sandboxes:
        if (
            status.sandbox.scope == common_pb2.SANDBOX_SCOPE_SESSION
            and status.sandbox.sandbox_id == session_id
        ):
            return status
    return None


def plan_reap(
    managed: Iterable[ManagedSandbox],
    states: Mapping[str, state_pb2.ExecutionState],
    now: float,
    grace: float,
    *,
    states_expire: bool = False,
) -> list[ReapPlan]:
    """Decide, per listed sandbox, whether to reap it. Pure: no I/O, time comes in as ``now``.

    ``states_expire``: finished executions' states are removed after a retention, so a session
    sandbox that no state references may belong to a live session whose executions all finished
    long ago; it is kept (its session's delete removes it). Without retention no reference means
    an orphan.
    """
    # Session id → the states that reference it (agent executions, and the session-keyed teardown state).
    by_session: dict[str, list[state_pb2.ExecutionState]] = {}
    for state in states.values():
        referenced = {state.session_id} if state.session_id else set()
        referenced |= {
            s.sandbox.sandbox_id
            for s in state.sandboxes
            if s.sandbox.scope == common_pb2.SANDBOX_SCOPE_SESSION
        }
        for session_id in referenced:
            by_session.setdefault(session_id, []).append(state)
    plans: list[ReapPlan] = []
    for sandbox in managed:
        age = _age(sandbox, now)
        if sandbox.scope == "workflow":
            plans.append(_plan_workflow(sandbox, states.get(sandbox.sandbox_id), age, grace))
        elif sandbox.scope == "session":
            plans.append(
                _plan_session(
                    sandbox,
                    states.get(sandbox.sandbox_id),
                    by_session.get(sandbox.sandbox_id, []),
                    age,
                    grace,
                    states_expire,
                )
            )
        else:
            plans.append(ReapPlan(sandbox, "keep", "connect sandboxes are not the lanes'", age_seconds=age))
    return plans


def _plan_workflow(
    sandbox: ManagedSandbox, state: state_pb2.ExecutionState | None, age: float | None, grace: float
) -> ReapPlan:
    eid = sandbox.sandbox_id
    if state is None or not state.created:
        if _past_grace(age, grace):
            return ReapPlan(sandbox, "reap", "no execution state past grace", eid, age_seconds=age)
        why = "age unknown" if age is None else f"within grace ({age:.0f}s <= {grace:g}s)"
        return ReapPlan(sandbox, "keep", f"no execution state, {why}", eid, age_seconds=age)
    phase_name = common_pb2.ExecutionPhase.Name(state.phase)
    if state.refused and not any(e.op == state_pb2.EFFECT_OP_ENSURE for e in state.pending):
        # The create was refused (its critical ensure failed): no runner may exist for it, and no
        # terminal phase will ever tear down what a half-done ensure left.
        return ReapPlan(sandbox, "reap", "execution refused (create)", eid, state.phase, age)
    if state.phase in TERMINAL_WORKFLOW_PHASES:
        if _teardown_pending(state, common_pb2.SANDBOX_SCOPE_WORKFLOW, eid):
            # The lane's own teardown is decided and not folded back yet: it owns the removal (and
            # its SandboxDeprovisioned outcome); a reap now would race it and report it twice.
            why = f"execution terminal ({phase_name}), its teardown in flight"
            return ReapPlan(sandbox, "keep", why, eid, state.phase, age)
        return ReapPlan(sandbox, "reap", f"execution terminal ({phase_name})", eid, state.phase, age)
    return ReapPlan(sandbox, "keep", f"execution live ({phase_name})", eid, state.phase, age)


def _teardown_pending(state: state_pb2.ExecutionState, scope: int, sandbox_id: str) -> bool:
    return any(
        e.op == state_pb2.EFFECT_OP_DEPROVISION and e.scope == scope and e.sandbox_id == sandbox_id
        for e in state.pending
    )


def _plan_session(
    sandbox: ManagedSandbox,
    own: state_pb2.ExecutionState | None,
    referencing: list[state_pb2.ExecutionState],
    age: float | None,
    grace: float,
    states_expire: bool,
) -> ReapPlan:
    sid = sandbox.sandbox_id
    deleted = (
        own is not None
        and (record := _session_record(own, sid)) is not None
        and (record.lifecycle in _ENDED_LIFECYCLES)
    )
    if deleted:
        assert own is not None
        deleted_at = _stamp(own)
        # An agent execution that provisioned the session sandbox after the delete keeps it.
        newer = [
            s
            for s in referencing
            if s is not own
            and (rec := _session_record(s, sid)) is not None
            and rec.lifecycle == state_pb2.SANDBOX_PROVISIONED
            and _stamp(s) > deleted_at
        ]
        if not newer:
            return ReapPlan(sandbox, "reap", "session deleted", age_seconds=age)
        return ReapPlan(sandbox, "keep", "session re-provisioned after its deletion", age_seconds=age)
    if referencing:
        return ReapPlan(sandbox, "keep", "session referenced by execution state", age_seconds=age)
    if states_expire:
        why = "no execution state (finished executions' states expire; the session's delete removes it)"
        return ReapPlan(sandbox, "keep", why, age_seconds=age)
    if _past_grace(age, grace):
        return ReapPlan(sandbox, "reap", "no execution state past grace", age_seconds=age)
    why = "age unknown" if age is None else f"within grace ({age:.0f}s <= {grace:g}s)"
    return ReapPlan(sandbox, "keep", f"no execution state, {why}", age_seconds=age)


def reaped_event(plan: ReapPlan, lane: LaneConfig, now: float) -> outcomes_pb2.SandboxReaped:
    """The outcome of one removal; its id is uuid5 over (scope, sandbox id, creation time)."""
    sb = plan.sandbox
    identity = f"reap:{sb.scope}:{sb.sandbox_id}:{sb.created_at if sb.created_at is not None else ''}"
    meta = common_pb2.EventMeta(
        event_id=derived_event_id(identity, "SandboxReaped", sb.scope),
        occurred_at=timestamp(dt.datetime.fromtimestamp(now, dt.UTC)),
        schema_version=STATE_SCHEMA_VERSION,
        source=lane.source,
    )
    ref = sandbox_ref(lane, sb.scope, sb.sandbox_id)
    ref.name = sb.name
    return outcomes_pb2.SandboxReaped(
        meta=meta,
        execution_id=plan.execution_id,
        sandbox=ref,
        reason=plan.reason,
        phase=plan.phase,  # type: ignore[arg-type]
        age_seconds=plan.age_seconds or 0.0,
    )


# --- the I/O around it ---------------------------------------------------------------------------


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
    store = StateStore(topic)
    await store.restore(bootstrap, partitions, isolation_level=isolation_level, security=security)
    return dict(store.items())


@dataclass
class Reaper:
    provisioner: SandboxProvisioner
    bootstrap: str
    topics: Topics
    lane: LaneConfig
    grace_s: float = DEFAULT_REAP_GRACE_S
    isolation_level: str = "read_committed"
    metrics: PodMetrics | None = None
    teardown_timeout_s: float = 60.0
    security: KafkaSecurity = PLAINTEXT
    #: Inside a pod: its own restored states and which sandbox ids its partitions own. Each
    #: replica then judges only its own sandboxes, from memory, instead of every replica reading
    #: the whole state topic each pass. None (the CLI): the whole topic, every sandbox.
    local: Callable[[], tuple[dict[str, state_pb2.ExecutionState], Callable[[str], bool]]] | None = None
    #: Finished executions' states are removed after a retention (see :func:`plan_reap`).
    states_expire: bool = False

    async def plan(self, now: float | None = None) -> tuple[list[ReapPlan], int]:
        # List first, then read state: the state view is never older than the listing.
        managed = await self.provisioner.list_managed()
        if self.local is not None:
            states, owns = self.local()
            managed = [m for m in managed if owns(m.sandbox_id)]
        else:
            states = await read_all_states(
                self.bootstrap,
                self.topics.state,
                isolation_level=self.isolation_level,
                security=self.security,
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

    async def _remove(self, result: ReapResult, producer: AIOKafkaProducer) -> None:
        sb = result.plan.sandbox

        async def remove() -> bool:
            # The listing is older than the state read: a lane's teardown may have removed the
            # sandbox in between. Gone now is nothing to reap, and no SandboxReaped claims otherwise.
            if await self.provisioner.probe(sb.scope, sb.sandbox_id) == "absent":
                return False
            await self.provisioner.deprovision(sb.scope, sb.sandbox_id)
            return True

        try:
            # One bound for the probe and the removal: neither may hold the pass up.
            if not await asyncio.wait_for(remove(), self.teardown_timeout_s):
                logger.info(
                    "Reaper candidate already gone",
                    extra={"scope": sb.scope, "sandboxId": sb.sandbox_id, "sandboxName": sb.name},
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


# --- knobs, the periodic task, the CLI -----------------------------------------------------------


def _isolation(settings: Settings) -> str:
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
        isolation_level=_isolation(settings),
        metrics=composed.metrics,
        teardown_timeout_s=settings.teardown_timeout_s,
        security=settings.kafka_security,
        local=_pod_states(composed.pod),
        states_expire=settings.state_retention_s > 0,
    )


def _pod_states(
    pod: Pod,
) -> Callable[[], tuple[dict[str, state_pb2.ExecutionState], Callable[[str], bool]]]:
    """The pod's restored states, and whether a sandbox id's records are on a partition it owns
    (a workflow sandbox is keyed by its execution id, a session sandbox by its session id: the
    keys its inputs are partitioned by)."""

    def local() -> tuple[dict[str, state_pb2.ExecutionState], Callable[[str], bool]]:
        owned = pod.store.owned()
        return dict(pod.store.items()), lambda key: pod.input_partition_of(key) in owned

    return local


async def periodic(reaper: Reaper, interval_s: float, stop: asyncio.Event, ready: asyncio.Event) -> None:
    """One pass every ``interval_s`` once the pod is ready, until ``stop``; a failed pass is logged."""
    await _first(stop, ready)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
        if stop.is_set():
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
    pod.background.append(task)
    logger.info("periodic reaper on", extra={"intervalSeconds": interval, "graceSeconds": reaper.grace_s})
    return task


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--apply", action="store_true", help="remove the candidates (default: dry run)")
    parser.add_argument("--grace", type=float, default=None, help=f"override {REAP_GRACE_ENV} (seconds)")
    parser.add_argument("--bootstrap", help="override KAFKA_BOOTSTRAP_SERVERS")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON lines")


def _row(result: ReapResult) -> dict[str, object]:
    plan = result.plan
    return {
        "scope": plan.sandbox.scope,
        "sandbox_id": plan.sandbox.sandbox_id,
        "name": plan.sandbox.name,
        "state": plan.sandbox.state,
        "age_seconds": None if plan.age_seconds is None else round(plan.age_seconds, 1),
        "verdict": plan.verdict,
        "reason": plan.reason,
        "removed": result.removed,
        "error": result.error,
        "event_id": result.event_id,
    }


def run(args: argparse.Namespace) -> int:
    from consumers.ops.compose import build_provisioner
    from consumers.ops.logs import setup_logging
    from consumers.ops.settings import load_settings

    settings = load_settings()
    setup_logging(
        getattr(args, "log_level", "info"), secrets=[settings.raw.get("STIGMER_RUNNER_TOKEN_KEY", "")]
    )
    provisioner = build_provisioner(settings, logging.getLogger("sandbox_lanes"))
    if provisioner is None:
        print("sandbox-lanes reap: no driver configured (SANDBOX_PROVISIONER_TYPE is empty); nothing to reap")
        return 0
    lane = LaneConfig(
        enabled=True, driver_name=provisioner.driver_name, source=f"sandbox-lanes/{settings.pod_id}/reap"
    )
    reaper = Reaper(
        provisioner,
        args.bootstrap or settings.bootstrap,
        settings.topics,
        lane,
        grace_s=args.grace if args.grace is not None else settings.reap_grace_s,
        isolation_level=_isolation(settings),
        teardown_timeout_s=settings.teardown_timeout_s,
        security=settings.kafka_security,
        states_expire=settings.state_retention_s > 0,
    )

    async def main() -> ReapReport:
        try:
            return await reaper.run_once(apply=args.apply)
        finally:
            await provisioner.close()

    report = asyncio.run(main())
    rows = [_row(r) for r in report.results]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"{'verdict':<7} {'scope':<8} {'name':<20} {'age':>8}  reason")
        for row in rows:
            age = "?" if row["age_seconds"] is None else f"{row['age_seconds']:.0f}s"
            mark = (
                row["verdict"]
                if not (row["removed"] or row["error"])
                else ("removed" if row["removed"] else "FAILED")
            )
            print(
                f"{mark:<7} {row['scope']:<8} {row['name']:<20} {age:>8}  "
                f"{row['reason']} ({row['sandbox_id']})"
            )
    mode = "applied" if report.applied else "dry run (use --apply to remove)"
    print(
        f"{len(rows)} managed sandboxes, {report.states} execution states; {report.candidates} to reap, "
        f"{report.removed} removed, {report.failed} failed — {mode}"
    )
    return 1 if report.failed else 0
