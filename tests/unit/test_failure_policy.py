"""The failure policy as a table, broker-free: every site x fault has one answer, and the history
turns small steps into a dead letter exactly at ``dead_letter_attempts``."""

from __future__ import annotations

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotCoordinatorForGroupError,
    OutOfOrderSequenceNumber,
    ProducerFenced,
    TopicAuthorizationFailedError,
)

from consumers.runtime.failure_policy import POLICY, Action, Decision, Fault, History, Site, classify, decide
from consumers.runtime.kafka.producer_errors import FatalProducer
from consumers.runtime.state.interface import StateStoreFault
from events.codec import DecodeError


@pytest.mark.parametrize(
    ("exc", "abandoned", "fault"),
    [
        (ProducerFenced(), False, Fault.FENCED),
        (FatalProducer(), False, Fault.FENCED),
        (ProducerFenced(), True, Fault.FENCED),  # a fence wins over an abandoned producer
        (KafkaTimeoutError(), True, Fault.ABANDONED),
        (MessageSizeTooLargeError(), False, Fault.RECORD),
        (DecodeError("bad bytes"), False, Fault.RECORD),
        (OutOfOrderSequenceNumber(), False, Fault.SEQUENCE),
        (StateStoreFault(3, "corrupt"), False, Fault.LOCAL_STATE),
        (KafkaConnectionError(), False, Fault.WORLD),
        (NotCoordinatorForGroupError(), False, Fault.WORLD),
        (TopicAuthorizationFailedError(), False, Fault.WORLD),  # an operator fixes it: waited out
        (RuntimeError("a client's own trouble"), False, Fault.WORLD),
        (AttributeError("what no list foresees"), False, Fault.WORLD),
    ],
)
def test_each_failure_is_classified(exc: BaseException, abandoned: bool, fault: Fault) -> None:
    assert classify(exc, abandoned=abandoned) is fault


#: The whole table as a reader should find it: (site, fault) → action, exactly_once.
EXPECTED: dict[tuple[Site, Fault], Action] = {
    (Site.TRANSACTION, Fault.FENCED): Action.STAND_DOWN,
    (Site.TRANSACTION, Fault.ABANDONED): Action.RETAKE,
    (Site.TRANSACTION, Fault.RECORD): Action.ONE_RECORD,
    (Site.TRANSACTION, Fault.SEQUENCE): Action.REST,
    (Site.TRANSACTION, Fault.LOCAL_STATE): Action.REBUILD,
    (Site.TRANSACTION, Fault.WORLD): Action.REST,
    (Site.STORE_APPLY, Fault.LOCAL_STATE): Action.REBUILD,
    (Site.STORE_APPLY, Fault.WORLD): Action.REBUILD,
    (Site.TAKE_OVER, Fault.LOCAL_STATE): Action.REBUILD,
    (Site.TAKE_OVER, Fault.WORLD): Action.RETAKE,
    (Site.TAKE_OVER, Fault.FENCED): Action.RETAKE,
    (Site.REOPEN, Fault.FENCED): Action.STAND_DOWN,
    (Site.REOPEN, Fault.WORLD): Action.REST,
    (Site.FETCH, Fault.RECORD): Action.DEAD_LETTER,
    (Site.FETCH, Fault.WORLD): Action.REST,
    (Site.CHECKPOINT, Fault.LOCAL_STATE): Action.REBUILD,
    (Site.CHECKPOINT, Fault.WORLD): Action.CARRY_ON,
    (Site.DRAIN, Fault.WORLD): Action.REST,
    (Site.TURN, Fault.LOCAL_STATE): Action.REBUILD,
    (Site.TURN, Fault.WORLD): Action.REST,
}


@pytest.mark.parametrize(("site", "fault"), list(EXPECTED))
def test_the_table(site: Site, fault: Fault) -> None:
    assert decide(site, fault).action is EXPECTED[(site, fault)]


def test_every_site_answers_every_fault_and_the_world_is_never_given_up() -> None:
    """No site lacks an answer (a missing cell is its world's), and no failure of the world is
    ever a dead letter or a stop: the pod waits it out."""
    for site in Site:
        assert Fault.WORLD in POLICY[site]
        for fault in Fault:
            answer = decide(site, fault).action
            assert isinstance(answer, Action)
        assert decide(site, Fault.WORLD).action not in (Action.DEAD_LETTER, Action.ONE_RECORD)


def test_a_refused_batch_renews_the_producer_only_under_exactly_once() -> None:
    assert decide(Site.TRANSACTION, Fault.SEQUENCE) == Decision(Action.REST, renew_producer=True)
    assert decide(Site.TRANSACTION, Fault.SEQUENCE, exactly_once=False) == Decision(Action.REST)
    assert decide(Site.TRANSACTION, Fault.RECORD).renew_producer
    assert not decide(Site.TRANSACTION, Fault.RECORD, exactly_once=False).renew_producer


@pytest.mark.parametrize("limit", [1, 2, 3, 5])
def test_a_step_is_given_up_exactly_at_its_nth_failure(limit: int) -> None:
    actions = [
        decide(
            Site.TRANSACTION, Fault.RECORD, History(same_subject_attempts=n, dead_letter_attempts=limit)
        ).action
        for n in range(0, limit + 2)
    ]
    # 0: a batch (no single step yet) → small steps; then small steps until the Nth failure.
    assert actions[0] is Action.ONE_RECORD
    assert actions[1:limit] == [Action.ONE_RECORD] * (limit - 1)
    assert actions[limit] is Action.DEAD_LETTER


def test_a_million_failures_of_the_world_in_a_row_are_waited_out_within_the_cap() -> None:
    """What the loop does with an outage of a million failures: the policy answers REST every time
    and the episode's backoff stays within its cap (before: OverflowError after 1,025)."""
    import logging

    from resilience.episode import Episode

    episode = Episode("the pod's loop", logging.getLogger("t.policy"), clock=lambda: 0.0)
    worst = 0.0
    for _ in range(1_000_000):
        assert decide(Site.TURN, classify(KafkaConnectionError())).action is Action.REST
        worst = max(worst, episode.failed("down"))
    assert 0.0 < worst <= 5.0
    assert episode.in_a_row == 1_000_000


def test_the_table_in_the_guarantees_is_the_policy() -> None:
    """docs/guarantees.md "The world, waited out" shows the table a newcomer reads: it must be the
    code's, cell for cell."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "guarantees.md").read_text()
    lines = text[text.index("## The world, waited out") :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| site \\ fault"))
    header = lines[start]
    table = lines[start + 2 :]
    rows = table[: next(i for i, line in enumerate(table) if not line.startswith("|"))]
    faults = [Fault(cell.strip()) for cell in header.strip("|").split("|")[1:]]
    shown = {
        "stand down": Action.STAND_DOWN,
        "retake": Action.RETAKE,
        "rest": Action.REST,
        "renew producer, rest": Action.REST,
        "rebuild": Action.REBUILD,
        "rebuild local state": Action.REBUILD,
        "rebuild, go on": Action.REBUILD,
        "carry on": Action.CARRY_ON,
        "dead letter (located, see Bad input)": Action.DEAD_LETTER,
    }
    seen = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        site = Site(cells[0].strip("*").split("**")[0].strip())
        seen.add(site)
        for fault, cell in zip(faults, cells[1:], strict=True):
            action = decide(site, fault).action
            if cell.startswith("small steps"):
                assert action is Action.ONE_RECORD, (site, fault)
            else:
                assert shown[cell] is action, (site, fault, cell)
    assert seen == set(Site)
