"""The capacity ledger's decisions: a pure function of the capacity log (issue 44, items 2, 4, 5).

One owner decides over one log (the capacity topic, one partition): ``decide(record, offset,
ledger)`` turns a ``CapacityRequested`` / ``CapacityReleased`` / ``CapacityTick`` and its offset
into the ledger's changes (its compacted changelog, keyed by sandbox key; ``None`` is a tombstone)
and answers (``CapacityQueued`` / ``CapacityAdmitted`` / ``CapacityTimedOut``, each for an
execution's partition). Nothing else is read: no clock (time is the deciding record's
``occurred_at``; time-outs happen on ticks, whose time is the owner's clock written into the log),
no randomness, and every choice is made in sequence order (or by a unique minimum), never in the
order a dict happened to fill. So replaying the log over an empty ledger gives the same answers,
and a ledger restored from the changelog (``Ledger.from_claims``) decides as the live one.

Fairness: round-robin across the organisations with a create waiting (and under their own cap),
in name order from the one admitted last, wrapping round; within an organisation, first in, first
out. A burst of one organisation gets one admission per round however many it sent, so it cannot
starve anyone, and while several wait their admissions are equal (within one). (A first version
served the organisation holding the fewest sandboxes: with a cap not divisible by the organisations
waiting, the tie-break gave the same one the odd place every time, 40 % of admissions among three
at cap 10, measured on Docker.)

The caps, the last tick and the round-robin's place (the organisation admitted last) are state
too: kept under the reserved key ``TICK_KEY`` as a ``CapacityClaim`` with ``tick`` and ``org``
(sandbox keys are DNS-label names, never "~").

Cost per decision: O(log n) in the claims (a Fenwick tree for positions, a heap for time-outs,
per-organisation FIFOs) plus O(organisations waiting) per admission; never a pass over the claims
(the heap and the tree are rebuilt when half of them is stale: amortised O(1)).
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, NamedTuple, TypeAlias

from google.protobuf.timestamp_pb2 import Timestamp

from events.codec import SCHEMA_VERSION, CapacityAnswer, CapacityRecord, derived_event_id
from events.sandbox_lanes.v1 import capacity_pb2, common_pb2

#: The changelog key of the caps and clock in force (the last tick). Not a sandbox name.
TICK_KEY: Final = "~tick"

_NS: Final = 1_000_000_000

__all__ = [
    "TICK_KEY",
    "Answer",
    "CapacityAnswer",
    "CapacityRecord",
    "Caps",
    "Ledger",
    "LedgerDecision",
    "decide",
]


@dataclass(frozen=True)
class Caps:
    """The caps decided under; 0 is unlimited (``admission_timeout_s`` 0: no time-out)."""

    max_sandboxes: int = 0
    max_per_org: int = 0
    admission_timeout_s: float = 0.0

    @classmethod
    def of_tick(cls, tick: capacity_pb2.CapacityTick) -> Caps:
        return cls(tick.max_sandboxes, tick.max_sandboxes_per_org, tick.admission_timeout_s)

    def tick(self, event_id: str, at: Timestamp) -> capacity_pb2.CapacityTick:
        """The tick an owner writes for these caps (``at``: its clock; ``event_id``: its choice)."""
        meta = common_pb2.EventMeta(event_id=event_id, schema_version=SCHEMA_VERSION)
        meta.occurred_at.CopyFrom(at)
        return capacity_pb2.CapacityTick(
            meta=meta,
            max_sandboxes=self.max_sandboxes,
            max_sandboxes_per_org=self.max_per_org,
            admission_timeout_s=self.admission_timeout_s,
        )


class Answer(NamedTuple):
    """An answer for the admissions topic: its partition (the execution's) and the message."""

    partition: int
    message: CapacityAnswer


class LedgerDecision(NamedTuple):
    """What one record changed (key -> the claim now, None: tombstone) and the answers, in order."""

    changes: dict[str, capacity_pb2.CapacityClaim | None]
    answers: list[Answer]


def decide(record: CapacityRecord, offset: int, ledger: Ledger) -> LedgerDecision:
    """Decide one capacity-log record at ``offset``; the changes are applied to ``ledger`` too."""
    return ledger.decide(record, offset)


def _ns(ts: Timestamp) -> int:
    return ts.seconds * _NS + ts.nanos


def _waited_s(now: Timestamp, since: Timestamp) -> float:
    return max(0.0, (_ns(now) - _ns(since)) / _NS)


class _Ranks:
    """How many waiting claims have a lower sequence: a Fenwick tree over the sequences in order.

    Sequences arrive increasing (log offsets), so a new one is appended; a removed one is zeroed,
    and the arrays are rebuilt once half of them is removed.
    """

    def __init__(self, sequences: Iterable[int] = ()) -> None:
        self._seqs: list[int] = []
        self._tree: list[int] = [0]  # 1-based
        self._index: dict[int, int] = {}  # live sequence -> its 1-based index
        for seq in sorted(sequences):
            self._append(seq)

    def __len__(self) -> int:
        return len(self._index)

    def _prefix(self, i: int) -> int:
        total = 0
        tree = self._tree
        while i > 0:
            total += tree[i]
            i &= i - 1
        return total

    def _append(self, seq: int) -> None:
        self._seqs.append(seq)
        i = len(self._seqs)
        # Node i covers (i - lowbit(i), i]: its own 1 plus the live entries before it in that range.
        self._tree.append(1 + self._prefix(i - 1) - self._prefix(i - (i & -i)))
        self._index[seq] = i

    def add(self, seq: int) -> None:
        if self._seqs and seq <= self._seqs[-1]:
            self._rebuild([*self._index, seq])  # out of log order: only a restore in another order
        else:
            self._append(seq)

    def remove(self, seq: int) -> None:
        i = self._index.pop(seq)
        tree = self._tree
        n = len(tree)
        while i < n:
            tree[i] -= 1
            i += i & -i
        if len(self._seqs) > 2 * len(self._index) + 64:
            self._rebuild(list(self._index))

    def below(self, seq: int) -> int:
        return self._prefix(bisect.bisect_left(self._seqs, seq))

    def _rebuild(self, sequences: list[int]) -> None:
        self._seqs = []
        self._tree = [0]
        self._index = {}
        for seq in sorted(sequences):
            self._append(seq)


#: A waiter's time-out entry: (requested_at ns, claim sequence, execution id, key, request event id).
_Deadline: TypeAlias = tuple[int, int, str, str, str]


class Ledger:
    """The ledger's state (claims by sandbox key, the caps and last tick) and its indexes.

    Mutated only by ``decide`` (a decision) and ``apply`` (a changelog record, on restore).
    Equality is the state's and the live indexes', so a restored ledger can be compared with the
    one that ran.
    """

    def __init__(self, default_caps: Caps = Caps()) -> None:
        self._default_caps = default_caps
        self._caps = default_caps
        self._tick: capacity_pb2.CapacityTick | None = None
        #: The organisation admitted last: round-robin goes on after it (kept with the tick).
        self._last_org = ""
        self._claims: dict[str, capacity_pb2.CapacityClaim] = {}
        self._held = 0
        self._held_by_org: dict[str, int] = {}
        #: org -> its waiting claims' keys, in sequence order (key -> sequence).
        self._waiting_by_org: dict[str, OrderedDict[str, int]] = {}
        self._ranks = _Ranks()
        self._deadlines: list[_Deadline] = []  # a heap, with stale entries skipped when popped
        self._live_waiters = 0  # waiters of waiting claims (the heap's live entries)

    # --- restore ---------------------------------------------------------------------------------

    @classmethod
    def from_claims(cls, claims: Iterable[capacity_pb2.CapacityClaim], default_caps: Caps = Caps()) -> Ledger:
        """The ledger whose changelog holds ``claims`` (the latest value of each key, tick included)."""
        ledger = cls(default_caps)
        for claim in sorted(claims, key=lambda c: (c.sequence, c.sandbox_key)):
            ledger.apply(claim.sandbox_key, claim)
        return ledger

    def apply(self, key: str, claim: capacity_pb2.CapacityClaim | None) -> None:
        """Set ``key`` to a changelog value (None: tombstone). The claim is copied."""
        if key == TICK_KEY:
            self._last_org = claim.org if claim is not None else ""
            if claim is None or not claim.HasField("tick"):
                self._tick = None
                self._caps = self._default_caps
            else:
                self._set_tick(claim.tick)
            return
        if key in self._claims:
            self._remove(key)
        if claim is not None:
            stored = capacity_pb2.CapacityClaim()
            stored.CopyFrom(claim)
            stored.sandbox_key = key
            self._put(stored)

    # --- read ------------------------------------------------------------------------------------

    @property
    def caps(self) -> Caps:
        return self._caps

    @property
    def last_tick(self) -> capacity_pb2.CapacityTick | None:
        return self._tick

    @property
    def held(self) -> int:
        """Admitted claims: the sandboxes counted against the caps."""
        return self._held

    @property
    def waiting(self) -> int:
        """Waiting claims (sandboxes asked for and not admitted)."""
        return len(self._ranks)

    def held_by_org(self) -> dict[str, int]:
        return {org: n for org, n in sorted(self._held_by_org.items()) if n}

    def waiting_by_org(self) -> dict[str, int]:
        return {org: len(queue) for org, queue in sorted(self._waiting_by_org.items())}

    @property
    def claims(self) -> Mapping[str, capacity_pb2.CapacityClaim]:
        """Read-only view; do not mutate the claims."""
        return MappingProxyType(self._claims)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ledger):
            return NotImplemented
        return self._canonical() == other._canonical()

    __hash__ = None  # type: ignore[assignment]

    def _canonical(self) -> tuple[object, ...]:
        return (
            self._caps,
            self._tick,
            self._last_org,
            self._claims,
            self._held,
            self.held_by_org(),
            {org: list(queue.items()) for org, queue in self._waiting_by_org.items()},
            sorted(self._ranks._index),
            self._live_waiters,
            sorted({d for d in self._deadlines if self._live(d)}),
        )

    # --- decide ----------------------------------------------------------------------------------

    def decide(self, record: CapacityRecord, offset: int) -> LedgerDecision:
        """See ``decide``: the changes are applied to this ledger as they are made."""
        touched: dict[str, None] = {}
        answers: list[Answer] = []
        now = self._time_of(record)
        cause = record.meta.event_id
        queued_for: tuple[str, capacity_pb2.CapacityWaiter] | None = None
        if isinstance(record, capacity_pb2.CapacityRequested):
            queued_for = self._request(record, offset, now, touched, answers)
        elif isinstance(record, capacity_pb2.CapacityReleased):
            self._release(record, now, touched, answers)
        elif isinstance(record, capacity_pb2.CapacityTick):
            self._on_tick(record, now, touched, answers)
        else:
            raise TypeError(f"not a capacity-log record: {type(record).__name__}")
        self._admit_while_possible(now, cause, touched, answers)
        if queued_for is not None:
            key, waiter = queued_for
            claim = self._claims.get(key)
            if claim is not None and not claim.admitted:
                answers.append(self._queued(claim, waiter, now, cause))
        changes: dict[str, capacity_pb2.CapacityClaim | None] = {}
        for key in touched:
            if key == TICK_KEY:
                changes[key] = capacity_pb2.CapacityClaim(
                    sandbox_key=TICK_KEY, tick=self._tick, org=self._last_org
                )
            elif key in self._claims:
                snapshot = capacity_pb2.CapacityClaim()
                snapshot.CopyFrom(self._claims[key])
                changes[key] = snapshot
            else:
                changes[key] = None
        return LedgerDecision(changes, answers)

    def _time_of(self, record: CapacityRecord) -> Timestamp:
        """The record's ``occurred_at``; without one, the last tick's (the log's clock), else 0."""
        if record.meta.HasField("occurred_at"):
            return record.meta.occurred_at
        if self._tick is not None:
            return self._tick.meta.occurred_at
        return Timestamp()

    def _request(
        self,
        record: capacity_pb2.CapacityRequested,
        offset: int,
        now: Timestamp,
        touched: dict[str, None],
        answers: list[Answer],
    ) -> tuple[str, capacity_pb2.CapacityWaiter] | None:
        """Returns the (key, waiter) to answer Queued if it is still waiting after the admissions."""
        key = record.sandbox_key
        if key == TICK_KEY:
            return None  # never a sandbox name; nothing to count
        # A wait is timed from when the request reached the log: its create's time, or the log's
        # clock (the last tick) when that is later (a pod that lagged, a producer's clock behind).
        if self._tick is not None and _ns(self._tick.meta.occurred_at) > _ns(now):
            now = self._tick.meta.occurred_at
        claim = self._claims.get(key)
        if claim is not None and claim.admitted:
            if any(
                w.execution_id == record.execution_id or w.request_event_id == record.meta.event_id
                for w in claim.waiters
            ):
                return None  # the same request again: answered already
            # Another execution of a counted sandbox (a session's): admitted at once, not recorded
            # (a session serves any number of executions; its claim must not grow with them).
            joined = capacity_pb2.CapacityWaiter(
                execution_id=record.execution_id,
                partition=record.partition,
                requested_at=now,
                request_event_id=record.meta.event_id,
            )
            answers.append(self._admitted(claim, joined, now, record.meta.event_id))
            return None
        waiter = capacity_pb2.CapacityWaiter(
            execution_id=record.execution_id,
            partition=record.partition,
            requested_at=now,
            request_event_id=record.meta.event_id,
        )
        if claim is None:
            claim = capacity_pb2.CapacityClaim(
                sandbox_key=key,
                org=record.org,
                scope=record.scope,
                admitted=False,
                sequence=offset,
                requested_at=now,
                waiters=[waiter],
            )
            self._put(claim)
            touched[key] = None
            return key, waiter
        if any(
            w.execution_id == record.execution_id or w.request_event_id == record.meta.event_id
            for w in claim.waiters
        ):
            return None  # the same request again (or the same execution): already counted, answered
        touched[key] = None
        self._add_waiter(claim, waiter)
        return key, claim.waiters[-1]

    def _release(
        self,
        record: capacity_pb2.CapacityReleased,
        now: Timestamp,
        touched: dict[str, None],
        answers: list[Answer],
    ) -> None:
        """Empty ``execution_id``: the sandbox no longer counts; whoever still waited for it (a
        session deleted while its creates waited) is answered, so no execution waits for ever. Set:
        that execution stops waiting for it (an admitted claim counts on until its own release:
        the sandbox may serve others, and counting it too long is safe where too short is not)."""
        key = record.sandbox_key
        claim = self._claims.get(key)
        if claim is None:
            return
        if not record.execution_id:
            if not claim.admitted:
                why = f"capacity: its sandbox was released while it waited ({record.reason or 'released'})"
                answers.extend(self._timed_out(key, w, now, record.meta.event_id, why) for w in claim.waiters)
            self._remove(key)
            touched[key] = None
            return
        if claim.admitted:
            return
        for i, w in enumerate(claim.waiters):
            if w.execution_id == record.execution_id:
                self._remove_waiter(claim, i)
                touched[key] = None
                if not claim.waiters:  # nobody waits for it any more
                    self._remove(key)
                return

    def _on_tick(
        self,
        record: capacity_pb2.CapacityTick,
        now: Timestamp,
        touched: dict[str, None],
        answers: list[Answer],
    ) -> None:
        self._set_tick(record).meta.occurred_at.CopyFrom(now)  # (a tick without a time keeps the last)
        touched[TICK_KEY] = None
        timeout_s = self._caps.admission_timeout_s
        if timeout_s <= 0:
            return
        now_ns = _ns(now)
        # (self._deadlines is re-read each turn: removing a claim may compact it into a new list.)
        while self._deadlines and (now_ns - self._deadlines[0][0]) / _NS > timeout_s:
            deadline = heapq.heappop(self._deadlines)
            if not self._live(deadline):
                continue
            _, _, execution_id, key, request_event_id = deadline
            claim = self._claims[key]
            i = next(
                i
                for i, w in enumerate(claim.waiters)
                if w.execution_id == execution_id and w.request_event_id == request_event_id
            )
            waiter = capacity_pb2.CapacityWaiter()
            waiter.CopyFrom(claim.waiters[i])
            waited = _waited_s(now, waiter.requested_at)
            binding = self._binding_cap(claim.org)
            reason = f"capacity: waited {waited:.0f} s for a sandbox" + (f" ({binding})" if binding else "")
            answers.append(self._timed_out(key, waiter, now, record.meta.event_id, reason))
            self._live_waiters -= 1  # already popped: _remove_waiter's bookkeeping minus the heap
            del claim.waiters[i]
            touched[key] = None
            if not claim.waiters:
                self._remove(key)
        self._compact_deadlines()

    def _admit_while_possible(
        self, now: Timestamp, cause: str, touched: dict[str, None], answers: list[Answer]
    ) -> None:
        caps = self._caps
        while caps.max_sandboxes == 0 or self._held < caps.max_sandboxes:
            # Round-robin: the first organisation after the one admitted last (by name, wrapping
            # round) that has a create waiting and is under its own cap.
            after: str | None = None
            first: str | None = None
            for org in self._waiting_by_org:
                if caps.max_per_org and self._held_by_org.get(org, 0) >= caps.max_per_org:
                    continue
                if first is None or org < first:
                    first = org
                if org > self._last_org and (after is None or org < after):
                    after = org
            chosen = after if after is not None else first
            if chosen is None:
                return
            self._last_org = chosen
            touched[TICK_KEY] = None
            key = next(iter(self._waiting_by_org[chosen]))
            claim = self._claims[key]
            self._unindex_waiting(claim)
            claim.admitted = True
            claim.admitted_at.CopyFrom(now)
            self._count(claim, +1)
            touched[key] = None
            answers.extend(self._admitted(claim, w, now, cause) for w in claim.waiters)

    # --- answers ---------------------------------------------------------------------------------

    @staticmethod
    def _meta(request_event_id: str, kind: str, key: str, now: Timestamp, cause: str) -> common_pb2.EventMeta:
        meta = common_pb2.EventMeta(
            event_id=derived_event_id(request_event_id, kind, key),
            schema_version=SCHEMA_VERSION,
            causation_id=cause,
        )
        meta.occurred_at.CopyFrom(now)
        return meta

    def _admitted(
        self,
        claim: capacity_pb2.CapacityClaim,
        waiter: capacity_pb2.CapacityWaiter,
        now: Timestamp,
        cause: str,
    ) -> Answer:
        key = claim.sandbox_key
        return Answer(
            waiter.partition,
            capacity_pb2.CapacityAdmitted(
                meta=self._meta(waiter.request_event_id, "CapacityAdmitted", key, now, cause),
                execution_id=waiter.execution_id,
                sandbox_key=key,
                waited_s=_waited_s(now, waiter.requested_at),
            ),
        )

    def _timed_out(
        self, key: str, waiter: capacity_pb2.CapacityWaiter, now: Timestamp, cause: str, reason: str
    ) -> Answer:
        return Answer(
            waiter.partition,
            capacity_pb2.CapacityTimedOut(
                meta=self._meta(waiter.request_event_id, "CapacityTimedOut", key, now, cause),
                execution_id=waiter.execution_id,
                sandbox_key=key,
                reason=reason,
                waited_s=_waited_s(now, waiter.requested_at),
            ),
        )

    def _queued(
        self,
        claim: capacity_pb2.CapacityClaim,
        waiter: capacity_pb2.CapacityWaiter,
        now: Timestamp,
        cause: str,
    ) -> Answer:
        key = claim.sandbox_key
        return Answer(
            waiter.partition,
            capacity_pb2.CapacityQueued(
                meta=self._meta(waiter.request_event_id, "CapacityQueued", key, now, cause),
                execution_id=waiter.execution_id,
                sandbox_key=key,
                reason=f"capacity: {self._binding_cap(claim.org) or 'waiting'}",
                position=1 + self._ranks.below(claim.sequence),
            ),
        )

    def _binding_cap(self, org: str) -> str:
        """Which cap keeps ``org``'s claims waiting: its own before the installation's; "" if none."""
        caps = self._caps
        if caps.max_per_org and self._held_by_org.get(org, 0) >= caps.max_per_org:
            return f"organisation cap {caps.max_per_org} reached"
        if caps.max_sandboxes and self._held >= caps.max_sandboxes:
            return f"installation cap {caps.max_sandboxes} reached"
        return ""

    # --- the state and its indexes ---------------------------------------------------------------

    def _set_tick(self, tick: capacity_pb2.CapacityTick) -> capacity_pb2.CapacityTick:
        stored = capacity_pb2.CapacityTick()
        stored.CopyFrom(tick)
        self._tick = stored
        self._caps = Caps.of_tick(stored)
        return stored

    def _put(self, claim: capacity_pb2.CapacityClaim) -> None:
        self._claims[claim.sandbox_key] = claim
        if claim.admitted:
            self._count(claim, +1)
            return
        queue = self._waiting_by_org.setdefault(claim.org, OrderedDict())
        out_of_order = bool(queue) and next(reversed(queue.values())) > claim.sequence
        queue[claim.sandbox_key] = claim.sequence
        if out_of_order:  # only a restore applied out of sequence order
            self._waiting_by_org[claim.org] = OrderedDict(sorted(queue.items(), key=lambda kv: kv[1]))
        self._ranks.add(claim.sequence)
        for w in claim.waiters:
            self._push_deadline(claim, w)

    def _remove(self, key: str) -> None:
        claim = self._claims.pop(key)
        if claim.admitted:
            self._count(claim, -1)
        else:
            self._unindex_waiting(claim)

    def _unindex_waiting(self, claim: capacity_pb2.CapacityClaim) -> None:
        queue = self._waiting_by_org[claim.org]
        del queue[claim.sandbox_key]
        if not queue:
            del self._waiting_by_org[claim.org]
        self._ranks.remove(claim.sequence)
        self._live_waiters -= len(claim.waiters)  # their heap entries are stale from now on
        self._compact_deadlines()

    def _count(self, claim: capacity_pb2.CapacityClaim, delta: int) -> None:
        self._held += delta
        n = self._held_by_org.get(claim.org, 0) + delta
        if n:
            self._held_by_org[claim.org] = n
        else:
            self._held_by_org.pop(claim.org, None)

    def _add_waiter(self, claim: capacity_pb2.CapacityClaim, waiter: capacity_pb2.CapacityWaiter) -> None:
        claim.waiters.append(waiter)
        if not claim.admitted:
            self._push_deadline(claim, waiter)

    def _remove_waiter(self, claim: capacity_pb2.CapacityClaim, i: int) -> None:
        del claim.waiters[i]
        if not claim.admitted:
            self._live_waiters -= 1
            self._compact_deadlines()

    def _push_deadline(self, claim: capacity_pb2.CapacityClaim, w: capacity_pb2.CapacityWaiter) -> None:
        entry = (_ns(w.requested_at), claim.sequence, w.execution_id, claim.sandbox_key, w.request_event_id)
        heapq.heappush(self._deadlines, entry)
        self._live_waiters += 1

    def _live(self, deadline: _Deadline) -> bool:
        """The entry's waiter still waits (its claim exists, is not admitted, and still holds it)."""
        requested_ns, sequence, execution_id, key, request_event_id = deadline
        claim = self._claims.get(key)
        if claim is None or claim.admitted or claim.sequence != sequence:
            return False
        return any(
            w.execution_id == execution_id
            and w.request_event_id == request_event_id
            and _ns(w.requested_at) == requested_ns
            for w in claim.waiters
        )

    def _compact_deadlines(self) -> None:
        if len(self._deadlines) > 2 * self._live_waiters + 64:
            self._deadlines = [d for d in self._deadlines if self._live(d)]
            heapq.heapify(self._deadlines)
