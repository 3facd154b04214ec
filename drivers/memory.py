"""An in-memory driver that counts and records calls.

Used for volume (chaos, benchmarks) and for audit replay, where no real
sandbox may be touched. It is never the only test of a path: every path it
stands in for also has a real-part integration test.
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
    """Keeps sandboxes in a dict; optional injected failure rates for chaos runs."""

    name: str = "memory"
    ensure_failure_rate: float = 0.0
    teardown_failure_rate: float = 0.0
    seed: int = 0
    calls: list[RecordedCall] = field(default_factory=list)
    live: dict[tuple[SandboxScope, str], SandboxProbeState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = asyncio.Lock()

    @property
    def driver_name(self) -> str:
        return self.name

    async def ensure(self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment) -> None:
        self.calls.append(
            RecordedCall(
                "ensure", scope, sandbox_id, env.task_queue, env.stigmer_token != "", env.caller_class
            )
        )
        if self.ensure_failure_rate and self._rng.random() < self.ensure_failure_rate:
            raise SandboxError("injected ensure failure")
        self.live[(scope, sandbox_id)] = "running"

    async def deprovision(self, scope: SandboxScope, sandbox_id: str) -> None:
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
    rate = float(config.options.get("ensure_failure_rate", "0") or 0)
    teardown = float(config.options.get("teardown_failure_rate", "0") or 0)
    return MemoryProvisioner(ensure_failure_rate=rate, teardown_failure_rate=teardown)
