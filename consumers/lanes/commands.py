"""The lane rules' vocabulary: their config, the driver commands and results, decisions and outcomes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, NamedTuple

from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.lanes.dispatch import (
    AgentExecutionTemporalConfig,
    WorkflowExecutionTemporalConfig,
)
from drivers.contract import SandboxScope
from events.codec import CapacityRecord, DecidedEvent, OutcomeEvent
from events.sandbox_lanes.v1 import common_pb2, state_pb2

SCOPE_ENUM: dict[SandboxScope, int] = {
    "session": common_pb2.SANDBOX_SCOPE_SESSION,
    "workflow": common_pb2.SANDBOX_SCOPE_WORKFLOW,
    "connect": common_pb2.SANDBOX_SCOPE_CONNECT,
}


@dataclass(frozen=True)
class LaneConfig:
    """What the rules need to know: is the lane on, and the two routing configs."""

    enabled: bool
    agent: AgentExecutionTemporalConfig = field(default_factory=AgentExecutionTemporalConfig)
    workflow: WorkflowExecutionTemporalConfig = field(default_factory=WorkflowExecutionTemporalConfig)
    driver_name: str = ""
    source: str = "sandbox-lanes"
    #: Stamp :attr:`fingerprint` on every state and outcome the rules produce (the pod's and
    #: replay's configs do; the rule tests pin records without it).
    stamp_fingerprint: bool = False
    #: Allowances the runtime applies around the rules that change what is decided (None: not
    #: known here, e.g. the rule tests): an input's ``occurred_at`` this far ahead of its record time
    #: is dead-lettered; a finished state is tombstoned this long after its last input.
    max_clock_ahead_s: float | None = None
    state_retention_s: float | None = None
    #: A cap is on: a create's sandbox waits for the capacity ledger's admission
    #: (docs/guarantees.md "Capacity"). Off (the default) is upstream's behaviour.
    capacity: bool = False

    def settings(self) -> dict[str, str]:
        """Every setting the rules read, by its environment variable (nothing secret; ``source``,
        the pod's name, is not one: it changes no decision)."""
        agent, workflow = self.agent, self.workflow
        return {
            "SANDBOX_PROVISIONER_TYPE": self.driver_name,
            "lane enabled": "true" if self.enabled else "false",
            "STIGMER_ACTIVITY_ROUTING": agent.activity_routing,
            "STIGMER_DEFAULT_EXECUTION_TARGET": agent.default_execution_target,
            "TEMPORAL_AGENT_EXECUTION_RUNNER_TASK_QUEUE": agent.runner_queue,
            "agent stigmer queue": agent.stigmer_queue,
            "STIGMER_WORKFLOW_ACTIVITY_ROUTING": workflow.workflow_activity_routing,
            "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET": workflow.default_execution_target,
            "TEMPORAL_WORKFLOW_EXECUTION_RUNNER_TASK_QUEUE": workflow.runner_queue,
            "workflow stigmer queue": workflow.stigmer_queue,
            **(
                {}
                if self.max_clock_ahead_s is None
                else {"SANDBOX_LANES_MAX_CLOCK_AHEAD_S": f"{self.max_clock_ahead_s:g}"}
            ),
            **(
                {}
                if self.state_retention_s is None
                else {"SANDBOX_LANES_STATE_RETENTION_S": f"{self.state_retention_s:g}"}
            ),
            # Only when on: a configuration without a cap keeps the fingerprint it always had.
            **({"capacity ledger": "on"} if self.capacity else {}),
        }

    @cached_property
    def fingerprint(self) -> str:
        """A stable hash of :meth:`settings`: 16 hex digits of SHA-256 over their sorted JSON."""
        text = json.dumps(self.settings(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def applied(self) -> state_pb2.LaneConfigApplied:
        """The configuration record's content (``pod_id`` and ``applied_at`` are the writer's)."""
        agent, workflow = self.agent, self.workflow
        applied = state_pb2.LaneConfigApplied(
            fingerprint=self.fingerprint,
            enabled=self.enabled,
            driver_name=self.driver_name,
            agent_stigmer_queue=agent.stigmer_queue,
            agent_runner_queue=agent.runner_queue,
            agent_activity_routing=agent.activity_routing,
            agent_default_execution_target=agent.default_execution_target,
            workflow_stigmer_queue=workflow.stigmer_queue,
            workflow_runner_queue=workflow.runner_queue,
            workflow_activity_routing=workflow.workflow_activity_routing,
            workflow_default_execution_target=workflow.default_execution_target,
        )
        if self.max_clock_ahead_s is not None:
            applied.max_clock_ahead_s = self.max_clock_ahead_s
        if self.state_retention_s is not None:
            applied.state_retention_s = self.state_retention_s
        applied.capacity = self.capacity
        return applied

    @classmethod
    def from_applied(
        cls, record: state_pb2.LaneConfigApplied, *, source: str = "sandbox-lanes", stamp: bool = True
    ) -> LaneConfig:
        """The configuration a :class:`LaneConfigApplied` record names (replay re-derives under it)."""
        return cls(
            enabled=record.enabled,
            agent=AgentExecutionTemporalConfig(
                record.agent_stigmer_queue,
                record.agent_runner_queue,
                record.agent_activity_routing,
                record.agent_default_execution_target,
            ),
            workflow=WorkflowExecutionTemporalConfig(
                record.workflow_stigmer_queue,
                record.workflow_runner_queue,
                record.workflow_activity_routing,
                record.workflow_default_execution_target,
            ),
            driver_name=record.driver_name,
            source=source,
            stamp_fingerprint=stamp,
            max_clock_ahead_s=record.max_clock_ahead_s if record.HasField("max_clock_ahead_s") else None,
            state_retention_s=record.state_retention_s if record.HasField("state_retention_s") else None,
            capacity=record.capacity,
        )


def changed_settings(a: Mapping[str, str], b: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``{setting: (a's value, b's value)}`` for every setting the two configurations set apart."""
    return {k: (a.get(k, ""), b.get(k, "")) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


# The per-event value types are NamedTuples: immutable and compared by value like the frozen
# dataclasses they replace, at about a third of the construction cost (a frozen dataclass sets
# each field through object.__setattr__). Hot paths build them positionally.


class LogIntent(NamedTuple):
    level: Literal["debug", "info", "warning", "error"]
    message: str
    fields: dict[str, str]


class Ensure(NamedTuple):
    scope: SandboxScope
    sandbox_id: str
    task_queue: str
    caller_class: str
    mint: SandboxCredentialRequest
    critical: bool


class Deprovision(NamedTuple):
    scope: SandboxScope
    sandbox_id: str
    phase: int


Command = Ensure | Deprovision


class CommandResult(NamedTuple):
    """What the edge reports back: success, or the error message (never a secret)."""

    ok: bool
    error: str = ""
    probe_state: str = ""
    token_minted: bool = False


class Decision(NamedTuple):
    event: DecidedEvent
    state: state_pb2.ExecutionState | None
    """The state with the event applied; ``None`` = nothing to write."""
    commands: tuple[Command, ...] = ()
    logs: tuple[LogIntent, ...] = ()
    reject: str | None = None
    """A reason to dead-letter the event instead of applying it."""
    duplicate: bool = False
    outputs: tuple[OutcomeEvent, ...] = ()
    """Outcomes decided without a driver call (a capacity wait, a capacity time-out)."""
    capacity: tuple[CapacityRecord, ...] = ()
    """Records for the capacity log (a request, a release); their ``partition`` is the runtime's to fill."""


class Outcome(NamedTuple):
    state: state_pb2.ExecutionState | None
    outputs: tuple[OutcomeEvent, ...]
    logs: tuple[LogIntent, ...]
    capacity: tuple[CapacityRecord, ...] = ()
    """Records for the capacity log (a release once a teardown is folded)."""


class StateView:
    """Read access to stored state, handed to ``decide``.

    ``get`` is the state the event applies to; ``session`` is a session's own record (what the
    session lane reads: was the session deleted?), which lives on the same partition because a
    session's inputs are keyed by its id. A protocol-like base so tests can pass a view that
    fails on any access, proving the disabled lane never reads state.
    """

    __slots__ = ("_sessions", "_state")

    def __init__(
        self,
        state: state_pb2.ExecutionState | None,
        sessions: Callable[[str], state_pb2.ExecutionState | None] | None = None,
    ) -> None:
        self._state = state
        self._sessions = sessions

    def get(self) -> state_pb2.ExecutionState | None:
        return self._state

    def session(self, session_id: str) -> state_pb2.ExecutionState | None:
        """The session's own record (keyed by its id), if any was written."""
        return None if self._sessions is None else self._sessions(session_id)
