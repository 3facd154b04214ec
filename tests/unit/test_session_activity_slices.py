"""The idle sweep's index of session activity, built inside the pod a slice of states at a time beside
the loop (issue 45 item 1), on a real RocksDB store: pinned by the slices it read and by a task on
the same loop that wakes between them, never by time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from consumers.runtime.session_activity import SLICE, StoreSessionActivity
from consumers.runtime.state.interface import HeldStates
from consumers.runtime.state.rocksdb import RocksDBStore
from drivers.agent_sandbox.idle import SessionActivity
from events.sandbox_lanes.v1 import common_pb2, state_pb2

NOW = 1_000_000.0


class _PodStandIn:
    """What the reader asks of a pod: its held states and where a session's inputs go."""

    def __init__(self, states: HeldStates) -> None:
        self.states = states

    def input_partition_of(self, key: str) -> int:
        return 1 if key.startswith("ses_other") else 0


def _agent(key: str, session: str, phase: int, stamp: float) -> state_pb2.ExecutionState:
    state = state_pb2.ExecutionState(
        execution_id=key,
        kind=common_pb2.AGENT_EXECUTION,
        session_id=session,
        created=True,
        phase=phase,  # type: ignore[arg-type]
    )
    state.updated_at.FromNanoseconds(int(stamp * 1e9))
    return state


def _store(tmp: Path, workflows: int) -> RocksDBStore:
    """``workflows`` workflows' states on partition 0 beside two sessions' executions."""
    store = RocksDBStore("state", directory=tmp)
    store.adopt([0, 1])
    store.apply(
        0,
        {
            f"wfx_{i:05d}": state_pb2.ExecutionState(
                execution_id=f"wfx_{i:05d}", created=True, kind=common_pb2.WORKFLOW_EXECUTION
            )
            for i in range(workflows)
        },
    )
    store.put(0, "axr_1", _agent("axr_1", "ses_a", common_pb2.EXECUTION_COMPLETED, NOW - 500))
    store.put(0, "axr_2", _agent("axr_2", "ses_a", common_pb2.EXECUTION_COMPLETED, NOW - 100))
    store.put(1, "axr_3", _agent("axr_3", "ses_other", common_pb2.EXECUTION_IN_PROGRESS, NOW - 900))
    return store


async def _until_answered(reader: StoreSessionActivity, session: str) -> SessionActivity:
    deadline = time.monotonic() + 30
    while (answer := reader.activity(session)) is None:
        assert time.monotonic() < deadline, "no index built"
        await asyncio.sleep(0)
    return answer


async def test_the_index_is_built_a_slice_at_a_time_the_loop_turning_between(tmp_path: Path) -> None:
    store = _store(tmp_path, 2_000)
    clock = [0.0]
    reader = StoreSessionActivity(_PodStandIn(store), clock=lambda: clock[0], wall=lambda: NOW)  # type: ignore[arg-type]
    wakes = 0
    done = False

    async def beside() -> None:
        nonlocal wakes
        while not done:
            wakes += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(beside())
    assert reader.activity("ses_a") is None  # nothing built yet: not judged this time
    answer = await _until_answered(reader, "ses_a")
    done = True
    await ticker
    assert answer == SessionActivity(busy=False, last_active_at=NOW - 100, executions=2)
    assert reader.activity("ses_other") == SessionActivity(busy=True, last_active_at=NOW - 900, executions=1)
    assert reader.activity("ses_none") == SessionActivity(busy=False, last_active_at=None, executions=0)
    # Partition 0: 2,002 states, partition 1: one; never more than SLICE between two yields.
    assert sum(reader.slices) == 2_003 and max(reader.slices) == SLICE
    assert len(reader.slices) == -(-2_002 // SLICE) + 1
    assert wakes >= len(reader.slices), (wakes, len(reader.slices))


async def test_a_stale_index_answers_while_the_next_one_is_built(tmp_path: Path) -> None:
    store = _store(tmp_path, 300)
    clock = [0.0]
    reader = StoreSessionActivity(_PodStandIn(store), clock=lambda: clock[0], wall=lambda: NOW)  # type: ignore[arg-type]
    await _until_answered(reader, "ses_a")
    store.put(0, "axr_4", _agent("axr_4", "ses_a", common_pb2.EXECUTION_IN_PROGRESS, NOW - 10))
    assert reader.activity("ses_a") == SessionActivity(busy=False, last_active_at=NOW - 100, executions=2)
    clock[0] = 1.0  # the index is a TTL old: the next question starts a build, answered from the last
    assert reader.activity("ses_a") == SessionActivity(busy=False, last_active_at=NOW - 100, executions=2)
    fresh = SessionActivity(busy=True, last_active_at=NOW - 10, executions=3)
    deadline = time.monotonic() + 30
    while reader.activity("ses_a") != fresh:
        assert time.monotonic() < deadline, reader.activity("ses_a")
        await asyncio.sleep(0)


def test_without_a_running_loop_the_index_is_built_at_once(tmp_path: Path) -> None:
    """A tool or a test with no loop to hold gets its answer at the first question."""
    reader = StoreSessionActivity(_PodStandIn(_store(tmp_path, 10)), wall=lambda: NOW)  # type: ignore[arg-type]
    assert reader.activity("ses_a") == SessionActivity(busy=False, last_active_at=NOW - 100, executions=2)
    assert reader.slices == []
