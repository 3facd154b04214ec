"""The pod: its parts, its lifecycle and its health.

The pod's jobs live in rooms of their own: :mod:`~consumers.runtime.ownership` (which partitions
are owned, taking them over, losing them, positions, the turn and restore locks),
:mod:`~consumers.runtime.turn` (the loop: fetch, one transaction per partition number, drain),
:mod:`~consumers.runtime.commit_book` (what follows a commit and a failure) and
:mod:`~consumers.runtime.failure_policy` (the one table that answers every failure). This module
starts them, stops them within the shutdown bound, and says how the pod is (``/healthz``,
``/readyz``). Writes are staged in an overlay and folded into the state store only once committed,
so an aborted or failed transaction leaves the store equal to the topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import murmur2

from consumers.lanes.commands import Command, CommandResult
from consumers.runtime.capacity_ledger import CapacityLedgerTask
from consumers.runtime.capacity_metrics import CapacityMetrics
from consumers.runtime.commit_book import CommitBook
from consumers.runtime.config_log import record_lane_config_soon
from consumers.runtime.create_order import CreateOrderGate
from consumers.runtime.effects import EffectRunner
from consumers.runtime.kafka.clients import (
    RebalanceHooks,
    group_consumer_for,
    producer_options_for,
    txn_producer_config,
)
from consumers.runtime.kafka.codecs import require_codecs
from consumers.runtime.kafka.sink import PartitionSinks
from consumers.runtime.kafka.topology import prepare_pod_topics
from consumers.runtime.loop_watch import LoopWatch
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.ownership import Ownership
from consumers.runtime.periodic import move_checkpoints, watch_cluster
from consumers.runtime.pod_config import Health, PodConfig, PodStats, assess_health
from consumers.runtime.processor import LaneProcessor
from consumers.runtime.shutdown import end_tasks, run_until_bound
from consumers.runtime.stall_guard import StallGuard
from consumers.runtime.state.store import HeldStates, MemoryStore, StateStore
from consumers.runtime.turn import Turns

logger = logging.getLogger("sandbox_lanes.pod")

#: Part of the shutdown bound kept for closing the consumer and producer.
_CLOSE_RESERVE_S = 5.0


class _UnwaitedExecutor(ThreadPoolExecutor):
    """The loop's default executor (driver SDK calls): its shutdown never waits on a call.

    ``asyncio.run`` ends by shutting the default executor down and, on Python 3.11, waits for
    every call in it without a bound: a driver call stuck in its SDK would keep a stopped pod
    alive. The stop has its own bound (``SANDBOX_LANES_SHUTDOWN_TIMEOUT_S``); past it nothing is
    waited on (the CLI exits without joining what is left, see ``tools.cli``).
    """

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)


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
        #: When the loop last turned, and the broker waits it is in (liveness, ``/healthz``).
        self.loop_watch = LoopWatch()
        self._running = False
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._stop_requested_at: float | None = None
        #: Tasks tied to the pod's life (the periodic reaper): awaited within the shutdown bound on stop.
        self._background: list[asyncio.Task[None]] = []
        #: Driver calls wait out a loop stall that may have cost the partitions (a paused pod).
        self.stall_guard = StallGuard(config.session_timeout_ms / 1000, config.heartbeat_interval_ms / 1000)
        self.effects = EffectRunner(self._run_effect, config.driver_concurrency, gate=self.stall_guard.clear)
        self._create_gate = CreateOrderGate(config.topics.execution_created)
        self.ownership = Ownership(
            config=config,
            store=self._store,
            effects=self.effects,
            stats=self.stats,
            metrics=self.metrics,
            stall_guard=self.stall_guard,
            stop=self._stop,
            ready=self.ready,
        )
        self.book = CommitBook(
            config=config,
            processor=processor,
            ownership=self.ownership,
            effects=self.effects,
            gate=self._create_gate,
            stats=self.stats,
            metrics=self.metrics,
        )
        self.turns = Turns(
            config=config,
            processor=processor,
            ownership=self.ownership,
            book=self.book,
            effects=self.effects,
            gate=self._create_gate,
            stats=self.stats,
            metrics=self.metrics,
            stop=self._stop,
            touch=self._touch,
            resubscribe=self._subscribe,
        )
        self._config_record: asyncio.Task[None] | None = None

    # --- what others read ----------------------------------------------------------------------

    @property
    def states(self) -> HeldStates:
        """The execution states this pod holds (committed ones only), read-only."""
        return self._store

    @property
    def turn_in_progress(self) -> bool:
        """A turn (or a take-over, a release) is changing the pod's partitions or positions now."""
        return self.ownership.batch_lock.locked()

    @property
    def consumer(self) -> AIOKafkaConsumer | None:
        """The group consumer while the pod runs (for lag gauges and diagnostics)."""
        return self.ownership.consumer

    @property
    def stopping(self) -> asyncio.Event:
        """Set once a stop was requested (read-only use: background tasks wait on it)."""
        return self._stop

    def run_beside(self, task: asyncio.Task[None]) -> None:
        """Tie ``task`` to the pod's life: it is awaited within the shutdown bound when the pod stops."""
        self._background.append(task)

    def input_partition_of(self, key: str) -> int | None:
        """The execution-created partition the default partitioner sends ``key`` to (``None``:
        the topic's partition count is not known yet). Agent executions are keyed by session id,
        so this is where a session's executions and their states live."""
        consumer = self.consumer
        partitions = consumer.partitions_for_topic(self.config.topics.execution_created) if consumer else None
        if not partitions:
            return None
        hashed: int = murmur2(key.encode("utf-8"))
        return (hashed & 0x7FFFFFFF) % len(partitions)

    def health(self, stall_after_s: float = 30.0) -> Health:
        """What /healthz and /readyz answer now (see :func:`assess_health`)."""
        consumer = self.consumer
        now = time.monotonic()
        loop = self.loop_watch.assess()
        return assess_health(
            now=now,
            running=self._running,
            last_loop=now - loop.since_turned_s,
            stalled_s=loop.stalled_s,
            waiting_for=loop.waiting_for,
            stats=self.stats,
            assigned=len(consumer.assignment()) if consumer is not None else 0,
            restoring=self.ownership.in_recovery,
            restored=self.ready.is_set(),
            stall_after_s=stall_after_s,
        )

    # --- lifecycle -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """SIGTERM: stop taking new records; the record in flight is finished, the batch so far committed."""
        if self._stop_requested_at is None:
            self._stop_requested_at = time.monotonic()
        self._stop.set()

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
        self._config_record = record_lane_config_soon(cfg, self.processor.config)  # beside the start
        consumer = group_consumer_for(cfg)
        await consumer.start()
        self.ownership.consumer = self.ownership.positions.consumer = consumer
        self.ownership.sinks = PartitionSinks(
            consumer,
            cfg.group_id,
            cfg.guarantee,
            producer_options_for(cfg),
            txn_config=txn_producer_config(cfg),
            transaction_timeout_s=cfg.transaction_timeout_ms / 1000,
            sequential=cfg.sequential_produce,
        )
        await self.ownership.sinks.start()
        self._subscribe()
        logger.info(
            "pod started",
            extra={"podId": cfg.pod_id, "guarantee": cfg.guarantee, "groupId": cfg.group_id},
        )

    def _subscribe(self) -> None:
        consumer = self.consumer
        assert consumer is not None
        consumer.subscribe(
            list(self.config.topics.consumed),
            listener=RebalanceHooks(self.ownership.release, self.ownership.assigned),
        )

    async def stop(self) -> None:
        """Close everything, each step bounded and none able to fail the stop (an outage: a
        consumer whose leave-group cannot reach the coordinator is left behind); the local store is
        always closed."""
        try:
            await self.ownership.cancel_tasks(_CLOSE_RESERVE_S)
            if self._config_record is not None and not self._config_record.done():
                self._config_record.cancel()  # its retries end with the pod
                await asyncio.wait({self._config_record}, timeout=_CLOSE_RESERVE_S / 2)
            with contextlib.suppress(Exception):  # a last checkpoint (proven: safe past a take-over too)
                await asyncio.wait_for(self._store.checkpoint(self._store.owned()), _CLOSE_RESERVE_S / 2)
            consumer, sinks = self.ownership.consumer, self.ownership.sinks
            if consumer is not None:
                await _bounded_close("the consumer", consumer.stop(), _CLOSE_RESERVE_S)
            if sinks is not None:
                await _bounded_close("the producers", sinks.stop(), _CLOSE_RESERVE_S)
        finally:
            with contextlib.suppress(Exception):
                self._store.close()
            self.ownership.consumer = None
            self.ownership.sinks = None

    async def run(self) -> None:
        """Start, process until stop is requested, then finish the batch in flight and close."""
        await self.start()
        self._running = True
        loop = asyncio.get_running_loop()
        self._background.append(loop.create_task(self.stall_guard.watch(self._stop)))
        self._background.append(loop.create_task(move_checkpoints(self._store, self.ownership, self._stop)))
        self._background.append(loop.create_task(watch_cluster(lambda: self.consumer, self._stop)))
        if self.config.topics.capacity_on:  # the capacity ledger: owned by one pod of the group
            ledger = CapacityLedgerTask(self.config, CapacityMetrics(self.metrics.registry), self._stop)
            self._background.append(loop.create_task(ledger.run()))
        try:
            await self._bounded_loop()
        finally:
            self._running = False
            await self._stop_background()
            await self.effects.cancel()
            try:
                await asyncio.wait_for(
                    self.stop(), max(_CLOSE_RESERVE_S, self._remaining()) + _CLOSE_RESERVE_S
                )
            except TimeoutError:  # every step is bounded; this is the last guard of the exit code
                logger.warning("closing the pod's clients outlived its bound; exiting without them")
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
            self._watched_loop(), self._stop, lambda: self._remaining() - _CLOSE_RESERVE_S, bound_reached
        )

    async def _watched_loop(self) -> None:
        """The loop, in a task of its own that serves the loop watch: its bounded broker waits (and
        those of the per-partition transactions it starts) are not counted as standing still."""
        with self.loop_watch.serving():
            await self.turns.loop()

    async def _stop_background(self) -> None:
        self._stop.set()  # background tasks end on the stop signal too (also when the loop raised)
        await end_tasks(self._background, self._remaining() - _CLOSE_RESERVE_S, _CLOSE_RESERVE_S)

    async def _run_effect(self, command: Command) -> CommandResult:
        return await self.processor.runner.run(command)

    def _touch(self) -> None:
        self.loop_watch.turned()


async def _bounded_close(what: str, closing: Awaitable[Any], seconds: float) -> None:
    """Close one client within ``seconds``; past them (an outage) it is left behind, logged."""
    try:
        await asyncio.wait_for(closing, seconds)
    except TimeoutError:
        logger.warning(f"closing {what} outlived {seconds:.0f} s; left behind", extra={"seconds": seconds})
    except asyncio.CancelledError:
        # aiokafka's stop cancels its fetch task and awaits it; a fetch asleep in its retry
        # backoff (an outage) lets that CancelledError out. Only a cancellation of the stop
        # itself goes on up: this one is the client's, and the stop is not over.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        logger.warning(f"closing {what} was cut short by the client's own cancelled task; left behind")
    except Exception as exc:  # the world, while stopping: nothing left to do with it
        logger.warning(f"closing {what} failed", extra={"error": repr(exc)[:300]})
