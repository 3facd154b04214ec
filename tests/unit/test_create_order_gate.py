"""The create-order gate's rule on the consumer's own facts (fetch answers, positions), one fact at a
time. The real path (a create held back 40 s on a real broker) is tests/integration/test_world_faults.py;
brokers bounced under load, tests/chaos/test_broker_faults.py."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiokafka import ConsumerRecord, TopicPartition

from consumers.runtime.create_order import CAUGHT_UP_CONFIRM_MS, CREATE_APPEND_MARGIN_MS, CreateOrderGate

CREATED = TopicPartition("execution-created", 0)


@dataclass
class _Consumer:
    """What an aiokafka consumer knows of the execution-created partition after its last fetch."""

    highwater_: int | None = None
    polled_ms: int | None = None
    position_: int = 0
    assigned: set[TopicPartition] = field(default_factory=lambda: {CREATED})

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.highwater_

    def last_poll_timestamp(self, tp: TopicPartition) -> int | None:
        return self.polled_ms

    async def position(self, tp: TopicPartition) -> int:
        return self.position_


def _phase_change(timestamp: int = 1_000) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord("phase-changed", 0, 7, timestamp, 0, b"k", b"v", None, 1, 1, ())


async def test_no_answer_since_the_record_was_seen_holds_it() -> None:
    gate, facts = CreateOrderGate("execution-created"), _Consumer(highwater_=5, position_=5)
    facts.polled_ms = int(time.time() * 1000)  # answered now: not after the record was seen + margin
    assert await gate.may_follow(facts, _phase_change())  # type: ignore[arg-type]


async def test_caught_up_goes_on_only_once_confirmed_by_a_later_answer() -> None:
    gate, facts = CreateOrderGate("execution-created"), _Consumer(highwater_=5, position_=5)
    rec = _phase_change()
    consumer = facts
    now = int(time.time() * 1000)
    facts.polled_ms = now + CREATE_APPEND_MARGIN_MS + 1
    assert await gate.may_follow(consumer, rec)  # type: ignore[arg-type]  # first seen caught up: held
    facts.polled_ms += CAUGHT_UP_CONFIRM_MS - 1
    assert await gate.may_follow(consumer, rec)  # type: ignore[arg-type]  # not long enough yet
    facts.polled_ms += 1
    assert not await gate.may_follow(consumer, rec)  # type: ignore[arg-type]  # confirmed: it goes on


async def test_a_new_leaders_low_highwater_is_not_trusted_when_the_next_answer_shows_more() -> None:
    """A leader just elected answers with a high watermark below a create its predecessor
    acknowledged; its next answer shows the create. The record stays held throughout."""
    gate, facts = CreateOrderGate("execution-created"), _Consumer(highwater_=5, position_=5)
    rec = _phase_change()
    consumer = facts
    facts.polled_ms = int(time.time() * 1000) + CREATE_APPEND_MARGIN_MS + 1
    assert await gate.may_follow(consumer, rec)  # type: ignore[arg-type]
    facts.polled_ms += 500
    facts.highwater_ = 6  # the create the old leader acknowledged
    assert await gate.may_follow(consumer, rec)  # type: ignore[arg-type]
    facts.polled_ms += CAUGHT_UP_CONFIRM_MS  # long past the first caught-up answer: still held
    assert await gate.may_follow(consumer, rec)  # type: ignore[arg-type]
    facts.position_ = 6  # the create read (and, in the pod, applied): caught up anew, confirmed later
    assert await gate.may_follow(consumer, rec)  # type: ignore[arg-type]
    facts.polled_ms += CAUGHT_UP_CONFIRM_MS
    assert not await gate.may_follow(consumer, rec)  # type: ignore[arg-type]


async def test_creates_of_the_batch_not_applied_yet_hold_it_and_a_later_create_releases_it() -> None:
    gate, facts = CreateOrderGate("execution-created"), _Consumer(highwater_=9, position_=9)
    consumer = facts
    facts.polled_ms = int(time.time() * 1000) + 10 * CAUGHT_UP_CONFIRM_MS
    rec = _phase_change(timestamp=1_000)
    gate.begin(0, last_create_offset=8)
    assert await gate.may_follow(consumer, rec)  # type: ignore[arg-type]  # create 8 still to apply
    gate.applied(0, 8, timestamp=1_001)  # a create stamped after the record: every earlier one is in
    assert not await gate.may_follow(consumer, rec)  # type: ignore[arg-type]


async def test_a_create_partition_not_assigned_here_holds_nothing() -> None:
    facts = _Consumer(highwater_=None, assigned=set())
    assert not await CreateOrderGate("execution-created").may_follow(facts, _phase_change())  # type: ignore[arg-type]
