"""Reading a topic to its end (state restore, replay, reap) gives up only when the read stands still, not
after a fixed total time: a restore of millions of states that keeps moving finishes (issue 45: a 10M
restore given up at 300 s in all started again from empty each time, and never finished)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from consumers.runtime.kafka.topic_reader import read_range, read_to_end

pytestmark = [pytest.mark.kafka]

PARTITIONS = 3
PER_PARTITION = 30
#: 30 records of 200 KB a partition: more than a fetch brings of one (4 MiB), so the read takes turns
VALUE = b"x" * 200_000


async def _topic(bootstrap: str) -> str:
    name = f"reader-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=PARTITIONS, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=1_048_576)
    await producer.start()
    try:
        for p in range(PARTITIONS):
            for i in range(PER_PARTITION):
                await producer.send(name, VALUE, key=f"{p}-{i}".encode(), partition=p)
        await producer.flush()
    finally:
        await producer.stop()
    return name


def test_a_read_that_keeps_moving_finishes_past_its_time_limit(kafka_bootstrap: str) -> None:
    async def main() -> tuple[int, float]:
        name = await _topic(kafka_bootstrap)
        tps = [TopicPartition(name, p) for p in range(PARTITIONS)]
        began, read = time.monotonic(), 0
        # each batch is folded slowly (0.4 s: a big restore's writes), the limit is 0.5 s: the read
        # takes several fetches, in all well past the limit, but it never stands still
        async for _, records in read_to_end(kafka_bootstrap, tps, timeout_s=0.5):
            read += len(records)
            await asyncio.sleep(0.4)
        return read, time.monotonic() - began

    read, took = asyncio.run(main())
    assert read == PARTITIONS * PER_PARTITION
    assert took > 2.0, took  # the case: four times the limit and more


def test_a_read_that_stands_still_gives_up_after_its_limit(kafka_bootstrap: str) -> None:
    async def main() -> tuple[int, str]:
        name = await _topic(kafka_bootstrap)
        tps = [TopicPartition(name, p) for p in range(PARTITIONS)]
        consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka_bootstrap, group_id=None, enable_auto_commit=False
        )
        await consumer.start()
        read = 0
        try:
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            # an end the topic never reaches: the read reads what there is, then stands still
            beyond = {tp: offset + 5 for tp, offset in ends.items()}
            with pytest.raises(TimeoutError) as raised:
                async for _, records in read_range(consumer, dict.fromkeys(tps, 0), beyond, timeout_s=1.0):
                    read += len(records)
        finally:
            await consumer.stop()
        return read, str(raised.value)

    read, error = asyncio.run(main())
    assert read == PARTITIONS * PER_PARTITION
    assert "stood still for 1s" in error, error
