"""Zombie fencing on a real broker: a pod that lost its partitions cannot commit anything.

The fence itself (one transactional producer per input partition, ``<group>-p<N>``), then the
whole story: a pod paused past its session timeout with driver work done, its partitions taken
over, then resumed."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from consumers.ops.settings import load_settings
from consumers.runtime.kafka.sink import PartitionSinks, TransactionalSink
from consumers.runtime.kafka.topology import Topics
from events.codec import EncodedRecord
from events.sandbox_lanes.v1 import outcomes_pb2
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
    zombie = PodProcess(env, tmp_path / "pod-a.log")
    zombie.start()
    await zombie.wait_for_log("state restored")
    await produce(kafka_bootstrap, env, *(wf_created(e) for e in executions))
    # Its decisions are committed and its driver calls are running when it is stopped.
    states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=20, timeout_s=30))
    assert all(len(states[e].pending) == 1 for e in executions)
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
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=20, timeout_s=90)
        await owner.wait_for_log("outbox resumed")
        # The zombie wakes: its 4 s driver calls are done, and it tries to fold them back.
        zombie.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(15)  # time to try its commits, be fenced, rejoin, and settle
        # Not wedged: the group (the fenced pod rejoined with new producers) decides new work.
        after = [f"wfx_zombie_{RUN}_after_{i}" for i in range(6)]
        await produce(kafka_bootstrap, env, *(wf_created(e) for e in after))
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=26, timeout_s=60)
    finally:
        if zombie.proc is not None and zombie.proc.poll() is None:
            zombie.proc.send_signal(signal.SIGCONT)
        codes = [pod.terminate()[0] for pod in (zombie, owner) if pod.proc is not None]
    log = zombie.log()
    ids = Counter(r.message.meta.event_id for r in outcomes)
    assert [i for i, n in ids.items() if n > 1] == [], log[-3000:]
    per_execution = Counter(
        r.message.execution_id for r in outcomes if isinstance(r.message, outcomes_pb2.SandboxProvisioned)
    )
    assert per_execution == Counter(executions + after), log[-3000:]
    # The zombie stood down: it tried to commit and was fenced, or the rejoin revoked its
    # partitions (voiding its results) before it tried.
    assert "fenced: another writer owns the partition" in log or "partitions released" in log, log[-3000:]
    assert codes == [0, 0], log[-5000:]


async def test_a_transaction_the_broker_timed_out_fences_the_producer_and_the_pod_replaces_it(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's wedge, forced for real: one transaction is held open (its commit delayed) past the
    1 s transaction timeout until the broker's cleanup (every 10 s) aborts it and bumps the producer's
    epoch. The commit then fails fenced; the pod stands down, rejoins with a new producer, decides the
    record again and keeps deciding new ones: one outcome each, commits succeed again."""
    import logging

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
            await asyncio.sleep(14)  # > timeout + the broker's 10 s abort-cleanup interval
        await real_commit(self, offsets)

    first = f"wfx_txn_timeout_{RUN}"
    later = [f"wfx_txn_timeout_{RUN}_after_{i}" for i in range(4)]
    async with running_pod(env, provisioner=MemoryProvisioner()) as composed:
        monkeypatch.setattr(TransactionalSink, "commit", commit)
        await produce(kafka_bootstrap, env, wf_created(first))
        await asyncio.wait_for(held.wait(), 20)
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1, timeout_s=90)
        await produce(kafka_bootstrap, env, *(wf_created(e) for e in later))
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=5, timeout_s=60, settle_s=2.0)
        stats = composed.pod.stats
        assert stats.commit_failures >= 1
        assert stats.commits_failing_since is None  # a later commit went through
        assert composed.pod.health().alive
    provisioned = Counter(
        r.message.execution_id for r in outcomes if isinstance(r.message, outcomes_pb2.SandboxProvisioned)
    )
    assert provisioned == Counter([first, *later])
    assert "fenced: another writer owns the partition now" in caplog.text


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
        for _ in range(40):  # 20 s: its hold, the heartbeat's answer, the rejoin, the revocation
            await asyncio.sleep(0.5)
            sample()
        after_resume = {q: runner_pids(q) for q in queues if runner_pids(q)}
        reap = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "consumers.tools.cli", "reap", "--apply", "--grace", "0",
            env={**os.environ, **env},
        )  # fmt: skip
        assert await asyncio.wait_for(reap.wait(), 60) == 0
        left = [q for q in queues if runner_pids(q)]
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
