"""The topology: which topics exist, how they are configured, and how they relate.

Kept apart from the runtime (as Kafka Streams separates a Topology from the
KafkaStreams instance running it): the pod, the CLI, the tests and the chaos
harness share these names and creation rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

logger = logging.getLogger("sandbox_lanes.topology")


@dataclass(frozen=True)
class Topics:
    execution_created: str = "execution-created"
    phase_changed: str = "phase-changed"
    session_deleted: str = "session-deleted"
    outcomes: str = "sandbox-outcomes"
    state: str = "sandbox-lanes-state"
    dead_letter: str = "sandbox-lanes-dlq"

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.execution_created, self.phase_changed, self.session_deleted)

    @property
    def co_partitioned(self) -> tuple[str, ...]:
        """Inputs and state: partition N of the state holds the keys of partition N of each input."""
        return (*self.inputs, self.state)

    def all(self) -> tuple[str, ...]:
        return (*self.co_partitioned, self.outcomes, self.dead_letter)


STATE_TOPIC_CONFIG: dict[str, str] = {
    "cleanup.policy": "compact",
    "min.cleanable.dirty.ratio": "0.1",
    "segment.ms": "600000",
}


class TopologyError(RuntimeError):
    """The broker's topics cannot carry this topology (e.g. inputs not co-partitioned)."""


async def ensure_topics(
    admin: AIOKafkaAdminClient, topics: Topics, partitions: int, replication: int
) -> None:
    """Create missing topics, then check that inputs and state are co-partitioned."""
    existing = await _partition_counts(admin, topics.all())
    missing = [
        NewTopic(
            name,
            num_partitions=partitions,
            replication_factor=replication,
            topic_configs=STATE_TOPIC_CONFIG if name == topics.state else {},
        )
        for name in topics.all()
        if name not in existing
    ]
    if missing:
        with contextlib.suppress(TopicAlreadyExistsError):  # a concurrent pod created it first
            await admin.create_topics(missing)
        logger.info("topics created", extra={"topics": ",".join(t.name for t in missing)})
    # Metadata of just-created topics can lag behind the create response: look again briefly.
    for _ in range(50):
        counts = await _partition_counts(admin, topics.all())
        if all(name in counts for name in topics.all()):
            break
        await asyncio.sleep(0.1)
    wanted = {name: counts.get(name) for name in topics.co_partitioned}
    if len(set(wanted.values())) != 1 or None in wanted.values():
        raise TopologyError(
            "input and state topics must have the same partition count (co-partitioning): "
            + ", ".join(f"{k}={v}" for k, v in wanted.items())
        )


async def _partition_counts(admin: AIOKafkaAdminClient, names: tuple[str, ...]) -> dict[str, int]:
    described: list[dict[str, Any]] = await admin.describe_topics(list(names))
    counts: dict[str, int] = {}
    for topic in described:
        if topic.get("error_code", 0) == 0 and topic.get("partitions"):
            counts[topic["topic"]] = len(topic["partitions"])
    return counts
