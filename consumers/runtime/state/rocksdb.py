"""The disk store: one RocksDB database (through ``rocksdict``) per owned partition, with a checkpoint.

``SANDBOX_LANES_STATE_STORE=rocksdb``. Each partition's database lives in
``<state dir>/<topic>/<partition>`` and keeps, under one-letter prefixes:

* ``s<key>``: the state, serialized as in the topic;
* ``r<key>``: when the finished state may be removed (milliseconds, 8 bytes big-endian), and
  ``d<when><key>``: the due-time index ordered by that time, so :meth:`RocksDBStore.due` reads
  only the keys whose time has come and the index survives a restart without a scan;
* ``m:checkpoint``: the state topic's offset the database reflects, with what it belongs to
  (topic name and id, partition, isolation level, format version, retention); ``m:count``: keys.

A store's databases share one write buffer manager and one block cache (:data:`MEMTABLES_BYTES`,
:data:`BLOCK_CACHE_BYTES`), so RocksDB's memory is bounded per pod, not per partition owned.

The topic stays the truth. A committed transaction's writes reach the database in one write
batch after its commit (:meth:`RocksDBStore.apply`). The checkpoint is set by :meth:`restore` (the
last stable offset it read to) and moves forward two ways, each only past records proven to be
ones this store applied:

* **with the commit** (the usual way): librdkafka's delivery reports give the offsets of the
  transaction's state records; when they are contiguous and start right at the checkpoint (or
  one past it: the commit marker of this store's previous transaction), the checkpoint moves to
  the last one + 1 (the new commit marker) in the same write batch as the states. Nothing is
  read again; a take-over reads at most that marker.
* **by reading** (:meth:`checkpoint`, when the offsets did not chain: an aborted transaction of
  ours, another writer's record, a producer that does not tell offsets): the topic's tail from the
  checkpoint is read, and the checkpoint moves only when the last record of every key in it is a
  write this store applied (so no other writer's record, nor a commit of ours not yet applied, is
  skipped).

A take-over reads from the checkpoint to the end; the records of the pod's own committed writes
read again there are applied again, which is idempotent. A crash between a commit and its apply
leaves the states and the checkpoint both as they were (one write batch): the tail is read again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError as ProtobufDecodeError
from rocksdict import BlockBasedOptions, Cache, Options, Rdict, WriteBatch, WriteBufferManager

from consumers.lanes.retention import removable_from
from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.unparsable import is_placeholder
from consumers.runtime.state.changelog import Bounds, ChangelogReader, topic_id
from consumers.runtime.state.interface import STATE_FORMAT_VERSION, RestoreReport
from events.codec import decode_state
from events.sandbox_lanes.v1 import state_pb2

logger = logging.getLogger("sandbox_lanes.state")

_STATE = b"s"
_REMOVABLE = b"r"
_DUE = b"d"
_CHECKPOINT = b"m:checkpoint"
_COUNT = b"m:count"
#: Writes applied since the checkpoint kept per partition to prove the next one; past this many the
#: partition's checkpoint stays where it is until its next restore (its tail then reads longer).
_PENDING_LIMIT = 200_000


def _ms(at: float) -> bytes:
    return struct.pack(">Q", max(0, int(at * 1000)))


#: What a store's databases share, whatever the number of partitions it owns: the memtables (all
#: of them, flushed early past this) and the block cache. RocksDB's memory is bounded per pod.
MEMTABLES_BYTES = 64 * 1024 * 1024
BLOCK_CACHE_BYTES = 32 * 1024 * 1024


def _options(memtables: WriteBufferManager, cache: Cache) -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_write_buffer_size(8 * 1024 * 1024)
    opts.set_max_write_buffer_number(2)
    opts.set_keep_log_file_num(2)
    opts.set_write_buffer_manager(memtables)
    table = BlockBasedOptions()
    table.set_block_cache(cache)
    opts.set_block_based_table_factory(table)
    return opts


class _Partition:
    def __init__(self, path: Path, options: Options) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.db = Rdict(str(path), options)
        raw = self.db.get(_COUNT)
        self.count = int(raw) if raw else 0
        #: Per key, the values applied since the checkpoint (None: a tombstone), oldest first.
        self.pending: dict[str, list[bytes | None]] = {}
        self.pending_n = 0
        self.provable = True
        #: The checkpoint's offset as recorded (None: none yet), and whether the record at it is the
        #: commit marker of this store's last transaction (its next records then start one past it).
        self.offset: int | None = None
        self.marker = False
        #: The offsets (first, last) of the transactions applied since the checkpoint that did not
        #: chain, and whether one of them had no known offsets: after a move by reading, the rest
        #: may chain from there.
        self.unproven: list[tuple[int, int]] = []
        self.unknown = False

    def checkpoint(self) -> dict[str, Any] | None:
        raw = self.db.get(_CHECKPOINT)
        if not raw:
            return None
        try:
            found = json.loads(raw)
        except ValueError:
            return None
        return found if isinstance(found, dict) else None

    def close(self) -> None:
        self.db.close()


class RocksDBStore:
    """States on local disk, one database per owned partition; see the module's docstring."""

    def __init__(self, topic: str, retention_s: float = 0.0, *, directory: str | Path) -> None:
        self.topic = topic
        self.retention_s = retention_s
        self.directory = Path(directory) / topic
        self._parts: dict[int, _Partition] = {}
        self._bootstrap: str | None = None
        self._isolation = "read_committed"
        self._security = PLAINTEXT
        self._topic_id: str | None = None
        self._memtables = WriteBufferManager(MEMTABLES_BYTES, False)
        self._cache = Cache(BLOCK_CACHE_BYTES)

    # --- reads -------------------------------------------------------------------------------

    def get(self, partition: int, key: str) -> state_pb2.ExecutionState | None:
        part = self._parts.get(partition)
        raw = None if part is None else part.db.get(_STATE + key.encode())
        return None if raw is None else decode_state(raw)

    def owned(self) -> set[int]:
        return set(self._parts)

    def __len__(self) -> int:
        return sum(p.count for p in self._parts.values())

    def partition_items(self, partition: int) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        part = self._parts.get(partition)
        if part is None:
            return
        for key, raw in _prefixed(part.db, _STATE):
            yield key.decode("utf-8", errors="replace"), decode_state(raw)

    def items(self) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        for partition in list(self._parts):
            yield from self.partition_items(partition)

    def due(self, now: float, limit: int) -> dict[int, list[str]]:
        """Keys whose state may be removed now, per partition (at most ``limit`` in all), read from
        the due-time index. They stay there until their tombstone is committed (:meth:`apply`)."""
        found: dict[int, list[str]] = {}
        bound = _ms(now)
        n = 0
        for partition, part in self._parts.items():
            for index_key, _ in _prefixed(part.db, _DUE):
                if n >= limit or index_key[:8] > bound:
                    break
                found.setdefault(partition, []).append(index_key[8:].decode("utf-8", errors="replace"))
                n += 1
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
    ) -> None:
        """A committed transaction's writes, in one write batch. ``at``: the offsets (first, last)
        of its state records in the topic, contiguous, when the producer told them; when they
        start where the checkpoint is (or one past: our previous commit's marker), the checkpoint
        moves past them in the same batch. Otherwise they wait for :meth:`checkpoint`'s proof."""
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
        for key, state in writes.items():
            raw = None if state is None else state.SerializeToString()
            self._write(part, batch, key.encode(), raw, state, now)
            if part.provable and not chained:
                part.pending.setdefault(key, []).append(raw)
                part.pending_n += 1
        if writes and not chained and part.provable:
            if at is None:
                part.unknown = True
            else:
                part.unproven.append(at)
        if part.pending_n > _PENDING_LIMIT:
            part.provable = False
            part.pending.clear()
            part.unproven.clear()
        batch.put(_COUNT, str(part.count).encode())
        if chained and at is not None:
            batch.put(_CHECKPOINT, self._checkpoint_body(partition, at[1] + 1))
            part.offset, part.marker = at[1] + 1, True
        part.db.write(batch)

    def _write(
        self,
        part: _Partition,
        batch: WriteBatch,
        key: bytes,
        raw: bytes | None,
        state: state_pb2.ExecutionState | None,
        seen_at: float,
    ) -> None:
        db = part.db
        old_at = db.get(_REMOVABLE + key)
        if old_at is not None:
            batch.delete(_DUE + old_at + key)
        existed = db.get(_STATE + key) is not None
        if raw is None or state is None:
            batch.delete(_STATE + key)
            batch.delete(_REMOVABLE + key)
            part.count -= existed
            return
        batch.put(_STATE + key, raw)
        part.count += not existed
        at = removable_from(state, self.retention_s, seen_at)
        if at is None:
            batch.delete(_REMOVABLE + key)
        else:
            batch.put(_REMOVABLE + key, _ms(at))
            batch.put(_DUE + _ms(at) + key, b"")

    # --- partitions come and go --------------------------------------------------------------

    def drop(self, partitions: Iterable[int]) -> None:
        """Close the partitions' databases; their files (and checkpoints) stay for a later take-over."""
        for p in partitions:
            part = self._parts.pop(p, None)
            if part is not None:
                part.close()

    def close(self) -> None:
        self.drop(list(self._parts))

    def adopt(self, partitions: Iterable[int]) -> None:
        """Open the partitions' databases as they are on disk, reading no topic (tools and tests;
        the pod's way in is :meth:`restore`)."""
        for p in partitions:
            if p not in self._parts:
                self._parts[p] = self._open(p)

    def checkpoint_of(self, partition: int) -> dict[str, Any] | None:
        """The partition's recorded checkpoint (an owned partition's), for diagnostics and tests."""
        part = self._parts.get(partition)
        return None if part is None else part.checkpoint()

    def _path(self, partition: int) -> Path:
        return self.directory / str(partition)

    def _open(self, partition: int) -> _Partition:
        return _Partition(self._path(partition), _options(self._memtables, self._cache))

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

    def _checkpoint_body(self, partition: int, offset: int) -> bytes:
        body = {
            "format": STATE_FORMAT_VERSION,
            "topic": self.topic,
            "topicId": self._topic_id,
            "partition": partition,
            "isolation": self._isolation,
            "retentionSeconds": self.retention_s,
            "offset": offset,
        }
        return json.dumps(body).encode()

    def _record_checkpoint(
        self, part: _Partition, partition: int, offset: int, *, marker: bool = False
    ) -> None:
        part.db.put(_CHECKPOINT, self._checkpoint_body(partition, offset))
        part.offset, part.marker = offset, marker

    async def restore(
        self,
        bootstrap: str,
        partitions: Iterable[int],
        *,
        isolation_level: str = "read_committed",
        timeout_s: float = 300.0,
        security: KafkaSecurity = PLAINTEXT,
    ) -> RestoreReport:
        """Open the partitions' databases and read the topic from each checkpoint to the end.

        A checkpoint of another topic (by name or id), partition, isolation level, retention or
        format, or one past the topic's end or before its first offset, is refused: the database
        is wiped and the partition read from the beginning.
        """
        wanted = sorted(set(partitions) - set(self._parts))
        started = time.monotonic()
        if not wanted:
            return RestoreReport(0, 0, 0, 0.0)
        self._bootstrap, self._isolation, self._security = bootstrap, isolation_level, security
        self._topic_id = await topic_id(bootstrap, self.topic, security=security)
        opened: dict[int, _Partition] = {}
        records = 0
        resumed = 0
        try:
            async with ChangelogReader(
                bootstrap, self.topic, wanted, isolation_level=isolation_level, security=security
            ) as reader:
                bounds = await reader.bounds()
                starts: dict[int, int] = {}
                for p in wanted:
                    part = opened[p] = await asyncio.to_thread(self._open, p)
                    found = part.checkpoint()
                    why = self._refused(found, p, bounds[p], isolation_level)
                    if why is None and found is not None:
                        starts[p] = int(found["offset"])
                        resumed += 1
                        continue
                    if found is not None or part.count:
                        logger.warning(
                            "state checkpoint refused: the partition is restored in full",
                            extra={"partition": p, "reason": why},
                        )
                    part.close()
                    await asyncio.to_thread(shutil.rmtree, part.path, True)
                    opened[p] = await asyncio.to_thread(self._open, p)
                    starts[p] = bounds[p].beginning
                seen_at = time.time()
                async for p, recs in reader.read(starts, timeout_s=timeout_s):
                    records += len(recs)
                    self._fold(opened[p], p, recs, seen_at)
                    await asyncio.sleep(0)
                ends = reader.ends()
            for p, part in opened.items():
                part.db.put(_COUNT, str(part.count).encode())
                self._record_checkpoint(part, p, ends[p])
        except BaseException:
            for part in opened.values():
                part.close()
            raise
        self._parts.update(opened)
        report = RestoreReport(
            len(wanted),
            records,
            sum(opened[p].count for p in wanted),
            time.monotonic() - started,
            from_checkpoint=resumed,
            full=len(wanted) - resumed,
        )
        logger.info(
            "state restored",
            extra={
                "partitions": ",".join(map(str, wanted)),
                "records": report.records,
                "keys": report.keys,
                "fromCheckpoint": resumed,
                "seconds": round(report.seconds, 3),
            },
        )
        return report

    def _fold(self, part: _Partition, partition: int, recs: list[Any], seen_at: float) -> None:
        batch = WriteBatch(raw_mode=True)
        #: Keys written earlier in this batch: their index entry is not in the database yet.
        written: dict[bytes, bytes | None] = {}
        for rec in recs:
            if is_placeholder(rec):
                logger.error(
                    "state record the Kafka client cannot parse, skipped",
                    extra={"partition": partition, "offset": rec.offset},
                )
                continue
            key: bytes = rec.key or b""
            if key in written:  # apply what this batch holds before writing the key again
                part.db.write(batch)
                batch = WriteBatch(raw_mode=True)
                written.clear()
            if rec.value is None:
                self._write(part, batch, key, None, None, seen_at)
                written[key] = None
                continue
            try:
                state = decode_state(rec.value)  # only what decodes is kept
            except ProtobufDecodeError:
                logger.error(
                    "state record does not decode, skipped",
                    extra={
                        "partition": partition,
                        "offset": rec.offset,
                        "executionId": key.decode(errors="replace"),
                    },
                )
                continue
            self._write(part, batch, key, rec.value, state, seen_at)
            written[key] = rec.value
        part.db.write(batch)

    async def checkpoint(self, partitions: Iterable[int]) -> dict[int, int]:
        """Move checkpoints forward to the topic's last stable offset where that is proven safe.

        The tail from each checkpoint is read; a partition moves only if, for every key in it, the
        tail's last record is a write :meth:`apply` applied since the checkpoint. Otherwise (a
        commit of ours not applied yet, another writer's record) it stays, which is always safe.
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
            found = part.checkpoint()
            if found is None or not isinstance(found.get("offset"), int):
                return {}
            starts[p] = int(found["offset"])
        last: dict[int, dict[str, bytes | None]] = {p: {} for p in wanted}
        async with ChangelogReader(
            self._bootstrap, self.topic, wanted, isolation_level=self._isolation, security=self._security
        ) as reader:
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
            for key, at in matched.items():
                applied = part.pending[key]
                del applied[: at + 1]
                part.pending_n -= at + 1
                if not applied:
                    del part.pending[key]
            self._record_checkpoint(part, p, ends[p])
            moved[p] = self._chain(part, p)
        return moved

    def _chain(self, part: _Partition, partition: int) -> int:
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
        self._record_checkpoint(part, partition, moved, marker=True)
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


def _prefixed(db: Rdict, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The entries whose key starts with ``prefix``, the prefix cut off, in key order."""
    it = db.iter()
    try:
        it.seek(prefix)
        while it.valid():
            key = it.key()
            if not key.startswith(prefix):
                break
            yield key[len(prefix) :], it.value()
            it.next()
    finally:
        del it
