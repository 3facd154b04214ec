r"""The disk store: one RocksDB database (through ``rocksdict``) per owned partition, with a checkpoint.

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

The local database is disposable (issue 42). :meth:`RocksDBStore.restore` opens and checks each
partition's database on its own: one that cannot be opened, read or written (a corrupt ``CURRENT``,
``MANIFEST`` or SST, a regular file where its directory should be, an unwritable or full disk), one
that lost its data (:mod:`.local_faults`' marker), and a checkpoint older than the topic's
``delete.retention.ms`` (a tombstone past it may have been compacted away) are thrown away and the
partition rebuilt from the beginning of the topic, logged once with the reason; the healthy ones
resume from their checkpoints. Once running, a read or write the database fails raises
:class:`~consumers.runtime.state.interface.StateStoreFault` and changes nothing (an :meth:`apply`
moves no count, checkpoint or proof unless its write batch was written); the pod then
:meth:`~RocksDBStore.discard`\ s the partition and restores it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError as ProtobufDecodeError
from rocksdict import BlockBasedOptions, Cache, Options, Rdict, ReadOptions, WriteBatch, WriteBufferManager

from consumers.lanes.retention import removable_from
from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.unparsable import is_placeholder
from consumers.runtime.state.changelog import (
    DEFAULT_DELETE_RETENTION_MS,
    Bounds,
    ChangelogReader,
    topic_facts,
)
from consumers.runtime.state.interface import (
    REBUILD_REASONS,
    STATE_FORMAT_VERSION,
    RestoreReport,
    StateStoreFault,
)
from consumers.runtime.state.local_faults import guarded, mark, marked
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
#: How much older than its ``asOfMs`` a record past a checkpoint may be: a transaction open when the
#: checkpoint was taken (its records past the last stable offset) lasts at most this long (Kafka's
#: default ``transaction.max.timeout.ms``). A checkpoint is stale past ``delete.retention.ms`` less it.
_TRANSACTION_SLACK_MS = 15 * 60 * 1000


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
        try:
            raw = self.db.get(_COUNT)
        except BaseException:
            # Closed here, not when the exception's traceback lets go of it: RocksDB keeps the
            # database's LOCK taken in this process till then, and its rebuild could not open.
            self.db.close()
            raise
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
        #: No due-time index entry sorts before this (its time as ``_ms``, then its key; b"": not
        #: known yet): where :meth:`RocksDBStore.due` seeks. Entries of states already removed lie
        #: before it, and a seek walks every deleted entry on its way until a compaction drops them
        #: (the key too: many states fall due in the same millisecond).
        self.due_floor = b""

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
        self._delete_retention_ms = DEFAULT_DELETE_RETENTION_MS
        #: Partitions thrown away (:meth:`discard`, or a restore that could not rebuild them), with
        #: why: the restore that rebuilds them reports them (and the pod counts them) once.
        self._discarded: dict[int, str] = {}
        #: Closes and deletes thrown-away databases off the caller's thread (see :meth:`_throw_away`).
        self._disposal: ThreadPoolExecutor | None = None
        #: Per partition, its thrown-away database's disposal: its next open waits for it (RocksDB
        #: holds a database's LOCK in the process until it is closed).
        self._closing: dict[int, Future[None]] = {}

    # --- reads -------------------------------------------------------------------------------

    def get(self, partition: int, key: str) -> state_pb2.ExecutionState | None:
        part = self._parts.get(partition)
        if part is None:
            return None
        with guarded(partition, writing=False):
            raw = part.db.get(_STATE + key.encode())
        return None if raw is None else decode_state(raw)

    def owned(self) -> set[int]:
        return set(self._parts)

    def __len__(self) -> int:
        return sum(p.count for p in self._parts.values())

    def partition_items(self, partition: int) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        part = self._parts.get(partition)
        if part is None:
            return
        with guarded(partition, writing=False):
            for key, raw in _prefixed(part.db, _STATE):
                yield key.decode("utf-8", errors="replace"), decode_state(raw)

    def items(self) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        for partition in list(self._parts):
            yield from self.partition_items(partition)

    def scan(self, partition: int, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        """Up to ``limit`` serialized states with keys past ``after``, in key order (see
        :meth:`~consumers.runtime.state.interface.HeldStates.scan`): one seek, no iterator kept."""
        part = self._parts.get(partition)
        if part is None or limit <= 0:
            return []
        found: list[tuple[str, bytes]] = []
        with guarded(partition, writing=False):
            it = part.db.iter(_within(_STATE))
            try:
                it.seek(_STATE if after is None else _STATE + after.encode() + b"\x00")
                while it.valid() and len(found) < limit:
                    key = it.key()
                    if not key.startswith(_STATE):
                        break
                    found.append((key[1:].decode("utf-8", errors="replace"), it.value()))
                    it.next()
                it.status()
            finally:
                del it
        return found

    def due(self, now: float, limit: int) -> dict[int, list[str]]:
        """Keys whose state may be removed now, per partition (at most ``limit`` in all), read from
        the due-time index. They stay there until their tombstone is committed (:meth:`apply`)."""
        found: dict[int, list[str]] = {}
        bound = _ms(now)
        n = 0
        for partition, part in self._parts.items():
            with guarded(partition, writing=False):
                floor = bound  # no entry at or past the floor: none before the bound either
                for index_key, _ in _prefixed(part.db, _DUE, part.due_floor):
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
                count += self._write(part, batch, key.encode(), raw, state, now)
                kept.append((key, raw))
        batch.put(_COUNT, str(count).encode())
        moved = at[1] + 1 if chained and at is not None else None
        if moved is not None:
            batch.put(_CHECKPOINT, self._checkpoint_body(partition, moved, marker=True))
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

    def _write(
        self,
        part: _Partition,
        batch: WriteBatch,
        key: bytes,
        raw: bytes | None,
        state: state_pb2.ExecutionState | None,
        seen_at: float,
    ) -> int:
        """Put one key's write into ``batch`` (reading its index entry); the change of the count."""
        db = part.db
        old_at = db.get(_REMOVABLE + key)
        if old_at is not None:
            batch.delete(_DUE + old_at + key)
        existed = db.get(_STATE + key) is not None
        if raw is None or state is None:
            batch.delete(_STATE + key)
            batch.delete(_REMOVABLE + key)
            return -1 if existed else 0
        batch.put(_STATE + key, raw)
        at = removable_from(state, self.retention_s, seen_at)
        if at is None:
            batch.delete(_REMOVABLE + key)
        else:
            batch.put(_REMOVABLE + key, _ms(at))
            batch.put(_DUE + _ms(at) + key, b"")
            part.due_floor = min(part.due_floor, _ms(at) + key)
        return 0 if existed else 1

    # --- partitions come and go --------------------------------------------------------------

    def drop(self, partitions: Iterable[int]) -> None:
        """Close the partitions' databases; their files (and checkpoints) stay for a later take-over."""
        for p in partitions:
            part = self._parts.pop(p, None)
            if part is not None:
                _close_quietly(part)

    def discard(self, partitions: Iterable[int], reason: str) -> None:
        """Throw the partitions' databases away (closed, deleted), logged once with ``reason``:
        they are no longer held, and the next :meth:`restore` rebuilds them from the beginning of
        the topic (reporting them in :attr:`RestoreReport.rebuilt`)."""
        rebuilt: dict[int, str] = {}
        for p in sorted(set(partitions)):
            self._throw_away(p, reason, rebuilt, part=self._parts.pop(p, None))
        for p, why in rebuilt.items():  # the first reason stands until the partition is rebuilt
            self._discarded.setdefault(p, why)

    def _throw_away(
        self,
        partition: int,
        reason: str,
        rebuilt: dict[int, str],
        detail: str = "",
        *,
        part: _Partition | None = None,
    ) -> None:
        """Delete a partition's database, whatever is at its path; logged once, noted in ``rebuilt``.

        ``part``: the database, still open. It is closed and deleted on the store's disposal thread,
        and the partition's next open waits for that: a database in RocksDB's error state (a full
        disk) takes a second to close, not to be spent on the event loop. What cannot be deleted
        makes the partition's next open fail, so it is never used.
        """
        reason = reason if reason in REBUILD_REASONS else "other"
        # Told once: not again for what a rebuild that failed left (its partition is already noted).
        again = partition in rebuilt or partition in self._discarded
        if self._disposal is None:
            self._disposal = ThreadPoolExecutor(1, thread_name_prefix="state-disposal")
        self._closing[partition] = self._disposal.submit(_dispose, part, self._path(partition))
        rebuilt.setdefault(partition, reason)
        logger.log(
            logging.DEBUG if again else logging.WARNING,
            "local state thrown away: the partition is rebuilt from the state topic",
            extra={"partition": partition, "reason": reason, **({"error": detail} if detail else {})},
        )

    def close(self) -> None:
        self.drop(list(self._parts))
        if self._disposal is not None:  # what was thrown away is gone when the store is closed
            self._disposal.shutdown(wait=True)
            self._disposal = None
            self._closing.clear()

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
        disposal = self._closing.pop(partition, None)
        if disposal is not None:
            disposal.result()  # never raises: it logs what it could not do
        with guarded(partition, writing=True):
            return _Partition(self._path(partition), _options(self._memtables, self._cache))

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
        part: _Partition,
        partition: int,
        offset: int,
        *,
        marker: bool = False,
        as_of: float | None = None,
    ) -> None:
        with guarded(partition, writing=True):
            part.db.put(_CHECKPOINT, self._checkpoint_body(partition, offset, marker=marker, as_of=as_of))
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
        """Open the partitions' databases, each checked on its own, and read the topic from each
        checkpoint to the end.

        A checkpoint of another topic (by name or id), partition, isolation level, retention or
        format, or one past the topic's end or before its first offset, is refused: the database
        is wiped and the partition read from the beginning. A database that cannot be opened, read
        or written, one that lost its data, and a checkpoint older than the topic's
        ``delete.retention.ms`` are thrown away (logged once, reported in ``rebuilt``) and the
        partition read from the beginning, the others not held back. A partition that fails even
        so (a full or unwritable disk) raises :class:`StateStoreFault` once the others are held.
        """
        wanted = sorted(set(partitions) - set(self._parts))
        started = time.monotonic()
        if not wanted:
            return RestoreReport(0, 0, 0, 0.0)
        self._bootstrap, self._isolation, self._security = bootstrap, isolation_level, security
        facts = await topic_facts(bootstrap, self.topic, security=security)
        self._topic_id, self._delete_retention_ms = facts.topic_id, facts.delete_retention_ms
        rebuilt = {p: self._discarded.pop(p) for p in wanted if p in self._discarded}
        opened: dict[int, _Partition] = {}
        records = resumed = 0
        todo = wanted
        failed: dict[int, StateStoreFault] = {}
        for _ in range(2):  # the partitions whose database failed while read are read again from empty
            got, failed, n, from_checkpoint = await self._restore_round(
                todo, isolation_level, timeout_s, security, rebuilt
            )
            opened.update(got)
            records += n
            resumed += from_checkpoint
            todo = sorted(failed)
            if not todo:
                break
        self._parts.update(opened)
        for p, fault in failed.items():  # reported (and counted) by the restore that rebuilds it
            self._discarded[p] = rebuilt.get(p, fault.reason)
        report = RestoreReport(
            len(opened),
            records,
            sum(part.count for part in opened.values()),
            time.monotonic() - started,
            from_checkpoint=resumed,
            full=len(opened) - resumed,
            rebuilt={p: why for p, why in rebuilt.items() if p in opened},
        )
        logger.info(
            "state restored",
            extra={
                "partitions": ",".join(map(str, sorted(opened))),
                "records": report.records,
                "keys": report.keys,
                "fromCheckpoint": resumed,
                "rebuilt": ",".join(f"{p}:{why}" for p, why in sorted(report.rebuilt.items())),
                "seconds": round(report.seconds, 3),
            },
        )
        if failed:
            raise next(iter(failed.values()))
        return report

    async def _restore_round(
        self,
        wanted: list[int],
        isolation_level: str,
        timeout_s: float,
        security: KafkaSecurity,
        rebuilt: dict[int, str],
    ) -> tuple[dict[int, _Partition], dict[int, StateStoreFault], int, int]:
        """One read of the topic for ``wanted``: (the partitions restored, those whose database
        failed, records read, partitions resumed from a checkpoint)."""
        opened: dict[int, _Partition] = {}
        failed: dict[int, StateStoreFault] = {}
        broken: dict[int, _Partition] = {}
        records = resumed = 0
        try:
            async with ChangelogReader(
                self._bootstrap or "", self.topic, wanted, isolation_level=isolation_level, security=security
            ) as reader:
                as_of = time.time()  # before the ends are taken: every record past them is later
                bounds = await reader.bounds()
                starts: dict[int, int] = {}
                for p in wanted:
                    try:
                        part, start, from_checkpoint = await asyncio.to_thread(
                            self._prepare, p, bounds[p], isolation_level, int(as_of * 1000), rebuilt
                        )
                    except StateStoreFault as fault:
                        failed[p] = fault
                        continue
                    opened[p], starts[p] = part, start
                    resumed += from_checkpoint
                seen_at = time.time()
                async for p, recs in reader.read(starts, timeout_s=timeout_s):
                    records += len(recs)
                    target = opened.get(p)
                    if target is None:
                        continue  # failed meanwhile
                    try:
                        with guarded(p, writing=True):
                            self._fold(target, p, recs, seen_at)
                    except StateStoreFault as fault:
                        failed[p] = fault
                        broken[p] = opened.pop(p)  # closed when thrown away
                    await asyncio.sleep(0)
                ends = reader.ends()
            for p, part in list(opened.items()):
                try:
                    with guarded(p, writing=True):
                        part.db.put(_COUNT, str(part.count).encode())
                        self._record_checkpoint(part, p, ends[p], as_of=as_of)
                        mark(part.path, self.topic, p)
                except StateStoreFault as fault:
                    failed[p] = fault
                    broken[p] = opened.pop(p)
        except BaseException:
            for part in [*opened.values(), *broken.values()]:
                _close_quietly(part)
            raise
        for p, failure in failed.items():
            self._throw_away(p, failure.reason, rebuilt, failure.detail, part=broken.get(p))
        return opened, failed, records, resumed

    def _prepare(
        self, partition: int, bounds: Bounds, isolation: str, now_ms: int, rebuilt: dict[int, str]
    ) -> tuple[_Partition, int, bool]:
        """Open a partition's database and choose where its read starts: (the database, the offset,
        whether it resumes from its checkpoint). A damaged database or a stale checkpoint is thrown
        away (noted in ``rebuilt``), a refused one wiped; then it starts empty, at the beginning."""
        try:
            part = self._open(partition)
            try:
                with guarded(partition, writing=False):
                    found = part.checkpoint()
                if found is None and marked(part.path):
                    raise StateStoreFault(
                        partition, "corrupt", "no checkpoint in a database that held one: its data is gone"
                    )
            except StateStoreFault:
                _close_quietly(part)
                raise
        except StateStoreFault as fault:
            self._throw_away(partition, fault.reason, rebuilt, fault.detail)
            return self._open(partition), bounds.beginning, False
        why = self._refused(found, partition, bounds, isolation)
        if why is None and found is not None:
            stale = self._stale(found, bounds, now_ms)
            if stale is None:
                return part, int(found["offset"]), True
            _close_quietly(part)
            self._throw_away(partition, "stale_checkpoint", rebuilt, stale)
            return self._open(partition), bounds.beginning, False
        if found is not None or part.count:
            logger.warning(
                "state checkpoint refused: the partition is restored in full",
                extra={"partition": partition, "reason": why},
            )
        _close_quietly(part)
        shutil.rmtree(part.path, ignore_errors=True)
        return self._open(partition), bounds.beginning, False

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
                part.count += self._write(part, batch, key, None, None, seen_at)
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
            part.count += self._write(part, batch, key, rec.value, state, seen_at)
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

    def _chain(self, part: _Partition, partition: int, as_of: float | None = None) -> int:
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


