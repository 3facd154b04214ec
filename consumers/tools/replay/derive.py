"""Re-deriving the decisions: read the topics as recorded, run the pure rules over the inputs with the
recorded driver results, hand the derived outputs to the comparison.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from consumers.lanes.commands import (
    Command,
    CommandResult,
    Ensure,
    LaneConfig,
    StateView,
    changed_settings,
)
from consumers.lanes.retention import finished
from consumers.ops.progress import progress
from consumers.ops.reaper import partitions_of
from consumers.runtime.dead_letters import AHEAD_OF_POD_CLOCK, source_of_dead_letter
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
from consumers.tools.replay.ledger import compare_ledger
from events import schema_registry
from events.codec import (
    OUTCOME_TYPES,
    DecidedEvent,
    DecodeError,
    decode,
    decode_answer,
    decode_input,
    decode_lane_config,
    decode_state,
    derived_event_id,
    header,
    is_lane_config_key,
    lane_config_topic,
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
        self._event: DecidedEvent | None = None
        self.unanswered: list[Command] = []

    def bind(self, event: DecidedEvent) -> None:
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
    use_recorded_config: bool = True,
) -> ReplayReport:
    """Re-run the rules over the recorded inputs and compare (``max_clock_ahead_s``: the pod's
    ``SANDBOX_LANES_MAX_CLOCK_AHEAD_S``, so inputs from the future are refused as it refused them).

    Each decision is re-derived under the configuration its records name (their fingerprint and the
    configuration record on the state topic), ``lane`` only where none is recorded; with
    ``use_recorded_config=False`` every decision is re-derived under ``lane``, and what diverges
    because a decision was made under another configuration is ``config_changed``, naming the
    settings that differ."""
    require_codecs()  # a codec it cannot read is an error naming it, not a divergence
    window = window or Window()
    isolation = "read_committed" if guarantee == "exactly_once" else "read_uncommitted"
    snapshot_ms = int(time.time() * 1000)
    read = functools.partial(read_topics, bootstrap, isolation_level=isolation, security=security)
    inputs_by_tp = await read(topics.consumed)  # with a cap on, the ledger's answers too
    outcome_recs = await read([topics.outcomes])
    dlq_recs = await read([topics.dead_letter])
    state_recs = await read([topics.state])
    config_recs = await read_configs(read, topics)
    report = ReplayReport(
        window=window.describe(), config_mode="recorded" if use_recorded_config else "current"
    )
    #: Per input event id: the fingerprint on the records its decision wrote ("" = none on them).
    evidence: dict[str, str] = {}

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
            meta = getattr(message, "meta")  # noqa: B009
            evidence.setdefault(meta.causation_id, meta.config_fingerprint)
            event_id: str = meta.event_id
            recorded.setdefault(event_id, []).append(
                RecordedOutcome(message, rec.topic, rec.partition, rec.offset, rec.timestamp)
            )
    recorded_dlq: dict[tuple[str, int, int], tuple[str, ConsumerRecord[bytes, bytes]]] = {}
    for recs in dlq_recs.values():
        for rec in recs:
            where = source_of_dead_letter(rec.headers) or ("", -1, rec.offset)
            recorded_dlq[where] = (header(rec.headers, "dlq_reason") or "", rec)
    recorded_states: dict[str, state_pb2.ExecutionState | None] = {}
    #: When each key's state was tombstoned (record timestamps, in topic order).
    tombstoned: dict[str, list[int]] = {}
    configs = recorded_configs(config_recs, lane.source)
    state_evidence: dict[str, str] = {}
    for recs in state_recs.values():
        for rec in recs:
            key = rec.key.decode("utf-8", errors="replace") if rec.key else ""
            value = decode_state(rec.value) if rec.value is not None else None
            if is_lane_config_key(key):
                continue
            recorded_states[key] = value
            if value is None:
                tombstoned.setdefault(key, []).append(rec.timestamp)
            elif value.applied_event_ids:
                state_evidence.setdefault(value.applied_event_ids[-1], value.config_fingerprint)
    for event_id, fingerprint in state_evidence.items():
        if not evidence.get(event_id):
            evidence[event_id] = fingerprint
    report.configs_recorded = len(configs)

    runner = RecordedRunner(recorded)
    quiet = logging.getLogger("sandbox_lanes.replay.rules")
    quiet.propagate = False
    quiet.addHandler(logging.NullHandler())
    processors: dict[str, LaneProcessor] = {}
    states: dict[str, state_pb2.ExecutionState] = {}
    touched: set[str] = set()
    derived_dlq: dict[tuple[str, int, int], str] = {}
    silent_outputs: set[str] = set()
    window_outputs: set[str] = set()
    window_inputs: set[str] = set()
    all_inputs: set[str] = set()
    ordered = merged_inputs(inputs_by_tp, topics)
    report.inputs = len(ordered)
    fingerprint_of = recorded_fingerprints(ordered, evidence)
    #: Per input event id (and per key), the settings that set its recorded configuration apart.
    changed: dict[str, dict[str, tuple[str, str]]] = {}
    changed_keys: dict[str, dict[str, tuple[str, str]]] = {}
    changed_where: dict[tuple[str, int, int], dict[str, tuple[str, str]]] = {}

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
            config, differs = _config_for(
                fingerprint_of.get(where, ""), configs, lane, use_recorded_config, report
            )
            if differs:
                changed_where[where] = differs
            await schema_registry.ensure(rec.value)
            event: DecidedEvent
            try:
                if rec.topic == topics.admissions and topics.capacity_on:
                    event = decode_answer(rec.key, rec.value, rec.headers)
                else:
                    event = decode_input(
                        rec.key,
                        rec.value,
                        rec.headers,
                        record_time_ms=rec.timestamp,
                        # The clock allowance the input was judged under (recorded with its configuration).
                        max_ahead_s=max_clock_ahead_s
                        if config.max_clock_ahead_s is None
                        else config.max_clock_ahead_s,
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
            if differs:
                changed[event.meta.event_id] = differs
                changed_keys.setdefault(key, {}).update(differs)
            processor = processors.get(config.fingerprint)
            if processor is None:
                processor = processors[config.fingerprint] = LaneProcessor(config, runner, quiet)
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
            by_config = report.decisions_by_config
            by_config[config.fingerprint] = by_config.get(config.fingerprint, 0) + 1
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

    if topics.capacity_on:  # every admission re-derived from the capacity log alone
        compare_ledger(await read([topics.capacity]), await read([topics.admissions]), report)
    compare_dead_letters(derived_dlq, recorded_dlq, inputs_by_tp, window, report)
    compare_states(states, touched, recorded_states, report)
    report.config_differs = len(changed)
    _blame_configuration(report, changed, changed_keys, changed_where)
    return report


async def read_configs(
    read: Callable[[list[str]], Awaitable[dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]]],
    topics: Topics,
) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
    """The configuration topic's records; none where it is absent (a log from before issue 35) or
    this principal may not read it: each decision is then replayed under the current configuration,
    and the summary counts it."""
    name = lane_config_topic(topics.state)
    try:
        return await read([name])
    except KafkaError as exc:
        logger.warning("configuration records not read", extra={"topic": name, "error": repr(exc)[:300]})
        return {}


def recorded_configs(
    records: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]], source: str
) -> dict[str, LaneConfig]:
    """Every configuration recorded on the configuration topic, by fingerprint."""
    configs: dict[str, LaneConfig] = {}
    for recs in records.values():
        for rec in recs:
            applied = decode_lane_config(rec.value, rec.headers)
            if applied is not None:
                configs[applied.fingerprint] = LaneConfig.from_applied(applied, source=source)
    return configs


def recorded_fingerprints(
    ordered: list[ConsumerRecord[bytes, bytes]], evidence: Mapping[str, str]
) -> dict[tuple[str, int, int], str]:
    """The configuration fingerprint each input was decided under, by (topic, partition, offset).

    An input whose decision wrote a record (an outcome, a state not yet compacted away) has that
    record's fingerprint ("" on a record written before fingerprints). One that left none was
    decided by whoever owned its partition then: the fingerprint of the input before it on the same
    partition, or, with none before it, of the first one after it. The configuration changes only
    when a pod starts, so this errs only across a restart on a partition that left no record.
    """
    out: dict[tuple[str, int, int], str] = {}
    by_partition: dict[int, list[tuple[tuple[str, int, int], str | None]]] = {}
    for rec in ordered:
        event_id = header(rec.headers, "ce_id") or ""
        known = evidence.get(event_id) if event_id else None
        by_partition.setdefault(rec.partition, []).append(((rec.topic, rec.partition, rec.offset), known))
    for entries in by_partition.values():
        first = next((fp for _, fp in entries if fp), "")
        last: str | None = None
        for where, fp in entries:
            if fp is not None:
                last = fp
            out[where] = fp if fp is not None else (last if last is not None else first)
    return out


def _config_for(
    fingerprint: str,
    configs: Mapping[str, LaneConfig],
    current: LaneConfig,
    use_recorded: bool,
    report: ReplayReport,
) -> tuple[LaneConfig, dict[str, tuple[str, str]]]:
    """The configuration to re-derive one decision under, and the settings that set it apart from
    the recorded one (only when replaying under ``current``)."""
    if not fingerprint:
        report.without_fingerprint += 1
        return current, {}
    recorded = configs.get(fingerprint)
    if recorded is None:
        report.unknown_fingerprint += 1
        return current, {}
    if use_recorded:
        return recorded, {}
    if fingerprint == current.fingerprint:
        return current, {}
    return current, changed_settings(recorded.settings(), current.settings())


def _blame_configuration(
    report: ReplayReport,
    changed: Mapping[str, dict[str, tuple[str, str]]],
    changed_keys: Mapping[str, dict[str, tuple[str, str]]],
    changed_where: Mapping[tuple[str, int, int], dict[str, tuple[str, str]]],
) -> None:
    """A divergence of a decision made under another configuration is ``config_changed``."""
    for d in report.divergences:
        settings = changed.get(d.causation_id)
        if settings is None and d.kind in ("state_mismatch", "unexpected_state"):
            settings = changed_keys.get(d.key)
        if settings is None and "dead_letter" in d.kind and d.source:
            settings = changed_where.get((d.source["topic"], d.source["partition"], d.source["offset"]))
        if not settings:
            continue
        names = ", ".join(settings)
        d.detail = f"decided under another configuration ({names}); replayed: {d.kind}: {d.detail}"
        d.kind = "config_changed"
        d.settings = {k: {"recorded": a, "replayed": b} for k, (a, b) in settings.items()}
