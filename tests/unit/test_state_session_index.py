"""The session index: a session's states are read from it, never a partition through (issue 45). Before,
the idle sweep's activity index was rebuilt from every held state each pass (1.2 s of CPU with 1M
states, every 30 s) and the reaper read a deleted session's partition through (14 s at 10M).

Both stores, the RocksDB one on a real database: ``referencing`` follows every write, a reference
dropped, a tombstone, a partition dropped and a restore, survives a close and reopen, and what the
idle sweep asks decodes the session's states only.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import ConsumerRecord

from consumers.runtime.session_activity import StoreSessionActivity
from consumers.runtime.state import memory
from consumers.runtime.state.interface import StateStore
from consumers.runtime.state.memory import MemoryStore
from consumers.runtime.state.rocksdb import RocksDBStore
from drivers.agent_sandbox.idle import SessionActivity
from events.sandbox_lanes.v1 import common_pb2, state_pb2

NOW = 1_000_000.0


def _agent(
    key: str, session: str, phase: int = common_pb2.EXECUTION_COMPLETED, stamp: float = NOW - 100
) -> state_pb2.ExecutionState:
    state = state_pb2.ExecutionState(
        execution_id=key,
        kind=common_pb2.AGENT_EXECUTION,
        session_id=session,
        created=True,
        phase=phase,  # type: ignore[arg-type]
    )
    state.updated_at.FromNanoseconds(int(stamp * 1e9))
    return state


def _recording(key: str, *sessions: str) -> state_pb2.ExecutionState:
    """A workflow's state that records session sandboxes (it references them, with no session id)."""
    state = state_pb2.ExecutionState(execution_id=key, kind=common_pb2.WORKFLOW_EXECUTION, created=True)
    for session in sessions:
        status = state.sandboxes.add()
        status.sandbox.scope = common_pb2.SANDBOX_SCOPE_SESSION
        status.sandbox.sandbox_id = session
    return state


def _workflow(key: str) -> state_pb2.ExecutionState:
    return state_pb2.ExecutionState(execution_id=key, kind=common_pb2.WORKFLOW_EXECUTION, created=True)


def _of(store: StateStore, partition: int, session: str) -> list[str]:
    return [key for key, _ in store.referencing(partition, session)]


def test_the_index_follows_each_write_reference_and_tombstone(each_store: StateStore) -> None:
    store = each_store
    store.apply(0, {f"wf-{i}": _workflow(f"wf-{i}") for i in range(50)})
    store.apply(
        0,
        {
            "ax-1": _agent("ax-1", "ses-a"),
            "ax-2": _agent("ax-2", "ses-ab"),
            "wf-r": _recording("wf-r", "ses-a", "ses-b"),
        },
    )
    store.apply(1, {"ax-9": _agent("ax-9", "ses-a")})
    assert _of(store, 0, "ses-a") == ["ax-1", "wf-r"]
    assert _of(store, 0, "ses-ab") == ["ax-2"]  # one id the prefix of another: each its own
    long_id = "ses-" + "l" * 70_000  # longer than a 2-byte length could say
    store.apply(0, {"ax-long": _agent("ax-long", long_id)})
    assert _of(store, 0, long_id) == ["ax-long"] and _of(store, 0, long_id[:-1]) == []
    store.apply(0, {"ax-long": None})
    assert _of(store, 0, long_id) == []
    assert _of(store, 0, "ses-b") == ["wf-r"]
    assert _of(store, 1, "ses-a") == ["ax-9"] and _of(store, 0, "ses-none") == []
    ((_, state),) = list(store.referencing(0, "ses-ab"))
    assert state.session_id == "ses-ab"  # the state as held
    store.apply(0, {"wf-r": _recording("wf-r", "ses-b")})  # ses-a's record gone from the state
    assert _of(store, 0, "ses-a") == ["ax-1"] and _of(store, 0, "ses-b") == ["wf-r"]
    store.apply(0, {"wf-r": _workflow("wf-r")})  # no session referenced any more
    assert _of(store, 0, "ses-b") == []
    store.apply(0, {"ax-1": None})  # removed
    store.put(0, "ax-3", _agent("ax-3", "ses-a"))
    store.delete(0, "ax-3")
    assert _of(store, 0, "ses-a") == []
    store.drop([1])
    assert _of(store, 1, "ses-a") == []


