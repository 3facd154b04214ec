"""When an execution's state may be removed: a pure rule (no clock of its own).

A state matters while something may still happen to it: a driver call is pending, or the
execution may still move (it is not in a terminal phase, nor refused, nor a deleted session's
record). Once it is finished, it is kept for the retention period after its last input, so a
redelivered input inside that window is still recognised as a duplicate; after it, the state is
tombstoned and the same input would be a new execution's.
"""

from __future__ import annotations

from consumers.lanes.constants import TERMINAL_WORKFLOW_PHASES
from events.sandbox_lanes.v1 import state_pb2


def finished(state: state_pb2.ExecutionState) -> bool:
    """Nothing pending, and nothing the rules do next depends on this state any more."""
    if state.pending:
        return False
    return state.session_deleted or state.refused or state.phase in TERMINAL_WORKFLOW_PHASES


def removable_from(state: state_pb2.ExecutionState, retention_s: float, seen_at: float) -> float | None:
    """Epoch seconds from which the state may be tombstoned; None while it is kept.

    The clock is the state's ``updated_at`` (its last input's ``occurred_at``); a state without
    one counts from ``seen_at`` (when the pod stored or restored it). ``retention_s`` 0 keeps all.
    """
    if retention_s <= 0 or not finished(state):
        return None
    if state.HasField("updated_at"):
        at = state.updated_at
        return at.seconds + at.nanos / 1e9 + retention_s
    return seen_at + retention_s
