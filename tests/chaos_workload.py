"""The chaos workload: a seeded, realistic input stream and what the spec says must come of it.

Pure (no I/O): ``generate`` plans every record to produce (time offset + event + why), and
``expected_from_plan`` says, from the plan and the spec's lane rules written out in it (never from
the pod's own rules), which outcome every input must have, which inputs must be dead-lettered, and
which sandboxes must be gone at the end.
"""

from __future__ import annotations

import datetime as dt
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

from events.codec import InputEvent, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2

Why = Literal["valid", "duplicate", "retry", "early"]

#: The lane configuration the chaos pods run with (a mix: UNSPECIFIED sessions are CLOUD,
#: UNSPECIFIED workflows are LOCAL).
LANE_ENV: dict[str, str] = {
    "STIGMER_ACTIVITY_ROUTING": "session",
    "STIGMER_WORKFLOW_ACTIVITY_ROUTING": "execution",
    "STIGMER_DEFAULT_EXECUTION_TARGET": "cloud",
    "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET": "local",
}

P = common_pb2
TERMINALS = (P.EXECUTION_COMPLETED, P.EXECUTION_FAILED, P.EXECUTION_CANCELLED, P.EXECUTION_TERMINATED)


@dataclass
class Planned:
    at: float
    """Seconds after the feed starts."""
    event: InputEvent
    why: Why
    delayed: bool = False
    """Moved later than its natural slot, past other executions' records (never past its own)."""


@dataclass
class Workload:
    seed: int
    executions: int
    plan: list[Planned]
    """Main timeline, sorted by ``at``."""
    early: list[Planned]
    """Phase events produced before their execution's create (a reorder WITHIN a history)."""
    sessions: dict[str, int]
    counts: dict[str, int] = field(default_factory=dict)

    def all_records(self) -> list[Planned]:
        return [*self.early, *self.plan]


def _run_id(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(8))


