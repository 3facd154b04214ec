"""The capacity ledger's decisions, without a broker (issue 44, items 2, 4 and 5).

Expectations come from the issue's and the design's words: a cap counts admitted sandboxes (a
session's once); over it a create waits; first in, first out within an organisation; across
organisations round-robin (in name order after the one admitted last, wrapping round), skipping
an organisation at its own cap; a release frees and admits the next; a waiter released while it waits leaves without a
sandbox; a wait longer than the time-out ends at a tick; caps come from ticks; nothing is revoked.
The scenario tests spell their expectations out by hand; the randomized test checks the answers
against a naive reference model of those rules written here (a pass over everything each time),
and checks restore and replay against the ledger that ran.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from consumers.lanes.admission import (
    TICK_KEY,
    Answer,
    CapacityRecord,
    Caps,
    Ledger,
    LedgerDecision,
    decide,
)
from events.sandbox_lanes.v1 import capacity_pb2, common_pb2

T0 = 1_800_000_000.0
UNLIMITED = Caps()


def _ts(at: float) -> Timestamp:
    seconds = int(at // 1)
    return Timestamp(seconds=seconds, nanos=round((at - seconds) * 1e9))


def _meta(event_id: str, at: float) -> common_pb2.EventMeta:
    meta = common_pb2.EventMeta(event_id=event_id, schema_version=1)
    meta.occurred_at.CopyFrom(_ts(at))
    return meta


def _kind(answer: Answer) -> str:
    return type(answer.message).__name__.removeprefix("Capacity")


class Log:
    """A capacity log and its owner: appends records, decides each, keeps what came out."""

    def __init__(self, caps: Caps = UNLIMITED, ledger: Ledger | None = None, offset: int = 0) -> None:
        self.ledger = ledger if ledger is not None else Ledger(caps)
        self.caps = caps
        self.offset = offset
        self.records: list[tuple[CapacityRecord, int]] = []
        self.decisions: list[LedgerDecision] = []
        self.changelog: dict[str, capacity_pb2.CapacityClaim] = {}
        self.now = T0

    def append(self, record: CapacityRecord) -> LedgerDecision:
        offset = self.offset
        self.offset += 1
        self.records.append((record, offset))
        decision = decide(record, offset, self.ledger)
        self.decisions.append(decision)
        for key, claim in decision.changes.items():
            if claim is None:
                self.changelog.pop(key, None)
            else:
                self.changelog[key] = claim
        return decision

    def request(
        self, key: str, execution: str, org: str, *, at: float | None = None, partition: int = 0
    ) -> LedgerDecision:
        return self.append(
            capacity_pb2.CapacityRequested(
                meta=_meta(f"req-{self.offset}", self.now if at is None else at),
                sandbox_key=key,
                execution_id=execution,
                org=org,
                partition=partition,
                scope=common_pb2.SANDBOX_SCOPE_WORKFLOW,
            )
        )

    def release(self, key: str, execution: str = "", *, at: float | None = None) -> LedgerDecision:
        return self.append(
            capacity_pb2.CapacityReleased(
                meta=_meta(f"rel-{self.offset}", self.now if at is None else at),
                sandbox_key=key,
                execution_id=execution,
                reason="test",
            )
        )

    def tick(self, caps: Caps, *, at: float | None = None) -> LedgerDecision:
        self.caps = caps
        return self.append(caps.tick(f"tick-{self.offset}", _ts(self.now if at is None else at)))


def _admitted(decision: LedgerDecision) -> list[str]:
    return [a.message.execution_id for a in decision.answers if _kind(a) == "Admitted"]


def _queued(decision: LedgerDecision) -> list[capacity_pb2.CapacityQueued]:
    return [a.message for a in decision.answers if isinstance(a.message, capacity_pb2.CapacityQueued)]


# --- scenarios ----------------------------------------------------------------------------------


def test_fifo_within_an_organisation() -> None:
    log = Log(Caps(max_sandboxes=1))
    assert _admitted(log.request("k1", "e1", "a")) == ["e1"]
    for n in (2, 3, 4):
        decision = log.request(f"k{n}", f"e{n}", "a")
        assert _admitted(decision) == []
        assert [q.execution_id for q in _queued(decision)] == [f"e{n}"]
    order = []
    for n in (1, 2, 3, 4):
        order += _admitted(log.release(f"k{n}"))
    assert order == ["e2", "e3", "e4"]


def test_an_admission_names_the_execution_partition_and_wait() -> None:
    log = Log(Caps(max_sandboxes=1))
    log.request("k1", "e1", "a", at=T0)
    log.request("k2", "e2", "a", at=T0 + 2, partition=7)
    decision = log.release("k1", at=T0 + 5.5)
    [answer] = decision.answers
    assert answer.partition == 7
    assert isinstance(answer.message, capacity_pb2.CapacityAdmitted)
    assert (answer.message.execution_id, answer.message.sandbox_key) == ("e2", "k2")
    assert answer.message.waited_s == pytest.approx(3.5)
    assert answer.message.meta.occurred_at == _ts(T0 + 5.5)  # the deciding record's time
    assert answer.message.meta.causation_id == "rel-2"
    assert answer.message.meta.event_id  # derived from the request: see test_replay_is_exact


def test_a_wait_never_counts_negative() -> None:
    """A request stamped later than the record that admits it (partition clocks differ)."""
    log = Log(Caps(max_sandboxes=1))
    log.request("k1", "e1", "a", at=T0)
    log.request("k2", "e2", "a", at=T0 + 60)
    [answer] = log.release("k1", at=T0 + 1).answers
    assert isinstance(answer.message, capacity_pb2.CapacityAdmitted)
    assert answer.message.waited_s == 0.0


def test_a_record_without_a_time_takes_the_logs_clock() -> None:
    """A request without ``occurred_at`` waits from the last tick's time, not from 1970."""
    log = Log()
    log.tick(Caps(max_sandboxes=1, admission_timeout_s=600), at=T0)
    log.request("k1", "e1", "A")
    untimed = capacity_pb2.CapacityRequested(
        meta=common_pb2.EventMeta(event_id="untimed"), sandbox_key="k2", execution_id="e2", org="A"
    )
    [q] = _queued(log.append(untimed))
    assert q.meta.occurred_at == _ts(T0)
    assert log.tick(log.caps, at=T0 + 300).answers == []
    [answer] = log.tick(log.caps, at=T0 + 601).answers
    assert isinstance(answer.message, capacity_pb2.CapacityTimedOut)
    assert answer.message.waited_s == pytest.approx(601)


