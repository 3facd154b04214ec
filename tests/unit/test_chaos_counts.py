"""The chaos run's counts fail when they are zero or non-zero where they must not be (issue 29 item 5),
checked without a broker: the reaper's exit, failures and removals; the duplicate filter's account
from the pods' logs; and same-id outcome copies that differ."""

from __future__ import annotations

from pathlib import Path

from drivers.contract import ManagedSandbox
from events.sandbox_lanes.v1 import common_pb2, outcomes_pb2
from tests.support.chaos import duplicates_ignored, reaper_problems
from tests.support.chaos_verify import Outcome, observed_results
from tests.support.chaos_workload import generate

LEAKED = [ManagedSandbox("workflow", "wfx_1", "sbx-wfx-000000000000", "running")]
SUMMARY = "3 managed sandboxes, 9 execution states; {c} to reap, {r} removed, {f} failed — applied\n"


def test_the_reaper_must_exit_0_fail_nothing_and_remove_the_leaked_runners() -> None:
    figures: dict[str, int] = {}
    assert reaper_problems(0, SUMMARY.format(c=1, r=1, f=0), LEAKED, figures) == []
    assert figures == {"reaper candidates": 1, "reaper removed": 1}
    assert reaper_problems(1, SUMMARY.format(c=1, r=1, f=0), LEAKED, {}) == [
        "`sandbox-lanes reap --apply` exited 1"
    ]
    assert reaper_problems(0, SUMMARY.format(c=1, r=0, f=1), LEAKED, {}) == [
        "the reaper failed 1 removals",
        "1 terminal workflows' runners leaked, the reaper removed none",
    ]
    assert reaper_problems(0, SUMMARY.format(c=0, r=0, f=0), [], {}) == []  # nothing leaked, nothing to do
    (problem,) = reaper_problems(0, "Traceback ...", LEAKED, {})
    assert problem.startswith("the reaper printed no summary")


def _log(path: Path, event_ids: list[str]) -> None:
    path.write_text(
        "".join(
            f'{{"ts": "t", "level": "info", "logger": "sandbox_lanes.pod", "msg": "duplicate input ignored", '
            f'"executionId": "x", "eventId": "{e}"}}\n'
            for e in event_ids
        )
    )


def test_every_injected_duplicate_must_be_ignored_and_under_exactly_once_nothing_else(tmp_path: Path) -> None:
    workload = generate(150, 3)
    injected = sorted({p.event.meta.event_id for p in workload.plan if p.why == "duplicate"})
    assert injected
    _log(tmp_path / "pod-a-1.log", injected[: len(injected) // 2])
    _log(tmp_path / "pod-a-2.log", injected[len(injected) // 2 :])
    for guarantee in ("exactly_once", "at_least_once"):
        problems, figures = duplicates_ignored(tmp_path, workload, guarantee)
        assert problems == [] and figures["injected duplicates ignored"] == len(injected)
    # One injected duplicate went through: a violation under both guarantees.
    _log(tmp_path / "pod-a-2.log", injected[len(injected) // 2 : -1])
    problems, _ = duplicates_ignored(tmp_path, workload, "at_least_once")
    assert problems == [f"injected duplicate {injected[-1]} was not ignored"]
    # An input ignored that was never sent twice: a redelivery (at_least_once) or a violation.
    _log(tmp_path / "pod-b-1.log", [injected[-1], "chaos-other-1"])
    problems, figures = duplicates_ignored(tmp_path, workload, "at_least_once")
    assert problems == [] and figures["inputs redelivered after a kill and ignored"] == 1
    problems, _ = duplicates_ignored(tmp_path, workload, "exactly_once")
    assert problems == ["input chaos-other-1 ignored as a duplicate, never injected twice"]
    # No duplicate injected at all: the filter went unexercised, which must not pass.
    problems, _ = duplicates_ignored(tmp_path, generate(150, 3, duplicate_share=0.0), "exactly_once")
    assert "no duplicate injected: the duplicate filter went unexercised" in problems


def test_driver_results_come_from_the_outcomes_and_differing_reruns_are_flagged() -> None:
    def failed(cause: str, reason: str) -> Outcome:
        message = outcomes_pb2.SandboxFailed(execution_id="axr_1", reason=reason)
        message.sandbox.scope = common_pb2.SANDBOX_SCOPE_SESSION
        return Outcome("id-" + reason, cause, message)

    ok = Outcome("id-ok", "c1", outcomes_pb2.SandboxProvisioned(execution_id="axr_1"))
    down = Outcome("id-down", "d1", outcomes_pb2.SandboxTeardownFailed(execution_id="wfx_1", reason="stuck"))
    results, ambiguous = observed_results([ok, failed("c2", "quota"), down])
    assert results == {
        ("c1", "Ensure"): (True, ""),
        ("c2", "Ensure"): (False, "quota"),
        ("d1", "Deprovision"): (False, "stuck"),
    }
    assert ambiguous == set()
    results, ambiguous = observed_results([ok, failed("c1", "quota")])  # one call, two different results
    assert ("c1", "Ensure") not in results and ambiguous == {"axr_1"}


def test_the_figures_line_the_chaos_tests_read_parses_back(tmp_path: Path) -> None:
    """Every count the chaos tests assert on survives print_result -> _figures (names may hold commas
    only at their peril: this is where one did)."""
    from tests.chaos.test_chaos import _figures
    from tests.support.chaos import RunResult, print_result
    from tests.support.chaos_verify import Verdict

    workload = generate(150, 3)
    _, dup_figures = duplicates_ignored(tmp_path, workload, "at_least_once")
    reap_figures: dict[str, int] = {}
    reaper_problems(0, SUMMARY.format(c=2, r=2, f=0), LEAKED, reap_figures)
    figures: dict[str, float | int | str] = {
        "guarantee": "at_least_once",
        "kills": 2,
        "broker restarts": 1,
        "duplicates injected": 68,
        "recovers": 33,
        "stale": 32,
        "same-id redeliveries": 0,
        "leaked before the reaper": 2,
        "executions with re-run driver calls that came out differently": 0,
        **dup_figures,
        **reap_figures,
        "violations": 0,
        "elapsed s": 35.2,
    }
    lines: list[str] = []
    print_result(RunResult("at_least_once", Verdict(), figures), lines.append)
    assert _figures(lines) == {k: v for k, v in figures.items() if isinstance(v, int)}
