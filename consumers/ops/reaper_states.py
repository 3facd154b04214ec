"""What a reaper pass reads of a pod's states: only the states its plan depends on, in bounded slices.

:func:`consumers.lanes.reap.plan_reap` judges a listed sandbox from at most: the state keyed by its id
(a workflow's execution, a session's own record) and, for a session sandbox whose verdict depends
on them (:func:`~consumers.lanes.reap.needs_references`), the states that reference the session.
The first are point lookups; the second sit on the session's partition (an agent execution is
keyed by its session id), read from the store's session index (``referencing``): what a pass reads
for a session grows with the session, never with what its partition holds (before the index, the
partition was read through: 14 s of CPU at 10M states). Between two slices the pass yields to the
event loop, so no pass holds the loop for more than one slice, whatever the store holds. The
listing is filtered by partition and judged (:func:`plan`) a slice of sandboxes at a time as well.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from consumers.lanes.reap import ReapPlan, index_references, needs_references, plan_reap
from consumers.runtime.state.interface import HeldStates
from drivers.contract import ManagedSandbox
from events.sandbox_lanes.v1 import state_pb2

#: States referencing the sessions sought, read from the session index per slice (between two
#: yields to the loop; a whole session's at once): about 5 us each to read and decode.
SLICE = 256
#: Listed sandboxes looked up per slice: each a RocksDB read (a block from disk when not cached:
#: tens of microseconds) and a decode.
LOOKUPS = 64


class ReapStates(Protocol):
    """A pod's states as the reaper reads them."""

    def owns(self, key: str) -> bool:
        """Is ``key``'s partition (the one its inputs go to) one this pod holds?"""

    def partition_of(self, key: str) -> int | None: ...

    def get(self, key: str) -> state_pb2.ExecutionState | None: ...

    def referencing(self, partition: int, session_id: str) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        """The partition's states that reference the session (the store's session index)."""
        ...

    def __len__(self) -> int: ...


@dataclass
class StoreStates:
    """:class:`ReapStates` over a store and the input partitioner (a workflow sandbox is keyed by
    its execution id, a session sandbox by its session id: the keys its inputs are partitioned by)."""

    store: HeldStates
    partitioner: Callable[[str], int | None]

    def partition_of(self, key: str) -> int | None:
        return self.partitioner(key)

    def owns(self, key: str) -> bool:
        partition = self.partitioner(key)
        return partition is not None and partition in self.store.owned()

    def get(self, key: str) -> state_pb2.ExecutionState | None:
        partition = self.partitioner(key)
        return None if partition is None else self.store.get(partition, key)

    def referencing(self, partition: int, session_id: str) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        return self.store.referencing(partition, session_id)

    def __len__(self) -> int:
        return len(self.store)


@dataclass
class ReadCounts:
    """What a pass read: per slice, the states it decoded and the raw states it looked at."""

    decoded: list[int] = field(default_factory=list)
    looked_at: list[int] = field(default_factory=list)

    def slice(self, decoded: int, looked_at: int) -> None:
        self.decoded.append(decoded)
        self.looked_at.append(looked_at)


async def owned(
    view: ReapStates, managed: Iterable[ManagedSandbox], *, lookups: int = LOOKUPS
) -> list[ManagedSandbox]:
    """The listed sandboxes of partitions this pod holds (a hash of each id), a slice at a time."""
    listed = list(managed)
    mine: list[ManagedSandbox] = []
    for start in range(0, len(listed), lookups):
        mine += [m for m in listed[start : start + lookups] if view.owns(m.sandbox_id)]
        await asyncio.sleep(0)
    return mine


async def plan(
    managed: Sequence[ManagedSandbox],
    states: Mapping[str, state_pb2.ExecutionState],
    now: float,
    grace: float,
    *,
    states_expire: bool,
    slice_size: int = SLICE,
    lookups: int = LOOKUPS,
) -> list[ReapPlan]:
    """:func:`~consumers.lanes.reap.plan_reap` over ``managed``, a slice of sandboxes at a time (its
    index of references built a slice of states at a time), yielding to the loop in between."""
    values = list(states.values())
    by_session: dict[str, list[state_pb2.ExecutionState]] = {}
    for start in range(0, len(values), slice_size):
        index_references(values[start : start + slice_size], by_session)
        await asyncio.sleep(0)
    plans: list[ReapPlan] = []
    for start in range(0, len(managed), lookups):
        chunk = managed[start : start + lookups]
        plans += plan_reap(chunk, states, now, grace, states_expire=states_expire, by_session=by_session)
        await asyncio.sleep(0)
    return plans


async def states_for(
    view: ReapStates,
    managed: Iterable[ManagedSandbox],
    *,
    states_expire: bool,
    slice_size: int = SLICE,
    lookups: int = LOOKUPS,
    counts: ReadCounts | None = None,
) -> dict[str, state_pb2.ExecutionState]:
    """The states :func:`~consumers.lanes.reap.plan_reap` needs to judge ``managed`` (sandboxes of
    partitions this pod holds), read a slice at a time with a yield to the loop after each."""
    counts = ReadCounts() if counts is None else counts
    listed = list(managed)
    states: dict[str, state_pb2.ExecutionState] = {}
    for start in range(0, len(listed), lookups):
        found = 0
        for sandbox in listed[start : start + lookups]:
            if (
                sandbox.scope in ("workflow", "session")
                and (state := view.get(sandbox.sandbox_id)) is not None
            ):
                states[sandbox.sandbox_id] = state
                found += 1
        counts.slice(found, found)
        await asyncio.sleep(0)
    sought: dict[int, set[str]] = {}
    for sandbox in listed:
        sid = sandbox.sandbox_id
        if sandbox.scope != "session" or not needs_references(
            sid, states.get(sid), states_expire=states_expire
        ):
            continue
        partition = view.partition_of(sid)
        if partition is not None:
            sought.setdefault(partition, set()).add(sid)
    for partition, sessions in sought.items():
        await _referencing(view, partition, sessions, states, slice_size, counts)
    return states


async def _referencing(
    view: ReapStates,
    partition: int,
    sessions: set[str],
    into: dict[str, state_pb2.ExecutionState],
    slice_size: int,
    counts: ReadCounts,
) -> None:
    """Add the partition's states that reference any of ``sessions`` to ``into``, from the session
    index: one session's states read at once (nothing of the store held across a yield), a yield
    after each session and after every ``slice_size`` states."""
    decoded = 0
    ordered = sorted(sessions)
    for i, session in enumerate(ordered):
        for key, state in list(view.referencing(partition, session)):
            into[key] = state
            decoded += 1
        if decoded >= slice_size or i == len(ordered) - 1:
            counts.slice(decoded, decoded)
            decoded = 0
        await asyncio.sleep(0)
