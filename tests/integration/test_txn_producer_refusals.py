"""A record the broker refuses in the middle of a transaction is the record's fault (issue 42, 2).

On the real broker with a real librdkafka producer: a topic whose ``max.message.bytes`` is small
refuses one record among many. librdkafka then enters its abortable state and answers every later
``produce()`` with ``_STATE``, which says nothing of why; before, the pod read that as the world's and
retried the whole batch for ever. Now ``produce()`` reads the delivery reports and raises the refused
record's own error (deterministic, naming it), so the pod's one-record mode and dead letter reach it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import MessageSizeTooLargeError
from confluent_kafka import KafkaError, KafkaException, Producer

from consumers.ops.settings import load_settings
from consumers.runtime.kafka.failures import is_deterministic
from consumers.runtime.kafka.txn_producer import TxnProducer, group_metadata
from events.sandbox_lanes.v1 import outcomes_pb2
from tests.support.pod_harness import create_inputs, produce, read_topic, running_pod, unique_env, wf_created

pytestmark = pytest.mark.kafka

#: The topic's limit; the refused record is well over it, the others well under.
TOPIC_LIMIT_BYTES = 2_000
REFUSED_BYTES = 20_000
#: How long the test keeps producing after the refused record, waiting for the broker's answer.
ANSWER_DEADLINE_S = 30.0
#: A partition the test topics do not have: librdkafka answers a record for it at once, never queues it.
MISSING_PARTITION = 99


async def _topic(bootstrap: str, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(name, 2, 1, topic_configs={"max.message.bytes": str(TOPIC_LIMIT_BYTES)})]
        )
    finally:
        await admin.close()


async def _committed_values(bootstrap: str, topic: str) -> list[bytes]:
    """Every committed record of ``topic`` (read_committed, up to the end offset)."""
    reader = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        enable_auto_commit=False,
    )
    await reader.start()
    try:
        tps = reader.assignment()
        ends = await reader.end_offsets(list(tps))
        values: list[bytes] = []
        deadline = time.monotonic() + 30
        while any([await reader.position(tp) < ends[tp] for tp in tps]):
            assert time.monotonic() < deadline, f"read {len(values)} records, short of {ends}"
            for records in (await reader.getmany(timeout_ms=500)).values():
                values.extend(r.value for r in records if r.value is not None)
        return values
    finally:
        await reader.stop()


async def _partitions_known(producer: TxnProducer, topic: str) -> None:
    """librdkafka holds ``topic``'s metadata: a record for a partition it lacks is then refused at once
    (``_UNKNOWN_PARTITION``), not queued until metadata comes (and failed later, inside the transaction)."""
    metadata = await asyncio.to_thread(producer._handle.list_topics, topic, 10.0)
    assert sorted(metadata.topics[topic].partitions) == [0, 1], metadata.topics[topic]


async def _until_abortable(producer: TxnProducer, topic: str) -> float:
    """Wait, up to :data:`ANSWER_DEADLINE_S`, until librdkafka has put the open transaction in its
    abortable state (the broker's refusal has arrived), serving no delivery report; the seconds it took.

    librdkafka shows that state only in what it refuses: a record for a partition the topic lacks is
    answered ``_STATE`` once the transaction is abortable, ``_UNKNOWN_PARTITION`` before, and never
    queued (:func:`_partitions_known` first). ``poll()`` or ``flush()`` would show it as well, but they
    serve the reports, and the scene waited for is the one where nobody has."""
    handle = producer._handle
    began = time.monotonic()
    while True:
        try:
            handle.produce(topic, key=b"probe", value=b"", partition=MISSING_PARTITION)
        except KafkaException as exc:
            code = exc.args[0].code()
            if code == KafkaError._STATE:
                return time.monotonic() - began
            assert code == KafkaError._UNKNOWN_PARTITION, repr(exc)
        else:
            raise AssertionError("the probe record was queued: the scene is spoiled (topic metadata unknown)")
        assert time.monotonic() - began < ANSWER_DEADLINE_S, f"no refusal within {ANSWER_DEADLINE_S:g} s"
        await asyncio.sleep(0.005)  # pacing only: the verdict is the probe's answer


def _producer(bootstrap: str, run: str) -> TxnProducer:
    return TxnProducer(
        {"bootstrap.servers": bootstrap, "linger.ms": 5, "message.max.bytes": 1_048_576},
        f"refusals-{run}",
        group_metadata(f"refusals-group-{run}"),
        timeout_s=10.0,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "refused_partition",
    [1, 0],
    ids=["in-a-batch-of-its-own", "sharing-its-batch"],
)
async def test_a_record_refused_mid_transaction_fails_the_later_produce_with_its_own_error(
    kafka_bootstrap: str, refused_partition: int
) -> None:
    """The other records go to partition 0. Alone on partition 1 the refused record is named exactly;
    on partition 0 the broker refuses its whole batch, whose first record is named (and how many
    more failed with it): the pod's one-record mode then finds which one it is."""
    run = uuid.uuid4().hex[:8]
    topic = f"refusing-{run}"
    await _topic(kafka_bootstrap, topic)
    producer = _producer(kafka_bootstrap, run)
    try:
        await producer.init()
        producer.begin()
        for i in range(20):
            await producer.produce(topic, b"before-%d" % i, b"before-%d" % i, None, 0)
        await producer.produce(topic, b"r" * REFUSED_BYTES, b"the-refused-one", None, refused_partition)
        # The records after it: handed over until librdkafka, having had the broker's refusal,
        # stops taking them. That raise is the verdict; the loop is bounded by a deadline.
        raised: BaseException | None = None
        produced_after = 0
        give_up_at = time.monotonic() + ANSWER_DEADLINE_S
        while raised is None and time.monotonic() < give_up_at:
            try:
                await producer.produce(topic, b"after", b"after-%d" % produced_after, None, 0)
                produced_after += 1
            except Exception as exc:
                raised = exc
            await asyncio.sleep(0.005)  # pacing only: the broker answers meanwhile
        assert raised is not None, (
            f"{produced_after} records produced after the refused one in {ANSWER_DEADLINE_S:g} s, none refused"
        )
        print(f"\nproduce() refused after {produced_after} later records: {type(raised).__name__}: {raised}")
        # The record's fault, not the world's: the broker's own code, naming the refused record.
        assert is_deterministic(raised), repr(raised)
        assert isinstance(raised, MessageSizeTooLargeError), repr(raised)
        assert f"{topic} [{refused_partition}]" in str(raised), str(raised)
        if refused_partition == 1:
            assert f"{topic} [1] key 'the-refused-one'" in str(raised), str(raised)
        else:
            assert "more records that failed after it" in str(raised), str(raised)

        # The transaction aborts. A refused batch leaves the producer's sequence numbers behind the
        # broker's (its next transaction fails OutOfOrderSequenceNumber), so the pod renews it: the
        # same transactional id, a new epoch, which commits (nothing of the refused one kept).
        await producer.abort()
        producer.close()
        producer = _producer(kafka_bootstrap, run)
        await producer.init()
        producer.begin()
        await producer.produce(topic, b"next", b"next", None, 0)
        await producer.commit({})
        assert await _committed_values(kafka_bootstrap, topic) == [b"next"]
    finally:
        producer.close()


@pytest.mark.timeout(120)
async def test_a_record_refused_just_before_the_commit_fails_the_commit_with_its_own_error(
    kafka_bootstrap: str,
) -> None:
    """No produce() after the refused record, and its refusal arrived before the commit starts (as when
    the pod's batch is long): librdkafka fails the commit at once, from its abortable state, with no
    record named and the delivery reports unserved. The reports are served then and the refused
    record's error is the commit's answer, naming it (CI found the pod reading librdkafka's bare
    answer as the world's, retrying a dead letter no ACL let it write for ever). Fails if the commit
    took the other path (its own flush serving the reports: named without that step)."""
    run = uuid.uuid4().hex[:8]
    topic = f"refusing-at-commit-{run}"
    await _topic(kafka_bootstrap, topic)
    producer = _producer(kafka_bootstrap, run)
    try:
        await producer.init()
        await _partitions_known(producer, topic)
        producer.begin()
        await producer.produce(topic, b"ordinary", b"ordinary", None, 0)
        await producer.produce(topic, b"r" * REFUSED_BYTES, b"the-refused-one", None, 1)
        abortable_after_s = await _until_abortable(producer, topic)
        with pytest.raises(MessageSizeTooLargeError) as raised:
            await producer.commit({})
        # What commit() answered before the reports were served (the exception it replaced).
        first = raised.value.__cause__
        print(
            f"\nabortable {abortable_after_s * 1000:.0f} ms after the refused record was handed over; "
            f"commit() answered {type(raised.value).__name__}: {raised.value}\n  in place of: {first!r}"
        )
        assert is_deterministic(raised.value), repr(raised.value)
        assert f"{topic} [1] key 'the-refused-one'" in str(raised.value), str(raised.value)
        # The path meant: librdkafka's own answer, translated and naming no record, replaced by the
        # served report's error. Through the commit's own flush, the record's error comes straight
        # from librdkafka's exception (nothing in between).
        assert not isinstance(first, KafkaException), f"the commit's own flush served the report: {first!r}"
        assert isinstance(first, Exception) and isinstance(first.__cause__, KafkaException), repr(first)
        assert "the-refused-one" not in str(first), repr(first)
        await producer.abort()
    finally:
        producer.close()
    assert await _committed_values(kafka_bootstrap, topic) == []


#: The state topic's limit in the pod test: a 30 kB org makes a state record it refuses.
STATE_LIMIT_BYTES = 20_000
#: Creates before and after the refused one, all in the pod's first fetch (one transaction): enough
#: after it that the pod is still handing records over when the broker's refusal arrives (the first
#: produce() that meets the abortable state ends the transaction: met in each of 4 runs with 300).
BEFORE, AFTER = 5, 300


@pytest.mark.timeout(420)
async def test_the_pod_dead_letters_a_record_refused_mid_transaction_and_provisions_the_rest(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path: the refusal surfaces in a later ``produce()`` of the same transaction (counted
    here, so the test knows it took that path), the pod reads it as the record's fault, narrows the
    partition down to one record per transaction, dead-letters the refused create after its attempts
    and decides every other create (its state committed). Before, it retried the whole batch for
    ever. (Every create's outcome follows from its state's outbox: how fast the results are folded
    after such a failure is the pod's small-steps policy, not this test's.)"""
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_PARTITIONS="1",
        SANDBOX_LANES_DEAD_LETTER_ATTEMPTS="2",
        SANDBOX_LANES_MAX_BATCH="2000",
    )
    topics = load_settings(env).topics
    await create_inputs(env)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    topics.state,
                    1,
                    1,
                    topic_configs={"cleanup.policy": "compact", "max.message.bytes": str(STATE_LIMIT_BYTES)},
                )
            ]
        )
    finally:
        await admin.close()

    # Which later produce() calls met librdkafka's abortable state, and what they were answered with.
    answered: list[BaseException] = []
    refused_for = TxnProducer._refused

    async def counted(
        self: TxnProducer, producer: Producer, exc: KafkaException, *, at_commit: bool = False
    ) -> BaseException:
        answer = await refused_for(self, producer, exc, at_commit=at_commit)
        if exc.args and isinstance(exc.args[0], KafkaError) and exc.args[0].code() == KafkaError._STATE:
            answered.append(answer)
        return answer

    monkeypatch.setattr(TxnProducer, "_refused", counted)

    run = uuid.uuid4().hex[:6]
    ordinary = [f"wf-mid-{run}-{i}" for i in range(BEFORE + AFTER)]
    refused = wf_created(f"wf-mid-{run}-refused")
    refused.org = "r" * 30_000
    creates = [wf_created(e) for e in ordinary]
    await produce(kafka_bootstrap, env, *creates[:BEFORE], refused, *creates[BEFORE:])
    started = time.monotonic()
    async with running_pod(env) as composed:
        letters = await read_topic(kafka_bootstrap, topics.dead_letter, at_least=1, timeout_s=90)
        lettered = time.monotonic() - started
        # After the dead letter the rest of the batch goes one record per transaction (the pod's small
        # steps, about 2 records/s here): the bound is generous.
        states = await read_topic(
            kafka_bootstrap, topics.state, at_least=len(ordinary), timeout_s=300, settle_s=0.5
        )
        decided = time.monotonic() - started
        assert composed.pod.health().alive
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, settle_s=0.2, timeout_s=5)
    print(
        f"\n{len(answered)} produce() calls met the abortable state; dead letter after {lettered:.1f} s, "
        f"{len({r.key for r in states})} states after {decided:.1f} s, {len(outcomes)} outcomes by then"
    )
    assert answered, "no produce() met the abortable state: the refusal only reached the commit"
    assert all(is_deterministic(a) and isinstance(a, MessageSizeTooLargeError) for a in answered), answered
    (letter,) = letters
    assert letter.key == refused.execution_id
    assert letter.headers["dlq_reason"].startswith("its transaction failed 2 times the same way"), (
        letter.headers
    )
    assert "too large" in letter.headers["dlq_reason"].lower(), letter.headers
    assert {r.key for r in states} == set(ordinary)  # every other create decided, the refused one not
    provisioned = [
        o.message.execution_id for o in outcomes if isinstance(o.message, outcomes_pb2.SandboxProvisioned)
    ]
    assert len(provisioned) == len(set(provisioned)) and set(provisioned) <= set(ordinary)
