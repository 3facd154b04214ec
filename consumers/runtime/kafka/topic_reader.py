"""Read topic partitions from the beginning up to their end offsets: state restore, replay, reap.

"The end" is taken once, when reading starts (for ``read_committed`` that is the last
stable offset), so a reader of a busy topic still finishes. Records are handed out
batch by batch, so a caller that folds them (the state restore) never holds a whole topic. A
record the client cannot parse comes as a placeholder (:func:`unparsable.is_placeholder`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from consumers.runtime.failure_policy import parse_fault
from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.unparsable import fetch_around_unparsable


async def read_to_end(
    bootstrap: str,
    partitions: Sequence[TopicPartition],
    *,
    isolation_level: str = "read_committed",
    timeout_s: float = 300.0,
    security: KafkaSecurity = PLAINTEXT,
) -> AsyncIterator[tuple[TopicPartition, list[ConsumerRecord[bytes, bytes]]]]:
    """Yield ``(partition, records)`` batches until every partition reached its end offset."""
    if not partitions:
        return
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        isolation_level=isolation_level,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 * 1024 * 1024,
        **security.client_options(),
    )
    try:
        await consumer.start()  # a failed start is stopped too (no 'Unclosed AIOKafkaConsumer')
        consumer.assign(list(partitions))
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(list(partitions))
        starts = await consumer.beginning_offsets(list(partitions))
        async for tp, kept in read_range(consumer, starts, ends, timeout_s=timeout_s):
            yield tp, kept
    finally:
        await consumer.stop()


async def read_range(
    consumer: AIOKafkaConsumer,
    starts: Mapping[TopicPartition, int],
    ends: Mapping[TopicPartition, int],
    *,
    timeout_s: float = 300.0,
) -> AsyncIterator[tuple[TopicPartition, list[ConsumerRecord[bytes, bytes]]]]:
    """Yield ``(partition, records)`` batches of an assigned ``consumer`` from ``starts`` up to (not
    including) ``ends``; a record the client cannot parse comes as a placeholder.

    ``timeout_s`` bounds how long the read may stand still (no partition's position moving), not how
    long it takes: a restore of ten million states that keeps reading is not a failure of the world
    (given up at a fixed total time, it would start again from its beginning each time, for ever)."""
    #: Where each partition's next record is (a rewind after an unparsable record goes there).
    nexts = dict(starts)
    for tp, offset in nexts.items():
        consumer.seek(tp, offset)
    pending = {tp for tp in nexts if ends[tp] > nexts[tp]}
    reached: dict[TopicPartition, int] = {}  # each partition's furthest position seen
    deadline = time.monotonic() + timeout_s

    async def rewind(tp: TopicPartition) -> None:
        consumer.seek(tp, nexts[tp])

    while pending:
        if time.monotonic() > deadline:
            topics = sorted({tp.topic for tp in pending})
            raise TimeoutError(f"reading {topics} stood still for {timeout_s:g}s before its end")
        try:
            batch = await consumer.getmany(*pending, timeout_ms=500, max_records=10_000)
        except Exception as exc:
            if not parse_fault(exc):
                raise
            # A record the client cannot parse: its place comes as a placeholder.
            batch, _ = await fetch_around_unparsable(
                consumer, sorted(pending), rewind, poll_ms=500, max_records=10_000
            )
        for tp, recs in batch.items():
            kept = [r for r in recs if r.offset < ends[tp]]
            if recs:
                nexts[tp] = recs[-1].offset + 1
            if kept:
                yield tp, kept
        for tp in list(pending):
            position = await consumer.position(tp)
            if position > reached.get(tp, -1):
                reached[tp] = position
                deadline = time.monotonic() + timeout_s  # the read moved: it is not standing still
            if position >= ends[tp]:
                pending.discard(tp)
