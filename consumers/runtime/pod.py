"""The stream runtime: consume inputs, decide, run the driver calls off the transaction, fold back.

One turn of the loop takes a fetch and the driver results finished so far, and
per partition number (partition N of every input topic and of the state topic)
commits one short transaction: the results folded back (outcome events, outbox
entries removed) and the records decided (state with new effects, dead
letters, offsets). No transaction waits on a driver: the calls a committed
decision added are handed to :class:`consumers.runtime.effects.EffectRunner` only after
the commit, and their results come back in a later turn. Records are processed in
partition order (key = execution id, so per-execution order holds). Writes are
staged in an overlay and folded into the state store only once committed, so an
aborted or failed transaction leaves the store equal to the topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import OutOfOrderSequenceNumber, ProducerFenced
from aiokafka.partitioner import murmur2

from consumers.lanes.commands import Command, CommandResult, Ensure
from consumers.runtime.backpressure import FetchThrottle
from consumers.runtime.config_log import record_lane_config_soon
from consumers.runtime.create_order import CreateOrderGate
from consumers.runtime.effects import Completion, EffectRunner
from resilience.episode import Episode
from consumers.runtime.kafka.clients import (
    RebalanceHooks,
    group_consumer_for,
    producer_options_for,
    txn_producer_config,
)
from consumers.runtime.kafka.codecs import require_codecs
from consumers.runtime.kafka.failures import is_deterministic
from consumers.runtime.kafka.sink import BatchSink, PartitionSinks
from consumers.runtime.kafka.topology import prepare_pod_topics
from consumers.runtime.kafka.txn_producer import DEADLINE_GRACE_S
from consumers.runtime.kafka.unparsable import Doom, RecordRef, fetch_around_unparsable, record_ref
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.partition_txn import TRANSACTION_FAILED, PartitionTransaction
from consumers.runtime.pod_config import Health, PodConfig, PodStats, assess_health
from consumers.runtime.processor import LaneProcessor
from consumers.runtime.shutdown import end_tasks, run_until_bound
from consumers.runtime.stall_guard import StallGuard
from consumers.runtime.state.interface import CHECKPOINT_INTERVAL_S
from consumers.runtime.state.recovery import restore_and_resume
from consumers.runtime.state.store import HeldStates, MemoryStore, StateStore

logger = logging.getLogger("sandbox_lanes.pod")

_T = TypeVar("_T")

#: Part of the shutdown bound kept for closing the consumer and producer.
_CLOSE_RESERVE_S = 5.0
_Records = list[ConsumerRecord[bytes, bytes]]
#: How long a fetch of one partition waits while the pod looks for a record it cannot parse: a
#: partition just sought back needs a round trip to the broker before it has records again.
_PROBE_MS = 500
#: Seconds between looks for states past their retention.
_EXPIRY_CHECK_S = 1.0
#: What a suspect partition's transaction is retried for: its results alone, or one record.
_RESULTS = "results"
#: Why the pod forgets partitions (see :meth:`Pod._forget`).
Forgotten = Literal["released", "take-over failed", "fenced", "abandoned"]
_FORGET_MESSAGES: dict[Forgotten, str] = {
    "released": "partitions released: their driver results are void here, the next owner re-runs them",
    "take-over failed": "taking partitions over failed; retrying the take-over",
    "fenced": (
        "fenced: the partition's transactional id has a newer epoch (another writer took it over, or the"
        " broker aborted a transaction past its timeout); standing down and rejoining the group"
    ),
    "abandoned": (
        "the partition's producer is abandoned (a broker wait outlived its deadline, or an abort failed);"
        " taking the partition over anew with a new producer"
    ),
}
#: A driver result that could not be folded back, recorded as a failure of its call instead.
_UNRECORDABLE = "its result could not be recorded ({attempts} attempts): {error}"


class _UnwaitedExecutor(ThreadPoolExecutor):
    """The loop's default executor (driver SDK calls): its shutdown never waits on a call.

    ``asyncio.run`` ends by shutting the default executor down and, on Python 3.11, waits for
    every call in it without a bound: a driver call stuck in its SDK would keep a stopped pod
    alive. The stop has its own bound (``SANDBOX_LANES_SHUTDOWN_TIMEOUT_S``); past it nothing is
    waited on (the CLI exits without joining what is left, see ``tools.cli``).
    """

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)


@dataclass
class _Suspect:
    """A partition whose transaction failed the same way a retry would (see :mod:`failures`).

    It is retried in small steps, its driver results alone and then one record per transaction,
    so the next failure names what fails; a step failing ``dead_letter_attempts`` times is given
    up: a record is dead-lettered, results are dropped.
    """

    subject: RecordRef | str | None = None
    attempts: int = 0


def _result_subject(effect_id: str) -> str:
    return f"{_RESULTS}:{effect_id}"


class Pod:
    def __init__(
        self,
        config: PodConfig,
        processor: LaneProcessor,
        metrics: PodMetrics | None = None,
        store: StateStore | None = None,
    ) -> None:
        self.config = config
        self.processor = processor
        self.metrics = metrics or PodMetrics()
        #: The states of the owned partitions (in memory unless given one: ``open_store``).
        self._store = MemoryStore(config.topics.state, config.state_retention_s) if store is None else store
        self.stats = PodStats()
        self._last_loop = time.monotonic()
        self._restoring = False
        self._running = False
        self._batch_lock = asyncio.Lock()
        self._restore_lock = asyncio.Lock()
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._stop_requested_at: float | None = None
        #: Tasks tied to the pod's life (the periodic reaper): awaited within the shutdown bound on stop.
        self._background: list[asyncio.Task[None]] = []
        self._consumer: AIOKafkaConsumer | None = None
        self._sinks: PartitionSinks | None = None
        #: Driver calls wait out a loop stall that may have cost the partitions (a paused pod).
        self.stall_guard = StallGuard(config.session_timeout_ms / 1000, config.heartbeat_interval_ms / 1000)
        self.effects = EffectRunner(self._run_effect, config.driver_concurrency, gate=self.stall_guard.clear)
        #: Results whose fold-back transaction failed: folded again next turn.
        self._retry: list[Completion] = []
        #: Partitions whose writer was fenced: nothing of theirs runs until the group reassigns them.
        self._fenced: set[int] = set()
        #: Partitions taken over (previous writer fenced, committed offset sought, new epoch).
        #: aiokafka hands out a new assignment's records before its assignment callback ends, so
        #: records, restores and driver calls wait for this, not for ``consumer.assignment()``.
        self._owned: set[int] = set()
        #: Where :meth:`take_over` sought each partition: records fetched before that seek differ.
        self._sought: dict[TopicPartition, int] = {}
        #: Set when a partition was fenced: the loop re-subscribes between turns (never in the middle
        #: of one: another partition's transaction may be committing), which rejoins the group.
        self._rejoin = False
        #: Where the pod stands on each owned input partition: the next offset to read, as its last
        #: commit (or its take-over) left it. Kept locally: a rewind needs no broker round trip, and
        #: it cannot read an unstable committed offset just after a transaction.
        self._standing: dict[TopicPartition, int] = {}
        #: Take-overs that failed (the world): retried with backoff while the partitions stay assigned.
        self._take_over_episode = Episode("taking partitions over", logger)
        #: Effect ids whose results are being recorded as failures (their own fold kept failing).
        self._unrecordable: set[str] = set()
        #: Per partition: transactions failing for the world's reasons, and until when it rests.
        self._commit_episodes: dict[int, Episode] = {}
        self._resting: dict[int, float] = {}
        #: Take-overs in flight (at most one: a rebalance first releases, which cancels it).
        self._taking_over: set[asyncio.Task[None]] = set()
        #: When each effect was decided (monotonic), for the time-to-sandbox histogram.
        self._decided_at: dict[str, tuple[int, float]] = {}
        self._throttle = FetchThrottle(config.driver_concurrency, config.max_batch)
        self._create_gate = CreateOrderGate(config.topics.execution_created)
        #: Records to dead-letter undecided (unparsable, or failing the same way each time).
        self._doomed: dict[RecordRef, Doom] = {}
        #: Partitions whose last transaction failed deterministically: retried in small steps.
        self._suspects: dict[int, _Suspect] = {}
        self._next_expiry_check = 0.0

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def states(self) -> HeldStates:
        """The execution states this pod holds (committed ones only), read-only."""
        return self._store

    @property
    def turn_in_progress(self) -> bool:
        """A turn (or a take-over, a release) is changing the pod's partitions or positions now."""
        return self._batch_lock.locked()

    def run_beside(self, task: asyncio.Task[None]) -> None:
        """Tie ``task`` to the pod's life: it is awaited within the shutdown bound when the pod stops."""
        self._background.append(task)

    @property
    def consumer(self) -> AIOKafkaConsumer | None:
        """The group consumer while the pod runs (for lag gauges and diagnostics)."""
        return self._consumer

    def request_stop(self) -> None:
        """SIGTERM: stop taking new records; the record in flight is finished, the batch so far committed."""
        if self._stop_requested_at is None:
            self._stop_requested_at = time.monotonic()
        self._stop.set()

    def input_partition_of(self, key: str) -> int | None:
        """The execution-created partition the default partitioner sends ``key`` to (``None``:
        the topic's partition count is not known yet). Agent executions are keyed by session id,
        so this is where a session's executions and their states live."""
        consumer = self._consumer
        partitions = consumer.partitions_for_topic(self.config.topics.execution_created) if consumer else None
        if not partitions:
            return None
        hashed: int = murmur2(key.encode("utf-8"))
        return (hashed & 0x7FFFFFFF) % len(partitions)

    @property
    def stopping(self) -> asyncio.Event:
        """Set once a stop was requested (read-only use: background tasks wait on it)."""
        return self._stop

    async def start(self) -> None:
        require_codecs()  # a codec the Kafka client lacks is a startup error naming it
        cfg = self.config
        # Drivers call blocking SDKs (docker, kubernetes) through asyncio.to_thread: the default
        # executor (cores + 4 threads) would cap the driver concurrency at 6 on a 2-core node.
        asyncio.get_running_loop().set_default_executor(
            _UnwaitedExecutor(max_workers=cfg.driver_concurrency + 4, thread_name_prefix="sandbox-lanes-io")
        )
        # Inputs must exist (the pod never creates them); its own topics are created when missing
        # (SANDBOX_LANES_CREATE_TOPICS) with the inputs' partition count. A MissingTopicsError /
        # TopologyError says what is missing or not co-partitioned.
        admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap, **cfg.security.client_options())
        await admin.start()
        try:
            await prepare_pod_topics(admin, cfg.topics, cfg.replication, create=cfg.create_topics)
        finally:
            await admin.close()
        # Issue 35: every decision carries its configuration's fingerprint; the log holds the configuration.
        self.processor.config = replace(
            self.processor.config,
            stamp_fingerprint=True,
            max_clock_ahead_s=cfg.max_clock_ahead_s,
            state_retention_s=cfg.state_retention_s,
        )
        record_lane_config_soon(cfg, self.processor.config)  # beside the start, never waited for
        producer_options = producer_options_for(cfg)
        self._consumer = group_consumer_for(cfg)
        await self._consumer.start()
        self._sinks = PartitionSinks(
            self._consumer,
            cfg.group_id,
            cfg.guarantee,
            producer_options,
            txn_config=txn_producer_config(cfg),
            transaction_timeout_s=cfg.transaction_timeout_ms / 1000,
            sequential=cfg.sequential_produce,
        )
        await self._sinks.start()
        self._subscribe()
        logger.info(
            "pod started",
            extra={"podId": cfg.pod_id, "guarantee": cfg.guarantee, "groupId": cfg.group_id},
        )

    def _subscribe(self) -> None:
        assert self._consumer is not None
        self._consumer.subscribe(
            list(self.config.topics.inputs), listener=RebalanceHooks(self.release, self.assigned)
        )

    async def stop(self) -> None:
        for task in list(self._taking_over):
            task.cancel()
        if self._taking_over:
            await asyncio.wait(set(self._taking_over), timeout=_CLOSE_RESERVE_S)
        with contextlib.suppress(Exception):  # a last checkpoint (proven: safe past a take-over too)
            await asyncio.wait_for(self._store.checkpoint(self._store.owned()), _CLOSE_RESERVE_S / 2)
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()
        if self._sinks is not None:
            with contextlib.suppress(Exception):
                await self._sinks.stop()
        self._store.close()
        self._consumer = None
        self._sinks = None

    async def run(self) -> None:
        """Start, process until stop is requested, then finish the batch in flight and close."""
        await self.start()
        self._running = True
        self._background.append(asyncio.get_running_loop().create_task(self.stall_guard.watch(self._stop)))
        self._background.append(asyncio.get_running_loop().create_task(self._checkpoints()))
        try:
            await self._bounded_loop()
        finally:
            self._running = False
            await self._stop_background()
            await self.effects.cancel()
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

        def bound_reached() -> None:
            logger.warning(
                "shutdown bound reached, handing the work in flight back",
                extra={"podId": self.config.pod_id, "boundSeconds": self.config.shutdown_timeout_s},
            )

        await run_until_bound(
            self._loop(), self._stop, lambda: self._remaining() - _CLOSE_RESERVE_S, bound_reached
        )

    async def _checkpoints(self) -> None:
        """Every few seconds, off the turn, the store's checkpoints move forward (a disk store: see
        :meth:`RocksDBStore.checkpoint`); one that fails leaves them where they were (a longer tail)."""
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), CHECKPOINT_INTERVAL_S)
            if self._stop.is_set():
                return
            try:
                await self._store.checkpoint(self._owned & self._store.owned())
            except Exception as exc:
                logger.warning("state checkpoint not moved", extra={"error": repr(exc)})

    async def _stop_background(self) -> None:
        self._stop.set()  # background tasks end on the stop signal too (also when the loop raised)
        await end_tasks(self._background, self._remaining() - _CLOSE_RESERVE_S, _CLOSE_RESERVE_S)

    def assigned(self, assigned: set[TopicPartition]) -> None:
        """Assigned (aiokafka's coordinator calls this): start taking the partitions over, return at once.

        aiokafka sends no heartbeat until the assignment callback has returned (its heartbeat
        task starts after it), and the take-over can wait long: InitProducerId waits out the
        previous owner's open transaction (up to the transaction timeout), and the restore reads
        the state partition (the whole of it, or from a disk store's checkpoint). Done inside the
        callback, that outlives the session timeout and the group expels the pod again and again.
        So the partitions are paused here and taken over in a task; :meth:`take_over` resumes them
        once they are owned.
        """
        if not assigned:
            return
        self._start_take_over(assigned)

    def _start_take_over(
        self, assigned: set[TopicPartition], delay_s: float = 0.0, *, again: bool = False
    ) -> None:
        assert self._consumer is not None
        with contextlib.suppress(Exception):  # a partition revoked meanwhile: its take-over is moot
            self._consumer.pause(*assigned)
        self._restoring = True
        task = asyncio.get_running_loop().create_task(self.take_over(assigned, delay_s, again=again))
        self._taking_over.add(task)
        task.add_done_callback(self._taking_over.discard)

    async def release(self, partitions: set[int]) -> None:
        """Revoked: forget the partitions' state, void their driver calls' results, close their writers."""
        for task in list(self._taking_over):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        async with self._batch_lock:
            await self._forget(partitions, "released")

    async def take_over(
        self, assigned: set[TopicPartition], delay_s: float = 0.0, *, again: bool = False
    ) -> None:
        """Assigned: fence the previous writer, read the offsets it left, restore, resume its outbox.

        A take-over that fails (the broker, a coordinator moving) forgets what it did and is tried
        again with backoff while the partitions stay assigned here; a rebalance cancels it.
        ``again``: not the group's fresh assignment but the pod's own decision (an abandoned
        producer, a failed take-over): it first waits out the stall guard's hold, so a pod that
        stood still past its session timeout hears from the group (and is revoked) before it could
        fence the partitions' new owner, and it goes on only with what is still assigned to it.
        """
        self._restoring = True  # taking over is part of the recovery: not ready until restored
        retry_in: float | None = None
        try:
            if delay_s > 0:
                await asyncio.wait_for(self._stop.wait(), delay_s)
                return  # stopping: nothing to take over
        except TimeoutError:
            pass
        if again:
            await self.stall_guard.clear()
            assert self._consumer is not None
            assigned = {tp for tp in assigned if tp in self._consumer.assignment()}
            if not assigned or self._stop.is_set():
                self._restoring = False
                return
        partitions = {tp.partition for tp in assigned}
        try:
            await self._take_over(assigned, partitions)
            self._take_over_episode.recovered()
        except Exception as exc:
            retry_in = self._take_over_episode.failed(exc)
            async with self._batch_lock:
                await self._forget(partitions, "take-over failed", error=str(exc) or repr(exc))
        finally:
            self._restoring = False
        if retry_in is not None and self._consumer is not None and not self._stop.is_set():
            still = {tp for tp in assigned if tp in self._consumer.assignment()}
            if still:
                self._start_take_over(still, retry_in, again=True)
            return
        if self._consumer is not None:
            self._apply_backpressure()  # resumes what is owned (unless throttled or stopping)

    async def _take_over(self, assigned: set[TopicPartition], partitions: set[int]) -> None:
        assert self._sinks is not None and self._consumer is not None
        async with self._batch_lock:
            self._fenced -= partitions
            # exactly_once: InitProducerId for <group>-p<N> aborts (or waits out) the previous
            # owner's transaction, so the committed offsets read next are the stable ones.
            await self._sinks.open(partitions)
            committed = {tp: await self._bounded(self._consumer.committed(tp)) for tp in assigned}
            # From here to the end of the block nothing awaits: a turn sees the partitions either
            # not owned (their records dropped, fetched again from the seek) or owned with their
            # seek done and their epoch new.
            for tp, offset in committed.items():
                if offset is not None and offset >= 0:
                    self._consumer.seek(tp, offset)
                    self._sought[tp] = offset
                    self._standing[tp] = offset
            self.effects.own(partitions)
            self._owned |= partitions
        await self.restore(partitions)

    async def restore(self, partitions: set[int]) -> None:
        """Rebuild the state of ``partitions`` not yet held; no record of theirs is processed before."""
        async with self._restore_lock:
            self._restoring = True
            try:
                await restore_and_resume(
                    partitions,
                    owned=lambda: self._owned,
                    config=self.config,
                    store=self._store,
                    effects=self.effects,
                    stats=self.stats,
                    metrics=self.metrics,
                )
            finally:
                self._restoring = False
        self.ready.set()

    def health(self, stall_after_s: float = 30.0) -> Health:
        """What /healthz and /readyz answer now (see :func:`assess_health`)."""
        return assess_health(
            now=time.monotonic(),
            running=self._running,
            last_loop=self._last_loop,
            stats=self.stats,
            assigned=len(self._consumer.assignment()) if self._consumer is not None else 0,
            restoring=self._restoring,
            restored=self.ready.is_set(),
            stall_after_s=stall_after_s,
        )

    # --- the loop ----------------------------------------------------------------------------

    async def _run_effect(self, command: Command) -> CommandResult:
        return await self.processor.runner.run(command)

    async def _bounded(self, call: Awaitable[_T]) -> _T:
        """A broker call of the consumer's, waited on no longer than a transaction's deadline."""
        return await asyncio.wait_for(call, self.config.transaction_timeout_ms / 1000 + DEADLINE_GRACE_S)

    async def _pause_for(self, seconds: float) -> None:
        """Wait ``seconds`` (a backoff), or less when a stop is requested."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    async def _loop(self) -> None:
        """Fetch and turn until a stop is requested. A failure of the world on the way (a fetch,
        a rewind, a restore, a client's own error: record faults never reach here) is waited out
        with backoff, logged once per episode; only a requested stop ends the loop."""
        assert self._consumer is not None
        episode = Episode("the pod's loop", logger)
        while not self._stop.is_set():
            try:
                if not await self._one_turn():
                    break
            except Exception as exc:
                self._last_loop = time.monotonic()  # waiting out the world is not a stalled loop
                await self._pause_for(episode.failed(exc))
                continue
            episode.recovered()
        await self._drain()

    async def _one_turn(self) -> bool:
        """One fetch and its turn; False when a stop was requested while fetching."""
        assert self._consumer is not None
        if self._rejoin:
            self._rejoin = False
            self._subscribe()
        # While driver calls are out, turn often enough to fold their results back promptly.
        busy = self.effects.outstanding > 0 or bool(self._retry)
        timeout_ms = min(10, self.config.poll_timeout_ms) if busy else self.config.poll_timeout_ms
        getmany = asyncio.ensure_future(self._fetch(timeout_ms))
        stopper = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait({getmany, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if getmany not in done:
            getmany.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await getmany
            return False
        fetched: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = getmany.result()
        self._last_loop = self.stats.last_progress = time.monotonic()
        await self._turn(fetched)
        return True

    async def _fetch(self, timeout_ms: int) -> dict[TopicPartition, _Records]:
        """The next fetch; past a record the client cannot parse (see :mod:`unparsable`)."""
        assert self._consumer is not None
        try:
            fetched: dict[TopicPartition, _Records] = await self._consumer.getmany(
                timeout_ms=timeout_ms, max_records=self.config.max_batch
            )
            return fetched
        except Exception as exc:
            if not is_deterministic(exc):
                raise
            self.metrics.unparsable.inc()
            paused = self._consumer.paused()
            candidates = [
                tp
                for tp in self._consumer.assignment()
                if tp not in paused and tp.partition in self._owned - self._fenced
            ]
            fetched, doomed = await fetch_around_unparsable(
                self._consumer,
                candidates,
                self._rewind,
                poll_ms=max(self.config.poll_timeout_ms, _PROBE_MS),
                max_records=self.config.max_batch,
            )
            self._doomed.update(doomed)
            return fetched

    async def _rewind(self, tp: TopicPartition) -> None:
        """Back to where the pod stands on ``tp`` (every turn leaves it at its last commit)."""
        assert self._consumer is not None
        standing = self._standing.get(tp)
        if standing is not None:
            self._consumer.seek(tp, standing)
            return
        # Nothing committed yet when it was taken over (auto_offset_reset=earliest): the beginning.
        await self._bounded(self._consumer.seek_to_beginning(tp))

    def _seek_back(self, fetched: Mapping[TopicPartition, _Records]) -> None:
        """A turn that could not run: its records are read again (from where the pod stands)."""
        assert self._consumer is not None
        for tp, recs in fetched.items():
            if not recs or tp.partition not in self._owned:
                continue  # not owned: its take-over seeks it
            with contextlib.suppress(Exception):  # revoked meanwhile: its next owner reads it
                self._consumer.seek(tp, self._standing.get(tp, recs[0].offset))

    async def _drain(self) -> None:
        """Stopping: no new records; driver calls in flight finish (within the bound) and are folded back."""
        assert self._consumer is not None
        with contextlib.suppress(Exception):
            self._consumer.pause(*self._consumer.assignment())
        while self.effects.outstanding > 0 or self._retry:
            self._last_loop = time.monotonic()
            if not self.effects.ready.is_set() and not self._retry:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self.effects.ready.wait()
            try:
                await self._turn({})
            except Exception as exc:  # the world, while stopping: tried again within the bound
                logger.warning("folding results back while stopping failed", extra={"error": repr(exc)})
                await asyncio.sleep(0.2)
                continue
            if self._retry:  # a fold-back failed (the world): not again at once
                await asyncio.sleep(0.2)

    async def _turn(self, fetched: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> None:
        """One turn: per partition number, fold back the results so far and decide the records fetched."""
        assert self._consumer is not None
        # Records arrive while the assignment callback is still taking a partition over, or for
        # a partition revoked meanwhile: keep only partitions taken over, restored first.
        work: dict[int, tuple[dict[TopicPartition, _Records], list[Completion]]] = {}
        try:
            for tp, recs in fetched.items():
                if not recs or tp.partition not in self._owned or tp.partition in self._fenced:
                    continue
                if tp in self._sought and await self._drained_before_seek(tp, recs):
                    continue  # the fetch resumes at the take-over's seek
                work.setdefault(tp.partition, ({}, []))[0][tp] = recs
            if work:
                await self.restore(set(work))
        except BaseException:
            self._seek_back(fetched)  # nothing of the fetch was decided: it is read again
            raise
        async with self._batch_lock:
            completions, self._retry = [*self._retry, *self.effects.take()], []
            for completion in completions:
                work.setdefault(completion.partition, ({}, []))[1].append(completion)
            expiring = self._expiring()
            for p in expiring:
                work.setdefault(p, ({}, []))
            if work:
                await asyncio.gather(
                    *(
                        self._process_partition(p, recs, comps, expiring.get(p, []))
                        for p, (recs, comps) in work.items()
                    )
                )
        self._apply_backpressure()

    def _expiring(self) -> dict[int, list[str]]:
        """States past their retention, per owned partition: looked for once a second, or at the
        next turn while a look finds a whole batch (a backlog drains at a batch per turn)."""
        now = time.time()
        if self._store.retention_s <= 0 or now < self._next_expiry_check:
            return {}
        due = self._store.due(now, self.config.max_batch)
        saturated = sum(len(keys) for keys in due.values()) >= self.config.max_batch
        self._next_expiry_check = now if saturated else now + _EXPIRY_CHECK_S
        return {
            p: keys
            for p, keys in due.items()
            if p in self._owned and p not in self._fenced and p not in self._suspects
        }

    async def _drained_before_seek(self, tp: TopicPartition, recs: _Records) -> bool:
        """Were these records drained before :meth:`take_over` sought the partition?

        Such records start below the committed offset the take-over read (the previous owner
        committed them meanwhile), or the seek has since moved the position back over them.
        The first batch that passes ends the check for the partition.
        """
        assert self._consumer is not None
        sought = self._sought[tp]
        position = await self._consumer.position(tp)  # known after a seek: returns at once
        if recs[0].offset < sought or position <= recs[-1].offset:
            return True
        del self._sought[tp]
        return False

    def _apply_backpressure(self) -> None:
        """Pause fetching while too many driver calls are out; resume once most are folded back."""
        assert self._consumer is not None
        # Now, not the turn's start: a fence may have dropped the assignment meanwhile (rejoining).
        assigned = self._consumer.assignment()
        outstanding = self.effects.outstanding
        self.metrics.effects_outstanding.set(outstanding)
        # Fetch what is owned (taken over, not fenced) unless throttled or stopping; pause the rest.
        fetching = self._throttle.fetching(outstanding, self._stop.is_set())
        now = time.monotonic()
        resting = {p for p, until in self._resting.items() if until > now}
        resumed = [
            tp
            for tp in assigned
            if fetching and tp.partition in self._owned - self._fenced and tp.partition not in resting
        ]
        if resumed:
            self._consumer.resume(*resumed)
        paused = [tp for tp in assigned if tp not in set(resumed)]
        if paused:
            self._consumer.pause(*paused)

    async def _process_partition(
        self,
        partition: int,
        batch: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]],
        completions: list[Completion],
        expiring: list[str],
    ) -> None:
        """One transaction for partition N: results folded back, then the records decided."""
        assert self._consumer is not None and self._sinks is not None
        sink = self._sinks.get(partition)
        if sink is None and partition in self._owned and partition not in self._fenced:
            sink = await self._reopen(partition)
            if sink is None:  # the broker is out of reach: everything waits for the next turn
                self._retry.extend(completions)
        if sink is None or partition in self._fenced:
            # Not (or no longer) ours: the records go back; the results are void (disowned).
            for tp, records in batch.items():
                with contextlib.suppress(Exception):
                    self._consumer.seek(tp, records[0].offset)
            return
        started = time.monotonic()
        if self._resting.get(partition, 0.0) > started:
            # Its last transaction failed for the world's reasons: it rests (backoff) rather than
            # hammer the broker; its records are read again and its results wait.
            for tp, records in batch.items():
                with contextlib.suppress(Exception):
                    self._consumer.seek(tp, records[0].offset)
            self._retry.extend(completions)
            return
        limit: int | None = None
        if partition in self._suspects:
            # Small steps: one result per transaction first, then one record per transaction, so
            # the next failure names what fails and nothing else waits on it for long.
            if completions:
                self._retry.extend(completions[1:])
                completions = completions[:1]
                limit = 0
            else:
                limit = 1
        txn = PartitionTransaction(
            partition,
            sink,
            config=self.config,
            processor=self.processor,
            store=self._store,
            stats=self.stats,
            metrics=self.metrics,
            gate=self._create_gate,
            consumer=self._consumer,
            stopping=self._stop,
            touch=self._touch,
            doomed=self._doomed,
            limit=limit,
        )
        creates = batch.get(TopicPartition(self.config.topics.execution_created, partition))
        self._create_gate.begin(partition, creates[-1].offset if creates else None)
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
                await self._failed(txn, sink, batch, completions, exc)
            except Exception as inner:  # handling it failed too: the next turn starts it over
                logger.exception(
                    "handling a failed transaction failed",
                    extra={"partition": partition, "error": repr(inner)},
                )
                self._retry.extend(completions)
            return
        self._committed(txn, started)

    async def _forget(self, partitions: set[int], why: Forgotten, *, error: str | None = None) -> None:
        """The one way partitions leave the pod (the turn lock held): released by the group, a
        take-over that failed (the pod rejoins), or fenced by another writer (the pod rejoins and
        ignores the partitions until the group reassigns them). Everything tracked for them goes:
        state, positions, driver calls (queued ones dropped, running ones' results void: the next
        owner re-runs them from the outbox), held results, create-order marks, doomed records,
        suspects, and the partition's producer."""
        if not partitions:
            return
        logger.log(
            logging.INFO if why == "released" else logging.ERROR,
            _FORGET_MESSAGES[why],
            extra={
                "partitions": ",".join(map(str, sorted(partitions))),
                "outstanding": self.effects.outstanding,
                **({"error": error} if error else {}),
            },
        )
        self._owned -= partitions
        if why == "fenced":
            self._fenced |= partitions
        else:
            self._fenced -= partitions
        self._sought = {tp: o for tp, o in self._sought.items() if tp.partition not in partitions}
        self._standing = {tp: o for tp, o in self._standing.items() if tp.partition not in partitions}
        self.effects.disown(partitions)
        self._store.drop(partitions)
        for p in partitions:
            self._create_gate.forget(p)
            self._suspects.pop(p, None)
            self._resting.pop(p, None)
        self._retry = [c for c in self._retry if c.partition not in partitions]
        self._decided_at = {e: d for e, d in self._decided_at.items() if d[0] not in partitions}
        self._doomed = {ref: d for ref, d in self._doomed.items() if ref[1] not in partitions}
        if self._sinks is not None:
            await self._sinks.close(partitions)

    def _touch(self) -> None:
        self._last_loop = time.monotonic()

    def _committed(self, txn: PartitionTransaction, started: float) -> None:
        """The transaction is durable: the store follows, its driver calls start, the meters move."""
        assert self._consumer is not None
        self.stats.max_transaction_s = max(self.stats.max_transaction_s, time.monotonic() - started)
        self.stats.commits_failing_since = None
        self._resting.pop(txn.partition, None)
        episode = self._commit_episodes.get(txn.partition)
        if episode is not None:
            episode.recovered()
        self._create_gate.committed(txn.partition)
        for tp, offset in txn.offsets.items():
            self._standing[tp] = offset
        for tp, offset in txn.held.items():
            self._standing[tp] = offset
            with contextlib.suppress(Exception):
                self._consumer.seek(tp, offset)
        self._store.apply(
            txn.partition, txn.overlay, txn.sink.written(self.config.topics.state, txn.partition)
        )
        self.metrics.states_removed.inc(sum(state is None for state in txn.overlay.values()))
        for rec in txn.attempted:
            self._doomed.pop(record_ref(rec), None)
        if txn.limit != 0:
            self._suspects.pop(txn.partition, None)  # the step that failed went through
        now = time.monotonic()
        for key, effect_id, command in txn.decided:
            if self.effects.submit(txn.partition, key, effect_id, command):
                self._decided_at[effect_id] = (txn.partition, now)
        driver = self.processor.config.driver_name
        for completion, outcome in txn.folded:
            self._unrecordable.discard(completion.effect_id)
            for output in outcome.outputs:
                self.metrics.record_outcome(completion.command, output, driver)
            decided = self._decided_at.pop(completion.effect_id, None)
            if decided is not None:
                decided_at = decided[1]
                operation = "ensure" if isinstance(completion.command, Ensure) else "deprovision"
                self.metrics.time_to_sandbox.labels(driver, operation).observe(now - decided_at)
        self.stats.outputs.update(txn.counted)
        self.stats.batches += 1
        for kind, n in txn.counted.items():
            self.metrics.outputs.labels(kind.rsplit(".", 1)[-1]).inc(n)
        self.metrics.batch_seconds.observe(now - started)
        self.metrics.state_keys.set(len(self._store))
        assignment = self._consumer.assignment()
        for tp, off in txn.offsets.items():
            if tp not in assignment:
                continue  # revoked meanwhile (a rejoin): no lag of ours to report
            highwater = self._consumer.highwater(tp)
            if highwater is not None:
                self.metrics.consumer_lag.labels(tp.topic, str(tp.partition)).set(max(0, highwater - off))

    async def _sinks_renew(self, partition: int) -> None:
        assert self._sinks is not None
        await self._sinks.close({partition})
        await self._reopen(partition)

    async def _reopen(self, partition: int) -> BatchSink | None:
        """A new producer for an owned partition whose producer was closed after a failure."""
        assert self._sinks is not None
        try:
            await self._sinks.open({partition})
        except Exception as exc:
            logger.error(
                "reopening the partition's producer failed; retrying next turn",
                extra={"partition": partition, "error": str(exc) or type(exc).__name__},
            )
        return self._sinks.get(partition)

    def _give_up(
        self, txn: PartitionTransaction, completions: list[Completion], error: str
    ) -> list[Completion]:
        """Count a deterministic failure against what the transaction tried; returns the results
        to fold again.

        The first such failure makes the partition a suspect: it is retried in small steps (one
        result per transaction, then one record per transaction), so only what fails pays. A step
        that fails ``dead_letter_attempts`` times is given up: a record is dead-lettered by the
        next transaction (with this error as the reason); a result is recorded as a failure of its
        driver call instead (its state can then finish and be removed), and only when even that
        cannot be written is it dropped (counted, logged with its effect id).
        """
        suspect = self._suspects.get(txn.partition)
        if suspect is None:
            self._suspects[txn.partition] = suspect = _Suspect()
            if len(txn.attempted) + len(completions) > 1:
                return completions  # a batch: the small steps will tell which part fails
        subject: RecordRef | str | None
        if completions and not txn.attempted:
            subject = _result_subject(completions[0].effect_id) if len(completions) == 1 else None
        else:
            subject = record_ref(txn.attempted[0]) if txn.attempted else None
        if subject != suspect.subject:
            suspect.subject, suspect.attempts = subject, 0
        suspect.attempts += 1
        if subject is None or suspect.attempts < self.config.dead_letter_attempts:
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
        doomed = self._doomed.get(subject)
        # Its dead letter failed as well (the dead-letter topic's own limit): the next one is bare.
        self._doomed[subject] = (
            Doom(reason, unparsable=doomed.unparsable, bare=True) if doomed else Doom(reason)
        )
        return completions

    async def _failed(
        self,
        txn: PartitionTransaction,
        sink: BatchSink,
        batch: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]],
        completions: list[Completion],
        exc: Exception,
    ) -> None:
        """A transaction failed: its records are read again and its results folded again; a
        fenced writer stands down; an abandoned one is replaced by taking the partition over anew."""
        assert self._consumer is not None
        partition = txn.partition
        self.stats.commit_failures += 1
        self.metrics.commit_failures.inc()
        self.stats.last_commit_failure = time.monotonic()
        if self.stats.commits_failing_since is None:
            self.stats.commits_failing_since = self.stats.last_commit_failure
        error = str(exc) or type(exc).__name__
        for tp, records in batch.items():
            with contextlib.suppress(Exception):
                self._consumer.seek(tp, records[0].offset)
        if isinstance(exc, ProducerFenced):
            self.metrics.fences.inc()
            # The transactional id has a newer epoch: another pod took the partition over (this
            # one was paused past its session timeout), or the broker aborted the transaction past
            # its timeout. Nothing of it may be written from here: stand down, and let the group
            # decide who owns it (the loop rejoins between turns; a reassignment takes it over).
            await self._forget({partition}, "fenced", error=error)
            self._rejoin = True
            return
        if not sink.abandoned:
            with contextlib.suppress(Exception):  # a failed abort abandons the producer
                await sink.abort()
        if sink.abandoned:
            self.metrics.producers_abandoned.inc()
            # Its transaction's fate is unknown here (a commit may still land): the new producer's
            # InitProducerId settles it on the broker before the offsets and state are read again,
            # so nothing is committed twice. The results are void; the restored outbox re-runs them.
            await self._retake(partition, error)
            return
        deterministic = is_deterministic(exc)
        if deterministic:
            logger.error(
                "transaction failed, rewinding",
                extra={"partition": partition, "error": error, "deterministic": deterministic},
            )
        else:  # the world: logged once per episode, the partition rests before its next try
            delay = self._commit_episode(partition).failed(exc)
            self._resting[partition] = time.monotonic() + delay
        if sink.guarantee == "exactly_once" and (deterministic or isinstance(exc, OutOfOrderSequenceNumber)):
            # A batch the broker refused leaves the producer's sequence numbers behind the
            # broker's: every later transaction would fail with OutOfOrderSequenceNumber.
            # A new producer (InitProducerId: a new epoch) starts them afresh.
            await self._sinks_renew(partition)
        if deterministic:
            completions = self._give_up(txn, completions, error)
        self._retry.extend(completions)

    def _commit_episode(self, partition: int) -> Episode:
        episode = self._commit_episodes.get(partition)
        if episode is None:
            episode = Episode("the partition's transaction", logger, extra={"partition": partition})
            self._commit_episodes[partition] = episode
        return episode

    async def _retake(self, partition: int, error: str) -> None:
        """(The turn lock held.) Forget the partition and take it over again, still assigned here."""
        assert self._consumer is not None
        tps = {tp for tp in self._consumer.assignment() if tp.partition == partition}
        await self._forget({partition}, "abandoned", error=error)
        if tps and not self._stop.is_set():
            self._start_take_over(tps, again=True)
