"""Comparing derived with recorded: outcomes, dead letters, final states; the report, its divergences."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from google.protobuf import json_format
from google.protobuf.message import Message

from consumers.lanes.retention import finished
from events.codec import (
    state_key,
)
from events.sandbox_lanes.v1 import state_pb2

logger = logging.getLogger("sandbox_lanes.replay")


@dataclass
class RecordedOutcome:
    message: Message
    topic: str
    partition: int
    offset: int
    timestamp: int


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
    """``{field path: {derived, recorded}}`` of two messages (``meta.source`` and the configuration
    fingerprints excluded)."""
    a, b = _flat(derived), _flat(recorded)
    for ignored in ("meta.source", "meta.config_fingerprint", "config_fingerprint"):
        # Who wrote it, and under which configuration (replay re-derives under the configuration
        # the fingerprint names, or reports ``config_changed`` when told to use another).
        a.pop(ignored, None)
        b.pop(ignored, None)
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
    #: ``config_changed``: each setting that differs, ``{setting: {recorded, replayed}}``.
    settings: dict[str, dict[str, str]] = field(default_factory=dict)

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
    #: Finished executions whose recorded state was tombstoned after its retention.
    states_expired: int = 0
    #: Under which configuration: "recorded" (each decision under the one its fingerprint names)
    #: or "current" (``--with-current-config``).
    config_mode: str = "recorded"
    #: Configuration records found on the state topic.
    configs_recorded: int = 0
    #: Decisions re-derived per configuration fingerprint.
    decisions_by_config: dict[str, int] = field(default_factory=dict)
    #: Inputs with no fingerprint on any record (written before issue 35): the current configuration.
    without_fingerprint: int = 0
    #: Inputs whose fingerprint has no configuration record: the current configuration.
    unknown_fingerprint: int = 0
    #: Decisions made under another configuration than the one replayed (``--with-current-config``).
    config_differs: int = 0
    #: The capacity ledger (a cap on): its log's records decided again, its answers compared.
    capacity_records: int = 0
    capacity_answers_derived: int = 0
    capacity_answers_recorded: int = 0
    capacity_answers_matched: int = 0
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


def source_of(rec: ConsumerRecord[bytes, bytes]) -> dict[str, Any]:
    return {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset}


def compare_output(
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
        "key": state_key(output),
        "type": type(output).__name__,
        "source": source_of(rec),
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


def compare_dead_letters(
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


def compare_states(
    derived: Mapping[str, state_pb2.ExecutionState],
    touched: set[str],
    recorded: Mapping[str, state_pb2.ExecutionState | None],
    report: ReplayReport,
) -> None:
    for key in sorted(touched):
        report.states_compared += 1
        mine = derived[key]
        theirs = recorded.get(key)
        if theirs is None and key in recorded and finished(mine):
            report.states_expired += 1  # tombstoned after its retention, as the rules allow
            continue
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
