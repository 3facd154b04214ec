"""Audit replay: re-derive every decision from the input topics and compare with what was recorded.

``sandbox-lanes replay --from-beginning | --from-offset N | --from-time T [--report FILE]``

How it works:

1. Snapshot the end offsets of the input topics and read them from the beginning
   (``read_committed`` under exactly-once), then read the outcome topic, the
   dead-letter topic and the compacted state topic as recorded.
2. Re-run the pure rules (:class:`consumers.processor.LaneProcessor` over
   :func:`consumers.rules.decide` / :func:`~consumers.rules.complete`) over the
   inputs in per-partition order (within a partition, by record timestamp, then
   topic, then offset), decoding each record exactly as the pod does.
3. Driver commands are answered by :class:`RecordedRunner` with the RECORDED
   result: the outcome with the command's deterministic event id (uuid5 of the
   input event id + outcome type + scope). No driver is built, no sandbox is
   touched; the state evolves exactly as it did in the pod (the session lane's
   ``status.error`` pre-stamp included).
4. Compare. A divergence is: a decision with no recorded outcome
   (``missing_outcome``); a recorded outcome with no decision
   (``unexpected_outcome``); a differing field (``field_mismatch``, outcome
   messages compared without ``meta.source``); two recorded outcomes with one id
   but different content (``conflicting_outcome``) or, under exactly-once, the
   same outcome twice (``duplicate_outcome``); an input dead-lettered by one side
   only or for another reason (``missing_dead_letter``, ``unexpected_dead_letter``,
   ``dead_letter_mismatch``, matched by source topic/partition/offset); a final
   execution state that differs from the compacted state topic (``state_mismatch``,
   ``unexpected_state``).

State is always re-derived from the beginning of the retained input; ``--from-offset``
and ``--from-time`` only narrow which decisions are compared. ``SandboxReaped`` outcomes
are the reaper's, not a decision of the inputs: they are counted, never compared.
Replay an idle pipeline for an exact answer: a running pod may record outcomes for
inputs newer than the snapshot (those are counted as ``after snapshot``, not diverged).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from google.protobuf import json_format
from google.protobuf.message import Message

from consumers.executor import CommandRunner
from consumers.processor import LaneProcessor
from consumers.progress import progress
from consumers.reaper import partitions_of
from consumers.rules import Command, CommandResult, Ensure, LaneConfig, StateView
from consumers.settings import Settings
from consumers.topic_reader import read_to_end
from consumers.topology import Topics
from events.codec import (
    OUTCOME_TYPES,
    DecodeError,
    InputEvent,
    decode,
    decode_input,
    decode_state,
    derived_event_id,
    header,
    record_key,
    type_name,
)
from events.sandbox_lanes.v1 import outcomes_pb2, state_pb2

logger = logging.getLogger("sandbox_lanes.replay")

_REAPED = type_name(outcomes_pb2.SandboxReaped())


# --- reading the topics --------------------------------------------------------------------------


async def read_topics(
    bootstrap: str,
    topics: Iterable[str],
    *,
    isolation_level: str = "read_committed",
    timeout_s: float = 300.0,
) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
    """Every record of ``topics`` from the beginning up to their end offsets as reading starts."""
    names = list(topics)
    known = await partitions_of(bootstrap, names)
    tps = [TopicPartition(t, p) for t in names for p in known.get(t, [])]
    out: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {tp: [] for tp in tps}
    async for tp, recs in read_to_end(bootstrap, tps, isolation_level=isolation_level, timeout_s=timeout_s):
        out[tp].extend(recs)
    return out


def merged_inputs(
    records: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]], topics: Topics
) -> list[ConsumerRecord[bytes, bytes]]:
    """Per-partition order: a key's records always share a partition; within it, by time, topic, offset."""
    rank = {name: i for i, name in enumerate(topics.inputs)}
    flat = [r for recs in records.values() for r in recs]
    return sorted(flat, key=lambda r: (r.partition, r.timestamp, rank.get(r.topic, 99), r.offset))