def _fairness_run() -> tuple[dict[str, int], int]:
    """Issue 44 item 7's burst: 300 creates from 3 organisations (one sends 80 %), cap 20,
    sandboxes released in the order they were admitted. Returns each organisation's admissions
    made while all three had a create waiting (as the answers show it), and their total."""
    rng = random.Random(44)
    orgs = ["big"] * 240 + ["small1"] * 30 + ["small2"] * 30
    rng.shuffle(orgs)
    log = Log(Caps(max_sandboxes=20))
    org_of: dict[str, str] = {}
    waiting: dict[str, set[str]] = {"big": set(), "small1": set(), "small2": set()}
    running: list[str] = []  # admitted, in admission order
    share = {"big": 0, "small1": 0, "small2": 0}

    def account(decision: LedgerDecision) -> None:
        all_wait = all(waiting.values())
        for answer in decision.answers:
            execution = answer.message.execution_id
            if _kind(answer) == "Queued":
                waiting[org_of[execution]].add(execution)
            elif _kind(answer) == "Admitted":
                waiting[org_of[execution]].discard(execution)
                running.append(execution)
                if all_wait:
                    share[org_of[execution]] += 1

    for n, org in enumerate(orgs):
        org_of[f"e{n}"] = org
        log.now += 0.01
        account(log.request(f"k{n}", f"e{n}", org))
    done = 0
    while done < len(running):
        log.now += 0.1
        account(log.release(f"k{running[done][1:]}"))
        done += 1
    assert done == 300  # every create admitted once, released once
    return share, sum(share.values())


