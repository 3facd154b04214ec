r"""One partition's RocksDB database (through ``rocksdict``): its key layout, options and reads.

The database lives in ``<state dir>/<topic>/<partition>`` and keeps, under one-letter prefixes:

* ``s<key>``: the state, serialized as in the topic;
* ``r<key>``: when the finished state may be removed (milliseconds, 8 bytes big-endian), and
  ``d<when><key>``: the due-time index ordered by that time, so
  :meth:`~consumers.runtime.state.rocksdb.RocksDBStore.due` reads only the keys whose time has come
  and the index survives a restart without a scan;
* ``o<key>``: the outbox index, one empty entry per state with driver calls pending, so a take-over
  re-runs them reading those states only
  (:meth:`~consumers.runtime.state.rocksdb.RocksDBStore.pending_items`), never every state held;
* ``x<session><key>`` (the session id length-prefixed, 4 bytes, :func:`session_entry`): the session index,
  one empty entry per state and session it references (:func:`~consumers.lanes.reap.sessions_referenced`),
  and ``y<key>``: the sessions the state's entries were written for, so the next write of the key
  removes the entries it no longer has without decoding the old state. The idle sweep and the reaper
  read a session's states from it (:meth:`~consumers.runtime.state.rocksdb.RocksDBStore.referencing`),
  never the partition through;
* ``m:checkpoint``: the state topic's offset the database reflects, with what it belongs to
  (topic name and id, partition, isolation level, format version, retention); ``m:count``: keys.

A store's databases share one write buffer manager and one block cache (:data:`MEMTABLES_BYTES`,
:data:`BLOCK_CACHE_BYTES`), so RocksDB's memory is bounded per pod, not per partition owned; beside
them, each table file's index and bloom filter (a few bytes a state).
"""

from __future__ import annotations

import enum
import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from rocksdict import BlockBasedOptions, Cache, Options, Rdict, ReadOptions, WriteBatch, WriteBufferManager

from consumers.lanes.reap import sessions_referenced
from consumers.lanes.retention import finished, removable_from
from events.sandbox_lanes.v1 import state_pb2

logger = logging.getLogger("sandbox_lanes.state")

STATE_PREFIX = b"s"
REMOVABLE_PREFIX = b"r"
DUE_PREFIX = b"d"
OUTBOX_PREFIX = b"o"
SESSION_PREFIX = b"x"
REFERENCES_PREFIX = b"y"
CHECKPOINT_KEY = b"m:checkpoint"
COUNT_KEY = b"m:count"


class Unknown(enum.Enum):
    """A key's prior state not read by the caller: the store reads what the write replaces."""

    UNKNOWN = enum.auto()


UNKNOWN: Final = Unknown.UNKNOWN


#: What a store's databases share, whatever the number of partitions it owns: the memtables (all
#: of them, flushed early past this) and the block cache. RocksDB's memory is bounded per pod.
MEMTABLES_BYTES = 64 * 1024 * 1024
BLOCK_CACHE_BYTES = 32 * 1024 * 1024


def ms_key(at: float) -> bytes:
    """A time as the index orders it: milliseconds, 8 bytes big-endian."""
    return struct.pack(">Q", max(0, int(at * 1000)))


def session_entry(session_id: bytes) -> bytes:
    """The session index's prefix for one session: its id's length (4 bytes: an id is as long as
    its record allows), then the id, so one session's prefix never starts another's (``"a"``, ``"ab"``)."""
    return SESSION_PREFIX + struct.pack(">I", len(session_id)) + session_id


def _session_keys(state: state_pb2.ExecutionState) -> list[bytes]:
    """The sessions a state references, as its ``y<key>`` list keeps them (sorted)."""
    return sorted(s.encode() for s in sessions_referenced(state))


def pack_sessions(sessions: list[bytes]) -> bytes:
    """A ``y<key>`` value: the sessions, each length-prefixed (4 bytes)."""
    return b"".join(struct.pack(">I", len(s)) + s for s in sessions)


def unpack_sessions(raw: bytes) -> list[bytes]:
    found: list[bytes] = []
    at = 0
    while at + 4 <= len(raw):
        (n,) = struct.unpack_from(">I", raw, at)
        found.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
    return found


def database_options(memtables: WriteBufferManager, cache: Cache) -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_write_buffer_size(8 * 1024 * 1024)
    opts.set_max_write_buffer_number(2)
    opts.set_keep_log_file_num(2)
    opts.set_write_buffer_manager(memtables)
    table = BlockBasedOptions()
    table.set_block_cache(cache)
    # A new execution's reads of keys not held (the decide's, the write's index and existence reads)
    # are answered by the filter instead of a block of every level: with 2M states held, 24 -> 9 us
    # of the loop's CPU per new execution (issue 45). 10 bits a key: about 1.2 bytes a state in the
    # table readers' memory (12 MiB at 10M). Not in the block cache: measured there, the fill thrashed.
    table.set_bloom_filter(10, False)
    opts.set_block_based_table_factory(table)
    return opts


