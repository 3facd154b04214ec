"""``sandbox-lanes replay``: arguments, the lane config from settings, the summary table, the exit code."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import sys
from pathlib import Path

from consumers.lanes.commands import LaneConfig
from consumers.ops.settings import Settings
from consumers.tools.replay.compare import ReplayReport, Window
from consumers.tools.replay.derive import replay

logger = logging.getLogger("sandbox_lanes.replay")


# --- the CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--from-beginning", action="store_true", help="compare every decision (the default)")
    start.add_argument(
        "--from-offset",
        type=int,
        metavar="N",
        help="compare decisions of records at offset >= N (every input partition)",
    )
    start.add_argument(
        "--from-time",
        type=_time_argument,
        metavar="TIME",
        help="compare decisions of records produced at or after TIME (ISO 8601, or epoch milliseconds)",
    )
    parser.add_argument("--report", metavar="FILE", help="write the JSON report of divergences to FILE")
    parser.add_argument("--bootstrap", help="override KAFKA_BOOTSTRAP_SERVERS")
    parser.add_argument(
        "--driver-name",
        help="the driver name the pod recorded in sandbox refs (default: SANDBOX_PROVISIONER_TYPE)",
    )
    parser.add_argument("--show", type=int, default=20, help="print at most this many divergences")
    parser.add_argument(
        "--with-current-config",
        action="store_true",
        help="re-derive every decision under this shell's configuration (the environment, or the global "
        "--config FILE) instead of the one each decision recorded; what that changes is config_changed",
    )


def _time_argument(text: str) -> str:
    """argparse's check of ``--from-time`` (kept as given; :func:`parse_time_ms` reads it)."""
    try:
        parse_time_ms(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time: give ISO 8601 (2026-05-01T12:00:00Z) or epoch milliseconds"
        ) from None
    return text


def parse_time_ms(text: str) -> int:
    if text.isdigit():
        return int(text)
    parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return int(parsed.timestamp() * 1000)


def lane_config(settings: Settings, driver_name: str | None = None) -> LaneConfig:
    """The pod's lane config from the settings alone: the driver is never built."""
    return LaneConfig(
        enabled=settings.provisioner_type != "",
        agent=settings.agent,
        workflow=settings.workflow,
        driver_name=driver_name or settings.provisioner_type,
        source=f"sandbox-lanes/{settings.pod_id}/replay",
        stamp_fingerprint=True,
        max_clock_ahead_s=settings.max_clock_ahead_s,
        state_retention_s=settings.state_retention_s,
        capacity=settings.topics.capacity_on,
    )


def summary_table(report: ReplayReport) -> str:
    by_kind: dict[str, int] = {}
    for d in report.divergences:
        by_kind[d.kind] = by_kind.get(d.kind, 0) + 1
    out_div = sum(v for k, v in by_kind.items() if "outcome" in k or k == "field_mismatch")
    dlq_div = sum(v for k, v in by_kind.items() if "dead_letter" in k)
    st_div = sum(v for k, v in by_kind.items() if "state" in k)
    rows = [
        ("", "derived", "recorded", "matched", "diverged"),
        ("outcomes", report.derived_outcomes, report.recorded_outcomes, report.matched_outcomes, out_div),
        (
            "dead letters",
            report.derived_dead_letters,
            report.recorded_dead_letters,
            report.matched_dead_letters,
            dlq_div,
        ),
        ("final states", report.states_compared, report.states_compared, report.states_matched, st_div),
    ]
    if report.capacity_records:
        cap_div = sum(v for k, v in by_kind.items() if "capacity" in k)
        rows.append(
            (
                "capacity",
                report.capacity_answers_derived,
                report.capacity_answers_recorded,
                report.capacity_answers_matched,
                cap_div,
            )
        )
    lines = [
        f"replay from {report.window}: {report.inputs} input records, {report.in_window} compared, "
        f"{report.decisions} decisions applied, {report.duplicates_ignored} duplicates ignored",
    ]
    lines += [f"  {a:<14}{b:>9}{c:>10}{d:>9}{e:>10}" for a, b, c, d, e in rows]
    extras = []
    if report.reaper_events:
        extras.append(f"{report.reaper_events} reaper events (not re-derived)")
    if report.redelivered_outcomes:
        extras.append(f"{report.redelivered_outcomes} identical redelivered outcomes")
    if report.after_snapshot:
        extras.append(f"{report.after_snapshot} outcomes newer than the input snapshot")
    if extras:
        lines.append("  " + "; ".join(extras))
    lines.append("  " + config_line(report))
    if by_kind:
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(by_kind.items()))
        lines.append(f"DIVERGED: {len(report.divergences)} divergences ({kinds})")
    else:
        lines.append("no divergence: every recorded decision re-derives exactly")
    return "\n".join(lines)


def config_line(report: ReplayReport) -> str:
    by_config = ", ".join(f"{fp}: {n}" for fp, n in sorted(report.decisions_by_config.items()))
    if report.config_mode == "recorded":
        head = f"configuration: as recorded ({report.configs_recorded} configuration records)"
    else:
        head = (
            f"configuration: this shell's, for every decision ({report.config_differs} inputs "
            "decided under another)"
        )
    notes = [f"decisions by fingerprint: {by_config or 'none'}"]
    if report.without_fingerprint:
        notes.append(
            f"{report.without_fingerprint} inputs recorded without a fingerprint (current configuration)"
        )
    if report.unknown_fingerprint:
        notes.append(
            f"{report.unknown_fingerprint} inputs whose fingerprint has no configuration record "
            "(current configuration)"
        )
    return head + "; " + "; ".join(notes)


def run(args: argparse.Namespace) -> int:
    from consumers.ops.logs import setup_logging
    from consumers.ops.settings import load_settings
    from events import schema_registry

    settings = load_settings()
    setup_logging(getattr(args, "log_level", "warning"))
    schema_registry.configure(settings.schema_registry_url)
    window = Window(
        from_offset=args.from_offset,
        from_time_ms=parse_time_ms(args.from_time) if args.from_time else None,
    )
    report = asyncio.run(
        replay(
            args.bootstrap or settings.bootstrap,
            settings.topics,
            lane_config(settings, args.driver_name),
            guarantee=settings.guarantee,
            window=window,
            max_clock_ahead_s=settings.max_clock_ahead_s,
            security=settings.kafka_security,
            use_recorded_config=not args.with_current_config,
        )
    )
    print(summary_table(report))
    for d in report.divergences[: max(0, args.show)]:
        print("  " + json.dumps(d.as_dict(), sort_keys=True))
    if len(report.divergences) > args.show:
        print(f"  … {len(report.divergences) - args.show} more (see --report)")
    if args.report:
        Path(args.report).write_text(json.dumps(report.as_dict(), indent=2, sort_keys=True) + "\n")
        print(f"report written to {args.report}", file=sys.stderr)
    return 1 if report.diverged else 0
