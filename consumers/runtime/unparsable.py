"""Getting past a record the Kafka client cannot parse.

aiokafka decodes a record's header keys as UTF-8 while it iterates a fetched batch (in its C and
its Python readers alike), and raises inside ``getmany()`` before the caller sees any record of
that fetch; a corrupt batch or a codec it lacks does the same. Retrying fetches the same bytes and
raises the same way, so the pod would never get past the record, and neither would the next owner
of its partition. Here the pod finds the record and hands back a placeholder for it, which its
partition's transaction dead-letters (topic, partition, offset and the client's error) with the
offset committed past it.

The failed ``getmany()`` may have drained records of other partitions (and of this one, before the
bad record) that it never returned, so every fetched partition is first put back where the pod
stands: its committed offset, which is where each turn leaves every partition.
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from consumers.runtime.failures import is_deterministic
from consumers.runtime.partition_txn import Doom, RecordRef, Records

logger = logging.getLogger("sandbox_lanes.pod")

#: Records fetched one at a time ahead of a bad one at most, before they are handed on.
_AHEAD_MAX = 2_000


def unparsable_reason(exc: BaseException) -> str:
    return f"the Kafka client cannot parse the record ({type(exc).__name__}: {exc})"


async def _rewind(consumer: AIOKafkaConsumer, tp: TopicPartition) -> None:
    committed = await consumer.committed(tp)
    if committed is None or committed < 0:
        await consumer.seek_to_beginning(tp)
    else:
        consumer.seek(tp, committed)


def _failed_offset(consumer: AIOKafkaConsumer, tp: TopicPartition, after: int) -> int:
    """The offset of the record whose parse failed: where the fetch stood when it raised.

    aiokafka keeps that in its fetch result (past any control batch before the record). Where a
    version does not, the record after the last one returned is the best known answer.
    """
    fetch = getattr(getattr(consumer, "_fetcher", None), "_records", {}).get(tp)
    offset = getattr(getattr(fetch, "_partition_records", None), "next_fetch_offset", None)
    return offset if isinstance(offset, int) and offset >= after else after


def _placeholder(tp: TopicPartition, offset: int, timestamp: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(tp.topic, tp.partition, offset, timestamp, 0, None, None, None, -1, -1, ())


async def _locate(
    consumer: AIOKafkaConsumer, tp: TopicPartition, poll_ms: int, error: BaseException
) -> tuple[Records, RecordRef | None, BaseException]:
    """Fetch ``tp`` one record at a time from where the pod stands, up to the record that fails."""
    await _rewind(consumer, tp)
    ahead: Records = []
    while len(ahead) < _AHEAD_MAX:
        position = await consumer.position(tp)
        try:
            got = await consumer.getmany(tp, timeout_ms=poll_ms, max_records=1)
        except Exception as exc:
            if not is_deterministic(exc):
                raise
            offset = _failed_offset(consumer, tp, position)
            return ahead, (tp.topic, tp.partition, offset), exc
        records = got.get(tp, [])
        if not records:
            break  # the bad record is not fetched (yet): the loop meets it again
        ahead.extend(records)
    return ahead, None, error


async def fetch_around_unparsable(
    consumer: AIOKafkaConsumer,
    candidates: list[TopicPartition],
    *,
    poll_ms: int,
    max_records: int,
    error: BaseException,
) -> tuple[dict[TopicPartition, Records], dict[RecordRef, Doom]]:
    """The records of ``candidates`` as far as they parse, with a placeholder for each that does not.

    Returns the fetch to process and the placeholders to dead-letter. A bad record's partition
    is sought past it; the transaction that dead-letters the placeholder commits that offset.
    """
    for tp in candidates:
        await _rewind(consumer, tp)
    fetched: dict[TopicPartition, Records] = {}
    doomed: dict[RecordRef, Doom] = {}
    for tp in candidates:
        try:
            got = await consumer.getmany(tp, timeout_ms=poll_ms, max_records=max_records)
        except Exception as exc:
            if not is_deterministic(exc):
                raise
            ahead, bad, cause = await _locate(consumer, tp, poll_ms, exc)
            if bad is not None:
                reason = unparsable_reason(cause)
                logger.error(
                    "record the Kafka client cannot parse: dead-lettering it",
                    extra={"topic": tp.topic, "partition": tp.partition, "offset": bad[2], "reason": reason},
                )
                doomed[bad] = Doom(reason, unparsable=True)
                ahead.append(_placeholder(tp, bad[2], ahead[-1].timestamp if ahead else 0))
                consumer.seek(tp, bad[2] + 1)
            if ahead:
                fetched[tp] = ahead
            continue
        fetched.update({p: recs for p, recs in got.items() if recs})
    return fetched, doomed
