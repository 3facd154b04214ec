"""A disk store's checkpoints: what one records, when one is refused or stale, and how it moves.

The topic stays the truth. The checkpoint is set by the restore (the last stable offset it read to)
and moves forward two ways, each only past records proven to be ones this store applied:

* **with the commit** (the usual way, in
  :meth:`~consumers.runtime.state.rocksdb.RocksDBStore.apply`): librdkafka's delivery reports give
  the offsets of the transaction's state records; when they are contiguous and start right at the
  checkpoint (or one past it: the commit marker of this store's previous transaction), the
  checkpoint moves to the last one + 1 (the new commit marker) in the same write batch as the
  states. Nothing is read again; a take-over reads at most that marker.
* **by reading** (:meth:`CheckpointedDatabases.checkpoint`, when the offsets did not chain: an
  aborted transaction of ours, another writer's record, a producer that does not tell offsets): the
  topic's tail from the checkpoint is read, and the checkpoint moves only when the last record of
  every key in it is a write this store applied (so no other writer's record, nor a commit of ours
  not yet applied, is skipped).

A checkpoint of another topic (by name or id), partition, isolation level, retention or format, or
one outside the topic's offsets, is refused (:meth:`CheckpointedDatabases._refused`); one older than
the topic's ``delete.retention.ms`` is stale (:meth:`CheckpointedDatabases._stale`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from consumers.runtime.kafka.security import PLAINTEXT
from consumers.runtime.state.changelog import DEFAULT_DELETE_RETENTION_MS, Bounds, ChangelogReader
from consumers.runtime.state.interface import STATE_FORMAT_VERSION
from consumers.runtime.state.local_faults import guarded
from consumers.runtime.state.rocksdb_databases import PartitionDatabases
from consumers.runtime.state.rocksdb_partition import CHECKPOINT_KEY, RocksDBPartition

#: How much older than its ``asOfMs`` a record past a checkpoint may be: a transaction open when the
#: checkpoint was taken (its records past the last stable offset) lasts at most this long (Kafka's
#: default ``transaction.max.timeout.ms``). A checkpoint is stale past ``delete.retention.ms`` less it.
_TRANSACTION_SLACK_MS = 15 * 60 * 1000


class CheckpointedDatabases(PartitionDatabases):
    """The partitions' databases with their checkpoints, and what the checkpoints belong to."""

    def __init__(self, topic: str, retention_s: float = 0.0, *, directory: str | Path) -> None:
        super().__init__(topic, retention_s, directory=directory)
        #: Where the topic is read and what a checkpoint records of it (set by the restore).
        self._bootstrap: str | None = None
        self._isolation = "read_committed"
        self._security = PLAINTEXT
        self._topic_id: str | None = None
        self._delete_retention_ms = DEFAULT_DELETE_RETENTION_MS

    def checkpoint_of(self, partition: int) -> dict[str, Any] | None:
        """The partition's recorded checkpoint (an owned partition's), for diagnostics and tests."""
        part = self._parts.get(partition)
        return None if part is None else part.checkpoint()

    def _stale(self, found: dict[str, Any], bounds: Bounds, now_ms: int) -> str | None:
        """Why a checkpoint is too old to resume from (None: it is not), finding 13: a tombstone
        written past it may have been compacted away once ``delete.retention.ms`` has gone by, and
        reading the tail would never see it. A partition with nothing past its checkpoint (its end
        at the offset, or one past it: our own commit marker) misses nothing, however old."""
        offset = int(found["offset"])
        if bounds.end <= offset + bool(found.get("marker")):
            return None
        as_of = found.get("asOfMs")
        if not isinstance(as_of, int):
            return "the checkpoint's age is unknown (written by an older version)"
        limit = max(0, self._delete_retention_ms - _TRANSACTION_SLACK_MS)
        if now_ms - as_of < limit:
            return None
        return (
            f"taken {(now_ms - as_of) / 1000:.0f} s ago, past the state topic's delete.retention.ms"
            f" ({self._delete_retention_ms} ms) less {_TRANSACTION_SLACK_MS} ms"
        )

    def _refused(
        self, found: dict[str, Any] | None, partition: int, bounds: Bounds, isolation: str
    ) -> str | None:
        """Why a checkpoint cannot be resumed from (None: it can)."""
        if found is None:
            return "no checkpoint"
        expected: dict[str, Any] = {
            "format": STATE_FORMAT_VERSION,
            "topic": self.topic,
            "partition": partition,
            "isolation": isolation,
            "retentionSeconds": self.retention_s,
        }
        for name, value in expected.items():
            if found.get(name) != value:
                return f"{name} is {found.get(name)!r}, not {value!r}"
        if self._topic_id is not None and found.get("topicId") not in (None, self._topic_id):
            return f"topic id is {found.get('topicId')!r}, not {self._topic_id!r} (recreated)"
        offset = found.get("offset")
        if not isinstance(offset, int):
            return "no offset"
        if offset > bounds.end:
            return f"offset {offset} is past the topic's end {bounds.end} (truncated or recreated)"
        if offset < bounds.beginning:
            return f"offset {offset} is before the topic's first offset {bounds.beginning}"
        return None

    def _checkpoint_body(
        self, partition: int, offset: int, *, marker: bool = False, as_of: float | None = None
    ) -> bytes:
        """``marker``: the record at ``offset`` is our last commit's marker; ``as_of``: no record past
        ``offset`` was written before this time (less an open transaction's life; now by default)."""
        body = {
            "format": STATE_FORMAT_VERSION,
            "topic": self.topic,
            "topicId": self._topic_id,
            "partition": partition,
            "isolation": self._isolation,
            "retentionSeconds": self.retention_s,
            "offset": offset,
            "marker": marker,
            "asOfMs": int((time.time() if as_of is None else as_of) * 1000),
        }
        return json.dumps(body).encode()

    def _record_checkpoint(
        self,
        part: RocksDBPartition,
        partition: int,
        offset: int,
        *,
        marker: bool = False,
        as_of: float | None = None,
    ) -> None:
        with guarded(partition, writing=True):
            part.db.put(CHECKPOINT_KEY, self._checkpoint_body(partition, offset, marker=marker, as_of=as_of))
        part.offset, part.marker = offset, marker

    async def checkpoint(self, partitions: Iterable[int]) -> dict[int, int]:
        """Move checkpoints forward to the topic's last stable offset where that is proven safe.

        The tail from each checkpoint is read; a partition moves only if, for every key in it, the
        tail's last record is a write ``apply`` applied since the checkpoint. Otherwise (a commit of
        ours not applied yet, another writer's record) it stays, which is always safe.
        """
        # A partition with nothing applied past its checkpoint has nothing to prove (its checkpoint
        # moved with its commits): a tail there holds only records it did not write.
        wanted = sorted(
            p
            for p in set(partitions)
            if p in self._parts and self._parts[p].provable and self._parts[p].pending
        )
        if not wanted or self._bootstrap is None:
            return {}
        parts = {p: self._parts[p] for p in wanted}
        starts: dict[int, int] = {}
        for p, part in parts.items():
            with guarded(p, writing=False):
                found = part.checkpoint()
            if found is None or not isinstance(found.get("offset"), int):
                return {}
            starts[p] = int(found["offset"])
        last: dict[int, dict[str, bytes | None]] = {p: {} for p in wanted}
        async with ChangelogReader(
            self._bootstrap, self.topic, wanted, isolation_level=self._isolation, security=self._security
        ) as reader:
            as_of = time.time()  # before the ends are taken: every record past them is later
            await reader.bounds()
            async for p, recs in reader.read(starts, timeout_s=60.0):
                for rec in recs:
                    last[p][(rec.key or b"").decode("utf-8", errors="replace")] = rec.value
            ends = reader.ends()
        moved: dict[int, int] = {}
        for p in wanted:
            part = parts[p]
            if self._parts.get(p) is not part or ends[p] <= starts[p]:
                continue  # released meanwhile, or nothing new
            matched = proven(last[p], part.pending)
            if matched is None:
                continue
            self._record_checkpoint(part, p, ends[p], as_of=as_of)  # written first: then the proof moves
            for key, at in matched.items():
                applied = part.pending[key]
                del applied[: at + 1]
                part.pending_n -= at + 1
                if not applied:
                    del part.pending[key]
            moved[p] = self._chain(part, p, as_of)
        return moved

    def _chain(self, part: RocksDBPartition, partition: int, as_of: float | None = None) -> int:
        """After a move by reading to ``part.offset``: if the transactions applied past it are all
        of known offsets chaining from there (each next one past the previous one's commit marker),
        the checkpoint moves past them too and the commits move it again. Its offset."""
        start = part.offset
        assert start is not None
        if not part.pending:
            part.unproven.clear()
            part.unknown = False
            return start
        later = sorted(r for r in part.unproven if r[0] >= start)  # the rest were in the tail read
        part.unproven = later
        if part.unknown or not later:
            return start
        expected = start
        for first, last in later:
            if first != expected:
                return start
            expected = last + 2
        moved = later[-1][1] + 1
        self._record_checkpoint(part, partition, moved, marker=True, as_of=as_of)
        part.pending.clear()
        part.pending_n = 0
        part.unproven = []
        return moved


def proven(
    tail_last: Mapping[str, bytes | None], applied: Mapping[str, list[bytes | None]]
) -> dict[str, int] | None:
    """Whether a checkpoint may move past a tail: per key, where the tail's last record is among the
    writes applied since the checkpoint (the first such write); None if any key's is not."""
    matched: dict[str, int] = {}
    for key, value in tail_last.items():
        writes = applied.get(key, [])
        if value not in writes:
            return None
        matched[key] = writes.index(value)
    return matched
