"""Where a partition's writes go, under the chosen processing guarantee.

``exactly_once``: one transactional producer per input partition number, with the
transactional id ``<group id>-p<N>`` (Kafka Streams' "exactly-once alpha" layout), on
librdkafka (:mod:`consumers.runtime.kafka.txn_producer`). Partition N of every input topic and of
the state topic is one unit of work (the range assignor keeps them on one pod), and its
outcomes, state records, dead letters and input offsets are committed in one transaction of
that producer. A pod that takes partition N over initialises the producer with the same id,
which bumps its epoch: the previous owner's open transaction is aborted and anything it tries
later (a pod paused past its session timeout and resumed) fails with ``ProducerFenced``.
That is the zombie fence; the offsets go in with the group id only (no KIP-447 generation),
so one transactional id per pod would not fence.

``at_least_once``: for brokers without transactions (the embedded Tansu demo broker), on
aiokafka. Writes are awaited, then offsets are committed. A crash between the two re-runs
the records: outputs re-appear with the SAME deterministic event ids (``ce_id``), so
downstream de-duplicates by id.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from consumers.runtime.kafka.txn_producer import (
    DEADLINE_GRACE_S,
    MAX_LINGERING,
    TooManyLingering,
    TxnProducer,
    group_metadata,
    lingering,
)
from consumers.runtime.loop_watch import bounded_wait
from events.codec import EncodedRecord

Guarantee = Literal["exactly_once", "at_least_once"]


def transactional_id(group_id: str, partition: int) -> str:
    """One id per input partition number: whoever owns partition N writes as ``<group>-p<N>``."""
    return f"{group_id}-p{partition}"


class BatchSink(Protocol):
    """One unit of work's writes (one partition number), committed with its input offsets."""

    @property
    def guarantee(self) -> Guarantee: ...

    async def begin(self) -> None: ...

    async def send(self, topic: str, record: EncodedRecord, partition: int | None = None) -> None: ...

    async def delete(self, topic: str, key: bytes, partition: int) -> None:
        """A tombstone for ``key`` (a null value): compaction removes the key."""

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Make the writes durable together with the input offsets (next offset to read)."""

    async def abort(self) -> None: ...

    def written(self, topic: str, partition: int) -> tuple[int, int] | None:
        """After :meth:`commit`: the offsets (first, last) of the committed transaction's records in
        ``topic`` ``partition``, when known to be all of them and contiguous; else None."""

    @property
    def abandoned(self) -> bool:
        """A broker wait outlived its deadline or an abort failed: the writer must be replaced."""


class TransactionalSink:
    """``exactly_once``: the records go to librdkafka as they are decided; the commit flushes them."""

    def __init__(self, producer: TxnProducer) -> None:
        self.producer = producer
        self._open = False

    @property
    def guarantee(self) -> Guarantee:
        return "exactly_once"

    @property
    def abandoned(self) -> bool:
        return self.producer.abandoned

    async def begin(self) -> None:
        self.producer.begin()
        self._open = True

    async def send(self, topic: str, record: EncodedRecord, partition: int | None = None) -> None:
        await self.producer.produce(topic, record.value, record.key, record.headers, partition)

    async def delete(self, topic: str, key: bytes, partition: int) -> None:
        await self.producer.produce(topic, None, key, None, partition)

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        await self.producer.commit(offsets)
        self._open = False

    def written(self, topic: str, partition: int) -> tuple[int, int] | None:
        return self.producer.written(topic, partition)

    async def abort(self) -> None:
        if not self._open:
            return
        self._open = False
        await self.producer.abort()


class AtLeastOnceSink:
    """``at_least_once`` on aiokafka: writes awaited, then the offsets committed."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        consumer: AIOKafkaConsumer,
        *,
        sequential: bool = False,
        deadline_s: float = 20.0,
    ) -> None:
        self.producer = producer
        self._consumer = consumer
        self._sequential = sequential
        #: The longest the commit waits on the broker (the writes, then the offsets).
        self._deadline_s = deadline_s
        self._futures: list[asyncio.Future[object]] = []

    @property
    def abandoned(self) -> bool:
        return False  # the shared producer outlives a failed transaction: nothing to replace

    @property
    def guarantee(self) -> Guarantee:
        return "at_least_once"

    async def begin(self) -> None:
        self._futures = []

    async def send(self, topic: str, record: EncodedRecord, partition: int | None = None) -> None:
        if self._sequential:
            # One record per produce request: Tansu's end offsets go wrong after multi-record batches.
            with bounded_wait("a record's acknowledgement", self._deadline_s):
                async with asyncio.timeout(self._deadline_s):
                    await self.producer.send_and_wait(
                        topic, record.value, key=record.key, headers=record.headers, partition=partition
                    )
            return
        # The producer's buffer full (a broker away), ``send`` waits for room: a bounded wait too.
        with bounded_wait("room in the producer's buffer", self._deadline_s):
            async with asyncio.timeout(self._deadline_s):
                future = await self.producer.send(
                    topic, record.value, key=record.key, headers=record.headers, partition=partition
                )
        self._futures.append(future)

    async def delete(self, topic: str, key: bytes, partition: int) -> None:
        if self._sequential:
            with bounded_wait("a record's acknowledgement", self._deadline_s):
                async with asyncio.timeout(self._deadline_s):
                    await self.producer.send_and_wait(topic, None, key=key, partition=partition)
            return
        with bounded_wait("room in the producer's buffer", self._deadline_s):
            async with asyncio.timeout(self._deadline_s):
                future = await self.producer.send(topic, None, key=key, partition=partition)
        self._futures.append(future)

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        waiting = bounded_wait("the writes' acknowledgements and the offsets' commit", self._deadline_s)
        with waiting:
            async with asyncio.timeout(self._deadline_s):  # a TimeoutError is the world's: retried
                if self._futures:
                    futures, self._futures = self._futures, []
                    # Every result retrieved, the first failure raised.
                    results = await asyncio.gather(*futures, return_exceptions=True)
                    for result in results:
                        if isinstance(result, BaseException):
                            raise result
                if offsets:
                    offsets_meta = {tp: OffsetAndMetadata(off, "") for tp, off in offsets.items()}
                    await self._consumer.commit(offsets_meta)

    def written(self, topic: str, partition: int) -> tuple[int, int] | None:
        return None  # no transaction: the store's checkpoint proves its way forward by reading

    async def abort(self) -> None:
        for future in self._futures:
            if future.done():
                if not future.cancelled():
                    future.exception()  # retrieved: the abort is the answer to it
            else:
                future.cancel()
        self._futures = []


