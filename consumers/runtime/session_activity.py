"""A session's activity from the pod's own state: what the agent-sandbox idle sweep judges by.

Upstream reads its executions table (busy while any execution of the session is not terminal;
otherwise idle since the latest stamp). Here the same facts are in the execution states the pod
restored from the compacted topic. An agent execution's events are keyed by its session id, so all
of a session's states sit on one partition: the pod that owns it judges the session, every other
pod answers ``None`` and leaves it alone.

The index of every session's activity is built from all the held states, so inside the pod (an
event loop running) it is built by a task beside the sweep, through the store's cursor a slice at
a time, yielding to the loop between slices (issue 45: no pass holds the loop for what the store
holds; one build over 1M states held it 1.2 s). The sweep is answered from the last index built,
at most ``INDEX_TTL_S`` plus one build old; until the first is built, ``None`` (this pass judges
nothing: the next one will).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from consumers.lanes.constants import TERMINAL_WORKFLOW_PHASES
from drivers.agent_sandbox.idle import SessionActivity
from events.codec import decode_state
from events.sandbox_lanes.v1 import common_pb2, state_pb2

if TYPE_CHECKING:
    from consumers.runtime.pod import Pod

logger = logging.getLogger("sandbox_lanes.session_activity")

#: One index of the owned states per sweep pass, not one scan per Sandbox.
INDEX_TTL_S = 1.0
#: States read (and decoded) per slice of a build, between two yields to the loop.
SLICE = 256
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
        self._index: _Tally | None = None
        self._building: asyncio.Task[None] | None = None
        #: States read per slice of the last build made beside the loop (what its tests pin).
        self.slices: list[int] = []

    def activity(self, session_id: str) -> SessionActivity | None:
        partition = self._pod.input_partition_of(session_id)
        if partition is None or partition not in self._pod.states.owned():
            return None
        now = self._clock()
        if self._built_at is None or now - self._built_at >= INDEX_TTL_S:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop to hold (a tool, a test): built here and now
                tally = _Tally(self._wall() + FUTURE_ALLOWANCE_S)
                tally.add(state for _, state in self._pod.states.items())
                self._index, self._built_at = tally, now
            else:
                if self._building is None or self._building.done():
                    self._building = loop.create_task(self._build_in_slices(now), name="session-activity")
        return None if self._index is None else self._index.get(session_id)

    async def _build_in_slices(self, started: float) -> None:
        """A fresh index, read through the store's cursor a slice at a time (a yield after each)."""
        states = self._pod.states
        tally = _Tally(self._wall() + FUTURE_ALLOWANCE_S)
        slices: list[int] = []
        try:
            for partition in sorted(states.owned()):
                after: str | None = None
                while raw := states.scan(partition, after, SLICE):
                    after = raw[-1][0]
                    slices.append(len(raw))
                    tally.add(decode_state(value) for _, value in raw)
                    await asyncio.sleep(0)
        except Exception as exc:  # the last index stays; the next question starts another build
            logger.warning("session activity index not rebuilt", extra={"error": repr(exc)})
            return
        self._index, self._built_at, self.slices = tally, started, slices


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
