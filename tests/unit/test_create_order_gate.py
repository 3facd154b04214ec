"""The create-order gate's rule on the consumer's own facts (fetch answers, positions), one fact at a
time. The real path (a create held back 40 s on a real broker) is tests/integration/test_world_faults.py;
brokers bounced under load, tests/chaos/test_broker_faults.py."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
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


#: The record's producer, as its CloudEvents ``ce_source`` header names it.
UPSTREAM = [("ce_source", b"upstream-a")]
#: Another producer, whose clock may be anywhere.
ANOTHER = [("ce_source", b"upstream-b")]


def _phase_change(
    timestamp: int = 1_000, headers: list[tuple[str, bytes]] | None = None
) -> ConsumerRecord[bytes, bytes]:
    record_headers = UPSTREAM if headers is None else headers
    return ConsumerRecord("phase-changed", 0, 7, timestamp, 0, b"k", b"v", None, 1, 1, record_headers)


def _holding_on_progress() -> _Consumer:
    """Facts that hold any record on progress: no answer from the create partition since it was seen.
    Only the shortcut can release a record then."""
    return _Consumer(highwater_=9, position_=9, polled_ms=int(time.time() * 1000))


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
    gate.applied(0, 8, timestamp=1_001, headers=UPSTREAM)  # its producer's next create: the earlier are in
    assert not await gate.may_follow(consumer, rec)  # type: ignore[arg-type]


async def test_a_create_partition_not_assigned_here_holds_nothing() -> None:
    facts = _Consumer(highwater_=None, assigned=set())
    assert not await CreateOrderGate("execution-created").may_follow(facts, _phase_change())  # type: ignore[arg-type]


# --- the shortcut under skewed producers (issue 42, finding 6) ------------------------------------


async def test_another_producers_create_stamped_later_never_releases_a_record() -> None:
    """Producer B's clock runs ten minutes ahead of A's: its create, made before A's phase change,
    is stamped long after it. It says nothing of A's creates: the record stays held on progress."""
    gate, facts = CreateOrderGate("execution-created"), _holding_on_progress()
    rec = _phase_change(timestamp=1_000)
    gate.begin(0)
    gate.applied(0, 3, timestamp=1_000 + 600_000, headers=ANOTHER)
    assert await gate.may_follow(facts, rec)  # type: ignore[arg-type]
    gate.committed(0)
    gate.begin(0)
    assert await gate.may_follow(facts, rec)  # type: ignore[arg-type]  # committed, still B's


async def test_its_own_producers_create_stamped_later_releases_it() -> None:
    gate, facts = CreateOrderGate("execution-created"), _holding_on_progress()
    rec = _phase_change(timestamp=1_000)
    gate.begin(0)
    gate.applied(0, 3, timestamp=1_001, headers=UPSTREAM)
    assert not await gate.may_follow(facts, rec)  # type: ignore[arg-type]


async def test_its_own_producers_create_of_the_same_millisecond_does_not_release_it() -> None:
    """Two records of one producer in one millisecond: the create may have been made after the
    record, so the record is not released by it (fails if the strict ``>`` becomes ``>=``)."""
    gate, facts = CreateOrderGate("execution-created"), _holding_on_progress()
    rec = _phase_change(timestamp=1_000)
    gate.begin(0)
    gate.applied(0, 3, timestamp=1_000, headers=UPSTREAM)
    assert await gate.may_follow(facts, rec)  # type: ignore[arg-type]
    gate.applied(0, 4, timestamp=1_001, headers=UPSTREAM)  # one millisecond later: released
    assert not await gate.may_follow(facts, rec)  # type: ignore[arg-type]


