"""The lane rules' vocabulary: their config, the driver commands and results, decisions and outcomes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.lanes.dispatch import (
    AgentExecutionTemporalConfig,
    WorkflowExecutionTemporalConfig,
)
from drivers.contract import SandboxScope
from events.codec import InputEvent, OutcomeEvent
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
    event: InputEvent
    state: state_pb2.ExecutionState | None
    """The state with the event applied; ``None`` = nothing to write."""
    commands: tuple[Command, ...] = ()
    logs: tuple[LogIntent, ...] = ()
    reject: str | None = None
    """A reason to dead-letter the event instead of applying it."""
    duplicate: bool = False


class Outcome(NamedTuple):
    state: state_pb2.ExecutionState | None
    outputs: tuple[OutcomeEvent, ...]
    logs: tuple[LogIntent, ...]


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
