"""The RocksDB state store's checkpoints on the real broker (issue 38).

* The store alone: a restore from empty reads the whole partition; a restart with a checkpoint reads
  only the tail; a checkpoint of another topic, an older format, or a topic deleted and created
  again (a new topic id) is refused and the partition is restored in full, with nothing of the
  old topic left in the store.
* The store's checkpoint moves forward with real transactions at the offsets the broker gave them
  (each commit to its marker), waits after an aborted transaction of ours, and is moved forward by
  the proof by reading over the real tail (to the last stable offset, an open transaction past it),
  after which the commits chain again.
* A pod on the disk store: its checkpoints move with its commits (to each commit's marker);
  restarted, it reads only the tail and holds exactly what a restore from empty holds; killed -9
  with its commits past its checkpoints (for real: another writer's record holds them back), the
  next pod reads the longer tail, nothing is lost or provisioned twice, and its own commits move
  the checkpoints forward again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import uuid
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from consumers.ops.settings import load_settings
from consumers.runtime.state.changelog import ChangelogReader
from consumers.runtime.state.interface import STATE_FORMAT_VERSION
from consumers.runtime.state.memory import MemoryStore
from consumers.runtime.state.rocksdb import RocksDBStore
from consumers.runtime.state.rocksdb_partition import CHECKPOINT_KEY
from events.sandbox_lanes.v1 import common_pb2, outcomes_pb2, state_pb2
from tests.integration.test_effects_kafka import assert_one_outcome_each, committed_outcomes, memory_env
from tests.support.chaos_verify import read_all
from tests.support.pod_harness import PodProcess, produce, read_topic, running_pod, wf_created

pytestmark = [pytest.mark.kafka, pytest.mark.usefixtures("no_leaked_runners")]


def _message(key: str, n: int) -> state_pb2.ExecutionState:
    return state_pb2.ExecutionState(
        execution_id=key, created=True, kind=common_pb2.WORKFLOW_EXECUTION, phase=n % 3
    )


def _state(key: str, n: int) -> bytes:
    return _message(key, n).SerializeToString()


async def _create(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for _ in range(120):  # a topic just deleted is still being removed for a moment
            try:
                await admin.create_topics(
                    [NewTopic(topic, 1, 1, topic_configs={"cleanup.policy": "compact"})]
                )
                return
            except TopicAlreadyExistsError:
                await asyncio.sleep(0.25)
        raise AssertionError(f"{topic} could not be created again")
    finally:
        await admin.close()


async def _delete(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()


async def _write(bootstrap: str, topic: str, records: list[tuple[str, bytes | None]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value in records:
            await producer.send_and_wait(topic, value, key=key.encode(), partition=0)
    finally:
        await producer.stop()


async def _restore(store: RocksDBStore, bootstrap: str) -> tuple[int, int, int]:
    report = await store.restore(bootstrap, [0])
    return report.records, report.from_checkpoint, report.full


def _held(store: RocksDBStore | MemoryStore) -> dict[str, bytes]:
    return {key: state.SerializeToString() for key, state in store.items()}


async def test_the_store_resumes_from_its_checkpoint_and_refuses_one_not_this_topics(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic = f"ckpt-{uuid.uuid4().hex[:8]}"
    await _create(kafka_bootstrap, topic)
    await _write(kafka_bootstrap, topic, [(f"e{i}", _state(f"e{i}", i)) for i in range(40)])
    store = RocksDBStore(topic, directory=tmp_path)
    # From empty: the whole partition.
    assert await _restore(store, kafka_bootstrap) == (40, 0, 1)
    assert len(store) == 40
    store.close()
    # Restarted with a checkpoint at the end: nothing to read.
    assert await _restore(store, kafka_bootstrap) == (0, 1, 0)
    assert len(store) == 40
    store.close()
    # The tail only: 5 records (2 new keys, 2 changed, 1 tombstone), applied over the database.
    tail: list[tuple[str, bytes | None]] = [("e40", _state("e40", 1)), ("e41", _state("e41", 2))]
    tail += [("e0", _state("e0", 2)), ("e1", _state("e1", 0)), ("e2", None)]
    await _write(kafka_bootstrap, topic, tail)
    assert await _restore(store, kafka_bootstrap) == (5, 1, 0)
    memory = MemoryStore(topic)
    await memory.restore(kafka_bootstrap, [0])
    assert _held(store) == _held(memory) and len(store) == 41
    store.close()

    # An older format's checkpoint is refused: a full restore, the same states.
    db = tmp_path / topic / "0"
    found = _checkpoint(db)
    _set_checkpoint(db, {**found, "format": STATE_FORMAT_VERSION - 1})
    assert await _restore(store, kafka_bootstrap) == (45, 0, 1)
    assert _held(store) == _held(memory)
    store.close()

    # Another topic's database and checkpoint (copied under this topic's name) are refused.
    other = f"ckpt-other-{uuid.uuid4().hex[:8]}"
    await _create(kafka_bootstrap, other)
    await _write(kafka_bootstrap, other, [("x", _state("x", 0))])
    shutil.copytree(db, tmp_path / other / "0")
    foreign = RocksDBStore(other, directory=tmp_path)
    assert await _restore(foreign, kafka_bootstrap) == (1, 0, 1)
    assert list(_held(foreign)) == ["x"]
    foreign.close()

    # The topic deleted and created again with more records than the checkpoint's offset: the
    # offset alone would pass; the topic id does not. Nothing of the old topic stays.
    await _delete(kafka_bootstrap, topic)
    await _create(kafka_bootstrap, topic)
    await _write(kafka_bootstrap, topic, [(f"n{i}", _state(f"n{i}", i)) for i in range(60)])
    assert await _restore(store, kafka_bootstrap) == (60, 0, 1)
    assert sorted(_held(store)) == sorted(f"n{i}" for i in range(60))
    store.close()


async def test_the_checkpoint_moves_forward_with_real_commits_and_by_the_proof_over_a_real_tail(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Real transactions on the real broker, their offsets as the broker gave them: a commit whose
    records start at the checkpoint (or one past: the previous commit's marker) moves it to its own
    marker; after an aborted transaction of ours the offsets do not chain and the checkpoint waits,
    until the proof by reading (``checkpoint()``, reading the real tail) moves it to the last stable
    offset, an open transaction of ours past it; that transaction's commit then chains from there."""
    topic = f"ckpt-fwd-{uuid.uuid4().hex[:8]}"
    await _create(kafka_bootstrap, topic)
    store = RocksDBStore(topic, directory=tmp_path)
    assert await _restore(store, kafka_bootstrap) == (0, 0, 1)
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, transactional_id=f"ckpt-{uuid.uuid4().hex[:8]}", acks="all"
    )
    await producer.start()

    async def send(key: str, n: int) -> int:
        sent = await producer.send_and_wait(topic, _state(key, n), key=key.encode(), partition=0)
        return int(sent.offset)

    def applied(offsets: list[int], writes: dict[str, int]) -> None:
        store.apply(0, {k: _message(k, n) for k, n in writes.items()}, (offsets[0], offsets[-1]))

    def at() -> tuple[int, bool]:
        found = store.checkpoint_of(0)
        assert found is not None
        return int(found["offset"]), bool(found["marker"])

    try:
        await producer.begin_transaction()
        t1 = [await send("a", 1), await send("b", 1)]
        await producer.commit_transaction()
        applied(t1, {"a": 1, "b": 1})
        assert at() == (t1[-1] + 1, True)  # its commit marker
        await producer.begin_transaction()
        t2 = [await send("a", 2)]
        await producer.commit_transaction()
        applied(t2, {"a": 2})
        assert t2[0] == t1[-1] + 2 and at() == (t2[0] + 1, True)
        ckpt = at()[0]
        await producer.begin_transaction()  # aborted: its record and marker take two offsets
        await send("c", 99)
        await producer.abort_transaction()
        await producer.begin_transaction()
        t3 = [await send("c", 1)]
        await producer.commit_transaction()
        applied(t3, {"c": 1})
        assert t3[0] > ckpt + 1 and at() == (ckpt, True)  # the premise: it does not chain, it waits
        await producer.begin_transaction()  # open during the proof: the last stable offset is its first
        t4 = [await send("a", 3)]
        moved = await store.checkpoint([0])
        assert moved == {0: t4[0]} and at() == (t4[0], False)  # forward, past the tail it read
        await producer.commit_transaction()
        applied(t4, {"a": 3})
        assert at() == (t4[0] + 1, True)  # chained from where the proof left it
        await producer.begin_transaction()
        t5 = [await send("b", 2)]
        await producer.commit_transaction()
        applied(t5, {"b": 2})
        assert at() == (t5[0] + 1, True)
    finally:
        await producer.stop()
        store.close()
    # Restarted: only the last commit's marker is left to read, and it holds what the topic holds.
    assert await _restore(store, kafka_bootstrap) == (0, 1, 0)
    memory = MemoryStore(topic)
    await memory.restore(kafka_bootstrap, [0])
    assert _held(store) == _held(memory) and len(store) == 3
    store.close()


