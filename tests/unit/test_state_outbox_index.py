"""A take-over re-runs the driver calls its partitions' states left pending (the outbox): it reads
those states only, never every state held (issue 45). Before, a restart with 300k states held held
the event loop 1.5 s decoding all of them (``sandbox-lanes bench --only scale``); 10M would have
held it for about a minute, past the group's session timeout.

Both stores, the RocksDB one on a real database: the outbox (``pending_items``) follows every write,
tombstone and restore, survives a close and reopen, and the resume decodes only what it lists.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from consumers.runtime.state import memory
from consumers.runtime.state.interface import StateStore
from consumers.runtime.state.memory import MemoryStore
from consumers.runtime.state.recovery import _resume
from consumers.runtime.state.rocksdb import RocksDBStore
from events.sandbox_lanes.v1 import common_pb2, state_pb2


def _state(key: str, *, pending: bool = False) -> state_pb2.ExecutionState:
    state = state_pb2.ExecutionState(execution_id=key, created=True, phase=common_pb2.EXECUTION_IN_PROGRESS)
    if pending:
        entry = state.pending.add()
        entry.effect_id = f"{key}-teardown"
        entry.op = state_pb2.EFFECT_OP_DEPROVISION
        entry.scope = common_pb2.SANDBOX_SCOPE_WORKFLOW
        entry.sandbox_id = key
        entry.phase = common_pb2.EXECUTION_COMPLETED
    return state


def _outbox(store: StateStore, partition: int) -> list[str]:
    return [key for key, _ in store.pending_items(partition)]


def test_the_outbox_follows_each_write_and_tombstone(each_store: StateStore) -> None:
    store = each_store
    store.apply(0, {f"exec-{i}": _state(f"exec-{i}") for i in range(50)})
    assert _outbox(store, 0) == []
    store.apply(0, {"exec-7": _state("exec-7", pending=True), "exec-3": _state("exec-3", pending=True)})
    store.apply(1, {"exec-other": _state("exec-other", pending=True)})
    assert _outbox(store, 0) == ["exec-3", "exec-7"]
    assert _outbox(store, 1) == ["exec-other"]
    ((_, state),) = [(k, s) for k, s in store.pending_items(0) if k == "exec-7"]
    assert [e.effect_id for e in state.pending] == ["exec-7-teardown"]  # the state as held now
    store.apply(0, {"exec-7": _state("exec-7")})  # its result folded back: nothing pending
    store.apply(0, {"exec-3": None})  # removed
    assert _outbox(store, 0) == []
    store.put(0, "exec-9", _state("exec-9", pending=True))
    store.delete(0, "exec-9")
    assert _outbox(store, 0) == [] and _outbox(store, 7) == []
    store.drop([1])
    assert _outbox(store, 1) == []


def test_the_rocksdb_outbox_survives_a_reopen(tmp_path: Path) -> None:
    store = RocksDBStore("state", directory=tmp_path)
    store.adopt([0])
    store.apply(0, {"a": _state("a", pending=True), "b": _state("b")})
    store.close()
    again = RocksDBStore("state", directory=tmp_path)
    again.adopt([0])
    try:
        assert _outbox(again, 0) == ["a"]
    finally:
        again.close()


class _Effects:
    """What ``_resume`` submits to: the pending calls, by effect id."""

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit(self, partition: int, key: str, effect_id: str, command: Any) -> int:
        self.submitted.append(effect_id)
        return 1


def test_a_resume_decodes_only_the_states_with_calls_pending(
    each_store: StateStore, store_decodes: list[bytes]
) -> None:
    store = each_store
    held = 2_000
    store.apply(0, {f"exec-{i:05d}": _state(f"exec-{i:05d}") for i in range(held)})
    store.apply(0, {"exec-00042": _state("exec-00042", pending=True)})
    effects = _Effects()
    assert _resume(0, store, effects) == 1  # type: ignore[arg-type]
    assert effects.submitted == ["exec-00042-teardown"]
    assert len(store_decodes) == 1, f"{len(store_decodes)} of {held} states decoded to resume one call"


def test_a_memory_restore_builds_the_outbox_from_the_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory store's restore keeps the outbox of what it read (the RocksDB store's restore
    stages each record as a write: the first test's path)."""
    from aiokafka import ConsumerRecord

    records = [
        ConsumerRecord("state", 0, i, 0, 0, key.encode(), value, None, 0, 0, [])
        for i, (key, value) in enumerate(
            [
                ("a", _state("a", pending=True).SerializeToString()),
                ("b", _state("b", pending=True).SerializeToString()),
                ("a", _state("a").SerializeToString()),  # folded back later in the log
                ("c", _state("c", pending=True).SerializeToString()),
                ("c", None),  # removed
            ]
        )
    ]

    async def read_to_end(*_: Any, **__: Any) -> Any:
        from aiokafka import TopicPartition

        yield TopicPartition("state", 0), records

    store = MemoryStore("state")
    monkeypatch.setattr(memory, "read_to_end", read_to_end)  # the reader's real run: test_effects_kafka
    asyncio.run(store.restore("127.0.0.1:9", [0]))
    assert _outbox(store, 0) == ["b"]
