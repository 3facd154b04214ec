"""Issue 35, the pure parts: the lane configuration's fingerprint, its record, the rules' stamp, and the
explain page's self-containment. No broker (the real-broker tests are tests/integration/test_audit.py)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace

from consumers.lanes.commands import CommandResult, LaneConfig, StateView, changed_settings
from consumers.lanes.dispatch import AgentExecutionTemporalConfig, WorkflowExecutionTemporalConfig
from consumers.lanes.rules import complete, complete_effect, decide
from consumers.tools.explain import render_html, render_text
from events.codec import decode_lane_config, encode_lane_config, lane_config_topic
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, state_pb2

CONFIG = LaneConfig(
    enabled=True,
    agent=AgentExecutionTemporalConfig(activity_routing="session", default_execution_target="cloud"),
    workflow=WorkflowExecutionTemporalConfig(workflow_activity_routing="execution"),
    driver_name="docker",
)

#: The settings CONFIG reads, written out here (not computed by the code under test).
CONFIG_SETTINGS = {
    "SANDBOX_PROVISIONER_TYPE": "docker",
    "lane enabled": "true",
    "STIGMER_ACTIVITY_ROUTING": "session",
    "STIGMER_DEFAULT_EXECUTION_TARGET": "cloud",
    "TEMPORAL_AGENT_EXECUTION_RUNNER_TASK_QUEUE": "stigmer_runner",
    "agent stigmer queue": "agent_execution_stigmer",
    "STIGMER_WORKFLOW_ACTIVITY_ROUTING": "execution",
    "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET": "local",
    "TEMPORAL_WORKFLOW_EXECUTION_RUNNER_TASK_QUEUE": "stigmer_runner",
    "workflow stigmer queue": "workflow_execution_stigmer",
}


def test_the_fingerprint_is_a_stable_hash_of_the_settings_the_rules_read() -> None:
    assert CONFIG.settings() == CONFIG_SETTINGS
    text = json.dumps(CONFIG_SETTINGS, sort_keys=True, separators=(",", ":"))
    assert CONFIG.fingerprint == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert re.fullmatch(r"[0-9a-f]{16}", CONFIG.fingerprint)
    # The pod's name (source) and whether it stamps change no decision: the same fingerprint.
    assert (
        replace(CONFIG, source="sandbox-lanes/pod-b", stamp_fingerprint=True).fingerprint
        == CONFIG.fingerprint
    )


def test_every_setting_the_rules_read_moves_the_fingerprint_and_is_named() -> None:
    variants = {
        "SANDBOX_PROVISIONER_TYPE": replace(CONFIG, driver_name="kubernetes"),
        "lane enabled": replace(CONFIG, enabled=False),
        "STIGMER_ACTIVITY_ROUTING": replace(CONFIG, agent=replace(CONFIG.agent, activity_routing="global")),
        "STIGMER_DEFAULT_EXECUTION_TARGET": replace(
            CONFIG, agent=replace(CONFIG.agent, default_execution_target="local")
        ),
        "TEMPORAL_AGENT_EXECUTION_RUNNER_TASK_QUEUE": replace(
            CONFIG, agent=replace(CONFIG.agent, runner_queue="q")
        ),
        "STIGMER_WORKFLOW_ACTIVITY_ROUTING": replace(
            CONFIG, workflow=replace(CONFIG.workflow, workflow_activity_routing="global")
        ),
        "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET": replace(
            CONFIG, workflow=replace(CONFIG.workflow, default_execution_target="cloud")
        ),
        "TEMPORAL_WORKFLOW_EXECUTION_RUNNER_TASK_QUEUE": replace(
            CONFIG, workflow=replace(CONFIG.workflow, runner_queue="q")
        ),
        "SANDBOX_LANES_MAX_CLOCK_AHEAD_S": replace(CONFIG, max_clock_ahead_s=300.0),
        "SANDBOX_LANES_STATE_RETENTION_S": replace(CONFIG, state_retention_s=604800.0),
    }
    seen = {CONFIG.fingerprint}
    for name, other in variants.items():
        assert other.fingerprint not in seen, name
        seen.add(other.fingerprint)
        assert list(changed_settings(CONFIG.settings(), other.settings())) == [name]


def test_the_configuration_record_round_trips_on_its_own_topic() -> None:
    record = encode_lane_config(CONFIG.applied(), source="sandbox-lanes/pod-a")
    assert record.key == CONFIG.fingerprint.encode()
    assert ("ce_type", b"sandbox_lanes.v1.LaneConfigApplied") in record.headers
    assert lane_config_topic("t1.sandbox-lanes-state") == "t1.sandbox-lanes-state-config"
    applied = decode_lane_config(record.value, record.headers)
    assert applied is not None
    back = LaneConfig.from_applied(applied, source="replay")
    assert back.fingerprint == CONFIG.fingerprint and back.settings() == CONFIG_SETTINGS
    assert back.max_clock_ahead_s is None and back.state_retention_s is None
    pod = replace(CONFIG, max_clock_ahead_s=300.0, state_retention_s=0.0)  # 0: keep every state
    again_record = encode_lane_config(pod.applied())
    again_applied = decode_lane_config(again_record.value, again_record.headers)
    assert again_applied is not None
    again = LaneConfig.from_applied(again_applied)
    assert (again.max_clock_ahead_s, again.state_retention_s) == (300.0, 0.0)
    assert again.settings()["SANDBOX_LANES_STATE_RETENTION_S"] == "0" and again.fingerprint == pod.fingerprint
    # Anything else on that topic is not a configuration: a tombstone, another type, bytes that do not parse.
    assert decode_lane_config(None, record.headers) is None
    assert decode_lane_config(record.value, [("ce_type", b"sandbox_lanes.v1.ExecutionState")]) is None
    assert decode_lane_config(b"\xff\xff", record.headers) is None


def test_an_old_state_without_the_new_fields_still_reads() -> None:
    # Bytes of a state written before issue 35 (fields 1..19 only): the new fields read empty.
    old = state_pb2.ExecutionState(execution_id="wfx_old", created=True, phase=common_pb2.EXECUTION_PENDING)
    parsed = state_pb2.ExecutionState.FromString(old.SerializeToString())
    assert parsed.config_fingerprint == ""


def _wf_created() -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=common_pb2.EventMeta(event_id="evt-1", schema_version=1),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id="wfx_1",
        workflow_execution_target=common_pb2.CLOUD,
    )


def test_the_rules_stamp_the_fingerprint_on_every_state_and_outcome_when_asked() -> None:
    stamping = replace(CONFIG, stamp_fingerprint=True)
    decision = decide(_wf_created(), StateView(None), stamping)
    assert decision.state is not None and decision.state.config_fingerprint == CONFIG.fingerprint
    outcome = complete(decision, [CommandResult(ok=True)], stamping)
    (out,) = outcome.outputs
    assert out.meta.config_fingerprint == CONFIG.fingerprint
    # A result folded later, by a pod under another configuration: the fold carries that one.
    later = decide(_wf_created(), StateView(None), stamping)
    assert later.state is not None
    other = replace(stamping, driver_name="kubernetes")
    folded = complete_effect(later.state, later.state.pending[0].effect_id, CommandResult(ok=True), other)
    assert folded.state is not None and folded.state.config_fingerprint == other.fingerprint
    assert folded.outputs[0].meta.config_fingerprint == other.fingerprint
    # Not asked (the rule tests' configs): nothing stamped, the pinned records unchanged.
    plain = decide(_wf_created(), StateView(None), CONFIG)
    assert plain.state is not None and plain.state.config_fingerprint == ""
    (unstamped,) = complete(plain, [CommandResult(ok=True)], CONFIG).outputs
    assert unstamped.meta.config_fingerprint == ""


STORY = {
    "id": "wfx_<1>",
    "steps": [
        {
            "input": {
                "topic": "execution-created",
                "partition": 0,
                "offset": 3,
                "record_time": "2026-12-05T10:00:00.000Z",
                "record_time_ms": 1_796_378_400_000,
                "type": "ExecutionCreated",
                "event_id": "evt-1",
                "occurred_at": "2026-12-05T10:00:00Z",
                "key": "wfx_<1>",
            },
            "config": {"fingerprint": "0123456789abcdef"},
            "rule": "workflow lane",
            "why": "lane enabled <script>alert(1)</script>",
            "effects": [
                {
                    "effect_id": "e-1",
                    "op": "ensure",
                    "scope": "workflow",
                    "sandbox_id": "wfx_<1>",
                    "outcome": {
                        "type": "SandboxProvisioned",
                        "event_id": "o-1",
                        "topic": "sandbox-outcomes",
                        "partition": 0,
                        "offset": 0,
                        "record_time": "2026-12-05T10:00:01.500Z",
                        "record_time_ms": 1_796_378_401_500,
                        "after_input_s": 1.5,
                        "result": "ok",
                    },
                }
            ],
            "state_after": {"phase": "EXECUTION_PENDING"},
        }
    ],
    "dead_letters": [],
    "final_states": {"wfx_<1>": {"recorded": "present", "phase": "EXECUTION_PENDING"}},
    "configs": {"0123456789abcdef": {"STIGMER_WORKFLOW_ACTIVITY_ROUTING": "execution"}},
    "notes": [],
}


def test_the_page_is_self_contained_and_escapes_what_it_shows() -> None:
    page = render_html(STORY)
    assert "<script" not in page  # the step's text is escaped, and the page has no script of its own
    assert "&lt;script&gt;" in page
    assert not re.search(r"\b(src|href)=", page)
    assert re.findall(r"https?://[^\"' ]+", page) == [
        "http://www.w3.org/2000/svg"
    ]  # a namespace, not a fetch
    assert page.count('class="tl-event tl-input"') == 1 and page.count('class="tl-event tl-outcome"') == 1
    text = render_text(STORY)
    assert "1.5 s after the input" in text and "config 0123456789abcdef" in text
