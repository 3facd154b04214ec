"""What a reaper pass reads of a pod's states: only the states its plan depends on, in bounded slices.

:func:`consumers.lanes.reap.plan_reap` judges a listed sandbox from at most: the state keyed by its id
(a workflow's execution, a session's own record) and, for a session sandbox whose verdict depends
on them (:func:`~consumers.lanes.reap.needs_references`), the states that reference the session.
The first are point lookups; the second sit on the session's partition (an agent execution is
keyed by its session id), read through the store's cursor (``scan``) a slice at a time, the raw
bytes sifted for the session ids before anything is decoded. Between two slices the pass yields
to the event loop, so no pass holds the loop for more than one slice, whatever the store holds;
with expiring states (retention on) a partition is read only for a deleted session's sandbox. The
listing is filtered by partition and judged (:func:`plan`) a slice of sandboxes at a time as well.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from consumers.lanes.reap import ReapPlan, index_references, needs_references, plan_reap, sessions_referenced
from consumers.runtime.state.interface import HeldStates
from drivers.contract import ManagedSandbox
from events.codec import decode_state
from events.sandbox_lanes.v1 import state_pb2

#: A partition's states looked through per slice (between two yields to the loop): at most this
#: many decodes (~5 us each for a workflow's state), most sifted out on their raw bytes.
SLICE = 256
#: Listed sandboxes looked up per slice: each a RocksDB read (a block from disk when not cached:
#: tens of microseconds) and a decode.
LOOKUPS = 64
#: Past this many session ids sought in one partition, the raw-bytes sift costs more than a decode:
#: every state of the slice is decoded instead.
SIFT_MAX = 32


class ReapStates(Protocol):
    """A pod's states as the reaper reads them."""

    def owns(self, key: str) -> bool:
        """Is ``key``'s partition (the one its inputs go to) one this pod holds?"""

    def partition_of(self, key: str) -> int | None: ...

    def get(self, key: str) -> state_pb2.ExecutionState | None: ...

    def scan(self, partition: int, after: str | None, limit: int) -> list[tuple[str, bytes]]: ...

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

    def scan(self, partition: int, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        return self.store.scan(partition, after, limit)

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
    """Add the partition's states that reference any of ``sessions`` to ``into``, a slice at a time."""
    sift = [s.encode() for s in sessions] if len(sessions) <= SIFT_MAX else None
    after: str | None = None
    while raw := view.scan(partition, after, slice_size):
        after = raw[-1][0]
        decoded = 0
        for key, value in raw:
            if sift is not None and not any(s in value for s in sift):
                continue  # a state that references a session holds its id
            state = decode_state(value)
            decoded += 1
            if sessions_referenced(state) & sessions:
                into[key] = state
        counts.slice(decoded, len(raw))
        await asyncio.sleep(0)
