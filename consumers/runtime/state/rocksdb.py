r"""The disk store: one RocksDB database (through ``rocksdict``) per owned partition, with a checkpoint.

``SANDBOX_LANES_STATE_STORE=rocksdb``. One module per job, as Quix Streams' ``state/rocksdb/``:

* :mod:`.rocksdb` (this one): :class:`RocksDBStore`, the store the pod uses: its reads (a state, a
  partition's states, a scan, the keys due for removal) and its writes (a committed transaction's,
  in one write batch);
* :mod:`.rocksdb_partition`: one partition's database: its key layout, options, a key's write;
* :mod:`.rocksdb_databases`: the partitions' databases held, opened, closed, thrown away;
* :mod:`.rocksdb_checkpoints`: what a checkpoint records, when it is refused or stale, how it moves
  (with the commit, or by reading the tail);
* :mod:`.rocksdb_restore`: the take-over's restore, each database checked on its own.

The topic stays the truth. A committed transaction's writes reach the database in one write batch
after its commit (:meth:`RocksDBStore.apply`), the checkpoint with them when their offsets chain
from it. Once running, a read or write the database fails raises
:class:`~consumers.runtime.state.interface.StateStoreFault` and changes nothing (an :meth:`apply`
moves no count, checkpoint or proof unless its write batch was written); the pod then
:meth:`~RocksDBStore.discard`\ s the partition and restores it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from rocksdict import WriteBatch

from consumers.runtime.state.local_faults import guarded
from consumers.runtime.state.rocksdb_partition import (
    CHECKPOINT_KEY,
    COUNT_KEY,
    DUE_PREFIX,
    OUTBOX_PREFIX,
    STATE_PREFIX,
    UNKNOWN,
    ms_key,
    prefixed,
    session_entry,
)
from consumers.runtime.state.rocksdb_restore import RestoringDatabases
from events.codec import decode_state
from events.sandbox_lanes.v1 import state_pb2

#: Writes applied since the checkpoint kept per partition to prove the next one; past this many the
#: partition's checkpoint stays where it is until its next restore (its tail then reads longer).
_PENDING_LIMIT = 200_000


class RocksDBStore(RestoringDatabases):
    """States on local disk, one database per owned partition; see the module's docstring."""

    # --- reads -------------------------------------------------------------------------------

    def get(self, partition: int, key: str) -> state_pb2.ExecutionState | None:
        part = self._parts.get(partition)
        if part is None:
            return None
        with guarded(partition, writing=False):
            raw = part.db.get(STATE_PREFIX + key.encode())
        return None if raw is None else decode_state(raw)

    def __len__(self) -> int:
        return sum(p.count for p in self._parts.values())

    def partition_items(self, partition: int) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        part = self._parts.get(partition)
        if part is None:
            return
        with guarded(partition, writing=False):
            for key, raw in prefixed(part.db, STATE_PREFIX):
                yield key.decode("utf-8", errors="replace"), decode_state(raw)

    def pending_items(self, partition: int) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        """The partition's states with driver calls pending, in key order, from the outbox index:
        what a take-over re-runs reads these states only, whatever else the partition holds."""
        part = self._parts.get(partition)
        if part is None:
            return
        with guarded(partition, writing=False):
            keys = [key for key, _ in prefixed(part.db, OUTBOX_PREFIX)]
            for key in keys:
                raw = part.db.get(STATE_PREFIX + key)
                if raw is not None:
                    yield key.decode("utf-8", errors="replace"), decode_state(raw)

    def referencing(self, partition: int, session_id: str) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        """The partition's states that reference the session (its executions, and those recording
        its sandbox), in key order, from the session index: what they are, whatever else it holds."""
        part = self._parts.get(partition)
        if part is None:
            return
        with guarded(partition, writing=False):
            keys = [key for key, _ in prefixed(part.db, session_entry(session_id.encode()))]
            for key in keys:
                raw = part.db.get(STATE_PREFIX + key)
                if raw is not None:
                    yield key.decode("utf-8", errors="replace"), decode_state(raw)

    def items(self) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        for partition in list(self._parts):
            yield from self.partition_items(partition)

    def due(self, now: float, limit: int) -> dict[int, list[str]]:
        """Keys whose state may be removed now, per partition (at most ``limit`` in all), read from
        the due-time index. They stay there until their tombstone is committed (:meth:`apply`)."""
        found: dict[int, list[str]] = {}
        bound = ms_key(now)
        n = 0
        for partition, part in self._parts.items():
            with guarded(partition, writing=False):
                floor = bound  # no entry at or past the floor: none before the bound either
                for index_key, _ in prefixed(part.db, DUE_PREFIX, part.due_floor):
                    floor = min(floor, index_key)
                    if n >= limit or index_key[:8] > bound:
                        break
                    found.setdefault(partition, []).append(index_key[8:].decode("utf-8", errors="replace"))
                    n += 1
                part.due_floor = floor
        return found

    # --- writes ------------------------------------------------------------------------------

    def put(self, partition: int, key: str, state: state_pb2.ExecutionState) -> None:
        self.apply(partition, {key: state})

    def delete(self, partition: int, key: str) -> None:
        self.apply(partition, {key: None})

    def apply(
        self,
        partition: int,
        writes: Mapping[str, state_pb2.ExecutionState | None],
        at: tuple[int, int] | None = None,
        prior: Mapping[str, state_pb2.ExecutionState | None] | None = None,
    ) -> None:
        """A committed transaction's writes, in one write batch. ``at``: the offsets (first, last)
        of its state records in the topic, contiguous, when the producer told them; when they
        start where the checkpoint is (or one past: our previous commit's marker), the checkpoint
        moves past them in the same batch. Otherwise they wait for :meth:`checkpoint`'s proof.

        Nothing moves (count, checkpoint, the writes kept for the proof) unless the batch was
        written: a read or the write that fails raises :class:`StateStoreFault`, the store as before.
        """
        part = self._parts.get(partition)
        if part is None:
            return
        batch = WriteBatch(raw_mode=True)
        now = time.time()
        chained = (
            at is not None
            and part.provable
            and not part.pending
            and part.offset is not None
            and at[0] == part.offset + part.marker
        )
        count = part.count
        kept: list[tuple[str, bytes | None]] = []
        with guarded(partition, writing=False):
            for key, state in writes.items():
                raw = None if state is None else state.SerializeToString()
                known = UNKNOWN if prior is None else prior.get(key, UNKNOWN)
                count += part.stage(batch, key.encode(), raw, state, now, self.retention_s, prior=known)
                kept.append((key, raw))
        batch.put(COUNT_KEY, str(count).encode())
        moved = at[1] + 1 if chained and at is not None else None
        if moved is not None:
            batch.put(CHECKPOINT_KEY, self._checkpoint_body(partition, moved, marker=True))
        with guarded(partition, writing=True):
            part.db.write(batch)
        # Written: only now does the bookkeeping follow it.
        part.count = count
        if moved is not None:
            part.offset, part.marker = moved, True
        elif part.provable:
            for key, raw in kept:
                part.pending.setdefault(key, []).append(raw)
                part.pending_n += 1
            if writes:
                if at is None:
                    part.unknown = True
                else:
                    part.unproven.append(at)
        if part.pending_n > _PENDING_LIMIT:
            part.provable = False
            part.pending.clear()
            part.unproven.clear()