class RocksDBPartition:
    """One owned partition's database, with what the store keeps of it in memory (its count, the
    writes applied since its checkpoint, where its due-time index starts)."""

    def __init__(self, path: Path, options: Options) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        # The options name the default column family too: given none, rocksdict opens an existing
        # database's column families with the options it loads from the database's OPTIONS file,
        # which keep neither the bloom filter nor the shared block cache (a private 8 MiB cache).
        self.db = Rdict(str(path), options, column_families={"default": options})
        try:
            raw = self.db.get(COUNT_KEY)
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
        #: No due-time index entry sorts before this (its time as :func:`ms_key`, then its key; b"":
        #: not known yet): where :meth:`~consumers.runtime.state.rocksdb.RocksDBStore.due` seeks.
        #: Entries of states already removed lie before it, and a seek walks every deleted entry on
        #: its way until a compaction drops them (the key too: many states fall due in the same
        #: millisecond).
        self.due_floor = b""

    def checkpoint(self) -> dict[str, Any] | None:
        raw = self.db.get(CHECKPOINT_KEY)
        if not raw:
            return None
        try:
            found = json.loads(raw)
        except ValueError:
            return None
        return found if isinstance(found, dict) else None

    def stage(
        self,
        batch: WriteBatch,
        key: bytes,
        raw: bytes | None,
        state: state_pb2.ExecutionState | None,
        seen_at: float,
        retention_s: float,
        prior: state_pb2.ExecutionState | Unknown | None = UNKNOWN,
    ) -> int:
        """Put one key's write into ``batch``; the change of the count. ``prior``: the state the key
        holds, when the caller read it (None: not held); what it replaces is then known and not read
        again. Each read it saves is a miss through every level's bloom filter when the entry is
        absent (a new key's everything; a running execution's removal time and, for a workflow, its
        session references): about 2 µs each at 10M states held."""
        db = self.db
        if prior is UNKNOWN:
            old_at = db.get(REMOVABLE_PREFIX + key)
            existed = db.get(STATE_PREFIX + key) is not None
            old_sessions = None
        else:
            # only a finished state has a removal time; when it has one it is read (the retention
            # in force when it was written may not be this one)
            old_at = db.get(REMOVABLE_PREFIX + key) if prior is not None and finished(prior) else None
            existed = prior is not None
            old_sessions = [] if prior is None else _session_keys(prior)
        if old_at is not None:
            batch.delete(DUE_PREFIX + old_at + key)
        if raw is None or state is None:
            batch.delete(STATE_PREFIX + key)
            batch.delete(REMOVABLE_PREFIX + key)
            if existed:
                batch.delete(OUTBOX_PREFIX + key)
                self._index_sessions(batch, key, [], old_sessions)
            return -1 if existed else 0
        batch.put(STATE_PREFIX + key, raw)
        self._index_sessions(
            batch,
            key,
            _session_keys(state),
            old_sessions if existed else [],
        )
        if state.pending:
            batch.put(OUTBOX_PREFIX + key, b"")
        elif existed:  # an outbox entry exists only beside its state: a new key has none to remove
            batch.delete(OUTBOX_PREFIX + key)
        at = removable_from(state, retention_s, seen_at)
        if at is None:
            batch.delete(REMOVABLE_PREFIX + key)
        else:
            batch.put(REMOVABLE_PREFIX + key, ms_key(at))
            batch.put(DUE_PREFIX + ms_key(at) + key, b"")
            self.due_floor = min(self.due_floor, ms_key(at) + key)
        return 0 if existed else 1

    def _index_sessions(
        self, batch: WriteBatch, key: bytes, sessions: list[bytes], old: list[bytes] | None
    ) -> None:
        """Stage the session index's entries of ``key`` for ``sessions`` (sorted), removing those
        of sessions its last write referenced and this one does not: ``old`` (sorted), read from
        the key's reference list when None."""
        if old is None:
            old_raw = self.db.get(REFERENCES_PREFIX + key)
            old = unpack_sessions(old_raw) if old_raw else []
        if old == sessions:
            return
        for session in set(old) - set(sessions):
            batch.delete(session_entry(session) + key)
        for session in sessions:
            batch.put(session_entry(session) + key, b"")
        if sessions:
            batch.put(REFERENCES_PREFIX + key, pack_sessions(sessions))
        else:
            batch.delete(REFERENCES_PREFIX + key)

    def close(self) -> None:
        self.db.close()

    def close_quietly(self) -> None:
        """Close a database that may be damaged: its close failing changes nothing."""
        try:
            self.close()
        except Exception as exc:
            logger.debug(
                "closing a state database failed", extra={"path": str(self.path), "error": repr(exc)}
            )


def within(prefix: bytes) -> ReadOptions:
    """Read options that end an iteration at the last key starting with ``prefix``. Without them an
    iterator leaving the range walks on over every deleted key after it until it finds a live one
    (the removable times of removed states lie right after the due-time index: 100k of them cost
    each retention check 2-9 ms until a compaction dropped them)."""
    opts = ReadOptions()
    opts.set_iterate_upper_bound(prefix[:-1] + bytes([prefix[-1] + 1]))  # our prefixes end below 0xff
    return opts


def prefixed(db: Rdict, prefix: bytes, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
    """The entries whose key starts with ``prefix``, the prefix cut off, in key order (from
    ``prefix + start``)."""
    bound = within(prefix)  # held for the iterator's life: it reads the bound, rocksdict does not keep it
    it = db.iter(bound)
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
        del it, bound
