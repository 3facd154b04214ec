"""The store protocol: what the pod, the reaper, replay and session activity use of a state store.

Two implementations: :class:`~consumers.runtime.state.memory.MemoryStore` (every state in memory,
restored from the beginning of the topic on each take-over: the tests' and the demo's) and
:class:`~consumers.runtime.state.rocksdb.RocksDBStore` (one RocksDB database per owned partition
on local disk, with a checkpoint, so a take-over reads only the topic's tail). Either way the
compacted state topic is the truth: a store is a cache of it that can always be rebuilt.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from events.sandbox_lanes.v1 import state_pb2

#: The layout of what a disk store keeps (keys, due-time index, checkpoint). A checkpoint written
#: by another format is refused: the partition is restored in full.
STATE_FORMAT_VERSION = 1
#: How often a pod moves its store's checkpoints forward (a disk store's; the memory store has none).
CHECKPOINT_INTERVAL_S = 5.0


@dataclass
class RestoreReport:
    partitions: int
    records: int
    keys: int
    seconds: float
    #: Partitions that resumed from a checkpoint (read only the tail), and those restored in full.
    from_checkpoint: int = 0
    full: int = 0


class HeldStates(Protocol):
    """What other layers may read of a pod's states: committed values, never a write."""

    def get(self, partition: int, key: str) -> state_pb2.ExecutionState | None: ...

    def owned(self) -> set[int]: ...

    def items(self) -> Iterator[tuple[str, state_pb2.ExecutionState]]: ...

    def __len__(self) -> int: ...


class StateStore(HeldStates, Protocol):
    """A pod's states of its owned partitions, holding only committed values.

    A transaction's writes go to the state topic inside the partition's transaction and reach the
    store only after its commit (:meth:`apply`). :meth:`restore` rebuilds partitions on take-over.
    """

    topic: str
    retention_s: float

    def put(self, partition: int, key: str, state: state_pb2.ExecutionState) -> None: ...

    def delete(self, partition: int, key: str) -> None: ...

    def apply(
        self,
        partition: int,
        writes: Mapping[str, state_pb2.ExecutionState | None],
        at: tuple[int, int] | None = None,
    ) -> None:
        """A committed transaction's writes (None: a tombstone), all at once; ``at``: the offsets
        (first, last) of its records in the state partition, when the producer told them and they
        are contiguous (a disk store's checkpoint moves with them)."""

    def due(self, now: float, limit: int) -> dict[int, list[str]]:
        """Keys whose state may be removed now, per partition (at most ``limit`` in all)."""

    def drop(self, partitions: Iterable[int]) -> None:
        """Forget partitions (a disk store closes them and keeps its files for a later take-over)."""

    def partition_items(self, partition: int) -> Iterator[tuple[str, state_pb2.ExecutionState]]: ...

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
