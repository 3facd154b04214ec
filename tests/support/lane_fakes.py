"""Test doubles for the seed-file ports: a recording provisioner and credential providers.

They stand in below the real integration tests of the same paths
(tests/integration/test_pod_kafka.py runs these lanes on a real broker with a real driver).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from consumers.lanes.commands import LaneConfig
from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.lanes.dispatch import AgentExecutionTemporalConfig, WorkflowExecutionTemporalConfig
from consumers.runtime.executor import DriverExecutor
from consumers.runtime.processor import LaneProcessor
from consumers.runtime.runner_tokens import MintedCredential
from drivers.contract import (
    ManagedSandbox,
    SandboxEnvironment,
    SandboxProbeState,
    SandboxScope,
    ScopedMethods,
)

TEST_CALLER_IDENTITY_ID = "ida_test_caller"

SESSION_ROUTING_CLOUD_DEFAULT = AgentExecutionTemporalConfig(
    "agent_execution_stigmer", "stigmer_runner", "session", "cloud"
)
EXECUTION_ROUTING_CONFIG = WorkflowExecutionTemporalConfig(
    "workflow_execution_stigmer", "stigmer_runner", "execution", "local"
)


@dataclass
class Ensured:
    scope: str
    id: str
    env: SandboxEnvironment


@dataclass
class FakeProvisioner(ScopedMethods):
    """Records every provisioner call; ensure/deprovision failures injectable."""

    ensure_error: Exception | None = None
    deprovision_error: Exception | None = None
    ensured: list[Ensured] = field(default_factory=list)
    deprovisioned: list[tuple[str, str]] = field(default_factory=list)

    @property
    def driver_name(self) -> str:
        return "fake"

    async def ensure(
        self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> SandboxProbeState:
        if self.ensure_error is not None:
            raise self.ensure_error
        self.ensured.append(Ensured(scope, sandbox_id, env))
        return "running"

    async def deprovision(self, scope: SandboxScope, sandbox_id: str) -> None:
        if self.deprovision_error is not None:
            raise self.deprovision_error
        self.deprovisioned.append((scope, sandbox_id))

    async def probe(self, scope: SandboxScope, sandbox_id: str) -> SandboxProbeState:
        return "absent"

    async def list_managed(self) -> list[ManagedSandbox]:
        return []

    async def close(self) -> None:
        return None


class MintingCredentials:
    """Echoes the binding: the token is ``tok-<binding>``."""

    def __init__(self) -> None:
        self.mints: list[tuple[str, str, int]] = []

    def is_enabled(self, lane: str) -> bool:
        return lane == "execution_scoped"

    def mint(self, lane: str, binding: str, ttl_seconds: int) -> MintedCredential:
        self.mints.append((lane, binding, ttl_seconds))
        return MintedCredential(token=f"tok-{binding}", ttl_seconds=ttl_seconds)

    def verify(self, lane: str, token: str) -> str:
        raise AssertionError("verify is not under test")


class DisabledCredentials:
    def is_enabled(self, lane: str) -> bool:
        return False

    def mint(self, lane: str, binding: str, ttl_seconds: int) -> MintedCredential:
        raise AssertionError("mint must not be called when the lane is disabled")

    def verify(self, lane: str, token: str) -> str:
        raise AssertionError("verify is not under test")


class CapabilityCredentials:
    """Has the C4 capability; the primitives must never be consulted on this path."""

    def __init__(self) -> None:
        self.minted: list[SandboxCredentialRequest] = []

    def is_enabled(self, lane: str) -> bool:
        raise AssertionError("primitives must not be consulted on the capability path")

    def mint(self, lane: str, binding: str, ttl_seconds: int) -> MintedCredential:
        raise AssertionError("primitives must not be consulted on the capability path")

    def verify(self, lane: str, token: str) -> str:
        raise AssertionError("verify is not under test")

    def mint_sandbox_credential(self, request: SandboxCredentialRequest) -> str:
        self.minted.append(request)
        return f"cloud-tok-{request.scope}"


def lane_processor(
    provisioner: FakeProvisioner,
    credentials: object | None = None,
    *,
    agent: AgentExecutionTemporalConfig = SESSION_ROUTING_CLOUD_DEFAULT,
    workflow: WorkflowExecutionTemporalConfig = EXECUTION_ROUTING_CONFIG,
    enabled: bool = True,
    logger: logging.Logger | None = None,
) -> LaneProcessor:
    log = logger or logging.getLogger("sandbox_lanes.test")
    config = LaneConfig(enabled=enabled, agent=agent, workflow=workflow, driver_name=provisioner.driver_name)
    executor = DriverExecutor(provisioner, credentials or MintingCredentials(), log)  # type: ignore[arg-type]
    return LaneProcessor(config, executor, log)
