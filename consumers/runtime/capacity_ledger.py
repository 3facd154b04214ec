"""The capacity ledger's owner: the one place the installation's caps are decided (issue 44).

A stream task of its own beside the pod's loop, as Kafka Streams would run a sub-topology over a
repartition topic: its own consumer group over the capacity log's one partition, so exactly one
pod of the installation owns it at a time, and its own transactional producer (one transactional
id for the installation: a new owner's InitProducerId fences the previous one, whose commits then
fail). Each turn is one transaction: the records fetched decided in log order by the pure
``lanes.admission`` (no clock, no config but the log's own ticks), the ledger's changes to its
compacted changelog, the answers to the executions' partitions of the admissions topic, and the
log's offset committed with them. A failed transaction leaves no trace: the ledger is restored
from its changelog and the records are read again.

The owner writes a ``CapacityTick`` (its clock and the caps in force) when it takes the log over
and about once a second while anything waits: time-outs and cap changes are then decisions over
the log, and ``replay`` re-derives every admission from the log alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from google.protobuf.timestamp_pb2 import Timestamp

from consumers.lanes.admission import TICK_KEY, Caps, Ledger, decide
from consumers.runtime.capacity_metrics import CapacityMetrics
from consumers.runtime.failure_policy import Fault, classify
from consumers.runtime.kafka.clients import RebalanceHooks, txn_producer_config
from consumers.runtime.kafka.topic_reader import read_to_end
from consumers.runtime.kafka.txn_producer import TxnProducer, group_metadata
from consumers.runtime.pod_config import PodConfig
from consumers.runtime.shutdown import stopped_within
from events.codec import DecodeError, EncodedRecord, decode_capacity, encode
from events.sandbox_lanes.v1 import capacity_pb2
from resilience.episode import Episode

logger = logging.getLogger("sandbox_lanes.capacity")

#: How often the owner writes its clock into the log while a create waits (time-outs' resolution).
TICK_EVERY_S = 1.0
_CLAIM_HEADERS = [("content-type", b"application/protobuf"), ("ce_type", b"sandbox_lanes.v1.CapacityClaim")]


def ledger_group(group_id: str) -> str:
    """The ledger's consumer group (and transactional id): one per installation."""
    return f"{group_id}-capacity-ledger"


def encode_claim(key: str, claim: capacity_pb2.CapacityClaim | None) -> EncodedRecord:
    """A changelog record: the claim, or a tombstone (compaction then drops the key)."""
    value = None if claim is None else claim.SerializeToString()
    return EncodedRecord(key.encode(), value, _CLAIM_HEADERS if value is not None else [])  # type: ignore[arg-type]


async def restore_ledger(
    cfg: PodConfig, caps: Caps, *, read: Callable[..., Any] = read_to_end
) -> tuple[Ledger, int]:
    """The ledger as its changelog holds it (read to its end), and how many records were read.

    The caps before the log's first tick are that tick's (as replay decides them): a changelog with
    no tick yet (nothing decided, or a first owner that failed before its tick was decided) takes
    its defaults from the log's first tick, and only a log with none yet from ``caps`` (this
    owner's, whose tick comes next)."""
    changes: dict[str, capacity_pb2.CapacityClaim | None] = {}
    count = 0
    tp = TopicPartition(cfg.topics.capacity_ledger, 0)
    async for _tp, records in read(cfg.bootstrap, [tp], security=cfg.security):
        for rec in records:
            count += 1
            key = rec.key.decode() if rec.key is not None else ""
            if rec.value is None:
                changes[key] = None
                continue
            claim = capacity_pb2.CapacityClaim()
            claim.ParseFromString(rec.value)
            changes[key] = claim
    ticked = changes.get(TICK_KEY)
    if ticked is None or not ticked.HasField("tick"):
        first = await first_tick(cfg, read=read)
        if first is not None:
            caps = Caps.of_tick(first)
    ledger = Ledger(caps)
    for key, value in changes.items():
        ledger.apply(key, value)
    return ledger, count


