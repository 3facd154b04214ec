"""Which partitions the pod owns, and the only way they come and go.

A partition is *owned* once it is taken over: its previous writer fenced (InitProducerId for
``<group>-p<N>``), its committed offsets read and sought, its driver calls given a new epoch. Its
records are decided only once its state is also *held* (restored from the compacted topic, or from a
disk store's checkpoint). It leaves through :meth:`Ownership.forget` alone: released by the group, a
take-over that failed, a fence, an abandoned producer. This module is the only holder of the turn
lock and the restore lock, and it checks that a partition is still assigned to this pod before
every InitProducerId (a take-over, a retake, a renewal, a reopen), so a pod cut off from the group
coordinator cannot fence the partition's new owner.

Failures here are answered by :mod:`consumers.runtime.failure_policy`; the waits are the one
backoff, logged once per episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition

from consumers.runtime.effects import EffectRunner
from consumers.runtime.failure_policy import Action, Site, classify, decide
from consumers.runtime.forget_log import Forgotten, log_forgotten
from consumers.runtime.kafka.sink import BatchSink, PartitionSinks
from consumers.runtime.kafka.txn_producer import DEADLINE_GRACE_S
from consumers.runtime.loop_watch import bounded_wait, outside_the_loop
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.pod_config import PodConfig, PodStats
from consumers.runtime.positions import Positions
from consumers.runtime.shutdown import stopped_within
from consumers.runtime.stall_guard import StallGuard
from consumers.runtime.state.interface import StateStoreFault
from consumers.runtime.state.recovery import restore_and_resume
from consumers.runtime.state.store import StateStore
from resilience.backoff import Backoff
from resilience.episode import Episode, describe

logger = logging.getLogger("sandbox_lanes.pod")

_T = TypeVar("_T")


class Ownership:
    def __init__(
        self,
        *,
        config: PodConfig,
        store: StateStore,
        effects: EffectRunner,
        stats: PodStats,
        metrics: PodMetrics,
        stall_guard: StallGuard,
        stop: asyncio.Event,
        ready: asyncio.Event,
    ) -> None:
        self.config = config
        self.store = store
        self.effects = effects
        self.stats = stats
        self.metrics = metrics
        self.stall_guard = stall_guard
        self._stop = stop
        self._ready = ready
        self.consumer: AIOKafkaConsumer | None = None
        self.sinks: PartitionSinks | None = None
        #: The turn lock: a turn, a release, a forget and the moment a take-over owns its partitions.
        #: Never held across a broker wait of a take-over (InitProducerId, committed offsets).
        self.batch_lock = asyncio.Lock()
        self._restore_lock = asyncio.Lock()
        #: Partitions taken over (previous writer fenced, committed offset sought, new epoch).
        #: aiokafka hands out a new assignment's records before its assignment callback ends, so
        #: records, restores and driver calls wait for this, not for ``consumer.assignment()``.
        self.owned: set[int] = set()
        #: Partitions whose writer was fenced: nothing of theirs runs until the group reassigns them.
        self.fenced: set[int] = set()
        #: Where the pod stands on each owned input partition (kept locally), and the take-over's seeks.
        self.positions = Positions(self.bounded)
        #: Set when a partition was fenced: the loop re-subscribes between turns, which rejoins.
        self.rejoin = False
        #: Owned partitions whose state is being read (a take-over's, or a rebuild's): not fetched.
        self.restoring: set[int] = set()
        #: Per partition: a producer that could not be reopened is not tried again before this.
        self._reopen_after: dict[int, float] = {}
        self._taking_over: set[asyncio.Task[None]] = set()
        self._restores: set[asyncio.Task[None]] = set()
        self._take_over_episode = Episode("taking partitions over", logger)
        self._restore_episode = Episode("restoring partitions' state", logger)
        self._reopen_episodes: dict[int, Episode] = {}
        #: Called with the partitions forgotten (the commit book drops what it held for them).
        self.on_forget: list[Callable[[set[int]], None]] = []
        #: Called when partitions may be fetched again (the turn's backpressure resumes them).
        self.on_fetchable: Callable[[], None] = lambda: None

    # --- what is owned -------------------------------------------------------------------------

    def active(self, partition: int) -> bool:
        return partition in self.owned and partition not in self.fenced

    def fetchable(self, partition: int) -> bool:
        """Owned, not fenced, and its state held (not being restored)."""
        return self.active(partition) and partition not in self.restoring

    @property
    def in_recovery(self) -> bool:
        """A take-over or a restore is under way (not ready until it ends)."""
        return bool(self._taking_over) or bool(self._restores) or self._restore_lock.locked()

    def assigned_now(self, partitions: Iterable[int]) -> set[int]:
        """Those of ``partitions`` the group assigns to this pod right now."""
        if self.consumer is None:
            return set()
        wanted = set(partitions)
        return {tp.partition for tp in self.consumer.assignment() if tp.partition in wanted}

    async def bounded(self, call: Awaitable[_T]) -> _T:
        """A broker call of the consumer's, waited on no longer than a transaction's deadline."""
        deadline_s = self.config.transaction_timeout_ms / 1000 + DEADLINE_GRACE_S
        with bounded_wait("a consumer's broker call (offsets, position)", deadline_s):
            return await asyncio.wait_for(call, deadline_s)

    # --- the group's callbacks -----------------------------------------------------------------

    def assigned(self, assigned: set[TopicPartition]) -> None:
        """Assigned (aiokafka's coordinator calls this): start taking the partitions over, return at once.

        aiokafka sends no heartbeat until the assignment callback has returned, and the take-over
        can wait long (InitProducerId waits out the previous owner's open transaction; the restore
        reads the state partition). So the partitions are paused here and taken over in a task.
        """
        if assigned:
            self._start_take_over(assigned)

    async def release(self, partitions: set[int]) -> None:
        """Revoked: forget the partitions' state, void their driver calls' results, close their writers.

        Every take-over and restore in flight is cancelled first, and again once the turn lock is
        held: a turn that held it may have started a retake meanwhile, and none may outlive the
        revocation (it would take the partition over a second time, or mark it restored for the
        next owner's epoch)."""
        await self._cancel_recovery()
        async with self.batch_lock:
            await self._cancel_recovery()
            await self.forget(partitions, "released")

    async def _cancel_recovery(self) -> None:
        tasks = {*self._taking_over, *self._restores}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    # --- taking over ---------------------------------------------------------------------------

    def _start_take_over(
        self, assigned: set[TopicPartition], delay_s: float = 0.0, *, again: bool = False
    ) -> None:
        assert self.consumer is not None
        with contextlib.suppress(Exception):  # a partition revoked meanwhile: its take-over is moot
            self.consumer.pause(*assigned)
        take_over = self.take_over(assigned, delay_s, again=again)
        task = asyncio.get_running_loop().create_task(take_over, context=outside_the_loop())
        self._taking_over.add(task)
        task.add_done_callback(self._taking_over.discard)

    async def take_over(
        self, assigned: set[TopicPartition], delay_s: float = 0.0, *, again: bool = False
    ) -> None:
        """Fence the previous writer, read the offsets it left, own, restore, resume.

        A take-over that fails is answered by the policy (the world: forget what it did and try
        again after the take-over's backoff while the partitions stay assigned here; a rebalance
        cancels it). ``again``: the pod's own decision (an abandoned producer, a failed take-over),
        not the group's: it first waits out the stall guard's hold, so a pod that stood still past
        its session timeout hears from the group (and is revoked) before it could fence the
        partitions' new owner, and it goes on only with what is still assigned to it.
        """
        if delay_s > 0:
            await stopped_within(self._stop, delay_s)
        if self._stop.is_set():
            return
        if again:
            await self.stall_guard.clear()
        assert self.consumer is not None
        assigned = {tp for tp in assigned if tp in self.consumer.assignment()}
        if not assigned or self._stop.is_set():
            return
        partitions = {tp.partition for tp in assigned}
        try:
            await self._own(assigned, partitions)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            retry_in = self._take_over_episode.failed(exc)
            decision = decide(Site.TAKE_OVER, classify(exc))
            async with self.batch_lock:
                await self.forget(partitions, "take-over failed", error=describe(exc))
                if decision.action is Action.REBUILD and isinstance(exc, StateStoreFault):
                    self.discard_state({exc.partition}, exc.reason)
            still = {tp for tp in assigned if tp in self.consumer.assignment()}
            if still and not self._stop.is_set():
                self._start_take_over(still, retry_in, again=True)
            return
        self._take_over_episode.recovered()
        await self._restore_until_held(partitions)

    async def _own(self, assigned: set[TopicPartition], partitions: set[int]) -> None:
        assert self.sinks is not None and self.consumer is not None
        # exactly_once: InitProducerId for <group>-p<N> aborts (or waits out) the previous owner's
        # transaction, so the committed offsets read next are the stable ones. Outside the turn
        # lock: the partitions are not owned yet, so no turn touches them, and the turns of the
        # other partitions go on meanwhile.
        self.fenced -= partitions
        await self.sinks.open(self.assigned_now(partitions))
        tps = sorted(assigned)
        offsets = await asyncio.gather(*(self.bounded(self.consumer.committed(tp)) for tp in tps))
        async with self.batch_lock:
            # Nothing awaits in here: a turn sees the partitions either not owned (their records
            # dropped, fetched again from the seek) or owned with their seek done and epoch new.
            if self.assigned_now(partitions) != partitions:
                raise RuntimeError("partitions revoked while being taken over")
            for tp, offset in zip(tps, offsets, strict=True):
                if offset is not None and offset >= 0:
                    self.positions.taken_over(tp, offset)
            self.effects.own(partitions)
            self.owned |= partitions
            self.restoring |= partitions

    async def _restore_until_held(self, partitions: set[int]) -> None:
        """Restore the partitions' state, retried (the policy: rebuild, or the world's backoff)
        while they stay owned. Each partition may be fetched again as soon as its state is held
        (one that fails does not hold the others back); one no longer owned is let go."""
        pending = set(partitions)
        again = Backoff(first_s=0.05, cap_s=1.0)
        try:
            rebuilt_once: set[int] = set()
            while pending and not self._stop.is_set():
                try:
                    await self.restore({p for p in pending if p in self.owned})
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    delay = self._restore_episode.failed(exc)
                    rebuild = decide(Site.TAKE_OVER, classify(exc)).action is Action.REBUILD
                    if rebuild and isinstance(exc, StateStoreFault):
                        async with self.batch_lock:
                            self.discard_state({exc.partition}, exc.reason)
                        if exc.partition not in rebuilt_once:  # its first rebuild: at once
                            rebuilt_once.add(exc.partition)
                            delay = 0.0
                    self._settle(pending)
                    if delay > 0:
                        await stopped_within(self._stop, delay)
                    continue
                self._settle(pending)
                if pending:  # read for an epoch since replaced (revoked and given back): again
                    await stopped_within(self._stop, again.failed())
                    continue
                self._restore_episode.recovered()
        finally:
            self.restoring -= {p for p in partitions if p not in self.owned or p in self.store.owned()}
            self.on_fetchable()

    def _settle(self, pending: set[int]) -> None:
        """Let go of the pending partitions that are held now (they may be fetched) or no longer owned."""
        done = {p for p in pending if p not in self.owned or p in self.store.owned()}
        if done:
            pending -= done
            self.restoring -= done
            self.on_fetchable()

    async def restore(self, partitions: set[int]) -> None:
        """Rebuild the state of ``partitions`` not yet held; no record of theirs is decided before."""
        async with self._restore_lock:
            await restore_and_resume(
                partitions,
                owned=lambda: self.owned,
                config=self.config,
                store=self.store,
                effects=self.effects,
                stats=self.stats,
                metrics=self.metrics,
            )
        self._ready.set()

    # --- local state ---------------------------------------------------------------------------

    def discard_state(self, partitions: set[int], reason: str) -> None:
        """Throw the partitions' local state away (the topic is the truth): counted, logged once."""
        self.store.discard(partitions, reason)

    def rebuild(self, partition: int, reason: str) -> None:
        """The policy's REBUILD (the turn lock held: no transaction of the partition is under way):
        the partition's local state is thrown away and read again from the topic in a task; its
        records are not fetched, nor its results folded, until it is held again."""
        self.discard_state({partition}, reason)
        if not self.active(partition) or partition in self.restoring:
            return
        self.restoring.add(partition)
        self.on_fetchable()  # pauses it
        restore = self._restore_until_held({partition})
        task = asyncio.get_running_loop().create_task(restore, context=outside_the_loop())
        self._restores.add(task)
        task.add_done_callback(self._restores.discard)

    # --- losing partitions ---------------------------------------------------------------------

    async def forget(self, partitions: set[int], why: Forgotten, *, error: str | None = None) -> None:
        """The one way partitions leave the pod (the turn lock held): released by the group, a
        take-over that failed (retried), fenced by another writer (the pod rejoins and ignores the
        partitions until the group reassigns them), or an abandoned producer (taken over anew).
        Everything tracked for them goes: state, positions, driver calls (queued ones dropped,
        running ones' results void: the next owner re-runs them from the outbox), the commit
        book's entries (``on_forget``), and the partition's producer."""
        if not partitions:
            return
        log_forgotten(why, partitions, self.effects.outstanding, error)
        self.owned -= partitions
        self.restoring -= partitions
        if why == "fenced":
            self.fenced |= partitions
        else:
            self.fenced -= partitions
        self.positions.forget(partitions)
        self.effects.disown(partitions)
        self.store.drop(partitions)
        for p in partitions:
            self._reopen_after.pop(p, None)
            self._reopen_episodes.pop(p, None)
        for listener in self.on_forget:
            listener(partitions)
        if self.sinks is not None:
            await self.sinks.close(partitions)

    async def stand_down(self, partition: int, error: str) -> None:
        """(The turn lock held.) Fenced: forget the partition and rejoin the group between turns."""
        self.metrics.fences.inc()
        await self.forget({partition}, "fenced", error=error)
        self.rejoin = True

    async def retake(self, partition: int, error: str) -> None:
        """(The turn lock held.) Forget the partition and take it over again after the take-over's
        backoff, if still assigned here (its producer's transaction has an unknown fate: the new
        producer's InitProducerId settles it before the offsets and state are read again)."""
        assert self.consumer is not None
        self.metrics.producers_abandoned.inc()
        tps = {tp for tp in self.consumer.assignment() if tp.partition == partition}
        delay = self._take_over_episode.failed(error)
        await self.forget({partition}, "abandoned", error=error)
        if tps and not self._stop.is_set():
            self._start_take_over(tps, delay, again=True)

    # --- the partition's producer --------------------------------------------------------------

    async def renew(self, partition: int) -> None:
        """A new producer for the partition (a new epoch restarts its sequence numbers)."""
        assert self.sinks is not None
        await self.sinks.close({partition})
        self._reopen_after.pop(partition, None)
        await self.reopen(partition)

    def store_lost(self, partition: int) -> bool:
        """Its local state is no longer held (thrown away for a rebuild): nothing more is decided."""
        return partition not in self.store.owned()

    def reopen_waits(self, partition: int, now: float) -> bool:
        """Its producer could not be reopened and is not tried again yet: not fetched meanwhile."""
        return self._reopen_after.get(partition, 0.0) > now

    async def reopen(self, partition: int) -> BatchSink | None:
        """The owned partition's producer, opened anew if it was closed after a failure; None while
        the broker is out of reach (tried again after the backoff) or the partition is no longer
        assigned here, or fenced (it stands down)."""
        assert self.sinks is not None
        sink = self.sinks.get(partition)
        if sink is not None or not self.active(partition):
            return sink
        if time.monotonic() < self._reopen_after.get(partition, 0.0):
            return None
        if self.stall_guard.holding or not self.assigned_now({partition}):
            # Revoked (the group's callback forgets it), or the loop stood still past what the
            # group allows: the group may have given the partition to another pod, whose producer
            # a new InitProducerId here would fence. Tried again once the group has answered.
            return None
        episode = self._reopen_episodes.get(partition)
        if episode is None:
            episode = Episode("reopening the partition's producer", logger, extra={"partition": partition})
            self._reopen_episodes[partition] = episode
        try:
            await self.sinks.open({partition})
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            decision = decide(Site.REOPEN, classify(exc))
            if decision.action is Action.STAND_DOWN:
                await self.stand_down(partition, describe(exc))
                return None
            self._reopen_after[partition] = time.monotonic() + episode.failed(exc)
            return None
        episode.recovered()
        return self.sinks.get(partition)

    # --- stopping ------------------------------------------------------------------------------

    async def cancel_tasks(self, wait_s: float) -> None:
        tasks = {*self._taking_over, *self._restores}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=wait_s)


__all__ = ["Forgotten", "Ownership"]
