"""Holding a record back while creates produced before it may still be unapplied.

The inputs are separate topics, so a fetch (after a restart, a rebalance, a broker outage: any
backlog) can hand out records before the creates produced earlier on the co-partitioned
execution-created partition. A phase change of a not-yet-created execution, and every session
delete (a session's creates are on its partition number), waits while that partition may still
hold a create produced before it. The wait is on *progress*, never on a clock: a broker fault
that holds the execution-created partition back for ten minutes holds the record ten minutes.
The record goes on (a phase change as a dead letter, "unknown execution") only once the pod has
consumed the execution-created partition past the point where any create produced before it
must be:

- a fetch of that partition answered after the pod first looked at the record (plus
  :data:`CREATE_APPEND_MARGIN_MS` for the fetch's own wait) showed its highwater, and
- the pod's position on it has reached that highwater (past control records too, which is why
  the position and not the last create applied is compared), and
- no create of that partition fetched with this transaction's batch is still to be applied, and
- it is still so on a fetch answered :data:`CAUGHT_UP_CONFIRM_MS` later: a leader just elected (a
  broker bounced) can answer with a high watermark below records its predecessor acknowledged,
  until its followers fetch again; the confirmation outlasts that.

Only the pod's own clock is read (when it first looked at the record, and when each fetch was
answered), so a producer with a skewed clock can neither release a record early nor hold it for
ever. One shortcut compares producers' stamps, and only a producer's with its own: once a create
*of the record's own producer* (the same ``ce_source``) stamped strictly later than the record was
applied, every create that producer made before the record has been (one clock, and its records
reach the partition in the order it made them). A create of another producer never releases a
record, however late its stamp: its clock may run ahead of the record's (before, any create stamped
later released it, so a producer whose clock ran ahead released other producers' records early). A
create stamped in the same millisecond as the record may have been made after it: not enough. A
record or create without a ``ce_source`` takes no shortcut.

A record counts as seen when the fetch that brought it was decided (every record of a fetch was
appended before it was answered), so the records fetched behind a held one are seen with it: a
backlog of held records (early phase changes, session deletes) waits out one confirmation
together, not one after the other (about 4 s each before). The confirmation is kept per cohort
(the partition and the time its records were seen): the same facts vouch for every record of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from events.codec import header

#: How much later than the pod first looked at a record a fetch of the execution-created partition
#: must be answered to vouch for it: the fetch may have been sent up to ``fetch_max_wait_ms``
#: (500 ms) before its answer, and the record was appended before the pod saw it.
CREATE_APPEND_MARGIN_MS = 1000
#: How long the execution-created partition must stay caught up (on fetches answered that much apart)
#: before a held record goes on: a new leader's high watermark catches up within its followers' next
#: fetch (``replica.fetch.wait.max.ms``, 500 ms by default).
CAUGHT_UP_CONFIRM_MS = 3000
#: Held records remembered at most (a bound on memory, not a limit anyone should reach).
_MAX_HELD = 100_000
#: Producers (``ce_source``) whose last create is remembered per partition, at most: past it the
#: shortcut starts over (records then wait on progress: slower, never early).
_MAX_SOURCES = 1_000
#: The CloudEvents header naming a record's producer.
SOURCE_HEADER = "ce_source"

#: Per producer (``ce_source``): the stamp of its last create applied.
_Stamps = dict[str, int]


def source_of(headers: Iterable[tuple[str, bytes | None]] | None) -> str | None:
    """A record's producer (its ``ce_source``), or None without one (a null or empty value too)."""
    try:
        return header(headers, SOURCE_HEADER) or None  # type: ignore[arg-type]
    except (AttributeError, TypeError, ValueError):  # a header that is not bytes: no source
        return None