# --- the recorded runner -------------------------------------------------------------------------


@dataclass
class RecordedOutcome:
    message: Message
    topic: str
    partition: int
    offset: int
    timestamp: int


_ENSURE_KINDS = ("SandboxProvisioned", "SandboxFailed")
_DEPROVISION_KINDS = ("SandboxDeprovisioned", "SandboxTeardownFailed")


class RecordedRunner(CommandRunner):
    """Answers each command with the result the pod recorded for it; never calls a driver."""

    def __init__(self, recorded: Mapping[str, list[RecordedOutcome]]) -> None:
        self._recorded = recorded
        self._event: InputEvent | None = None
        self.unanswered: list[Command] = []

    def bind(self, event: InputEvent) -> None:
        self._event = event

    def lookup(self, command: Command) -> RecordedOutcome | None:
        assert self._event is not None, "bind(event) before run(command)"
        kinds = _ENSURE_KINDS if isinstance(command, Ensure) else _DEPROVISION_KINDS
        found = [
            recs[0]
            for kind in kinds
            if (recs := self._recorded.get(derived_event_id(self._event.meta.event_id, kind, command.scope)))
        ]
        # Both kinds recorded (an at-least-once re-run whose retry went the other way): the later wins.
        return max(found, key=lambda r: (r.partition, r.offset)) if found else None

    async def run(self, command: Command) -> CommandResult:
        rec = self.lookup(command)
        if rec is None:
            self.unanswered.append(command)
            return CommandResult(ok=True)  # reported as missing_outcome when its output finds no record
        msg = rec.message
        if isinstance(msg, outcomes_pb2.SandboxProvisioned):
            return CommandResult(ok=True, probe_state=msg.probe_state, token_minted=msg.token_minted)
        if isinstance(msg, outcomes_pb2.SandboxFailed | outcomes_pb2.SandboxTeardownFailed):
            return CommandResult(ok=False, error=msg.reason)
        return CommandResult(ok=True)


# --- comparing -----------------------------------------------------------------------------------


def _flat(message: Message) -> dict[str, Any]:
    data = json_format.MessageToDict(message, preserving_proto_field_name=True)
    flat: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        else:
            flat[path] = value

    walk(data, "")
    return flat


def field_diff(derived: Message, recorded: Message) -> dict[str, dict[str, Any]]:
    """``{field path: {derived, recorded}}`` of two messages (``meta.source`` excluded)."""
    a, b = _flat(derived), _flat(recorded)
    a.pop("meta.source", None)
    b.pop("meta.source", None)
    if type(derived) is not type(recorded):
        a["@type"], b["@type"] = type(derived).__name__, type(recorded).__name__
    return {
        k: {"derived": a.get(k), "recorded": b.get(k)}
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    }


@dataclass
class Divergence:
    kind: str
    detail: str
    event_id: str = ""
    causation_id: str = ""
    key: str = ""
    type: str = ""
    source: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in ("", {}, None)}


@dataclass
class ReplayReport:
    inputs: int = 0
    in_window: int = 0
    decisions: int = 0
    duplicates_ignored: int = 0
    derived_outcomes: int = 0
    recorded_outcomes: int = 0
    matched_outcomes: int = 0
    reaper_events: int = 0
    redelivered_outcomes: int = 0
    after_snapshot: int = 0
    derived_dead_letters: int = 0
    recorded_dead_letters: int = 0
    matched_dead_letters: int = 0
    states_compared: int = 0
    states_matched: int = 0
    window: str = "beginning"
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        return bool(self.divergences)

    def as_dict(self) -> dict[str, Any]:
        summary = {k: v for k, v in self.__dict__.items() if k != "divergences"}
        by_kind: dict[str, int] = {}
        for d in self.divergences:
            by_kind[d.kind] = by_kind.get(d.kind, 0) + 1
        summary["divergences"] = len(self.divergences)
        summary["divergences_by_kind"] = by_kind
        return {"summary": summary, "divergences": [d.as_dict() for d in self.divergences]}


