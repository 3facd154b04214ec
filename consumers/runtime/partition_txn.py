"""What one partition's transaction holds: driver results folded back, then the records decided.

Writes are staged in an overlay and reach the state store only once the pod has committed the
transaction, so an aborted or failed one leaves memory equal to the topic. The transaction is
filled here and committed (or failed) by :class:`consumers.runtime.pod.Pod`.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from consumers.lanes.commands import Command, Outcome, StateView
from consumers.lanes.outbox import new_effects
from consumers.runtime import tracing
from consumers.runtime.create_order import CreateOrderGate
from consumers.runtime.dead_letters import (
    Provenance,
    ahead_of_pod_reason,
    bare_dead_letter,
    dead_letter_record,
    unparsable_dead_letter,
)
from consumers.runtime.effects import Completion
from consumers.runtime.kafka.failures import oversize_reason
from consumers.runtime.kafka.sink import BatchSink
from consumers.runtime.kafka.unparsable import Doom, RecordRef, record_ref
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.pod_config import PodConfig, PodStats
from consumers.runtime.processor import LaneProcessor
from consumers.runtime.state.interface import StateStoreFault
from consumers.runtime.state.store import StateStore
from events import schema_registry
from events.codec import (
    TYPE_PREFIX,
    CapacityRecord,
    DecidedEvent,
    DecodeError,
    decode_answer,
    decode_input,
    encode,
    state_key,
    type_name,
)
from events.sandbox_lanes.v1 import capacity_pb2, inputs_pb2, state_pb2

logger = logging.getLogger("sandbox_lanes.pod")

Records = list[ConsumerRecord[bytes, bytes]]


#: How the pod's own reason for a record whose transaction kept failing starts.
TRANSACTION_FAILED = "its transaction failed "


def _decode_class(reason: str) -> str:
    """The metric's class of a codec refusal."""
    if "on a topic that carries" in reason:
        return "wrong_topic"
    if reason.startswith("meta.occurred_at is") and "ahead of" in reason:
        return "clock_ahead"
    return "undecodable"


def _ahead_of_now(event: DecidedEvent) -> float | None:
    """Seconds the input's ``occurred_at`` is ahead of the pod's clock now (None: not stamped)."""
    if not event.meta.HasField("occurred_at"):
        return None
    at = event.meta.occurred_at
    return at.seconds + at.nanos / 1e9 - time.time()


