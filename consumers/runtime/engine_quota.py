"""Ensures waiting out an engine that refused them for quota, and what wakes them.

An ensure the engine refused as full (:class:`~drivers.contract.CapacityRefused`) sleeps with its own
:class:`~resilience.backoff.Backoff` between attempts. Capacity frees when a sandbox ends, so every
successful teardown of this pod wakes the waiter that has waited longest (first refused, first
woken); one admitted after a wait wakes the next (capacity was there a moment ago). One wake per
freed sandbox, not all of them: a thousand waiters woken by each teardown would each ask the engine
again for the one place that freed. A wake that comes while a waiter is calling the engine is kept
for its next sleep, which then ends at once. A woken waiter starts its backoff over: an engine may
show the freed room only seconds after the teardown (a Kubernetes pod counts against its quota until
it has terminated), so it asks again soon and then less and less often.
"""

from __future__ import annotations

import asyncio
import contextlib

from consumers.runtime.metrics import PodMetrics


class QuotaWaiter:
    """One ensure's wait for engine capacity (from its first refusal to its admission or time-out)."""

    def __init__(self, since: float) -> None:
        self.since = since
        self.attempts = 1
        self._woken = asyncio.Event()

    @property
    def woken(self) -> bool:
        return self._woken.is_set()

    def wake(self) -> None:
        self._woken.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep ``seconds`` or until woken; True when woken. The wake is used up either way."""
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self._woken.wait()
            return self._woken.is_set()
        finally:
            self._woken.clear()


class EngineQuotaWaits:
    """The ensures of this pod waiting for engine capacity, oldest first."""

    def __init__(self, metrics: PodMetrics | None = None) -> None:
        self._metrics = metrics
        #: Insertion order is the order of first refusal (a dict as an ordered set).
        self._waiting: dict[QuotaWaiter, None] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def begin(self, driver: str) -> QuotaWaiter:
        waiter = QuotaWaiter(asyncio.get_running_loop().time())
        self._waiting[waiter] = None
        if self._metrics is not None:
            self._metrics.engine_quota_waits.labels(driver).inc()
            self._metrics.engine_quota_waiting.set(len(self._waiting))
        return waiter

    def end(self, waiter: QuotaWaiter, driver: str, *, timed_out: bool) -> None:
        self._waiting.pop(waiter, None)
        if self._metrics is not None:
            if timed_out:
                self._metrics.engine_quota_timeouts.labels(driver).inc()
            self._metrics.engine_quota_waiting.set(len(self._waiting))

    def freed(self) -> None:
        """A sandbox ended (a teardown succeeded) or one was admitted: wake the longest waiter not yet
        woken."""
        for waiter in self._waiting:
            if not waiter.woken:
                waiter.wake()
                return