def _dispose(part: _Partition | None, path: Path) -> None:
    """Close a thrown-away database and delete whatever is at its path (the disposal thread's job)."""
    if part is not None:
        _close_quietly(part)
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    except OSError as exc:  # its next open fails on what is left: a fault, so never used
        logger.warning(
            "deleting a thrown-away state database failed", extra={"path": str(path), "error": repr(exc)}
        )


def _close_quietly(part: _Partition) -> None:
    """Close a database that may be damaged: its close failing changes nothing."""
    try:
        part.close()
    except Exception as exc:
        logger.debug("closing a state database failed", extra={"path": str(part.path), "error": repr(exc)})


def _within(prefix: bytes) -> ReadOptions:
    """Read options that end an iteration at the last key starting with ``prefix``. Without them an
    iterator leaving the range walks on over every deleted key after it until it finds a live one
    (the removable times of removed states lie right after the due-time index: 100k of them cost
    each retention check 2-9 ms until a compaction dropped them)."""
    opts = ReadOptions()
    opts.set_iterate_upper_bound(prefix[:-1] + bytes([prefix[-1] + 1]))  # our prefixes end below 0xff
    return opts


def _prefixed(db: Rdict, prefix: bytes, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
    """The entries whose key starts with ``prefix``, the prefix cut off, in key order (from
    ``prefix + start``)."""
    it = db.iter(_within(prefix))
    try:
        it.seek(prefix + start)
        while it.valid():
            key = it.key()
            if not key.startswith(prefix):
                break
            yield key[len(prefix) :], it.value()
            it.next()
        it.status()  # an iterator that stopped on a damaged block says so only here
    finally:
        del it
