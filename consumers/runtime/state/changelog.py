"""The state topic read as a changelog: its bounds, its identity, and its records from given offsets.

:func:`consumers.runtime.kafka.topic_reader.read_to_end` reads from the beginning; a store with a
checkpoint reads from its checkpoint instead, so it has its own reader here. "The end" is taken
once when reading starts (``read_committed``: the last stable offset), as there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.topic_reader import read_range

logger = logging.getLogger("sandbox_lanes.state")

Records = list[ConsumerRecord[bytes, bytes]]


@dataclass(frozen=True)
class Bounds:
    """A partition's first offset and its end (for ``read_committed``, the last stable offset)."""

    beginning: int
    end: int


#: Kafka's default ``delete.retention.ms`` (a day): assumed when the topic's own cannot be read.
DEFAULT_DELETE_RETENTION_MS = 86_400_000


@dataclass(frozen=True)
class TopicFacts:
    """What a checkpoint is checked against: the topic's id (None: the broker did not tell) and how
    long its tombstones stay readable (``delete.retention.ms``; a checkpoint older than that may
    have missed a delete compacted away since)."""

    topic_id: str | None
    delete_retention_ms: int


async def topic_facts(
    bootstrap: str, topic: str, *, security: KafkaSecurity = PLAINTEXT, timeout_s: float = 10.0
) -> TopicFacts:
    """The topic's id and ``delete.retention.ms``; what cannot be read is logged (a warning) and
    taken as unknown (the id: the offsets' bounds still guard) or Kafka's default (the retention:
    the pod's ACLs may not grant DescribeConfigs)."""
    from confluent_kafka import TopicCollection
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    admin = AdminClient({"bootstrap.servers": bootstrap, **security.librdkafka_options()})

    def describe() -> str | None:
        futures = admin.describe_topics(TopicCollection([topic]), request_timeout=timeout_s)
        found = getattr(futures[topic].result(timeout=timeout_s), "topic_id", None)
        return None if found is None else str(found)

    def retention() -> int:
        resource = ConfigResource(ResourceType.TOPIC, topic)
        futures = admin.describe_configs([resource], request_timeout=timeout_s)
        entries = futures[resource].result(timeout=timeout_s)
        return int(entries["delete.retention.ms"].value)

    found_id: str | None = None
    try:
        found_id = await asyncio.wait_for(asyncio.to_thread(describe), timeout_s + 1)
    except Exception as exc:  # an older broker, an ACL
        logger.warning("state topic id unknown", extra={"topic": topic, "error": repr(exc)})
    try:
        delete_retention_ms = await asyncio.wait_for(asyncio.to_thread(retention), timeout_s + 1)
    except Exception as exc:
        delete_retention_ms = DEFAULT_DELETE_RETENTION_MS
        logger.warning(
            "state topic's delete.retention.ms unknown: Kafka's default assumed",
            extra={"topic": topic, "error": repr(exc), "deleteRetentionMs": delete_retention_ms},
        )
    return TopicFacts(found_id, delete_retention_ms)


class ChangelogReader:
    """One consumer for a store's restore: :meth:`bounds`, then :meth:`read` from chosen offsets."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        partitions: list[int],
        *,
        isolation_level: str = "read_committed",
        security: KafkaSecurity = PLAINTEXT,
    ) -> None:
        self.topic = topic
        self.tps = [TopicPartition(topic, p) for p in partitions]
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=None,
            enable_auto_commit=False,
            isolation_level=isolation_level,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=4 * 1024 * 1024,
            **security.client_options(),
        )
        self._ends: dict[TopicPartition, int] = {}

    async def __aenter__(self) -> ChangelogReader:
        try:
            await self.consumer.start()
        except BaseException:
            await self.consumer.stop()
            raise
        self.consumer.assign(self.tps)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()

    async def bounds(self) -> dict[int, Bounds]:
        begins = await self.consumer.beginning_offsets(self.tps)
        self._ends = await self.consumer.end_offsets(self.tps)
        return {tp.partition: Bounds(begins[tp], self._ends[tp]) for tp in self.tps}

    async def read(
        self, starts: Mapping[int, int], *, timeout_s: float = 300.0
    ) -> AsyncIterator[tuple[int, Records]]:
        """``(partition, records)`` batches from ``starts`` up to the ends :meth:`bounds` took."""
        if not self._ends:
            await self.bounds()
        begin = {tp: starts.get(tp.partition, 0) for tp in self.tps}
        async for tp, kept in read_range(self.consumer, begin, self._ends, timeout_s=timeout_s):
            yield tp.partition, kept

    def ends(self) -> dict[int, int]:
        return {tp.partition: off for tp, off in self._ends.items()}
