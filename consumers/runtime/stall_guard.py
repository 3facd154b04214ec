"""No driver call from a pod that may have lost its partitions while it stood still.

A pod whose process was paused (SIGSTOP, a VM freeze, a long GC or a blocked loop) past its
session timeout has been dropped from the group, and its partitions may already belong to another
pod; but when it resumes, its queued driver calls are runnable before its heartbeat has told it
so. Its Kafka writes are fenced (per-partition transactional ids), its driver calls are not: a
resumed zombie could create a sandbox for an execution the new owner has already torn down.

So every driver call first passes :meth:`StallGuard.clear`. The guard watches the event loop with
a short tick; a gap long enough to have cost the membership (the session timeout minus two
heartbeat intervals, at least 1 s) holds every call for two heartbeat intervals. In that time the
resumed consumer's first heartbeat is answered: a pod still in its generation goes on; a pod that
was dropped rejoins, its partitions are revoked first, and the effect runner drops the held calls
of the old epoch (the next owner re-runs them from the state's outbox). The check is made when the
call is about to run, so it holds even when the call's task wakes before the watch does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from consumers.runtime.shutdown import stopped_within

logger = logging.getLogger("sandbox_lanes.pod")

#: How often the watch looks at the clock.
TICK_S = 0.1


class StallGuard:
    def __init__(
        self,
        session_timeout_s: float,
        heartbeat_interval_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        #: A gap at least this long may have cost the group membership.
        self.stall_s = max(1.0, session_timeout_s - 2 * heartbeat_interval_s)
        #: How long calls wait after such a gap: time for a heartbeat's answer and a revocation.
        self.hold_s = 2 * heartbeat_interval_s
        self._clock = clock
        self._last = clock()
        self._held_until = 0.0
        #: Stalls seen so far.
        self.stalls = 0
        #: Only a watched loop has gaps that mean something (no watch: no hold).
        self._watching = False

    def observe(self) -> float:
        """The loop is running now; a long gap since the last look starts a hold. Returns now."""
        now = self._clock()
        gap = now - self._last
        self._last = now
        if gap >= self.stall_s and self._watching:
            self.stalls += 1
            self._held_until = now + self.hold_s
            logger.warning(
                "event loop stood still: driver calls held until the group has answered",
                extra={"stalledSeconds": round(gap, 1), "holdSeconds": self.hold_s},
            )
        return now

    @property
    def holding(self) -> bool:
        return self._clock() < self._held_until

    async def watch(self, stop: asyncio.Event) -> None:
        """Tick until ``stop`` is set (a background task of the pod)."""
        self.observe()
        self._watching = True
        try:
            while not stop.is_set():
                self.observe()
                await stopped_within(stop, TICK_S)
        finally:
            self._watching = False

    async def clear(self) -> None:
        """Return at once in a healthy pod; after a stall, once its hold has passed."""
        now = self.observe()
        while now < self._held_until:
            await asyncio.sleep(min(TICK_S, self._held_until - now))
            now = self.observe()
