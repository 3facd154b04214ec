"""The stream runtime: consume inputs, run each record through the lane processor, write outcomes.

Records are processed in partition order (key = execution id, so per-execution
order holds). Writes of a batch are staged in an overlay and folded into the
state store only once the batch's outputs, state records and offsets are
committed, so an aborted or failed batch leaves memory equal to the topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from consumers.metrics import PodMetrics
from consumers.processor import LaneProcessor
from consumers.rules import StateView
from consumers.sink import BatchSink, Guarantee
from consumers.state_store import StateStore
from consumers.topology import Topics, ensure_topics
from events.codec import DecodeError, EncodedRecord, decode_input, encode, record_key, type_name
from events.sandbox_lanes.v1 import state_pb2

logger = logging.getLogger("sandbox_lanes.pod")


@dataclass(frozen=True)
class PodConfig:
    bootstrap: str
    group_id: str = "sandbox-lanes"
    topics: Topics = field(default_factory=Topics)
    partitions: int = 3
    replication: int = 1
    guarantee: Guarantee = "exactly_once"
    sequential_produce: bool = False
    pod_id: str = field(default_factory=socket.gethostname)
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_batch: int = 500
    poll_timeout_ms: int = 200
    shutdown_timeout_s: float = 30.0
    transaction_timeout_ms: int = 15_000
    create_topics: bool = True

    @property
    def transactional_id(self) -> str:
        return f"{self.group_id}-{self.pod_id}"


@dataclass
class PodStats:
    consumed: Counter[str] = field(default_factory=Counter)
    outputs: Counter[str] = field(default_factory=Counter)
    dead_lettered: int = 0
    duplicates: int = 0
    batches: int = 0
    commit_failures: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    restored_keys: int = 0
    restore_seconds: float = 0.0


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, pod: Pod) -> None:
        self._pod = pod

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        async with self._pod.batch_lock:
            self._pod.store.drop({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._pod.restore({tp.partition for tp in assigned})


@dataclass(frozen=True)
class Health:
    """What /healthz and /readyz report."""

    alive: bool
    ready: bool
    restoring: bool
    assigned_partitions: int
    seconds_since_loop: float
    detail: str


class Pod:
    def __init__(
        self, config: PodConfig, processor: LaneProcessor, metrics: PodMetrics | None = None
    ) -> None:
        self.config = config
        self.processor = processor
        self.metrics = metrics or PodMetrics()
        self.store = StateStore(config.topics.state)
        self.stats = PodStats()
        self._last_loop = time.monotonic()
        self._restoring = False
        self._running = False
        self.batch_lock = asyncio.Lock()
        self._restore_lock = asyncio.Lock()
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._sink: BatchSink | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        """SIGTERM: stop taking new records; the batch in flight is finished and committed."""
        self._stop.set()

    async def start(self) -> None:
        cfg = self.config
        if cfg.create_topics:
            admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap)
            await admin.start()
            try:
                await ensure_topics(admin, cfg.topics, cfg.partitions, cfg.replication)
            finally:
                await admin.close()
        eos = cfg.guarantee == "exactly_once"
        self._producer = AIOKafkaProducer(
            bootstrap_servers=cfg.bootstrap,
            acks="all",
            enable_idempotence=eos,
            transactional_id=cfg.transactional_id if eos else None,
            transaction_timeout_ms=cfg.transaction_timeout_ms,
            linger_ms=0 if cfg.sequential_produce else 5,
        )
        await self._producer.start()
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=cfg.bootstrap,
            group_id=cfg.group_id,
            client_id=f"sandbox-lanes-{cfg.pod_id}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed" if eos else "read_uncommitted",
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            max_poll_interval_ms=300_000,
            rebalance_timeout_ms=60_000,
            # Range keeps partition N of every input topic on one member: co-partitioned with the state.
            partition_assignment_strategy=(RangePartitionAssignor,),
        )
        await self._consumer.start()
        self._consumer.subscribe(list(cfg.topics.inputs), listener=_Rebalance(self))
        self._sink = BatchSink(
            self._producer, self._consumer, cfg.group_id, cfg.guarantee, sequential=cfg.sequential_produce
        )
        logger.info(
            "pod started",
            extra={"podId": cfg.pod_id, "guarantee": cfg.guarantee, "groupId": cfg.group_id},
        )

    async def stop(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.stop()
        self._consumer = self._producer = None

    async def run(self) -> None:
        """Start, process until stop is requested, then finish the batch in flight and close."""
        await self.start()
        self._running = True
        try:
            await self._loop()
        finally:
            self._running = False
            await asyncio.wait_for(self.stop(), self.config.shutdown_timeout_s)
            logger.info("pod stopped", extra={"podId": self.config.pod_id})

    async def restore(self, partitions: set[int]) -> None:
        """Rebuild the state of ``partitions`` not yet held; no record of theirs is processed before."""
        async with self._restore_lock:
            self._restoring = True
            try:
                await self._restore_missing(partitions)
            finally:
                self._restoring = False
        self.metrics.state_keys.set(len(self.store))
        self.ready.set()

    def health(self, stall_after_s: float = 30.0) -> Health:
        """Alive: the loop turned within ``stall_after_s``. Ready: alive, state restored, partitions held."""
        since = time.monotonic() - self._last_loop
        alive = self._running and since < stall_after_s
        assigned = len(self._consumer.assignment()) if self._consumer is not None else 0
        ready = alive and not self._restoring and self.ready.is_set() and assigned > 0
        if not self._running:
            detail = "not running"
        elif not alive:
            detail = f"loop stalled for {since:.1f}s"
        elif self._restoring:
            detail = "restoring state"
        elif assigned == 0:
            detail = "no partitions assigned"
        else:
            detail = "ok"
        return Health(alive, ready, self._restoring, assigned, since, detail)

    async def _restore_missing(self, partitions: set[int]) -> None:
        missing = partitions - self.store.owned()
        if missing:
            report = await self.store.restore(
                self.config.bootstrap,
                missing,
                isolation_level="read_committed"
                if self.config.guarantee == "exactly_once"
                else "read_uncommitted",
            )
            self.stats.restored_keys += report.keys
            self.stats.restore_seconds += report.seconds
            self.metrics.restored_keys.inc(report.keys)
            self.metrics.restore_seconds.set(report.seconds)

    # --- the loop ----------------------------------------------------------------------------

    async def _loop(self) -> None:
        assert self._consumer is not None
        while not self._stop.is_set():
            getmany = asyncio.ensure_future(
                self._consumer.getmany(
                    timeout_ms=self.config.poll_timeout_ms, max_records=self.config.max_batch
                )
            )
            stopper = asyncio.ensure_future(self._stop.wait())
            done, _ = await asyncio.wait({getmany, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if getmany not in done:
                getmany.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await getmany
                break
            fetched: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = getmany.result()
            self._last_loop = self.stats.last_progress = time.monotonic()
            # Records can arrive while the assignment callback is still restoring, or for a
            # partition revoked meanwhile: keep only assigned partitions, restored first.
            assigned = self._consumer.assignment()
            batch = {tp: recs for tp, recs in fetched.items() if tp in assigned and recs}
            if batch:
                await self.restore({tp.partition for tp in batch})
                async with self.batch_lock:
                    await self._process_batch(batch)

    async def _process_batch(
        self, batch: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
    ) -> None:
        assert self._sink is not None and self._consumer is not None
        started = time.monotonic()
        overlay: dict[tuple[int, str], state_pb2.ExecutionState] = {}
        offsets: dict[TopicPartition, int] = {}
        counted: Counter[str] = Counter()
        await self._sink.begin()
        try:
            for tp, records in batch.items():
                for rec in records:
                    await self._process_record(rec, overlay, counted)
                    offsets[tp] = rec.offset + 1
            await self._sink.commit(offsets)
        except Exception as exc:
            self.stats.commit_failures += 1
            self.metrics.commit_failures.inc()
            logger.error("batch failed, rewinding", extra={"error": str(exc) or type(exc).__name__})
            with contextlib.suppress(Exception):
                await self._sink.abort()
            for tp, records in batch.items():
                with contextlib.suppress(Exception):
                    self._consumer.seek(tp, records[0].offset)
            return
        for (partition, key), state in overlay.items():
            self.store.put(partition, key, state)
        self.stats.outputs.update(counted)
        self.stats.batches += 1
        for kind, n in counted.items():
            self.metrics.outputs.labels(kind.rsplit(".", 1)[-1]).inc(n)
        self.metrics.batch_seconds.observe(time.monotonic() - started)
        self.metrics.state_keys.set(len(self.store))
        for tp, off in offsets.items():
            highwater = self._consumer.highwater(tp)
            if highwater is not None:
                self.metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(max(0, highwater - off))

    async def _process_record(
        self,
        rec: ConsumerRecord[bytes, bytes],
        overlay: dict[tuple[int, str], state_pb2.ExecutionState],
        counted: Counter[str],
    ) -> None:
        assert self._sink is not None
        topics = self.config.topics
        try:
            event = decode_input(rec.key, rec.value, rec.headers)
        except DecodeError as exc:
            await self._dead_letter(rec, exc.reason)
            return
        self.stats.consumed[type_name(event)] += 1
        self.metrics.events_consumed.labels(type_name(event).rsplit(".", 1)[-1]).inc()
        key = record_key(event)
        slot = (rec.partition, key)
        stored = overlay.get(slot)
        if stored is None:
            stored = self.store.get(rec.partition, key)
        try:
            processed = await self.processor.process(event, StateView(stored))
        except Exception as exc:  # a bug in the rules must not stop the pod: park the record
            logger.exception("record processing raised", extra={"executionId": key})
            await self._dead_letter(rec, f"internal error: {exc!r}")
            return
        decision = processed.decision
        self.metrics.record_decision(decision, processed.outcome, self.processor.config.driver_name)
        if decision.reject is not None:
            await self._dead_letter(rec, decision.reject)
            return
        if decision.duplicate:
            self.stats.duplicates += 1
            self.metrics.duplicates.inc()
            logger.info("duplicate input ignored", extra={"executionId": key, "eventId": event.meta.event_id})
            return
        outcome = processed.outcome
        if outcome is None or outcome.state is None:
            return
        for output in outcome.outputs:
            await self._sink.send(topics.outcomes, encode(output, source=self.processor.config.source))
            counted[type_name(output)] += 1
        await self._sink.send(topics.state, encode(outcome.state), partition=rec.partition)
        overlay[slot] = outcome.state

    async def _dead_letter(self, rec: ConsumerRecord[bytes, bytes], reason: str) -> None:
        assert self._sink is not None
        self.stats.dead_lettered += 1
        self.metrics.dead_letters.inc()
        logger.warning(
            "record dead-lettered",
            extra={"topic": rec.topic, "partition": rec.partition, "offset": rec.offset, "reason": reason},
        )
        headers = [
            *list(rec.headers or ()),
            ("dlq_reason", reason.encode()),
            ("dlq_source_topic", rec.topic.encode()),
            ("dlq_source_partition", str(rec.partition).encode()),
            ("dlq_source_offset", str(rec.offset).encode()),
            ("dlq_pod", self.config.pod_id.encode()),
        ]
        await self._sink.send(
            self.config.topics.dead_letter,
            EncodedRecord(key=rec.key or b"", value=rec.value or b"", headers=headers),
        )