class PartitionSinks:
    """The sinks of the partitions this pod owns.

    ``exactly_once``: a transactional librdkafka producer per partition, opened when the
    partition is assigned (its ``init_transactions`` is the fence) and closed when it is revoked.
    ``at_least_once``: one shared aiokafka producer.
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        group_id: str,
        guarantee: Guarantee,
        producer_options: Mapping[str, Any],
        *,
        txn_config: Mapping[str, Any] | None = None,
        transaction_timeout_s: float = 15.0,
        sequential: bool = False,
    ) -> None:
        self._consumer = consumer
        self._group_id = group_id
        self._guarantee = guarantee
        self._options = dict(producer_options)
        self._txn_config = dict(txn_config or {})
        self._timeout_s = transaction_timeout_s
        self._sequential = sequential
        self._sinks: dict[int, BatchSink] = {}
        self._shared: AIOKafkaProducer | None = None
        self._metadata: object = None

    async def start(self) -> None:
        if self._guarantee == "at_least_once":
            self._shared = AIOKafkaProducer(**self._options)
            await self._shared.start()
            return
        self._metadata = group_metadata(self._group_id)

    def get(self, partition: int) -> BatchSink | None:
        return self._sinks.get(partition)

    async def open(self, partitions: Iterable[int]) -> None:
        """Sinks for newly owned partitions; for exactly_once this fences their previous writer."""
        wanted = [p for p in partitions if p not in self._sinks]
        if self._guarantee == "at_least_once":
            assert self._shared is not None
            for p in wanted:
                self._sinks[p] = AtLeastOnceSink(
                    self._shared,
                    self._consumer,
                    sequential=self._sequential,
                    deadline_s=self._timeout_s + DEADLINE_GRACE_S,
                )
            return

        waiting = lingering()
        if wanted and waiting >= MAX_LINGERING:
            raise TooManyLingering(
                f"{waiting} closed producers are still stuck in broker waits: not opening another yet"
            )

        async def one(partition: int) -> TxnProducer:
            producer = TxnProducer(
                self._txn_config,
                transactional_id(self._group_id, partition),
                self._metadata,
                timeout_s=self._timeout_s,
            )
            try:
                await producer.init()  # InitProducerId: bumps the epoch, aborts a zombie's open transaction
            except BaseException:  # failed or cancelled (revoked meanwhile): no half-open producer left
                producer.close()
                raise
            return producer

        # Every init is waited for, and only when all succeeded are the sinks kept: a sibling that
        # finished after another failed must not leave a producer behind for a partition the
        # caller then forgets (and a retry would run a second InitProducerId beside it).
        results = await asyncio.gather(*(one(p) for p in wanted), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            for r in results:
                if isinstance(r, TxnProducer):
                    r.close()
            raise failed
        for partition, producer in zip(wanted, results, strict=True):
            assert isinstance(producer, TxnProducer)
            self._sinks[partition] = TransactionalSink(producer)

    async def close(self, partitions: Iterable[int]) -> None:
        """Close the partitions' producers: off the loop, never waited on (see ``TxnProducer.close``)."""
        gone = [self._sinks.pop(p) for p in list(partitions) if p in self._sinks]
        for sink in gone:
            if isinstance(sink, TransactionalSink):
                sink.producer.close()

    async def stop(self) -> None:
        await self.close(list(self._sinks))
        if self._shared is not None:
            with contextlib.suppress(Exception):
                await self._shared.stop()
            self._shared = None