def generate(
    executions: int,
    seed: int,
    *,
    rate_per_s: float = 60.0,
    duplicate_share: float = 0.08,
    delay_share: float = 0.06,
    early_share: float = 0.02,
    retry_share: float = 0.02,
    session_delete_share: float = 0.2,
) -> Workload:
    rng = random.Random(seed)
    run = _run_id(rng)
    base = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
    plan: list[Planned] = []
    early: list[Planned] = []
    counter = 0

    def meta(at: float) -> common_pb2.EventMeta:
        nonlocal counter
        counter += 1
        return new_meta(
            event_id=f"chaos-{run}-{counter}",
            occurred_at=base + dt.timedelta(seconds=at),
            source="chaos-feeder",
        )

    n_sessions = max(1, executions // 6)
    targets = (P.CLOUD, P.LOCAL, P.EXECUTION_TARGET_UNSPECIFIED)
    sessions = {f"ses_{run}_{i}": rng.choices(targets, (0.55, 0.25, 0.2))[0] for i in range(n_sessions)}
    session_ids = list(sessions)
    session_last: dict[str, float] = defaultdict(float)
    workflow_ids: list[str] = []
    # Per execution: its records in history order (the order the pod must apply them in).
    histories: list[list[Planned]] = []

    for i in range(executions):
        start = i / rate_per_s
        history: list[Planned] = []
        roll = rng.random()
        if roll < 0.5:
            kind = P.AGENT_EXECUTION
            exec_id = f"axr_{run}_{i}"
            session_id = rng.choice(session_ids)
            override = ""
            if workflow_ids and rng.random() < 0.15:  # a workflow's child: shares the parent's sandbox
                override = f"wfexec:{rng.choice(workflow_ids)}"
            created = inputs_pb2.ExecutionCreated(
                meta=meta(start),
                kind=kind,
                execution_id=exec_id,
                name=f"agent run {i}",
                org="org_chaos",
                session_id=session_id,
                activity_task_queue=override,
                session_execution_target=sessions[session_id],
                caller_identity_id=f"ida_{i % 7}",
                caller_class=rng.choice(["user", "service", ""]),
            )
            finals = ((P.EXECUTION_COMPLETED, 0.7), (P.EXECUTION_FAILED, 0.2), (P.EXECUTION_CANCELLED, 0.1))
        else:
            kind = P.WORKFLOW_EXECUTION
            exec_id = f"wfx_{run}_{i}"
            workflow_ids.append(exec_id)
            session_id = ""
            created = inputs_pb2.ExecutionCreated(
                meta=meta(start),
                kind=kind,
                execution_id=exec_id,
                name=f"workflow run {i}",
                org="org_chaos",
                workflow_execution_target=rng.choices(targets, (0.5, 0.3, 0.2))[0],
                caller_identity_id=f"ida_{i % 7}",
            )
            finals = (
                (P.EXECUTION_COMPLETED, 0.55),
                (P.EXECUTION_FAILED, 0.2),
                (P.EXECUTION_CANCELLED, 0.15),
                (P.EXECUTION_TERMINATED, 0.1),
            )
        history.append(Planned(start, created, "valid"))
        t = start
        phases: list[tuple[int, int, str]] = [(P.EXECUTION_PENDING, P.EXECUTION_IN_PROGRESS, "")]
        if kind == P.WORKFLOW_EXECUTION and rng.random() < 0.2:
            pause_error = "waiting for approval" if rng.random() < 0.3 else ""
            phases += [
                (P.EXECUTION_IN_PROGRESS, P.EXECUTION_PAUSED, pause_error),
                (P.EXECUTION_PAUSED, P.EXECUTION_IN_PROGRESS, ""),
            ]
        if rng.random() < 0.9:  # the rest is still running when the feed ends
            final = rng.choices([f for f, _ in finals], [w for _, w in finals])[0]
            error = f"step {i} failed" if final == P.EXECUTION_FAILED else ""
            phases.append((P.EXECUTION_IN_PROGRESS, final, error))
            if rng.random() < 0.05:  # a repeated terminal write: previous == new, tears nothing down
                phases.append((final, final, "late error" if rng.random() < 0.5 else ""))
        for previous, new, error in phases:
            t += rng.uniform(0.05, 1.2)
            event = inputs_pb2.PhaseChanged(
                meta=meta(t),
                execution_id=exec_id,
                session_id=session_id,
                kind=kind,
                previous_phase=previous,  # type: ignore[arg-type]
                new_phase=new,  # type: ignore[arg-type]
                error=error,
            )
            history.append(Planned(t, event, "valid"))
        histories.append(history)

    counts: dict[str, int] = defaultdict(int)
    # A reorder WITHIN a history (by design a dead letter): the first phase event before the create.
    for history in histories:
        if len(history) > 1 and rng.random() < early_share:
            first = history.pop(1)
            first.why = "early"
            early.append(first)
    # Cross-execution reorder: delay a record, but never past the next record of its own history.
    for history in histories:
        for idx, item in enumerate(history):
            if rng.random() >= delay_share:
                continue
            limit = history[idx + 1].at - 0.01 if idx + 1 < len(history) else item.at + 4.0
            if limit - item.at > 0.3:
                item.at = rng.uniform(item.at + 0.25, limit)
                item.delayed = True
        plan.extend(history)
    # A producer retry of a create under a new event id: a no-op.
    for history in histories:
        if rng.random() < retry_share:
            created_event = history[0].event
            assert isinstance(created_event, inputs_pb2.ExecutionCreated)
            again = inputs_pb2.ExecutionCreated()
            again.CopyFrom(created_event)
            again.meta.CopyFrom(meta(history[0].at + 0.5))
            limit = history[1].at - 0.01 if len(history) > 1 else history[0].at + 1.0
            plan.append(Planned(min(history[0].at + 0.02, limit), again, "retry"))
    # Session deletions, after the session's last activity (its records' times after the delays).
    for history in histories:
        for item in history:
            if item.event.session_id:
                sid = item.event.session_id
                session_last[sid] = max(session_last[sid], item.at)
    for session_id in session_ids:
        if rng.random() < session_delete_share:
            at = session_last[session_id] + rng.uniform(2.0, 4.0)
            plan.append(Planned(at, inputs_pb2.SessionDeleted(meta=meta(at), session_id=session_id), "valid"))
    # Duplicates (same event id), later, across executions. A duplicate of a record applied later
    # than the original is filtered; one that overtakes its own history is not produced.
    originals = [p for p in plan if p.why == "valid"]
    for item in originals:
        if rng.random() < duplicate_share:
            plan.append(Planned(item.at + rng.uniform(0.05, 5.0), item.event, "duplicate"))
    plan.sort(key=lambda p: p.at)
    counts["events"] = len(plan) + len(early)
    counts["duplicates"] = sum(1 for p in plan if p.why == "duplicate")
    counts["retries"] = sum(1 for p in plan if p.why == "retry")
    counts["reordered"] = sum(1 for p in plan if p.delayed)
    counts["early"] = len(early)
    counts["session_deletes"] = sum(1 for p in plan if isinstance(p.event, inputs_pb2.SessionDeleted))
    return Workload(seed, executions, plan, early, sessions, dict(counts))


# --- expectations ---------------------------------------------------------------------------------


@dataclass
class Expected:
    provision: dict[str, str] = field(default_factory=dict)
    """create event id → execution id, for every create that must yield Provisioned|Failed."""
    teardown: dict[str, str] = field(default_factory=dict)
    """phase / session-deleted event id → key, for every input that must yield Deprovisioned|TeardownFailed."""
    dead_letters: set[str] = field(default_factory=set)
    """event ids that must be dead-lettered."""
    errors: dict[str, list[str]] = field(default_factory=dict)
    """execution id → the non-empty phase errors, in applied order."""
    phase: dict[str, int] = field(default_factory=dict)
    """execution id → the phase its state must end in."""
    kind: dict[str, int] = field(default_factory=dict)
    terminal_workflows: set[str] = field(default_factory=set)
    """workflow executions whose terminal transition was applied: no sandbox may outlive them."""
    provisioning_workflows: set[str] = field(default_factory=set)
    deleted_sessions: set[str] = field(default_factory=set)


def expected_from_plan(workload: Workload) -> Expected:
    """What must come of the plan, from the spec's lane rules written out here (not the pod's code).

    Records are taken in the order the pod applies each key's records (early ones first, then the
    plan by time; a session's delete comes seconds after its last record). Per the spec, with
    :data:`LANE_ENV` (session routing per session, workflow routing per execution; an unspecified
    session target is CLOUD, an unspecified workflow target LOCAL):

    * an input whose id the key already applied is a duplicate: no outcome;
    * a phase change before its execution's create is dead-lettered;
    * the first create of an execution provisions when its lane resolves to CLOUD: an agent run
      with a session, no task-queue override and its session not deleted; a workflow run; a second
      create (a producer retry under a new id) changes nothing;
    * a workflow's transition INTO a terminal phase tears its sandbox down (a repeated terminal
      phase is no transition); an agent's terminal phase tears nothing down;
    * a session's delete tears its session sandbox down;
    * every applied phase change's non-empty error is listed (the first one must survive), and
      the phase an execution ends in is its last applied phase change's (PENDING after a create).
    """
    cloud_sessions = LANE_ENV["STIGMER_DEFAULT_EXECUTION_TARGET"] == "cloud"
    cloud_workflows = LANE_ENV["STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET"] == "cloud"
    assert LANE_ENV["STIGMER_ACTIVITY_ROUTING"] == "session"
    assert LANE_ENV["STIGMER_WORKFLOW_ACTIVITY_ROUTING"] == "execution"
    expected = Expected()
    applied: dict[str, set[str]] = defaultdict(set)
    created: set[str] = set()
    deleted: set[str] = set()
    for item in workload.all_records():
        event = item.event
        event_id = event.meta.event_id
        if isinstance(event, inputs_pb2.SessionDeleted):
            key = event.session_id
            if event_id in applied[key]:
                continue
            applied[key].add(event_id)
            deleted.add(key)
            expected.teardown[event_id] = key
            expected.deleted_sessions.add(key)
            continue
        key = event.execution_id
        if event_id in applied[key]:
            continue
        if isinstance(event, inputs_pb2.ExecutionCreated):
            applied[key].add(event_id)
            if key in created:
                continue  # a second create: a no-op
            created.add(key)
            expected.phase[key] = P.EXECUTION_PENDING
            expected.kind[key] = event.kind
            if event.kind == P.AGENT_EXECUTION:
                if (
                    event.session_id
                    and not event.activity_task_queue
                    and event.session_id not in deleted
                    and _cloud(event.session_execution_target, cloud_sessions)
                ):
                    expected.provision[event_id] = key
            else:
                if _cloud(event.workflow_execution_target, cloud_workflows):
                    expected.provision[event_id] = key
                    expected.provisioning_workflows.add(key)
            continue
        if key not in created:
            expected.dead_letters.add(event_id)
            continue
        applied[key].add(event_id)
        if event.error:
            expected.errors.setdefault(key, []).append(event.error)
        previous, expected.phase[key] = expected.phase[key], event.new_phase
        if (
            event.kind == P.WORKFLOW_EXECUTION
            and event.new_phase in TERMINALS
            and previous != event.new_phase
        ):
            expected.teardown[event_id] = key
            expected.terminal_workflows.add(key)
    return expected


def _cloud(target: int, default_is_cloud: bool) -> bool:
    """An execution target resolved: CLOUD, or unspecified with the lane's default CLOUD."""
    return target == P.CLOUD or (target == P.EXECUTION_TARGET_UNSPECIFIED and default_is_cloud)