def test_fairness_a_burst_of_one_organisation_does_not_starve_the_others() -> None:
    share, total = _fairness_run()
    print(f"\nadmissions while all three waited: {share} of {total}")
    equal = total / 3  # the expectation: an equal share each, whatever each sent
    assert total >= 60  # the window is long enough to measure a share at all
    for org, n in share.items():
        assert abs(n - equal) <= 0.1 * equal, (org, n, equal)


def test_the_installation_cap_and_the_organisation_cap_both_hold() -> None:
    log = Log(Caps(max_sandboxes=4, max_per_org=2))
    assert _admitted(log.request("a1", "a1", "A")) == ["a1"]
    assert _admitted(log.request("a2", "a2", "A")) == ["a2"]
    [q] = _queued(log.request("a3", "a3", "A"))
    assert (q.reason, q.position) == ("capacity: organisation cap 2 reached", 1)
    assert _admitted(log.request("b1", "b1", "B")) == ["b1"]
    assert _admitted(log.request("b2", "b2", "B")) == ["b2"]
    [q] = _queued(log.request("b3", "b3", "B"))
    assert (q.reason, q.position) == ("capacity: organisation cap 2 reached", 2)
    [q] = _queued(log.request("c1", "c1", "C"))
    assert (q.reason, q.position) == ("capacity: installation cap 4 reached", 3)
    # A frees one: A and C may take it (B is at its own cap); B was admitted last, so the round
    # goes on to C.
    assert _admitted(log.release("a1")) == ["c1"]
    # B frees one: A and B may; after C the round wraps to A.
    assert _admitted(log.release("b1")) == ["a3"]
    # C frees one: only B is under its cap.
    assert _admitted(log.release("c1")) == ["b3"]
    assert log.ledger.held == 4


def test_a_session_sandbox_counts_once_for_several_executions() -> None:
    log = Log(Caps(max_sandboxes=2))
    assert _admitted(log.request("session-1", "e1", "A")) == ["e1"]
    # Another execution of the same session: admitted at once, nothing more counted.
    assert _admitted(log.request("session-1", "e2", "A")) == ["e2"]
    assert _admitted(log.request("k2", "e3", "A")) == ["e3"]  # room for one more sandbox
    [q] = _queued(log.request("k3", "e4", "A"))
    assert q.reason == "capacity: installation cap 2 reached"
    # An execution letting go of a counted sandbox frees nothing (it may serve others: counting it
    # too long is safe for the cap, too short is not)...
    assert log.release("session-1", "e1").answers == []
    assert log.release("session-1", "e2").answers == []
    assert log.ledger.held == 2
    # ...its teardown does.
    assert _admitted(log.release("session-1")) == ["e4"]
    # A session serving many executions: its claim does not grow with them.
    log.request("session-9", "x0", "B")
    log.release("k2")
    for n in range(1, 50):
        assert _admitted(log.request("session-9", f"x{n}", "B")) == [f"x{n}"]
    assert len(log.ledger.claims["session-9"].waiters) == 1


def test_a_sandbox_torn_down_frees_its_place_whoever_it_served() -> None:
    log = Log(Caps(max_sandboxes=1))
    assert _admitted(log.request("session-1", "e1", "A")) == ["e1"]
    assert _admitted(log.request("session-1", "e2", "A")) == ["e2"]
    log.request("k2", "e3", "A")
    assert _admitted(log.release("session-1")) == ["e3"]


