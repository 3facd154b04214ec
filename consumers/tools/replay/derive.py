"""Re-deriving the decisions: read the topics as recorded, run the pure rules over the inputs with the
recorded driver results, hand the derived outputs to the comparison.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Mapping

from aiokafka import ConsumerRecord, TopicPartition

from consumers.lanes.commands import Command, CommandResult, Ensure, LaneConfig, StateView
from consumers.lanes.retention import finished
from consumers.ops.progress import progress
from consumers.ops.reaper import partitions_of
from consumers.runtime.dead_letters import AHEAD_OF_POD_CLOCK
from consumers.runtime.executor import CommandRunner
from consumers.runtime.kafka.codecs import require_codecs
from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.topic_reader import read_to_end
from consumers.runtime.kafka.topology import Topics
from consumers.runtime.processor import LaneProcessor
from consumers.tools.replay.compare import (
    Divergence,
    RecordedOutcome,
    ReplayReport,
    Window,
    compare_dead_letters,
    compare_output,
    compare_states,
    source_of,
)
from events.codec import (
    OUTCOME_TYPES,
    DecodeError,
    InputEvent,
    decode,
    decode_input,
    decode_state,
    derived_event_id,
    header,
    state_key,
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
    security: KafkaSecurity = PLAINTEXT,
) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
    """Every record of ``topics`` from the beginning up to their end offsets as reading starts."""
    names = list(topics)
    known = await partitions_of(bootstrap, names, security=security)
    tps = [TopicPartition(t, p) for t in names for p in known.get(t, [])]
    out: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {tp: [] for tp in tps}
    async for tp, recs in read_to_end(
        bootstrap, tps, isolation_level=isolation_level, timeout_s=timeout_s, security=security
    ):
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


# --- the replay ----------------------------------------------------------------------------------

#: The reasons the runtime (not the rules) gives a dead letter.
_RUNTIME_REASONS = ("the Kafka client cannot parse the record", "its transaction failed ", AHEAD_OF_POD_CLOCK)


def runtime_dead_letter(reason: str) -> str:
    """``reason`` when the runtime dead-lettered the record for what it is, else ""."""
    return reason if reason.startswith(_RUNTIME_REASONS) else ""


async def replay(
    bootstrap: str,
    topics: Topics,
    lane: LaneConfig,
    *,
    guarantee: str = "exactly_once",
    window: Window | None = None,
    show_progress: bool | None = None,
    security: KafkaSecurity = PLAINTEXT,
    max_clock_ahead_s: float | None = None,
) -> ReplayReport:
    """Re-run the rules over the recorded inputs and compare (``max_clock_ahead_s``: the pod's
    ``SANDBOX_LANES_MAX_CLOCK_AHEAD_S``, so inputs from the future are refused as it refused them)."""
    require_codecs()  # a codec it cannot read is an error naming it, not a divergence
    window = window or Window()
    isolation = "read_committed" if guarantee == "exactly_once" else "read_uncommitted"
    snapshot_ms = int(time.time() * 1000)
    read = functools.partial(read_topics, bootstrap, isolation_level=isolation, security=security)
    inputs_by_tp = await read(topics.inputs)
    outcome_recs = await read([topics.outcomes])
    dlq_recs = await read([topics.dead_letter])
    state_recs = await read([topics.state])
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
                        source=source_of(rec),
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
    #: When each key's state was tombstoned (record timestamps, in topic order).
    tombstoned: dict[str, list[int]] = {}
    for recs in state_recs.values():
        for rec in recs:
            key = rec.key.decode("utf-8", errors="replace") if rec.key else ""
            recorded_states[key] = decode_state(rec.value) if rec.value is not None else None
            if rec.value is None:
                tombstoned.setdefault(key, []).append(rec.timestamp)

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
            runtime_reason = runtime_dead_letter(recorded_dlq.get(where, ("", None))[0])
            if runtime_reason:
                # Dead-lettered by the runtime, not the rules (the client could not parse it, or
                # its transaction failed the same way every attempt): nothing to derive.
                if compare:
                    derived_dlq[where] = runtime_reason
                continue
            try:
                event = decode_input(
                    rec.key,
                    rec.value,
                    rec.headers,
                    record_time_ms=rec.timestamp,
                    max_ahead_s=max_clock_ahead_s,
                    topic_carries=topics.carries(rec.topic),
                )
            except DecodeError as exc:
                if compare:
                    derived_dlq[where] = exc.reason
                continue
            all_inputs.add(event.meta.event_id)
            if compare:
                window_inputs.add(event.meta.event_id)
            key = state_key(event)
            removed = tombstoned.get(key)
            while removed and removed[0] <= rec.timestamp:
                removed.pop(0)
                if key in states and finished(states[key]):
                    del states[key]  # its retention passed before this input: a new execution
            runner.bind(event)
            try:
                processed = await processor.process(event, StateView(states.get(key), states.get))
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
                compare_output(output, recorded, report, rec, key, guarantee)
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
                    key=state_key(r.message),
                    type=type(r.message).__name__,
                    source={"topic": r.topic, "partition": r.partition, "offset": r.offset},
                )
            )

    compare_dead_letters(derived_dlq, recorded_dlq, inputs_by_tp, window, report)
    compare_states(states, touched, recorded_states, report)
    return report
