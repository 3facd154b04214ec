"""A reaper pass inside a pod reads only what its plan depends on, a bounded slice per turn of the loop
(issue 45 item 1). Pinned by what the pass read (states decoded and looked at, per slice) and by a
task on the same loop that counts its wakes between slices, on a real RocksDB store; never by time.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable
from pathlib import Path

import pytest
from harness.memory_driver import MemoryProvisioner

from consumers.lanes.commands import LaneConfig
from consumers.lanes.reap import plan_reap
from consumers.ops.reaper import Reaper
from consumers.ops.reaper_states import LOOKUPS, SLICE, ReadCounts, StoreStates, owned, plan, states_for
from consumers.runtime.kafka.topology import Topics
from consumers.runtime.state.interface import StateStore
from consumers.runtime.state.rocksdb import RocksDBStore
from consumers.runtime.state.store import MemoryStore
from drivers.contract import ManagedSandbox, SandboxEnvironment, SandboxScope
from drivers.naming import sandbox_base_name
from events.sandbox_lanes.v1 import common_pb2, state_pb2

PARTITIONS = 3
SES = common_pb2.SANDBOX_SCOPE_SESSION


def _partition_of(key: str) -> int:
    """Keys name their partition: ``<anything>-p<N>-<rest>``."""
    return int(key.split("-p", 1)[1].split("-", 1)[0])


def _rocksdb(tmp: Path) -> RocksDBStore:
    store = RocksDBStore("state", directory=tmp)
    store.adopt(range(PARTITIONS))
    return store


def _workflow(key: str, phase: int, at: int = 100) -> state_pb2.ExecutionState:
    state = state_pb2.ExecutionState(
        execution_id=key,
        created=True,
        kind=common_pb2.WORKFLOW_EXECUTION,
        phase=phase,  # type: ignore[arg-type]
    )
    state.updated_at.FromSeconds(at)
    return state


def _agent(key: str, session: str, lifecycle: int, at: int) -> state_pb2.ExecutionState:
    """An agent execution of ``session`` whose record of the session's sandbox is ``lifecycle``."""
    state = state_pb2.ExecutionState(
        execution_id=key,
        created=True,
        kind=common_pb2.AGENT_EXECUTION,
        phase=common_pb2.EXECUTION_IN_PROGRESS,
        session_id=session,
    )
    state.updated_at.FromSeconds(at)
    record = state.sandboxes.add()
    record.sandbox.scope = SES
    record.sandbox.sandbox_id = session
    record.lifecycle = lifecycle  # type: ignore[assignment]
    return state


def _deleted(session: str, at: int) -> state_pb2.ExecutionState:
    """A session's own record once its SessionDeleted was applied and its teardown failed."""
    state = state_pb2.ExecutionState(execution_id=session, session_deleted=True)
    state.updated_at.FromSeconds(at)
    record = state.sandboxes.add()
    record.sandbox.scope = SES
    record.sandbox.sandbox_id = session
    record.lifecycle = state_pb2.SANDBOX_TEARDOWN_FAILED
    return state


def _sb(scope: SandboxScope, sid: str) -> ManagedSandbox:
    return ManagedSandbox(scope, sid, sandbox_base_name(scope, sid), "running", created_at=0.0)


def _fill(store: StateStore, partition: int, n: int) -> None:
    """``n`` finished workflows' states no listed sandbox names, in one partition."""
    store.apply(
        partition,
        {
            f"wfx-p{partition}-{i:06d}": _workflow(
                f"wfx-p{partition}-{i:06d}", common_pb2.EXECUTION_COMPLETED
            )
            for i in range(n)
        },
    )


async def _listed(workflows: Iterable[str], sessions: list[str]) -> MemoryProvisioner:
    provisioner = MemoryProvisioner()
    for key in workflows:
        await provisioner.ensure("workflow", key, SandboxEnvironment(task_queue="q"))
    for session in sessions:
        await provisioner.ensure("session", session, SandboxEnvironment(task_queue="q"))
    return provisioner