def test_joining_a_waiting_sandbox_waits_with_it_and_is_admitted_with_it() -> None:
    log = Log(Caps(max_sandboxes=1))
    log.request("k1", "e1", "A")
    log.request("session-2", "e2", "A", partition=3)
    [q] = _queued(log.request("session-2", "e3", "B", partition=5))
    assert (q.execution_id, q.position) == ("e3", 1)
    decision = log.release("k1")
    assert sorted((a.partition, a.message.execution_id) for a in decision.answers) == [(3, "e2"), (5, "e3")]
    assert log.ledger.held == 1


def test_a_release_frees_a_place_and_admits_the_next() -> None:
    log = Log(Caps(max_sandboxes=2))
    log.request("k1", "e1", "A")
    log.request("k2", "e2", "A")
    log.request("k3", "e3", "B")
    decision = log.release("k2")
    assert _admitted(decision) == ["e3"]
    assert decision.changes["k2"] is None  # tombstone: it no longer counts
    claim = decision.changes["k3"]
    assert claim is not None and claim.admitted and list(w.execution_id for w in claim.waiters) == ["e3"]


def test_a_waiter_released_while_it_waits_leaves_without_a_sandbox() -> None:
    log = Log(Caps(max_sandboxes=1))
    log.request("k1", "e1", "A")
    log.request("k2", "e2", "A")
    log.request("k3", "e3", "A")
    decision = log.release("k2", "e2")  # e2 reached a terminal phase while it waited
    assert decision.answers == []
    assert decision.changes == {"k2": None}
    assert _admitted(log.release("k1")) == ["e3"]
    # A sandbox released while it only waited (its session deleted): gone, nothing counted, and
    # whoever waited for it is answered (no execution waits for ever).
    log.request("k4", "e4", "A")
    decision = log.release("k4")
    assert decision.changes == {"k4": None}
    [gone] = decision.answers
    assert isinstance(gone.message, capacity_pb2.CapacityTimedOut) and gone.message.execution_id == "e4"
    assert gone.message.reason.startswith("capacity: its sandbox was released while it waited")
    assert _admitted(log.release("k3")) == []
    assert log.ledger.held == 0


def test_one_of_two_waiters_leaves_the_other_keeps_its_place() -> None:
    log = Log(Caps(max_sandboxes=1))
    log.request("k1", "e1", "A")
    log.request("session-2", "e2", "A")
    log.request("session-2", "e3", "A")
    log.request("k3", "e4", "A")
    assert log.release("session-2", "e2").answers == []
    assert _admitted(log.release("k1")) == ["e3"]


def test_a_wait_longer_than_the_timeout_ends_at_a_tick() -> None:
    log = Log()
    log.tick(Caps(max_sandboxes=1, admission_timeout_s=600), at=T0)
    log.request("k1", "e1", "A", at=T0)
    log.request("k2", "e2", "A", at=T0 + 10, partition=4)
    log.request("session-3", "e3", "A", at=T0 + 20)
    assert log.tick(log.caps, at=T0 + 610).answers == []  # 600 s exactly: not longer
    decision = log.tick(log.caps, at=T0 + 611)
    [answer] = decision.answers
    assert answer.partition == 4
    assert isinstance(answer.message, capacity_pb2.CapacityTimedOut)
    assert answer.message.execution_id == "e2"
    assert answer.message.reason == "capacity: waited 601 s for a sandbox (installation cap 1 reached)"
    assert answer.message.waited_s == pytest.approx(601)
    assert decision.changes["k2"] is None  # nobody waits for it any more
    # The admitted one is never timed out; e3 goes at its own time. e5's request reached the log
    # after the tick at 611: its wait counts from there, not from its own (earlier) time.
    log.request("session-3", "e5", "A", at=T0 + 300)
    decision = log.tick(log.caps, at=T0 + 700)
    assert [(_kind(a), a.message.execution_id) for a in decision.answers] == [("TimedOut", "e3")]
    assert decision.changes["session-3"] is not None  # e5 still waits for it
    assert log.tick(log.caps, at=T0 + 1211).answers == []
    decision = log.tick(log.caps, at=T0 + 1212)
    assert [(_kind(a), a.message.execution_id) for a in decision.answers] == [("TimedOut", "e5")]
    assert decision.changes["session-3"] is None
    assert _admitted(log.release("k1")) == []  # nothing left waiting


