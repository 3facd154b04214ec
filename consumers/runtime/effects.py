"""Driver calls off the transaction: concurrent across sandboxes, in order within one.

The pod commits a decision (its effects included) first and only then hands
the entries here. Each call runs in its own task, bounded by a semaphore (the
driver concurrency), and calls for one sandbox (scope + id) run one after the
other in submission order: a terminal teardown submitted while its ensure is in
flight waits for the ensure. Results are collected as :class:`Completion` values
for the pod to fold back in a later, short transaction.

Ownership: every call carries the partition's ownership epoch. When a partition
is revoked its queued calls are dropped (the next owner re-runs them from the
state's outbox) and the results of calls already running are discarded. The
epoch is checked again right before the driver is called, after the gate (the
pod's :class:`~consumers.runtime.stall_guard.StallGuard`) has let the call through.

A call that waits inside the run callable (an ensure the engine refused as full, waiting for capacity)
gives its slot up for the wait with :func:`slot_given_up` and takes it back, behind the gate, before it
calls the driver again: a wait never holds a driver-concurrency slot. :func:`call_current` tells it
whether its partition is still owned (a disowned call stops waiting: its result would be discarded).

Work that is not an effect but acts on a sandbox (the reaper's removal) takes its turn in the same
order with :meth:`EffectRunner.exclusive`: it runs after every call queued for that sandbox, and a call
submitted while it waits or runs waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextvars import ContextVar
from typing import NamedTuple, TypeVar

from consumers.lanes.commands import Command, CommandResult
from consumers.runtime import tracing

logger = logging.getLogger("sandbox_lanes.effects")

Run = Callable[[Command], Awaitable[CommandResult]]
#: Awaited right before each driver call (the pod's stall guard): returns when the call may run.
Gate = Callable[[], Awaitable[None]]
_T = TypeVar("_T")


class Completion(NamedTuple):
    partition: int
    key: str
    """The state key (execution id, or session id for a session delete)."""
    effect_id: str
    command: Command
    result: CommandResult
    started: float
    finished: float
    trace: str = ""
    """The ``traceparent`` of the driver call's span when tracing is on (the fold's outcome records
    carry it on); "" when off."""


class _Call(NamedTuple):
    partition: int
    epoch: int
    key: str
    effect_id: str
    command: Command


class _Turn(NamedTuple):
    """Work of no partition holding a sandbox's turn (:meth:`EffectRunner.exclusive`)."""

    work: Callable[[], Awaitable[object]]
    done: asyncio.Future[object]


_Entry = _Call | _Turn


class _SlotLease:
    """The driver-concurrency slot a running call holds, which it may give up while it waits."""

    def __init__(self, slots: asyncio.Semaphore, gate: Gate | None, current: Callable[[], bool]) -> None:
        self._slots = slots
        self._gate = gate
        self.current = current
        self.held = False

    async def acquire(self) -> None:
        await self._slots.acquire()
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._slots.release()

    @contextlib.asynccontextmanager
    async def given_up(self) -> AsyncIterator[None]:
        self.release()
        try:
            yield
        finally:
            # Cancelled while taking it back: ``held`` stays False and nothing is released twice.
            await self.acquire()
            if self._gate is not None:
                await self._gate()


#: The lease of the call the current task is running (set by :meth:`EffectRunner._drive`).
_LEASE: ContextVar[_SlotLease | None] = ContextVar("sandbox_lanes_effect_slot", default=None)


@contextlib.asynccontextmanager
async def slot_given_up() -> AsyncIterator[None]:
    """For the block, the running call's driver-concurrency slot is free for other calls; it is taken
    back (behind the gate) when the block ends. Outside an effect runner's call: nothing to give up."""
    lease = _LEASE.get()
    if lease is None:
        yield
        return
    async with lease.given_up():
        yield


def call_current() -> bool:
    """Does the running call's partition still belong to this pod (same epoch)? True outside one."""
    lease = _LEASE.get()
    return lease is None or lease.current()


