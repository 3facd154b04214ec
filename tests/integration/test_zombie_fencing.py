"""Zombie fencing on a real broker: a pod that lost its partitions cannot commit anything.

The fence itself (one transactional producer per input partition, ``<group>-p<N>``), then the
whole story: a pod paused past its session timeout with driver work done, its partitions taken
over, then resumed."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from consumers.lanes.constants import LOG_TOKENLESS_LAUNCH
from consumers.ops.settings import load_settings
from consumers.runtime.kafka.sink import PartitionSinks, TransactionalSink
from consumers.runtime.kafka.topology import Topics
from events.codec import OUTCOME_TYPES, EncodedRecord, decode
from events.sandbox_lanes.v1 import outcomes_pb2
from tests.support.chaos_verify import read_all
from tests.support.pod_harness import (
    PodProcess,
    latest_states,
    produce,
    read_topic,
    unique_env,
    wf_created,
    wf_terminal,
)
from tests.support.proc_util import runner_pids

pytestmark = [pytest.mark.kafka]

RUN = uuid.uuid4().hex[:8]
#: The pod's stall guard logs this when its event loop runs again after a stop (SIGCONT): the
#: first line the resumed pod writes about the stop, so everything after it is the resumed pod's.
RESUMED = "event loop stood still"


# --- what a pod's log says (its JSON lines), waited for with a deadline ---------------------------


def log_records(pod: PodProcess) -> list[dict[str, Any]]:
    records = []
    for line in pod.log().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line of a runner process sharing the pod's stderr
        if isinstance(record, dict):
            records.append(record)
    return records


def _partitions(record: dict[str, Any]) -> set[int]:
    return {int(p) for p in str(record.get("partitions", "")).split(",") if p}


def resumed_at(records: list[dict[str, Any]]) -> int | None:
    """Index of the resumed pod's first line (its stall guard's warning), None before it."""
    return next((i for i, r in enumerate(records) if str(r.get("msg", "")).startswith(RESUMED)), None)


def stand_downs(records: list[dict[str, Any]], since: int) -> dict[int, int]:
    """Per partition, the index of the first record from ``since`` (the resume line) on in which
    the resumed pod gave the partition up in its old generation: its transaction fenced by the
    partition's new owner, or the group's revocation of it (its driver results void). Callers
    wait for these while the pod still runs, before any signal of theirs, so the release a
    shutdown writes can never be the one matched."""
    found: dict[int, int] = {}
    for i in range(since, len(records)):
        record = records[i]
        if record.get("logger") != "sandbox_lanes.pod":
            continue
        msg = str(record.get("msg", ""))
        fenced = msg.startswith("fenced:") and record.get("level") == "error"
        if fenced or msg.startswith("partitions released"):
            for p in _partitions(record):
                found.setdefault(p, i)
    return found


async def wait_for_log(
    pod: PodProcess,
    what: str,
    found: Callable[[list[dict[str, Any]]], Any],
    timeout_s: float = 60.0,
    on_tick: Callable[[], None] | None = None,
) -> Any:
    """Poll the pod's log until ``found`` returns something truthy; fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = found(log_records(pod))
        if result:
            return result
        if on_tick is not None:
            on_tick()
        assert pod.proc is not None
        assert pod.proc.poll() is None, (
            f"pod exited ({pod.proc.returncode}) before {what}:\n{pod.log()[-3000:]}"
        )
        assert time.monotonic() < deadline, f"not in {timeout_s:g}s: {what}\n{pod.log()[-4000:]}"
        await asyncio.sleep(0.2)


async def wait_for_stand_down(
    pod: PodProcess,
    partitions: Iterable[int],
    timeout_s: float = 60.0,
    on_tick: Callable[[], None] | None = None,
) -> int:
    """Wait until the resumed pod has stood down every partition in ``partitions`` (see
    :func:`stand_downs`); returns the index of the last of those records in its log."""
    wanted = set(partitions)

    def found(records: list[dict[str, Any]]) -> int | None:
        since = resumed_at(records)
        if since is None:
            return None
        downs = stand_downs(records, since)
        return max(downs[p] for p in wanted) if wanted <= set(downs) else None

    at: int = await wait_for_log(
        pod, f"the resumed pod standing down partitions {sorted(wanted)}", found, timeout_s, on_tick
    )
    return at


