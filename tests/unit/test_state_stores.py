"""The state stores without a broker: the memory and the RocksDB store behave alike (reads, writes,
tombstones, the retention schedule); the RocksDB store keeps its states, count and due-time index
across a close and reopen, and refuses checkpoints that are not this partition's.

The restore and the checkpoints against the topic are tested on the real broker
(tests/integration/test_state_checkpoints.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import ConsumerRecord

from consumers.runtime.state.changelog import Bounds
from consumers.runtime.state.interface import (
    REBUILD_REASONS,
    STATE_FORMAT_VERSION,
    StateStore,
    StateStoreFault,
)
from consumers.runtime.state.local_faults import guarded, mark
from consumers.runtime.state.memory import MemoryStore
from consumers.runtime.state.rocksdb import RocksDBStore
from consumers.runtime.state.rocksdb_checkpoints import proven
from consumers.runtime.state.store import open_store
from events.sandbox_lanes.v1 import common_pb2, state_pb2
from tests.integration.test_reaper import _state


def _pending(state: state_pb2.ExecutionState) -> state_pb2.ExecutionState:
    entry = state.pending.add()
    entry.effect_id = "c1"
    entry.op = state_pb2.EFFECT_OP_DEPROVISION
    return state


def _rocksdb(tmp: Path, retention_s: float) -> RocksDBStore:
    store = RocksDBStore("state", retention_s, directory=tmp)
    store.adopt([0, 1])
    return store


@pytest.fixture(params=["memory", "rocksdb"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[type[object]]:
    made: list[StateStore] = []

    def factory(retention_s: float = 0.0) -> StateStore:
        store: StateStore = (
            MemoryStore("state", retention_s)
            if request.param == "memory"
            else _rocksdb(tmp_path, retention_s)
        )
        made.append(store)
        return store

    yield factory  # type: ignore[misc]
    for store in made:
        store.close()


def test_puts_gets_and_tombstones(make) -> None:  # type: ignore[no-untyped-def]
    store = make()
    store.apply(0, {"a": _state("a", phase=common_pb2.EXECUTION_IN_PROGRESS, at=1), "b": None})
    store.apply(1, {"c": _state("c", phase=common_pb2.EXECUTION_IN_PROGRESS, at=1)})
    got = store.get(0, "a")
    assert got is not None and got.execution_id == "a"
    assert store.get(1, "a") is None and store.get(0, "b") is None
    assert len(store) == 2 and store.owned() >= {0, 1}
    # The same write twice counts once; a tombstone takes the key out of the store.
    store.apply(0, {"a": _state("a", phase=common_pb2.EXECUTION_COMPLETED, at=2)})
    assert len(store) == 2
    store.apply(0, {"a": None})
    assert store.get(0, "a") is None and len(store) == 1
    assert sorted(k for k, _ in store.items()) == ["c"]
    assert [k for k, _ in store.partition_items(1)] == ["c"]


def test_the_schedule_lists_due_keys_until_their_tombstone(make) -> None:  # type: ignore[no-untyped-def]
    store = make(100.0)
    store.put(0, "done_early", _state("done_early", phase=common_pb2.EXECUTION_COMPLETED, at=1_000))
    store.put(0, "done_late", _state("done_late", phase=common_pb2.EXECUTION_FAILED, at=1_050))
    store.put(1, "other", _state("other", phase=common_pb2.EXECUTION_CANCELLED, at=1_000))
    store.put(0, "live", _state("live", phase=common_pb2.EXECUTION_IN_PROGRESS, at=0))
    store.put(0, "tearing", _pending(_state("tearing", phase=common_pb2.EXECUTION_COMPLETED, at=0)))
    assert store.due(1_099.0, limit=10) == {}
    assert store.due(1_100.0, limit=10) == {0: ["done_early"], 1: ["other"]}
    assert sum(len(v) for v in store.due(1_100.0, limit=1).values()) == 1
    assert store.due(1_200.0, limit=10) == {0: ["done_early", "done_late"], 1: ["other"]}
    store.delete(0, "done_early")
    # A state that moves on is no longer due; one that ends again is, from its new time.
    store.put(0, "done_late", _state("done_late", phase=common_pb2.EXECUTION_IN_PROGRESS, at=1_060))
    assert store.due(1_200.0, limit=10) == {1: ["other"]}
    store.put(0, "done_late", _state("done_late", phase=common_pb2.EXECUTION_COMPLETED, at=1_070))
    assert store.due(1_169.0, limit=10) == {1: ["other"]}
    assert store.due(1_170.0, limit=10) == {0: ["done_late"], 1: ["other"]}
    store.drop([1])
    assert store.due(1_200.0, limit=10) == {0: ["done_late"]}
    assert 1 not in store.owned() and len(store) == 3


def test_rocksdb_keeps_states_count_and_schedule_across_a_reopen(tmp_path: Path) -> None:
    store = _rocksdb(tmp_path, 100.0)
    for i in range(50):
        phase = common_pb2.EXECUTION_COMPLETED if i % 2 else common_pb2.EXECUTION_IN_PROGRESS
        store.put(0, f"e{i:02d}", _state(f"e{i:02d}", phase=phase, at=1_000 + i))
    store.delete(0, "e01")
    store.close()
    again = RocksDBStore("state", 100.0, directory=tmp_path)
    assert again.owned() == set()
    again.adopt([0])
    try:
        assert len(again) == 49
        # The index is read back, not rebuilt: the earliest due keys first, the tombstoned one gone.
        assert again.due(1_105.0, limit=10) == {0: ["e03", "e05"]}
        assert again.due(1e12, limit=100)[0] == [f"e{i:02d}" for i in range(3, 50, 2)]
    finally:
        again.close()


def test_the_rocksdb_store_tells_what_its_database_holds_in_memory(tmp_path: Path) -> None:
    """Its memtables (the writes), then its table readers (the written files' index and filter
    blocks); the memory store cannot tell its states' memory apart from the heap's."""
    assert MemoryStore("state").memory_bytes() is None
    store = _rocksdb(tmp_path, 0.0)
    try:
        store.adopt([1])
        empty = store.memory_bytes()
        assert empty is not None
        for p in (0, 1):
            store.apply(p, {f"e{i:05d}": _state(f"e{i:05d}") for i in range(5_000)})
        written = store.memory_bytes()
        assert written is not None and written - empty > 5_000 * 2 * 50, (empty, written)
        for part in store._parts.values():
            part.db.flush()
        readers = sum(
            part.db.property_int_value("rocksdb.estimate-table-readers-mem") or 0
            for part in store._parts.values()
        )
        assert readers > 0 and (store.memory_bytes() or 0) >= readers
    finally:
        store.close()


def test_open_store_picks_the_implementation(tmp_path: Path) -> None:
    assert isinstance(open_store("memory", "t"), MemoryStore)
    disk = open_store("rocksdb", "t", 5.0, tmp_path)
    assert isinstance(disk, RocksDBStore) and disk.directory == tmp_path / "t"
    with pytest.raises(ValueError, match="state directory"):
        open_store("rocksdb", "t")


def _checkpoint(**changes: object) -> dict[str, object]:
    found: dict[str, object] = {
        "format": STATE_FORMAT_VERSION,
        "topic": "state",
        "topicId": "id-1",
        "partition": 0,
        "isolation": "read_committed",
        "retentionSeconds": 100.0,
        "offset": 40,
    }
    found.update(changes)
    return found


@pytest.mark.parametrize(
    ("changes", "bounds", "reason"),
    [
        ({"topic": "other"}, Bounds(0, 50), "topic is 'other'"),
        ({"partition": 1}, Bounds(0, 50), "partition is 1"),
        ({"format": STATE_FORMAT_VERSION - 1}, Bounds(0, 50), "format is"),
        ({"isolation": "read_uncommitted"}, Bounds(0, 50), "isolation is"),
        ({"retentionSeconds": 7.0}, Bounds(0, 50), "retentionSeconds is"),
        ({"topicId": "id-0"}, Bounds(0, 50), "recreated"),
        ({}, Bounds(0, 39), "past the topic's end"),
        ({}, Bounds(41, 60), "before the topic's first offset"),
        ({"offset": "40"}, Bounds(0, 50), "no offset"),
    ],
)
def test_a_checkpoint_not_this_partitions_is_refused(
    tmp_path: Path, changes: dict[str, object], bounds: Bounds, reason: str
) -> None:
    store = RocksDBStore("state", 100.0, directory=tmp_path)
    store._topic_id = "id-1"
    assert store._refused(_checkpoint(), 0, Bounds(0, 50), "read_committed") is None
    assert store._refused(_checkpoint(), 0, Bounds(40, 40), "read_committed") is None
    why = store._refused(_checkpoint(**changes), 0, bounds, "read_committed")
    assert why is not None and reason in why
    assert store._refused(None, 0, bounds, "read_committed") == "no checkpoint"


def test_a_checkpoint_moves_only_past_writes_this_store_applied() -> None:
    applied: dict[str, list[bytes | None]] = {"a": [b"a1", b"a2"], "b": [None], "c": [b"c1"]}
    # The tail's last record per key is one of ours: where, per key (the first match).
    assert proven({"a": b"a1", "b": None}, applied) == {"a": 0, "b": 0}
    assert proven({}, applied) == {}
    # Another writer's record (or a commit of ours not applied yet) holds the checkpoint back.
    assert proven({"a": b"a1", "c": b"foreign"}, applied) is None
    assert proven({"d": b"d1"}, applied) is None
    assert proven({"b": b"b-live"}, applied) is None


def _record(offset: int, key: str, value: bytes | None) -> ConsumerRecord[bytes, bytes]:
    size = -1 if value is None else len(value)
    return ConsumerRecord("state", 0, offset, 0, 0, key.encode(), value, None, len(key), size, [])


def test_rocksdb_folds_a_tail_with_a_key_written_again_in_one_batch(tmp_path: Path) -> None:
    """A restore's batch may hold a key more than once (its index entry and count stay right), a
    tombstone, and bytes that do not decode (skipped, as the memory store skips them)."""
    store = _rocksdb(tmp_path, 100.0)
    try:
        done = _state("k", phase=common_pb2.EXECUTION_COMPLETED, at=1_000).SerializeToString()
        later = _state("k", phase=common_pb2.EXECUTION_COMPLETED, at=2_000).SerializeToString()
        other = _state("o", phase=common_pb2.EXECUTION_FAILED, at=1_500).SerializeToString()
        batch = [
            _record(0, "k", done),
            _record(1, "o", other),
            _record(2, "k", later),
            _record(3, "gone", other),
            _record(4, "gone", None),
            _record(5, "bad", b"\xff\xff\xff"),
        ]
        store._fold(store._parts[0], 0, batch, seen_at=0.0)
        assert len(store) == 2 and store.get(0, "gone") is None and store.get(0, "bad") is None
        assert store.due(1e12, limit=10) == {0: ["o", "k"]}  # one index entry each, by due time
        assert store.due(1_600.0, limit=10) == {0: ["o"]}
    finally:
        store.close()


def test_rocksdb_checkpoint_moves_with_commits_whose_offsets_chain(tmp_path: Path) -> None:
    """A commit's state records at known, contiguous offsets starting at the checkpoint (or one past
    it: the previous commit's marker) move the checkpoint past them in the same write batch; a gap
    (another writer, an aborted transaction) or unknown offsets leave it for the proof by reading
    (driven against the real topic in tests/integration/test_state_checkpoints.py), and what was
    applied stays whatever the checkpoint does."""
    store = _rocksdb(tmp_path, 0.0)
    try:
        part = store._parts[0]
        store._record_checkpoint(part, 0, 10)  # as a restore that read to offset 10 leaves it

        def at() -> object:
            found = store.checkpoint_of(0)
            return found and found["offset"]

        def state(key: str, n: int) -> state_pb2.ExecutionState:
            return _state(key, phase=common_pb2.EXECUTION_COMPLETED, at=n)

        store.apply(0, {"a": state("a", 1), "b": state("b", 1)}, (10, 11))
        assert at() == 12 and not part.pending  # 12: this commit's marker
        store.apply(0, {"a": state("a", 2)}, (13, 13))
        assert at() == 14 and not part.pending
        store.apply(0, {}, None)  # nothing written to the state partition: no marker there either
        assert at() == 14
        store.apply(0, {"c": state("c", 1)}, (16, 16))  # offset 15 is not ours
        assert at() == 14 and part.pending == {"c": [state("c", 1).SerializeToString()]}
        store.apply(0, {"a": state("a", 3)}, (18, 18))  # chains, but something before it is unproven
        assert at() == 14 and set(part.pending) == {"a", "c"} and part.unproven == [(16, 16), (18, 18)]
        store.apply(0, {"b": state("b", 2)}, None)  # offsets not told: only a read may prove it
        assert at() == 14 and part.unknown
        store.close()
        reopened = _rocksdb(tmp_path, 0.0)
        found = reopened.checkpoint_of(0)
        assert found is not None and isinstance(found.pop("asOfMs"), int)
        assert found == _checkpoint(offset=14, topicId=None, retentionSeconds=0.0, marker=True)
        assert reopened.get(0, "a") == state("a", 3) and reopened.get(0, "b") == state("b", 2)
        assert len(reopened) == 3
        reopened.close()
    finally:
        store.close()


# --- the local state is disposable (issue 42) ---------------------------------------------------


class _FailingWrites:
    """A database whose writes fail as a full disk fails them (RocksDB's own message); reads pass
    through. A fake beneath the real full filesystem of tests/integration/test_state_disk_faults.py."""

    def __init__(self, db: Any) -> None:
        self.db = db

    def write(self, batch: object) -> None:
        raise Exception("IO error: No space left on device: While appending to file: 000012.log")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


def test_a_failed_write_moves_no_count_checkpoint_or_proof(tmp_path: Path) -> None:
    store = _rocksdb(tmp_path, 0.0)
    try:
        part = store._parts[0]
        store._record_checkpoint(part, 0, 10)
        done = _state("a", phase=common_pb2.EXECUTION_COMPLETED, at=1)
        real, part.db = part.db, _FailingWrites(part.db)
        for at in [(10, 11), (16, 16), None]:  # would chain; would wait for the proof; unknown
            with pytest.raises(StateStoreFault) as raised:
                store.apply(0, {"a": done, "b": None}, at)
            assert (raised.value.partition, raised.value.reason) == (0, "disk_full")
            assert isinstance(raised.value, Exception) and "No space left" in str(raised.value)
            found = store.checkpoint_of(0)
            assert found is not None and found["offset"] == 10 and part.offset == 10
            assert not part.marker and part.count == 0 and len(store) == 0
            assert part.pending == {} and part.pending_n == 0 and part.unproven == [] and not part.unknown
            assert store.get(0, "a") is None
        part.db = real  # the disk has room again: the same commit applies and moves it
        store.apply(0, {"a": done, "b": None}, (10, 11))
        found = store.checkpoint_of(0)
        assert found is not None and found["offset"] == 12 and len(store) == 1
    finally:
        store.close()


@pytest.mark.parametrize(
    ("error", "writing", "reason"),
    [
        (Exception("Corruption: block checksum mismatch: stored = 1, computed = 2"), False, "corrupt"),
        (Exception("Corruption: CURRENT file corrupted"), True, "corrupt"),
        (Exception("IO error: No space left on device: While appending to file"), True, "disk_full"),
        (
            Exception("IO error: While open a file for appending: x/000012.log: Permission denied"),
            True,
            "unwritable",
        ),
        (Exception("IO error: While mkdir if missing: x: Read-only file system"), True, "unwritable"),
        (FileExistsError(17, "File exists"), True, "not_a_directory"),
        (NotADirectoryError(20, "Not a directory"), True, "not_a_directory"),
        (PermissionError(13, "Permission denied"), True, "unwritable"),
        (OSError(28, "No space left on device"), True, "disk_full"),
        (Exception("IO error: Input/output error"), True, "write_failed"),
        (Exception("IO error: Input/output error"), False, "read_failed"),
    ],
)
def test_database_and_disk_errors_become_faults_with_a_bounded_reason(
    error: Exception, writing: bool, reason: str
) -> None:
    with pytest.raises(StateStoreFault) as raised, guarded(3, writing=writing):
        raise error
    assert (raised.value.partition, raised.value.reason) == (3, reason) and reason in REBUILD_REASONS
    assert raised.value.__cause__ is error


def test_a_bug_is_not_a_database_fault() -> None:
    with pytest.raises(KeyError), guarded(0, writing=True):
        raise KeyError("a bug")
    assert StateStoreFault(0, "no such reason").reason == "other"


def _seeded(tmp_path: Path, *, n: int = 3000, flushed: bool = True) -> Path:
    """A partition's database as a pod leaves it: ``n`` states, a checkpoint at offset 40, flushed to
    SST files (as after a restart: the recovery flushes the WAL), the marker beside it."""
    store = _rocksdb(tmp_path, 0.0)
    part = store._parts[0]
    for i in range(0, n, 500):
        store.apply(0, {f"e{j:05d}": _state(f"e{j:05d}", phase=1, at=j) for j in range(i, min(n, i + 500))})
    store._record_checkpoint(part, 0, 40, marker=True)
    mark(part.path, "state", 0)
    if flushed:
        part.db.flush()
    store.close()
    return tmp_path / "state" / "0"


def _prepared(tmp_path: Path, bounds: Bounds, now_ms: int | None = None) -> tuple[int, bool, dict[int, str]]:
    """Open partition 0 as a restore does: (where its read starts, resumed, rebuilt reasons)."""
    store = RocksDBStore("state", 0.0, directory=tmp_path)
    store._delete_retention_ms = 86_400_000
    rebuilt: dict[int, str] = {}
    part, start, resumed = store._prepare(
        0, bounds, "read_committed", now_ms or int(time.time() * 1000), rebuilt
    )
    held = part.count
    part.close()
    assert (held == 0) == (not resumed)  # a fresh database when it starts over
    return start, resumed, rebuilt


def test_a_healthy_database_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    _seeded(tmp_path)
    assert _prepared(tmp_path, Bounds(0, 45)) == (40, True, {})


def _scribble(path: Path, at: float, size: int) -> None:
    with path.open("r+b") as f:
        f.seek(int(path.stat().st_size * at))
        f.write(b"\xa5" * size)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("current", "corrupt"),
        ("manifest_half", "corrupt"),
        ("file", "not_a_directory"),
        ("stale", "stale_checkpoint"),
    ],
)
def test_a_damaged_database_or_stale_checkpoint_is_thrown_away_and_read_from_the_beginning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: str, reason: str
) -> None:
    db = _seeded(tmp_path)
    now_ms = int(time.time() * 1000)
    if fault == "current":
        (db / "CURRENT").write_text("MANIFEST-999999-garbage\n")
    elif fault == "manifest_half":
        (manifest,) = db.glob("MANIFEST-*")
        os.truncate(manifest, manifest.stat().st_size // 2)
    elif fault == "file":
        shutil.rmtree(db)
        db.write_text("not a database")
    else:  # read a day and a bit later, with records written past the checkpoint meanwhile
        now_ms += 86_400_000 + 1
    with caplog.at_level(logging.WARNING, logger="sandbox_lanes.state"):
        assert _prepared(tmp_path, Bounds(0, 45), now_ms) == (0, False, {0: reason})
    told = [r for r in caplog.records if r.getMessage().startswith("local state thrown away")]
    assert [(r.partition, r.reason) for r in told] == [(0, reason)]  # type: ignore[attr-defined]


def test_an_old_checkpoint_with_nothing_past_it_is_not_stale(tmp_path: Path) -> None:
    _seeded(tmp_path)
    a_week_on = int(time.time() * 1000) + 7 * 86_400_000
    assert _prepared(tmp_path, Bounds(0, 41), a_week_on) == (40, True, {})  # 40: our commit marker
    assert _prepared(tmp_path, Bounds(0, 42), a_week_on) == (0, False, {0: "stale_checkpoint"})


def test_a_scribbled_sst_fails_its_reads_as_a_fault(tmp_path: Path) -> None:
    db = _seeded(tmp_path, n=20_000)
    ssts = list(db.glob("*.sst"))
    assert ssts  # the premise: the states are in SST files
    for sst in ssts:
        _scribble(sst, 0.5, 512)
    store = RocksDBStore("state", 0.0, directory=tmp_path)
    store.adopt([0])  # it opens: RocksDB reads only the files' ends
    try:
        with pytest.raises(StateStoreFault) as raised:
            sum(1 for _ in store.partition_items(0))  # an iterator that stops early says why
        assert raised.value.reason == "corrupt" and "checksum" in str(raised.value)
        with pytest.raises(StateStoreFault):
            for i in range(20_000):
                store.get(0, f"e{i:05d}")
    finally:
        store.close()


def test_discard_throws_the_partition_away(make, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = make()
    store.apply(0, {"a": _state("a", phase=common_pb2.EXECUTION_IN_PROGRESS, at=1)})
    store.apply(1, {"b": _state("b", phase=common_pb2.EXECUTION_IN_PROGRESS, at=1)})
    store.discard({0}, "write_failed")
    assert 0 not in store.owned() and 1 in store.owned()
    assert store.get(0, "a") is None and len(store) == 1
    if isinstance(store, RocksDBStore):
        store.adopt([0])  # opened again (once the old one is closed, off the caller's thread): empty
        assert store.get(0, "a") is None and store.checkpoint_of(0) is None and len(store) == 1
        store.discard({0}, "corrupt")
        store.close()  # waits for what was thrown away to be gone
        assert not (tmp_path / "state" / "0").exists() and (tmp_path / "state" / "1").is_dir()


def test_a_database_failing_as_it_opens_is_rebuilt_at_once_in_the_same_process(tmp_path: Path) -> None:
    """Its count is read as it opens: a damaged block there fails the open, and the fresh database
    at the same path opens right away (the damaged one let go of RocksDB's LOCK, not left it to the
    traceback holding it)."""
    db = _seeded(tmp_path, n=50)
    (sst,) = db.glob("*.sst")
    _scribble(sst, 0.0, sst.stat().st_size // 2)  # the one data block: every key's, m:count's too
    assert _prepared(tmp_path, Bounds(0, 45)) == (0, False, {0: "corrupt"})