class CreateOrderGate:
    """Per partition: how far the execution-created topic has been applied, committed and in progress."""

    def __init__(self, created_topic: str) -> None:
        self._created_topic = created_topic
        #: Per partition, per producer: the stamp of its last create applied and committed.
        self._committed: dict[int, _Stamps] = {}
        #: The same within the transaction in progress.
        self._in_progress: dict[int, _Stamps] = {}
        #: Per partition: the last create offset of the transaction's batch not applied yet.
        self._unapplied_upto: dict[int, int] = {}
        #: When the pod first looked at each held record (its own wall clock, ms).
        self._held_since: dict[tuple[str, int, int], int] = {}
        #: Per cohort (topic, partition, seen ms): when a fetch first showed its create partition
        #: caught up (ms, pod's clock). Kept until its topic partition's fetched range moves on.
        self._caught_up_at: dict[tuple[str, int, int], int] = {}
        #: Per input partition: the last offset of the fetch being decided and when it was decided
        #: (ms): every record up to that offset was appended by then.
        self._fetched: dict[tuple[str, int], tuple[int, int]] = {}

    def fetched(self, topic: str, partition: int, first: int, last: int) -> None:
        """A fetch of ``first``..``last`` of that partition is being decided: those records were all
        appended by now. A range still ahead of ``first`` is kept (its time is the earlier)."""
        known = self._fetched.get((topic, partition))
        if known is None or known[0] < first:
            now = int(time.time() * 1000)
            self._fetched[(topic, partition)] = (last, now)
            # Every record seen before now lies behind this fetch: their cohorts are done with.
            self._caught_up_at = {
                c: t for c, t in self._caught_up_at.items() if c[:2] != (topic, partition) or c[2] >= now
            }

    def begin(self, partition: int, last_create_offset: int | None = None) -> None:
        """A transaction for ``partition`` starts from what was committed; ``last_create_offset``:
        the last execution-created record of its batch (None: none fetched)."""
        done = self._committed.get(partition)
        if done is None:
            self._in_progress.pop(partition, None)
        else:
            self._in_progress[partition] = dict(done)
        if last_create_offset is None:
            self._unapplied_upto.pop(partition, None)
        else:
            self._unapplied_upto[partition] = last_create_offset

    def applied(
        self,
        partition: int,
        offset: int,
        timestamp: int,
        headers: Iterable[tuple[str, bytes | None]] | None = None,
    ) -> None:
        """A create at ``offset`` was applied (or dead-lettered) in the transaction in progress;
        ``headers``: its record's, which name its producer (without them it takes no shortcut)."""
        source = source_of(headers)
        if source is not None:
            stamps = self._in_progress.setdefault(partition, {})
            if source not in stamps and len(stamps) >= _MAX_SOURCES:
                stamps.clear()
            stamps[source] = max(timestamp, stamps.get(source, -1))
        if self._unapplied_upto.get(partition, -1) <= offset:
            self._unapplied_upto.pop(partition, None)

    def committed(self, partition: int) -> None:
        done = self._in_progress.get(partition)
        if done is not None:
            self._committed[partition] = dict(done)

    def forget(self, partition: int) -> None:
        """The partition moved away (or its writer was fenced): the next owner starts over."""
        self._committed.pop(partition, None)
        self._in_progress.pop(partition, None)
        self._unapplied_upto.pop(partition, None)
        self._held_since = {ref: t for ref, t in self._held_since.items() if ref[1] != partition}
        self._caught_up_at = {c: t for c, t in self._caught_up_at.items() if c[1] != partition}
        self._fetched = {tp: f for tp, f in self._fetched.items() if tp[1] != partition}

    def holds(self, topic: str, partition: int, offset: int) -> bool:
        """Is that record held now (looked at, and not yet applied or dead-lettered)?"""
        return (topic, partition, offset) in self._held_since

    def seen_at(self, topic: str, partition: int, offset: int) -> int | None:
        """When a held record counts as seen (ms, the pod's clock): its cohort. None: not held."""
        return self._held_since.get((topic, partition, offset))

    def settled(self, rec: ConsumerRecord[bytes, bytes]) -> None:
        """The record was applied or dead-lettered: it is no longer held."""
        self._held_since.pop((rec.topic, rec.partition, rec.offset), None)

    async def may_follow(self, consumer: AIOKafkaConsumer, rec: ConsumerRecord[bytes, bytes]) -> bool:
        """Could a create produced before this record still be unapplied on its partition number?"""
        created = TopicPartition(self._created_topic, rec.partition)
        if created not in consumer.assignment():
            return False
        if len(self._held_since) > _MAX_HELD:
            self._held_since.clear()
            self._caught_up_at.clear()
        ref = (rec.topic, rec.partition, rec.offset)
        seen_ms = self._held_since.get(ref)
        if seen_ms is None:
            fetched = self._fetched.get((rec.topic, rec.partition))
            now = int(time.time() * 1000)
            seen_ms = min(now, fetched[1]) if fetched is not None and rec.offset <= fetched[0] else now
            self._held_since[ref] = seen_ms
        cohort = (rec.topic, rec.partition, seen_ms)
        source = source_of(rec.headers)
        if source is not None and self._in_progress.get(rec.partition, {}).get(source, -1) > rec.timestamp:
            return False  # its own producer's create stamped after it was applied (same ms: maybe not)
        if rec.partition in self._unapplied_upto:
            return True  # creates of this batch are still to be applied: look again next turn
        highwater = consumer.highwater(created)
        polled = consumer.last_poll_timestamp(created)
        if highwater is None or polled is None or polled <= seen_ms + CREATE_APPEND_MARGIN_MS:
            return True  # no answer from that partition's leader since the record was seen
        position = await consumer.position(created)  # known (fetched): no broker round trip
        if position < highwater:
            self._caught_up_at.pop(cohort, None)
            return True
        caught_up = self._caught_up_at.setdefault(cohort, polled)
        return bool(polled < caught_up + CAUGHT_UP_CONFIRM_MS)
