"""The real Kafka broker harness works end to end with aiokafka."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

pytestmark = pytest.mark.kafka

Record = tuple[bytes, bytes, list[tuple[str, bytes]]]


async def _create_topic(bootstrap: str, configs: dict[str, str] | None = None) -> str:
    name = f"t-{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 1, 1, topic_configs=configs or {})])
    finally:
        await admin.close()
    return name


async def _consume(bootstrap: str, topic: str, count: int, **kwargs: str) -> list[Record]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False, **kwargs
    )
    await consumer.start()
    try:
        got: list[Record] = []
        while len(got) < count:
            batches = await consumer.getmany(timeout_ms=10_000, max_records=count)
            assert batches, f"timed out after {len(got)} of {count} records"
            for records in batches.values():
                got += [(r.key, r.value, list(r.headers)) for r in records]
        return got
    finally:
        await consumer.stop()


async def test_compacted_topic_round_trip(kafka_bootstrap: str) -> None:
    topic = await _create_topic(kafka_bootstrap, {"cleanup.policy": "compact"})
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for i in range(3):
            headers = [("n", b"%d" % i)]
            await producer.send_and_wait(topic, f"v{i}".encode(), key=f"k{i}".encode(), headers=headers)
    finally:
        await producer.stop()

    got = await _consume(kafka_bootstrap, topic, 3, group_id=f"g-{topic}")
    assert got == [(f"k{i}".encode(), f"v{i}".encode(), [("n", b"%d" % i)]) for i in range(3)]

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        [response] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        await admin.close()
    [resource] = response.resources
    assert resource[0] == 0, resource  # error_code
    configs = {entry[0]: entry[1] for entry in resource[4]}
    assert configs["cleanup.policy"] == "compact"


async def test_transactional_producer_read_committed(kafka_bootstrap: str) -> None:
    topic = await _create_topic(kafka_bootstrap)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"tx-{topic}")
    await producer.start()
    try:
        await producer.begin_transaction()
        await producer.send_and_wait(topic, b"aborted", key=b"k")
        await producer.abort_transaction()
        await producer.begin_transaction()
        for i in range(3):
            await producer.send(topic, f"v{i}".encode(), key=b"k")
        await producer.commit_transaction()
    finally:
        await producer.stop()

    got = await _consume(kafka_bootstrap, topic, 3, isolation_level="read_committed")
    assert [value for _, value, _ in got] == [b"v0", b"v1", b"v2"]
