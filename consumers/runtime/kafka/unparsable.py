"""Getting past a record the Kafka client cannot parse.

aiokafka decodes a record's header keys as UTF-8 while it iterates a fetched batch (in its C and
its Python readers alike), and raises inside ``getmany()`` before the caller sees any record of
that fetch; a corrupt batch or a codec it lacks does the same. Retrying fetches the same bytes and
raises the same way, so a reader would never get past the record (and the pod's next owner of the
partition would not either). Here the reader finds the record and gets a placeholder for it in
its place: the pod's partition transaction dead-letters it (topic, partition, offset and the
client's error) with the offset committed past it; a reader of a whole topic (replay) sees it.

The failed ``getmany()`` may have drained records of other partitions (and of this one, before the
bad record) that it never returned, so every fetched partition is first put back where its reader
stands (the pod: its committed offset, where each turn leaves every partition).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from consumers.runtime.failure_policy import parse_fault
from consumers.runtime.loop_watch import bounded_wait

logger = logging.getLogger("sandbox_lanes.pod")

Records = list[ConsumerRecord[bytes, bytes]]
#: A record's place: (topic, partition, offset).
RecordRef = tuple[str, int, int]
#: A placeholder's timestamp type: no record the broker hands out has it.
_PLACEHOLDER_TIMESTAMP_TYPE = -1
#: Records fetched one at a time ahead of a bad one at most, before they are handed on.
_AHEAD_MAX = 2_000
#: Past its timeout by this much a fetch is let go, the pod's own and those around a bad record
#: alike (aiokafka holds one for as long as a rebalance takes): nothing is taken from the buffer.
FETCH_GRACE_S = 1.0


class Doom(NamedTuple):
    """Why a record is dead-lettered without being decided."""

    reason: str
    #: The Kafka client could not parse it: the record in the batch is a placeholder.
    unparsable: bool = False
    #: Its dead letter kept failing too (a dead-letter topic with a smaller size limit): send one
    #: with the original's sizes and hashes only.
    bare: bool = False
    #: The failure behind it: its exception's class and message, and how many times it was met.
    error_class: str = ""
    error_message: str = ""
    attempts: int = 1


def record_ref(rec: ConsumerRecord[bytes, bytes]) -> RecordRef:
    return (rec.topic, rec.partition, rec.offset)


def is_placeholder(rec: ConsumerRecord[bytes, bytes]) -> bool:
    """Stands for a record the client could not parse (no key, value or headers of its own)."""
    return bool(rec.timestamp_type == _PLACEHOLDER_TIMESTAMP_TYPE)


def unparsable_reason(exc: BaseException) -> str:
    return f"the Kafka client cannot parse the record ({type(exc).__name__}: {exc})"


def _failed_offset(consumer: AIOKafkaConsumer, tp: TopicPartition, after: int) -> int:
    """The offset of the record whose parse failed: where the fetch stood when it raised.

    aiokafka keeps that in its fetch result (past any control batch before the record). Where a
    version does not, the record after the last one returned is the best known answer.
    """
    fetch = getattr(getattr(consumer, "_fetcher", None), "_records", {}).get(tp)
    offset = getattr(getattr(fetch, "_partition_records", None), "next_fetch_offset", None)
    return offset if isinstance(offset, int) and offset >= after else after


async def _fetch(
    consumer: AIOKafkaConsumer, tp: TopicPartition, poll_ms: int, max_records: int
) -> dict[TopicPartition, Records]:
    """One partition's fetch, let go (nothing) past its timeout; a declared wait of the loop."""
    bound_s = poll_ms / 1000 + FETCH_GRACE_S
    with bounded_wait("a fetch around an unparsable record", bound_s):
        try:
            got: dict[TopicPartition, Records] = await asyncio.wait_for(
                consumer.getmany(tp, timeout_ms=poll_ms, max_records=max_records), bound_s
            )
        except TimeoutError:
            return {}
    return got


def _placeholder(tp: TopicPartition, offset: int, timestamp: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        tp.topic, tp.partition, offset, timestamp, _PLACEHOLDER_TIMESTAMP_TYPE, None, None, None, -1, -1, ()
    )


async def _locate(
    consumer: AIOKafkaConsumer, tp: TopicPartition, poll_ms: int
) -> tuple[Records, int | None, BaseException | None]:
    """Fetch ``tp`` one record at a time from where it stands, up to the record that fails."""
    ahead: Records = []
    while len(ahead) < _AHEAD_MAX:
        position = await consumer.position(tp)
        try:
            got = await _fetch(consumer, tp, poll_ms, 1)
        except Exception as exc:
            if not parse_fault(exc):
                raise
            return ahead, _failed_offset(consumer, tp, position), exc
        records = got.get(tp, [])
        if not records:
            break  # the bad record is not fetched (yet): the reader meets it again
        ahead.extend(records)
    return ahead, None, None


async def fetch_around_unparsable(
    consumer: AIOKafkaConsumer,
    candidates: list[TopicPartition],
    rewind: Callable[[TopicPartition], Awaitable[None]],
    *,
    poll_ms: int,
    max_records: int,
) -> tuple[dict[TopicPartition, Records], dict[RecordRef, Doom]]:
    """The records of ``candidates`` as far as they parse, with a placeholder for each that does not.

    ``rewind`` puts a partition back where its reader stands. Returns the fetch and the
    placeholders' reasons; a bad record's partition is sought past it.
    """
    for tp in candidates:
        await rewind(tp)
    fetched: dict[TopicPartition, Records] = {}
    doomed: dict[RecordRef, Doom] = {}
    try:
        for tp in candidates:
            try:
                got = await _fetch(consumer, tp, poll_ms, max_records)
            except Exception as exc:
                if not parse_fault(exc):
                    raise
                await rewind(tp)
                ahead, bad, cause = await _locate(consumer, tp, poll_ms)
                if bad is not None and cause is not None:
                    reason = unparsable_reason(cause)
                    logger.error(
                        "record the Kafka client cannot parse: dead-lettering it",
                        extra={"topic": tp.topic, "partition": tp.partition, "offset": bad, "reason": reason},
                    )
                    doomed[(tp.topic, tp.partition, bad)] = Doom(
                        reason, unparsable=True, error_class=type(cause).__name__, error_message=str(cause)
                    )
                    ahead.append(_placeholder(tp, bad, ahead[-1].timestamp if ahead else 0))
                    consumer.seek(tp, bad + 1)
                if ahead:
                    fetched[tp] = ahead
                continue
            fetched.update({p: recs for p, recs in got.items() if recs})
    except BaseException:
        # A failure of the world midway (a rebalance, the broker): nothing of this scan is handed
        # on, so every partition it read goes back to where the scan found it.
        for tp in candidates:
            with contextlib.suppress(Exception):
                await rewind(tp)
        raise
    return fetched, doomed
