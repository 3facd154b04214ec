"""State retention without a broker: the rule, the store's schedule, and what the reaper keeps.

Expectations are literal, from issue 25's rule: a state may go once it is finished (a terminal
phase, a refused create, or a deleted session's record, with nothing pending) and the retention
has passed since its last input's ``occurred_at``. Each condition of the rule has a test of its
own that fails when that condition is taken out of ``consumers/lanes/retention.py`` (checked by
mutating the rule one condition at a time, issue 33).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from consumers.lanes.reap import plan_reap
from consumers.lanes.retention import finished, removable_from
from consumers.runtime.state.rocksdb import RocksDBStore
from consumers.runtime.state.store import MemoryStore as StateStore
from events.sandbox_lanes.v1 import common_pb2, state_pb2
from tests.integration.test_reaper import _sb, _state

DAY = 86_400.0


def _pending(state: state_pb2.ExecutionState) -> state_pb2.ExecutionState:
    entry = state.pending.add()
    entry.effect_id = "c1"
    entry.op = state_pb2.EFFECT_OP_DEPROVISION
    return state


TERMINAL = (
    common_pb2.EXECUTION_COMPLETED,
    common_pb2.EXECUTION_FAILED,
    common_pb2.EXECUTION_CANCELLED,
    common_pb2.EXECUTION_TERMINATED,
)
NOT_TERMINAL = (
    common_pb2.EXECUTION_PHASE_UNSPECIFIED,
    common_pb2.EXECUTION_PENDING,
    common_pb2.EXECUTION_IN_PROGRESS,
    common_pb2.EXECUTION_PAUSED,
)


def _terminal(phase: int = common_pb2.EXECUTION_COMPLETED) -> state_pb2.ExecutionState:
    return _state("wf", phase=phase, at=1_000)


def _refused() -> state_pb2.ExecutionState:
    """A refused create: its phase is not terminal, so ``refused`` alone makes it finished."""
    state = _state("wf", phase=common_pb2.EXECUTION_PENDING, at=1_000)
    state.refused = True
    return state


def _deleted_session() -> state_pb2.ExecutionState:
    """A deleted session's own record: no phase, not refused, only ``session_deleted``."""
    state = state_pb2.ExecutionState(execution_id="ses_1", session_deleted=True)
    state.updated_at.FromSeconds(1_000)
    return state


FINISHED = {"terminal": _terminal, "refused": _refused, "session deleted": _deleted_session}


# --- the rule, one condition per test (each fails if that condition is taken out of the rule) ----


@pytest.mark.parametrize("make", FINISHED.values(), ids=FINISHED.keys())
def test_a_pending_effect_keeps_a_finished_state(make: Callable[[], state_pb2.ExecutionState]) -> None:
    """A state removed under a pending effect would lose the effect's result: never removable."""
    assert finished(make()) is True  # the same state without the effect is finished
    kept = _pending(make())
    assert finished(kept) is False
    assert removable_from(kept, DAY, seen_at=5.0) is None


@pytest.mark.parametrize("phase", TERMINAL, ids=common_pb2.ExecutionPhase.Name)
def test_a_terminal_phase_is_finished(phase: int) -> None:
    state = _terminal(phase)
    assert finished(state) is True
    assert removable_from(state, DAY, seen_at=5.0) == 1_000 + DAY


@pytest.mark.parametrize("phase", NOT_TERMINAL, ids=common_pb2.ExecutionPhase.Name)
def test_a_live_execution_is_never_removable(phase: int) -> None:
    state = _state("wf", phase=phase, at=1_000)
    assert finished(state) is False
    assert removable_from(state, DAY, seen_at=5.0) is None


def test_a_refused_create_is_finished_whatever_its_phase() -> None:
    assert finished(_refused()) is True
    assert removable_from(_refused(), DAY, seen_at=5.0) == 1_000 + DAY


def test_a_deleted_sessions_record_is_finished() -> None:
    assert finished(_deleted_session()) is True
    assert removable_from(_deleted_session(), DAY, seen_at=5.0) == 1_000 + DAY
    live_session = state_pb2.ExecutionState(execution_id="ses_2")
    assert finished(live_session) is False


@pytest.mark.parametrize("retention_s", [0.0, -1.0])
def test_no_retention_keeps_every_state(retention_s: float) -> None:
    for make in FINISHED.values():
        assert removable_from(make(), retention_s, seen_at=5.0) is None


