"""Holding a record back while creates produced before it may still be unapplied.

The inputs are separate topics, so a fetch (after a restart, a rebalance, a broker outage: any
backlog) can hand out records before the creates produced earlier on the co-partitioned
execution-created partition. A phase change of a not-yet-created execution waits while that
partition has unapplied records older than it; only then (or after ``DEFER_UNKNOWN_S``) is it a
dead letter. A session delete always waits so (a session's creates are on its partition number),
so a create produced before the delete is applied before it; after ``DEFER_UNKNOWN_S`` it is
applied regardless.
"""

from __future__ import annotations

import time

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

#: How long a phase-changed record for a not-yet-created execution waits for the co-partitioned
#: execution-created partition to catch up before it is dead-lettered.
DEFER_UNKNOWN_S = 30.0
#: How much later than a phase change a fetch of the execution-created partition must be to vouch
#: that every create produced before that phase change is in it (producer send to broker append).
CREATE_APPEND_MARGIN_MS = 1000
#: Held records remembered at most (a bound on memory, not a limit anyone should reach).
_MAX_HELD = 100_000


class CreateOrderGate:
    """Per partition: how far the execution-created topic has been applied, committed and in progress."""

    def __init__(self, created_topic: str) -> None:
        self._created_topic = created_topic
        #: Per partition: (next offset, last record timestamp) applied and committed.
        self._committed: dict[int, tuple[int, int]] = {}
        #: The same within the transaction in progress.
        self._in_progress: dict[int, tuple[int, int]] = {}
        self._held_since: dict[tuple[str, int, int], float] = {}

    def begin(self, partition: int) -> None:
        """A transaction for ``partition`` starts from what was committed."""
        done = self._committed.get(partition)
        if done is None:
            self._in_progress.pop(partition, None)
        else:
            self._in_progress[partition] = done

    def applied(self, partition: int, offset: int, timestamp: int) -> None:
        """A create at ``offset`` was applied in the transaction in progress."""
        self._in_progress[partition] = (offset + 1, timestamp)

    def committed(self, partition: int) -> None:
        done = self._in_progress.get(partition)
        if done is not None:
            self._committed[partition] = done

    def forget(self, partition: int) -> None:
        """The partition moved away (or its writer was fenced): the next owner starts over."""
        self._committed.pop(partition, None)

    def settled(self, rec: ConsumerRecord[bytes, bytes]) -> None:
        """The record was applied or dead-lettered: it is no longer held."""
        self._held_since.pop((rec.topic, rec.partition, rec.offset), None)

    async def may_follow(self, consumer: AIOKafkaConsumer, rec: ConsumerRecord[bytes, bytes]) -> bool:
        """Could a create produced before this record still be unapplied on its partition number?"""
        created = TopicPartition(self._created_topic, rec.partition)
        if created not in consumer.assignment():
            return False
        now = time.monotonic()
        if len(self._held_since) > _MAX_HELD:
            self._held_since.clear()
        first = self._held_since.setdefault((rec.topic, rec.partition, rec.offset), now)
        if now - first > DEFER_UNKNOWN_S:
            return False
        done = self._in_progress.get(rec.partition)
        if done is None:
            committed = await consumer.committed(created)
            done = (committed if committed is not None and committed >= 0 else 0, -1)
            self._in_progress[rec.partition] = done
        next_offset, last_timestamp = done
        if last_timestamp > rec.timestamp:
            return False  # every create produced before this record has been applied (same ms: maybe not)
        highwater = consumer.highwater(created)
        if highwater is None or next_offset < highwater:
            return True
        # Caught up to the highwater of the last fetch of that partition: but that fetch may predate
        # this record's create (each partition is fetched on its own schedule). Trust it only when
        # it came well after this record was produced.
        polled = consumer.last_poll_timestamp(created)
        return polled is None or polled <= rec.timestamp + CREATE_APPEND_MARGIN_MS