async def test_the_shortcut_is_kept_per_producer_and_across_committed_transactions_only() -> None:
    gate, facts = CreateOrderGate("execution-created"), _holding_on_progress()
    from_a, from_b = _phase_change(timestamp=5_000), _phase_change(timestamp=5_000, headers=ANOTHER)
    gate.begin(0)
    gate.applied(0, 3, timestamp=9_000, headers=UPSTREAM)
    gate.applied(0, 4, timestamp=4_000, headers=ANOTHER)  # B's clock behind: before B's record
    assert not await gate.may_follow(facts, from_a)  # type: ignore[arg-type]
    assert await gate.may_follow(facts, from_b)  # type: ignore[arg-type]
    gate.begin(0)  # the transaction was not committed (it failed): what it applied is not counted
    assert await gate.may_follow(facts, from_a)  # type: ignore[arg-type]
    gate.applied(0, 3, timestamp=9_000, headers=UPSTREAM)
    gate.committed(0)
    gate.begin(0)  # the next transaction starts from the committed stamps
    assert not await gate.may_follow(facts, from_a)  # type: ignore[arg-type]
    assert await gate.may_follow(facts, from_b)  # type: ignore[arg-type]
    gate.forget(0)  # the partition moved away: the next owner starts over
    gate.begin(0)
    assert await gate.may_follow(facts, from_a)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "headers",
    [[], [("ce_source", None)], [("ce_source", b"")], [("other", b"upstream-a")]],
    ids=["no-header", "null", "empty", "another-header"],
)
async def test_without_a_producer_named_there_is_no_shortcut(headers: list[tuple[str, bytes | None]]) -> None:
    gate, facts = CreateOrderGate("execution-created"), _holding_on_progress()
    gate.begin(0)
    gate.applied(0, 3, timestamp=9_000, headers=headers)  # type: ignore[arg-type]
    gate.applied(0, 4, timestamp=9_000)
    assert await gate.may_follow(facts, _phase_change(timestamp=1_000, headers=headers))  # type: ignore[arg-type]
    gate.applied(0, 5, timestamp=9_000, headers=UPSTREAM)  # a named create does not release a nameless record
    assert await gate.may_follow(facts, _phase_change(timestamp=1_000, headers=headers))  # type: ignore[arg-type]


async def test_holds_says_which_records_are_held() -> None:
    gate, facts = CreateOrderGate("execution-created"), _holding_on_progress()
    rec = _phase_change()
    assert not gate.holds("phase-changed", 0, 7)
    assert await gate.may_follow(facts, rec)  # type: ignore[arg-type]
    assert gate.holds("phase-changed", 0, 7)
    gate.settled(rec)
    assert not gate.holds("phase-changed", 0, 7)


def _at(offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord("phase-changed", 0, offset, 1_000, 0, b"k", b"v", None, 1, 1, [])


async def test_records_fetched_behind_a_held_one_wait_out_its_confirmation_with_it() -> None:
    """A backlog of held records fetched together goes on together once the first is confirmed (it
    took one confirmation each, about 4 s per record, before). A record fetched later waits its own."""
    gate, facts = CreateOrderGate("execution-created"), _Consumer(highwater_=5, position_=5)
    gate.fetched("phase-changed", 0, 7, 9)  # offsets 7-9 in one fetch, decided now
    now = int(time.time() * 1000)
    facts.polled_ms = now + CREATE_APPEND_MARGIN_MS + 1
    assert await gate.may_follow(facts, _at(7))  # type: ignore[arg-type]  # caught up, not confirmed
    facts.polled_ms += CAUGHT_UP_CONFIRM_MS
    assert not await gate.may_follow(facts, _at(7))  # type: ignore[arg-type]
    gate.settled(_at(7))
    for offset in (8, 9):  # the next turns: the same facts vouch for them
        assert not await gate.may_follow(facts, _at(offset))  # type: ignore[arg-type]
        gate.settled(_at(offset))
    time.sleep(0.002)  # a later millisecond (records seen in the same one are vouched for alike)
    gate.fetched("phase-changed", 0, 10, 10)  # fetched now: not vouched for by the answers before
    assert await gate.may_follow(facts, _at(10))  # type: ignore[arg-type]
    facts.position_ = 4  # and not caught up on a later answer: the cohort's confirmation is gone
    facts.polled_ms += CREATE_APPEND_MARGIN_MS + 1
    assert await gate.may_follow(facts, _at(10))  # type: ignore[arg-type]


async def test_a_record_fetched_again_keeps_the_time_of_its_first_fetch() -> None:
    """A fetch from a held record again (the partition resumes at it) keeps the earlier range's time."""
    gate, facts = CreateOrderGate("execution-created"), _Consumer(highwater_=5, position_=5)
    gate.fetched("phase-changed", 0, 7, 9)
    first = int(time.time() * 1000)
    facts.polled_ms = first + CREATE_APPEND_MARGIN_MS + 1
    assert await gate.may_follow(facts, _at(7))  # type: ignore[arg-type]
    time.sleep(0.01)  # the next turn fetches 7-12: 7-9 were appended by the first fetch already
    gate.fetched("phase-changed", 0, 7, 12)
    facts.polled_ms += CAUGHT_UP_CONFIRM_MS
    assert not await gate.may_follow(facts, _at(7))  # type: ignore[arg-type]
    gate.settled(_at(7))
    assert not await gate.may_follow(facts, _at(9))  # type: ignore[arg-type]  # the first fetch's cohort
    gate.settled(_at(9))
    gate.forget(0)  # the partition moved away: nothing of it is kept
    assert await gate.may_follow(facts, _at(8))  # type: ignore[arg-type]
