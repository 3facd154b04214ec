"""A take-over's committed offsets are read stably (KIP-447's ``require_stable``), on a real broker.

Under exactly_once a partition's input offsets are committed inside its transactions. While a
transaction's offsets are pending at the group coordinator, a plain OffsetFetch (aiokafka's, versions
0-3) answers with what was materialised before; a take-over that read that would seek back before
inputs whose state it then restores, and ignore them as duplicates. The pod's reader
(``StableOffsets``, used by ``PartitionSinks.committed`` and the capacity ledger) answers nothing
while they are pending (it is told to ask again, and does), and the committed offsets once the
transaction ends, whichever way it ends. The reader gets the pod's own librdkafka options.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from confluent_kafka import Producer
from confluent_kafka import TopicPartition as RdTopicPartition

from consumers.ops.compose import pod_config
from consumers.ops.settings import load_settings
from consumers.runtime.kafka.clients import txn_producer_config
from consumers.runtime.kafka.stable_offsets import StableOffsets, Unstable
from consumers.runtime.kafka.txn_producer import group_metadata
from tests.support.pod_harness import unique_env

pytestmark = pytest.mark.kafka

TIMEOUT_S = 15.0


@pytest.fixture
def names() -> Iterator[tuple[str, str]]:
    run = uuid.uuid4().hex[:8]
    yield f"stable-offsets-{run}", f"stable-offsets-group-{run}"


@pytest.fixture
async def topic(kafka_bootstrap: str, names: tuple[str, str]) -> AsyncIterator[TopicPartition]:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(names[0], 2, 1)])
    finally:
        await admin.close()
    yield TopicPartition(names[0], 0)


def _producer(bootstrap: str) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"stable-{uuid.uuid4().hex}"})
    producer.init_transactions(TIMEOUT_S)
    return producer


def _pending(producer: Producer, group: str, tp: TopicPartition, offset: int) -> None:
    """Open a transaction holding ``offset`` for ``group`` (TxnOffsetCommit acknowledged), left open."""
    producer.begin_transaction()
    producer.send_offsets_to_transaction(
        [RdTopicPartition(tp.topic, tp.partition, offset)], group_metadata(group), TIMEOUT_S
    )


async def _plain_committed(bootstrap: str, group: str, tp: TopicPartition) -> int | None:
    """aiokafka's OffsetFetch (no require_stable), as the pod read offsets before."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        return await consumer.committed(tp)
    finally:
        await consumer.stop()


async def _until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` (a broker's answer), up to the test's timeout: a wait, not a verdict."""
    async with asyncio.timeout(TIMEOUT_S):
        while not condition():
            await asyncio.sleep(0.02)


async def test_no_offset_is_read_while_a_transaction_holds_the_groups_offsets(
    kafka_bootstrap: str, names: tuple[str, str], topic: TopicPartition, tmp_path: Path
) -> None:
    group = names[1]
    other = TopicPartition(topic.topic, 1)
    config = txn_producer_config(pod_config(load_settings(unique_env(kafka_bootstrap, tmp_path))))
    reader = StableOffsets(config, group, timeout_s=TIMEOUT_S)
    producer = _producer(kafka_bootstrap)
    try:
        assert await reader.read([topic, other]) == [None, None]  # nothing committed: None, not unstable

        _pending(producer, group, topic, 5)
        # The premise: a plain read answers at once with what was there before the transaction.
        assert await _plain_committed(kafka_bootstrap, group, topic) is None
        with pytest.raises(Unstable):
            await reader.read_once([topic])
        waiting = asyncio.ensure_future(reader.read([topic, other]))
        await _until(lambda: reader.asked_again > 0 or waiting.done())
        assert not waiting.done()  # told to ask again, still asking: no answer while pending
        await asyncio.to_thread(producer.commit_transaction, TIMEOUT_S)
        assert await asyncio.wait_for(waiting, TIMEOUT_S) == [5, None]

        _pending(producer, group, topic, 9)  # an aborted transaction's offsets never show
        with pytest.raises(Unstable):
            await reader.read_once([topic])
        assert await _plain_committed(kafka_bootstrap, group, topic) == 5
        await asyncio.to_thread(producer.abort_transaction, TIMEOUT_S)
        assert await asyncio.wait_for(reader.read([topic]), TIMEOUT_S) == [5]
    finally:
        producer.flush(0)
