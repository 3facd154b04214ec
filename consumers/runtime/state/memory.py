"""The in-memory store: every state of the owned partitions held serialized in memory.

The tests' and the demo's store (``SANDBOX_LANES_STATE_STORE=memory``). Nothing outlives the
process: every take-over restores the partition from the beginning of the compacted topic.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Iterable, Iterator, Mapping

from aiokafka import TopicPartition
from google.protobuf.message import DecodeError as ProtobufDecodeError

from consumers.lanes.reap import sessions_referenced
from consumers.lanes.retention import removable_from
from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.topic_reader import read_to_end
from consumers.runtime.kafka.unparsable import is_placeholder
from consumers.runtime.state.interface import REBUILD_REASONS, RestoreReport
from events.codec import decode_state
from events.sandbox_lanes.v1 import state_pb2

logger = logging.getLogger("sandbox_lanes.state")


class MemoryStore:
    """Values are held serialized (~5x smaller than parsed messages: 1M executions fit well under
    1 GiB); ``get`` parses a fresh message, so callers never share a mutable state.

    With a retention, the store also knows when each finished state may be removed
    (:func:`consumers.lanes.retention.removable_from`): :meth:`due` lists the keys whose time has
    come, and the pod tombstones them in their partition's next transaction.
    """

    def __init__(self, topic: str, retention_s: float = 0.0) -> None:
        self.topic = topic
        self.retention_s = retention_s
        self._partitions: dict[int, dict[str, bytes]] = {}
        #: Per partition, when each finished state may be removed (epoch seconds).
        self._removable: dict[int, dict[str, float]] = {}
        #: (when, partition, key), a min-heap over ``_removable``; stale entries are skipped.
        self._heap: list[tuple[float, int, str]] = []
        #: Partitions thrown away by :meth:`discard`, with why: the next restore reports them rebuilt.
        self._discarded: dict[int, str] = {}
        #: Per partition, the keys whose state has driver calls pending (:meth:`pending_items`).
        self._outbox: dict[int, set[str]] = {}
        #: Per partition, the session index (:meth:`referencing`): session id -> the keys of the
        #: states referencing it, and per key the sessions it was indexed under.
        self._sessions: dict[int, _SessionIndex] = {}

    def get(self, partition: int, key: str) -> state_pb2.ExecutionState | None:
        raw = self._partitions.get(partition, {}).get(key)
        return None if raw is None else decode_state(raw)

    def put(self, partition: int, key: str, state: state_pb2.ExecutionState) -> None:
        self._partitions.setdefault(partition, {})[key] = state.SerializeToString()
        self._schedule(partition, key, state, time.time())
        outbox = self._outbox.setdefault(partition, set())
        if state.pending:
            outbox.add(key)
        else:
            outbox.discard(key)
        self._sessions.setdefault(partition, _SessionIndex()).index(key, sessions_referenced(state))

    def delete(self, partition: int, key: str) -> None:
        self._partitions.get(partition, {}).pop(key, None)
        self._removable.get(partition, {}).pop(key, None)
        self._outbox.get(partition, set()).discard(key)
        if (sessions := self._sessions.get(partition)) is not None:
            sessions.index(key, set())

    def apply(
        self,
        partition: int,
        writes: Mapping[str, state_pb2.ExecutionState | None],
        at: tuple[int, int] | None = None,
        prior: Mapping[str, state_pb2.ExecutionState | None] | None = None,
    ) -> None:
        for key, state in writes.items():
            if state is None:
                self.delete(partition, key)
            else:
                self.put(partition, key, state)

    async def checkpoint(self, partitions: Iterable[int]) -> dict[int, int]:
        """Nothing outlives the process: no checkpoint."""
        return {}

    def close(self) -> None:
        self.drop(list(self._partitions))

    def _schedule(self, partition: int, key: str, state: state_pb2.ExecutionState, now: float) -> None:
        at = removable_from(state, self.retention_s, now)
        removable = self._removable.setdefault(partition, {})
        if at is None:
            removable.pop(key, None)
            return
        removable[key] = at
        heapq.heappush(self._heap, (at, partition, key))
        if len(self._heap) > 2 * sum(len(r) for r in self._removable.values()) + 1024:
            self._heap = [(w, p, k) for p, r in self._removable.items() for k, w in r.items()]
            heapq.heapify(self._heap)

    def due(self, now: float, limit: int) -> dict[int, list[str]]:
        """Keys whose state may be removed now, per partition (at most ``limit`` in all).

        They stay scheduled until :meth:`delete` (the tombstone committed), so a transaction
        that fails lists them again.
        """
        found: dict[int, list[str]] = {}
        kept: list[tuple[float, int, str]] = []
        heap = self._heap
        while heap and heap[0][0] <= now and len(kept) < limit:
            entry = heapq.heappop(heap)
            at, partition, key = entry
            if self._removable.get(partition, {}).get(key) != at:
                continue  # stale: the state changed, was removed, or its partition left
            kept.append(entry)
            found.setdefault(partition, []).append(key)
        for entry in kept:
            heapq.heappush(heap, entry)
        return found

    def owned(self) -> set[int]:
        return set(self._partitions)

    def drop(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            self._partitions.pop(p, None)
            self._removable.pop(p, None)
            self._outbox.pop(p, None)
            self._sessions.pop(p, None)

    def discard(self, partitions: Iterable[int], reason: str) -> None:
        """Throw the partitions' states away (nothing of them is on disk): the next restore rebuilds
        them from the topic and reports them rebuilt."""
        gone = sorted(set(partitions))
        if not gone:
            return
        self.drop(gone)
        reason = reason if reason in REBUILD_REASONS else "other"
        self._discarded.update(dict.fromkeys(gone, reason))
        logger.warning(
            "local state thrown away: the partitions are rebuilt from the state topic",
            extra={"partitions": ",".join(map(str, gone)), "reason": reason},
        )

    def items(self) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        for part in self._partitions.values():
            for key, raw in part.items():
                yield key, decode_state(raw)

    def partition_items(self, partition: int) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        for key, raw in list(self._partitions.get(partition, {}).items()):
            yield key, decode_state(raw)

    def pending_items(self, partition: int) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        part = self._partitions.get(partition, {})
        for key in sorted(self._outbox.get(partition, ())):
            raw = part.get(key)
            if raw is not None:
                yield key, decode_state(raw)

    def referencing(self, partition: int, session_id: str) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        part = self._partitions.get(partition, {})
        index = self._sessions.get(partition)
        for key in sorted(index.keys_of(session_id) if index is not None else ()):
            raw = part.get(key)
            if raw is not None:
                yield key, decode_state(raw)

    def __len__(self) -> int:
        return sum(len(p) for p in self._partitions.values())

    def memory_bytes(self) -> int | None:
        return None  # its states are Python objects: the process's heap, not measured apart

    async def restore(
        self,
        bootstrap: str,
        partitions: Iterable[int],
        *,
        isolation_level: str = "read_committed",
        timeout_s: float = 300.0,
        security: KafkaSecurity = PLAINTEXT,
    ) -> RestoreReport:
        """Rebuild the given partitions from the beginning of the state topic up to its end."""
        wanted = sorted(set(partitions))
        started = time.monotonic()
        if not wanted:
            return RestoreReport(0, 0, 0, 0.0)
        records = 0
        fresh: dict[int, dict[str, bytes]] = {p: {} for p in wanted}
        #: When each restored finished state may be removed (only a float is kept per key).
        removable: dict[int, dict[str, float]] = {p: {} for p in wanted}
        outbox: dict[int, set[str]] = {p: set() for p in wanted}
        sessions: dict[int, _SessionIndex] = {p: _SessionIndex() for p in wanted}
        seen_at = time.time()
        tps = [TopicPartition(self.topic, p) for p in wanted]
        async for tp, recs in read_to_end(
            bootstrap, tps, isolation_level=isolation_level, timeout_s=timeout_s, security=security
        ):
            for rec in recs:
                records += 1
                if is_placeholder(rec):
                    logger.error(
                        "state record the Kafka client cannot parse, skipped",
                        extra={"partition": tp.partition, "offset": rec.offset},
                    )
                    continue
                key = rec.key.decode("utf-8", errors="replace") if rec.key else ""
                if rec.value is None:
                    fresh[tp.partition].pop(key, None)
                    removable[tp.partition].pop(key, None)
                    outbox[tp.partition].discard(key)
                    sessions[tp.partition].index(key, set())
                    continue
                try:
                    state = decode_state(rec.value)  # only what decodes is kept
                    fresh[tp.partition][key] = rec.value
                    if state.pending:
                        outbox[tp.partition].add(key)
                    else:
                        outbox[tp.partition].discard(key)
                    sessions[tp.partition].index(key, sessions_referenced(state))
                    at = removable_from(state, self.retention_s, seen_at)
                    if at is None:
                        removable[tp.partition].pop(key, None)
                    else:
                        removable[tp.partition][key] = at
                except ProtobufDecodeError:
                    logger.error(
                        "state record does not decode, skipped",
                        extra={"partition": tp.partition, "offset": rec.offset, "executionId": key},
                    )
            await asyncio.sleep(0)
        self._partitions.update(fresh)
        self._removable.update(removable)
        self._outbox.update(outbox)
        self._sessions.update(sessions)
        self._heap.extend((at, p, key) for p, keys in removable.items() for key, at in keys.items())
        heapq.heapify(self._heap)
        report = RestoreReport(
            len(wanted),
            records,
            sum(len(v) for v in fresh.values()),
            time.monotonic() - started,
            full=len(wanted),
            rebuilt={p: self._discarded.pop(p) for p in wanted if p in self._discarded},
        )
        logger.info(
            "state restored",
            extra={
                "partitions": ",".join(map(str, wanted)),
                "records": report.records,
                "keys": report.keys,
                "seconds": round(report.seconds, 3),
            },
        )
        return report


class _SessionIndex:
    """One partition's session index in memory: session id -> keys, and key -> its sessions."""

    def __init__(self) -> None:
        self._keys: dict[str, set[str]] = {}
        self._of: dict[str, frozenset[str]] = {}

    def index(self, key: str, sessions: set[str]) -> None:
        old = self._of.get(key, frozenset())
        if old == sessions:
            return
        for session in old - sessions:
            keys = self._keys.get(session)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._keys[session]
        for session in sessions - old:
            self._keys.setdefault(session, set()).add(key)
        if sessions:
            self._of[key] = frozenset(sessions)
        else:
            self._of.pop(key, None)

    def keys_of(self, session_id: str) -> set[str]:
        return set(self._keys.get(session_id, ()))