def test_no_timeout_when_it_is_zero() -> None:
    log = Log()
    log.tick(Caps(max_sandboxes=1), at=T0)
    log.request("k1", "e1", "A", at=T0)
    log.request("k2", "e2", "A", at=T0)
    assert log.tick(log.caps, at=T0 + 10 * 86_400).answers == []


def test_a_tick_changes_the_caps_and_nothing_is_revoked() -> None:
    log = Log(Caps(max_sandboxes=1))
    for n in range(1, 5):
        log.request(f"k{n}", f"e{n}", "A")
    decision = log.tick(Caps(max_sandboxes=3))
    assert _admitted(decision) == ["e2", "e3"]
    assert decision.changes[TICK_KEY] is not None
    decision = log.tick(Caps(max_sandboxes=1, max_per_org=1))
    assert decision.answers == []  # three held over the new cap: kept
    assert log.ledger.held == 3
    assert _admitted(log.release("k1")) == []
    assert _admitted(log.release("k2")) == []
    assert _admitted(log.release("k3")) == ["e4"]
    log.request("k5", "e5", "B")
    [q] = _queued(log.request("k6", "e6", "A"))
    assert q.reason == "capacity: organisation cap 1 reached"


def test_before_any_tick_the_callers_caps_decide() -> None:
    log = Log(Caps(max_sandboxes=1))
    log.request("k1", "e1", "A")
    [q] = _queued(log.request("k2", "e2", "A"))
    assert q.reason == "capacity: installation cap 1 reached"
    assert _admitted(log.tick(Caps())) == ["e2"]  # unlimited


def test_unlimited_admits_everything_at_once() -> None:
    log = Log()
    for n in range(50):
        assert _admitted(log.request(f"k{n}", f"e{n}", f"org{n % 3}")) == [f"e{n}"]
    assert log.ledger.held == 50


def test_the_same_request_twice_and_unknown_releases_change_nothing() -> None:
    log = Log(Caps(max_sandboxes=1))
    log.request("k1", "e1", "A")
    log.request("k2", "e2", "A")
    for record, _ in list(log.records):  # each request again, as delivered twice
        assert log.append(record) == LedgerDecision({}, [])
    assert log.release("nope") == LedgerDecision({}, [])
    assert log.release("k1", "not-a-waiter") == LedgerDecision({}, [])
    assert log.release("k2", "not-a-waiter") == LedgerDecision({}, [])
    assert _admitted(log.release("k1")) == ["e2"]
    assert log.release("k1") == LedgerDecision({}, [])  # released twice


def test_positions_follow_arrival_order() -> None:
    log = Log(Caps(max_sandboxes=1))
    log.request("a1", "a1", "A")
    assert [q.position for q in _queued(log.request("b1", "b1", "B"))] == [1]
    assert [q.position for q in _queued(log.request("c1", "c1", "C"))] == [2]
    assert [q.position for q in _queued(log.request("a2", "a2", "A"))] == [3]
    # Another execution joining c1's sandbox waits where c1 waits.
    assert [q.position for q in _queued(log.request("c1", "c1-bis", "C"))] == [2]
    assert _admitted(log.release("a1")) == ["b1"]
    assert [q.position for q in _queued(log.request("d1", "d1", "D"))] == [3]
    log.release("c1", "c1")
    log.release("c1", "c1-bis")  # c1's sandbox: nobody waits for it now
    assert [q.position for q in _queued(log.request("e1", "e1", "E"))] == [3]


def test_the_caps_and_clock_are_state() -> None:
    log = Log(Caps(max_sandboxes=5))
    log.tick(Caps(max_sandboxes=2, max_per_org=1, admission_timeout_s=30), at=T0 + 3)
    tick_claim = log.changelog[TICK_KEY]
    assert tick_claim.tick.max_sandboxes == 2 and tick_claim.tick.meta.occurred_at == _ts(T0 + 3)
    restored = Ledger.from_claims(log.changelog.values(), Caps(max_sandboxes=5))
    assert restored.caps == Caps(max_sandboxes=2, max_per_org=1, admission_timeout_s=30)
    assert restored == log.ledger