async def no_open_transaction(bootstrap: str, topic: str, timeout_s: float = 60.0) -> None:
    """Wait until ``topic`` holds records and no transaction on it is open: on every partition its
    last stable offset (the ``read_committed`` end) has reached its high watermark (a broker-side fact)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    tps = [TopicPartition(topic, p["partition"]) for p in described["partitions"]]
    stable = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, isolation_level="read_committed")
    written = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, isolation_level="read_uncommitted")
    await stable.start()
    await written.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            lso, hw = await stable.end_offsets(tps), await written.end_offsets(tps)
            if sum(hw.values()) > 0 and lso == hw:
                return
            assert time.monotonic() < deadline, f"a transaction on {topic} still open after {timeout_s:g}s"
            await asyncio.sleep(0.2)
    finally:
        await stable.stop()
        await written.stop()


async def runners_left(queues: list[str], timeout_s: float = 15.0) -> list[str]:
    """The queues that still have a runner process once every one is gone, or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := [q for q in queues if runner_pids(q)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return left


async def committed_outcomes(bootstrap: str, topic: str) -> list[Any]:
    """Every committed outcome, up to the topic's last stable offset (a broker-side end, no settle)."""
    return [
        decode(r.key, r.value, [(k, v.encode()) for k, v in r.headers.items()], allowed=OUTCOME_TYPES)
        for r in await read_all(bootstrap, topic)
    ]


async def test_the_next_owner_of_a_partition_fences_the_previous_writer(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    topic = f"fence-{RUN}"
    group = f"fence-group-{RUN}"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=None)
    await consumer.start()
    options = {"bootstrap.servers": kafka_bootstrap}
    old = PartitionSinks(consumer, group, "exactly_once", {}, txn_config=options)
    new = PartitionSinks(consumer, group, "exactly_once", {}, txn_config=options)
    await old.start()
    await new.start()
    try:
        await old.open([0])
        zombie = old.get(0)
        assert isinstance(zombie, TransactionalSink)
        await zombie.begin()
        await zombie.send(topic, EncodedRecord(b"k", b"from-the-zombie", []), partition=0)
        await zombie.producer.flush()

        await new.open([0])  # the rebalanced owner: same transactional id, new epoch
        owner = new.get(0)
        assert owner is not None
        await owner.begin()
        await owner.send(topic, EncodedRecord(b"k", b"from-the-owner", []), partition=0)
        await owner.commit({})

        with pytest.raises(KafkaError):
            await zombie.commit({TopicPartition("any-input", 0): 1})
        reader = AIOKafkaConsumer(
            topic,
            bootstrap_servers=kafka_bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
        )
        await reader.start()
        try:
            batch = await reader.getmany(timeout_ms=3000)
        finally:
            await reader.stop()
        values = [r.value for recs in batch.values() for r in recs]
        assert values == [b"from-the-owner"]
    finally:
        await old.stop()
        await new.stop()
        await consumer.stop()
    # The fenced transaction's error was handled (raised to its commit): asyncio must not report it
    # again as "Future exception was never retrieved" once the zombie's futures are collected.
    del zombie, old
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


async def test_a_pod_paused_past_its_session_timeout_and_resumed_writes_no_second_outcome(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_DRIVER_OPTIONS="ensure_latency_ms=4000",
    )
    topics: Topics = load_settings(env).topics
    executions = [f"wfx_zombie_{RUN}_{i}" for i in range(20)]
    after = [f"wfx_zombie_{RUN}_after_{i}" for i in range(6)]
    zombie = PodProcess(env, tmp_path / "pod-a.log")
    zombie.start()
    await zombie.wait_for_log("state restored")
    await produce(kafka_bootstrap, env, *(wf_created(e) for e in executions))
    # Its decisions are committed and every driver call is inside the driver when it is stopped
    # (each call mints, token-less here, right before the driver): the 4 s calls end while it is
    # stopped, longer than 4 s since the group drops it only after its 6 s session timeout.
    states = latest_states(
        await read_topic(kafka_bootstrap, topics.state, at_least=20, timeout_s=30, settle_s=0.0)
    )
    assert all(len(states[e].pending) == 1 for e in executions)

    def launched(records: list[dict[str, Any]]) -> bool:
        minted = {r.get("executionId") for r in records if r.get("msg") == LOG_TOKENLESS_LAUNCH}
        return minted >= set(executions)

    await wait_for_log(zombie, "every driver call started", launched, timeout_s=30)
    assert zombie.proc is not None
    zombie.proc.send_signal(signal.SIGSTOP)
    owner = PodProcess(
        {**env, "SANDBOX_LANES_POD_ID": "pod-b", "SANDBOX_LANES_DRIVER_OPTIONS": "ensure_latency_ms=50"},
        tmp_path / "pod-b.log",
    )
    try:
        owner.start()
        # Past the 6 s session timeout the group drops the stopped pod; the owner takes over both
        # partitions, fences their writer and finishes the pending calls.
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=20, timeout_s=90)
        await owner.wait_for_log("outbox resumed")
        zombie.proc.send_signal(signal.SIGCONT)
        # The zombie wakes with its calls' results in hand. It must stand down both partitions it
        # held: its fold-back transaction fenced by the owner's epoch, or (if the group's answer
        # comes first) the revocation voiding its results. Waited for, not slept on.
        stood_down = await wait_for_stand_down(zombie, [0, 1])
        # Not wedged: the fenced pod rejoins the group and takes a partition over again...
        await wait_for_log(
            zombie,
            "the zombie taking a partition over again after standing down",
            lambda records: any(r.get("msg") == "state restored" for r in records[stood_down:]),
        )
        # ... and the group decides new work.
        await produce(kafka_bootstrap, env, *(wf_created(e) for e in after))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=26, timeout_s=60, settle_s=0.0)
    finally:
        if zombie.proc is not None and zombie.proc.poll() is None:
            zombie.proc.send_signal(signal.SIGCONT)
        codes = [pod.terminate()[0] for pod in (zombie, owner) if pod.proc is not None]
    log = zombie.log()
    # Both pods have exited: the topic's committed contents are final.
    outcomes = await committed_outcomes(kafka_bootstrap, topics.outcomes)
    ids = Counter(m.meta.event_id for m in outcomes)
    assert [i for i, n in ids.items() if n > 1] == [], log[-3000:]
    per_execution = Counter(
        m.execution_id for m in outcomes if isinstance(m, outcomes_pb2.SandboxProvisioned)
    )
    assert per_execution == Counter(executions + after), log[-3000:]
    assert codes == [0, 0], log[-5000:]