@dataclass(frozen=True)
class Window:
    from_offset: int | None = None
    from_time_ms: int | None = None

    def contains(self, rec: ConsumerRecord[bytes, bytes]) -> bool:
        if self.from_offset is not None and rec.offset < self.from_offset:
            return False
        return not (self.from_time_ms is not None and rec.timestamp < self.from_time_ms)

    def describe(self) -> str:
        if self.from_offset is not None:
            return f"offset {self.from_offset}"
        if self.from_time_ms is not None:
            return dt.datetime.fromtimestamp(self.from_time_ms / 1000, dt.UTC).isoformat()
        return "beginning"


def _strip(message: Message) -> Message:
    copy = type(message)()
    copy.CopyFrom(message)
    meta = getattr(copy, "meta", None)
    if meta is not None:
        meta.ClearField("source")
    return copy


def _src(rec: ConsumerRecord[bytes, bytes]) -> dict[str, Any]:
    return {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset}


# --- the replay ----------------------------------------------------------------------------------


async def replay(
    bootstrap: str,
    topics: Topics,
    lane: LaneConfig,
    *,
    guarantee: str = "exactly_once",
    window: Window | None = None,
    show_progress: bool | None = None,
) -> ReplayReport:
    window = window or Window()
    isolation = "read_committed" if guarantee == "exactly_once" else "read_uncommitted"
    snapshot_ms = int(time.time() * 1000)
    inputs_by_tp = await read_topics(bootstrap, topics.inputs, isolation_level=isolation)
    outcome_recs = await read_topics(bootstrap, [topics.outcomes], isolation_level=isolation)
    dlq_recs = await read_topics(bootstrap, [topics.dead_letter], isolation_level=isolation)
    state_recs = await read_topics(bootstrap, [topics.state], isolation_level=isolation)
    report = ReplayReport(window=window.describe())

    # Recorded outcomes by id (in topic order).
    recorded: dict[str, list[RecordedOutcome]] = {}
    for recs in outcome_recs.values():
        for rec in recs:
            try:
                message = decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
            except DecodeError as exc:
                report.divergences.append(
                    Divergence(
                        "unexpected_outcome",
                        f"recorded outcome does not decode: {exc.reason}",
                        source=_src(rec),
                    )
                )
                continue
            if type_name(message) == _REAPED:
                report.reaper_events += 1
                continue
            report.recorded_outcomes += 1
            event_id: str = getattr(message, "meta").event_id  # noqa: B009
            recorded.setdefault(event_id, []).append(
                RecordedOutcome(message, rec.topic, rec.partition, rec.offset, rec.timestamp)
            )
    recorded_dlq: dict[tuple[str, int, int], tuple[str, ConsumerRecord[bytes, bytes]]] = {}
    for recs in dlq_recs.values():
        for rec in recs:
            try:
                where = (
                    header(rec.headers, "dlq_source_topic") or "",
                    int(header(rec.headers, "dlq_source_partition") or -1),
                    int(header(rec.headers, "dlq_source_offset") or -1),
                )
            except ValueError:
                where = ("", -1, rec.offset)
            recorded_dlq[where] = (header(rec.headers, "dlq_reason") or "", rec)
    recorded_states: dict[str, state_pb2.ExecutionState | None] = {}
    for recs in state_recs.values():
        for rec in recs:
            key = rec.key.decode("utf-8", errors="replace") if rec.key else ""
            recorded_states[key] = decode_state(rec.value) if rec.value is not None else None

    runner = RecordedRunner(recorded)
    quiet = logging.getLogger("sandbox_lanes.replay.rules")
    quiet.propagate = False
    quiet.addHandler(logging.NullHandler())
    processor = LaneProcessor(lane, runner, quiet)
    states: dict[str, state_pb2.ExecutionState] = {}
    touched: set[str] = set()
    derived_dlq: dict[tuple[str, int, int], str] = {}
    silent_outputs: set[str] = set()
    window_outputs: set[str] = set()
    window_inputs: set[str] = set()
    all_inputs: set[str] = set()
    ordered = merged_inputs(inputs_by_tp, topics)
    report.inputs = len(ordered)

    with progress("replay", total=len(ordered), enabled=show_progress) as bar:
        for rec in ordered:
            bar.advance()
            compare = window.contains(rec)
            report.in_window += int(compare)
            where = (rec.topic, rec.partition, rec.offset)
            try:
                event = decode_input(rec.key, rec.value, rec.headers)
            except DecodeError as exc:
                if compare:
                    derived_dlq[where] = exc.reason
                continue
            all_inputs.add(event.meta.event_id)
            if compare:
                window_inputs.add(event.meta.event_id)
            key = record_key(event)
            runner.bind(event)
            try:
                processed = await processor.process(event, StateView(states.get(key)))
            except Exception as exc:  # as the pod: park the record
                if compare:
                    derived_dlq[where] = f"internal error: {exc!r}"
                continue
            decision = processed.decision
            if decision.reject is not None:
                if compare:
                    derived_dlq[where] = decision.reject
                continue
            if decision.duplicate:
                report.duplicates_ignored += int(compare)
                continue
            outcome = processed.outcome
            if outcome is None or outcome.state is None:
                continue
            states[key] = outcome.state
            if not compare:
                silent_outputs.update(o.meta.event_id for o in outcome.outputs)
                continue
            touched.add(key)
            report.decisions += 1
            for output in outcome.outputs:
                report.derived_outcomes += 1
                _compare_output(output, recorded, report, rec, key, guarantee)
                window_outputs.add(output.meta.event_id)

    for event_id, recs in recorded.items():
        if event_id in window_outputs or event_id in silent_outputs:
            continue
        first = recs[0]
        causation = getattr(first.message, "meta").causation_id  # noqa: B009
        if causation in all_inputs and causation not in window_inputs:
            continue  # caused by an input before the window
        if causation not in all_inputs and first.timestamp > snapshot_ms:
            report.after_snapshot += 1
            continue
        for r in recs:
            report.divergences.append(
                Divergence(
                    "unexpected_outcome",
                    "recorded outcome with no decision"
                    + ("" if causation in all_inputs else f" (no input event has id {causation!r})"),
                    event_id=event_id,
                    causation_id=causation,
                    key=record_key(r.message),
                    type=type(r.message).__name__,
                    source={"topic": r.topic, "partition": r.partition, "offset": r.offset},
                )
            )

    _compare_dead_letters(derived_dlq, recorded_dlq, inputs_by_tp, window, report)
    _compare_states(states, touched, recorded_states, report)
    return report