async def first_tick(
    cfg: PodConfig, *, read: Callable[..., Any] = read_to_end
) -> capacity_pb2.CapacityTick | None:
    """The capacity log's first tick, if it has one (read from its beginning until found)."""
    tp = TopicPartition(cfg.topics.capacity, 0)
    async for _tp, records in read(cfg.bootstrap, [tp], security=cfg.security):
        for rec in records:
            with contextlib.suppress(DecodeError):
                record = decode_capacity(rec.key, rec.value, rec.headers)
                if isinstance(record, capacity_pb2.CapacityTick):
                    return record
    return None


class CapacityLedgerTask:
    """Owns the capacity log when its group gives it the one partition; decides it turn by turn."""

    def __init__(self, cfg: PodConfig, metrics: CapacityMetrics, stop: asyncio.Event) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self._stop = stop
        self.caps = Caps(cfg.max_sandboxes, cfg.max_sandboxes_per_org, cfg.admission_timeout_s)
        self._tp = TopicPartition(cfg.topics.capacity, 0)
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: TxnProducer | None = None
        self._ledger: Ledger | None = None
        self._assigned = False
        self._next_offset: int | None = None
        self._last_tick = 0.0
        self._episode = Episode("the capacity ledger", logger, first_delay_s=0.2)

    @property
    def owned(self) -> bool:
        return self._ledger is not None

    # --- ownership -------------------------------------------------------------------------------

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        self._assigned = self._tp in assigned

    async def _on_revoked(self, _revoked: set[int]) -> None:
        self._assigned = False
        self._drop()

    def _drop(self) -> None:
        """Stand down: nothing of a transaction in flight is kept (the next owner re-reads)."""
        if self._ledger is not None:
            self.metrics.stood_down()
        self._ledger = None
        self._next_offset = None
        if self._producer is not None:
            self._producer.close()
            self._producer = None

    async def _take_over(self) -> None:
        """InitProducerId (fencing a previous owner), the ledger restored, the log's position, a tick."""
        consumer = self._consumer
        assert consumer is not None
        producer = TxnProducer(
            txn_producer_config(self.cfg),
            ledger_group(self.cfg.group_id),
            group_metadata(ledger_group(self.cfg.group_id)),
            timeout_s=self.cfg.transaction_timeout_ms / 1000,
        )
        try:
            await producer.init()
            started = time.monotonic()
            ledger, records = await restore_ledger(self.cfg, self.caps)
            committed = await consumer.committed(self._tp)
        except BaseException:
            producer.close()
            raise
        if not self._assigned:
            producer.close()
            return
        self._producer = producer
        self._ledger = ledger
        self._next_offset = committed
        if committed is not None:
            consumer.seek(self._tp, committed)
        else:  # nothing committed yet: from the log's first record (a failed first turn read on)
            await consumer.seek_to_beginning(self._tp)
        logger.info(
            "capacity ledger taken over",
            extra={
                "records": records,
                "held": ledger.held,
                "waiting": ledger.waiting,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        await self._tick(force=True)
        self._episode.recovered()

    # --- the loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Until the pod stops: join the ledger's group, own the log when given it, decide."""
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.cfg.bootstrap,
            group_id=ledger_group(self.cfg.group_id),
            client_id=f"sandbox-lanes-{self.cfg.pod_id}-capacity",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            session_timeout_ms=self.cfg.session_timeout_ms,
            heartbeat_interval_ms=self.cfg.heartbeat_interval_ms,
            **self.cfg.security.client_options(),
        )
        try:
            await self._retrying(self._consumer.start)
            hooks = RebalanceHooks(self._on_revoked, self._on_assigned)
            self._consumer.subscribe([self.cfg.topics.capacity], listener=hooks)
            while not self._stop.is_set():
                try:
                    await self._turn()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if not self._assigned:  # revoked meanwhile (its producer closed under it): no failure
                        logger.debug("capacity ledger turn ended by a revoke", extra={"error": repr(exc)})
                        self._drop()
                    elif classify(exc) is Fault.FENCED:
                        # Another pod owns the log now: stand down until the group gives it back
                        # (taking it over again at once would fence that pod in turn).
                        fenced = {"error": repr(exc)}
                        logger.warning("capacity ledger fenced: another pod owns it", extra=fenced)
                        self._assigned = False
                        self._drop()
                    else:  # the world's (or a refused write): restored from the changelog, read again
                        await self._failed(exc)
        finally:
            self._drop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._consumer.stop(), 10)

    async def _retrying(self, call: Callable[[], Awaitable[Any]]) -> None:
        while not self._stop.is_set():
            try:
                await call()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._failed(exc)

    async def _failed(self, exc: BaseException) -> None:
        delay = self._episode.failed(exc)
        if self._producer is not None and not self._producer.abandoned:
            with contextlib.suppress(Exception):
                await self._producer.abort()
        self._drop()  # restored from the changelog at the next take-over: nothing half-applied kept
        await self._pause(delay)

    async def _pause(self, seconds: float) -> None:
        await stopped_within(self._stop, seconds)

    async def _turn(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        if self._assigned and self._ledger is None:
            await self._take_over()
        fetched = await consumer.getmany(timeout_ms=200, max_records=500)  # its one partition, if assigned
        records = fetched.get(self._tp, [])
        if self._ledger is None or self._producer is None:
            return
        if records:
            await self._decide(records)
        await self._tick()
        self._meter()

    async def _decide(self, records: list[Any]) -> None:
        ledger, producer = self._ledger, self._producer
        assert ledger is not None and producer is not None
        topics = self.cfg.topics
        producer.begin()
        last = records[-1].offset
        for rec in records:
            try:
                record = decode_capacity(rec.key, rec.value, rec.headers)
            except DecodeError as exc:  # only this pod writes the log: said, and passed over
                extra = {"offset": rec.offset, "reason": exc.reason}
                logger.error("capacity log record unreadable", extra=extra)
                continue
            decision = decide(record, rec.offset, ledger)
            for key, claim in decision.changes.items():
                changed = encode_claim(key, claim)
                await producer.produce(topics.capacity_ledger, changed.value, changed.key, changed.headers, 0)
            for answer in decision.answers:
                out = encode(answer.message, source=f"sandbox-lanes/{self.cfg.pod_id}")
                await producer.produce(topics.admissions, out.value, out.key, out.headers, answer.partition)
                self._count(answer.message)
        await producer.commit({self._tp: last + 1})
        self._next_offset = last + 1
        self._episode.recovered()  # a committed transaction: the backoff starts over

    async def _tick(self, *, force: bool = False) -> None:
        """The owner's clock into the log, while anything waits (or on take-over)."""
        ledger, producer = self._ledger, self._producer
        if ledger is None or producer is None:
            return
        now = time.monotonic()
        if not force and (ledger.waiting == 0 or now - self._last_tick < TICK_EVERY_S):
            return
        at = Timestamp()
        at.GetCurrentTime()
        tick = self.caps.tick(str(uuid.uuid4()), at)
        tick.meta.source = f"sandbox-lanes/{self.cfg.pod_id}"
        record = encode(tick)
        producer.begin()
        await producer.produce(self.cfg.topics.capacity, record.value, record.key, record.headers, 0)
        await producer.commit({})
        self._last_tick = now

    def _count(self, message: Any) -> None:
        metrics = self.metrics
        if isinstance(message, capacity_pb2.CapacityAdmitted):
            metrics.admissions.inc()
            metrics.wait_seconds.observe(message.waited_s)
        elif isinstance(message, capacity_pb2.CapacityTimedOut):
            metrics.timeouts.inc()

    def _meter(self) -> None:
        ledger = self._ledger
        if ledger is None:
            return
        self.metrics.set_ledger(ledger.held, self.caps.max_sandboxes, ledger.waiting_by_org())


__all__ = ["TICK_EVERY_S", "CapacityLedgerTask", "encode_claim", "ledger_group", "restore_ledger"]
