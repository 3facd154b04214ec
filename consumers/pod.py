"""The stream runtime: consume inputs, run each record through the lane processor, write outcomes.

Records are processed in partition order (key = execution id, so per-execution
order holds). Writes of a batch are staged in an overlay and folded into the
state store only once the batch's outputs, state records and offsets are
committed, so an aborted or failed batch leaves memory equal to the topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
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
from events.codec import (
    MAX_PAYLOAD_BYTES,
    TYPE_PREFIX,
    DecodeError,
    EncodedRecord,
    decode_input,
    encode,
    record_key,
    type_name,
)
from events.sandbox_lanes.v1 import inputs_pb2, state_pb2

logger = logging.getLogger("sandbox_lanes.pod")

#: Part of the shutdown bound kept for closing the consumer and producer.
_CLOSE_RESERVE_S = 5.0
#: How long a phase-changed record for a not-yet-created execution waits for the co-partitioned
#: execution-created partition to catch up before it is dead-lettered (see Pod._create_may_follow).
_DEFER_UNKNOWN_S = 30.0
#: How much later than a phase change a fetch of the execution-created partition must be to vouch
#: that every create produced before that phase change is in it (producer send to broker append).
_CREATE_APPEND_MARGIN_MS = 1000


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
            for tp in revoked:
                self._pod._created_done.pop(tp.partition, None)

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
        self._stop_requested_at: float | None = None
        #: Tasks tied to the pod's life (the periodic reaper): awaited within the shutdown bound on stop.
        self.background: list[asyncio.Task[None]] = []
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._sink: BatchSink | None = None
        #: Per partition: (next offset, last record timestamp) applied on the execution-created topic.
        self._created_done: dict[int, tuple[int, int]] = {}
        self._batch_created: dict[int, tuple[int, int]] = {}
        self._deferred_since: dict[tuple[str, int, int], float] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def consumer(self) -> AIOKafkaConsumer | None:
        """The group consumer while the pod runs (for lag gauges and diagnostics)."""
        return self._consumer

    def request_stop(self) -> None:
        """SIGTERM: stop taking new records; the record in flight is finished, the batch so far committed."""
        if self._stop_requested_at is None:
            self._stop_requested_at = time.monotonic()
        self._stop.set()

    @property
    def stopping(self) -> asyncio.Event:
        """Set once a stop was requested (read-only use: background tasks wait on it)."""
        return self._stop

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
            # Right after a commit the coordinator answers ConcurrentTransactions until its markers
            # are written; aiokafka then waits retry_backoff before AddOffsetsToTxn again (100 ms
            # by default), a large share of the latency of a small exactly-once batch.
            retry_backoff_ms=20,
            # A batch writes ~2 records per input; 16 KiB producer batches made sends wait on drains.
            max_batch_size=256 * 1024,
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
            await self._bounded_loop()
        finally:
            self._running = False
            await self._stop_background()
            await asyncio.wait_for(self.stop(), max(_CLOSE_RESERVE_S, self._remaining()))
            logger.info("pod stopped", extra={"podId": self.config.pod_id})

    def _remaining(self) -> float:
        """Seconds left of the shutdown bound (the whole bound while no stop was requested)."""
        if self._stop_requested_at is None:
            return self.config.shutdown_timeout_s
        return self.config.shutdown_timeout_s - (time.monotonic() - self._stop_requested_at)

    async def _bounded_loop(self) -> None:
        """The loop; once a stop is requested it gets the shutdown bound (minus the close reserve).

        Past the bound the work in flight is cancelled: its transaction is aborted (at-least-once:
        its offsets are not committed), so the next owner of the partition re-runs it.
        """
        loop = asyncio.ensure_future(self._loop())
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({loop, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not loop.done():
                await asyncio.wait({loop}, timeout=max(0.0, self._remaining() - _CLOSE_RESERVE_S))
            if not loop.done():
                logger.warning(
                    "shutdown bound reached, handing the work in flight back",
                    extra={"podId": self.config.pod_id, "boundSeconds": self.config.shutdown_timeout_s},
                )
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
                return
            loop.result()
        finally:
            stopper.cancel()
            if not loop.done():
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await loop

    async def _stop_background(self) -> None:
        self._stop.set()  # background tasks end on the stop signal too (also when the loop raised)
        pending = [t for t in self.background if not t.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=max(0.0, self._remaining() - _CLOSE_RESERVE_S))
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=_CLOSE_RESERVE_S)

    async def restore(self, partitions: set[int]) -> None:
        """Rebuild the state of ``partitions`` not yet held; no record of theirs is processed before."""
        async with self._restore_lock:
            self._restoring = True
            try:
                await self._restore_missing(partitions)
            finally:
                self._restoring = False
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
            self.metrics.state_keys.set(len(self.store))

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
        held: dict[TopicPartition, int] = {}
        self._batch_created = dict(self._created_done)
        created_topic = self.config.topics.execution_created
        await self._sink.begin()
        try:
            # The inputs are separate topics: merge a batch's partitions by record time (creates
            # first on a tie), each partition's own order kept, so a create is applied before the
            # phase changes produced after it even when one fetch returned both.
            merged = heapq.merge(
                *(
                    [((rec.timestamp, tp.topic != created_topic), i, tp, rec) for rec in recs]
                    for i, (tp, recs) in enumerate(batch.items())
                ),
                key=lambda item: (item[0], item[1]),
            )
            for _, _, tp, rec in merged:
                if self._stop.is_set():
                    break  # stopping: commit what is done, hand the rest back (not committed)
                if tp in held:
                    continue
                if await self._process_record(rec, overlay, counted):
                    held[tp] = rec.offset  # deferred: this partition resumes here next batch
                    continue
                offsets[tp] = rec.offset + 1
                if tp.topic == created_topic:
                    self._batch_created[tp.partition] = (rec.offset + 1, rec.timestamp)
            await self._sink.commit(offsets)
        except asyncio.CancelledError:
            # The shutdown bound cancelled the batch: abort so nothing of it becomes visible.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._sink.abort())
            raise
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
        self._created_done = self._batch_created
        for tp, offset in held.items():
            with contextlib.suppress(Exception):
                self._consumer.seek(tp, offset)
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
    ) -> bool:
        """Process one record; True = deferred (not applied, the partition resumes at it later)."""
        assert self._sink is not None
        # A batch of slow driver calls is progress, not a stall: the heartbeat moves per record.
        self._last_loop = time.monotonic()
        topics = self.config.topics
        try:
            event = decode_input(rec.key, rec.value, rec.headers)
        except DecodeError as exc:
            await self._dead_letter(rec, exc.reason)
            return False
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
            return False
        decision = processed.decision
        if (
            decision.reject is not None
            and isinstance(event, inputs_pb2.PhaseChanged)
            and (stored is None or not stored.created)
            and await self._create_may_follow(rec)
        ):
            return True  # its create may still be ahead on the execution-created topic
        self._deferred_since.pop((rec.topic, rec.partition, rec.offset), None)
        # Counted once it is applied or dead-lettered, not on every look while it is held back.
        event_type = event.DESCRIPTOR.name
        self.stats.consumed[TYPE_PREFIX + event_type] += 1
        self.metrics.consumed(event_type).inc()
        self.metrics.record_decision(decision, processed.outcome, self.processor.config.driver_name)
        if decision.reject is not None:
            await self._dead_letter(rec, decision.reject)
            return False
        if decision.duplicate:
            self.stats.duplicates += 1
            self.metrics.duplicates.inc()
            logger.info("duplicate input ignored", extra={"executionId": key, "eventId": event.meta.event_id})
            return False
        outcome = processed.outcome
        if outcome is None or outcome.state is None:
            return False
        for output in outcome.outputs:
            await self._sink.send(topics.outcomes, encode(output, source=self.processor.config.source))
            counted[type_name(output)] += 1
        await self._sink.send(topics.state, encode(outcome.state), partition=rec.partition)
        overlay[slot] = outcome.state
        return False

    async def _create_may_follow(self, rec: ConsumerRecord[bytes, bytes]) -> bool:
        """Could the create of this phase-changed record's execution still be unapplied?

        The inputs are separate topics, so a fetch (after a restart, a rebalance, a broker
        outage: any backlog) can hand out phase changes before the creates produced earlier on
        the co-partitioned execution-created partition. Such a record waits while that partition
        has unapplied records older than it; only then (or after ``_DEFER_UNKNOWN_S``) is it a
        dead letter.
        """
        assert self._consumer is not None
        created = TopicPartition(self.config.topics.execution_created, rec.partition)
        if created not in self._consumer.assignment():
            return False
        now = time.monotonic()
        if len(self._deferred_since) > 100_000:
            self._deferred_since.clear()
        first = self._deferred_since.setdefault((rec.topic, rec.partition, rec.offset), now)
        if now - first > _DEFER_UNKNOWN_S:
            return False
        done = self._batch_created.get(rec.partition)
        if done is None:
            committed = await self._consumer.committed(created)
            done = (committed if committed is not None and committed >= 0 else 0, -1)
            self._batch_created[rec.partition] = done
        next_offset, last_timestamp = done
        if last_timestamp > rec.timestamp:
            return False  # every create produced before this record has been applied (same ms: maybe not)
        highwater = self._consumer.highwater(created)
        if highwater is None or next_offset < highwater:
            return True
        # Caught up to the highwater of the last fetch of that partition: but that fetch may predate
        # this record's create (each partition is fetched on its own schedule). Trust it only when
        # it came well after this record was produced.
        polled = self._consumer.last_poll_timestamp(created)
        return polled is None or polled <= rec.timestamp + _CREATE_APPEND_MARGIN_MS

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
        value = rec.value or b""
        if len(value) > MAX_PAYLOAD_BYTES:
            # Over the limit it cannot be produced again (the producer and the broker refuse it, so
            # the batch would rewind forever): the dead letter points at the original instead.
            headers.append(("dlq_value_omitted", str(len(value)).encode()))
            value = b""
        await self._sink.send(
            self.config.topics.dead_letter,
            EncodedRecord(key=rec.key or b"", value=value, headers=headers),
        )
