"""The lane rules pinned with literal expectations written from the spec (issue 29), never computed
with the rules' own helpers: timestamp order (equal and sub-second), first non-empty status.error
across pre-stamps, phase errors and errors that arrive while an ensure is out, ``token_minted``,
``updated_at``, the applied-ids bound for every N from 1 to 80, and literal derived ids.

Every error scenario runs under every completion schedule the pod can produce: a decision's driver
calls complete at once (upstream's synchronous ensure) or any number of later decisions after it,
in decision order. The spec's answer does not depend on when a driver call returns.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from consumers.lanes.commands import CommandResult, Deprovision, Ensure, LaneConfig, StateView
from consumers.lanes.rules import complete, complete_effect, decide
from events.codec import InputEvent
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2
from tests.support.lane_fakes import EXECUTION_ROUTING_CONFIG, SESSION_ROUTING_CLOUD_DEFAULT

P = common_pb2
CONFIG = LaneConfig(
    enabled=True, agent=SESSION_ROUTING_CLOUD_DEFAULT, workflow=EXECUTION_ROUTING_CONFIG, driver_name="d"
)
PREFIX = "Sandbox provisioning failed: "  # spec 2.2, with its trailing space


def ts(seconds: int, nanos: int = 0) -> Timestamp:
    return Timestamp(seconds=seconds, nanos=nanos)


def meta(event_id: str, at: Timestamp | None) -> common_pb2.EventMeta:
    m = common_pb2.EventMeta(event_id=event_id, schema_version=1, source="test")
    if at is not None:
        m.occurred_at.CopyFrom(at)
    return m


def agent_created(
    event_id: str = "c", at: Timestamp | None = None, target: int = P.CLOUD
) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=meta(event_id, at),
        kind=P.AGENT_EXECUTION,
        execution_id="axr_1",
        session_id="ses_1",
        org="org_1",
        session_execution_target=target,  # type: ignore[arg-type]
        caller_identity_id="ida_1",
        caller_class="user",
    )


def wf_created(event_id: str = "c", at: Timestamp | None = None) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=meta(event_id, at),
        kind=P.WORKFLOW_EXECUTION,
        execution_id="wfx_1",
        org="org_1",
        workflow_execution_target=P.CLOUD,
        caller_identity_id="ida_1",
        caller_class="user",
    )


def phase(
    kind: int, event_id: str, new: int, error: str = "", at: Timestamp | None = None
) -> inputs_pb2.PhaseChanged:
    agent = kind == P.AGENT_EXECUTION
    return inputs_pb2.PhaseChanged(
        meta=meta(event_id, at),
        kind=kind,  # type: ignore[arg-type]
        execution_id="axr_1" if agent else "wfx_1",
        session_id="ses_1" if agent else "",
        new_phase=new,  # type: ignore[arg-type]
        error=error,
    )


# --- running a history under every completion schedule -------------------------------------------

OK = CommandResult(ok=True, probe_state="running")


def fail(error: str) -> CommandResult:
    return CommandResult(ok=False, error=error)


@dataclass
class Run:
    state: state_pb2.ExecutionState
    commands: list[tuple[str, str]]
    """(causation event id, "Ensure"/"Deprovision") of every driver call decided, in order."""
    outputs: list[object]


def _schedules(decided_at: Sequence[int], events: int) -> Iterator[tuple[int, ...]]:
    """Each driver call completes after some decision at or after its own, in decision order."""

    def rec(i: int, floor: int) -> Iterator[tuple[int, ...]]:
        if i == len(decided_at):
            yield ()
            return
        for point in range(max(floor, decided_at[i]), events):
            for rest in rec(i + 1, point):
                yield (point, *rest)

    yield from rec(0, 0)


def _decided_at(events: Sequence[InputEvent]) -> list[int]:
    """Which decision each driver call comes from (a dry run, every call succeeding at once)."""
    out: list[int] = []
    state: state_pb2.ExecutionState | None = None
    for i, event in enumerate(events):
        decision = decide(event, StateView(state), CONFIG)
        out += [i] * len(decision.commands)
        state = complete(decision, [OK] * len(decision.commands), CONFIG).state or state
    return out


def run(
    events: Sequence[InputEvent], results: dict[str, CommandResult], schedule: Sequence[int] | None = None
) -> Run:
    """Decide ``events`` in order; the k-th driver call completes right after decision ``schedule[k]``
    (default: at once). ``results`` maps the deciding event's id to its driver call's result."""
    state: state_pb2.ExecutionState | None = None
    commands: list[tuple[str, str]] = []
    outputs: list[object] = []
    completed = 0
    for i, event in enumerate(events):
        decision = decide(event, StateView(state), CONFIG)
        assert decision.reject is None and decision.state is not None, decision
        state = decision.state
        for command in decision.commands:
            commands.append((event.meta.event_id, type(command).__name__))
        while completed < len(commands) and (schedule is None or schedule[completed] <= i):
            entry = state.pending[0]
            result = results.get(entry.causation_id, OK)
            outcome = complete_effect(state, entry.effect_id, result, CONFIG)
            assert outcome.state is not None
            state = outcome.state
            outputs += outcome.outputs
            completed += 1
    assert state is not None and not state.pending and completed == len(commands)
    return Run(state, commands, outputs)


def every_schedule(events: Sequence[InputEvent], results: dict[str, CommandResult]) -> Iterator[Run]:
    n = 0
    for schedule in _schedules(_decided_at(events), len(events)):
        n += 1
        yield run(events, results, schedule)
    assert n >= 1


# --- first non-empty status.error wins (spec 2.2, 2.7) --------------------------------------------

A, W = P.AGENT_EXECUTION, P.WORKFLOW_EXECUTION
IN_PROGRESS, FAILED, COMPLETED = P.EXECUTION_IN_PROGRESS, P.EXECUTION_FAILED, P.EXECUTION_COMPLETED


def _agent(*steps: tuple[str, int, str]) -> list[InputEvent]:
    return [
        agent_created("c", ts(100)),
        *(phase(A, i, p, e, ts(100 + n + 1)) for n, (i, p, e) in enumerate(steps)),
    ]


def _wf(*steps: tuple[str, int, str]) -> list[InputEvent]:
    return [
        wf_created("c", ts(100)),
        *(phase(W, i, p, e, ts(100 + n + 1)) for n, (i, p, e) in enumerate(steps)),
    ]


ERROR_CASES = [
    # (name, events, driver results by deciding event id, status_error, phase)
    ("phase errors: the first wins", _agent(("p1", FAILED, "first"), ("p2", FAILED, "second")), {},
     "first", FAILED),
    ("an empty error clears nothing", _agent(("p1", IN_PROGRESS, "first"), ("p2", COMPLETED, "")), {},
     "first", COMPLETED),
    ("an empty error stamps nothing, the next non-empty one does",
     _agent(("p1", FAILED, ""), ("p2", FAILED, "late")), {}, "late", FAILED),
    ("the pre-stamp wins over a later phase error", _agent(("p1", FAILED, "runner timeout")),
     {"c": fail("quota exhausted: count/secrets")}, PREFIX + "quota exhausted: count/secrets", FAILED),
    ("the pre-stamp wins over two later phase errors",
     _agent(("p1", IN_PROGRESS, "a"), ("p2", FAILED, "b")), {"c": fail("quota")}, PREFIX + "quota", FAILED),
    ("a successful ensure lets the first phase error through",
     _agent(("p1", IN_PROGRESS, "a"), ("p2", FAILED, "b")), {}, "a", FAILED),
    ("an agent recover clears the error; the next one is stamped",
     _agent(("p1", FAILED, "a"), ("r", IN_PROGRESS, ""), ("p3", FAILED, "b")), {}, "b", FAILED),
    ("an agent recover clears a pre-stamp made before it",
     _agent(("p1", FAILED, "a"), ("r", IN_PROGRESS, "")), {"c": fail("quota")}, "", IN_PROGRESS),
    ("an agent recover's failed ensure stamps nothing",
     _agent(("p1", FAILED, "a"), ("r", IN_PROGRESS, "")), {"c": fail("q1"), "r": fail("q2")}, "",
     IN_PROGRESS),
    ("after an agent recover the first new error wins",
     _agent(("p1", FAILED, "a"), ("r", IN_PROGRESS, ""), ("p3", FAILED, "b"), ("p4", FAILED, "c")),
     {"c": fail("q1"), "r": fail("q2")}, "b", FAILED),
    ("a recover's own error is stamped after the clear",
     _agent(("p1", FAILED, "a"), ("r", IN_PROGRESS, "resumed with warnings")), {},
     "resumed with warnings", IN_PROGRESS),
    ("workflow: a refused create stamps nothing, the phase error does",
     _wf(("p1", FAILED, "boom")), {"c": fail("no capacity")}, "boom", FAILED),
    ("workflow: the first phase error wins", _wf(("p1", FAILED, "a"), ("p2", FAILED, "b")), {}, "a", FAILED),
    ("workflow: a recover that goes through clears the error",
     _wf(("p1", FAILED, "boom"), ("r", IN_PROGRESS, "")), {}, "", IN_PROGRESS),
    ("workflow: an error after a recover that goes through is stamped",
     _wf(("p1", FAILED, "boom"), ("r", IN_PROGRESS, ""), ("p3", FAILED, "again")), {}, "again", FAILED),
    ("workflow: a refused recover keeps the error and the execution FAILED",
     _wf(("p1", FAILED, "boom"), ("r", IN_PROGRESS, "")), {"r": fail("no capacity")}, "boom", FAILED),
]  # fmt: skip


@pytest.mark.parametrize(
    ("events", "results", "error", "final_phase"),
    [pytest.param(e, r, s, p, id=name) for name, e, r, s, p in ERROR_CASES],
)
def test_first_non_empty_status_error_wins_whenever_the_driver_calls_return(
    events: list[InputEvent], results: dict[str, CommandResult], error: str, final_phase: int
) -> None:
    for got in every_schedule(events, results):
        assert (got.state.status_error, got.state.phase) == (error, final_phase), got.commands
        assert got.state.deferred_status_error == ""


def test_the_schedules_cover_late_completions() -> None:
    """The harness itself: a create's ensure may return after any later decision."""
    events = _agent(("p1", FAILED, "a"), ("r", IN_PROGRESS, ""))
    assert list(_schedules(_decided_at(events), len(events))) == [
        (0, 2), (1, 2), (2, 2),
    ]  # fmt: skip