# --- restore, replay, and a reference model over random logs ------------------------------------


@dataclass
class _MClaim:
    org: str
    seq: int
    admitted: bool = False
    waiters: dict[str, float] = field(default_factory=dict)  # execution -> requested at


class _Model:
    """The rules restated naively (every decision looks at everything)."""

    def __init__(self, caps: Caps) -> None:
        self.caps = caps
        self.claims: dict[str, _MClaim] = {}
        self.last_org = ""
        self.clock = 0.0  # the last tick's time

    def held(self, org: str | None = None) -> int:
        return sum(1 for c in self.claims.values() if c.admitted and (org is None or c.org == org))

    def eligible(self) -> list[tuple[str, int, str]]:
        """(org, the org's oldest waiting sequence, key of that claim) per eligible org."""
        if self.caps.max_sandboxes and self.held() >= self.caps.max_sandboxes:
            return []
        oldest: dict[str, tuple[int, str]] = {}
        for key, c in self.claims.items():
            if not c.admitted and (c.org not in oldest or c.seq < oldest[c.org][0]):
                oldest[c.org] = (c.seq, key)
        return [
            (org, seq, key)
            for org, (seq, key) in oldest.items()
            if not (self.caps.max_per_org and self.held(org) >= self.caps.max_per_org)
        ]

    def binding(self, org: str) -> str:
        if self.caps.max_per_org and self.held(org) >= self.caps.max_per_org:
            return f"organisation cap {self.caps.max_per_org} reached"
        if self.caps.max_sandboxes and self.held() >= self.caps.max_sandboxes:
            return f"installation cap {self.caps.max_sandboxes} reached"
        return ""

    def expect(self, record: CapacityRecord, offset: int) -> list[tuple[str, str, str, object]]:
        """The answers as (kind, execution, key, detail); applies the record to the model."""
        now = record.meta.occurred_at.seconds + record.meta.occurred_at.nanos / 1e9
        out: list[tuple[str, str, str, object]] = []
        queued: tuple[str, str] | None = None
        if isinstance(record, capacity_pb2.CapacityRequested):
            key, execution = record.sandbox_key, record.execution_id
            at = max(now, self.clock)  # a wait counts from when the request reached the log
            claim = self.claims.get(key)
            if claim is None:
                self.claims[key] = _MClaim(record.org, offset, waiters={execution: at})
                queued = (key, execution)
            elif execution not in claim.waiters:
                if claim.admitted:
                    out.append(("Admitted", execution, key, 0.0))  # joins, not recorded
                else:
                    claim.waiters[execution] = at
                    queued = (key, execution)
        elif isinstance(record, capacity_pb2.CapacityReleased):
            claim = self.claims.get(record.sandbox_key)
            if claim is not None and not record.execution_id:
                if not claim.admitted:
                    why = (
                        f"capacity: its sandbox was released while it waited ({record.reason or 'released'})"
                    )
                    out += [("TimedOut", e, record.sandbox_key, why) for e in claim.waiters]
                del self.claims[record.sandbox_key]
            elif claim is not None and not claim.admitted and record.execution_id in claim.waiters:
                del claim.waiters[record.execution_id]
                if not claim.waiters:
                    del self.claims[record.sandbox_key]
        else:
            self.clock = now
            self.caps = Caps.of_tick(record)
            timeout = self.caps.admission_timeout_s
            for key, claim in list(self.claims.items()):
                if claim.admitted or not timeout:
                    continue
                for execution, at in list(claim.waiters.items()):
                    if now - at > timeout:
                        reason = f"capacity: waited {now - at:.0f} s for a sandbox"
                        binding = self.binding(claim.org)
                        out.append(
                            ("TimedOut", execution, key, reason + (f" ({binding})" if binding else ""))
                        )
                        del claim.waiters[execution]
                if not claim.waiters:
                    del self.claims[key]
        while self.eligible():
            candidates = sorted(self.eligible())  # by org name
            later = [c for c in candidates if c[0] > self.last_org]
            org, _, key = (later or candidates)[0]  # the next after the last admitted, wrapping round
            self.last_org = org
            claim = self.claims[key]
            claim.admitted = True
            out += [
                ("Admitted", execution, key, max(0.0, now - at)) for execution, at in claim.waiters.items()
            ]
        if queued is not None and not self.claims[queued[0]].admitted:
            claim = self.claims[queued[0]]
            position = 1 + sum(1 for c in self.claims.values() if not c.admitted and c.seq < claim.seq)
            out.append(("Queued", queued[1], queued[0], (f"capacity: {self.binding(claim.org)}", position)))
        return out


