"""``sandbox-lanes explain <execution-or-session-id>``: one execution's story, from the log alone.

Every input that concerns it (topic, partition, offset, record time, ``occurred_at``, event id), the
rule that fired and why (in the words of ``docs/rules.md``), each effect with its id, the driver's
result (the recorded outcome) and its timing, each outcome record, every dead letter that concerns
it, the state after each step, and the configuration each decision was made under. The decisions are
re-derived as ``replay`` does (the pure rules, each under the configuration its records name, driver
results answered from the recorded outcomes): nothing is built, no sandbox is touched.

Text by default; ``--json`` for tools; ``--html FILE`` writes one self-contained page (inline CSS and
SVG, no script, no network) with the timeline drawn.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import html
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from google.protobuf import json_format
from google.protobuf.message import Message

from consumers.lanes.commands import Command, Decision, Deprovision, Ensure, LaneConfig, StateView
from consumers.lanes.constants import (
    LOG_SESSION_DELETED_NOT_PROVISIONED,
    LOG_SESSION_ROUTING_NOT_PER_SESSION,
    WORKFLOW_ROUTING_EXECUTION,
)
from consumers.lanes.outbox import effect_id_of
from consumers.lanes.retention import finished
from consumers.runtime.dead_letters import source_of_dead_letter
from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.topology import Topics
from consumers.runtime.processor import LaneProcessor
from consumers.tools.replay.compare import RecordedOutcome
from consumers.tools.replay.derive import (
    RecordedRunner,
    merged_inputs,
    read_configs,
    read_topics,
    recorded_configs,
    recorded_fingerprints,
    runtime_dead_letter,
)
from events import schema_registry
from events.codec import (
    OUTCOME_TYPES,
    DecidedEvent,
    DecodeError,
    decode,
    decode_answer,
    decode_input,
    decode_state,
    header,
    is_lane_config_key,
    state_key,
)
from events.sandbox_lanes.v1 import capacity_pb2, common_pb2, inputs_pb2, outcomes_pb2, state_pb2

logger = logging.getLogger("sandbox_lanes.explain")

Records = Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]]


# --- the story -----------------------------------------------------------------------------------


def _iso_ms(ms: int) -> str:
    return (
        dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def _phase(number: int) -> str:
    return common_pb2.ExecutionPhase.Name(number)  # type: ignore[arg-type]


def _concerns(event: DecidedEvent, target: str) -> bool:
    if isinstance(event, inputs_pb2.SessionDeleted):
        return event.session_id == target
    if isinstance(event, inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged):
        return target in (event.execution_id, event.session_id)
    return event.execution_id == target  # the capacity ledger's answer to it


def _message_dict(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def state_summary(state: state_pb2.ExecutionState | None) -> dict[str, Any]:
    """What an auditor reads in a state: phase, error, refusal, sandboxes, pending effects."""
    if state is None:
        return {}
    out: dict[str, Any] = {"key": state.execution_id, "phase": _phase(state.phase)}
    if state.status_error:
        out["status_error"] = state.status_error
    if state.refused:
        out["refused"] = True
        out["refusal_reason"] = state.refusal_reason
    elif state.refusal_reason:
        out["refusal_reason"] = state.refusal_reason
    if state.session_deleted:
        out["session_deleted"] = True
    if state.sandboxes:
        out["sandboxes"] = [
            {
                "scope": common_pb2.SandboxScope.Name(s.sandbox.scope).removeprefix("SANDBOX_SCOPE_").lower(),
                "name": s.sandbox.name,
                "lifecycle": state_pb2.SandboxLifecycle.Name(s.lifecycle).removeprefix("SANDBOX_").lower(),
                **({"reason": s.reason} if s.reason else {}),
            }
            for s in state.sandboxes
        ]
    if state.pending:
        out["pending"] = [e.effect_id for e in state.pending]
    if state.config_fingerprint:
        out["config_fingerprint"] = state.config_fingerprint
    return out


def rule_of(
    event: DecidedEvent, decision: Decision, before: state_pb2.ExecutionState | None, config: LaneConfig
) -> tuple[str, str]:
    """The rule that fired (a row of docs/rules.md) and why, for one decision."""
    if decision.duplicate:
        return (
            "duplicate",
            "this input's event id is among the execution's applied ids: applied once already, ignored",
        )
    if decision.reject is not None:
        return "dead letter", f"the pod cannot decide it: {decision.reject}"
    commands = decision.commands
    messages = {log.message for log in decision.logs}
    # A cap on: the lane's ensure waits for the capacity ledger's admission (asked in its place).
    asked = any(isinstance(r, capacity_pb2.CapacityRequested) for r in decision.capacity)
    then = "; a cap is on: asked the capacity ledger first" if asked else ""
    if isinstance(event, capacity_pb2.CapacityQueued):
        return "capacity: waits", f"{event.reason}; its place among the creates waiting: {event.position}"
    if isinstance(event, capacity_pb2.CapacityAdmitted):
        if not decision.commands:
            return "capacity: admitted", "admitted after it stopped waiting: its place handed back"
        return "capacity: admitted", f"admitted after {event.waited_s:.1f} s: the lane runs from its create"
    if isinstance(event, capacity_pb2.CapacityTimedOut):
        return "capacity: timed out", f"{event.reason}: the lane's provisioning failure"
    if isinstance(event, inputs_pb2.SessionDeleted):
        return (
            "session delete",
            "SessionDeleted: the session's record is marked session_deleted and its sandbox torn down "
            "(best effort)",
        )
    if isinstance(event, inputs_pb2.ExecutionCreated):
        if before is not None and before.created:
            return (
                "create (again)",
                "a second create for one execution (a producer retry under a new id) is a no-op",
            )
        if event.kind == common_pb2.AGENT_EXECUTION:
            if LOG_SESSION_DELETED_NOT_PROVISIONED in messages:
                return "session delete", (
                    f"a create applied after its session's delete provisions nothing (refused: session "
                    f"'{event.session_id}' was deleted)"
                )
            if not event.session_id:
                return (
                    "session lane (does not fire)",
                    "no session_id: an agent execution without a session has no session sandbox",
                )
            if event.activity_task_queue:
                return "session lane (does not fire)", (
                    "activity_task_queue override set: wfexec: children share their parent's sandbox"
                )
            if LOG_SESSION_ROUTING_NOT_PER_SESSION in messages:
                return "session lane (skipped)", (
                    f"resolved target CLOUD under STIGMER_ACTIVITY_ROUTING={config.agent.activity_routing}: "
                    "Sandbox provisioning skipped: session routing is not per-session"
                )
            if commands or asked:
                return "session lane", (
                    "lane enabled, session_id set, no activity_task_queue override, resolved target CLOUD "
                    f"and the queue is session:{event.session_id}: ensure the session sandbox (non-critical)"
                    + then
                )
            return "session lane (does not fire)", (
                f"the resolved target is not CLOUD (session target "
                f"{common_pb2.ExecutionTarget.Name(event.session_execution_target)}, "
                f"STIGMER_DEFAULT_EXECUTION_TARGET={config.agent.default_execution_target})"
            )
        routing = config.workflow.workflow_activity_routing
        if routing != WORKFLOW_ROUTING_EXECUTION:
            return "workflow lane (does not fire)", (
                f"STIGMER_WORKFLOW_ACTIVITY_ROUTING={routing}: the lane runs only under execution routing"
            )
        if commands or asked:
            return "workflow lane", (
                "lane enabled, STIGMER_WORKFLOW_ACTIVITY_ROUTING=execution, resolved target CLOUD; queue "
                f"wfexec:{event.execution_id}: ensure the workflow sandbox "
                "(critical: a failure refuses the create)" + then
            )
        return "workflow lane (does not fire)", (
            f"the resolved target is not CLOUD (workflow target "
            f"{common_pb2.ExecutionTarget.Name(event.workflow_execution_target)}, "
            f"STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET={config.workflow.default_execution_target})"
        )
    # A phase change.
    stored = before.phase if before is not None else 0
    move = f"{_phase(stored)} -> {_phase(event.new_phase)}"
    if "stale phase change ignored" in messages:
        return (
            "stale phase change",
            f"{move}: written before the stored phase (older occurred_at): it moves nothing",
        )
    if any(isinstance(c, Deprovision) for c in commands):
        return (
            "terminal observer",
            f"workflow {move}: a terminal phase from a stored phase that differs: deprovision the sandbox",
        )
    if any(isinstance(c, Ensure) for c in commands):
        return "recover", f"{move}: FAILED -> IN_PROGRESS re-runs the execution's lane from its stored create"
    if (
        event.kind == common_pb2.WORKFLOW_EXECUTION
        and before is not None
        and before.refused
        and event.new_phase in (3, 4, 5, 6)
    ):
        return (
            "terminal observer (nothing to tear down)",
            f"workflow {move}: the create was refused, no sandbox ever existed",
        )
    if stored == event.new_phase:
        return "phase change (no transition)", f"{move}: the stored phase already: nothing fires"
    if event.kind == common_pb2.AGENT_EXECUTION and event.new_phase in (3, 4, 5, 6):
        return (
            "phase change",
            f"{move}: session sandboxes are long-lived: "
            "an agent execution's terminal phase tears nothing down",
        )
    return "phase change", f"{move}: applied; no rule fires on this transition"


def _command_dict(command: Command) -> dict[str, Any]:
    if isinstance(command, Ensure):
        return {
            "op": "ensure",
            "scope": command.scope,
            "sandbox_id": command.sandbox_id,
            "task_queue": command.task_queue,
            "critical": command.critical,
        }
    return {
        "op": "deprovision",
        "scope": command.scope,
        "sandbox_id": command.sandbox_id,
        "phase": _phase(command.phase),
    }


def _outcome_dict(rec: RecordedOutcome, input_ms: int | None) -> dict[str, Any]:
    msg = rec.message
    meta = getattr(msg, "meta")  # noqa: B009
    out: dict[str, Any] = {
        "type": type(msg).__name__,
        "event_id": meta.event_id,
        "topic": rec.topic,
        "partition": rec.partition,
        "offset": rec.offset,
        "record_time": _iso_ms(rec.timestamp),
        "record_time_ms": rec.timestamp,
    }
    if meta.config_fingerprint:
        out["config_fingerprint"] = meta.config_fingerprint
    if input_ms is not None:
        out["after_input_s"] = round((rec.timestamp - input_ms) / 1000, 3)
    if isinstance(msg, outcomes_pb2.SandboxProvisioned):
        out["result"] = (
            f"ok (probe {msg.probe_state or '-'}, token {'minted' if msg.token_minted else 'none'})"
        )
    elif isinstance(msg, outcomes_pb2.SandboxFailed):
        out["result"] = f"failed: {msg.reason}" + (" (critical)" if msg.critical else "")
    elif isinstance(msg, outcomes_pb2.SandboxTeardownFailed):
        out["result"] = f"teardown failed: {msg.reason}"
    elif isinstance(msg, outcomes_pb2.SandboxReaped):
        out["result"] = f"reaped: {msg.reason}"
    elif isinstance(msg, outcomes_pb2.SandboxQueued):
        out["result"] = f"waits for capacity: {msg.reason} (place {msg.position})"
    else:
        out["result"] = "ok"
    sandbox = getattr(msg, "sandbox", None)
    if sandbox is not None and sandbox.name:
        out["sandbox"] = sandbox.name
        out["driver"] = sandbox.driver
    return out


async def build_story(
    target: str,
    inputs_by_tp: Records,
    outcome_recs: Records,
    dlq_recs: Records,
    state_recs: Records,
    config_recs: Records,
    topics: Topics,
    lane: LaneConfig,
    *,
    max_clock_ahead_s: float | None = None,
) -> dict[str, Any]:
    """The story of ``target`` (an execution or a session id) from the records as read."""
    recorded: dict[str, list[RecordedOutcome]] = {}
    reaped: list[RecordedOutcome] = []
    evidence: dict[str, str] = {}
    for recs in outcome_recs.values():
        for rec in recs:
            try:
                message = decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
            except DecodeError:
                continue
            one = RecordedOutcome(message, rec.topic, rec.partition, rec.offset, rec.timestamp)
            if isinstance(message, outcomes_pb2.SandboxReaped):
                if target in (message.execution_id, message.sandbox.sandbox_id):
                    reaped.append(one)
                continue
            meta = getattr(message, "meta")  # noqa: B009
            evidence.setdefault(meta.causation_id, meta.config_fingerprint)
            recorded.setdefault(meta.event_id, []).append(one)
    configs = recorded_configs(config_recs, lane.source)
    final: dict[str, tuple[state_pb2.ExecutionState | None, int]] = {}
    for recs in state_recs.values():
        for rec in recs:
            key = rec.key.decode("utf-8", errors="replace") if rec.key else ""
            value = decode_state(rec.value) if rec.value is not None else None
            if is_lane_config_key(key):
                continue
            final[key] = (value, rec.timestamp)
            if (
                value is not None
                and value.applied_event_ids
                and not evidence.get(value.applied_event_ids[-1])
            ):
                evidence[value.applied_event_ids[-1]] = value.config_fingerprint
    dead_letters: dict[tuple[str, int, int], ConsumerRecord[bytes, bytes]] = {}
    #: A dead letter's place ("topic/partition/offset") -> the input it holds (a re-drive names it).
    letter_sources: dict[str, tuple[str, int, int]] = {}
    for recs in dlq_recs.values():
        for rec in recs:
            where = source_of_dead_letter(rec.headers)
            if where is not None:
                dead_letters[where] = rec
                letter_sources[f"{rec.topic}/{rec.partition}/{rec.offset}"] = where

    ordered = merged_inputs(inputs_by_tp, topics)
    fingerprint_of = recorded_fingerprints(ordered, evidence)
    runner = RecordedRunner(recorded)
    quiet = logging.getLogger("sandbox_lanes.explain.rules")
    quiet.propagate = False
    quiet.addHandler(logging.NullHandler())
    processors: dict[str, LaneProcessor] = {}
    states: dict[str, state_pb2.ExecutionState] = {}
    steps: list[dict[str, Any]] = []
    letters: list[dict[str, Any]] = []
    used_configs: dict[str, dict[str, str]] = {}
    keys: set[str] = set()
    # Only the partitions that hold the target's records matter (a key's records share one).
    wanted = {
        rec.partition
        for rec in ordered
        if (rec.key or b"").decode("utf-8", errors="replace") == target
        or target.encode() in (rec.value or b"")
    }
    for rec in ordered:
        if rec.partition not in wanted:
            continue
        where = (rec.topic, rec.partition, rec.offset)
        source = {
            "topic": rec.topic,
            "partition": rec.partition,
            "offset": rec.offset,
            "record_time": _iso_ms(rec.timestamp),
            "record_time_ms": rec.timestamp,
        }
        redriven_from = header(rec.headers, "dlq_redriven_from")
        if redriven_from:  # written back by `sandbox-lanes redrive`: the dead letter and its original
            source["redriven_from"] = redriven_from
            source["redrive_count"] = header(rec.headers, "dlq_redrive_count") or ""
            original = letter_sources.get(redriven_from)
            if original is not None:
                source["original"] = f"{original[0]}[{original[1]}]@{original[2]}"
        letter = dead_letters.get(where)
        reason = header(letter.headers, "dlq_reason") or "" if letter is not None else ""
        fp = fingerprint_of.get(where, "")
        found = configs.get(fp)
        allowance = found.max_clock_ahead_s if found is not None else None
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
                    max_ahead_s=max_clock_ahead_s if allowance is None else allowance,
                    topic_carries=topics.carries(rec.topic),
                )
        except DecodeError as exc:
            if (rec.key or b"").decode("utf-8", errors="replace") == target:
                letters.append(
                    {"input": source, "derived_reason": exc.reason, "recorded_reason": reason or None}
                )
            continue
        if not _concerns(event, target):
            # Another execution on the same partition: applied for the states the rules read.
            if runtime_dead_letter(reason):
                continue
            config = found or lane
            processor = processors.setdefault(config.fingerprint, LaneProcessor(config, runner, quiet))
            runner.bind(event)
            key = state_key(event)
            try:
                done = await processor.process(event, StateView(states.get(key), states.get))
            except Exception:  # as the pod: the record is parked, the story goes on
                continue
            if done.outcome is not None and done.outcome.state is not None and done.decision.reject is None:
                states[key] = done.outcome.state
            continue
        key = state_key(event)
        keys.add(key)
        meta = event.meta
        step: dict[str, Any] = {
            "input": {
                **source,
                "type": type(event).__name__,
                "event_id": meta.event_id,
                "occurred_at": meta.occurred_at.ToJsonString() if meta.HasField("occurred_at") else None,
                "key": key,
            }
        }
        if isinstance(event, inputs_pb2.PhaseChanged):
            step["input"]["new_phase"] = _phase(event.new_phase)
            if event.error:
                step["input"]["error"] = event.error
        if found is None:
            step["config"] = (
                {"fingerprint": None, "note": "no fingerprint recorded: the current configuration"}
                if not fp
                else {"fingerprint": fp, "note": "no configuration record for it: the current configuration"}
            )
            config = lane
        else:
            config = found
            step["config"] = {"fingerprint": fp}
            used_configs[fp] = config.settings()
        if runtime_dead_letter(reason):
            step["rule"] = "dead letter"
            step["why"] = f"the runtime dead-lettered the record: {reason}"
            step["dead_letter"] = {"reason": reason, "offset": letter.offset if letter is not None else None}
            steps.append(step)
            continue
        processor = processors.setdefault(config.fingerprint, LaneProcessor(config, runner, quiet))
        runner.bind(event)
        before = states.get(key)
        done = await processor.process(event, StateView(before, states.get))
        decision = done.decision
        step["rule"], step["why"] = rule_of(event, decision, before, config)
        if decision.reject is not None:
            step["dead_letter"] = {
                "reason": reason or None,
                "derived_reason": decision.reject,
                "offset": letter.offset if letter is not None else None,
                "recorded": letter is not None,
            }
        effects = []
        for command in decision.commands:
            effect: dict[str, Any] = {
                "effect_id": effect_id_of(meta.event_id, command),
                **_command_dict(command),
            }
            answer = runner.lookup(command)
            effect["outcome"] = _outcome_dict(answer, rec.timestamp) if answer is not None else None
            effects.append(effect)
        if effects:
            step["effects"] = effects
        if decision.logs:
            step["logs"] = [f"{log.level}: {log.message}" for log in decision.logs]
        if done.outcome is not None and done.outcome.state is not None:
            states[key] = done.outcome.state
            step["state_after"] = state_summary(done.outcome.state)
        steps.append(step)

    for one in reaped:
        steps.append(
            {
                "input": {
                    "topic": one.topic,
                    "partition": one.partition,
                    "offset": one.offset,
                    "record_time": _iso_ms(one.timestamp),
                    "record_time_ms": one.timestamp,
                    "type": "SandboxReaped",
                    "event_id": getattr(one.message, "meta").event_id,  # noqa: B009
                },
                "rule": "reaper",
                "why": f"the reaper removed the sandbox: {getattr(one.message, 'reason')}",  # noqa: B009
                "effects": [{"op": "reap", "outcome": _outcome_dict(one, None)}],
            }
        )
    steps.sort(key=lambda s: s["input"]["record_time_ms"])

    recorded_states: dict[str, Any] = {}
    notes: list[str] = []
    for key in sorted(keys):
        value, at = final.get(key, (None, 0))
        if key not in final:
            recorded_states[key] = {"recorded": "absent"}
            notes.append(f"{key}: no state record on the state topic")
        elif value is None:
            derived = states.get(key)
            recorded_states[key] = {"recorded": "tombstoned", "at": _iso_ms(at)}
            notes.append(
                f"{key}: past retention: its state was tombstoned at {_iso_ms(at)}"
                + (
                    " (finished, as the retention rule allows)"
                    if derived is not None and finished(derived)
                    else ""
                )
                + "; the story above is what its inputs, still on the topic, show"
            )
        else:
            recorded_states[key] = {"recorded": "present", **state_summary(value)}
    if not steps:
        notes.append(f"no retained input concerns {target!r}")
    return {
        "id": target,
        "steps": steps,
        "dead_letters": letters,
        "final_states": recorded_states,
        "configs": used_configs,
        "notes": notes,
    }


async def explain(
    bootstrap: str,
    topics: Topics,
    lane: LaneConfig,
    target: str,
    *,
    guarantee: str = "exactly_once",
    security: KafkaSecurity = PLAINTEXT,
    max_clock_ahead_s: float | None = None,
) -> dict[str, Any]:
    isolation = "read_committed" if guarantee == "exactly_once" else "read_uncommitted"
    read = functools.partial(read_topics, bootstrap, isolation_level=isolation, security=security)
    inputs_by_tp, outcome_recs, dlq_recs, state_recs, config_recs = await asyncio.gather(
        read(topics.consumed),  # with a cap on, the capacity ledger's answers too
        read([topics.outcomes]),
        read([topics.dead_letter]),
        read([topics.state]),
        read_configs(read, topics),
    )
    return await build_story(
        target,
        inputs_by_tp,
        outcome_recs,
        dlq_recs,
        state_recs,
        config_recs,
        topics,
        lane,
        max_clock_ahead_s=max_clock_ahead_s,
    )


# --- rendering -----------------------------------------------------------------------------------


def render_text(story: dict[str, Any]) -> str:
    lines = [f"explain {story['id']}: {len(story['steps'])} steps"]
    for n, step in enumerate(story["steps"], 1):
        inp = step["input"]
        lines.append("")
        lines.append(
            f"{n}. {inp['record_time']}  {inp['type']}  {inp['topic']}[{inp['partition']}]@{inp['offset']}"
            f"  event {inp['event_id']}"
        )
        if inp.get("occurred_at"):
            lines.append(f"   occurred_at {inp['occurred_at']}")
        if inp.get("redriven_from"):
            lines.append(
                f"   re-driven (#{inp.get('redrive_count') or '?'}) from dead letter {inp['redriven_from']}"
                + (f", the original {inp['original']}" if inp.get("original") else "")
            )
        if inp.get("new_phase"):
            lines.append(
                f"   new phase {inp['new_phase']}" + (f", error {inp['error']!r}" if inp.get("error") else "")
            )
        config = step.get("config")
        if config:
            lines.append(
                f"   config {config.get('fingerprint') or '-'}"
                + (f" ({config['note']})" if config.get("note") else "")
            )
        lines.append(f"   rule: {step['rule']} — {step['why']}")
        for effect in step.get("effects", []):
            head = f"   effect {effect.get('effect_id', '-')}: {effect['op']}"
            if effect.get("sandbox_id"):
                head += f" {effect['scope']} {effect['sandbox_id']}"
            if effect.get("task_queue"):
                head += f" on {effect['task_queue']}"
            lines.append(head)
            outcome = effect.get("outcome")
            if outcome is None:
                lines.append("     no recorded outcome (not yet completed, or lost: see replay)")
            else:
                timing = (
                    f", {outcome['after_input_s']} s after the input" if "after_input_s" in outcome else ""
                )
                lines.append(
                    f"     -> {outcome['type']} {outcome['event_id']} "
                    f"{outcome['topic']}[{outcome['partition']}]@{outcome['offset']} "
                    f"at {outcome['record_time']}{timing}: {outcome['result']}"
                )
        for log in step.get("logs", []):
            lines.append(f"   log {log}")
        letter = step.get("dead_letter")
        if letter:
            lines.append(
                f"   dead letter: {letter.get('reason') or letter.get('derived_reason')}"
                + ("" if letter.get("recorded", True) else " (NOT on the dead-letter topic)")
            )
        if step.get("state_after"):
            lines.append("   state after: " + json.dumps(step["state_after"], sort_keys=True))
    for letter in story["dead_letters"]:
        inp = letter["input"]
        lines.append(
            f"\ndead letter: {inp['topic']}[{inp['partition']}]@{inp['offset']} at {inp['record_time']}: "
            f"{letter['recorded_reason'] or letter['derived_reason']}"
        )
    if story["configs"]:
        lines.append("")
        for fp, settings in sorted(story["configs"].items()):
            lines.append(f"configuration {fp}: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    for key, final in sorted(story["final_states"].items()):
        lines.append(f"recorded state {key}: " + json.dumps(final, sort_keys=True))
    for note in story["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2430;background:#fff}
h1{font-size:20px;margin:0 0 4px} .sub{color:#5b6472;margin-bottom:16px}
svg{display:block;margin:8px 0 20px;border:1px solid #d8dde6;border-radius:6px;background:#fafbfd}
.tl-axis{stroke:#8a94a6;stroke-width:2}
.tl-input{fill:#2f6fde} .tl-outcome{fill:#1e9e5a} .tl-failed{fill:#d9822b}
.tl-dead{fill:#c23030} .tl-reap{fill:#7a4fd0}
.tl-link{stroke:#9aa4b5;stroke-dasharray:3 3}
text{font:11px system-ui,sans-serif;fill:#1d2430}
ol{padding-left:20px}
li.step{margin:0 0 14px;padding:8px 10px;border-left:4px solid #2f6fde;background:#f4f7fc}
li.step.dead{border-color:#c23030} li.step.reap{border-color:#7a4fd0}
.rule{font-weight:600} .mono{font-family:ui-monospace,monospace;font-size:12px}
.effect{margin:4px 0 0 12px} .state{color:#4a5363}
table{border-collapse:collapse} td,th{border:1px solid #d8dde6;padding:3px 8px;text-align:left}
"""


