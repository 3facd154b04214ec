"""The stores' cursor (``scan``): a partition's serialized states in key order, a bounded slice per
call, resumed past the last key seen. Both stores alike; the RocksDB one on a real database."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumers.runtime.state.interface import StateStore
from consumers.runtime.state.rocksdb import RocksDBStore
from consumers.runtime.state.store import MemoryStore
from events.codec import decode_state
from events.sandbox_lanes.v1 import common_pb2, state_pb2


def _state(key: str) -> state_pb2.ExecutionState:
    return state_pb2.ExecutionState(execution_id=key, created=True, phase=common_pb2.EXECUTION_IN_PROGRESS)


@pytest.fixture(params=["memory", "rocksdb"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> StateStore:
    if request.param == "memory":
        return MemoryStore("state")
    disk = RocksDBStore("state", directory=tmp_path)
    disk.adopt([0, 1])
    return disk


def test_a_scan_walks_a_partition_in_key_order_a_slice_at_a_time(store: StateStore) -> None:
    for key in ("exec-c", "exec-a", "exec-d", "exec-b"):
        store.put(0, key, _state(key))
    store.put(1, "exec-other", _state("exec-other"))
    first = store.scan(0, None, 2)
    assert [k for k, _ in first] == ["exec-a", "exec-b"]
    assert [decode_state(v).execution_id for _, v in first] == ["exec-a", "exec-b"]
    assert [k for k, _ in store.scan(0, "exec-b", 10)] == ["exec-c", "exec-d"]
    assert store.scan(0, "exec-d", 10) == []
    assert [k for k, _ in store.scan(1, None, 10)] == ["exec-other"]
    assert store.scan(7, None, 10) == []  # a partition not held
    assert store.scan(0, None, 0) == []


def test_a_scan_resumed_sees_what_was_written_past_its_cursor_and_not_what_was_removed(
    store: StateStore,
) -> None:
    for key in ("exec-a", "exec-b", "exec-d"):
        store.put(0, key, _state(key))
    (seen,) = store.scan(0, None, 1)
    assert seen[0] == "exec-a"
    store.put(0, "exec-c", _state("exec-c"))  # between two slices: past the cursor
    store.put(0, "exec-0", _state("exec-0"))  # behind the cursor: the next pass's
    store.delete(0, "exec-b")
    assert [k for k, _ in store.scan(0, seen[0], 10)] == ["exec-c", "exec-d"]


def test_a_rocksdb_scan_reads_the_states_not_the_index_nor_the_metadata(tmp_path: Path) -> None:
    """The disk store keeps its due-time index and checkpoint beside the states, under other
    prefixes: a scan returns states only."""
    store = RocksDBStore("state", retention_s=100.0, directory=tmp_path)
    store.adopt([0])
    done = _state("exec-done")
    done.phase = common_pb2.EXECUTION_COMPLETED
    done.updated_at.FromSeconds(1_000)
    store.put(0, "exec-done", done)  # writes a due-time index entry and the count too
    store.put(0, "exec-live", _state("exec-live"))
    assert [k for k, _ in store.scan(0, None, 100)] == ["exec-done", "exec-live"]
    assert store.due(2_000.0, 10) == {0: ["exec-done"]}