def test_the_clock_is_the_last_inputs_occurred_at_not_when_the_pod_saw_it() -> None:
    done = _terminal()
    done.updated_at.nanos = 500_000_000
    assert removable_from(done, 7 * DAY, seen_at=5.0) == 1_000.5 + 7 * DAY
    assert removable_from(done, 7 * DAY, seen_at=99_999.0) == 1_000.5 + 7 * DAY


def test_a_state_without_a_clock_counts_from_when_the_pod_saw_it() -> None:
    no_clock = state_pb2.ExecutionState(execution_id="ses", session_deleted=True)
    assert removable_from(no_clock, 60.0, seen_at=5.0) == 65.0
    assert removable_from(no_clock, 60.0, seen_at=7.0) == 67.0


# --- the store's schedule ---------------------------------------------------------------------


def test_the_store_never_lists_a_terminal_state_while_an_effect_is_pending() -> None:
    store = StateStore("state", retention_s=100.0)
    store.put(0, "tearing", _pending(_state("tearing", phase=common_pb2.EXECUTION_COMPLETED, at=1_000)))
    assert store.due(1e12, limit=10) == {}
    # The teardown's result folded back (nothing pending): now it is scheduled as any finished state.
    store.put(0, "tearing", _state("tearing", phase=common_pb2.EXECUTION_COMPLETED, at=1_000))
    assert store.due(1_100.0, limit=10) == {0: ["tearing"]}
    # An effect pending again (a recover's ensure, say) takes it off the schedule.
    store.put(0, "tearing", _pending(_state("tearing", phase=common_pb2.EXECUTION_COMPLETED, at=1_000)))
    assert store.due(1e12, limit=10) == {}


def test_the_store_lists_due_keys_until_they_are_deleted() -> None:
    store = StateStore("state", retention_s=100.0)
    store.put(0, "done_early", _state("done_early", phase=common_pb2.EXECUTION_COMPLETED, at=1_000))
    store.put(0, "done_late", _state("done_late", phase=common_pb2.EXECUTION_FAILED, at=1_050))
    store.put(1, "other_partition", _state("other_partition", phase=common_pb2.EXECUTION_CANCELLED, at=1_000))
    store.put(0, "live", _state("live", phase=common_pb2.EXECUTION_IN_PROGRESS, at=0))
    assert store.due(1_099.0, limit=10) == {}
    assert store.due(1_100.0, limit=10) == {0: ["done_early"], 1: ["other_partition"]}
    assert store.due(1_100.0, limit=1) in ({0: ["done_early"]}, {1: ["other_partition"]})
    # Listed again until the tombstone is committed (a failed transaction lists them next time).
    assert store.due(1_200.0, limit=10) == {0: ["done_early", "done_late"], 1: ["other_partition"]}
    store.delete(0, "done_early")
    assert store.get(0, "done_early") is None
    # A state that moves on (a recover out of FAILED) is no longer due; one that ends again is.
    store.put(0, "done_late", _state("done_late", phase=common_pb2.EXECUTION_IN_PROGRESS, at=1_060))
    assert store.due(1_200.0, limit=10) == {1: ["other_partition"]}
    store.put(0, "done_late", _state("done_late", phase=common_pb2.EXECUTION_COMPLETED, at=1_070))
    assert store.due(1_169.0, limit=10) == {1: ["other_partition"]}
    assert store.due(1_170.0, limit=10) == {0: ["done_late"], 1: ["other_partition"]}
    # A partition that leaves takes its schedule with it.
    store.drop([1])
    assert store.due(1_200.0, limit=10) == {0: ["done_late"]}
    assert len(store) == 2 and store.get(0, "live") is not None


def test_a_store_without_retention_lists_nothing() -> None:
    store = StateStore("state")
    store.put(0, "done", _state("done", phase=common_pb2.EXECUTION_COMPLETED, at=0))
    assert store.due(1e12, limit=10) == {}


def test_with_retention_an_unreferenced_session_sandbox_is_kept() -> None:
    """Its executions' states may have expired while the session lives on; only a delete ends it."""
    listed = [_sb("session", "ses_quiet", created_at=0), _sb("workflow", "wfx_gone", created_at=0)]
    now, grace = 10_000.0, 600.0
    kept = {p.sandbox.sandbox_id: p.verdict for p in plan_reap(listed, {}, now, grace, states_expire=True)}
    assert kept == {"ses_quiet": "keep", "wfx_gone": "reap"}
    orphan = {p.sandbox.sandbox_id: p.verdict for p in plan_reap(listed, {}, now, grace)}
    assert orphan == {"ses_quiet": "reap", "wfx_gone": "reap"}