def test_errors_that_arrive_while_the_session_ensure_is_out_wait_for_it_first_kept() -> None:
    events = _agent(("p1", IN_PROGRESS, "first"), ("p2", FAILED, "second"))
    state: state_pb2.ExecutionState | None = None
    for event in events:
        state = decide(event, StateView(state), CONFIG).state
    assert state is not None
    assert (state.status_error, state.deferred_status_error) == ("", "first")
    out = complete_effect(state, state.pending[0].effect_id, OK, CONFIG)
    assert out.state is not None and (out.state.status_error, out.state.deferred_status_error) == (
        "first",
        "",
    )


# --- occurred_at order: equal applies, sub-second counts (the stale rule) -------------------------

ORDERS = [
    # (stored phase change's occurred_at, the later-delivered one's, applied?)
    (ts(10), ts(10), True),  # the same instant: not older, applied
    (ts(10, 500), ts(10, 500), True),
    (ts(10, 700_000_000), ts(10, 200_000_000), False),  # 0.5 s older within one second: stale
    (ts(10, 200_000_000), ts(10, 700_000_000), True),
    (ts(10, 1), ts(10, 0), False),  # one nanosecond older
    (ts(10, 0), ts(10, 1), True),
    (ts(11, 0), ts(10, 999_999_999), False),
    (ts(10, 999_999_999), ts(11, 0), True),
    (ts(10), ts(9), False),
    (ts(9), ts(10), True),
]