def _compare_output(
    output: Message,
    recorded: Mapping[str, list[RecordedOutcome]],
    report: ReplayReport,
    rec: ConsumerRecord[bytes, bytes],
    key: str,
    guarantee: str,
) -> None:
    meta = getattr(output, "meta")  # noqa: B009
    common = {
        "event_id": meta.event_id,
        "causation_id": meta.causation_id,
        "key": record_key(output),
        "type": type(output).__name__,
        "source": _src(rec),
    }
    recs = recorded.get(meta.event_id)
    if not recs:
        report.divergences.append(
            Divergence("missing_outcome", "decision with no recorded outcome", **common)
        )
        return
    first = recs[0]
    diff = field_diff(_strip(output), _strip(first.message))
    if diff:
        report.divergences.append(
            Divergence("field_mismatch", f"{', '.join(diff)} differ", fields=diff, **common)
        )
    else:
        report.matched_outcomes += 1
    for again in recs[1:]:
        conflict = field_diff(_strip(first.message), _strip(again.message))
        where = {"topic": again.topic, "partition": again.partition, "offset": again.offset}
        if conflict:
            fields = {k: {"first": v["derived"], "again": v["recorded"]} for k, v in conflict.items()}
            report.divergences.append(
                Divergence(
                    "conflicting_outcome",
                    f"two recorded outcomes with one id differ in {', '.join(conflict)}",
                    fields=fields,
                    **{**common, "source": where},
                )
            )
        elif guarantee == "exactly_once":
            report.divergences.append(
                Divergence(
                    "duplicate_outcome",
                    "outcome recorded twice under exactly_once",
                    **{**common, "source": where},
                )
            )
        else:
            report.redelivered_outcomes += 1


