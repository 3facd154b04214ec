"""An in-memory driver that counts and records calls.

Used for volume (chaos, benchmarks) and for audit replay, where no real
sandbox may be touched. It is never the only test of a path: every path it
stands in for also has a real-part integration test.

Dev-only: the harness registers it as ``memory`` (``sandbox_lanes.drivers`` entry point in
devtools/pyproject.toml), so only where the harness is installed can a pod or the bench select it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

from drivers.contract import (
    DriverConfig,
    ManagedSandbox,
    SandboxEnvironment,
    SandboxError,
    SandboxProbeState,
    SandboxScope,
    ScopedMethods,
)
from drivers.naming import sandbox_base_name


@dataclass
class RecordedCall:
    op: str
    scope: SandboxScope
    sandbox_id: str
    task_queue: str = ""
    token_present: bool = False
    caller_class: str = ""


@dataclass
class MemoryProvisioner(ScopedMethods):
    """Keeps sandboxes in a dict; optional injected failures, latency and hangs for chaos runs.

    Latency stands in for a real engine's (a docker create takes ~200 ms here) so that throughput
    and resilience figures are measured with calls that take time; a hang never returns (the
    executor's ensure/teardown timeout ends it).
    """

    name: str = "memory"
    ensure_failure_rate: float = 0.0
    teardown_failure_rate: float = 0.0
    ensure_latency_ms: float = 0.0
    teardown_latency_ms: float = 0.0
    latency_jitter_ms: float = 0.0
    hang_rate: float = 0.0
    seed: int = 0
    calls: list[RecordedCall] = field(default_factory=list)
    live: dict[tuple[SandboxScope, str], SandboxProbeState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = asyncio.Lock()

    @property
    def driver_name(self) -> str:
        return self.name

    async def _delay(self, latency_ms: float) -> None:
        if self.hang_rate and self._rng.random() < self.hang_rate:
            await asyncio.Event().wait()  # hangs until cancelled (the executor's timeout)
        jitter = self._rng.uniform(0, self.latency_jitter_ms) if self.latency_jitter_ms else 0.0
        if latency_ms or jitter:
            await asyncio.sleep((latency_ms + jitter) / 1000)

    async def ensure(
        self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> SandboxProbeState:
        await self._delay(self.ensure_latency_ms)
        self.calls.append(
            RecordedCall(
                "ensure", scope, sandbox_id, env.task_queue, env.stigmer_token != "", env.caller_class
            )
        )
        if self.ensure_failure_rate and self._rng.random() < self.ensure_failure_rate:
            raise SandboxError("injected ensure failure")
        self.live[(scope, sandbox_id)] = "running"
        return "running"

    async def deprovision(self, scope: SandboxScope, sandbox_id: str) -> None:
        await self._delay(self.teardown_latency_ms)
        self.calls.append(RecordedCall("deprovision", scope, sandbox_id))
        if self.teardown_failure_rate and self._rng.random() < self.teardown_failure_rate:
            raise SandboxError("injected teardown failure")
        self.live.pop((scope, sandbox_id), None)

    async def probe(self, scope: SandboxScope, sandbox_id: str) -> SandboxProbeState:
        return self.live.get((scope, sandbox_id), "absent")

    async def list_managed(self) -> list[ManagedSandbox]:
        return [
            ManagedSandbox(scope, sid, sandbox_base_name(scope, sid), state)
            for (scope, sid), state in sorted(self.live.items())
        ]

    async def close(self) -> None:
        return None

    def count(self, op: str) -> int:
        return sum(1 for c in self.calls if c.op == op)


def new_memory_provisioner(config: DriverConfig, logger: logging.Logger) -> MemoryProvisioner:
    def number(name: str) -> float:
        return float(config.options.get(name, "0") or 0)

    return MemoryProvisioner(
        ensure_failure_rate=number("ensure_failure_rate"),
        teardown_failure_rate=number("teardown_failure_rate"),
        ensure_latency_ms=number("ensure_latency_ms"),
        teardown_latency_ms=number("teardown_latency_ms"),
        latency_jitter_ms=number("latency_jitter_ms"),
        hang_rate=number("hang_rate"),
        seed=int(number("seed")),
    )