@pytest.mark.parametrize(("stored", "later", "applied"), ORDERS)
def test_a_completed_against_the_stored_in_progress_by_occurred_at(
    stored: Timestamp, later: Timestamp, applied: bool
) -> None:
    state = decide(wf_created("c", ts(1)), StateView(None), CONFIG).state
    assert state is not None
    state.ClearField("pending")
    state = decide(phase(W, "p1", IN_PROGRESS, at=stored), StateView(state), CONFIG).state
    assert state is not None
    decision = decide(phase(W, "p2", COMPLETED, "done badly", at=later), StateView(state), CONFIG)
    got = decision.state
    assert got is not None and list(got.applied_event_ids) == ["c", "p1", "p2"] and got.applied_count == 3
    if applied:
        assert decision.commands == (Deprovision("workflow", "wfx_1", COMPLETED),)
        assert (got.phase, got.status_error) == (COMPLETED, "done badly")
        assert (got.phase_changed_at, got.updated_at) == (later, later)
    else:
        assert decision.commands == ()
        assert (got.phase, got.status_error) == (IN_PROGRESS, "")
        assert (got.phase_changed_at, got.updated_at) == (stored, stored)


@pytest.mark.parametrize(("stored", "later", "applied"), ORDERS)
def test_a_late_in_progress_against_the_stored_completed_by_occurred_at(
    stored: Timestamp, later: Timestamp, applied: bool
) -> None:
    """A late IN_PROGRESS after COMPLETED: only one written at or after it moves the execution."""
    state = decide(agent_created("c", ts(1)), StateView(None), CONFIG).state
    assert state is not None
    state.ClearField("pending")
    state = decide(phase(A, "p1", COMPLETED, at=stored), StateView(state), CONFIG).state
    assert state is not None
    got = decide(phase(A, "p2", IN_PROGRESS, at=later), StateView(state), CONFIG).state
    assert got is not None
    assert got.phase == (IN_PROGRESS if applied else COMPLETED)
    assert got.updated_at == (later if applied else stored)