def _checkpoint(db: Path) -> dict[str, object]:
    from rocksdict import Options, Rdict

    opened = Rdict(str(db), Options(raw_mode=True))
    try:
        raw = opened.get(CHECKPOINT_KEY)
        assert raw is not None
        found: dict[str, object] = json.loads(raw)
        return found
    finally:
        opened.close()


def _set_checkpoint(db: Path, body: dict[str, object]) -> None:
    from rocksdict import Options, Rdict

    opened = Rdict(str(db), Options(raw_mode=True))
    try:
        opened.put(CHECKPOINT_KEY, json.dumps(body).encode())
    finally:
        opened.close()


async def _ends(bootstrap: str, topic: str) -> dict[int, int]:
    reader = ChangelogReader(bootstrap, topic, [0, 1])
    async with reader:
        return {p: b.end for p, b in (await reader.bounds()).items()}


def _restored(caplog: pytest.LogCaptureFixture) -> list[tuple[int, int]]:
    """(records read, partitions resumed from a checkpoint) of each "state restored" line."""
    return [
        (r.records, r.fromCheckpoint)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "state restored" and hasattr(r, "fromCheckpoint")
    ]


async def test_a_pod_restarted_with_a_checkpoint_reads_only_the_tail_and_holds_what_a_full_restore_holds(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sandbox_lanes.state")
    env = memory_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_LANES_STATE_STORE="rocksdb",
        SANDBOX_LANES_STATE_DIR=str(tmp_path / "state"),
    )
    topics = load_settings(env).topics
    first = [f"wfx_ckpt_{i}" for i in range(20)]
    later = [f"wfx_ckpt_later_{i}" for i in range(10)]
    async with running_pod(env):
        await produce(kafka_bootstrap, env, *(wf_created(e) for e in first))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=20, timeout_s=90, settle_s=0)
    # Stopped: its checkpoints moved with its commits, each to the commit's marker (the offset after
    # its last state record): at most that marker is left to read.
    disk = RocksDBStore(topics.state, directory=tmp_path / "state")
    disk.adopt([0, 1])
    checkpoints = {p: disk.checkpoint_of(p) for p in (0, 1)}
    disk.close()
    offsets = {p: int(c["offset"]) for p, c in checkpoints.items() if c is not None}
    ends = await _ends(kafka_bootstrap, topics.state)
    assert offsets == {p: end - 1 for p, end in ends.items()}, (offsets, ends)  # moved by its commits
    caplog.clear()
    async with running_pod(env) as composed:
        # Only what was written since its checkpoints is read (no record here: the pod was down).
        tail = [r for r in await read_all(kafka_bootstrap, topics.state) if r.offset >= offsets[r.partition]]
        assert tail == [] and _restored(caplog) == [(0, 2)]  # both partitions from their checkpoint
        await produce(kafka_bootstrap, env, *(wf_created(e) for e in later))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=30, timeout_s=90, settle_s=0)
        held = dict(composed.pod.states.items())
    full = MemoryStore(topics.state)
    await full.restore(kafka_bootstrap, [0, 1])
    assert held == dict(full.items())
    assert_one_outcome_each(
        await committed_outcomes(kafka_bootstrap, topics.outcomes),
        first + later,
        outcomes_pb2.SandboxProvisioned,
    )