async def test_a_transaction_the_broker_timed_out_fences_the_producer_and_the_pod_replaces_it(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's wedge, forced for real: one transaction is held open (its commit delayed) past the
    1 s transaction timeout until the broker's cleanup (every 10 s) has aborted it and bumped the
    producer's epoch (seen on the broker: no transaction open on the state topic any more). The
    commit then fails fenced; the pod stands down, rejoins with a new producer, decides the record
    again and keeps deciding new ones: one outcome each, commits succeed again."""
    from harness.memory_driver import MemoryProvisioner

    from consumers.runtime.kafka.sink import TransactionalSink
    from tests.support.pod_harness import running_pod

    caplog.set_level(logging.INFO, logger="sandbox_lanes")
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_TRANSACTION_TIMEOUT_MS="1000",
    )
    topics = load_settings(env).topics
    real_commit = TransactionalSink.commit
    held = asyncio.Event()

    async def commit(self: TransactionalSink, offsets: dict[TopicPartition, int]) -> None:
        if offsets and not held.is_set():
            held.set()
            # The only transaction on the state topic is this one (its create's state): commit
            # once the broker has ended it on its own (aborted past the 1 s timeout).
            await no_open_transaction(kafka_bootstrap, topics.state)
        await real_commit(self, offsets)

    first = f"wfx_txn_timeout_{RUN}"
    later = [f"wfx_txn_timeout_{RUN}_after_{i}" for i in range(4)]
    async with running_pod(env, provisioner=MemoryProvisioner()) as composed:
        monkeypatch.setattr(TransactionalSink, "commit", commit)
        await produce(kafka_bootstrap, env, wf_created(first))
        await asyncio.wait_for(held.wait(), 20)
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=1, timeout_s=90, settle_s=0.0)
        await produce(kafka_bootstrap, env, *(wf_created(e) for e in later))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=5, timeout_s=60, settle_s=0.0)
        stats = composed.pod.stats
        assert stats.commit_failures >= 1
        assert stats.commits_failing_since is None  # a later commit went through
        assert composed.pod.health().alive
    # The pod has stopped: the topic's committed contents are final.
    outcomes = await committed_outcomes(kafka_bootstrap, topics.outcomes)
    provisioned = Counter(m.execution_id for m in outcomes if isinstance(m, outcomes_pb2.SandboxProvisioned))
    assert provisioned == Counter([first, *later])
    fences = [
        r
        for r in caplog.records
        if r.name == "sandbox_lanes.pod"
        and r.levelno == logging.ERROR
        and r.getMessage().startswith("fenced:")
    ]
    assert fences, caplog.text[-3000:]


@pytest.mark.usefixtures("no_leaked_runners")
async def test_a_resumed_zombie_creates_no_sandbox_for_an_execution_that_moved_and_ended(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Two pods, the real local-process driver one call at a time (a slow driver: calls queue).
    The first pod is stopped with calls queued; the second takes over, provisions every execution
    and, after their terminal phases, tears every runner down; then the first resumes. None of its
    queued calls may start, and no execution ever has two runners at once (a runner the stopped pod
    spawned but had not recorded is adopted by the new owner's ensure or ended by its teardown). The
    one call that was inside the driver at the stop (concurrency 1) is past every check and may
    still spawn its runner after the resume: at most that one runner appears. A runner left for an
    ended execution is the reaper's, and one pass removes it, so nothing of an ended execution stays."""
    env = unique_env(
        kafka_bootstrap, tmp_path, SANDBOX_LANES_DRIVER_CONCURRENCY="1", SANDBOX_LANES_REAP_INTERVAL_S="0"
    )
    topics: Topics = load_settings(env).topics
    executions = [f"wfx_resume_{RUN}_{i}" for i in range(30)]
    queues = [f"wfexec:{e}" for e in executions]
    most_at_once = Counter[str]()

    def sample() -> None:
        for queue in queues:
            most_at_once[queue] = max(most_at_once[queue], len(runner_pids(queue)))

    zombie = PodProcess(env, tmp_path / "pod-a.log")
    zombie.start()
    await zombie.wait_for_log("state restored")
    await produce(kafka_bootstrap, env, *(wf_created(e) for e in executions))
    await read_topic(kafka_bootstrap, topics.outcomes, at_least=2, settle_s=0.0)
    assert zombie.proc is not None
    zombie.proc.send_signal(signal.SIGSTOP)  # mid-work: the rest of its calls are queued
    sample()
    owner = PodProcess({**env, "SANDBOX_LANES_POD_ID": "pod-b"}, tmp_path / "pod-b.log")
    try:
        owner.start()
        outcomes = await read_topic(
            kafka_bootstrap, topics.outcomes, at_least=30, timeout_s=120, settle_s=0.5
        )
        sample()
        assert sum(isinstance(r.message, outcomes_pb2.SandboxProvisioned) for r in outcomes) >= 30
        await produce(kafka_bootstrap, env, *(wf_terminal(e) for e in executions))
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=60, timeout_s=120)
        sample()
        in_flight = {q: runner_pids(q) for q in queues if runner_pids(q)}
        assert len(in_flight) <= 1, in_flight  # at most the one call inside the driver at the stop
        zombie.proc.send_signal(signal.SIGCONT)
        # The resumed pod stands down both partitions (its transaction fenced, or the group's
        # revocation voiding its queued calls). Then it is stopped (a clean SIGTERM): once it has
        # exited, every runner it was ever going to start has started, so the count is final.
        await wait_for_stand_down(zombie, [0, 1], timeout_s=60, on_tick=sample)
        await asyncio.to_thread(zombie.terminate)
        sample()
        after_resume = {q: runner_pids(q) for q in queues if runner_pids(q)}
        reap = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "consumers.tools.cli", "reap", "--apply", "--grace", "0",
            env={**os.environ, **env},
        )  # fmt: skip
        assert await asyncio.wait_for(reap.wait(), 60) == 0
        left = await runners_left(queues)
    finally:
        if zombie.proc is not None and zombie.proc.poll() is None:
            zombie.proc.send_signal(signal.SIGCONT)
        codes = [pod.terminate()[0] for pod in (zombie, owner) if pod.proc is not None]
    log = zombie.log()
    # The resumed pod started nothing but, at most, the one call already inside the driver.
    assert len(set(after_resume) - set(in_flight)) <= 1, (after_resume, in_flight, log[-4000:])
    assert left == [], log[-4000:]
    assert max(most_at_once.values()) <= 1, most_at_once.most_common(3)
    assert "event loop stood still" in log, log[-4000:]
    assert codes == [0, 0], log[-5000:]
