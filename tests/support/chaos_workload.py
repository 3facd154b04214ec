"""The chaos workload: a seeded, realistic input stream and what the spec says must come of it.

Pure (no I/O): ``generate`` plans every record to produce (time offset + event + why), and
``expected_from_plan`` says, from the plan and the spec's lane rules written out in it (never from
the pod's own rules), which outcome every input must have, which inputs must be dead-lettered, and
which sandboxes must be gone at the end.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import random
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from google.protobuf.timestamp_pb2 import Timestamp

from events.codec import InputEvent, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, state_pb2

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
    base: dt.datetime = dt.datetime(2025, 1, 1, tzinfo=dt.UTC),
) -> Workload:
    """``base`` is the feed's start as the records' occurred_at say (a live run passes the wall clock,
    so no record looks days old or ahead of its Kafka timestamp to the pod)."""
    rng = random.Random(seed)
    run = _run_id(rng)
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
        if kind == P.AGENT_EXECUTION and rng.random() < 0.15:
            # An agent run fails and is recovered (FAILED -> IN_PROGRESS: its session sandbox is
            # ensured again, its error cleared), then goes on to its end.
            phases += [
                (P.EXECUTION_IN_PROGRESS, P.EXECUTION_FAILED, f"attempt {i} failed"),
                (P.EXECUTION_FAILED, P.EXECUTION_IN_PROGRESS, ""),
            ]
        recovered_at_end = False
        if rng.random() < 0.9:  # the rest is still running when the feed ends
            final = rng.choices([f for f, _ in finals], [w for _, w in finals])[0]
            error = f"step {i} failed" if final == P.EXECUTION_FAILED else ""
            phases.append((P.EXECUTION_IN_PROGRESS, final, error))
            if rng.random() < 0.05:  # a repeated terminal write: previous == new, tears nothing down
                phases.append((final, final, "late error" if rng.random() < 0.5 else ""))
            elif kind == P.WORKFLOW_EXECUTION and final == P.EXECUTION_FAILED and rng.random() < 0.4:
                # A workflow recover, its last record: its sandbox is ensured again (critical) and,
                # once that goes through, its error cleared. (Last: after a refused recover upstream
                # has no running execution to write phases for.)
                phases.append((P.EXECUTION_FAILED, P.EXECUTION_IN_PROGRESS, ""))
                recovered_at_end = True
        equal_end = rng.random() < 0.1  # the last phase stamped in the same instant as the one before
        for n, (previous, new, error) in enumerate(phases):
            if not (equal_end and n == len(phases) - 1 and n > 0):
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
        if len(phases) > 1 and not recovered_at_end and rng.random() < 0.12:
            # A stale write: stamped up to 0.4 s before the last phase change (mostly in the same
            # second), delivered after it. It moves nothing, its error included.
            event = inputs_pb2.PhaseChanged(
                meta=meta(t - rng.uniform(0.001, 0.4)),
                execution_id=exec_id,
                session_id=session_id,
                kind=kind,
                previous_phase=P.EXECUTION_PENDING,
                new_phase=P.EXECUTION_IN_PROGRESS,
                error="stale write",
            )
            history.append(Planned(t + rng.uniform(0.1, 1.0), event, "valid"))
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
    phase_changes = [p for p in plan if isinstance(p.event, inputs_pb2.PhaseChanged) and p.why == "valid"]
    counts["recovers"] = sum(
        1
        for p in phase_changes
        if p.event.previous_phase == P.EXECUTION_FAILED and p.event.new_phase == P.EXECUTION_IN_PROGRESS
    )
    counts["stale"] = sum(1 for p in phase_changes if p.event.error == "stale write")
    counts["equal timestamps"] = _equal_stamps(histories)
    return Workload(seed, executions, plan, early, sessions, dict(counts))


def _equal_stamps(histories: list[list[Planned]]) -> int:
    """Phase changes stamped in the same instant as the one before them in their history."""
    n = 0
    for history in histories:
        stamps = [p.event.meta.occurred_at for p in history if isinstance(p.event, inputs_pb2.PhaseChanged)]
        n += sum(1 for a, b in itertools.pairwise(stamps) if a == b)
    return n


# --- expectations ---------------------------------------------------------------------------------

#: The outcome id namespace (docs/guarantees.md: outcome and effect ids are uuid5 of "<input id>/<type>/<scope>").
OUTPUT_ID_NAMESPACE = uuid.UUID("6f1d3c2e-5b7a-4e0b-9a51-2f4c8d7e9b10")
PREFIX = "Sandbox provisioning failed: "  # spec 2.2
APPLIED_IDS_KEPT = 32  # each execution remembers its newest 32 applied input ids (the duplicate filter)

Op = Literal["Ensure", "Deprovision"]
DriverResult = tuple[bool, str]
"""(ok, error) of one driver call."""
ResultOf = Callable[[str, Op], DriverResult | None]
"""The driver result of the call decided by input ``event id`` (None: no call was made)."""


@dataclass
class Expected:
    provision: dict[str, str] = field(default_factory=dict)
    """create / recover event id → execution id, for every input that must yield Provisioned|Failed."""
    teardown: dict[str, str] = field(default_factory=dict)
    """phase / session-deleted event id → key, for every input that must yield Deprovisioned|TeardownFailed."""
    teardown_optional: set[str] = field(default_factory=set)
    """terminal phases of a refused workflow create: upstream tears nothing down (no sandbox exists);
    the pod does (harmlessly) when the phase was decided while the refused ensure was still out."""
    dead_letters: set[str] = field(default_factory=set)
    """event ids that must be dead-lettered."""
    terminal_workflows: set[str] = field(default_factory=set)
    """workflow executions that end in a terminal phase: no sandbox may outlive them."""
    provisioning_workflows: set[str] = field(default_factory=set)
    deleted_sessions: set[str] = field(default_factory=set)
    states: dict[str, state_pb2.ExecutionState] = field(default_factory=dict)
    """key → the whole state it must end in, every driver call folded back."""


def _ts(at: Timestamp) -> tuple[int, int]:
    return at.seconds, at.nanos


def _outcome_id(causation_id: str, kind: str, scope: str) -> str:
    return str(uuid.uuid5(OUTPUT_ID_NAMESPACE, f"{causation_id}/{kind}/{scope}"))


def _base_name(scope: str, sandbox_id: str) -> str:
    """Spec 5.0: sbx-<ses|wfx|mcp>-<first 12 hex of sha256(id)>."""
    code = {"session": "ses", "workflow": "wfx"}[scope]
    return f"sbx-{code}-{hashlib.sha256(sandbox_id.encode()).hexdigest()[:12]}"


_SCOPES = {"session": P.SANDBOX_SCOPE_SESSION, "workflow": P.SANDBOX_SCOPE_WORKFLOW}


def _record(
    state: state_pb2.ExecutionState,
    driver: str,
    causation_id: str,
    op: Op,
    scope: str,
    sandbox_id: str,
    task_queue: str,
    result: DriverResult,
) -> None:
    """The state's record of its sandbox after a driver call's result (one record per sandbox)."""
    ok, error = result
    kinds = {
        ("Ensure", True): ("SandboxProvisioned", state_pb2.SANDBOX_PROVISIONED),
        ("Ensure", False): ("SandboxFailed", state_pb2.SANDBOX_FAILED),
        ("Deprovision", True): ("SandboxDeprovisioned", state_pb2.SANDBOX_DEPROVISIONED),
        ("Deprovision", False): ("SandboxTeardownFailed", state_pb2.SANDBOX_TEARDOWN_FAILED),
    }
    kind, lifecycle = kinds[(op, ok)]
    ref = common_pb2.SandboxRef(
        scope=_SCOPES[scope],  # type: ignore[arg-type]
        sandbox_id=sandbox_id,
        name=_base_name(scope, sandbox_id),
        driver=driver,
        task_queue=task_queue if op == "Ensure" else "",
    )
    record = state_pb2.SandboxStatus(
        sandbox=ref,
        lifecycle=lifecycle,  # type: ignore[arg-type]
        reason="" if ok else error,
        outcome_event_id=_outcome_id(causation_id, kind, scope),
    )
    for existing in state.sandboxes:
        if existing.sandbox.scope == ref.scope and existing.sandbox.sandbox_id == sandbox_id:
            existing.CopyFrom(record)
            return
    state.sandboxes.append(record)


def expected_from_plan(
    workload: Workload, result_of: ResultOf | None = None, driver: str = "chaos"
) -> Expected:
    """What must come of the plan, from the spec's lane rules written out here (not the pod's code).

    ``result_of`` gives each driver call's result (the seeded failures of the oracle test, or what the
    chaos run's outcome topic says the driver returned); by default every call succeeds. Upstream
    runs an ensure synchronously in its create / recover pipeline, so each result is folded right
    after its input here; the pod, which completes driver calls later, must end in the same state.

    Records are taken in the order the pod applies each key's records (early ones first, then the
    plan by time; a session's delete comes seconds after its last record). Per the spec, with
    :data:`LANE_ENV` (session routing per session, workflow routing per execution; an unspecified
    session target is CLOUD, an unspecified workflow target LOCAL):

    * an input whose id the key already applied (its newest 32) is a duplicate: nothing happens;
    * a phase change before its execution's create is dead-lettered;
    * every other input is applied: its id remembered, ``updated_at`` set to its ``occurred_at``;
    * the first create of an execution (PENDING) provisions when its lane resolves to CLOUD: an agent
      run with a session, no task-queue override and its session not deleted (deleted: refused,
      nothing provisioned); a workflow run, critical (a failure refuses the create); a second create
      (a producer retry under a new id) changes nothing else;
    * a phase change stamped before the stored phase's (strictly, to the nanosecond) is stale: it
      moves nothing, not even ``updated_at``; one stamped in the same instant is applied;
    * the transition is judged against the stored phase; status.error is first-non-empty-wins: the
      session ensure's failure pre-stamps ``Sandbox provisioning failed: <error>``, a phase change's
      error stamps itself; a recover (stored FAILED -> IN_PROGRESS) re-runs the lane: an agent's
      clears the error at once and its ensure's failure stamps nothing; a workflow's ensure is
      critical, clears the error when it goes through and leaves the execution FAILED when refused;
    * a workflow's transition INTO a terminal phase tears its sandbox down (not when its create was
      refused: no sandbox exists); an agent's terminal phase tears nothing down;
    * a session's delete tears its session sandbox down.
    """
    cloud_sessions = LANE_ENV["STIGMER_DEFAULT_EXECUTION_TARGET"] == "cloud"
    cloud_workflows = LANE_ENV["STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET"] == "cloud"
    assert LANE_ENV["STIGMER_ACTIVITY_ROUTING"] == "session"
    assert LANE_ENV["STIGMER_WORKFLOW_ACTIVITY_ROUTING"] == "execution"

    def result(event_id: str, op: Op, optional: bool = False) -> DriverResult | None:
        got = None if result_of is None else result_of(event_id, op)
        if got is None and not optional:
            return (True, "")  # a call that must happen: a missing one shows as a mismatch
        return got

    expected = Expected()
    states = expected.states
    deleted: set[str] = set()

    def lane(
        event: inputs_pb2.ExecutionCreated, cause: str, state: state_pb2.ExecutionState, recover: bool
    ) -> None:
        key = event.execution_id
        if event.kind == P.AGENT_EXECUTION:
            session_id = event.session_id
            if not session_id or event.activity_task_queue:
                return
            if session_id in deleted:
                state.refused = True
                state.refusal_reason = f"session '{session_id}' was deleted"
                return
            if not _cloud(event.session_execution_target, cloud_sessions):
                return
            expected.provision[cause] = key
            got = result(cause, "Ensure")
            assert got is not None
            _record(state, driver, cause, "Ensure", "session", session_id, f"session:{session_id}", got)
            if not got[0] and not recover and not state.status_error:
                state.status_error = PREFIX + got[1]
            return
        if not _cloud(event.workflow_execution_target, cloud_workflows):
            return
        expected.provision[cause] = key
        expected.provisioning_workflows.add(key)
        got = result(cause, "Ensure")
        assert got is not None
        _record(state, driver, cause, "Ensure", "workflow", key, f"wfexec:{key}", got)
        if got[0]:
            state.refused = False
            if recover:
                state.status_error = ""
        else:
            state.refusal_reason = got[1]
            if recover:
                state.phase = P.EXECUTION_FAILED
            else:
                state.refused = True

    for item in workload.all_records():
        event = item.event
        event_id = event.meta.event_id
        key = event.session_id if isinstance(event, inputs_pb2.SessionDeleted) else event.execution_id
        current = states.get(key)
        if current is not None and event_id in current.applied_event_ids:
            continue  # a duplicate
        if isinstance(event, inputs_pb2.PhaseChanged) and (current is None or not current.created):
            expected.dead_letters.add(event_id)
            continue
        state = states.setdefault(key, state_pb2.ExecutionState(schema_version=1, execution_id=key))
        state.applied_event_ids.append(event_id)
        del state.applied_event_ids[:-APPLIED_IDS_KEPT]
        state.applied_count += 1
        at = event.meta.occurred_at
        stale = (
            isinstance(event, inputs_pb2.PhaseChanged)
            and state.HasField("phase_changed_at")
            and _ts(at) < _ts(state.phase_changed_at)
        )
        if stale:
            continue  # moves nothing, not even the clock
        state.updated_at.CopyFrom(at)
        if isinstance(event, inputs_pb2.SessionDeleted):
            deleted.add(key)
            state.session_deleted = True
            expected.teardown[event_id] = key
            expected.deleted_sessions.add(key)
            got = result(event_id, "Deprovision")
            assert got is not None
            _record(state, driver, event_id, "Deprovision", "session", key, "", got)
            continue
        if isinstance(event, inputs_pb2.ExecutionCreated):
            if state.created:
                continue  # a second create: a no-op
            state.created = True
            state.phase = P.EXECUTION_PENDING
            state.kind = event.kind
            state.session_id = event.session_id
            state.org = event.org
            state.created_event.CopyFrom(event)
            state.created_event.ClearField("meta")
            lane(event, event_id, state, recover=False)
            continue
        state.phase_changed_at.CopyFrom(at)
        previous, state.phase = state.phase, event.new_phase
        refused_before = state.refused
        recover = previous == P.EXECUTION_FAILED and event.new_phase == P.EXECUTION_IN_PROGRESS
        if recover and event.kind == P.AGENT_EXECUTION:
            state.status_error = ""
        if event.error and not state.status_error:
            state.status_error = event.error
        if previous == event.new_phase:
            continue
        if event.kind == P.WORKFLOW_EXECUTION and event.new_phase in TERMINALS:
            if refused_before:
                expected.teardown_optional.add(event_id)
                got = result(event_id, "Deprovision", optional=True)
            else:
                expected.teardown[event_id] = key
                got = result(event_id, "Deprovision")
            if got is not None:
                _record(state, driver, event_id, "Deprovision", "workflow", key, "", got)
            continue
        if recover:
            lane(state.created_event, event_id, state, recover=True)
    expected.terminal_workflows = {
        key
        for key, state in states.items()
        if state.kind == P.WORKFLOW_EXECUTION and state.phase in TERMINALS
    }
    return expected


def _cloud(target: int, default_is_cloud: bool) -> bool:
    """An execution target resolved: CLOUD, or unspecified with the lane's default CLOUD."""
    return target == P.CLOUD or (target == P.EXECUTION_TARGET_UNSPECIFIED and default_is_cloud)
