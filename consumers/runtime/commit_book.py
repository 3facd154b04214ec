"""After a partition's transaction: what follows its commit, and what follows its failure.

Committed: the local store follows (the transaction is durable: a store that cannot take it is
rebuilt from the topic), the positions move, the decided driver calls start, the meters move.
Failed: the records are read again and the results folded again, and the failure policy
(:mod:`consumers.runtime.failure_policy`) says what else: stand down, retake, rest, renew the
producer, small steps (one result, then one record per transaction) or give one up, rebuild the
local state. The book keeps what that needs between turns: the results to fold again, the
partitions in small steps (*suspects*), the records to dead-letter undecided (*doomed*), each
partition's rest.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiokafka import ConsumerRecord, TopicPartition

from consumers.lanes.commands import CommandResult, Ensure
from consumers.runtime.create_order import CreateOrderGate
from consumers.runtime.effects import Completion, EffectRunner
from consumers.runtime.failure_policy import Action, Fault, History, Site, classify, decide
from consumers.runtime.kafka.sink import BatchSink
from consumers.runtime.kafka.unparsable import Doom, RecordRef, record_ref
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.ownership import Ownership
from consumers.runtime.partition_txn import TRANSACTION_FAILED, PartitionTransaction
from consumers.runtime.pod_config import PodConfig, PodStats
from consumers.runtime.processor import LaneProcessor
from consumers.runtime.state.interface import StateStoreFault
from resilience.episode import Episode, describe

logger = logging.getLogger("sandbox_lanes.pod")

Records = list[ConsumerRecord[bytes, bytes]]
#: A driver result that could not be folded back, recorded as a failure of its call instead.
_UNRECORDABLE = "its result could not be recorded ({attempts} attempts): {error}"
_RESULTS = "results"


@dataclass
class Suspect:
    """A partition whose transaction failed the same way a retry would: retried in small steps
    until every record of the batch that failed is behind it (``until``: per input partition, the
    offset past that batch), so a bad record at position k costs one failure of the batch and
    ``dead_letter_attempts`` of its own, not k of each."""

    subject: RecordRef | str | None = None
    attempts: int = 0
    until: dict[TopicPartition, int] = field(default_factory=dict)

    def passed(self, standing: Mapping[TopicPartition, int]) -> bool:
        return all(standing.get(tp, -1) >= end for tp, end in self.until.items())


def _result_subject(effect_id: str) -> str:
    return f"{_RESULTS}:{effect_id}"


class CommitBook:
    def __init__(
        self,
        *,
        config: PodConfig,
        processor: LaneProcessor,
        ownership: Ownership,
        effects: EffectRunner,
        gate: CreateOrderGate,
        stats: PodStats,
        metrics: PodMetrics,
    ) -> None:
        self.config = config
        self.processor = processor
        self.ownership = ownership
        self.effects = effects
        self.gate = gate
        self.stats = stats
        self.metrics = metrics
        #: Results whose fold-back transaction failed: folded again next turn.
        self.retry: list[Completion] = []
        #: Records to dead-letter undecided (unparsable, or failing the same way each time).
        self.doomed: dict[RecordRef, Doom] = {}
        #: Partitions whose last transaction failed deterministically: retried in small steps.
        self.suspects: dict[int, Suspect] = {}
        #: Per partition: until when it rests after the world failed its transaction.
        self.resting: dict[int, float] = {}
        self._episodes: dict[int, Episode] = {}
        #: Effect ids whose results are being recorded as failures (their own fold kept failing).
        self._unrecordable: set[str] = set()
        #: When each effect was decided (monotonic), for the time-to-sandbox histogram.
        self._decided_at: dict[str, tuple[int, float]] = {}
        ownership.on_forget.append(self.forget)

    def forget(self, partitions: set[int]) -> None:
        for p in partitions:
            self.gate.forget(p)
            self.suspects.pop(p, None)
            self.resting.pop(p, None)
            self._episodes.pop(p, None)
        self.retry = [c for c in self.retry if c.partition not in partitions]
        self._decided_at = {e: d for e, d in self._decided_at.items() if d[0] not in partitions}
        self.doomed = {ref: d for ref, d in self.doomed.items() if ref[1] not in partitions}

    def rests(self, partition: int, now: float) -> bool:
        return self.resting.get(partition, 0.0) > now

    def step(self, partition: int, completions: list[Completion]) -> tuple[list[Completion], int | None]:
        """The part of the work a suspect partition tries this turn: one result (no records), or
        else one record; the rest of the results wait. ``(completions, limit)``."""
        if partition not in self.suspects:
            return completions, None
        if completions:
            self.retry.extend(completions[1:])
            return completions[:1], 0
        return completions, 1

    # --- committed -----------------------------------------------------------------------------

    def committed(self, txn: PartitionTransaction, started: float) -> None:
        """The transaction is durable: the store follows, its driver calls start, the meters move."""
        ownership = self.ownership
        consumer = ownership.consumer
        assert consumer is not None
        partition = txn.partition
        self.stats.max_transaction_s = max(self.stats.max_transaction_s, time.monotonic() - started)
        self.stats.commits_failing_since = None
        self.resting.pop(partition, None)
        episode = self._episodes.get(partition)
        if episode is not None:
            episode.recovered()
        self.gate.committed(partition)
        for tp, offset in txn.offsets.items():
            ownership.positions.stand_at(tp, offset)
        for tp, offset in txn.held.items():
            ownership.positions.stand_at(tp, offset, seek=True)
        try:
            ownership.store.apply(
                partition,
                txn.overlay,
                txn.sink.written(self.config.topics.state, partition),
                prior=txn.prior,
            )
        except Exception as exc:
            fault = classify(exc) if isinstance(exc, StateStoreFault) else Fault.WORLD
            if decide(Site.STORE_APPLY, fault).action is Action.REBUILD:
                reason = exc.reason if isinstance(exc, StateStoreFault) else "write_failed"
                logger.error(
                    "a committed transaction could not be applied to the local state: rebuilding the"
                    " partition's state from the topic before its next record",
                    extra={"partition": partition, "error": describe(exc)},
                )
                ownership.rebuild(partition, reason)
        self.metrics.states_removed.inc(sum(state is None for state in txn.overlay.values()))
        for rec in txn.attempted:
            self.doomed.pop(record_ref(rec), None)
        suspect = self.suspects.get(partition)
        if suspect is not None and txn.limit != 0 and suspect.passed(ownership.positions.standing):
            del self.suspects[partition]  # every record of the batch that failed is behind it
        now = time.monotonic()
        for key, effect_id, command in txn.decided:
            if self.effects.submit(partition, key, effect_id, command):
                self._decided_at[effect_id] = (partition, now)
        driver = self.processor.config.driver_name
        for completion, outcome in txn.folded:
            self._unrecordable.discard(completion.effect_id)
            for output in outcome.outputs:
                self.metrics.record_outcome(completion.command, output, driver)
            decided = self._decided_at.pop(completion.effect_id, None)
            if decided is not None:
                operation = "ensure" if isinstance(completion.command, Ensure) else "deprovision"
                self.metrics.time_to_sandbox.labels(driver, operation).observe(now - decided[1])
        self.stats.outputs.update(txn.counted)
        self.stats.batches += 1
        for kind, n in txn.counted.items():
            self.metrics.outputs.labels(kind.rsplit(".", 1)[-1]).inc(n)
        self.metrics.batch_seconds.observe(now - started)
        self.metrics.state_keys.set(len(ownership.store))
        assignment = consumer.assignment()
        for tp, off in txn.offsets.items():
            if tp not in assignment:
                continue  # revoked meanwhile (a rejoin): no lag of ours to report
            highwater = consumer.highwater(tp)
            if highwater is not None:
                self.metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(max(0, highwater - off))

    # --- failed --------------------------------------------------------------------------------

    async def failed(
        self,
        txn: PartitionTransaction,
        sink: BatchSink,
        batch: Mapping[TopicPartition, Records],
        completions: list[Completion],
        exc: Exception,
    ) -> None:
        """A transaction failed: its records are read again, its results folded again, and the
        failure policy's answer carried out."""
        partition = txn.partition
        self.stats.commit_failures += 1
        self.metrics.commit_failures.inc()
        self.stats.last_commit_failure = time.monotonic()
        if self.stats.commits_failing_since is None:
            self.stats.commits_failing_since = self.stats.last_commit_failure
        error = describe(exc)
        self.ownership.positions.seek_to_first(batch)
        if classify(exc) is not Fault.FENCED and not sink.abandoned:
            with contextlib.suppress(Exception):
                await sink.abort()
        fault = classify(exc, abandoned=sink.abandoned)
        history = self._history(txn, completions) if fault is Fault.RECORD else History()
        decision = decide(Site.TRANSACTION, fault, history, exactly_once=sink.guarantee == "exactly_once")
        action = decision.action
        if action is Action.STAND_DOWN:
            await self.ownership.stand_down(partition, error)
            return
        if action is Action.RETAKE:
            # The results are void; the restored outbox re-runs them.
            await self.ownership.retake(partition, error)
            return
        if action is Action.REBUILD:
            reason = exc.reason if isinstance(exc, StateStoreFault) else "read_failed"
            logger.error(
                "the local state failed a transaction: rebuilding the partition's state from the topic",
                extra={"partition": partition, "error": error},
            )
            self.ownership.rebuild(partition, reason)
            self.retry.extend(completions)
            return
        if action is Action.REST:
            self.resting[partition] = time.monotonic() + self._episode(partition).failed(exc)
        else:  # small steps, or give one up
            logger.error(
                "transaction failed, rewinding",
                extra={"partition": partition, "error": error, "deterministic": True, "action": str(action)},
            )
        if decision.renew_producer:
            # A batch the broker refused leaves the producer's sequence numbers behind the
            # broker's; a new producer (InitProducerId: a new epoch) starts them afresh.
            await self.ownership.renew(partition)
        if action in (Action.ONE_RECORD, Action.DEAD_LETTER):
            give_up = action is Action.DEAD_LETTER
            completions = self._isolate(
                txn, batch, completions, error, give_up=give_up, error_class=type(exc).__name__
            )
        self.retry.extend(completions)

    def _episode(self, partition: int) -> Episode:
        episode = self._episodes.get(partition)
        if episode is None:
            episode = Episode("the partition's transaction", logger, extra={"partition": partition})
            self._episodes[partition] = episode
        return episode

    def _subject(self, txn: PartitionTransaction, completions: list[Completion]) -> RecordRef | str | None:
        """The one step a failed transaction was (a result, a record), or None for a batch."""
        first_of_a_batch = txn.partition not in self.suspects and len(txn.attempted) + len(completions) > 1
        if first_of_a_batch:
            return None  # the small steps will tell which part fails
        if completions and not txn.attempted:
            return _result_subject(completions[0].effect_id) if len(completions) == 1 else None
        # The last record it attempted: the one it failed on (those before it were deferred).
        return record_ref(txn.attempted[-1]) if txn.attempted else None

    def _history(self, txn: PartitionTransaction, completions: list[Completion]) -> History:
        """This deterministic failure counted against its step, for the policy."""
        suspect = self.suspects.get(txn.partition)
        subject = self._subject(txn, completions)
        attempts = 0
        if subject is not None:
            same = suspect is not None and subject == suspect.subject
            attempts = suspect.attempts + 1 if same and suspect is not None else 1
        return History(same_subject_attempts=attempts, dead_letter_attempts=self.config.dead_letter_attempts)

    def _isolate(
        self,
        txn: PartitionTransaction,
        batch: Mapping[TopicPartition, Records],
        completions: list[Completion],
        error: str,
        *,
        give_up: bool,
        error_class: str = "",
    ) -> list[Completion]:
        """Small steps from here (the first such failure marks the partition a suspect until the
        whole failed batch is behind it); ``give_up``: the step failed N times the same way: a
        record is dead-lettered by the next transaction (with this error as the reason), a result
        is recorded as a failure of its driver call (so its state can finish), and only when even
        that cannot be written is it dropped (counted, logged with its effect id). Returns the
        results to fold again."""
        subject = self._subject(txn, completions)
        suspect = self.suspects.get(txn.partition)
        if suspect is None:
            suspect = self.suspects[txn.partition] = Suspect()
        for tp, records in batch.items():
            if records:
                suspect.until[tp] = max(suspect.until.get(tp, 0), records[-1].offset + 1)
        if subject is None:
            return completions  # a batch: the small steps will tell which part fails
        if subject != suspect.subject:
            suspect.subject, suspect.attempts = subject, 0
        suspect.attempts += 1
        if not give_up:
            return completions
        suspect.attempts = 0
        attempts = self.config.dead_letter_attempts
        if isinstance(subject, str):
            (completion,) = completions
            if completion.effect_id not in self._unrecordable:
                self._unrecordable.add(completion.effect_id)
                logger.error(
                    "a driver result could not be folded back: recording its call as failed instead",
                    extra={"partition": txn.partition, "effectId": completion.effect_id, "error": error},
                )
                failed = CommandResult(ok=False, error=_UNRECORDABLE.format(attempts=attempts, error=error))
                return [completion._replace(result=failed)]
            self._unrecordable.discard(completion.effect_id)
            self._decided_at.pop(completion.effect_id, None)
            self.metrics.results_dropped.inc()
            logger.error(
                "driver result dropped: neither it nor its failure could be recorded",
                extra={
                    "partition": txn.partition,
                    "attempts": attempts,
                    "error": error,
                    "effectIds": completion.effect_id,
                },
            )
            return []
        reason = f"{TRANSACTION_FAILED}{attempts} times the same way: {error}"
        doomed = self.doomed.get(subject)
        # Its dead letter failed as well (the dead-letter topic's own limit): the next one is bare.
        self.doomed[subject] = Doom(
            reason,
            unparsable=doomed.unparsable if doomed else False,
            bare=doomed is not None,
            error_class=error_class,
            error_message=error,
            attempts=attempts,
        )
        return completions
