"""The turn: fetch, then per partition number one short transaction; the loop that repeats it.

One turn takes a fetch and the driver results finished so far, and per partition number
(partition N of every input topic and of the state topic) commits one transaction: the results
folded back (outcome events, outbox entries removed) and the records decided (state with new
effects, dead letters, offsets). No transaction waits on a driver: the calls a committed decision
added start only after the commit (:class:`~consumers.runtime.commit_book.CommitBook`), and their
results come back in a later turn. A failure of the world anywhere in a turn is waited out with the
one backoff, logged once per episode (:mod:`consumers.runtime.failure_policy`); only a requested
stop ends the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from aiokafka import ConsumerRecord, TopicPartition

from consumers.runtime.backpressure import FetchThrottle
from consumers.runtime.commit_book import CommitBook
from consumers.runtime.create_order import CreateOrderGate
from consumers.runtime.effects import Completion, EffectRunner
from consumers.runtime.failure_policy import Action, Site, classify, decide, parse_fault
from consumers.runtime.kafka.sink import BatchSink
from consumers.runtime.kafka.txn_producer import lingering
from consumers.runtime.kafka.unparsable import FETCH_GRACE_S, fetch_around_unparsable
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.ownership import Ownership
from consumers.runtime.partition_txn import PartitionTransaction
from consumers.runtime.pod_config import PodConfig, PodStats
from consumers.runtime.processor import LaneProcessor
from consumers.runtime.shutdown import stopped_within
from consumers.runtime.state.interface import StateStoreFault
from resilience.episode import Episode

logger = logging.getLogger("sandbox_lanes.pod")

Records = list[ConsumerRecord[bytes, bytes]]
#: How long a fetch of one partition waits while the pod looks for a record it cannot parse: a
#: partition just sought back needs a round trip to the broker before it has records again.
_PROBE_MS = 500
#: Seconds between looks for states past their retention.
_EXPIRY_CHECK_S = 1.0


class Turns:
    def __init__(
        self,
        *,
        config: PodConfig,
        processor: LaneProcessor,
        ownership: Ownership,
        book: CommitBook,
        effects: EffectRunner,
        gate: CreateOrderGate,
        stats: PodStats,
        metrics: PodMetrics,
        stop: asyncio.Event,
        touch: Callable[[], None],
        resubscribe: Callable[[], None],
    ) -> None:
        self.config = config
        self.processor = processor
        self.ownership = ownership
        self.book = book
        self.effects = effects
        self.gate = gate
        self.stats = stats
        self.metrics = metrics
        self._stop = stop
        self._touch = touch
        #: Subscribe (again) to the inputs with the pod's rebalance hooks: a rejoin of the group.
        self._resubscribe = resubscribe
        self._throttle = FetchThrottle(config.driver_concurrency, config.max_batch)
        self._next_expiry_check = 0.0
        self._next_memory_read = 0.0
        ownership.on_fetchable = self.apply_backpressure

    # --- the loop ------------------------------------------------------------------------------

    async def _pause_for(self, seconds: float) -> None:
        await stopped_within(self._stop, seconds)

    async def loop(self) -> None:
        """Fetch and turn until a stop is requested; then drain."""
        episode = Episode("the pod's loop", logger)
        while not self._stop.is_set():
            try:
                if not await self.one_turn():
                    break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._touch()  # waiting out the world is not a stalled loop
                await self._answer_outside_a_transaction(Site.TURN, exc)
                await self._pause_for(episode.failed(exc))
                continue
            episode.recovered()
        await self.drain()

    async def _answer_outside_a_transaction(self, site: Site, exc: BaseException) -> None:
        """A failure outside a transaction: the local state's is rebuilt; the world's rests."""
        fault = classify(exc)
        if decide(site, fault).action is Action.REBUILD and isinstance(exc, StateStoreFault):
            async with self.ownership.batch_lock:
                self.ownership.rebuild(exc.partition, exc.reason)

    async def one_turn(self) -> bool:
        """One fetch and its turn; False when a stop was requested while fetching."""
        consumer = self.ownership.consumer
        assert consumer is not None
        if self.ownership.rejoin:
            self.ownership.rejoin = False
            self._resubscribe()
        # While driver calls are out, turn often enough to fold their results back promptly.
        busy = self.effects.outstanding > 0 or bool(self.book.retry)
        timeout_ms = min(10, self.config.poll_timeout_ms) if busy else self.config.poll_timeout_ms
        getmany = asyncio.ensure_future(self.fetch(timeout_ms))
        stopper = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait({getmany, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if getmany not in done:
            getmany.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await getmany
            return False
        fetched: dict[TopicPartition, Records] = getmany.result()
        self._touch()
        self.stats.last_progress = time.monotonic()
        await self.turn(fetched)
        return True

    async def fetch(self, timeout_ms: int) -> dict[TopicPartition, Records]:
        """The next fetch; past a record the client cannot parse (see :mod:`unparsable`)."""
        consumer = self.ownership.consumer
        assert consumer is not None
        try:
            # aiokafka holds a fetch for as long as the group takes to settle a new assignment (a
            # rebalance waits for every member's revocation: after an outage, for the other pods'
            # broker waits, up to the rebalance timeout). The loop does not stand still inside
            # it: past its timeout the fetch is let go (nothing was taken from the buffer yet) and
            # the loop turns without records, folding results back and answering a stop.
            fetched: dict[TopicPartition, Records] = await asyncio.wait_for(
                consumer.getmany(timeout_ms=timeout_ms, max_records=self.config.max_batch),
                timeout_ms / 1000 + FETCH_GRACE_S,
            )
            return fetched
        except TimeoutError:
            return {}
        except Exception as exc:
            if not parse_fault(exc):
                raise
            self.metrics.unparsable.inc()
            paused = consumer.paused()
            candidates = [
                tp
                for tp in consumer.assignment()
                if tp not in paused and self.ownership.fetchable(tp.partition)
            ]
            fetched, doomed = await fetch_around_unparsable(
                consumer,
                candidates,
                self.ownership.positions.rewind,
                poll_ms=max(self.config.poll_timeout_ms, _PROBE_MS),
                max_records=self.config.max_batch,
            )
            self.book.doomed.update(doomed)
            return fetched

    async def drain(self) -> None:
        """Stopping: no new records; driver calls in flight finish (within the bound) and are folded back."""
        consumer = self.ownership.consumer
        assert consumer is not None
        with contextlib.suppress(Exception):
            consumer.pause(*consumer.assignment())
        episode = Episode("folding results back while stopping", logger, max_delay_s=1.0)
        while self.effects.outstanding > 0 or self.book.retry:
            self._touch()
            if not self.effects.ready.is_set() and not self.book.retry:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self.effects.ready.wait()
            try:
                await self.turn({})
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the world, while stopping: tried again within the bound
                await self._answer_outside_a_transaction(Site.DRAIN, exc)
                await asyncio.sleep(episode.failed(exc))
                continue
            if self.book.retry:  # a fold-back failed (the world): not again at once
                await asyncio.sleep(episode.backoff.peek() or 0.1)
            else:
                episode.recovered()

    # --- one turn ------------------------------------------------------------------------------

    async def turn(self, fetched: Mapping[TopicPartition, Records]) -> None:
        """Per partition number: fold back the results so far and decide the records fetched."""
        ownership = self.ownership
        # Records arrive while a take-over is still owning or restoring a partition, or for a
        # partition revoked meanwhile: keep only partitions owned whose state is held.
        work: dict[int, tuple[dict[TopicPartition, Records], list[Completion]]] = {}
        try:
            for tp, recs in fetched.items():
                if not recs:
                    continue
                if not ownership.fetchable(tp.partition):
                    if ownership.active(tp.partition):  # being restored: read again once held
                        ownership.positions.seek_back({tp: recs}, ownership.owned)
                    continue
                if await ownership.positions.drained_before_seek(tp, recs):
                    continue  # the fetch resumes at the take-over's seek
                work.setdefault(tp.partition, ({}, []))[0][tp] = recs
        except BaseException:
            # Nothing of the fetch was decided: it is read again.
            ownership.positions.seek_back(fetched, ownership.owned)
            raise
        async with ownership.batch_lock:
            expiring = self._expiring()
            completions, self.book.retry = [*self.book.retry, *self.effects.take()], []
            try:
                for completion in completions:
                    if ownership.active(completion.partition) and completion.partition in ownership.restoring:
                        self.book.retry.append(completion)  # its state is being read: folded once held
                        continue
                    work.setdefault(completion.partition, ({}, []))[1].append(completion)
                for p in expiring:
                    work.setdefault(p, ({}, []))
                if work:
                    await asyncio.gather(
                        *(
                            self._partition(p, recs, comps, expiring.get(p, []))
                            for p, (recs, comps) in work.items()
                        )
                    )
            except BaseException:
                # Something outside a transaction's own handling failed: nothing of the turn is
                # lost (its records are read again, its results folded again), then the loop's
                # policy answers it.
                self.book.retry[:0] = [c for c in completions if c not in self.book.retry]
                ownership.positions.seek_back(
                    {tp: r for recs, _ in work.values() for tp, r in recs.items()}, ownership.owned
                )
                raise
        self.apply_backpressure()

    def _expiring(self) -> dict[int, list[str]]:
        """States past their retention, per owned partition: looked for once a second, or at the
        next turn while a look finds a whole batch (a backlog drains at a batch per turn)."""
        now = time.time()
        store = self.ownership.store
        if store.retention_s <= 0 or now < self._next_expiry_check:
            return {}
        try:
            due = store.due(now, self.config.max_batch)
        except StateStoreFault as fault:  # the turn lock is held: rebuilt, looked at again next turn
            self.ownership.rebuild(fault.partition, fault.reason)
            return {}
        saturated = sum(len(keys) for keys in due.values()) >= self.config.max_batch
        self._next_expiry_check = now if saturated else now + _EXPIRY_CHECK_S
        return {
            p: keys for p, keys in due.items() if self.ownership.fetchable(p) and p not in self.book.suspects
        }

    def apply_backpressure(self) -> None:
        """Pause fetching while too many driver calls are out; resume once most are folded back."""
        consumer = self.ownership.consumer
        if consumer is None:
            return
        # Now, not the turn's start: a fence may have dropped the assignment meanwhile (rejoining).
        assigned = consumer.assignment()
        outstanding = self.effects.outstanding
        self.metrics.effects_outstanding.set(outstanding)
        self.metrics.producers_lingering.set(lingering())
        now = time.monotonic()
        if now >= self._next_memory_read:  # a property read per partition: once a second is enough
            self._next_memory_read = now + 1.0
            held = self.ownership.store.memory_bytes()
            if held is not None:
                self.metrics.state_memory.set(held)
        # Fetch what is owned, held and not resting, unless throttled or stopping; pause the rest.
        fetching = self._throttle.fetching(outstanding, self._stop.is_set())
        resumed = [
            tp
            for tp in assigned
            if fetching
            and self.ownership.fetchable(tp.partition)
            and not self.book.rests(tp.partition, now)
            and not self.ownership.reopen_waits(tp.partition, now)
        ]
        with contextlib.suppress(Exception):  # revoked meanwhile: the next call sees the new assignment
            if resumed:
                consumer.resume(*resumed)
            fetched = set(resumed)
            paused = [tp for tp in assigned if tp not in fetched]
            if paused:
                consumer.pause(*paused)

    async def _partition(
        self,
        partition: int,
        batch: Mapping[TopicPartition, Records],
        completions: list[Completion],
        expiring: list[str],
    ) -> None:
        """Partition N's transaction: results folded back, then the records decided.

        A partition in small steps (a suspect) goes through what this fetch holds one step per
        transaction, all in this turn, rather than one fetch per record: each step is committed on
        its own, so the failing one still names itself, and the rest costs a transaction each."""
        ownership, book = self.ownership, self.book
        consumer = ownership.consumer
        assert consumer is not None
        sink = await ownership.reopen(partition) if ownership.active(partition) else None
        if sink is None or not ownership.active(partition):
            # Not (or no longer) ours, or its producer cannot be opened now: the records go back;
            # the results wait (void if disowned: the effect runner drops them with the epoch).
            ownership.positions.seek_to_first(batch)
            if ownership.active(partition):
                book.retry.extend(completions)
            return
        if book.rests(partition, time.monotonic()):
            # Its last transaction failed for the world's reasons: it rests (backoff) rather than
            # hammer the broker; its records are read again and its results wait.
            ownership.positions.seek_to_first(batch)
            book.retry.extend(completions)
            return
        completions, limit = book.step(partition, completions)
        rest: Mapping[TopicPartition, Records] = batch
        steps = 0
        try:
            while True:
                txn = await self._transaction(partition, sink, rest, completions, expiring, limit)
                steps += 1
                if txn is None or limit != 1 or txn.stepped == 0 or self._stop.is_set():
                    return
                if not ownership.fetchable(partition) or ownership.store_lost(partition):
                    return
                standing = ownership.positions.standing
                rest = {
                    tp: left
                    for tp, recs in rest.items()
                    if (left := [r for r in recs if r.offset >= standing.get(tp, r.offset)])
                }
                if not rest:
                    return
                completions, expiring = [], []
                completions, limit = book.step(partition, completions)
        finally:
            if steps > 1:  # every input partition of the fetch back to where the steps left it
                ownership.positions.seek_back(batch, ownership.owned)

    async def _transaction(
        self,
        partition: int,
        sink: BatchSink,
        batch: Mapping[TopicPartition, Records],
        completions: list[Completion],
        expiring: list[str],
        limit: int | None,
    ) -> PartitionTransaction | None:
        """One transaction; the committed one, or None when it failed (the book has answered it)."""
        ownership, book = self.ownership, self.book
        consumer = ownership.consumer
        assert consumer is not None
        started = time.monotonic()
        txn = PartitionTransaction(
            partition,
            sink,
            config=self.config,
            processor=self.processor,
            store=ownership.store,
            stats=self.stats,
            metrics=self.metrics,
            gate=self.gate,
            consumer=consumer,
            stopping=self._stop,
            touch=self._touch,
            doomed=book.doomed,
            limit=limit,
        )
        creates = batch.get(TopicPartition(self.config.topics.execution_created, partition))
        self.gate.begin(partition, creates[-1].offset if creates else None)
        try:
            await sink.begin()
            await txn.expire(expiring)
            for completion in completions:
                await txn.fold(completion)
            await txn.decide(batch)
            await txn.commit()  # the sink's commit (under a span when tracing)
        except asyncio.CancelledError:
            # The shutdown bound cancelled the turn: abort so nothing of it becomes visible.
            with contextlib.suppress(Exception):
                await asyncio.shield(sink.abort())
            raise
        except Exception as exc:
            try:
                await book.failed(txn, sink, batch, completions, exc)
            except asyncio.CancelledError:
                raise
            except Exception as inner:  # handling it failed too (the world): the next turn starts it over
                logger.warning(
                    "handling a failed transaction failed; the next turn tries again",
                    extra={"partition": partition, "error": repr(inner)},
                )
                ownership.positions.seek_to_first(batch)
                book.retry.extend(completions)
            return None
        book.committed(txn, started)
        return txn


__all__ = ["Turns"]