def _timeline_svg(story: dict[str, Any]) -> str:
    """The steps on a time axis: each input a blue dot, each outcome a green (failure: orange) dot
    joined to its input, a dead letter red, a reap violet. Positions are computed here: no script."""
    points: list[tuple[int, str, str, str, int | None]] = []  # (ms, class, label, title, parent index)
    for step in story["steps"]:
        inp = step["input"]
        dead = "dead_letter" in step
        kind = "tl-reap" if step["rule"] == "reaper" else "tl-dead" if dead else "tl-input"
        parent = len(points)
        points.append(
            (
                inp["record_time_ms"],
                kind,
                inp["type"],
                f"{inp['type']} {inp['event_id']}: {step['rule']}",
                None,
            )
        )
        if step["rule"] == "reaper":
            continue
        for effect in step.get("effects", []):
            out = effect.get("outcome")
            if out is not None:
                failed = "failed" in out["result"]
                points.append(
                    (
                        out["record_time_ms"],
                        "tl-failed" if failed else "tl-outcome",
                        out["type"],
                        f"{out['type']} {out['event_id']}: {out['result']}",
                        parent,
                    )
                )
    width, left, right = 960, 40, 40
    height = 70 + 22 * max(1, len(points))
    if not points:
        empty = '<text x="10" y="30">nothing to draw</text>'
        return f'<svg id="timeline" width="{width}" height="60" role="img">{empty}</svg>'
    lo = min(p[0] for p in points)
    hi = max(p[0] for p in points)
    span = max(hi - lo, 1)

    def x_of(ms: int) -> float:
        return left + (width - left - right) * (ms - lo) / span

    axis_y = 40
    parts = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="timeline of {html.escape(story["id"])}">',
        f'<line class="tl-axis" x1="{left}" y1="{axis_y}" x2="{width - right}" y2="{axis_y}"/>',
        f'<text x="{left}" y="20">{html.escape(_iso_ms(lo))}</text>',
        f'<text x="{width - right}" y="20" text-anchor="end">'
        f"{html.escape(_iso_ms(hi))} (+{span / 1000:.3f} s)</text>",
    ]
    for i, (ms, cls, label, title, joined) in enumerate(points):
        x = x_of(ms)
        y = 70 + 22 * i
        if joined is not None:  # an outcome: joined to its input
            px, py = x_of(points[joined][0]), 70 + 22 * joined
            parts.append(f'<line class="tl-link" x1="{px:.1f}" y1="{py}" x2="{x:.1f}" y2="{y}"/>')
        parts.append(f'<line class="tl-link" x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{y}"/>')
        parts.append(
            f'<circle class="tl-event {cls}" data-index="{i}" data-time-ms="{ms}" '
            f'cx="{x:.1f}" cy="{y}" r="6">'
            f"<title>{html.escape(title)}</title></circle>"
        )
        anchor = "end" if x > width * 0.6 else "start"
        dx = -10 if anchor == "end" else 10
        parts.append(
            f'<text class="tl-label" x="{x + dx:.1f}" y="{y + 4}" text-anchor="{anchor}">'
            f"{html.escape(label)} +{(ms - lo) / 1000:.3f} s</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def render_html(story: dict[str, Any]) -> str:
    """One self-contained page: inline CSS, an inline SVG timeline, no script, no external asset."""
    e = html.escape
    items = []
    for step in story["steps"]:
        inp = step["input"]
        classes = (
            "step"
            + (" dead" if "dead_letter" in step else "")
            + (" reap" if step["rule"] == "reaper" else "")
        )
        body = [
            f'<div class="mono">{e(inp["record_time"])} · '
            f"{e(inp['topic'])}[{inp['partition']}]@{inp['offset']} · "
            f"event {e(inp['event_id'])}"
            + (f" · occurred_at {e(inp['occurred_at'])}" if inp.get("occurred_at") else "")
            + "</div>",
            f'<div><span class="rule">{e(step["rule"])}</span> — {e(step["why"])}</div>',
        ]
        config = step.get("config")
        if config:
            body.append(
                f'<div class="mono">config {e(config.get("fingerprint") or "-")} '
                f"{e(config.get('note', ''))}</div>"
            )
        for effect in step.get("effects", []):
            out = effect.get("outcome")
            result = (
                f"{e(out['type'])} {e(out['event_id'])} at {e(out['record_time'])}: {e(out['result'])}"
                if out
                else "no recorded outcome"
            )
            body.append(
                f'<div class="effect mono">effect {e(str(effect.get("effect_id", "-")))} {e(effect["op"])} '
                f"{e(str(effect.get('sandbox_id', '')))} → {result}</div>"
            )
        letter = step.get("dead_letter")
        if letter:
            body.append(
                '<div class="effect">dead letter: '
                f"{e(str(letter.get('reason') or letter.get('derived_reason')))}</div>"
            )
        if step.get("state_after"):
            body.append(
                '<div class="state mono">state after: '
                f"{e(json.dumps(step['state_after'], sort_keys=True))}</div>"
            )
        items.append(f'<li class="{classes}" data-type="{e(inp["type"])}">{"".join(body)}</li>')
    finals = "".join(
        f"<tr><td class=mono>{e(k)}</td><td class=mono>{e(json.dumps(v, sort_keys=True))}</td></tr>"
        for k, v in sorted(story["final_states"].items())
    )
    configs = "".join(
        f"<tr><td class=mono>{e(fp)}</td>"
        f"<td class=mono>{e(', '.join(f'{k}={v}' for k, v in s.items()))}</td></tr>"
        for fp, s in sorted(story["configs"].items())
    )
    notes = "".join(f"<li>{e(n)}</li>" for n in story["notes"])
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>explain {e(story['id'])}</title><style>{_CSS}</style></head><body>"
        f"<h1>explain {e(story['id'])}</h1>"
        f'<div class="sub">{len(story["steps"])} steps, from the log alone (sandbox-lanes explain)</div>'
        f"{_timeline_svg(story)}"
        f'<ol id="steps">{"".join(items)}</ol>'
        f"<h2>Recorded states</h2><table id=states>{finals}</table>"
        f"<h2>Configurations</h2><table id=configs>{configs}</table>"
        f'<ul id="notes">{notes}</ul>'
        "</body></html>\n"
    )


# --- the CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="an execution id or a session id")
    parser.add_argument("--json", action="store_true", help="print the story as JSON")
    parser.add_argument(
        "--html", metavar="FILE", help="also write a self-contained HTML page with the timeline"
    )
    parser.add_argument("--bootstrap", help="override KAFKA_BOOTSTRAP_SERVERS")


def run(args: argparse.Namespace) -> int:
    from consumers.ops.logs import setup_logging
    from consumers.ops.settings import load_settings
    from consumers.tools.replay.command import lane_config

    settings = load_settings()
    setup_logging(getattr(args, "log_level", "warning"))
    schema_registry.configure(settings.schema_registry_url)
    story = asyncio.run(
        explain(
            args.bootstrap or settings.bootstrap,
            settings.topics,
            lane_config(settings),
            args.id,
            guarantee=settings.guarantee,
            security=settings.kafka_security,
            max_clock_ahead_s=settings.max_clock_ahead_s,
        )
    )
    if args.json:
        print(json.dumps(story, indent=2, sort_keys=True))
    else:
        print(render_text(story))
    if args.html:
        Path(args.html).write_text(render_html(story))
        print(f"page written to {args.html}", file=sys.stderr)
    return 0 if story["steps"] else 1
