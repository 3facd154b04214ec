"""State retention without a broker: the rule, the store's schedule, and what the reaper keeps.

Expectations are literal, from issue 25's rule: a state may go once it is finished (a terminal
phase, a refused create, or a deleted session's record, with nothing pending) and the retention
has passed since its last input's ``occurred_at``.
"""

from __future__ import annotations

import pytest

from consumers.lanes.reap import plan_reap
from consumers.lanes.retention import finished, removable_from
from consumers.runtime.state.store import StateStore
from events.sandbox_lanes.v1 import common_pb2, state_pb2
from tests.integration.test_reaper import _sb, _state

DAY = 86_400.0


def _pending(state: state_pb2.ExecutionState) -> state_pb2.ExecutionState:
    entry = state.pending.add()
    entry.effect_id = "c1"
    entry.op = state_pb2.EFFECT_OP_DEPROVISION
    return state


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        (common_pb2.EXECUTION_PHASE_UNSPECIFIED, False),
        (common_pb2.EXECUTION_PENDING, False),
        (common_pb2.EXECUTION_IN_PROGRESS, False),
        (common_pb2.EXECUTION_PAUSED, False),
        (common_pb2.EXECUTION_COMPLETED, True),
        (common_pb2.EXECUTION_FAILED, True),
        (common_pb2.EXECUTION_CANCELLED, True),
        (common_pb2.EXECUTION_TERMINATED, True),
    ],
)
def test_only_a_terminal_phase_with_nothing_pending_is_finished(phase: int, expected: bool) -> None:
    state = _state("wf", phase=phase)
    assert finished(state) is expected
    assert finished(_pending(state)) is False  # a teardown in flight keeps any state


def test_refused_creates_and_deleted_sessions_are_finished() -> None:
    refused = _state("wf", phase=common_pb2.EXECUTION_PENDING)
    refused.refused = True
    session = state_pb2.ExecutionState(execution_id="ses_1", session_deleted=True)
    live_session = state_pb2.ExecutionState(execution_id="ses_2")
    assert (finished(refused), finished(session), finished(live_session)) == (True, True, False)


def test_removable_from_counts_from_the_last_input() -> None:
    done = _state("wf", phase=common_pb2.EXECUTION_COMPLETED, at=1_000)
    done.updated_at.nanos = 500_000_000
    assert removable_from(done, 7 * DAY, seen_at=5.0) == 1_000.5 + 7 * DAY
    assert removable_from(done, 0, seen_at=5.0) is None  # 0 keeps every state
    assert removable_from(_state("wf", phase=common_pb2.EXECUTION_IN_PROGRESS), DAY, seen_at=5.0) is None
    no_clock = state_pb2.ExecutionState(execution_id="ses", session_deleted=True)
    assert removable_from(no_clock, 60.0, seen_at=5.0) == 65.0  # from when the pod saw it


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
