"""The pod's one failure policy: where a failure happened and what it is → what the pod does.

Read it as one table (:data:`POLICY`), like librdkafka's error codes or Kafka Streams' exception
handlers: a row per *site* (where the failure happened), a column per *fault* (what it is), and in
each cell the *response*. Nothing else in the runtime decides whether to retry: the call sites
classify (:func:`classify`), ask (:func:`decide`) and carry the answer out. The waiting itself is
the one backoff (:class:`resilience.backoff.Backoff`, through an episode that logs once).

Pure: no I/O, no clock; tested as a table, broker-free.

The faults:

* ``fenced``: the partition's transactional id has a newer epoch (another pod took it over, or the
  broker aborted a transaction past its timeout), or librdkafka made the producer fatal. Nothing of
  it may be written from here.
* ``abandoned``: a broker wait outlived its deadline, or an abort failed: the producer's transaction
  has an unknown fate (a commit may still land).
* ``record``: what a record *is* (its size, an encoding, content protobuf cannot take): the same
  record fails the same way on every retry (:func:`consumers.runtime.kafka.failures.is_deterministic`).
* ``sequence``: the producer's sequence numbers are behind the broker's (a batch it refused).
* ``local state``: the local state database cannot be opened, read or written
  (:class:`~consumers.runtime.state.interface.StateStoreFault`); the state topic holds the truth.
* ``world``: everything else — the broker, the network, a coordinator moving, a timeout, a missing
  ACL, a client's own trouble, and what no list foresees. Waited out with backoff, for ever; never
  charged to a record, never a reason to exit.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from aiokafka.errors import OutOfOrderSequenceNumber, ProducerFenced

from consumers.runtime.kafka.failures import is_deterministic
from consumers.runtime.state.interface import StateStoreFault


class Site(StrEnum):
    """Where a failure happened."""

    FETCH = "fetch"  # the group consumer's fetch
    TAKE_OVER = "take-over"  # fencing the previous writer, reading its offsets, restoring state
    TRANSACTION = "transaction"  # a partition's transaction, begin to commit
    STORE_APPLY = "store apply"  # folding a committed transaction into the local store
    REOPEN = "reopen"  # a new producer for an owned partition whose producer was closed
    CHECKPOINT = "checkpoint"  # moving the local store's checkpoints (off the turn)
    DRAIN = "drain"  # folding driver results back while stopping
    TURN = "turn"  # anything else of a turn (a rewind, a restore before deciding)


class Fault(StrEnum):
    """What a failure is."""

    FENCED = "fenced"
    ABANDONED = "abandoned"
    RECORD = "record"
    SEQUENCE = "sequence"
    LOCAL_STATE = "local state"
    WORLD = "world"


class Action(StrEnum):
    """What the pod does about it."""

    #: Forget the partition and rejoin the group; nothing of it runs until the group reassigns it.
    STAND_DOWN = "stand down"
    #: Forget the partition and take it over anew (a new producer whose InitProducerId settles the
    #: old transaction's fate), after the take-over's backoff, if still assigned here.
    RETAKE = "retake"
    #: Rest the work (its records read again, its results held) for the backoff's delay.
    REST = "rest"
    #: Rest, and replace the partition's producer (a new epoch restarts its sequence numbers).
    RENEW_AND_REST = "renew and rest"
    #: Retry the partition in small steps (one result, then one record per transaction), so the
    #: next failure names what fails and only it pays.
    ONE_RECORD = "one record"
    #: Give up the record that failed the same way ``dead_letter_attempts`` times: dead-letter it
    #: (a driver result: record its call as failed) and go on.
    DEAD_LETTER = "dead letter"
    #: Throw the partition's local state database away and rebuild it from the state topic before
    #: its next record is decided.
    REBUILD = "rebuild local state"
    #: Leave it: the work is retried where it stands (a checkpoint not moved: a longer tail).
    CARRY_ON = "carry on"


#: The table. A site without a cell for a fault answers with its ``WORLD`` cell.
POLICY: Final[dict[Site, dict[Fault, Action]]] = {
    Site.TRANSACTION: {
        Fault.FENCED: Action.STAND_DOWN,
        Fault.ABANDONED: Action.RETAKE,
        Fault.RECORD: Action.ONE_RECORD,  # → DEAD_LETTER once the same record failed N times
        Fault.SEQUENCE: Action.RENEW_AND_REST,
        Fault.LOCAL_STATE: Action.REBUILD,
        Fault.WORLD: Action.REST,
    },
    Site.STORE_APPLY: {
        # The transaction is committed: the topic has it. A store that could not take it cannot be
        # trusted with the next decision; whatever the cause, rebuild from the topic.
        Fault.WORLD: Action.REBUILD,
    },
    Site.TAKE_OVER: {
        Fault.LOCAL_STATE: Action.REBUILD,  # then the take-over goes on from the topic
        Fault.WORLD: Action.RETAKE,
    },
    Site.REOPEN: {
        Fault.FENCED: Action.STAND_DOWN,
        Fault.WORLD: Action.REST,
    },
    Site.FETCH: {
        Fault.RECORD: Action.DEAD_LETTER,  # a record the client cannot parse: located, dead-lettered
        Fault.WORLD: Action.REST,
    },
    Site.CHECKPOINT: {
        Fault.LOCAL_STATE: Action.REBUILD,
        Fault.WORLD: Action.CARRY_ON,
    },
    Site.DRAIN: {Fault.WORLD: Action.REST},
    Site.TURN: {
        Fault.LOCAL_STATE: Action.REBUILD,
        Fault.WORLD: Action.REST,
    },
}


def classify(exc: BaseException, *, abandoned: bool = False) -> Fault:
    """What ``exc`` is. ``abandoned``: the producer gave up on a broker wait (or its abort failed)."""
    if isinstance(exc, ProducerFenced):  # librdkafka's _FATAL counts as a fence (FatalProducer)
        return Fault.FENCED
    if abandoned:
        return Fault.ABANDONED
    if isinstance(exc, StateStoreFault):
        return Fault.LOCAL_STATE
    if is_deterministic(exc):
        return Fault.RECORD
    if isinstance(exc, OutOfOrderSequenceNumber):
        return Fault.SEQUENCE
    return Fault.WORLD


def parse_fault(exc: BaseException) -> bool:
    """A fetch failed for a record the client cannot parse (the policy: locate it, dead-letter it),
    not for the world (re-raised: the caller's loop rests)."""
    return decide(Site.FETCH, classify(exc)).action is Action.DEAD_LETTER


@dataclass(frozen=True)
class History:
    """What the policy needs to know of the failures before this one: how many times in a row
    the same single step (one record, one result) has now failed deterministically, this failure
    included (0: the step was a batch, whose small steps will tell which part fails), and after how
    many such failures a step is given up."""

    same_subject_attempts: int = 0
    dead_letter_attempts: int = 3


@dataclass(frozen=True)
class Decision:
    action: Action
    #: Also replace the partition's producer (exactly_once: a refused batch leaves its sequence
    #: numbers behind the broker's, so every later transaction would fail).
    renew_producer: bool = False


def decide(site: Site, fault: Fault, history: History = History(), *, exactly_once: bool = True) -> Decision:
    """The response to a ``fault`` at ``site``, given the ``history``."""
    row = POLICY[site]
    action = row.get(fault, row[Fault.WORLD])
    if action is Action.ONE_RECORD:
        # A single step (one record or one result) that failed N times the same way is given up;
        # a batch, or a step not yet failed N times, goes (on) in small steps.
        attempts = history.same_subject_attempts
        if attempts > 0 and attempts >= history.dead_letter_attempts:
            action = Action.DEAD_LETTER
        return Decision(action, renew_producer=exactly_once)
    if action is Action.RENEW_AND_REST:
        return Decision(Action.REST, renew_producer=exactly_once)
    return Decision(action)
