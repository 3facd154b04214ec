"""Where a batch's writes go, under the chosen processing guarantee.

``exactly_once``: outputs, state records, dead letters and the input offsets are
committed in one Kafka transaction (consumers read outcomes ``read_committed``).
Driver side effects are outside any transaction; they are idempotent by name,
so a batch re-run after a crash re-ensures on the fast path.

``at_least_once``: for brokers without transactions (the embedded Tansu demo
broker). Writes are awaited, then offsets are committed. A crash between the
two re-runs the batch: outputs re-appear with the SAME deterministic event ids
(``ce_id``), so downstream de-duplicates by id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Literal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from events.codec import EncodedRecord

Guarantee = Literal["exactly_once", "at_least_once"]


class BatchSink:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        consumer: AIOKafkaConsumer,
        group_id: str,
        guarantee: Guarantee,
        *,
        sequential: bool = False,
    ) -> None:
        self._producer = producer
        self._consumer = consumer
        self._group_id = group_id
        self._guarantee = guarantee
        self._sequential = sequential
        self._futures: list[asyncio.Future[object]] = []
        self._open = False

    @property
    def guarantee(self) -> Guarantee:
        return self._guarantee

    async def begin(self) -> None:
        if self._guarantee == "exactly_once":
            await self._producer.begin_transaction()
        self._open = True
        self._futures = []

    async def send(self, topic: str, record: EncodedRecord, partition: int | None = None) -> None:
        if self._sequential:
            # One record per produce request: Tansu's end offsets go wrong after multi-record batches.
            await self._producer.send_and_wait(
                topic, record.value, key=record.key, headers=record.headers, partition=partition
            )
            return
        future = await self._producer.send(
            topic, record.value, key=record.key, headers=record.headers, partition=partition
        )
        self._futures.append(future)

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Make the batch's writes durable together with the input offsets (next offset to read)."""
        if self._futures:
            await asyncio.gather(*self._futures)
            self._futures = []
        if self._guarantee == "exactly_once":
            if offsets:
                await self._producer.send_offsets_to_transaction(
                    {tp: OffsetAndMetadata(off, "") for tp, off in offsets.items()}, self._group_id
                )
            await self._producer.commit_transaction()
        elif offsets:
            await self._consumer.commit({tp: OffsetAndMetadata(off, "") for tp, off in offsets.items()})
        self._open = False

    async def abort(self) -> None:
        if not self._open:
            return
        self._open = False
        for future in self._futures:
            future.cancel()
        self._futures = []
        if self._guarantee == "exactly_once":
            await self._producer.abort_transaction()
