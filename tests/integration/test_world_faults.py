"""What production does to the pod that is no record's fault (issue 33), on the real broker.

- A phase change whose create is held back on its partition (here by a producer's transaction left
  open past the old 30 s give-up, so a read_committed consumer cannot get past it) waits for the
  create however long that takes, and is applied after it: never dead-lettered as "unknown"; a create
  of another producer whose clock runs ahead, applied before, does not release it.
- A record whose type is not the one its topic carries is dead-lettered at once, with the reason,
  and the records behind it go on.
- A producer whose clock runs ahead (its event stamps and record timestamps alike) cannot make the
  correct phase changes after it stale: its record is dead-lettered against the pod's clock, the
  correct one tears the sandbox down, and a replay from another shell re-derives every decision.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from confluent_kafka import Producer

from consumers.ops.settings import load_settings
from consumers.runtime.create_order import CreateOrderGate
from consumers.tools.replay.command import lane_config
from consumers.tools.replay.derive import replay
from events.codec import encode
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2
from tests.support.pod_harness import (
    create_inputs,
    read_topic,
    running_pod,
    unique_env,
    wf_created,
    wf_terminal,
)

pytestmark = pytest.mark.kafka

#: Longer than the create-order gate's old give-up (30 s on wall-clock time).
HELD_BACK_S = 40


def _env(bootstrap: str, tmp_path: Path) -> dict[str, str]:
    return unique_env(bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", SANDBOX_LANES_PARTITIONS="1")


async def _producer(bootstrap: str, **options: Any) -> AIOKafkaProducer:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", **options)
    await producer.start()
    return producer


async def _outcomes(bootstrap: str, env: dict[str, str], execution_id: str, count: int) -> list[Any]:
    topic = load_settings(env).topics.outcomes
    deadline = time.monotonic() + 90
    found: list[Any] = []
    while time.monotonic() < deadline:
        found = [
            r.message
            for r in await read_topic(bootstrap, topic, settle_s=0.2, timeout_s=5)
            if getattr(r.message, "execution_id", None) == execution_id
        ]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.3)
    raise AssertionError(f"{execution_id}: {len(found)} of {count} outcomes: {found}")


async def _provisioned(
    producer: AIOKafkaProducer, bootstrap: str, env: dict[str, str], execution_id: str
) -> None:
    """Produce a workflow's create and wait for its sandbox."""
    create = encode(wf_created(execution_id))
    topic = load_settings(env).topics.execution_created
    await producer.send_and_wait(topic, create.value, key=create.key, headers=create.headers)
    assert [type(o) for o in await _outcomes(bootstrap, env, execution_id, 1)] == [
        outcomes_pb2.SandboxProvisioned
    ]


async def _dead_letters(bootstrap: str, env: dict[str, str]) -> list[dict[str, str]]:
    topic = load_settings(env).topics.dead_letter
    return [r.headers for r in await read_topic(bootstrap, topic, settle_s=0.2, timeout_s=5)]


#: How far ahead of the others another producer's clock runs (inside the pod's 300 s allowance, so
#: its create is applied, not dead-lettered as from the future).
SKEW_MS = 120_000


def _gate(pod: Any) -> CreateOrderGate:
    gate = getattr(pod, "_create_gate", None)
    assert isinstance(gate, CreateOrderGate), "the pod's create-order gate is not where the test looks"
    return gate