# --- the disk store's retention check: where its index read starts (issue 45) ------------------


def _disk(tmp: Path) -> RocksDBStore:
    store = RocksDBStore("state", retention_s=100.0, directory=tmp)
    store.adopt([0])
    return store


def _done(key: str, at: int) -> state_pb2.ExecutionState:
    return _state(key, phase=common_pb2.EXECUTION_COMPLETED, at=at)


def test_the_disk_stores_check_starts_past_the_index_entries_of_states_already_removed(
    tmp_path: Path,
) -> None:
    """Removed states' index entries stay in RocksDB as deleted entries until a compaction, and a
    read from the index's start walks them all (a backlog drained: 100k of them, 13 ms each second).
    The check starts at the earliest entry it saw last time: an entry put before that, behind the
    store's back, is not read (a read from the start would list it)."""
    store = _disk(tmp_path)
    store.apply(0, {f"done-{i:03d}": _done(f"done-{i:03d}", at=1_000 + i) for i in range(300)})
    drained: list[str] = []
    while due := store.due(2_000.0, limit=100):
        drained += due[0]
        store.apply(0, dict.fromkeys(due[0]))
    assert drained == [f"done-{i:03d}" for i in range(300)]
    store.apply(0, {"later": _done("later", at=5_000)})
    assert store.due(2_000.0, limit=10) == {}
    ghost = b"d" + struct.pack(">Q", 1_050_000) + b"ghost"  # earlier than anything the store holds
    store._parts[0].db.put(ghost, b"")
    assert store.due(6_000.0, limit=10) == {0: ["later"]}


def test_the_disk_stores_check_starts_past_removed_entries_of_the_same_millisecond(tmp_path: Path) -> None:
    """Many states fall due in the same millisecond (a burst's executions ended together): the check
    starts at the earliest live entry's key, not only its time."""
    store = _disk(tmp_path)
    store.apply(0, {f"done-{i:03d}": _done(f"done-{i:03d}", at=1_000) for i in range(300)})
    first = store.due(2_000.0, limit=100)[0]
    store.apply(0, dict.fromkeys(first))
    assert store.due(2_000.0, limit=1) == {0: ["done-100"]}
    ghost = b"d" + struct.pack(">Q", 1_100_000) + b"done-050x"  # same time, among the removed keys
    store._parts[0].db.put(ghost, b"")
    assert store.due(2_000.0, limit=1) == {0: ["done-100"]}


def test_a_state_due_earlier_than_where_the_check_starts_is_still_listed(tmp_path: Path) -> None:
    """A finished state whose last input is older than every due one (a late, old event) moves the
    check's start back: it is listed, and so is everything after it."""
    store = _disk(tmp_path)
    store.put(0, "first", _done("first", at=1_000))
    assert store.due(1_500.0, limit=10) == {0: ["first"]}
    store.delete(0, "first")
    assert store.due(1_500.0, limit=10) == {}  # nothing due: the start moves up to now
    store.put(0, "old", _done("old", at=200))
    store.put(0, "newer", _done("newer", at=1_300))
    assert store.due(1_500.0, limit=10) == {0: ["old", "newer"]}
    # Reopened, the store reads its index from the start again.
    store.close()
    again = _disk(tmp_path)
    assert again.due(1_500.0, limit=10) == {0: ["old", "newer"]}


def test_the_disk_stores_index_read_ends_at_the_index_not_at_the_next_live_key(tmp_path: Path) -> None:
    """Past the due-time index lie the removable times (``r``), deleted with their states: an
    iterator that leaves the index without a bound walks every one of them to reach the next live
    key. The store's reads are bounded to their prefix: they end where it ends."""
    from rocksdict import Options, Rdict

    from consumers.runtime.state.rocksdb_partition import within

    db = Rdict(str(tmp_path / "db"), Options(raw_mode=True))
    try:
        db.put(b"d" + struct.pack(">Q", 1) + b"k", b"")
        db.put(b"s" + b"k", b"state")
        for bounded, after_the_index in ((False, b"sk"), (True, None)):
            it = db.iter(within(b"d")) if bounded else db.iter()
            it.seek(b"d")
            it.next()  # one past the index's only entry
            assert (it.key() if it.valid() else None) == after_the_index
            del it
        it = db.iter(within(b"s"))
        it.seek(b"s")
        assert it.valid() and it.key() == b"sk"
        del it
    finally:
        db.close()
