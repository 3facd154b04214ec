"""The chaos test's oracle (``expected_from_plan``, the spec's lane rules written out over the plan)
against the pod's pure rules, on seeded workloads: both must say the same of every input and end every
execution in the same whole state (phase, status_error, sandboxes, applied ids, clocks, refusals).

The workloads hold recovers, stale and equal timestamps, duplicates, early (dead-lettered) records and
session deletes; driver calls fail by a seeded rule, and the rules' driver calls complete the way the
pod completes them: at once, all at the very end, or at random points in between (in decision order
per execution). The chaos test checks the running pods against the same oracle.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from consumers.lanes.commands import CommandResult, Deprovision, Ensure, LaneConfig, StateView
from consumers.lanes.rules import complete_effect, decide
from consumers.ops.settings import load_settings
from events.codec import state_key
from events.sandbox_lanes.v1 import state_pb2
from tests.support.chaos_workload import (
    LANE_ENV,
    DriverResult,
    Expected,
    Op,
    Workload,
    expected_from_plan,
    generate,
)

Schedule = str  # "at once" | "at the end" | "random"


def injected(event_id: str, op: Op) -> DriverResult:
    """The seeded driver: about one call in five fails, with a message naming it."""
    digest = hashlib.sha256(f"{event_id}/{op}".encode()).hexdigest()
    if int(digest[:2], 16) < 52:
        return False, f"injected {op.lower()} failure {digest[:6]}"
    return True, ""


def _through_the_rules(
    workload: Workload, schedule: Schedule, seed: int
) -> tuple[Expected, dict[tuple[str, Op], DriverResult]]:
    """Every planned record through ``decide``; driver calls completed by ``complete_effect``."""
    settings = load_settings({"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9092", **LANE_ENV})
    config = LaneConfig(enabled=True, agent=settings.agent, workflow=settings.workflow, driver_name="chaos")
    rng = random.Random(seed)
    states: dict[str, state_pb2.ExecutionState] = {}
    results: dict[tuple[str, Op], DriverResult] = {}
    got = Expected()

    def complete_first(key: str) -> None:
        state = states[key]
        entry = state.pending[0]
        op: Op = "Ensure" if entry.op == state_pb2.EFFECT_OP_ENSURE else "Deprovision"
        ok, error = results.setdefault((entry.causation_id, op), injected(entry.causation_id, op))
        result = CommandResult(ok=ok, error=error, probe_state="running" if ok and op == "Ensure" else "")
        outcome = complete_effect(state, entry.effect_id, result, config)
        assert outcome.state is not None and len(outcome.outputs) == 1
        states[key] = outcome.state

    for item in workload.all_records():
        event = item.event
        key = state_key(event)
        decision = decide(event, StateView(states.get(key), states.get), config)
        event_id = event.meta.event_id
        if decision.reject is not None:
            got.dead_letters.add(event_id)
            continue
        if decision.duplicate or decision.state is None:
            continue
        states[key] = decision.state
        for command in decision.commands:
            if isinstance(command, Ensure):
                got.provision[event_id] = key
            elif isinstance(command, Deprovision):
                got.teardown[event_id] = key
        if schedule == "at once":
            while states[key].pending:
                complete_first(key)
        elif schedule == "random":
            for other in [k for k, s in states.items() if s.pending]:
                while states[other].pending and rng.random() < 0.3:
                    complete_first(other)
    for key in list(states):
        while states[key].pending:
            complete_first(key)
    got.states = states
    return got, results


def _diff(want: state_pb2.ExecutionState, got: state_pb2.ExecutionState) -> list[str]:
    fields = {f.name for f, _ in want.ListFields()} | {f.name for f, _ in got.ListFields()}
    return sorted(
        f"{name}: oracle {getattr(want, name)!r}, rules {getattr(got, name)!r}"
        for name in fields
        if getattr(want, name) != getattr(got, name)
    )


def compare(workload: Workload, schedule: Schedule, seed: int) -> Expected:
    rules, results = _through_the_rules(workload, schedule, seed)
    oracle = expected_from_plan(workload, lambda event_id, op: results.get((event_id, op)), driver="chaos")
    where = f"seed {workload.seed}, {schedule}"
    assert rules.provision == oracle.provision, where
    assert rules.dead_letters == oracle.dead_letters, where
    required = {k: v for k, v in rules.teardown.items() if k not in oracle.teardown_optional}
    assert required == oracle.teardown, where
    assert set(rules.states) == set(oracle.states), where
    for key, want in oracle.states.items():
        got = rules.states[key]
        assert got == want, f"{where}, {key}: " + "; ".join(_diff(want, got))
    return oracle


@pytest.mark.parametrize("schedule", ["at once", "at the end", "random"])
def test_the_chaos_oracle_and_the_pure_rules_agree_on_seeded_workloads(schedule: Schedule) -> None:
    totals: dict[str, int] = dict.fromkeys(
        ("recovers", "stale", "equal timestamps", "duplicates", "retries", "failed", "dead", "optional"), 0
    )
    for seed in range(30):
        workload = generate(150, seed)
        oracle = compare(workload, schedule, seed)
        # Every kind of expectation is exercised: agreement is not agreement on nothing.
        assert oracle.provision and oracle.teardown and oracle.terminal_workflows and oracle.deleted_sessions
        for name in ("recovers", "stale", "equal timestamps", "duplicates", "retries"):
            totals[name] += workload.counts[name]
        totals["failed"] += sum(
            1
            for s in oracle.states.values()
            for box in s.sandboxes
            if box.lifecycle == state_pb2.SANDBOX_FAILED
        )
        totals["dead"] += len(oracle.dead_letters)
        totals["optional"] += len(oracle.teardown_optional)
        errors = [s.status_error for s in oracle.states.values()]
        assert any(e.startswith("Sandbox provisioning failed: injected") for e in errors)
        assert any(e.startswith("step ") for e in errors) and "stale write" not in errors
    assert all(totals.values()), totals
