"""A write of a key the transaction read skips the reads of what it replaces (issue 45: at 10M states
held, a new execution's write read its removal time and its state through every level of the database,
and a running execution's update missed its removal time and, for a workflow, its session references
the same way). The hint changes how much is read, never what is stored: the same writes applied with
and without it leave byte-identical databases, on a real RocksDB store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from consumers.runtime.state.rocksdb import RocksDBStore
from events.sandbox_lanes.v1 import common_pb2, state_pb2


def _state(
    key: str, *, session: str = "", finished: bool = False, pending: bool = False
) -> state_pb2.ExecutionState:
    state = state_pb2.ExecutionState(
        execution_id=key,
        created=True,
        kind=common_pb2.AGENT_EXECUTION if session else common_pb2.WORKFLOW_EXECUTION,
        session_id=session,
        phase=common_pb2.EXECUTION_COMPLETED if finished else common_pb2.EXECUTION_IN_PROGRESS,
    )
    if pending:
        entry = state.pending.add()
        entry.effect_id = f"{key}-ensure"
        entry.op = state_pb2.EFFECT_OP_ENSURE
    return state


class _CountingDb:
    """The partition's real database, its point reads counted."""

    def __init__(self, db: Any) -> None:
        self._db = db
        self.gets = 0

    def get(self, key: bytes) -> Any:
        self.gets += 1
        return self._db.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _contents(store: RocksDBStore) -> list[tuple[bytes, bytes]]:
    """Every entry but the checkpoint, the removal times (the clock's) zeroed in the due-time index
    (``d<ms><key>``) and the removable entries (``r<key>`` -> ms)."""
    found = []
    for k, v in store._parts[0].db.items():
        if k.startswith(b"m:checkpoint"):
            continue
        if k.startswith(b"d"):
            k = b"d" + bytes(8) + k[9:]
        if k.startswith(b"r"):
            v = bytes(len(v))
        found.append((k, v))
    return sorted(found)


def _run(directory: Path, hinted: bool) -> tuple[list[tuple[bytes, bytes]], int, int]:
    """The same writes, with the states read before each as the hint or without it: the contents,
    the reads of the new keys' writes and the reads of the updates' writes."""
    store = RocksDBStore("state", directory=directory, retention_s=60.0)
    store.adopt([0])
    counting = _CountingDb(store._parts[0].db)
    store._parts[0].db = counting  # type: ignore[assignment]
    held: dict[str, state_pb2.ExecutionState | None] = {}

    def apply(writes: dict[str, state_pb2.ExecutionState | None]) -> None:
        prior = {key: held.get(key) for key in writes} if hinted else None
        store.apply(0, writes, prior=prior)
        held.update(writes)

    try:
        fresh = {
            f"new-{i}": _state(f"new-{i}", session=f"ses-{i % 3}" if i % 2 else "", pending=i % 4 == 0)
            for i in range(40)
        }
        apply(dict(fresh))
        new_gets = counting.gets
        # updates of running executions: workflows and agents, a session changed, a pending call done
        apply(
            {
                **{
                    f"new-{i}": _state(f"new-{i}", session=f"ses-{i % 3}" if i % 2 else "")
                    for i in range(4, 20)
                },
                "new-5": _state("new-5", session="ses-other"),
            }
        )
        update_gets = counting.gets - new_gets
        # a finished one (a removal time), then finished again (the old one replaced), a removal of a
        # running one and of a finished one, a key never held removed
        apply(
            {
                "new-1": _state("new-1", session="ses-1", finished=True),
                "new-7": _state("new-7", session="ses-1", finished=True),
                "new-2": None,
            }
        )
        apply({"new-1": _state("new-1", finished=True), "new-3": _state("new-3"), "other": _state("other")})
        apply({"new-7": None, "new-6": None, "ghost": None})
        store._parts[0].db = counting._db
        return _contents(store), new_gets, update_gets
    finally:
        store._parts[0].db = counting._db
        store.close()


def test_the_hint_reads_less_and_stores_the_same(tmp_path: Path) -> None:
    plain, plain_new, plain_updates = _run(tmp_path / "plain", hinted=False)
    hinted, hinted_new, hinted_updates = _run(tmp_path / "hinted", hinted=True)
    assert hinted == plain
    assert any(k.startswith(b"x") for k, _ in plain) and any(k.startswith(b"o") for k, _ in plain)
    assert any(k.startswith(b"d") for k, _ in plain)  # a finished state's removal time is indexed
    # without the hint a write reads its removal time, its state and (an update) its references
    assert plain_new >= 2 * 40 and plain_updates >= 3 * 16, (plain_new, plain_updates)
    # with it, a running execution's write reads nothing
    assert hinted_new == 0 and hinted_updates == 0, (hinted_new, hinted_updates)