def test_a_stale_recover_revives_nothing() -> None:
    """FAILED at t+0.7 s, then a recover written at t+0.2 s: no ensure, still FAILED, error kept."""
    state = decide(wf_created("c", ts(1)), StateView(None), CONFIG).state
    assert state is not None
    state.ClearField("pending")
    state = decide(phase(W, "p1", FAILED, "boom", at=ts(5, 700_000_000)), StateView(state), CONFIG).state
    assert state is not None
    state.ClearField("pending")
    decision = decide(phase(W, "r", IN_PROGRESS, at=ts(5, 200_000_000)), StateView(state), CONFIG)
    assert decision.commands == () and decision.state is not None
    assert (decision.state.phase, decision.state.status_error) == (FAILED, "boom")


# --- updated_at: the latest applied event's occurred_at (the idle sweep's clock) ------------------


def test_updated_at_follows_every_applied_event_and_never_a_stale_one() -> None:
    state = decide(agent_created("c", ts(1_700_000_000, 123_456_789)), StateView(None), CONFIG).state
    assert state is not None and state.updated_at == ts(1_700_000_000, 123_456_789)
    assert not state.HasField("phase_changed_at")  # only phase changes write it
    state.ClearField("pending")
    state = decide(phase(A, "p1", IN_PROGRESS, at=ts(1_700_000_005)), StateView(state), CONFIG).state
    assert state is not None and state.updated_at == ts(1_700_000_005)
    state = decide(phase(A, "p2", COMPLETED, at=ts(1_700_000_009, 1)), StateView(state), CONFIG).state
    assert state is not None and state.updated_at == ts(1_700_000_009, 1)
    stale = decide(phase(A, "p3", IN_PROGRESS, at=ts(1_700_000_009)), StateView(state), CONFIG).state
    assert stale is not None and stale.updated_at == ts(1_700_000_009, 1)
    # An event without occurred_at leaves the clock where it was.
    untimed = decide(agent_created("c2", None), StateView(stale), CONFIG).state
    assert untimed is not None and untimed.updated_at == ts(1_700_000_009, 1)
    first = decide(agent_created("c", None), StateView(None), CONFIG).state
    assert first is not None and not first.HasField("updated_at")
    deleted = inputs_pb2.SessionDeleted(meta=meta("d", ts(1_700_000_100, 7)), session_id="ses_1")
    session = decide(deleted, StateView(None), CONFIG).state
    assert session is not None and session.updated_at == ts(1_700_000_100, 7)


# --- token_minted ----------------------------------------------------------------------------------


@pytest.mark.parametrize("minted", [True, False])
@pytest.mark.parametrize("lane", ["session", "workflow"])
def test_token_minted_is_what_the_edge_reported(lane: str, minted: bool) -> None:
    created = agent_created() if lane == "session" else wf_created()
    result = CommandResult(ok=True, probe_state="stopped", token_minted=minted)
    (sync,) = complete(decide(created, StateView(None), CONFIG), [result], CONFIG).outputs
    state = decide(created, StateView(None), CONFIG).state
    assert state is not None
    (later,) = complete_effect(state, state.pending[0].effect_id, result, CONFIG).outputs
    for out in (sync, later):
        assert isinstance(out, outcomes_pb2.SandboxProvisioned)
        assert out.token_minted is minted and out.probe_state == "stopped"


# --- the applied-ids bound -----------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 81))
def test_the_newest_32_applied_ids_are_kept_for_every_n(n: int) -> None:
    state: state_pb2.ExecutionState | None = None
    for i in range(n):
        decision = decide(agent_created(f"e{i}", ts(100 + i)), StateView(state), CONFIG)
        assert not decision.duplicate
        state = decision.state
    assert state is not None
    kept = [f"e{i}" for i in range(max(0, n - 32), n)]
    assert list(state.applied_event_ids) == kept and state.applied_count == n
    for event_id in kept:  # every remembered id is a duplicate
        again = decide(agent_created(event_id, ts(999)), StateView(state), CONFIG)
        assert again.duplicate and again.state is None
    if n > 32:  # the newest id forgotten is applied again (a no-op create, counted)
        evicted = decide(agent_created(f"e{n - 33}", ts(999)), StateView(state), CONFIG)
        assert not evicted.duplicate and evicted.state is not None
        assert evicted.state.applied_count == n + 1