class PartitionTransaction:
    """One partition's transaction in the making: the overlay, the offsets, what to do once committed."""

    def __init__(
        self,
        partition: int,
        sink: BatchSink,
        *,
        config: PodConfig,
        processor: LaneProcessor,
        store: StateStore,
        stats: PodStats,
        metrics: PodMetrics,
        gate: CreateOrderGate,
        consumer: AIOKafkaConsumer,
        stopping: asyncio.Event,
        touch: Callable[[], None],
        doomed: Mapping[RecordRef, Doom] | None = None,
        limit: int | None = None,
    ) -> None:
        self.partition = partition
        self.sink = sink
        self.config = config
        self.processor = processor
        self.store = store
        self.stats = stats
        self.metrics = metrics
        self.gate = gate
        self.consumer = consumer
        self.stopping = stopping
        #: Marks the pod's loop alive (a long batch is progress too).
        self.touch = touch
        #: Records to dead-letter without deciding them, with the reason: ones the Kafka client
        #: could not parse (placeholders), and ones whose transactions kept failing the same way.
        self.doomed: Mapping[RecordRef, Doom] = doomed or {}
        #: Records decided at most (None = all fetched): a partition whose transactions fail the
        #: same way is retried one record at a time, so the failure names its record.
        self.limit = limit
        #: The records this transaction decided or dead-lettered, in order (deferred ones too).
        self.attempted: list[ConsumerRecord[bytes, bytes]] = []
        #: How many of them were applied (not deferred): what ``limit`` counts, so a record the
        #: create-order gate holds back never uses up a small step.
        self.stepped = 0
        #: Staged writes; None = a tombstone (the key's state removed).
        self.overlay: dict[str, state_pb2.ExecutionState | None] = {}
        #: What the store held for each key this transaction read from it (None: not held): what its
        #: write replaces, so the store need not read it again (the prior hint).
        self.prior: dict[str, state_pb2.ExecutionState | None] = {}
        #: Next offset per input partition, committed with the transaction.
        self.offsets: dict[TopicPartition, int] = {}
        self.counted: Counter[str] = Counter()
        #: Where each input partition resumes next turn (a record held back, or not reached).
        self.held: dict[TopicPartition, int] = {}
        #: Outbox entries this transaction added: submitted to the effect runner once committed.
        self.decided: list[tuple[str, str, Command]] = []
        #: Results folded back, with their outcome: metered once committed.
        self.folded: list[tuple[Completion, Outcome]] = []
        #: Tracing on: the spans (inputs, driver calls) this transaction's ``commit`` span goes under.
        self.traced: list[Any] = []

    async def commit(self) -> None:
        """Commit the transaction with its input offsets (under a ``commit`` span when tracing)."""
        active = tracing.ACTIVE
        if active is None or not self.traced:
            await self.sink.commit(self.offsets)
            return
        await active.commit(self.traced, self.partition, self.sink.commit(self.offsets))

    async def fold(self, completion: Completion) -> None:
        """One driver result back into its execution's state: the outcome event, the entry removed."""
        key = completion.key
        state = self._stored(key)
        if state is None:
            return
        active = tracing.ACTIVE if completion.trace else None
        if active is not None:
            with active.under(completion.trace):  # its log lines name the driver call's span
                outcome = self.processor.complete(
                    state, completion.effect_id, completion.command, completion.result
                )
        else:
            outcome = self.processor.complete(
                state, completion.effect_id, completion.command, completion.result
            )
        if outcome.state is None:
            return  # not pending any more: completed before (this pod, or the previous owner)
        for output in outcome.outputs:
            record = encode(output, source=self.processor.config.source)
            if active is not None:  # the outcome carries the trace on to the next consumer
                topic = self.config.topics.outcomes
                headers = active.outcome_headers(completion.trace, topic, record.headers)
                record = record._replace(headers=headers)
            await self.sink.send(self.config.topics.outcomes, record)
            self.counted[type_name(output)] += 1
        if active is not None:
            self.traced.append(active.parent_of(completion.trace))
        await self._to_ledger(outcome.capacity)
        await self.sink.send(self.config.topics.state, encode(outcome.state), partition=self.partition)
        self.overlay[key] = outcome.state
        self.folded.append((completion, outcome))

    async def decide(self, batch: Mapping[TopicPartition, Records]) -> None:
        """Decide the fetched records; stopping ends early and hands the rest back (not committed)."""
        created_topic = self.config.topics.execution_created
        for tp, recs in batch.items():
            if recs:
                self.gate.fetched(tp.topic, tp.partition, recs[0].offset, recs[-1].offset)
        # The inputs are separate topics: merge the partitions by record time (creates first
        # on a tie), each partition's own order kept, so a create is applied before the phase
        # changes produced after it even when one fetch returned both.
        merged = heapq.merge(
            *(
                [((rec.timestamp, tp.topic != created_topic), i, tp, rec) for rec in recs]
                for i, (tp, recs) in enumerate(batch.items())
            ),
            key=lambda item: (item[0], item[1]),
        )
        for _, _, tp, rec in merged:
            if self.stopping.is_set() or (self.limit is not None and self.stepped >= self.limit):
                break
            if tp in self.held:
                continue
            self.attempted.append(rec)
            active = tracing.ACTIVE
            if active is None:
                deferred = await self._record(rec)
            else:
                with active.input(rec):
                    deferred = await self._record(rec)
                    if not deferred:
                        self.traced.append(active.current_context())
            if deferred:
                self.held[tp] = rec.offset  # deferred: this partition resumes here next turn
                continue
            self.stepped += 1
            self.offsets[tp] = rec.offset + 1
            if tp.topic == created_topic:
                self.gate.applied(self.partition, rec.offset, rec.timestamp, rec.headers)
        for tp, records in batch.items():
            if tp in self.held:
                continue
            if tp not in self.offsets:
                self.held[tp] = records[0].offset  # not reached (stopping, limit): handed back
            elif self.offsets[tp] <= records[-1].offset:
                self.held[tp] = self.offsets[tp]  # reached part-way (limit): resumes after the last

    async def _record(self, rec: ConsumerRecord[bytes, bytes]) -> bool:
        """Decide one record; True = deferred (not applied, the partition resumes at it later)."""
        self.touch()
        doomed = self.doomed.get(record_ref(rec))
        if doomed is not None:
            failed = doomed.reason.startswith(TRANSACTION_FAILED)
            await self._dead_letter(
                rec,
                doomed.reason,
                "transaction_failed" if failed else "unparsable",
                unparsable=doomed.unparsable,
                bare=doomed.bare,
                doom=doomed,
            )
            return False
        await schema_registry.ensure(rec.value)  # a framed input's schema id, looked up once (cached)
        answer = rec.topic == self.config.topics.admissions  # the capacity ledger's, the pod's own
        event: DecidedEvent
        try:
            if answer:
                event = decode_answer(rec.key, rec.value, rec.headers)
            else:
                event = decode_input(
                    rec.key,
                    rec.value,
                    rec.headers,
                    record_time_ms=rec.timestamp,
                    max_ahead_s=self.config.max_clock_ahead_s,
                    topic_carries=self.config.topics.carries(rec.topic),
                )
        except DecodeError as exc:
            await self._dead_letter(rec, exc.reason, _decode_class(exc.reason), error=exc)
            return False
        ahead_s = None if answer else _ahead_of_now(event)
        if ahead_s is not None and ahead_s > self.config.max_clock_ahead_s > 0:
            # Its producer's clock runs ahead: stamped and timestamped in the future alike, it
            # passes the check against the record's timestamp, and applied it would make every
            # correct phase change after it stale. The pod's own clock is the reference here.
            await self._dead_letter(
                rec, ahead_of_pod_reason(ahead_s, self.config.max_clock_ahead_s), "clock_ahead"
            )
            return False
        if isinstance(event, inputs_pb2.SessionDeleted) and await self.gate.may_follow(self.consumer, rec):
            return True  # a create of this session produced before the delete may still be ahead
        key = state_key(event)
        stored = self._stored(key)
        active = tracing.ACTIVE
        span = active.decided() if active is not None else None
        try:
            decision = self.processor.decide(event, StateView(stored, self._stored))
        except StateStoreFault:  # the local store, not the record: the policy rebuilds it, the record waits
            if span is not None:
                span.end()
            raise
        except Exception as exc:  # a bug in the rules must not stop the pod: park the record
            if span is not None:
                span.end()
            logger.exception("record processing raised", extra={"executionId": key})
            await self._dead_letter(rec, f"internal error: {exc!r}", "internal", error=exc)
            return False
        if (
            decision.reject is not None
            and isinstance(event, inputs_pb2.PhaseChanged)
            and (stored is None or not stored.created)
            and await self.gate.may_follow(self.consumer, rec)
        ):
            if span is not None:
                span.end()
            return True  # its create may still be ahead on the execution-created topic
        self.gate.settled(rec)
        if active is not None and span is not None:
            active.end_decision(
                span,
                message_id=event.meta.event_id,
                event_type=event.DESCRIPTOR.name,
                key=key,
                outcome=(
                    "rejected"
                    if decision.reject is not None
                    else "duplicate"
                    if decision.duplicate
                    else "unchanged"
                    if decision.state is None
                    else "applied"
                ),
                state=decision.state,
                effect_ids=[effect_id for effect_id, _ in new_effects(decision)] if decision.state else [],
            )
        # Counted once it is applied or dead-lettered, not on every look while it is held back.
        event_type = event.DESCRIPTOR.name
        self.stats.consumed[TYPE_PREFIX + event_type] += 1
        self.metrics.consumed(event_type, rec.partition).inc()
        self.metrics.record_decision(decision, None, self.processor.config.driver_name)
        if decision.reject is not None:
            unknown = decision.reject.startswith("phase-changed for unknown execution")
            await self._dead_letter(rec, decision.reject, "unknown_execution" if unknown else "rejected")
            return False
        if decision.duplicate:
            self.stats.duplicates += 1
            self.metrics.duplicates.inc()
            logger.info("duplicate input ignored", extra={"executionId": key, "eventId": event.meta.event_id})
            return False
        if decision.state is None:
            return False
        record = encode(decision.state)
        too_large = oversize_reason("its state", record)
        if too_large is not None:
            await self._dead_letter(rec, too_large, "oversize")
            return False
        await self.sink.send(self.config.topics.state, record, partition=rec.partition)
        self.overlay[key] = decision.state
        for output in decision.outputs:  # decided without a driver call (a capacity wait, its time-out)
            await self.sink.send(
                self.config.topics.outcomes, encode(output, source=self.processor.config.source)
            )
            self.counted[type_name(output)] += 1
        await self._to_ledger(decision.capacity)
        for effect_id, command in new_effects(decision):
            self.decided.append((key, effect_id, command))
        return False

    async def _to_ledger(self, records: tuple[CapacityRecord, ...]) -> None:
        """Requests and releases to the capacity log, in this transaction: a request names this
        partition, where the ledger's answer comes back."""
        for record in records:
            if isinstance(record, capacity_pb2.CapacityRequested):
                record.partition = self.partition
            await self.sink.send(self.config.topics.capacity, encode(record), partition=0)

    async def expire(self, keys: list[str]) -> None:
        """Tombstone the states of ``keys`` (past retention): compaction then drops them."""
        for key in keys:
            await self.sink.delete(self.config.topics.state, key.encode(), partition=self.partition)
            self.overlay[key] = None

    def _stored(self, key: str) -> state_pb2.ExecutionState | None:
        """A key's state as this transaction sees it (its own writes first)."""
        if key in self.overlay:
            return self.overlay[key]
        state = self.store.get(self.partition, key)
        self.prior.setdefault(key, state)
        return state

    async def _dead_letter(
        self,
        rec: ConsumerRecord[bytes, bytes],
        reason: str,
        reason_class: str,
        *,
        unparsable: bool = False,
        bare: bool = False,
        error: BaseException | None = None,
        doom: Doom | None = None,
    ) -> None:
        """``reason_class``: one of :data:`~consumers.runtime.metrics.DEAD_LETTER_REASONS` (its label);
        ``error``: the exception that refused the record, or ``doom``: the failure it was given up for
        (none for a refusal by the rules)."""
        if doom is not None:
            why = Provenance(self.config.group_id, doom.error_class, doom.error_message, doom.attempts)
        elif error is not None:
            message = error.reason if isinstance(error, DecodeError) else str(error)
            why = Provenance(self.config.group_id, type(error).__name__, message)
        else:
            why = Provenance(self.config.group_id)
        self.stats.dead_lettered += 1
        self.metrics.dead_letters.labels(reason_class).inc()
        logger.warning(
            "record dead-lettered",
            extra={"topic": rec.topic, "partition": rec.partition, "offset": rec.offset, "reason": reason},
        )
        pod = self.config.pod_id
        if unparsable:
            record = unparsable_dead_letter(rec.topic, rec.partition, rec.offset, reason, pod, why)
        elif bare:
            record = bare_dead_letter(rec, reason, pod, why)
        else:
            record = dead_letter_record(rec, reason, pod, why)
        await self.sink.send(self.config.topics.dead_letter, record)
