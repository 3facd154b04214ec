"""A session's activity from the pod's own state: what the agent-sandbox idle sweep judges by.

Upstream reads its executions table (busy while any execution of the session is not terminal;
otherwise idle since the latest stamp). Here the same facts are in the execution states the pod
restored from the compacted topic. An agent execution's events are keyed by its session id, so all
of a session's states sit on one partition: the pod that owns it judges the session, every other
pod answers ``None`` and leaves it alone.

A session's states are read from the store's session index (``HeldStates.referencing``): the
sweep's question costs what the session holds, never what the store holds (issue 45: the index
of every session rebuilt from all held states cost 1.2 s of CPU per sweep with 1M states, and
would have cost 12 s with 10M, every 30 s).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from consumers.lanes.constants import TERMINAL_WORKFLOW_PHASES
from drivers.agent_sandbox.idle import SessionActivity
from events.sandbox_lanes.v1 import common_pb2, state_pb2

if TYPE_CHECKING:
    from consumers.runtime.pod import Pod

#: A stamp further ahead of this pod's clock is skipped (upstream's allowance, spec 4.5): a skewed
#: producer clock must not keep a sandbox awake until that time passes.
FUTURE_ALLOWANCE_S = 60.0


class StoreSessionActivity:
    """``SessionActivityReader`` over ``pod.states``."""

    def __init__(self, pod: Pod, wall: Callable[[], float] = time.time) -> None:
        self._pod = pod
        self._wall = wall

    def activity(self, session_id: str) -> SessionActivity | None:
        partition = self._pod.input_partition_of(session_id)
        if partition is None or partition not in self._pod.states.owned():
            return None
        tally = _Tally(self._wall() + FUTURE_ALLOWANCE_S)
        tally.add(state for _, state in self._pod.states.referencing(partition, session_id))
        return tally.get(session_id)


class _Tally:
    """Per session: its agent executions counted, whether one is live, and its latest stamp (one not
    further ahead than ``latest_allowed``)."""

    def __init__(self, latest_allowed: float) -> None:
        self._latest_allowed = latest_allowed
        self._busy: dict[str, bool] = {}
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def add(self, states: Iterable[state_pb2.ExecutionState]) -> None:
        for state in states:
            if state.kind != common_pb2.AGENT_EXECUTION or not state.session_id or not state.created:
                continue
            sid = state.session_id
            self._count[sid] = self._count.get(sid, 0) + 1
            active = state.phase not in TERMINAL_WORKFLOW_PHASES and not state.refused
            self._busy[sid] = self._busy.get(sid, False) or active
            if state.HasField("updated_at"):
                stamp = state.updated_at.seconds + state.updated_at.nanos / 1e9
                if stamp <= self._latest_allowed:
                    self._last[sid] = max(self._last.get(sid, stamp), stamp)

    def get(self, session_id: str) -> SessionActivity:
        return SessionActivity(
            busy=self._busy.get(session_id, False),
            last_active_at=self._last.get(session_id),
            executions=self._count.get(session_id, 0),
        )
