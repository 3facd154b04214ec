"""The store protocol: what the pod, the reaper, replay and session activity use of a state store.

Two implementations: :class:`~consumers.runtime.state.memory.MemoryStore` (every state in memory,
restored from the beginning of the topic on each take-over: the tests' and the demo's) and
:class:`~consumers.runtime.state.rocksdb.RocksDBStore` (one RocksDB database per owned partition
on local disk, with a checkpoint, so a take-over reads only the topic's tail). Either way the
compacted state topic is the truth: a store is a cache of it that can always be rebuilt.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from events.sandbox_lanes.v1 import state_pb2

#: The layout of what a disk store keeps (keys, due-time index, outbox index, session index,
#: checkpoint). A checkpoint written by another format is refused: the partition is restored in full
#: (2: the outbox index, which a database of format 1 lacks; 3: the session index).
STATE_FORMAT_VERSION = 3
#: How often a pod moves its store's checkpoints forward (a disk store's; the memory store has none).
CHECKPOINT_INTERVAL_S = 5.0


#: Why a partition's local database was thrown away and the partition rebuilt from the topic (the
#: label values of ``sandbox_lanes_state_rebuilds_total{reason}``; anything else counts as ``other``).
REBUILD_REASONS = (
    "corrupt",  # RocksDB reports corruption (CURRENT, MANIFEST, an SST), or its data went missing
    "not_a_directory",  # the partition's path is a regular file
    "unwritable",  # permission denied, a read-only filesystem
    "disk_full",  # no space left on the device
    "write_failed",  # another error writing (an I/O error)
    "read_failed",  # another error reading
    "stale_checkpoint",  # older than the topic's delete.retention.ms: tombstones may be gone
    "other",
)


class StateStoreFault(Exception):
    """The local database of ``partition`` cannot be read or written (``reason``: one of
    :data:`REBUILD_REASONS`). Nothing of the failed operation took effect in the store; the cure is
    :meth:`StateStore.discard` and a restore from the topic (the truth)."""

    def __init__(self, partition: int, reason: str, detail: str = "") -> None:
        told = f"state store of partition {partition}: {reason}"
        super().__init__(f"{told}: {detail}" if detail else told)
        self.partition = partition
        self.reason = reason if reason in REBUILD_REASONS else "other"
        self.detail = detail


@dataclass
class RestoreReport:
    partitions: int
    records: int
    keys: int
    seconds: float
    #: Partitions that resumed from a checkpoint (read only the tail), and those restored in full.
    from_checkpoint: int = 0
    full: int = 0
    #: Partitions whose local database was thrown away (damaged, stale or discarded) and rebuilt
    #: from the topic, with the reason (one of :data:`REBUILD_REASONS`).
    rebuilt: dict[int, str] = field(default_factory=dict)


class HeldStates(Protocol):
    """What other layers may read of a pod's states: committed values, never a write."""

    def get(self, partition: int, key: str) -> state_pb2.ExecutionState | None: ...

    def owned(self) -> set[int]: ...

    def items(self) -> Iterator[tuple[str, state_pb2.ExecutionState]]: ...

    def referencing(self, partition: int, session_id: str) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        """The partition's states that reference the session (its executions, and those recording its
        sandbox: :func:`~consumers.lanes.reap.sessions_referenced`), in key order, from the store's
        session index: a read that grows with the session, never with what else the partition holds."""
        ...

    def __len__(self) -> int: ...


class StateStore(HeldStates, Protocol):
    """A pod's states of its owned partitions, holding only committed values.

    A transaction's writes go to the state topic inside the partition's transaction and reach the
    store only after its commit (:meth:`apply`). :meth:`restore` rebuilds partitions on take-over.
    """

    topic: str
    retention_s: float

    def memory_bytes(self) -> int | None:
        """What the store holds in memory beside the states' own objects, when it can tell (a disk
        store: its database's caches and buffers); None when it cannot."""
        ...

    def put(self, partition: int, key: str, state: state_pb2.ExecutionState) -> None: ...

    def delete(self, partition: int, key: str) -> None: ...

    def apply(
        self,
        partition: int,
        writes: Mapping[str, state_pb2.ExecutionState | None],
        at: tuple[int, int] | None = None,
        prior: Mapping[str, state_pb2.ExecutionState | None] | None = None,
    ) -> None:
        """A committed transaction's writes (None: a tombstone), all at once; ``at``: the offsets
        (first, last) of its records in the state partition, when the producer told them and they
        are contiguous (a disk store's checkpoint moves with them). ``prior``: what this store held
        for keys the transaction read from it (None: not held); the partition has one writer, so it
        is still what they replace, and a disk store writes them without reading it again."""

    def due(self, now: float, limit: int) -> dict[int, list[str]]:
        """Keys whose state may be removed now, per partition (at most ``limit`` in all)."""

    def drop(self, partitions: Iterable[int]) -> None:
        """Forget partitions (a disk store closes them and keeps its files for a later take-over)."""

    def discard(self, partitions: Iterable[int], reason: str) -> None:
        """Throw the partitions' local state away (a disk store deletes their databases), logged
        once with ``reason``: they are no longer held, and the next :meth:`restore` rebuilds them
        from the beginning of the topic and reports them in :attr:`RestoreReport.rebuilt`."""

    def partition_items(self, partition: int) -> Iterator[tuple[str, state_pb2.ExecutionState]]: ...

    def pending_items(self, partition: int) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        """The partition's states with driver calls pending (the outbox), in key order, read from an
        index kept with the writes: a take-over's resume reads these, not every state held."""
        ...

    async def restore(
        self,
        bootstrap: str,
        partitions: Iterable[int],
        *,
        isolation_level: str = "read_committed",
        timeout_s: float = 300.0,
        security: KafkaSecurity = PLAINTEXT,
    ) -> RestoreReport: ...

    async def checkpoint(self, partitions: Iterable[int]) -> dict[int, int]:
        """Move the partitions' checkpoints forward as far as it is proven safe; their offsets."""

    def close(self) -> None: ...