async def test_a_pod_killed_with_its_commits_past_its_checkpoint_loses_and_duplicates_nothing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A checkpoint behind the commits for real: another writer's record in each state partition
    (a tombstone of a key the pod never had) breaks the chain of its commits' offsets, and the proof
    by reading can never move past it (its last record is not one of the store's writes), so every
    commit of the first pod lands past its checkpoint. Killed -9 while it commits, the next pod
    reads the whole tail, loses and duplicates nothing, and its own commits move the checkpoints
    forward again, to its last commit's marker."""
    env = memory_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_LANES_STATE_STORE="rocksdb",
        SANDBOX_LANES_STATE_DIR=str(tmp_path / "state"),
        SANDBOX_LANES_DRIVER_OPTIONS="ensure_latency_ms=20",
    )
    topics = load_settings(env).topics
    executions = [f"wfx_kill_{i}" for i in range(200)]
    first = PodProcess(env, tmp_path / "pod-1.log")
    first.start()
    await first.wait_for_log("state restored")
    before = await _ends(kafka_bootstrap, topics.state)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:  # the other writer: one record at each partition's end, before the pod's first commit
        foreign = {
            p: (await producer.send_and_wait(topics.state, None, key=b"wfx_never_here", partition=p)).offset
            for p in (0, 1)
        }
    finally:
        await producer.stop()
    assert foreign == before  # at the end its restore read to: where its checkpoints are
    await produce(kafka_bootstrap, env, *(wf_created(e) for e in executions))
    # Killed while it commits (outcomes still coming), past a proof by reading or more (each 5 s).
    await read_topic(kafka_bootstrap, topics.outcomes, at_least=120, timeout_s=60, settle_s=0)
    first.kill9()
    stuck = {p: int(str(_checkpoint(tmp_path / "state" / topics.state / str(p))["offset"])) for p in (0, 1)}
    ends = await _ends(kafka_bootstrap, topics.state)
    assert stuck == before and all(ends[p] > stuck[p] + 20 for p in (0, 1)), (stuck, ends)  # the premise
    second = PodProcess({**env, "SANDBOX_LANES_POD_ID": "pod-b"}, tmp_path / "pod-2.log")
    second.start()
    try:
        await second.wait_for_log("state restored")
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=200, timeout_s=120, settle_s=0)
    finally:
        code, _ = second.terminate()
    assert code == 0
    restored = [json.loads(line) for line in second.log().splitlines() if '"state restored"' in line]
    assert restored, second.log()[-2000:]
    # It resumed from the checkpoints and read the whole tail since (the commits after them).
    assert sum(r["fromCheckpoint"] for r in restored) == 2
    behind = [
        r
        for r in await read_all(kafka_bootstrap, topics.state)
        if stuck[r.partition] <= r.offset < ends[r.partition]
    ]
    assert len(behind) > 40 and sum(r["records"] for r in restored) >= len(behind), (len(behind), restored)
    assert_one_outcome_each(
        await committed_outcomes(kafka_bootstrap, topics.outcomes),
        executions,
        outcomes_pb2.SandboxProvisioned,
    )
    # What the disk store holds is what the topic holds, state for state.
    disk = RocksDBStore(topics.state, directory=tmp_path / "state")
    disk.adopt([0, 1])
    full = MemoryStore(topics.state)
    await full.restore(kafka_bootstrap, [0, 1])
    try:
        assert _held(disk) == _held(full)
        assert Counter(k for k, _ in disk.items() if k.startswith("wfx_")) == Counter(executions)
        # The checkpoints moved forward again: past the tail, and where the second pod committed
        # (a state record of its own past the kill's ends), to its last commit's marker.
        last = await _ends(kafka_bootstrap, topics.state)
        written = {
            r.partition
            for r in await read_all(kafka_bootstrap, topics.state)
            if r.offset >= ends[r.partition]
        }
        moved = {p: int(str((disk.checkpoint_of(p) or {})["offset"])) for p in (0, 1)}
        assert written and all(moved[p] >= ends[p] > stuck[p] for p in (0, 1)), (moved, ends, stuck)
        assert {p: moved[p] for p in written} == {p: last[p] - 1 for p in written}, (moved, last)
    finally:
        disk.close()
