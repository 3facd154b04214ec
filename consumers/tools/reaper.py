"""``sandbox-lanes reap``: one reaper pass from the command line (dry run unless ``--apply``).

Lists the managed sandboxes through the configured driver, reads the whole state topic
read-only, and prints the plan of :func:`consumers.lanes.reap.plan_reap` (the rules are
there); with ``--apply`` it removes the candidates (:class:`consumers.ops.reaper.Reaper`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

from consumers.lanes.commands import LaneConfig
from consumers.ops.reaper import Reaper, ReapReport, ReapResult, isolation
from consumers.runtime.kafka.codecs import require_codecs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--apply", action="store_true", help="remove the candidates (default: dry run)")
    parser.add_argument(
        "--grace", type=float, default=None, help="override SANDBOX_LANES_REAP_GRACE_S (seconds)"
    )
    parser.add_argument("--bootstrap", help="override KAFKA_BOOTSTRAP_SERVERS")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON lines")


def _row(result: ReapResult) -> dict[str, object]:
    plan = result.plan
    return {
        "scope": plan.sandbox.scope,
        "sandbox_id": plan.sandbox.sandbox_id,
        "name": plan.sandbox.name,
        "state": plan.sandbox.state,
        "age_seconds": None if plan.age_seconds is None else round(plan.age_seconds, 1),
        "verdict": plan.verdict,
        "reason": plan.reason,
        "removed": result.removed,
        "error": result.error,
        "event_id": result.event_id,
    }


def run(args: argparse.Namespace) -> int:
    from consumers.ops.compose import build_provisioner
    from consumers.ops.logs import setup_logging
    from consumers.ops.settings import load_settings

    require_codecs()  # it reads the whole state topic: every codec a producer may use
    settings = load_settings()
    setup_logging(
        getattr(args, "log_level", "info"), secrets=[settings.raw.get("STIGMER_RUNNER_TOKEN_KEY", "")]
    )
    provisioner = build_provisioner(settings, logging.getLogger("sandbox_lanes"))
    if provisioner is None:
        print("sandbox-lanes reap: no driver configured (SANDBOX_PROVISIONER_TYPE is empty); nothing to reap")
        return 0
    lane = LaneConfig(
        enabled=True, driver_name=provisioner.driver_name, source=f"sandbox-lanes/{settings.pod_id}/reap"
    )
    reaper = Reaper(
        provisioner,
        args.bootstrap or settings.bootstrap,
        settings.topics,
        lane,
        grace_s=args.grace if args.grace is not None else settings.reap_grace_s,
        isolation_level=isolation(settings),
        teardown_timeout_s=settings.teardown_timeout_s,
        security=settings.kafka_security,
        states_expire=settings.state_retention_s > 0,
    )

    async def main() -> ReapReport:
        try:
            return await reaper.run_once(apply=args.apply)
        finally:
            await provisioner.close()

    report = asyncio.run(main())
    rows = [_row(r) for r in report.results]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"{'verdict':<7} {'scope':<8} {'name':<20} {'age':>8}  reason")
        for row in rows:
            age = "?" if row["age_seconds"] is None else f"{row['age_seconds']:.0f}s"
            mark = (
                row["verdict"]
                if not (row["removed"] or row["error"])
                else ("removed" if row["removed"] else "FAILED")
            )
            print(
                f"{mark:<7} {row['scope']:<8} {row['name']:<20} {age:>8}  "
                f"{row['reason']} ({row['sandbox_id']})"
            )
    mode = "applied" if report.applied else "dry run (use --apply to remove)"
    print(
        f"{len(rows)} managed sandboxes, {report.states} execution states; {report.candidates} to reap, "
        f"{report.removed} removed, {report.failed} failed — {mode}"
    )
    return 1 if report.failed else 0