class EffectRunner:
    def __init__(self, run: Run, concurrency: int, gate: Gate | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"driver concurrency must be at least 1, got {concurrency}")
        self._run = run
        self._gate = gate
        self._slots = asyncio.Semaphore(concurrency)
        self.concurrency = concurrency
        #: Per sandbox: the calls waiting behind the one running (a chain exists while it has work).
        self._chains: dict[tuple[str, str], list[_Entry]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Effect id -> the call submitted and not yet completed or dropped. A resubmission is
        #: ignored while that call belongs to the partition's current epoch; a call of an old
        #: epoch (still running after its partition was disowned) does not block a new one.
        self._taken: dict[str, _Call] = {}
        self._epochs: dict[int, int] = {}
        self._done: list[Completion] = []
        self.ready = asyncio.Event()
        """Set when completions are waiting to be taken."""
        #: Tracing on (consumers.runtime.tracing): the ``traceparent`` its decision recorded with an
        #: effect, by (partition, state key, effect id), and the driver's name for the call's span.
        self.trace_of: Callable[[int, str, str], str] | None = None
        self.driver = ""

    # --- ownership ----------------------------------------------------------------------------

    def own(self, partitions: Iterable[int]) -> None:
        """The pod (again) owns these partitions: a new epoch, so results of an old one are void."""
        for p in partitions:
            self._epochs[p] = self._epochs.get(p, 0) + 1

    def disown(self, partitions: Iterable[int]) -> None:
        """Revoked or fenced: queued calls are dropped, results of running ones discarded."""
        gone = set(partitions)
        for p in gone:
            self._epochs[p] = self._epochs.get(p, 0) + 1
        for chain in self._chains.values():
            # The head (index 0) is running: it is kept so the chain stays ordered behind it. A turn
            # belongs to no partition: it stays.
            kept = [chain[0]] + [c for c in chain[1:] if isinstance(c, _Turn) or c.partition not in gone]
            for call in chain[1:]:
                if isinstance(call, _Call) and call.partition in gone:
                    self._forget(call)
            chain[:] = kept
        dropped = [c for c in self._done if c.partition in gone]
        self._done = [c for c in self._done if c.partition not in gone]
        for completion in dropped:
            self._taken.pop(completion.effect_id, None)

    def epoch(self, partition: int) -> int:
        """The partition's ownership epoch (changes on every own/disown)."""
        return self._epochs.get(partition, 0)

    def _current(self, call: _Call) -> bool:
        return self._epochs.get(call.partition, 0) == call.epoch

    def _forget(self, call: _Call) -> None:
        if self._taken.get(call.effect_id) is call:
            del self._taken[call.effect_id]

    # --- work ---------------------------------------------------------------------------------

    def submit(self, partition: int, key: str, effect_id: str, command: Command) -> bool:
        """Queue one call; False when the same effect id is already queued or running.

        A call of an old epoch with the same id (its partition was disowned while it ran) does
        not count: the new call queues behind it on the sandbox's chain, so the outbox's order
        holds — a teardown never overtakes the ensure it follows.
        """
        previous = self._taken.get(effect_id)
        if previous is not None and self._current(previous):
            return False
        call = _Call(partition, self._epochs.get(partition, 0), key, effect_id, command)
        self._taken[effect_id] = call
        self._enqueue((command.scope, command.sandbox_id), call)
        return True

    def _enqueue(self, sandbox: tuple[str, str], entry: _Entry) -> None:
        chain = self._chains.get(sandbox)
        if chain is not None:
            chain.append(entry)
            return
        self._chains[sandbox] = [entry]
        task = asyncio.get_running_loop().create_task(self._drive(sandbox))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def exclusive(self, scope: str, sandbox_id: str, work: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``work`` in the sandbox's turn: after every call queued for it now, before any submitted
        later (which waits until ``work`` has returned), within the driver concurrency and behind the
        gate, as an effect's call. Its result or exception is the caller's. Cancelling the caller
        while it waits gives the turn up; a runner that is cancelled (shutdown) cancels it."""
        done: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._enqueue((scope, sandbox_id), _Turn(work, done))
        result = await done
        return result  # type: ignore[return-value]

    @property
    def outstanding(self) -> int:
        """Calls queued or running, plus results not yet taken."""
        return len(self._taken)

    def take(self) -> list[Completion]:
        """The results so far, in completion order; the caller folds them back."""
        done, self._done = self._done, []
        self.ready.clear()
        for completion in done:
            self._taken.pop(completion.effect_id, None)
        return done

    async def _drive(self, sandbox: tuple[str, str]) -> None:
        loop = asyncio.get_running_loop()
        chain = self._chains[sandbox]
        try:
            while chain:
                call = chain[0]
                if isinstance(call, _Turn):
                    await self._take_turn(call)
                elif self._current(call):
                    lease = _SlotLease(self._slots, self._gate, functools.partial(self._current, call))
                    await lease.acquire()
                    held = _LEASE.set(lease)
                    try:
                        # Ownership is judged when the call is about to run, not when it queued:
                        # the partition may have moved while it waited for a slot or a stall's hold.
                        if self._gate is not None:
                            await self._gate()
                        current = self._current(call)
                        trace = ""
                        if current:
                            started = loop.time()
                            active = tracing.ACTIVE
                            if active is None:
                                result = await self._run(call.command)
                            else:
                                decision = (
                                    self.trace_of(call.partition, call.key, call.effect_id)
                                    if self.trace_of is not None
                                    else ""
                                )
                                result, trace = await active.effect(
                                    decision, call.command, self.driver, self._run
                                )
                    finally:
                        _LEASE.reset(held)
                        lease.release()
                    finished = loop.time()
                    if current and self._current(call):
                        done = Completion(
                            call.partition,
                            call.key,
                            call.effect_id,
                            call.command,
                            result,
                            started,
                            finished,
                            trace,
                        )
                        self._done.append(done)
                        self.ready.set()
                    else:
                        self._forget(call)
                else:
                    self._forget(call)
                chain.pop(0)
        except Exception:  # the run callable turns failures into results; this is a bug guard
            logger.exception("effect chain failed", extra={"sandbox": "/".join(sandbox)})
            for call in chain:
                if isinstance(call, _Call):
                    self._forget(call)
            chain.clear()
        finally:
            for entry in chain:  # cancelled (shutdown): nobody waits on a turn for ever
                if isinstance(entry, _Turn) and not entry.done.done():
                    entry.done.cancel()
            del self._chains[sandbox]

    async def _take_turn(self, turn: _Turn) -> None:
        if turn.done.done():
            return  # its caller gave up waiting
        async with self._slots:
            if self._gate is not None:
                await self._gate()
            try:
                result = await turn.work()
            except asyncio.CancelledError:
                turn.done.cancel()
                raise
            except Exception as exc:
                if not turn.done.done():
                    turn.done.set_exception(exc)
                return
        if not turn.done.done():
            turn.done.set_result(result)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is queued or running (shutdown); True when idle in time."""
        if not self._tasks:
            return True
        _, late = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        return not late

    async def cancel(self) -> None:
        """Cancel whatever still runs (past the shutdown bound): the next owner re-runs it."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5.0)
