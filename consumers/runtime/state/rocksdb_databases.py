"""The databases of the partitions a disk store holds: where each lives, opened, closed, thrown away.

The local database is disposable (issue 42): one thrown away (:meth:`PartitionDatabases.discard`,
or a restore that found it damaged) is closed and deleted off the caller's thread, logged once with
its reason, and rebuilt by the partition's next restore, which reports it.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from rocksdict import Cache, WriteBufferManager

from consumers.runtime.state.allocator import unmap_large_blocks
from consumers.runtime.state.interface import REBUILD_REASONS
from consumers.runtime.state.local_faults import guarded
from consumers.runtime.state.rocksdb_partition import (
    BLOCK_CACHE_BYTES,
    MEMTABLES_BYTES,
    RocksDBPartition,
    database_options,
)

logger = logging.getLogger("sandbox_lanes.state")


class PartitionDatabases:
    """One database per owned partition under ``<directory>/<topic>``, sharing the memtables' and
    the block cache's bounds (the base of :class:`~consumers.runtime.state.rocksdb.RocksDBStore`)."""

    def __init__(self, topic: str, retention_s: float = 0.0, *, directory: str | Path) -> None:
        self.topic = topic
        self.retention_s = retention_s
        self.directory = Path(directory) / topic
        self._parts: dict[int, RocksDBPartition] = {}
        unmap_large_blocks()  # the memtables' blocks go back to the system when flushed
        self._memtables = WriteBufferManager(MEMTABLES_BYTES, False)
        self._cache = Cache(BLOCK_CACHE_BYTES)
        #: Partitions thrown away (:meth:`discard`, or a restore that could not rebuild them), with
        #: why: the restore that rebuilds them reports them (and the pod counts them) once.
        self._discarded: dict[int, str] = {}
        #: Closes and deletes thrown-away databases off the caller's thread (see :meth:`_throw_away`).
        self._disposal: ThreadPoolExecutor | None = None
        #: Per partition, its thrown-away database's disposal: its next open waits for it (RocksDB
        #: holds a database's LOCK in the process until it is closed).
        self._closing: dict[int, Future[None]] = {}

    def owned(self) -> set[int]:
        return set(self._parts)

    def memory_bytes(self) -> int | None:
        """What RocksDB holds in memory for the store: the memtables and the block cache, each one
        bound shared by every partition, and the table readers' index and filter blocks, per
        partition, growing with the states held (about 3 bytes a state, bloom filters included)."""
        readers = 0
        for part in list(self._parts.values()):
            try:
                readers += part.db.property_int_value("rocksdb.estimate-table-readers-mem") or 0
            except Exception:  # a database closed or damaged meanwhile: counted from the next read
                continue
        return int(self._memtables.get_usage() + self._cache.get_usage() + readers)

    def compactions_busy(self) -> bool:
        """Whether any partition's database has a compaction pending or running (a restore from
        empty leaves many overlapping level-0 files to merge in the background)."""
        for part in list(self._parts.values()):
            try:
                if part.db.property_int_value("rocksdb.compaction-pending") or part.db.property_int_value(
                    "rocksdb.num-running-compactions"
                ):
                    return True
            except Exception:  # a database closed or damaged meanwhile: not this one's work
                continue
        return False

    def drop(self, partitions: Iterable[int]) -> None:
        """Close the partitions' databases; their files (and checkpoints) stay for a later take-over."""
        for p in partitions:
            part = self._parts.pop(p, None)
            if part is not None:
                part.close_quietly()

    def discard(self, partitions: Iterable[int], reason: str) -> None:
        """Throw the partitions' databases away (closed, deleted), logged once with ``reason``:
        they are no longer held, and the next restore rebuilds them from the beginning of the topic
        (reporting them in :attr:`RestoreReport.rebuilt`)."""
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
        part: RocksDBPartition | None = None,
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
        the pod's way in is the restore)."""
        for p in partitions:
            if p not in self._parts:
                self._parts[p] = self._open(p)

    def _path(self, partition: int) -> Path:
        return self.directory / str(partition)

    def _open(self, partition: int) -> RocksDBPartition:
        disposal = self._closing.pop(partition, None)
        if disposal is not None:
            disposal.result()  # never raises: it logs what it could not do
        with guarded(partition, writing=True):
            return RocksDBPartition(self._path(partition), database_options(self._memtables, self._cache))


def _dispose(part: RocksDBPartition | None, path: Path) -> None:
    """Close a thrown-away database and delete whatever is at its path (the disposal thread's job)."""
    if part is not None:
        part.close_quietly()
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    except OSError as exc:  # its next open fails on what is left: a fault, so never used
        logger.warning(
            "deleting a thrown-away state database failed", extra={"path": str(path), "error": repr(exc)}
        )