# --- literal ids and outcomes (uuid5 over "<input id>/<type>/<scope>"; names sbx-<code>-sha256[:12]) ----


def test_a_session_ensure_and_its_outcome_have_literal_ids() -> None:
    created = agent_created("evt-literal-1", ts(1_750_000_000, 5))
    created.session_id = "ses_lit"
    decision = decide(created, StateView(None), CONFIG)
    assert decision.state is not None
    (entry,) = decision.state.pending
    assert entry.effect_id == "b073b635-e018-5482-a6cc-a994e2f574f9"
    ok = CommandResult(ok=True, probe_state="running", token_minted=True)
    (out,) = complete(decision, [ok], CONFIG).outputs
    want = outcomes_pb2.SandboxProvisioned(
        meta=common_pb2.EventMeta(
            event_id="d8451585-7ad4-5249-b13c-9f8051ef7fc7",
            schema_version=1,
            source="sandbox-lanes",
            causation_id="evt-literal-1",
            occurred_at=ts(1_750_000_000, 5),
        ),
        execution_id="axr_1",
        sandbox=common_pb2.SandboxRef(
            scope=P.SANDBOX_SCOPE_SESSION,
            sandbox_id="ses_lit",
            name="sbx-ses-60dad73e07e4",
            driver="d",
            task_queue="session:ses_lit",
        ),
        probe_state="running",
        token_minted=True,
    )
    assert out == want


def test_a_refused_workflow_ensure_has_a_literal_id_and_outcome() -> None:
    created = wf_created("evt-literal-1", ts(1_750_000_000))
    created.execution_id = "wfx_lit"
    decision = decide(created, StateView(None), CONFIG)
    assert decision.state is not None and decision.state.pending[0].effect_id == (
        "65c86efd-6eb0-54a7-9bad-1dc0384a7ac9"
    )
    outcome = complete(decision, [fail("no capacity")], CONFIG)
    (out,) = outcome.outputs
    assert out == outcomes_pb2.SandboxFailed(
        meta=common_pb2.EventMeta(
            event_id="ffb700c0-5d85-5aeb-b790-49d67927595b",
            schema_version=1,
            source="sandbox-lanes",
            causation_id="evt-literal-1",
            occurred_at=ts(1_750_000_000),
        ),
        execution_id="wfx_lit",
        sandbox=common_pb2.SandboxRef(
            scope=P.SANDBOX_SCOPE_WORKFLOW,
            sandbox_id="wfx_lit",
            name="sbx-wfx-ae9df21f4ba1",
            driver="d",
            task_queue="wfexec:wfx_lit",
        ),
        reason="no capacity",
        critical=True,
        code=P.STATUS_CODE_UNAVAILABLE,
        message="failed to provision workflow sandbox",
    )
    assert outcome.state is not None and list(outcome.state.sandboxes) == [
        state_pb2.SandboxStatus(
            sandbox=out.sandbox,
            lifecycle=state_pb2.SANDBOX_FAILED,
            reason="no capacity",
            outcome_event_id="ffb700c0-5d85-5aeb-b790-49d67927595b",
        )
    ]
    assert outcome.state.refused and outcome.state.refusal_reason == "no capacity"


def test_the_ensure_commands_carry_the_spec_request() -> None:
    (ensure,) = decide(agent_created(), StateView(None), CONFIG).commands
    assert isinstance(ensure, Ensure)
    assert (ensure.scope, ensure.sandbox_id, ensure.task_queue, ensure.caller_class, ensure.critical) == (
        "session", "ses_1", "session:ses_1", "user", False,
    )  # fmt: skip
    assert tuple(ensure.mint) == ("session", "ses_1", "axr_1", "org_1", "ida_1")


def test_the_pre_stamp_never_overwrites_an_existing_error() -> None:
    """Spec 7.1: re-seeded with status.error "the real root cause" (a concurrent runner write), the
    failed ensure's pre-stamp leaves it; on an empty error it writes prefix + the driver's message."""
    state = decide(agent_created(), StateView(None), CONFIG).state
    assert state is not None
    seeded = state_pb2.ExecutionState()
    seeded.CopyFrom(state)
    seeded.status_error = "the real root cause"
    for start, want in ((seeded, "the real root cause"), (state, PREFIX + "second failure")):
        out = complete_effect(start, start.pending[0].effect_id, fail("second failure"), CONFIG)
        assert out.state is not None and out.state.status_error == want
        (failed,) = out.outputs
        assert isinstance(failed, outcomes_pb2.SandboxFailed)
        assert (failed.message, failed.reason, failed.critical) == (
            PREFIX + "second failure",
            "second failure",
            False,
        )
