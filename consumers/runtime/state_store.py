"""The execution state store: an in-memory view of a compacted Kafka topic.

Keyed by execution id, partitioned exactly like the input topics (partition N
of the state topic holds the keys of partition N of every input). The topic is
the truth; memory is a cache rebuilt by :meth:`StateStore.restore` whenever a
partition is assigned, which is what a restarted or rebalanced pod recovers from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from aiokafka import TopicPartition
from google.protobuf.message import DecodeError as ProtobufDecodeError

from consumers.runtime.kafka_security import PLAINTEXT, KafkaSecurity
from consumers.runtime.topic_reader import read_to_end
from events.codec import decode_state
from events.sandbox_lanes.v1 import state_pb2

logger = logging.getLogger("sandbox_lanes.state")


@dataclass
class RestoreReport:
    partitions: int
    records: int
    keys: int
    seconds: float


class StateStore:
    """Values are held serialized (~5x smaller than parsed messages: 1M executions fit well under
    1 GiB); ``get`` parses a fresh message, so callers never share a mutable state."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self._partitions: dict[int, dict[str, bytes]] = {}

    def get(self, partition: int, key: str) -> state_pb2.ExecutionState | None:
        raw = self._partitions.get(partition, {}).get(key)
        return None if raw is None else decode_state(raw)

    def put(self, partition: int, key: str, state: state_pb2.ExecutionState) -> None:
        self._partitions.setdefault(partition, {})[key] = state.SerializeToString()

    def owned(self) -> set[int]:
        return set(self._partitions)

    def drop(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            self._partitions.pop(p, None)

    def items(self) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        for part in self._partitions.values():
            for key, raw in part.items():
                yield key, decode_state(raw)

    def partition_items(self, partition: int) -> Iterator[tuple[str, state_pb2.ExecutionState]]:
        for key, raw in list(self._partitions.get(partition, {}).items()):
            yield key, decode_state(raw)

    def __len__(self) -> int:
        return sum(len(p) for p in self._partitions.values())

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
        tps = [TopicPartition(self.topic, p) for p in wanted]
        async for tp, recs in read_to_end(
            bootstrap, tps, isolation_level=isolation_level, timeout_s=timeout_s, security=security
        ):
            for rec in recs:
                records += 1
                key = rec.key.decode("utf-8", errors="replace") if rec.key else ""
                if rec.value is None:
                    fresh[tp.partition].pop(key, None)
                    continue
                try:
                    decode_state(rec.value)  # only what decodes is kept
                    fresh[tp.partition][key] = rec.value
                except ProtobufDecodeError:
                    logger.error(
                        "state record does not decode, skipped",
                        extra={"partition": tp.partition, "offset": rec.offset, "executionId": key},
                    )
            await asyncio.sleep(0)
        self._partitions.update(fresh)
        report = RestoreReport(
            len(wanted), records, sum(len(v) for v in fresh.values()), time.monotonic() - started
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
