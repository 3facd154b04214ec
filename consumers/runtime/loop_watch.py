"""How long the pod's loop has stood still: liveness that tells a dead loop from one waiting out the world.

The loop turns every poll, but a turn may wait on the broker for a long time by design: each
librdkafka call of a transaction (InitProducerId, the offsets, the commit, the abort) is given the
transaction timeout and waited on to a deadline a little past it, and a failed transaction's
handling can chain several such calls (an abort, then a new producer's InitProducerId). After an
outage every pod meets those waits at once. Counting them as a stalled loop would have the
liveness probe restart a pod in the middle of its recovery (issue 42: 33.3 s after a ten-minute
outage), which only adds a restore.

So a wait with a bound of its own says so (:func:`bounded_wait`): while it is within its bound the
loop is not standing still; past it, the overrun counts. Beginning or ending a wait is the loop
moving. What the liveness window judges is the time the loop stood still beyond every bound it
declared (:func:`stalled_for`, pure); a loop stuck anywhere else (a lock never released, an
await with no bound) still fails it after the window. The raw time since the loop last turned is
reported beside it.

Only the loop's own waits count: the loop serves the watch in its task (:meth:`LoopWatch.serving`),
tasks it starts inherit it (a turn's per-partition transactions), and the tasks that are not the
loop's (a take-over, a restore) are started with :func:`outside_the_loop`.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

#: The watch of the loop the current task works for (None outside the loop).
_WATCH: contextvars.ContextVar[LoopWatch | None] = contextvars.ContextVar("loop_watch", default=None)


@dataclass(frozen=True)
class Wait:
    """A wait of the loop's in progress: what it waits for, since when, and until when at most."""

    what: str
    began: float
    deadline: float


@dataclass(frozen=True)
class LoopState:
    """What the health endpoints say of the loop."""

    #: Since the loop last turned (a fetch answered, a record decided), waits included.
    since_turned_s: float
    #: Stood still beyond the bounds of the waits it declared: what the liveness window judges.
    stalled_s: float
    #: The waits in progress, in words ("" when none).
    waiting_for: str


def stalled_for(now: float, moved_at: float, waits: Iterable[Wait]) -> float:
    """Seconds the loop has stood still beyond what its waits allow: since the later of its last
    move and the deadline of each wait in progress (a wait within its bound covers up to now)."""
    covered = moved_at
    for wait in waits:
        covered = max(covered, min(now, wait.deadline))
    return max(0.0, now - covered)


def describe_waits(now: float, waits: Iterable[Wait], limit: int = 3) -> str:
    """The waits in progress, longest-bound first, in words."""
    ordered = sorted(waits, key=lambda w: w.deadline, reverse=True)
    parts = [
        f"{w.what} ({now - w.began:.1f} s of its {w.deadline - w.began:.0f} s bound)" for w in ordered[:limit]
    ]
    if len(ordered) > limit:
        parts.append(f"and {len(ordered) - limit} more")
    return "; ".join(parts)


class LoopWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        now = clock()
        self._turned_at = now
        self._moved_at = now
        self._waits: dict[int, Wait] = {}
        self._ids = itertools.count()

    def turned(self) -> None:
        """The loop turned (a fetch answered, a record decided, a failure answered)."""
        self._turned_at = self._moved_at = self._clock()

    def assess(self) -> LoopState:
        now = self._clock()
        waits = list(self._waits.values())
        stalled = stalled_for(now, self._moved_at, waits)
        return LoopState(now - self._turned_at, stalled, describe_waits(now, waits))

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """The current task is the loop: its bounded waits (and those of tasks it starts) count."""
        token = _WATCH.set(self)
        try:
            yield
        finally:
            _WATCH.reset(token)

    def _begin(self, what: str, bound_s: float) -> int:
        now = self._clock()
        self._moved_at = now
        key = next(self._ids)
        self._waits[key] = Wait(what, now, now + bound_s)
        return key

    def _end(self, key: int) -> None:
        self._waits.pop(key, None)
        self._moved_at = self._clock()


@contextlib.contextmanager
def bounded_wait(what: str, bound_s: float) -> Iterator[None]:
    """Around a wait that ends within ``bound_s`` by construction (its own deadline): within it, the
    loop is not standing still. A no-op outside the loop."""
    watch = _WATCH.get()
    if watch is None:
        yield
        return
    key = watch._begin(what, bound_s)
    try:
        yield
    finally:
        watch._end(key)


def outside_the_loop() -> contextvars.Context:
    """A context for a task that is not the loop's (a take-over, a restore): its waits do not count
    as the loop's."""
    context = contextvars.copy_context()
    context.run(_WATCH.set, None)
    return context


__all__ = [
    "LoopState",
    "LoopWatch",
    "Wait",
    "bounded_wait",
    "describe_waits",
    "outside_the_loop",
    "stalled_for",
]