def test_the_rocksdb_index_survives_a_reopen_and_leaves_no_entry_behind(tmp_path: Path) -> None:
    store = RocksDBStore("state", directory=tmp_path)
    store.adopt([0])
    store.apply(
        0, {"a": _agent("a", "ses-1"), "b": _recording("b", "ses-1", "ses-2"), "c": _agent("c", "ses-2")}
    )
    store.apply(0, {"c": None, "b": _recording("b", "ses-2")})
    store.close()
    again = RocksDBStore("state", directory=tmp_path)
    again.adopt([0])
    try:
        assert _of(again, 0, "ses-1") == ["a"] and _of(again, 0, "ses-2") == ["b"]
        again.apply(0, {"a": None, "b": None})
        # Every index entry and its per-key record went with the states: nothing left to leak.
        db = again._parts[0].db
        left = [k for k, _ in db.items() if k[:1] in (b"x", b"y", b"s")]
        assert left == []
    finally:
        again.close()


def _records(pairs: list[tuple[str, state_pb2.ExecutionState | None]]) -> list[Any]:
    return [
        ConsumerRecord(
            "state", 0, i, 0, 0, key.encode(), None if s is None else s.SerializeToString(), None, 0, 0, []
        )
        for i, (key, s) in enumerate(pairs)
    ]


_LOG: list[tuple[str, state_pb2.ExecutionState | None]] = [
    ("a", _agent("a", "ses-1")),
    ("b", _recording("b", "ses-1")),
    ("a", _agent("a", "ses-1", common_pb2.EXECUTION_IN_PROGRESS)),  # the same key again, later in the log
    ("c", _agent("c", "ses-1")),
    ("c", None),  # removed
    ("b", _workflow("b")),  # its reference dropped
]


def test_a_memory_restore_builds_the_index_from_the_records(monkeypatch: pytest.MonkeyPatch) -> None:
    async def read_to_end(*_: Any, **__: Any) -> Any:
        from aiokafka import TopicPartition

        yield TopicPartition("state", 0), _records(_LOG)

    store = MemoryStore("state")
    monkeypatch.setattr(memory, "read_to_end", read_to_end)  # the reader's real run: test_effects_kafka
    asyncio.run(store.restore("127.0.0.1:9", [0]))
    assert _of(store, 0, "ses-1") == ["a"]


def test_a_rocksdb_restore_folds_the_index_from_the_records(tmp_path: Path) -> None:
    store = RocksDBStore("state", directory=tmp_path)
    store.adopt([0])
    try:
        store._fold(store._parts[0], 0, _records(_LOG), time.time())
        assert _of(store, 0, "ses-1") == ["a"]
        ((_, state),) = list(store.referencing(0, "ses-1"))
        assert state.phase == common_pb2.EXECUTION_IN_PROGRESS  # the last write of the key
    finally:
        store.close()


class _PodStandIn:
    """What the reader asks of a pod: its held states and where a session's inputs go."""

    def __init__(self, states: StateStore) -> None:
        self.states = states

    def input_partition_of(self, key: str) -> int:
        return 1 if key.startswith("ses-other") else 0


def test_the_idle_sweeps_question_decodes_the_sessions_states_only(
    each_store: StateStore, store_decodes: list[bytes]
) -> None:
    store = each_store
    held = 2_000
    store.apply(0, {f"wf-{i:05d}": _workflow(f"wf-{i:05d}") for i in range(held)})
    store.apply(0, {f"ax-{i}": _agent(f"ax-{i}", f"ses-{i}") for i in range(held)})  # other sessions
    store.apply(0, {"ax-a1": _agent("ax-a1", "ses-a", stamp=NOW - 500), "ax-a2": _agent("ax-a2", "ses-a")})
    store.apply(1, {"ax-o": _agent("ax-o", "ses-other", common_pb2.EXECUTION_IN_PROGRESS, NOW - 900)})
    reader = StoreSessionActivity(_PodStandIn(store), wall=lambda: NOW)  # type: ignore[arg-type]
    assert reader.activity("ses-a") == SessionActivity(busy=False, last_active_at=NOW - 100, executions=2)
    assert len(store_decodes) == 2, (
        f"{len(store_decodes)} of {2 * held + 3} states decoded for a session of 2"
    )
    assert reader.activity("ses-other") == SessionActivity(busy=True, last_active_at=NOW - 900, executions=1)
    assert reader.activity("ses-none") == SessionActivity(busy=False, last_active_at=None, executions=0)
    store.put(0, "ax-a3", _agent("ax-a3", "ses-a", common_pb2.EXECUTION_IN_PROGRESS, NOW - 10))
    assert reader.activity("ses-a") == SessionActivity(busy=True, last_active_at=NOW - 10, executions=3)
