"""A session's activity from the pod's own state: what the agent-sandbox idle sweep judges by.

Upstream reads its executions table (busy while any execution of the session is not terminal;
otherwise idle since the latest stamp). Here the same facts are in the execution states the pod
restored from the compacted topic. An agent execution's events are keyed by its session id, so all
of a session's states sit on one partition: the pod that owns it judges the session, every other
pod answers ``None`` and leaves it alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from consumers.lanes.constants import TERMINAL_WORKFLOW_PHASES
from drivers.agent_sandbox.idle import SessionActivity
from events.sandbox_lanes.v1 import common_pb2

if TYPE_CHECKING:
    from consumers.runtime.pod import Pod

#: One index of the owned states per sweep pass, not one scan per Sandbox.
INDEX_TTL_S = 1.0
#: A stamp further ahead of this pod's clock is skipped (upstream's allowance, spec 4.5): a skewed
#: producer clock must not keep a sandbox awake until that time passes.
FUTURE_ALLOWANCE_S = 60.0


class StoreSessionActivity:
    """``SessionActivityReader`` over ``pod.states``."""

    def __init__(
        self, pod: Pod, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ) -> None:
        self._pod = pod
        self._clock = clock
        self._wall = wall
        self._built_at: float | None = None
        self._index: dict[str, SessionActivity] = {}

    def activity(self, session_id: str) -> SessionActivity | None:
        partition = self._pod.input_partition_of(session_id)
        if partition is None or partition not in self._pod.states.owned():
            return None
        now = self._clock()
        if self._built_at is None or now - self._built_at >= INDEX_TTL_S:
            self._index = self._build()
            self._built_at = now
        return self._index.get(session_id, SessionActivity(busy=False, last_active_at=None, executions=0))

    def _build(self) -> dict[str, SessionActivity]:
        busy: dict[str, bool] = {}
        last: dict[str, float] = {}
        count: dict[str, int] = {}
        latest_allowed = self._wall() + FUTURE_ALLOWANCE_S
        for _key, state in self._pod.states.items():
            if state.kind != common_pb2.AGENT_EXECUTION or not state.session_id or not state.created:
                continue
            sid = state.session_id
            count[sid] = count.get(sid, 0) + 1
            active = state.phase not in TERMINAL_WORKFLOW_PHASES and not state.refused
            busy[sid] = busy.get(sid, False) or active
            if state.HasField("updated_at"):
                stamp = state.updated_at.seconds + state.updated_at.nanos / 1e9
                if stamp <= latest_allowed:
                    last[sid] = max(last.get(sid, stamp), stamp)
        return {
            sid: SessionActivity(busy=busy[sid], last_active_at=last.get(sid), executions=n)
            for sid, n in count.items()
        }
