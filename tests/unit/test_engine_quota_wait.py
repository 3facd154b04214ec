"""The executor waits out an engine that refuses ensures for quota (issue 44, item 3).

A fake driver that refuses N times stands in for the engine here; the real path (a ResourceQuota on
the harness's Kubernetes node, the pod through real Kafka) is
``tests/integration/test_kubernetes_quota.py``. No sleep decides a verdict: a test waits for the fact
it needs (a refusal seen, a call completed) with a deadline, and the backoff's first delay is made long
(minutes) where a test shows that something else (a teardown, another call) gets through first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import ClassVar

from consumers.lanes.commands import CommandResult, Deprovision, Ensure
from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.runtime.effects import EffectRunner
from consumers.runtime.executor import DriverExecutor
from consumers.runtime.metrics import PodMetrics
from drivers.contract import (
    CapacityRefused,
    ManagedSandbox,
    SandboxEnvironment,
    SandboxProbeState,
    SandboxScope,
    ScopedMethods,
)
from resilience.backoff import Backoff
from tests.support.lane_fakes import DisabledCredentials

MINT = SandboxCredentialRequest("workflow", "", "wfx", "org", "usr")
LOG = logging.getLogger("sandbox_lanes.test.quota")
QUOTA = 'pods "sbx-w-1" is forbidden: exceeded quota: sandbox-quota, requested: pods=1, used: pods=3, limited: pods=3'
LONG = 600.0  # a backoff delay no test waits out: something else must end the sleep


def ensure(sandbox_id: str) -> Ensure:
    return Ensure("workflow", sandbox_id, f"wfexec:{sandbox_id}", "", MINT, True)


def teardown(sandbox_id: str) -> Deprovision:
    return Deprovision("workflow", sandbox_id, 5)


class FullEngine(ScopedMethods):
    """Refuses the ensures of the ids in ``full`` for quota ``refusals`` times each (``None``: always)."""

    def __init__(self, refusals: int | None, full: set[str] | None = None) -> None:
        self.refusals = refusals
        self.full = full
        self.calls: dict[str, int] = {}
        self.refused = asyncio.Event()
        self.torn_down: list[str] = []

    @property
    def driver_name(self) -> str:
        return "fake"

    async def ensure(
        self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> SandboxProbeState:
        n = self.calls[sandbox_id] = self.calls.get(sandbox_id, 0) + 1
        if (self.full is None or sandbox_id in self.full) and (self.refusals is None or n <= self.refusals):
            self.refused.set()
            raise CapacityRefused(f"fake create {sandbox_id} failed (HTTP 403): {QUOTA}")
        return "running"

    async def deprovision(self, scope: SandboxScope, sandbox_id: str) -> None:
        self.torn_down.append(sandbox_id)

    async def probe(self, scope: SandboxScope, sandbox_id: str) -> SandboxProbeState:
        return "absent"

    async def list_managed(self) -> list[ManagedSandbox]:
        return []

    async def close(self) -> None:
        return None


class Recorded(Backoff):
    """The one backoff, its delays recorded (jitter pinned to none)."""

    delays: ClassVar[list[float]] = []

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rng = lambda: 0.0

    def failed(self) -> float:
        delay = super().failed()
        Recorded.delays.append(delay)
        return delay


def executor(engine: FullEngine, metrics: PodMetrics | None = None, **kwargs: float) -> DriverExecutor:
    return DriverExecutor(engine, DisabledCredentials(), LOG, metrics=metrics, **kwargs)  # type: ignore[arg-type]


async def until(what: str, fact: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not fact():
            await asyncio.sleep(0.005)
    assert fact(), what


async def test_refusals_are_retried_with_the_one_backoff_until_admitted() -> None:
    Recorded.delays = []
    engine = FullEngine(refusals=3)
    run = executor(engine, quota_first_delay_s=0.01, quota_max_delay_s=0.02)
    run.quota_backoff = Recorded
    result = await run.run(ensure("w-1"))
    assert result == CommandResult(ok=True, probe_state="running", token_minted=False)
    assert engine.calls["w-1"] == 4  # three refusals, then admitted
    assert Recorded.delays == [0.01, 0.02, 0.02]  # first, doubled, capped: the shared Backoff's shape
    assert len(run.quota) == 0


async def test_a_teardown_wakes_the_waiting_ensure_long_before_its_backoff() -> None:
    engine = FullEngine(refusals=1, full={"w-1"})
    metrics = PodMetrics()
    run = executor(engine, metrics, quota_first_delay_s=LONG, quota_max_delay_s=LONG)
    waiting = asyncio.create_task(run.run(ensure("w-1")))
    await until("the first refusal", lambda: len(run.quota) == 1)
    assert metrics.engine_quota_waiting._value.get() == 1
    assert (await run.run(teardown("w-0"))).ok  # a sandbox of this pod ended: capacity may have freed
    async with asyncio.timeout(5):  # far below the 600 s backoff: only the wake can have ended the sleep
        result = await waiting
    assert result.ok and engine.calls["w-1"] == 2
    assert metrics.engine_quota_waiting._value.get() == 0
    assert metrics.engine_quota_waits.labels("fake")._value.get() == 1


async def test_one_teardown_wakes_one_waiter_the_longest_waiting() -> None:
    engine = FullEngine(refusals=1, full={"w-1", "w-2"})
    run = executor(engine, quota_first_delay_s=LONG, quota_max_delay_s=LONG)
    first = asyncio.create_task(run.run(ensure("w-1")))
    await until("w-1 refused", lambda: len(run.quota) == 1)
    second = asyncio.create_task(run.run(ensure("w-2")))
    await until("w-2 refused", lambda: len(run.quota) == 2)
    assert (await run.run(teardown("w-0"))).ok
    async with asyncio.timeout(5):
        assert (await first).ok
    # w-1's admission wakes the next waiter too (there was room a moment ago).
    async with asyncio.timeout(5):
        assert (await second).ok
    assert engine.calls == {"w-1": 2, "w-2": 2}


async def test_past_the_admission_timeout_the_result_is_the_capacity_failure() -> None:
    engine = FullEngine(refusals=None)
    metrics = PodMetrics()
    run = executor(engine, metrics, admission_timeout_s=0.2, quota_first_delay_s=0.05, quota_max_delay_s=0.05)
    result = await run.run(ensure("w-1"))
    assert not result.ok
    assert result.error == f"capacity: fake create w-1 failed (HTTP 403): {QUOTA}"
    assert engine.calls["w-1"] >= 2  # retried, not failed at the first refusal
    assert metrics.engine_quota_timeouts.labels("fake")._value.get() == 1
    assert metrics.engine_quota_waiting._value.get() == 0


async def test_other_failures_are_not_waited_out() -> None:
    class Broken(FullEngine):
        async def ensure(
            self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
        ) -> SandboxProbeState:
            self.calls[sandbox_id] = self.calls.get(sandbox_id, 0) + 1
            raise RuntimeError("forbidden: cannot create deployments")

    engine = Broken(refusals=None)
    run = executor(engine, quota_first_delay_s=LONG)
    result = await run.run(ensure("w-1"))
    assert result == CommandResult(ok=False, error="forbidden: cannot create deployments")
    assert engine.calls["w-1"] == 1


async def test_a_waiting_ensure_holds_no_driver_slot_and_shutdown_ends_it() -> None:
    engine = FullEngine(refusals=None, full={"w-1"})
    run = executor(engine, quota_first_delay_s=LONG, quota_max_delay_s=LONG)
    runner = EffectRunner(run.run, concurrency=1)  # one slot: a wait that held it would block the rest
    runner.own([0])
    runner.submit(0, "w-1", "e-1", ensure("w-1"))
    await until("w-1 refused and waiting", lambda: len(run.quota) == 1)
    for n in (2, 3):
        runner.submit(0, f"w-{n}", f"e-{n}", ensure(f"w-{n}"))
    await until("the other calls to complete", lambda: len(runner._done) == 2)
    done = runner.take()
    assert sorted(c.command.sandbox_id for c in done) == ["w-2", "w-3"] and all(c.result.ok for c in done)
    assert runner.outstanding == 1  # w-1 is still waiting
    async with asyncio.timeout(5):  # the effect runner's cancel (shutdown) ends the wait at once
        await runner.cancel()
    assert len(run.quota) == 0 and runner.take() == []  # no result: the next owner runs it again


async def test_a_disowned_partitions_wait_ends_and_its_result_is_discarded() -> None:
    engine = FullEngine(refusals=None, full={"w-1"})
    run = executor(engine, quota_first_delay_s=LONG, quota_max_delay_s=LONG)
    runner = EffectRunner(run.run, concurrency=1)
    runner.own([0])
    runner.submit(0, "w-1", "e-1", ensure("w-1"))
    await until("w-1 waiting", lambda: len(run.quota) == 1)
    runner.disown([0])
    assert (await run.run(teardown("w-0"))).ok  # woken: it sees the partition gone and stops
    async with asyncio.timeout(5):
        assert await runner.wait_idle(5)
    assert len(run.quota) == 0 and runner.take() == [] and engine.calls["w-1"] == 1


async def test_a_zero_admission_timeout_fails_at_the_first_refusal() -> None:
    engine = FullEngine(refusals=None)
    run = executor(engine, admission_timeout_s=0.0)
    result = await run.run(ensure("w-1"))
    assert not result.ok and result.error.startswith("capacity: ") and engine.calls["w-1"] == 1


async def test_a_woken_waiter_starts_its_backoff_over() -> None:
    Recorded.delays = []
    engine = FullEngine(refusals=2, full={"w-1"})
    run = executor(engine, quota_first_delay_s=LONG / 4, quota_max_delay_s=LONG)
    run.quota_backoff = Recorded
    waiting = asyncio.create_task(run.run(ensure("w-1")))
    await until("the first refusal", lambda: engine.calls.get("w-1") == 1)
    assert (await run.run(teardown("w-0"))).ok
    await until("the second refusal", lambda: engine.calls.get("w-1") == 2 and len(Recorded.delays) == 2)
    assert (await run.run(teardown("w-9"))).ok
    async with asyncio.timeout(5):
        assert (await waiting).ok
    # Not doubled after the wake: the engine may show the freed room only seconds after a teardown.
    assert Recorded.delays == [LONG / 4, LONG / 4]