def _seen(answers: Iterable[Answer]) -> list[tuple[str, str, str, object]]:
    seen: list[tuple[str, str, str, object]] = []
    for a in answers:
        m = a.message
        if isinstance(m, capacity_pb2.CapacityQueued):
            seen.append(("Queued", m.execution_id, m.sandbox_key, (m.reason, m.position)))
        elif isinstance(m, capacity_pb2.CapacityAdmitted):
            seen.append(("Admitted", m.execution_id, m.sandbox_key, round(m.waited_s, 6)))
        else:
            seen.append(("TimedOut", m.execution_id, m.sandbox_key, m.reason))
    return seen


def _normal(expected: list[tuple[str, str, str, object]]) -> list[tuple[str, str, str, object]]:
    """Time-outs in any order among themselves (the rules give none); the rest as decided."""
    timed_out = sorted((a for a in expected if a[0] == "TimedOut"), key=repr)
    rest = [
        (k, e, key, round(d, 6) if isinstance(d, float) else d)
        for k, e, key, d in expected
        if k != "TimedOut"
    ]
    return timed_out + rest


def _random_log(seed: int, length: int) -> list[CapacityRecord]:
    rng = random.Random(seed)
    orgs = ["A"] * 6 + ["B"] * 3 + ["C"]
    keys = [f"k{n}" for n in range(rng.choice((8, 20, 40)))]
    org_of = {key: rng.choice(orgs) for key in keys}
    executions = [f"e{n}" for n in range(rng.choice((10, 30, 80)))]
    now = T0
    records: list[CapacityRecord] = []
    for n in range(length):
        now += rng.choice((0.0, 0.5, 1.0, 3.0, 7.0))
        roll = rng.random()
        if roll < 0.45:
            key = rng.choice(keys)
            at = now + rng.choice((0.0, 0.0, -2.0, 1.5))  # partitions' clocks differ
            records.append(
                capacity_pb2.CapacityRequested(
                    meta=_meta(f"r{n}", at),
                    sandbox_key=key,
                    execution_id=rng.choice(executions),
                    org=org_of[key],
                    partition=rng.randrange(4),
                )
            )
        elif roll < 0.52 and records:
            records.append(rng.choice(records))  # delivered twice
        elif roll < 0.85:
            execution = "" if rng.random() < 0.6 else rng.choice(executions)
            records.append(
                capacity_pb2.CapacityReleased(
                    meta=_meta(f"r{n}", now),
                    sandbox_key=rng.choice([*keys, "unknown"]),
                    execution_id=execution,
                )
            )
        else:
            caps = Caps(rng.choice((0, 1, 3, 6)), rng.choice((0, 1, 2)), rng.choice((0.0, 5.0, 20.0)))
            records.append(caps.tick(f"r{n}", _ts(now)))
    return records


