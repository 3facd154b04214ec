"""The pod's Kafka clients as its config asks for them: the group consumer and the producers' options."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from consumers.runtime.pod_config import PodConfig

#: librdkafka closes a transactional producer's broker connection idle this long (see below).
IDLE_CONNECTION_MS: Final = 60_000


def producer_options_for(cfg: PodConfig) -> dict[str, Any]:
    """Options of every per-partition producer (``PartitionSinks`` adds the transactional id)."""
    return {
        "bootstrap_servers": cfg.bootstrap,
        "acks": "all",
        "transaction_timeout_ms": cfg.transaction_timeout_ms,
        "linger_ms": 0 if cfg.sequential_produce else 5,
        # Right after a commit the coordinator answers ConcurrentTransactions until its markers
        # are written; aiokafka then waits retry_backoff before AddOffsetsToTxn again (100 ms
        # by default), a large share of the latency of a small exactly-once transaction.
        "retry_backoff_ms": 20,
        # A transaction writes ~2 records per input; 16 KiB producer batches made sends wait.
        "max_batch_size": 256 * 1024,
        **cfg.security.client_options(),
    }


def txn_producer_config(cfg: PodConfig) -> dict[str, Any]:
    """librdkafka options of every per-partition transactional producer (``exactly_once``)."""
    return {
        "bootstrap.servers": cfg.bootstrap,
        "client.id": f"sandbox-lanes-{cfg.pod_id}",
        "transaction.timeout.ms": cfg.transaction_timeout_ms,
        "linger.ms": 5,
        # Java's partitioner (murmur2 of the key), as aiokafka's: a keyed outcome lands where
        # every other client of the topic expects it.
        "partitioner": "murmur2_random",
        # aiokafka's max_request_size: a record up to failures.RECORD_LIMIT_BYTES fits.
        "message.max.bytes": 1_048_576,
        # Right after a commit the coordinator answers ConcurrentTransactions until its markers
        # are written; a short backoff before the next transaction's first request.
        "retry.backoff.ms": 20,
        # An abandoned producer stuck in send_offsets_to_transaction (librdkafka 5456, 5511: its
        # request waits for a broker state change once its group coordinator went away) lingers,
        # with its threads and buffers, until one of its brokers changes state: in the soak, a
        # later bounce, 4 to 10 minutes on. Its connections idle out after this and are closed,
        # which is such a change. Measured in a quiet 45-minute soak (docs/performance.md, The
        # soak): each abandoned producer lingered 38-98 s, against 230-489 s and more before.
        # The cost, on a partition with no input for a minute: its producer's connections close
        # too, it reconnects to its transaction coordinator at once (about once a minute while
        # quiet) and its next transaction first reconnects to the leader.
        "connections.max.idle.ms": IDLE_CONNECTION_MS,
        **cfg.security.librdkafka_options(),
    }


def group_consumer_for(cfg: PodConfig) -> AIOKafkaConsumer:
    """The input consumer: manual commits (in the transaction), read_committed under exactly_once."""
    return AIOKafkaConsumer(
        bootstrap_servers=cfg.bootstrap,
        group_id=cfg.group_id,
        group_instance_id=cfg.pod_id if cfg.static_membership else None,
        client_id=f"sandbox-lanes-{cfg.pod_id}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed" if cfg.guarantee == "exactly_once" else "read_uncommitted",
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        max_poll_interval_ms=300_000,
        rebalance_timeout_ms=60_000,
        # Range keeps partition N of every input topic on one member: co-partitioned with the state.
        partition_assignment_strategy=(RangePartitionAssignor,),
        **cfg.security.client_options(),
    )


def group_joined(consumer: AIOKafkaConsumer | None) -> bool:
    """Whether the consumer is a member of its group now with its assignment settled (a generation
    > 0 and no reassignment in progress), partitions or none. Between JoinGroup and the applied
    SyncGroup answer the generation is already set and the assignment still empty: that is not
    an idle member. aiokafka has no public accessor; its state is read defensively."""
    coordinator = getattr(consumer, "_coordinator", None)
    generation = getattr(coordinator, "generation", -1)
    subscription = getattr(consumer, "_subscription", None)
    settling = getattr(subscription, "reassignment_in_progress", True)
    return isinstance(generation, int) and generation > 0 and settling is False


class RebalanceHooks(ConsumerRebalanceListener):  # type: ignore[misc]
    """The group's rebalance callbacks: revoked partition numbers, then the assigned partitions."""

    def __init__(
        self,
        revoked: Callable[[set[int]], Awaitable[None]],
        assigned: Callable[[set[TopicPartition]], None],
    ) -> None:
        self._revoked = revoked
        self._assigned = assigned

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._revoked({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._assigned(assigned)