@pytest.mark.parametrize("held", [0, 3_000])
async def test_a_pass_decodes_one_state_per_listed_sandbox_however_many_are_held(
    tmp_path: Path, held: int
) -> None:
    """With expiring states (retention on), a pass over 6 workflow sandboxes and 2 live sessions'
    sandboxes decodes the 6 workflows' states: the same whether the store holds 6 or 3,006 states."""
    store = _rocksdb(tmp_path)
    for p in range(PARTITIONS):
        _fill(store, p, held // PARTITIONS)
    workflows = {
        f"wfx-p{i % PARTITIONS}-listed{i}": (
            common_pb2.EXECUTION_COMPLETED if i < 3 else common_pb2.EXECUTION_PENDING
        )
        for i in range(6)
    }
    for key, phase in workflows.items():
        store.put(_partition_of(key), key, _workflow(key, phase))
    provisioner = await _listed(workflows, ["ses-p0-live", "ses-p1-quiet"])
    store.put(0, "axr-p0-1", _agent("axr-p0-1", "ses-p0-live", state_pb2.SANDBOX_PROVISIONED, at=100))
    reaper = Reaper(
        provisioner,
        "127.0.0.1:9",
        Topics(),
        LaneConfig(enabled=True, driver_name="memory"),
        local=StoreStates(store, _partition_of),
        states_expire=True,
    )
    counts = ReadCounts()
    plans, n_states = await reaper.plan(now=10_000.0, counts=counts)
    verdicts = {p.sandbox.sandbox_id: p.verdict for p in plans}
    assert verdicts == {
        "wfx-p0-listed0": "reap",
        "wfx-p1-listed1": "reap",
        "wfx-p2-listed2": "reap",
        "wfx-p0-listed3": "keep",
        "wfx-p1-listed4": "keep",
        "wfx-p2-listed5": "keep",
        "ses-p0-live": "keep",
        "ses-p1-quiet": "keep",
    }
    assert n_states == held + 7
    assert (sum(counts.decoded), sum(counts.looked_at), len(counts.looked_at)) == (6, 6, 1)


async def test_a_deleted_sessions_references_are_read_from_the_session_index_the_loop_turning_between(
    tmp_path: Path,
) -> None:
    """A deleted session's sandbox is judged by what references the session: those states are read
    from the store's session index, never the 1,500 others of their partitions (the partition was
    read through before: 1,507 states looked at); a task on the same loop wakes between every two
    slices. An agent execution that provisioned the session again after its delete keeps it; the
    other deleted session, referenced by nothing newer, goes."""
    store = _rocksdb(tmp_path)
    _fill(store, 0, 1_000)
    _fill(store, 1, 500)
    store.put(0, "ses-p0-back", _deleted("ses-p0-back", at=1_000))
    store.put(
        0, "axr-p0-later", _agent("axr-p0-later", "ses-p0-back", state_pb2.SANDBOX_PROVISIONED, at=2_000)
    )
    store.put(
        0, "axr-p0-before", _agent("axr-p0-before", "ses-p0-back", state_pb2.SANDBOX_PROVISIONED, at=500)
    )
    store.put(1, "ses-p1-gone", _deleted("ses-p1-gone", at=1_000))
    store.put(
        1, "axr-p1-before", _agent("axr-p1-before", "ses-p1-gone", state_pb2.SANDBOX_PROVISIONED, at=900)
    )
    listed = [_sb("session", "ses-p0-back"), _sb("session", "ses-p1-gone")]
    counts = ReadCounts()
    seen_between: set[int] = set()
    done = False

    async def ticker() -> None:
        while not done:
            seen_between.add(len(counts.looked_at))  # slices finished when this task ran
            await asyncio.sleep(0)

    beside = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    states = await states_for(
        StoreStates(store, _partition_of), listed, states_expire=True, slice_size=100, counts=counts
    )
    done = True
    await beside
    slices = len(counts.looked_at)
    # One slice of point lookups, then each partition's session: its own state and what names it.
    assert slices == 1 + 1 + 1
    assert sum(counts.looked_at) == 2 + 3 + 2
    assert sum(counts.decoded) == 2 + 3 + 2
    assert set(range(1, slices + 1)) <= seen_between, "the loop ran nothing else between two slices"
    verdicts = {
        p.sandbox.sandbox_id: (p.verdict, p.reason) for p in plan_reap(listed, states, 10_000.0, 600.0)
    }
    assert verdicts == {
        "ses-p0-back": ("keep", "session re-provisioned after its deletion"),
        "ses-p1-gone": ("reap", "session deleted"),
    }


async def test_a_pass_judges_as_a_plan_over_every_held_state_would(tmp_path: Path) -> None:
    """The states a pass reads are enough: over a random mix (workflows in every phase, live, quiet
    and deleted sessions, executions referencing them before and after a delete), the verdicts
    from what the pass read equal those of the plan over every state held (what a pass read before
    issue 45), with and without expiring states."""
    rng = random.Random(45)
    stores: list[StateStore] = [MemoryStore("state"), _rocksdb(tmp_path)]
    every: dict[str, state_pb2.ExecutionState] = {}
    listed: list[ManagedSandbox] = []
    phases = list(common_pb2.ExecutionPhase.values())
    lifecycles = list(state_pb2.SandboxLifecycle.values())
    for i in range(120):
        p = i % PARTITIONS
        key = f"wfx-p{p}-{i}"
        if rng.random() < 0.8:
            every[key] = _workflow(key, rng.choice(phases))
        if rng.random() < 0.7:
            listed.append(_sb("workflow", key))
    for i in range(40):
        p = i % PARTITIONS
        session = f"ses-p{p}-{i}"
        if rng.random() < 0.5:
            every[session] = _deleted(session, at=1_000)
        for j in range(rng.randrange(3)):
            key = f"axr-p{p}-{i}-{j}"
            every[key] = _agent(key, session, rng.choice(lifecycles), at=rng.choice([500, 2_000]))
        if rng.random() < 0.8:
            listed.append(_sb("session", session))
    for store in stores:
        for key, state in every.items():
            store.put(_partition_of(key), key, state)
    reasons: set[str] = set()
    for store in stores:
        for expire in (True, False):
            read = await states_for(StoreStates(store, _partition_of), listed, states_expire=expire)
            assert len(read) < len(every)
            # Planned a few sandboxes at a time, its index of references a few states at a time.
            got = await plan(listed, read, 10_000.0, 600.0, states_expire=expire, slice_size=7, lookups=5)
            want = plan_reap(listed, every, 10_000.0, 600.0, states_expire=expire)
            assert [p.verdict for p in got] == [p.verdict for p in want]
            # A reap's reason is its SandboxReaped's: the same. A kept session's may name the
            # retention rather than the states not read (kept either way, see needs_references).
            assert [p.reason for p in got if p.verdict == "reap"] == [
                p.reason for p in want if p.verdict == "reap"
            ]
            reasons |= {p.reason for p in want}
    # The mix reaches every way a session sandbox is judged.
    assert {
        "session deleted",
        "session re-provisioned after its deletion",
        "session referenced by execution state",
        "no execution state past grace",
    } <= reasons, reasons


async def test_many_listed_sandboxes_are_looked_up_a_slice_at_a_time(tmp_path: Path) -> None:
    store = _rocksdb(tmp_path)
    listed = [_sb("workflow", f"wfx-p{i % PARTITIONS}-{i}") for i in range(2 * LOOKUPS + 3)]
    for sandbox in listed[::2]:
        key = sandbox.sandbox_id
        store.put(_partition_of(key), key, _workflow(key, common_pb2.EXECUTION_COMPLETED))
    counts = ReadCounts()
    states = await states_for(StoreStates(store, _partition_of), listed, states_expire=True, counts=counts)
    assert sorted(states) == sorted(s.sandbox_id for s in listed[::2])
    assert len(counts.looked_at) == 3 and max(counts.decoded) <= LOOKUPS


async def test_the_plan_and_the_ownership_filter_yield_to_the_loop_between_slices(tmp_path: Path) -> None:
    """Thousands of listed sandboxes (a driver's whole listing) are filtered by partition and judged
    LOOKUPS at a time: a task beside wakes between every two slices of each."""
    store = _rocksdb(tmp_path)
    listed = [_sb("workflow", f"wfx-p{i % 4}-{i}") for i in range(4 * LOOKUPS)]  # partition 3: not held
    wakes = 0
    done = False

    async def beside() -> None:
        nonlocal wakes
        while not done:
            wakes += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(beside())
    await asyncio.sleep(0)
    start = wakes
    mine = await owned(StoreStates(store, _partition_of), listed)
    filtered_wakes = wakes - start
    plans = await plan(mine, {}, 10_000.0, 600.0, states_expire=True)
    planned_wakes = wakes - start - filtered_wakes
    done = True
    await ticker
    assert len(mine) == 3 * LOOKUPS and all(_partition_of(m.sandbox_id) != 3 for m in mine)
    assert [p.verdict for p in plans] == ["reap"] * len(mine)  # no state, past grace
    assert filtered_wakes >= 4 and planned_wakes >= 3


def test_a_slice_is_small() -> None:
    """One slice decodes at most SLICE states (~5 us each) or looks up LOOKUPS: about a millisecond."""
    assert 16 <= SLICE <= 1_000 and 16 <= LOOKUPS <= 256
