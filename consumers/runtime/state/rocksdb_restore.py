"""A disk store's restore: each partition's database opened and checked on its own, then the topic
read from its checkpoint (or from the beginning) to the end.

A take-over reads from the checkpoint to the end; the records of the pod's own committed writes
read again there are applied again, which is idempotent. A crash between a commit and its apply
leaves the states and the checkpoint both as they were (one write batch): the tail is read again.

The local database is disposable (issue 42). Each partition's database is opened and checked on its
own: one that cannot be opened, read or written (a corrupt ``CURRENT``, ``MANIFEST`` or SST, a
regular file where its directory should be, an unwritable or full disk), one that lost its data
(:mod:`.local_faults`' marker), and a checkpoint older than the topic's ``delete.retention.ms`` (a
tombstone past it may have been compacted away) are thrown away and the partition rebuilt from the
beginning of the topic, logged once with the reason; the healthy ones resume from their checkpoints.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterable
from typing import Any

from google.protobuf.message import DecodeError as ProtobufDecodeError
from rocksdict import WriteBatch

from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.unparsable import is_placeholder
from consumers.runtime.state.changelog import Bounds, ChangelogReader, topic_facts
from consumers.runtime.state.interface import RestoreReport, StateStoreFault
from consumers.runtime.state.local_faults import guarded, mark, marked
from consumers.runtime.state.rocksdb_checkpoints import CheckpointedDatabases
from consumers.runtime.state.rocksdb_partition import COUNT_KEY, RocksDBPartition
from events.codec import decode_state

logger = logging.getLogger("sandbox_lanes.state")


class RestoringDatabases(CheckpointedDatabases):
    """The partitions' databases, restored from the state topic on take-over."""

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
        opened: dict[int, RocksDBPartition] = {}
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
    ) -> tuple[dict[int, RocksDBPartition], dict[int, StateStoreFault], int, int]:
        """One read of the topic for ``wanted``: (the partitions restored, those whose database
        failed, records read, partitions resumed from a checkpoint)."""
        opened: dict[int, RocksDBPartition] = {}
        failed: dict[int, StateStoreFault] = {}
        broken: dict[int, RocksDBPartition] = {}
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
                        part.db.put(COUNT_KEY, str(part.count).encode())
                        self._record_checkpoint(part, p, ends[p], as_of=as_of)
                        mark(part.path, self.topic, p)
                except StateStoreFault as fault:
                    failed[p] = fault
                    broken[p] = opened.pop(p)
        except BaseException:
            for part in [*opened.values(), *broken.values()]:
                part.close_quietly()
            raise
        for p, failure in failed.items():
            self._throw_away(p, failure.reason, rebuilt, failure.detail, part=broken.get(p))
        return opened, failed, records, resumed

    def _prepare(
        self, partition: int, bounds: Bounds, isolation: str, now_ms: int, rebuilt: dict[int, str]
    ) -> tuple[RocksDBPartition, int, bool]:
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
                part.close_quietly()
                raise
        except StateStoreFault as fault:
            self._throw_away(partition, fault.reason, rebuilt, fault.detail)
            return self._open(partition), bounds.beginning, False
        why = self._refused(found, partition, bounds, isolation)
        if why is None and found is not None:
            stale = self._stale(found, bounds, now_ms)
            if stale is None:
                return part, int(found["offset"]), True
            part.close_quietly()
            self._throw_away(partition, "stale_checkpoint", rebuilt, stale)
            return self._open(partition), bounds.beginning, False
        if found is not None or part.count:
            logger.warning(
                "state checkpoint refused: the partition is restored in full",
                extra={"partition": partition, "reason": why},
            )
        part.close_quietly()
        shutil.rmtree(part.path, ignore_errors=True)
        return self._open(partition), bounds.beginning, False

    def _fold(self, part: RocksDBPartition, partition: int, recs: list[Any], seen_at: float) -> None:
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
                part.count += part.stage(batch, key, None, None, seen_at, self.retention_s)
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
            part.count += part.stage(batch, key, rec.value, state, seen_at, self.retention_s)
            written[key] = rec.value
        part.db.write(batch)