@pytest.mark.timeout(240)
async def test_a_phase_change_waits_for_its_create_held_back_longer_than_the_old_timeout(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Also under a skewed producer (issue 42, 6): another producer, whose clock runs two minutes
    ahead, had a create applied on the same partition before; its later stamp must not release the
    phase change (it did: the phase change was dead-lettered as an unknown execution at once)."""
    env = _env(kafka_bootstrap, tmp_path)
    await create_inputs(env)
    topics = load_settings(env).topics
    execution_id = f"wf-held-{uuid.uuid4().hex[:8]}"
    holder = await _producer(
        kafka_bootstrap, transactional_id=f"holder-{uuid.uuid4().hex[:6]}", transaction_timeout_ms=300_000
    )
    plain = await _producer(kafka_bootstrap)
    try:
        async with running_pod(env) as composed:
            pod = composed.pod
            gate = _gate(pod)
            # Another producer's create, stamped (record and event alike) two minutes ahead: applied.
            skewed_id = f"wf-skewed-{uuid.uuid4().hex[:8]}"
            ahead_ms = int(time.time() * 1000) + SKEW_MS
            skewed_event = wf_created(skewed_id)
            skewed_event.meta.occurred_at.FromMilliseconds(ahead_ms)
            skewed = encode(skewed_event, source="another-producer-two-minutes-ahead")
            await plain.send_and_wait(
                topics.execution_created,
                skewed.value,
                key=skewed.key,
                headers=skewed.headers,
                timestamp_ms=ahead_ms,
            )
            assert [type(o) for o in await _outcomes(kafka_bootstrap, env, skewed_id, 1)] == [
                outcomes_pb2.SandboxProvisioned
            ]
            consumed_before = sum(pod.stats.consumed.values())
            # The create is produced first, inside a transaction left open: the partition's last
            # stable offset stays below it, so the pod cannot read it (nor anything after it there).
            await holder.begin_transaction()
            create = encode(wf_created(execution_id))
            await (
                await holder.send(
                    topics.execution_created, create.value, key=create.key, headers=create.headers
                )
            )
            phase = encode(wf_terminal(execution_id))
            sent = await plain.send_and_wait(
                topics.phase_changed, phase.value, key=phase.key, headers=phase.headers
            )
            # Positive barrier: the pod has looked at the phase change and its gate holds it.
            deadline = time.monotonic() + 30
            while not gate.holds(sent.topic, sent.partition, sent.offset):
                assert pod.stats.dead_lettered == 0, "the phase change was dead-lettered, not held"
                assert time.monotonic() < deadline, "the pod never looked at the phase change"
                await asyncio.sleep(0.05)
            held_at = time.monotonic()
            while time.monotonic() - held_at < HELD_BACK_S:
                assert gate.holds(sent.topic, sent.partition, sent.offset), "the phase change was let go"
                assert pod.stats.dead_lettered == 0, (
                    "the phase change was dead-lettered while its create was held"
                )
                assert pod.health().alive, pod.health()
                await asyncio.sleep(1.0)
            assert sum(pod.stats.consumed.values()) == consumed_before, pod.stats.consumed
            await holder.commit_transaction()
            outcomes = await _outcomes(kafka_bootstrap, env, execution_id, 2)
            assert [type(o) for o in outcomes] == [
                outcomes_pb2.SandboxProvisioned,
                outcomes_pb2.SandboxDeprovisioned,
            ], outcomes
            assert not gate.holds(sent.topic, sent.partition, sent.offset)
            assert pod.stats.dead_lettered == 0
        assert await _dead_letters(kafka_bootstrap, env) == []
    finally:
        await holder.stop()
        await plain.stop()


#: Phase changes of executions never created, produced together (early phase changes after an outage).
BACKLOG = 12


@pytest.mark.timeout(180)
async def test_a_backlog_of_held_phase_changes_waits_out_one_confirmation_together(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Each record held at the head of its partition used to be seen only when it got there, so a
    backlog of N held records took N confirmations one after the other (about 4 s each). Fetched
    together, they are seen together: one cohort, every one dead-lettered "unknown execution"."""
    env = _env(kafka_bootstrap, tmp_path)
    await create_inputs(env)
    topics = load_settings(env).topics
    plain = await _producer(kafka_bootstrap)
    try:
        async with running_pod(env) as composed:
            pod = composed.pod
            gate = _gate(pod)
            await _provisioned(plain, kafka_bootstrap, env, f"wf-first-{uuid.uuid4().hex[:8]}")
            batch = plain.create_batch()
            for i in range(BACKLOG):
                phase = encode(wf_terminal(f"wf-never-{i}-{uuid.uuid4().hex[:6]}"))
                assert batch.append(key=phase.key, value=phase.value, timestamp=None, headers=phase.headers)
            sent = await (await plain.send_batch(batch, topics.phase_changed, partition=0))
            refs = [(topics.phase_changed, 0, sent.offset + i) for i in range(BACKLOG)]
            seen: dict[int, int] = {}
            started = time.monotonic()
            while pod.stats.dead_lettered < BACKLOG:
                for topic, partition, offset in refs:
                    at = gate.seen_at(topic, partition, offset)
                    if at is not None:
                        seen.setdefault(offset, at)
                assert time.monotonic() - started < 150, (pod.stats.dead_lettered, seen)
                await asyncio.sleep(0.02)
            took = time.monotonic() - started
        letters = await _dead_letters(kafka_bootstrap, env)
        assert len(letters) == BACKLOG, letters
        assert all("unknown execution" in h["dlq_reason"] for h in letters), letters
        # The gate held the backlog (a positive barrier), and whatever of it was seen held was seen
        # as one cohort: released by one confirmation (before, each record was held about 4 s on its
        # own, seen at its own time: 12 times at 20 ms polls).
        assert seen, "the gate never held the backlog"
        assert len(set(seen.values())) == 1, seen
        print(
            f"\n{BACKLOG} held phase changes dead-lettered in {took:.1f} s; cohorts {sorted(set(seen.values()))}"
        )
    finally:
        await plain.stop()


@pytest.mark.timeout(180)
async def test_a_record_of_another_topics_type_is_dead_lettered_at_once(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = _env(kafka_bootstrap, tmp_path)
    await create_inputs(env)
    topics = load_settings(env).topics
    live = f"wf-live-{uuid.uuid4().hex[:8]}"
    producer = await _producer(kafka_bootstrap)
    try:
        async with running_pod(env) as composed:
            await _provisioned(producer, kafka_bootstrap, env, live)
            # A workflow phase change labelled SessionDeleted (it would decode as one and end the live
            # workflow's session), and a phase change written to the execution-created topic.
            phase = encode(wf_terminal(live))
            labelled = [
                (k, b"sandbox_lanes.v1.SessionDeleted" if k == "ce_type" else v) for k, v in phase.headers
            ]
            first = await producer.send_and_wait(
                topics.phase_changed, phase.value, key=phase.key, headers=labelled
            )
            started = time.monotonic()
            second = await producer.send_and_wait(
                topics.execution_created, phase.value, key=phase.key, headers=phase.headers
            )
            after = f"wf-after-{uuid.uuid4().hex[:8]}"
            ordinary = encode(wf_created(after))
            await producer.send_and_wait(
                topics.execution_created, ordinary.value, key=ordinary.key, headers=ordinary.headers
            )
            assert [type(o) for o in await _outcomes(kafka_bootstrap, env, after, 1)] == [
                outcomes_pb2.SandboxProvisioned
            ]
            waited = time.monotonic() - started
            assert composed.pod.stats.dead_lettered == 2
            assert composed.metrics.dead_letters.labels("wrong_topic")._value.get() == 2
        letters = {
            (h["dlq_source_topic"], h["dlq_source_offset"]): h["dlq_reason"]
            for h in await _dead_letters(kafka_bootstrap, env)
        }
        assert letters == {
            (topics.phase_changed, str(first.offset)): (
                "event type 'sandbox_lanes.v1.SessionDeleted' on a topic that carries "
                "'sandbox_lanes.v1.PhaseChanged' only"
            ),
            (topics.execution_created, str(second.offset)): (
                "event type 'sandbox_lanes.v1.PhaseChanged' on a topic that carries "
                "'sandbox_lanes.v1.ExecutionCreated' only"
            ),
        }
        # Not held on any gate: the create written after them was provisioned well inside the old 30 s.
        assert waited < 30, waited
        # The live workflow was not touched: provisioned once, never torn down.
        assert [type(o) for o in await _outcomes(kafka_bootstrap, env, live, 1)] == [
            outcomes_pb2.SandboxProvisioned
        ]
    finally:
        await producer.stop()


@pytest.mark.timeout(180)
async def test_a_producer_clock_running_ahead_cannot_make_later_phase_changes_stale(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = _env(kafka_bootstrap, tmp_path)
    await create_inputs(env)
    settings = load_settings(env)
    topics = settings.topics
    execution_id = f"wf-skew-{uuid.uuid4().hex[:8]}"
    producer = await _producer(kafka_bootstrap)
    try:
        async with running_pod(env) as composed:
            await _provisioned(producer, kafka_bootstrap, env, execution_id)
            # A producer whose clock is 50 minutes ahead (inside the broker's own 1 h allowance for
            # CreateTime): the event's stamp and the record's timestamp agree, both in the future.
            ahead_s = 50 * 60
            skewed = wf_terminal(execution_id)
            skewed.new_phase = common_pb2.EXECUTION_IN_PROGRESS
            skewed.previous_phase = common_pb2.EXECUTION_PENDING
            skewed.meta.occurred_at.seconds += ahead_s
            record = encode(skewed)
            sent = await producer.send_and_wait(
                topics.phase_changed,
                record.value,
                key=record.key,
                headers=record.headers,
                timestamp_ms=int((time.time() + ahead_s) * 1000),
            )
            # Then the correct phase change, by a producer with a right clock.
            done = encode(wf_terminal(execution_id))
            await producer.send_and_wait(topics.phase_changed, done.value, key=done.key, headers=done.headers)
            outcomes = await _outcomes(kafka_bootstrap, env, execution_id, 2)
            assert [type(o) for o in outcomes] == [
                outcomes_pb2.SandboxProvisioned,
                outcomes_pb2.SandboxDeprovisioned,
            ], outcomes
            assert composed.pod.stats.dead_lettered == 1
            assert composed.metrics.dead_letters.labels("clock_ahead")._value.get() == 1
        (letter,) = await _dead_letters(kafka_bootstrap, env)
        assert letter["dlq_source_offset"] == str(sent.offset)
        reason = letter["dlq_reason"]
        assert reason.startswith("meta.occurred_at is ahead of the pod's clock by "), letter
        assert 2990 <= int(reason.split(" by ", 1)[1].split("s", 1)[0]) <= 3000, reason
    finally:
        await producer.stop()
    # The auditor's replay, later and elsewhere: the pod's clock is in no input, so its dead letter
    # is taken as recorded; every other decision re-derives.
    report = await replay(
        kafka_bootstrap,
        topics,
        lane_config(settings),
        guarantee=settings.guarantee,
        max_clock_ahead_s=settings.max_clock_ahead_s,
    )
    assert report.divergences == [], [d.as_dict() for d in report.divergences]
    assert report.matched_dead_letters == report.recorded_dead_letters == 1


@pytest.mark.timeout(240)
async def test_a_fence_of_one_partition_amid_the_others_commits_harms_none(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Partitions' writers are fenced one after another (a real InitProducerId on each transactional
    id, by librdkafka) while a steady stream keeps all four partitions' transactions going in the
    same turns. The pod stands a fenced partition down and rejoins between turns (it used to
    re-subscribe inside the turn, and another partition's commit then asked the highwater of a
    partition no longer assigned: the loop died); every execution still gets its outcomes exactly
    once."""
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_PARTITIONS="4",
    )
    await create_inputs(env)
    settings = load_settings(env)
    topics = settings.topics
    executions = [f"wf-fence-{uuid.uuid4().hex[:6]}-{i}" for i in range(240)]
    producer = await _producer(kafka_bootstrap, linger_ms=0)
    try:
        async with running_pod(env) as composed:
            pod = composed.pod

            async def stream(ids: list[str]) -> None:
                for execution_id in ids:
                    for event in (wf_created(execution_id), wf_terminal(execution_id)):
                        record = encode(event)
                        topic = (
                            topics.execution_created
                            if isinstance(event, inputs_pb2.ExecutionCreated)
                            else topics.phase_changed
                        )
                        await producer.send_and_wait(
                            topic, record.value, key=record.key, headers=record.headers
                        )
                    await asyncio.sleep(0.02)  # pacing: a steady stream, several turns

            feeding = asyncio.create_task(stream(executions))
            # The partitions have committed work before the first fence lands mid-stream.
            while pod.stats.batches < 6:
                await asyncio.sleep(0.05)
            fencer = Producer(
                {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{settings.group_id}-p0"}
            )
            await asyncio.to_thread(fencer.init_transactions, 30)
            await feeding
            outcomes: dict[str, list[str]] = {}
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                outcomes = {}
                for r in await read_topic(kafka_bootstrap, topics.outcomes, settle_s=0.2, timeout_s=5):
                    execution_id = getattr(r.message, "execution_id", None)
                    if execution_id in executions:
                        outcomes.setdefault(execution_id, []).append(type(r.message).__name__)
                if len(outcomes) == len(executions) and all(len(v) >= 2 for v in outcomes.values()):
                    break
                await asyncio.sleep(0.5)
            assert pod.health().alive, pod.health()
            fenced = pod.stats.commit_failures
            assert pod.metrics.fences._value.get() >= 1  # counted as fences, not as abandoned producers
        assert outcomes == {e: ["SandboxProvisioned", "SandboxDeprovisioned"] for e in executions}, {
            e: v for e, v in outcomes.items() if v != ["SandboxProvisioned", "SandboxDeprovisioned"]
        }
        assert fenced >= 1  # the fence did land on a transaction of partition 0
        assert await _dead_letters(kafka_bootstrap, env) == []
    finally:
        await producer.stop()


@pytest.mark.timeout(240)
async def test_only_the_result_that_cannot_be_written_pays(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Six ensures come back together and are folded in one transaction; one of them (an execution
    whose id makes its outcome larger than the outcome topic takes) fails that transaction the same
    way every time. The other five are folded and provisioned; only the one is given up: recorded
    as a failure of its call, and, as that outcome is too large as well, dropped and counted."""
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_PARTITIONS="1",
        SANDBOX_LANES_DEAD_LETTER_ATTEMPTS="2",
        SANDBOX_LANES_DRIVER_OPTIONS="ensure_latency_ms=1500",
    )
    await create_inputs(env)
    topics = load_settings(env).topics
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:  # the outcome topic takes records up to 3,000 bytes: an ordinary outcome is a few hundred
        await admin.create_topics(
            [NewTopic(topics.outcomes, 1, 1, topic_configs={"max.message.bytes": "3000"})]
        )
    finally:
        await admin.close()
    tag = uuid.uuid4().hex[:6]
    ordinary = [f"wf-ok-{tag}-{i}" for i in range(5)]
    too_large = f"wf-big-{tag}-" + "x" * 3000
    producer = await _producer(kafka_bootstrap, max_request_size=1 << 20)
    try:
        async with running_pod(env) as composed:
            pod = composed.pod
            for execution_id in [*ordinary[:3], too_large, *ordinary[3:]]:
                record = encode(wf_created(execution_id))
                await producer.send(
                    topics.execution_created, record.value, key=record.key, headers=record.headers
                )
            await producer.flush()
            provisioned = await _outcomes(kafka_bootstrap, env, ordinary[-1], 1)
            assert [type(o) for o in provisioned] == [outcomes_pb2.SandboxProvisioned]
            dropped = pod.metrics.results_dropped
            deadline = time.monotonic() + 60
            while dropped._value.get() < 1:  # the given-up result is counted, not lost silently
                assert time.monotonic() < deadline, "the result that cannot be written was never given up"
                await asyncio.sleep(0.2)
            assert pod.health().alive
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, settle_s=0.5, timeout_s=10)
        by_id = {getattr(r.message, "execution_id", ""): type(r.message).__name__ for r in outcomes}
        assert by_id == {e: "SandboxProvisioned" for e in ordinary}, by_id
        assert dropped._value.get() == 1
        assert await _dead_letters(kafka_bootstrap, env) == []
    finally:
        await producer.stop()
