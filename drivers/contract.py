"""The one small contract every sandbox driver implements (upstream ``sandbox/provisioner.ts``).

Drivers expose three generic, idempotent operations keyed by (scope, id):
``ensure`` (absent → provision, stopped → start, running → fast path),
``deprovision`` (a missing sandbox is success) and ``probe``. The upstream
per-scope method names are provided on top by :class:`ScopedMethods` so the
surface reads like the original and a port of an upstream test maps 1:1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol, runtime_checkable

SandboxScope = Literal["session", "workflow", "connect"]
SandboxProbeState = Literal["absent", "stopped", "running"]

SCOPES: tuple[SandboxScope, ...] = ("session", "workflow", "connect")
PROBE_STATES: tuple[SandboxProbeState, ...] = ("absent", "stopped", "running")

#: Variables the drivers set themselves; operator runner lists may never name them
#: (upstream ``SANDBOX_DRIVER_OWNED_RUNNER_ENV``).
SANDBOX_DRIVER_OWNED_RUNNER_ENV: tuple[str, ...] = (
    "MODE",
    "STIGMER_TASK_QUEUE",
    "STIGMER_TOKEN",
    "STIGMER_BACKEND_ENDPOINT",
    "STIGMER_MCP_PUBLIC_ENDPOINT",
    "TEMPORAL_SERVICE_ADDRESS",
    "TEMPORAL_NAMESPACE",
    "WORKSPACE_ROOT_DIR",
    "STIGMER_ATTACH_PORT",
    "STIGMER_SANDBOX_NAME_FILE",
)


@dataclass(frozen=True)
class SandboxEnvironment:
    """Per-sandbox request facts (spec 4.1).

    ``stigmer_token`` is excluded from ``repr`` so a stray log line or
    exception message can never print it. ``""`` means launch token-less:
    drivers must then not set ``STIGMER_TOKEN`` at all.
    """

    task_queue: str
    stigmer_token: str = field(default="", repr=False)
    caller_class: str = ""


#: The installation a driver config names when none is given: the pod's default consumer group.
DEFAULT_INSTALLATION: Final = "sandbox-lanes"


@dataclass(frozen=True)
class DriverConfig:
    """Driver configuration (upstream ``SandboxDriverConfig``); endpoints and images live here."""

    backend_endpoint: str = ""
    temporal_address: str = "localhost:7233"
    runner_image: str = "ghcr.io/stigmer/runner:latest"
    runner_command: str = "stigmer-runner"
    kubernetes_namespace: str = "stigmer-sandboxes"
    mcp_public_endpoint: str = ""
    temporal_namespace: str = "default"
    temporal_connection_env: Mapping[str, str] = field(default_factory=dict, repr=False)
    runner_env: Mapping[str, str] = field(default_factory=dict)
    runner_secret_env: Mapping[str, str] = field(default_factory=dict, repr=False)
    #: Driver-specific knobs (e.g. docker memory limit), by the driver's own names.
    options: Mapping[str, str] = field(default_factory=dict)
    #: The pod's own secret settings (the signing key, its file, Kafka credentials): a driver whose
    #: runner inherits the pod's environment (local-process) leaves these out.
    withheld_env: frozenset[str] = frozenset()
    #: The installation (``stigmer.ai/installation``): every object the driver makes carries it, and
    #: the driver acts only on objects that carry it (two installations may share a namespace or an
    #: engine). The pod sets it from ``SANDBOX_LANES_INSTALLATION`` (default: its consumer group).
    installation: str = DEFAULT_INSTALLATION


@dataclass(frozen=True)
class ManagedSandbox:
    """A runtime object found by its labels; what the reaper lists."""

    scope: SandboxScope
    sandbox_id: str
    name: str
    state: SandboxProbeState
    #: When the runtime object was created (unix seconds); ``None`` when the driver cannot tell.
    created_at: float | None = None


class SandboxError(Exception):
    """A driver failure whose message is safe to record (never carries a secret)."""


class SandboxCollision(SandboxError):
    """The object a sandbox's name maps to belongs to another sandbox (a name collision).

    Names are upstream's ``sbx-<code>-<first 12 hex of sha256(id)>`` (48 bits), so two ids can share
    one. A driver raises this before it touches the object: an ensure fails (the pod records
    ``SandboxFailed`` with this message) and the other owner's object is left as it was.
    ``owner`` is the other object's ``stigmer.ai/sandbox-id`` (``None``: it carries none);
    ``owner_installation`` its ``stigmer.ai/installation`` when that is not ``installation`` (this
    driver's), so an object of another installation (or of none) is named as such.
    """

    def __init__(
        self,
        driver: str,
        kind: str,
        where: str,
        name: str,
        scope: SandboxScope,
        sandbox_id: str,
        owner: str | None,
        owner_scope: str | None = None,
        owner_installation: str | None = None,
        installation: str | None = None,
    ) -> None:
        self.driver = driver
        self.kind = kind
        self.where = where
        self.name = name
        self.scope = scope
        self.sandbox_id = sandbox_id
        self.owner = owner
        self.owner_installation = owner_installation
        held_by = (
            f"{owner_scope or scope} '{owner}'"
            if owner is not None
            else "no sandbox of this server (no stigmer.ai/sandbox-id label)"
        )
        if owner is not None and installation is not None and owner_installation != installation:
            held_by += (
                f" of installation '{owner_installation}'"
                if owner_installation
                else " of no installation (no stigmer.ai/installation label)"
            )
        super().__init__(
            f"{driver} sandbox name collision: {kind} {where} belongs to {held_by}, not to {scope} "
            f"'{sandbox_id}' (both map to the name {name}); the {kind} was left untouched"
        )


class CapacityRefused(SandboxError):
    """The engine is full: it refused the sandbox for quota or capacity, not for a fault of the request.

    Its message is the engine's own words (for Kubernetes the ``exceeded quota: ...`` message). The
    pod waits such a refusal out (retried with backoff, woken early as its sandboxes end) up to the
    admission timeout instead of failing the execution at once. A driver raises it only once nothing
    of the refused attempt holds capacity (the refused object is gone or never was), so a retry
    starts from a fresh create.
    """


@runtime_checkable
class SandboxProvisioner(Protocol):
    """What the pod needs from a driver. Every method must be safe under concurrency."""

    @property
    def driver_name(self) -> str: ...

    async def ensure(
        self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> SandboxProbeState:
        """Make the sandbox exist and run; return the state the ensure saw or left it in.

        The pod records that state in ``SandboxProvisioned.probe_state`` without a second engine
        call (upstream's ensure probes first, then acts; it never probes again afterwards).
        """
        ...

    async def deprovision(self, scope: SandboxScope, sandbox_id: str) -> None: ...

    async def probe(self, scope: SandboxScope, sandbox_id: str) -> SandboxProbeState: ...

    async def list_managed(self) -> list[ManagedSandbox]: ...

    async def close(self) -> None: ...


class ScopedMethods:
    """Upstream's per-scope method names, expressed over the generic contract."""

    async def ensure(
        self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> SandboxProbeState:
        raise NotImplementedError

    async def deprovision(self, scope: SandboxScope, sandbox_id: str) -> None:
        raise NotImplementedError

    async def ensure_session_sandbox(self, session_id: str, env: SandboxEnvironment) -> None:
        await self.ensure("session", session_id, env)

    async def deprovision_session_sandbox(self, session_id: str) -> None:
        await self.deprovision("session", session_id)

    async def ensure_workflow_sandbox(self, execution_id: str, env: SandboxEnvironment) -> None:
        await self.ensure("workflow", execution_id, env)

    async def deprovision_workflow_sandbox(self, execution_id: str) -> None:
        await self.deprovision("workflow", execution_id)

    async def create_connect_sandbox(self, request_id: str, env: SandboxEnvironment) -> str:
        """One-shot; every built-in returns the request id as the sandbox id."""
        await self.ensure("connect", request_id, env)
        return request_id

    async def deprovision_connect_sandbox(self, sandbox_id: str) -> None:
        await self.deprovision("connect", sandbox_id)


SandboxProvisionerFactory = Callable[[DriverConfig, logging.Logger], SandboxProvisioner]
