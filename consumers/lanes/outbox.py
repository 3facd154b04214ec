"""The outbox in the execution state: each driver command of a decision becomes a pending effect with a
deterministic id, re-run by whichever pod owns the partition until its result is folded back."""

from __future__ import annotations

from consumers.lanes.commands import SCOPE_ENUM, Command, Decision, Deprovision, Ensure
from consumers.lanes.credentials import SandboxCredentialRequest
from drivers.contract import SandboxScope
from events.codec import DecidedEvent, derived_event_id
from events.sandbox_lanes.v1 import inputs_pb2, state_pb2


def effect_id_of(causation_id: str, command: Command) -> str:
    """The deterministic id of an effect: one per (input event, operation, scope)."""
    kind = "Ensure" if isinstance(command, Ensure) else "Deprovision"
    return derived_event_id(causation_id, kind, command.scope)


def fill_pending(state: state_pb2.ExecutionState, event: DecidedEvent, commands: tuple[Command, ...]) -> None:
    """The outbox: each command of the decision becomes a pending effect in the decision's state."""
    meta = event.meta
    causation_id = meta.event_id
    for command in commands:
        entry = state.pending.add()
        entry.effect_id = effect_id_of(causation_id, command)
        entry.scope = SCOPE_ENUM[command.scope]  # type: ignore[assignment]
        entry.sandbox_id = command.sandbox_id
        entry.causation_id = causation_id
        if meta.HasField("occurred_at"):
            entry.occurred_at.CopyFrom(meta.occurred_at)
        if isinstance(command, Ensure):
            entry.op = state_pb2.EFFECT_OP_ENSURE
            entry.task_queue = command.task_queue
            entry.caller_class = command.caller_class
            entry.critical = command.critical
            mint = command.mint
            entry.mint_scope = mint.scope
            entry.mint_session_id = mint.session_id
            entry.mint_execution_id = mint.execution_id
            entry.mint_org = mint.org
            entry.mint_caller_identity_id = mint.caller_identity_id
            # Only a recover decides an ensure from a phase change.
            entry.recover = isinstance(event, inputs_pb2.PhaseChanged)
        else:
            entry.op = state_pb2.EFFECT_OP_DEPROVISION
            entry.phase = command.phase  # type: ignore[assignment]


_SCOPE_NAMES: dict[int, SandboxScope] = {number: name for name, number in SCOPE_ENUM.items()}


def command_of(entry: state_pb2.PendingEffect) -> Command:
    """The driver command a pending effect stands for (what a restarted pod re-runs)."""
    scope = _SCOPE_NAMES[entry.scope]
    if entry.op == state_pb2.EFFECT_OP_DEPROVISION:
        return Deprovision(scope, entry.sandbox_id, entry.phase)
    mint = SandboxCredentialRequest(
        entry.mint_scope,  # type: ignore[arg-type]
        entry.mint_session_id,
        entry.mint_execution_id,
        entry.mint_org,
        entry.mint_caller_identity_id,
    )
    return Ensure(scope, entry.sandbox_id, entry.task_queue, entry.caller_class, mint, entry.critical)


def pending_of(state: state_pb2.ExecutionState | None) -> list[tuple[str, Command]]:
    """The state's outstanding driver calls, in decision order, as ``(effect id, command)``."""
    if state is None:
        return []
    return [(entry.effect_id, command_of(entry)) for entry in state.pending]


def new_effects(decision: Decision) -> list[tuple[str, Command]]:
    """The driver calls this decision added to the outbox (the last entries of its state)."""
    n = len(decision.commands)
    if n == 0 or decision.state is None:
        return []
    entries = decision.state.pending[-n:]
    return [(entry.effect_id, command) for entry, command in zip(entries, decision.commands, strict=True)]