def _run(records: list[CapacityRecord], seed: int) -> tuple[Log, list[bytes]]:
    """Decides the log, checking each decision against the model, the caps, and that a waiter is
    answered Admitted or TimedOut at most once; at random points, restore == running. Returns the
    answers as bytes (for replay)."""
    rng = random.Random(seed)
    first = Caps(*_first_caps(seed))
    log = Log(first)
    model = _Model(first)
    # (key, execution) -> "waiting" / "holding", from the records and answers alone.
    pairs: dict[tuple[str, str], str] = {}
    out: list[bytes] = []
    for record in records:
        offset = log.offset
        held_before = {key for key, c in log.changelog.items() if c.admitted and key != TICK_KEY}
        expected = model.expect(record, offset)
        decision = log.append(record)
        assert _normal(_seen(decision.answers)) == _normal(expected), (seed, offset, record)
        # The cap in force is never exceeded by an admission (held is above it only when a tick
        # lowered it, and then nothing is admitted).
        held_after = {key: log.changelog[key].org for key in log.changelog if key != TICK_KEY}
        held_after = {key: org for key, org in held_after.items() if log.changelog[key].admitted}
        if set(held_after) - held_before:
            caps = log.ledger.caps
            assert not caps.max_sandboxes or len(held_after) <= caps.max_sandboxes
            for org in {held_after[key] for key in set(held_after) - held_before}:
                assert not caps.max_per_org or list(held_after.values()).count(org) <= caps.max_per_org
        if isinstance(record, capacity_pb2.CapacityRequested):
            pairs.setdefault((record.sandbox_key, record.execution_id), "waiting")
        for answer in decision.answers:
            m = answer.message
            pair = (m.sandbox_key, m.execution_id)
            if isinstance(m, capacity_pb2.CapacityAdmitted):
                # Once, or again for a sandbox counted before this record (an execution joining a
                # counted sandbox is answered at once and not recorded: a repeat is answered again,
                # with the same id).
                assert pairs.get(pair) == "waiting" or (
                    pairs.get(pair) == "holding" and m.sandbox_key in held_before
                ), (seed, offset, pair)
                pairs[pair] = "holding"
            elif isinstance(m, capacity_pb2.CapacityTimedOut):
                assert pairs.pop(pair, None) == "waiting", (seed, offset, pair)
            out.append(m.SerializeToString(deterministic=True))
        if isinstance(record, capacity_pb2.CapacityReleased):
            for pair in [p for p in pairs if p[0] == record.sandbox_key]:
                if not record.execution_id:
                    del pairs[pair]
                elif pair[1] == record.execution_id and pairs[pair] == "waiting":
                    del pairs[pair]  # an execution lets go only of a wait
        if rng.random() < 0.05:
            assert Ledger.from_claims(log.changelog.values(), first) == log.ledger
    assert Ledger.from_claims(log.changelog.values(), first) == log.ledger
    return log, out


@pytest.mark.parametrize("seed", range(120))
def test_random_logs_follow_the_rules_restore_and_replay(seed: int) -> None:
    records = _random_log(seed, 250)
    log, answers = _run(records, seed)
    # Replay: the same log over an empty ledger gives the same answers, byte for byte.
    replay = Log(Caps(*_first_caps(seed)))
    replayed = [
        a.message.SerializeToString(deterministic=True) for r in records for a in replay.append(r).answers
    ]
    assert replayed == answers
    assert replay.ledger == log.ledger
    # Restore midway, then go on: the restored ledger decides as the live one did.
    half = len(records) // 2
    first = Log(Caps(*_first_caps(seed)))
    for r in records[:half]:
        first.append(r)
    resumed = Log(
        ledger=Ledger.from_claims(first.changelog.values(), Caps(*_first_caps(seed))), offset=first.offset
    )
    rest = [
        a.message.SerializeToString(deterministic=True)
        for r in records[half:]
        for a in resumed.append(r).answers
    ]
    assert rest == answers[len(answers) - len(rest) :] and len(rest) == sum(
        len(d.answers) for d in log.decisions[half:]
    )


def _first_caps(seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    return rng.choice((1, 2, 5)), rng.choice((0, 1, 2))