def _compare_dead_letters(
    derived: Mapping[tuple[str, int, int], str],
    recorded: Mapping[tuple[str, int, int], tuple[str, ConsumerRecord[bytes, bytes]]],
    inputs_by_tp: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]],
    window: Window,
    report: ReplayReport,
) -> None:
    report.derived_dead_letters = len(derived)
    in_window = {
        (r.topic, r.partition, r.offset) for recs in inputs_by_tp.values() for r in recs if window.contains(r)
    }
    seen = {(r.topic, r.partition, r.offset) for recs in inputs_by_tp.values() for r in recs}
    for where, (reason, dl) in recorded.items():
        if where in seen and where not in in_window:
            continue
        report.recorded_dead_letters += 1
        source = {"topic": where[0], "partition": where[1], "offset": where[2]}
        mine = derived.get(where)
        if mine is None:
            report.divergences.append(
                Divergence(
                    "unexpected_dead_letter",
                    f"recorded dead letter ({reason}) for an input replay applies"
                    if where in seen
                    else f"recorded dead letter ({reason}) for no input record in the snapshot",
                    source=source,
                    fields={"dlq_reason": {"derived": None, "recorded": reason}},
                    key=dl.key.decode("utf-8", errors="replace") if dl.key else "",
                )
            )
        elif mine != reason:
            report.divergences.append(
                Divergence(
                    "dead_letter_mismatch",
                    "dead-letter reasons differ",
                    source=source,
                    fields={"dlq_reason": {"derived": mine, "recorded": reason}},
                )
            )
        else:
            report.matched_dead_letters += 1
    for where, reason in derived.items():
        if where not in recorded:
            report.divergences.append(
                Divergence(
                    "missing_dead_letter",
                    f"replay dead-letters this input ({reason}); nothing recorded",
                    source={"topic": where[0], "partition": where[1], "offset": where[2]},
                    fields={"dlq_reason": {"derived": reason, "recorded": None}},
                )
            )


def _compare_states(
    derived: Mapping[str, state_pb2.ExecutionState],
    touched: set[str],
    recorded: Mapping[str, state_pb2.ExecutionState | None],
    report: ReplayReport,
) -> None:
    for key in sorted(touched):
        report.states_compared += 1
        mine = derived[key]
        theirs = recorded.get(key)
        if theirs is None:
            report.divergences.append(
                Divergence(
                    "state_mismatch", "no recorded state for an execution replay applied events to", key=key
                )
            )
            continue
        diff = field_diff(mine, theirs)
        if diff:
            report.divergences.append(
                Divergence(
                    "state_mismatch", f"final state differs in {', '.join(diff)}", key=key, fields=diff
                )
            )
        else:
            report.states_matched += 1
    for key, state in recorded.items():
        if state is not None and key not in derived:
            report.divergences.append(
                Divergence("unexpected_state", "recorded state for an execution no input produced", key=key)
            )


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
    if by_kind:
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(by_kind.items()))
        lines.append(f"DIVERGED: {len(report.divergences)} divergences ({kinds})")
    else:
        lines.append("no divergence: every recorded decision re-derives exactly")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from consumers.logs import setup_logging
    from consumers.settings import load_settings

    settings = load_settings()
    setup_logging(getattr(args, "log_level", "warning"))
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
