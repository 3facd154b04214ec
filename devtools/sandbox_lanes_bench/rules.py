"""Figure 4: pure decide + complete per input event, no I/O, one core."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.common import bench_lane_config, created_event, summary

logger = logging.getLogger("sandbox_lanes.bench")


# --- 4. pure rules ------------------------------------------------------------------------------


def measure_rules(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    from consumers.lanes.commands import CommandResult, StateView
    from consumers.lanes.rules import complete, decide
    from events.codec import new_meta
    from events.sandbox_lanes.v1 import common_pb2, inputs_pb2

    config = bench_lane_config()
    # Per execution: ExecutionCreated (→ ensure) then PhaseChanged RUNNING→COMPLETED (→ deprovision
    # for a workflow; nothing for an agent). Half agent (session lane), half workflow.
    executions = max(1, args.rules_events // 2)
    pairs = []
    for i in range(executions):
        agent = i % 2 == 0
        eid = f"rx-{i}"
        pairs.append(
            (
                created_event(eid, f"rx-ev-{i}", agent=agent),
                inputs_pb2.PhaseChanged(
                    meta=new_meta(event_id=f"rx-ph-{i}", source="bench"),
                    kind=common_pb2.AGENT_EXECUTION if agent else common_pb2.WORKFLOW_EXECUTION,
                    execution_id=eid,
                    session_id=f"ses-{eid}" if agent else "",
                    previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
                    new_phase=common_pb2.EXECUTION_COMPLETED,
                ),
            )
        )
    ok = CommandResult(ok=True, probe_state="running", token_minted=True)
    empty = StateView(None)
    rates: list[float] = []
    decide_rates: list[float] = []
    with progress("pure rules", args.repeats, enabled=show) as bar:
        for _ in range(args.repeats):
            started = time.perf_counter()
            decisions = 0
            for created, phase in pairs:
                d = decide(created, empty, config)
                o = complete(d, [ok] * len(d.commands), config)
                d2 = decide(phase, StateView(o.state), config)
                complete(d2, [ok] * len(d2.commands), config)
                decisions += 2
            rates.append(decisions / (time.perf_counter() - started))
            # decide() alone: the decision without folding in the commands' results.
            states = [StateView(complete(decide(c, empty, config), [ok], config).state) for c, _ in pairs[:1]]
            started = time.perf_counter()
            for created, phase in pairs:
                decide(created, empty, config)
                decide(phase, states[0], config)
            decide_rates.append(decisions / (time.perf_counter() - started))
            bar.advance()
    return {
        "events_per_run": executions * 2,
        "decisions_per_s_per_core": summary(rates),
        "decide_only_per_s_per_core": summary(decide_rates),
    }
