"""Where a partition's writes go, under the chosen processing guarantee.

``exactly_once``: one transactional producer per input partition number, with the
transactional id ``<group id>-p<N>`` (Kafka Streams' "exactly-once alpha" layout).
Partition N of every input topic and of the state topic is one unit of work
(the range assignor keeps them on one pod), and its outcomes, state records, dead
letters and input offsets are committed in one transaction of that producer. A pod
that takes partition N over initialises the producer with the same id, which
bumps its epoch: the previous owner's open transaction is aborted and anything it
tries later (a pod paused past its session timeout and resumed) fails with
``ProducerFenced``. That is the zombie fence; aiokafka's
``send_offsets_to_transaction`` takes a group id only (no KIP-447 group
metadata), so one transactional id per pod would not fence.

``at_least_once``: for brokers without transactions (the embedded Tansu demo
broker). Writes are awaited, then offsets are committed. A crash between the
two re-runs the records: outputs re-appear with the SAME deterministic event ids
(``ce_id``), so downstream de-duplicates by id.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from events.codec import EncodedRecord

Guarantee = Literal["exactly_once", "at_least_once"]


def transactional_id(group_id: str, partition: int) -> str:
    """One id per input partition number: whoever owns partition N writes as ``<group>-p<N>``."""
    return f"{group_id}-p{partition}"


class BatchSink:
    """One unit of work's writes (one partition number), committed with its input offsets."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        consumer: AIOKafkaConsumer,
        group_id: str,
        guarantee: Guarantee,
        *,
        sequential: bool = False,
    ) -> None:
        self.producer = producer
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
            await self.producer.begin_transaction()
        self._open = True
        self._futures = []

    async def send(self, topic: str, record: EncodedRecord, partition: int | None = None) -> None:
        if self._sequential:
            # One record per produce request: Tansu's end offsets go wrong after multi-record batches.
            await self.producer.send_and_wait(
                topic, record.value, key=record.key, headers=record.headers, partition=partition
            )
            return
        future = await self.producer.send(
            topic, record.value, key=record.key, headers=record.headers, partition=partition
        )
        self._futures.append(future)

    async def delete(self, topic: str, key: bytes, partition: int) -> None:
        """A tombstone for ``key`` (a null value): compaction removes the key."""
        if self._sequential:
            await self.producer.send_and_wait(topic, None, key=key, partition=partition)
            return
        self._futures.append(await self.producer.send(topic, None, key=key, partition=partition))

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Make the writes durable together with the input offsets (next offset to read)."""
        if self._futures:
            futures, self._futures = self._futures, []
            # Every result retrieved (a fenced producer fails them all), the first failure raised.
            results = await asyncio.gather(*futures, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        if self._guarantee == "exactly_once":
            try:
                if offsets:
                    await self.producer.send_offsets_to_transaction(
                        {tp: OffsetAndMetadata(off, "") for tp, off in offsets.items()}, self._group_id
                    )
                await self.producer.commit_transaction()
            except Exception:
                retrieve_transaction_error(self.producer)
                raise
        elif offsets:
            await self._consumer.commit({tp: OffsetAndMetadata(off, "") for tp, off in offsets.items()})
        self._open = False

    async def abort(self) -> None:
        if not self._open:
            return
        self._open = False
        for future in self._futures:
            if future.done():
                if not future.cancelled():
                    future.exception()  # retrieved: the abort is the answer to it
            else:
                future.cancel()
        self._futures = []
        if self._guarantee == "exactly_once":
            await self.producer.abort_transaction()


def retrieve_transaction_error(producer: AIOKafkaProducer) -> None:
    """Mark a failed transaction's own waiter as seen.

    A producer whose sender failed (fenced, or dead) sets the error on the transaction's waiter
    as well as on the call that raised it. After a fence nothing awaits that waiter (no commit or
    abort follows), and asyncio would log "Future exception was never retrieved" at ERROR when
    it is collected, for an error the pod has already handled.
    """
    manager = getattr(producer, "_txn_manager", None)
    waiter = manager.wait_for_transaction_end() if manager is not None else None
    if isinstance(waiter, asyncio.Future) and waiter.done() and not waiter.cancelled():
        waiter.exception()


class PartitionSinks:
    """The sinks of the partitions this pod owns.

    ``exactly_once``: a transactional producer per partition, opened when the partition is
    assigned (its ``init_transactions`` is the fence) and closed when it is revoked.
    ``at_least_once``: one shared idempotence-less producer.
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        group_id: str,
        guarantee: Guarantee,
        producer_options: Mapping[str, Any],
        *,
        sequential: bool = False,
    ) -> None:
        self._consumer = consumer
        self._group_id = group_id
        self._guarantee = guarantee
        self._options = dict(producer_options)
        self._sequential = sequential
        self._sinks: dict[int, BatchSink] = {}
        self._shared: AIOKafkaProducer | None = None

    async def start(self) -> None:
        if self._guarantee == "at_least_once":
            self._shared = AIOKafkaProducer(**self._options)
            await self._shared.start()

    def get(self, partition: int) -> BatchSink | None:
        return self._sinks.get(partition)

    async def open(self, partitions: Iterable[int]) -> None:
        """Sinks for newly owned partitions; for exactly_once this fences their previous writer."""
        wanted = [p for p in partitions if p not in self._sinks]
        if self._guarantee == "at_least_once":
            assert self._shared is not None
            for p in wanted:
                self._sinks[p] = self._sink(self._shared)
            return

        async def one(partition: int) -> None:
            producer = AIOKafkaProducer(
                **self._options,
                enable_idempotence=True,
                transactional_id=transactional_id(self._group_id, partition),
            )
            try:
                await producer.start()  # InitProducerId: bumps the epoch, aborts a zombie's open transaction
            except BaseException:  # failed or cancelled (revoked meanwhile): no half-open producer left
                with contextlib.suppress(Exception):
                    await asyncio.shield(producer.stop())
                raise
            self._sinks[partition] = self._sink(producer)

        await asyncio.gather(*(one(p) for p in wanted))

    def _sink(self, producer: AIOKafkaProducer) -> BatchSink:
        return BatchSink(
            producer, self._consumer, self._group_id, self._guarantee, sequential=self._sequential
        )

    async def close(self, partitions: Iterable[int]) -> None:
        gone = [self._sinks.pop(p) for p in list(partitions) if p in self._sinks]
        if self._guarantee == "exactly_once":
            for sink in gone:
                retrieve_transaction_error(sink.producer)
                with contextlib.suppress(Exception):
                    await sink.producer.stop()

    async def stop(self) -> None:
        await self.close(list(self._sinks))
        if self._shared is not None:
            with contextlib.suppress(Exception):
                await self._shared.stop()
            self._shared = None
