"""The chaos test's oracle (``expected_from_plan``, the spec's lane rules written out over the plan)
against the pod's pure rules, on seeded workloads: both must say the same of every input.

The chaos test checks the running pods against the oracle; this checks the oracle and the rules
against each other without Kafka, so a disagreement names the workload's seed and the field.
"""

from __future__ import annotations

import dataclasses

from consumers.lanes.commands import CommandResult, Deprovision, Ensure, LaneConfig, StateView
from consumers.lanes.rules import complete, decide
from consumers.ops.settings import load_settings
from events.codec import state_key
from events.sandbox_lanes.v1 import inputs_pb2, state_pb2
from tests.chaos_workload import LANE_ENV, Expected, Workload, expected_from_plan, generate


def _through_the_rules(workload: Workload) -> Expected:
    """Every planned record through ``decide`` / ``complete`` (every driver call succeeding)."""
    settings = load_settings({"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9092", **LANE_ENV})
    config = LaneConfig(enabled=True, agent=settings.agent, workflow=settings.workflow, driver_name="chaos")
    states: dict[str, state_pb2.ExecutionState | None] = {}
    got = Expected()
    ok = CommandResult(ok=True, probe_state="running")
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
        for command in decision.commands:
            if isinstance(command, Ensure):
                got.provision[event_id] = key
                if command.scope == "workflow":
                    got.provisioning_workflows.add(key)
            elif isinstance(command, Deprovision):
                got.teardown[event_id] = key
                (got.terminal_workflows if command.scope == "workflow" else got.deleted_sessions).add(key)
        if isinstance(event, inputs_pb2.PhaseChanged) and event.error:
            got.errors.setdefault(key, []).append(event.error)
        state = complete(decision, [ok] * len(decision.commands), config).state
        states[key] = state
        if isinstance(event, inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged):
            assert state is not None
            got.phase[key] = state.phase
            got.kind[key] = event.kind
    return got


def test_the_chaos_oracle_and_the_pure_rules_agree_on_seeded_workloads() -> None:
    dead_letters = retries = 0
    for seed in range(40):
        workload = generate(150, seed)
        oracle = expected_from_plan(workload)
        rules = _through_the_rules(workload)
        for f in dataclasses.fields(Expected):
            assert getattr(rules, f.name) == getattr(oracle, f.name), f"seed {seed}: {f.name}"
        # Every kind of expectation is exercised: agreement is not agreement on nothing.
        assert oracle.provision and oracle.teardown and oracle.errors and oracle.terminal_workflows
        assert oracle.deleted_sessions and workload.counts["duplicates"]
        dead_letters += len(oracle.dead_letters)
        retries += workload.counts["retries"]
    assert dead_letters > 0 and retries > 0
