"""Issue 35 on a real broker: every decision carries its configuration, replay uses it, `explain` tells
one execution's story (text, JSON, and an HTML page opened in Debian's headless chromium).

The pods are real (in-process, the real local-process driver with the stub runner); the expectations
are literal (the ids produced here, the settings of the environments written here), never derived
with the code under test.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from consumers.ops.settings import load_settings
from consumers.tools.explain import explain, render_text
from consumers.tools.replay import lane_config, replay
from drivers.contract import SandboxEnvironment
from drivers.local_process import new_local_process_provisioner
from events.codec import decode_lane_config, lane_config_topic, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2
from tests.support.pod_harness import ROOT, produce, read_topic, running_pod, unique_env

pytestmark = pytest.mark.kafka
RUN = uuid.uuid4().hex[:8]
WF, AG = common_pb2.WORKFLOW_EXECUTION, common_pb2.AGENT_EXECUTION
P = common_pb2


def created(execution_id: str, kind: int, event_id: str, **fields: object) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(event_id=event_id),
        kind=kind,
        execution_id=execution_id,  # type: ignore[arg-type]
        caller_identity_id="ida_audit",
        **fields,  # type: ignore[arg-type]
    )


def phase(
    execution_id: str, kind: int, previous: int, new: int, event_id: str, **fields: object
) -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(event_id=event_id),
        kind=kind,
        execution_id=execution_id,
        previous_phase=previous,  # type: ignore[arg-type]
        new_phase=new,  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumers.tools.cli", *args],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def _states(bootstrap: str, topic: str, at_least: int) -> dict[str, state_pb2.ExecutionState]:
    out: dict[str, state_pb2.ExecutionState] = {}
    for rec in await read_topic(bootstrap, topic, at_least=at_least, settle_s=0.3):
        if isinstance(rec.message, state_pb2.ExecutionState):
            out[rec.key] = rec.message
    return out


async def _configs(bootstrap: str, state_topic: str, at_least: int) -> dict[str, state_pb2.LaneConfigApplied]:
    """The configuration records, by fingerprint (their own compacted topic)."""
    out: dict[str, state_pb2.LaneConfigApplied] = {}
    deadline = time.monotonic() + 30
    while len(out) < at_least:  # written beside the pod's start: wait for the records, not a clock
        assert time.monotonic() < deadline, f"configuration records: {sorted(out)}"
        for rec in await read_topic(bootstrap, lane_config_topic(state_topic), at_least=0, settle_s=0.2):
            headers = [(k, v.encode()) for k, v in rec.headers.items()]
            applied = decode_lane_config(rec.value, headers)
            if applied is not None:
                out[applied.fingerprint] = applied
    return out


# --- replay under the recorded configuration -----------------------------------------------------


async def test_replay_uses_each_decisions_recorded_configuration_and_names_a_changed_setting(
    kafka_bootstrap: str, tmp_path: Path, no_leaked_runners: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A pod under routing A decides, is restarted with another workflow routing (B) and decides
    again. Replayed from a shell whose settings differ from both: no divergence. Replayed under B
    (--with-current-config): the decisions made under A are config_changed, naming the setting."""
    env_a = unique_env(kafka_bootstrap, tmp_path)
    env_b = {**env_a, "STIGMER_WORKFLOW_ACTIVITY_ROUTING": "global"}
    # An auditor's shell: other routing, other default targets, none of the pod's lane settings.
    env_shell = {
        **env_a,
        "STIGMER_ACTIVITY_ROUTING": "global",
        "STIGMER_DEFAULT_EXECUTION_TARGET": "local",
        "STIGMER_WORKFLOW_ACTIVITY_ROUTING": "global",
        "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET": "cloud",
    }
    topics = load_settings(env_a).topics
    wf1, wf2, axr, ses = f"wfx_au1_{RUN}", f"wfx_au2_{RUN}", f"axr_au_{RUN}", f"ses_au_{RUN}"
    async with running_pod(env_a):
        await produce(
            kafka_bootstrap,
            env_a,
            created(wf1, WF, f"evt-au-wf1-{RUN}", workflow_execution_target=P.CLOUD),
            created(
                axr,
                AG,
                f"evt-au-axr-{RUN}",
                session_id=ses,
                session_execution_target=P.EXECUTION_TARGET_UNSPECIFIED,
            ),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
    async with running_pod(env_b):
        await produce(
            kafka_bootstrap,
            env_b,
            created(wf2, WF, f"evt-au-wf2-{RUN}", workflow_execution_target=P.CLOUD),
            phase(wf1, WF, P.EXECUTION_IN_PROGRESS, P.EXECUTION_COMPLETED, f"evt-au-wf1-done-{RUN}"),
            inputs_pb2.SessionDeleted(meta=new_meta(event_id=f"evt-au-sesdel-{RUN}"), session_id=ses),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=4)
        states = await _states(kafka_bootstrap, topics.state, at_least=6)
        assert wf2 in states and states[wf2].created
    configs = await _configs(kafka_bootstrap, topics.state, at_least=2)
    assert len(configs) == 2  # one record per configuration the pods started with
    by_routing = {c.workflow_activity_routing: c.fingerprint for c in configs.values()}
    assert {c.pod_id for c in configs.values()} == {"pod-a"}
    assert sorted(by_routing) == ["execution", "global"]
    assert states[wf2].config_fingerprint == by_routing["global"]
    outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=4)
    provisioned = [r.message for r in outcomes if isinstance(r.message, outcomes_pb2.SandboxProvisioned)]
    assert {m.execution_id: m.meta.config_fingerprint for m in provisioned if m.execution_id == wf1} == {
        wf1: by_routing["execution"]
    }

    # A restart with a configuration the log has seen writes no second record.
    with caplog.at_level(logging.INFO, logger="sandbox_lanes.pod"):
        async with running_pod(env_a):
            deadline = time.monotonic() + 60
            while not any(r.getMessage() == "lane configuration already recorded" for r in caplog.records):
                assert time.monotonic() < deadline, "the restarted pod did not check its configuration record"
                await asyncio.sleep(0.1)
    raw = await read_topic(kafka_bootstrap, lane_config_topic(topics.state), at_least=2, settle_s=0.3)
    assert len(raw) == 2, [r.key for r in raw]

    shell = load_settings(env_shell)
    report = await replay(kafka_bootstrap, topics, lane_config(shell), guarantee=shell.guarantee)
    assert report.divergences == [], json.dumps(report.as_dict(), indent=1)
    assert (
        report.configs_recorded == 2 and report.without_fingerprint == 0 and report.unknown_fingerprint == 0
    )
    assert set(report.decisions_by_config) == set(by_routing.values())
    assert report.matched_outcomes == report.recorded_outcomes == 4

    # The same from the CLI in the other shell: exit 0, no divergence.
    done = cli(env_shell, "replay", "--log-level", "warning")
    assert done.returncode == 0 and "no divergence" in done.stdout, done.stdout + done.stderr

    # Under B's configuration for every decision: what A decided differently is config_changed.
    now = load_settings(env_b)
    changed = await replay(
        kafka_bootstrap, topics, lane_config(now), guarantee=now.guarantee, use_recorded_config=False
    )
    kinds = {d.kind for d in changed.divergences}
    assert kinds == {"config_changed"}, json.dumps(changed.as_dict(), indent=1)
    assert {d.causation_id for d in changed.divergences if d.causation_id} == {f"evt-au-wf1-{RUN}"}
    for d in changed.divergences:
        assert d.settings == {
            "STIGMER_WORKFLOW_ACTIVITY_ROUTING": {"recorded": "execution", "replayed": "global"}
        }
    report_file = tmp_path / "changed.json"
    done = cli(
        env_b, "replay", "--log-level", "warning", "--with-current-config", "--report", str(report_file)
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "config_changed" in done.stdout and "STIGMER_WORKFLOW_ACTIVITY_ROUTING" in done.stdout
    doc = json.loads(report_file.read_text())
    assert set(doc["summary"]["divergences_by_kind"]) == {"config_changed"}


# --- explain -------------------------------------------------------------------------------------


class _Timeline(HTMLParser):
    """The drawn timeline as the browser serialised it: each circle's classes, time and x."""

    def __init__(self) -> None:
        super().__init__()
        self.circles: list[dict[str, str]] = []
        self.steps: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "circle" and "tl-event" in a.get("class", ""):
            self.circles.append(a)
        if tag == "li" and "step" in a.get("class", "").split():
            self.steps.append(a.get("data-type", ""))


def _chromium() -> str:
    found = shutil.which("chromium")
    assert found is not None, (
        "chromium is missing: scripts/bootstrap.sh --system installs it (Debian's chromium)"
    )
    return found


def _browser(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-background-networking",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _rules(story: dict[str, Any]) -> list[str]:
    return [s["rule"] for s in story["steps"]]


def _outcome_types(story: dict[str, Any]) -> list[str]:
    return [e["outcome"]["type"] for s in story["steps"] for e in s.get("effects", []) if e.get("outcome")]


async def test_explain_tells_each_lanes_story_and_the_page_renders_in_chromium(
    kafka_bootstrap: str, tmp_path: Path, no_leaked_runners: None
) -> None:
    env = unique_env(kafka_bootstrap, tmp_path)
    settings = load_settings(env)
    topics = settings.topics
    reaped_wf = f"wfx_exreap_{RUN}"
    wf, bad, axr, ses, ghost = (
        f"wfx_ex_{RUN}",
        f"wfx_ex/{RUN}",  # an id the local-process driver refuses: a real driver failure, refused
        f"axr_ex_{RUN}",
        f"ses_ex_{RUN}",
        f"wfx_exghost_{RUN}",
    )
    failed_error = "runner lost"
    async with running_pod(env):
        await produce(
            kafka_bootstrap,
            env,
            created(wf, WF, f"evt-ex-wf-{RUN}", workflow_execution_target=P.CLOUD),
            created(bad, WF, f"evt-ex-bad-{RUN}", workflow_execution_target=P.CLOUD),
            created(axr, AG, f"evt-ex-axr-{RUN}", session_id=ses, session_execution_target=P.CLOUD),
            created(reaped_wf, WF, f"evt-ex-reap-{RUN}", workflow_execution_target=P.CLOUD),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=4)
        await produce(
            kafka_bootstrap,
            env,
            phase(
                wf,
                WF,
                P.EXECUTION_IN_PROGRESS,
                P.EXECUTION_FAILED,
                f"evt-ex-wf-fail-{RUN}",
                error=failed_error,
            ),
            phase(reaped_wf, WF, P.EXECUTION_IN_PROGRESS, P.EXECUTION_COMPLETED, f"evt-ex-reap-done-{RUN}"),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=6)
        await produce(
            kafka_bootstrap,
            env,
            phase(wf, WF, P.EXECUTION_FAILED, P.EXECUTION_IN_PROGRESS, f"evt-ex-wf-rec-{RUN}"),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=7)
        await produce(
            kafka_bootstrap,
            env,
            phase(wf, WF, P.EXECUTION_IN_PROGRESS, P.EXECUTION_COMPLETED, f"evt-ex-wf-done-{RUN}"),
            inputs_pb2.SessionDeleted(meta=new_meta(event_id=f"evt-ex-sesdel-{RUN}"), session_id=ses),
            phase(ghost, WF, P.EXECUTION_IN_PROGRESS, P.EXECUTION_COMPLETED, f"evt-ex-ghost-{RUN}"),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=9)
        await read_topic(kafka_bootstrap, topics.dead_letter, at_least=1)
    # A leak: the finished execution's sandbox made again behind the pod's back; the reaper removes it.
    driver = new_local_process_provisioner(settings.driver, logging.getLogger("sandbox_lanes"))
    try:
        await driver.ensure("workflow", reaped_wf, SandboxEnvironment(task_queue=f"wfexec:{reaped_wf}"))
    finally:
        await driver.close()
    reap = cli(env, "reap", "--log-level", "warning", "--apply", "--grace", "3600")
    assert reap.returncode == 0 and "1 removed, 0 failed" in reap.stdout, reap.stdout + reap.stderr

    lane = lane_config(settings)
    # The recovered workflow: create, FAILED (torn down), recover (ensured again), COMPLETED.
    story = await explain(kafka_bootstrap, topics, lane, wf, guarantee=settings.guarantee)
    assert _rules(story) == ["workflow lane", "terminal observer", "recover", "terminal observer"]
    assert _outcome_types(story) == [
        "SandboxProvisioned",
        "SandboxDeprovisioned",
        "SandboxProvisioned",
        "SandboxDeprovisioned",
    ]
    assert [s["input"]["event_id"] for s in story["steps"]] == [
        f"evt-ex-wf-{RUN}",
        f"evt-ex-wf-fail-{RUN}",
        f"evt-ex-wf-rec-{RUN}",
        f"evt-ex-wf-done-{RUN}",
    ]
    assert [s["input"]["topic"] for s in story["steps"]] == [topics.execution_created] + [
        topics.phase_changed
    ] * 3
    assert [s["state_after"]["phase"] for s in story["steps"]] == [
        "EXECUTION_PENDING",
        "EXECUTION_FAILED",
        "EXECUTION_IN_PROGRESS",
        "EXECUTION_COMPLETED",
    ]
    assert story["steps"][1]["state_after"]["status_error"] == failed_error
    assert "status_error" not in story["steps"][2]["state_after"]  # the recover's ensure cleared it
    (fingerprint,) = {s["config"]["fingerprint"] for s in story["steps"]}
    assert story["configs"][fingerprint]["STIGMER_WORKFLOW_ACTIVITY_ROUTING"] == "execution"
    assert story["configs"][fingerprint]["SANDBOX_PROVISIONER_TYPE"] == "local-process"
    for step in story["steps"]:
        for effect in step["effects"]:
            assert re.fullmatch(r"[0-9a-f-]{36}", effect["effect_id"])
            assert effect["outcome"]["after_input_s"] >= 0
    assert story["final_states"][wf]["recorded"] == "present"
    text = render_text(story)
    print("\n" + text)

    # The session lane, by the session's id: the agent execution's create, then the session's delete.
    session = await explain(kafka_bootstrap, topics, lane, ses, guarantee=settings.guarantee)
    assert _rules(session) == ["session lane", "session delete"]
    assert _outcome_types(session) == ["SandboxProvisioned", "SandboxDeprovisioned"]
    assert session["steps"][0]["effects"][0]["task_queue"] == f"session:{ses}"

    # A refused create: the driver's failure, critical.
    refused = await explain(kafka_bootstrap, topics, lane, bad, guarantee=settings.guarantee)
    assert _rules(refused) == ["workflow lane"]
    (outcome,) = [e["outcome"] for e in refused["steps"][0]["effects"]]
    assert outcome["type"] == "SandboxFailed" and outcome["result"].endswith("(critical)")
    assert refused["steps"][0]["state_after"]["refused"] is True

    # A reaped sandbox: the workflow's create, its terminal phase, then the reaper's removal.
    reaped = await explain(kafka_bootstrap, topics, lane, reaped_wf, guarantee=settings.guarantee)
    assert _rules(reaped) == ["workflow lane", "terminal observer", "reaper"]
    assert _outcome_types(reaped) == ["SandboxProvisioned", "SandboxDeprovisioned", "SandboxReaped"]
    assert (
        reaped["steps"][2]["why"]
        == "the reaper removed the sandbox: execution terminal (EXECUTION_COMPLETED)"
    )

    # A dead-lettered input: a phase change of an execution never created.
    ghost_story = await explain(kafka_bootstrap, topics, lane, ghost, guarantee=settings.guarantee)
    assert _rules(ghost_story) == ["dead letter"]
    letter = ghost_story["steps"][0]["dead_letter"]
    assert letter["recorded"] is True and "unknown execution" in letter["reason"]

    # The CLI: text, JSON, and the page, as an auditor runs them.
    page = tmp_path / "explain.html"
    done = cli(env, "explain", wf, "--log-level", "warning", "--html", str(page))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"explain {wf}: 4 steps"
    assert "rule: recover" in done.stdout
    as_json = cli(env, "explain", wf, "--log-level", "warning", "--json")
    assert as_json.returncode == 0 and _rules(json.loads(as_json.stdout)) == _rules(story)
    missing = cli(env, "explain", f"wfx_nobody_{RUN}", "--log-level", "warning")
    assert missing.returncode == 1 and "no retained input concerns" in missing.stdout

    # The page in a real headless browser: the timeline read back from the DOM it rendered.
    dom = _browser("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    timeline = _Timeline()
    timeline.feed(dom.stdout)
    assert timeline.steps == ["ExecutionCreated", "PhaseChanged", "PhaseChanged", "PhaseChanged"]
    classes = [c["class"].split()[1] for c in timeline.circles]
    assert classes.count("tl-input") == 4 and classes.count("tl-outcome") == 4 and len(classes) == 8
    # Drawn in time order along the axis: x grows with the record time.
    points = sorted((int(c["data-time-ms"]), float(c["cx"])) for c in timeline.circles)
    assert [x for _, x in points] == sorted(x for _, x in points)
    assert points[0][1] < points[-1][1]
    shot = tmp_path / "explain.png"
    taken = _browser(f"--screenshot={shot}", "--window-size=1000,900", "--hide-scrollbars", page.as_uri())
    assert taken.returncode == 0, taken.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    print(f"explain page: {page}\nscreenshot: {shot}")


async def test_explain_an_execution_past_retention_tells_what_its_inputs_show(
    kafka_bootstrap: str, tmp_path: Path, no_leaked_runners: None
) -> None:
    """A finished execution's state is tombstoned after the retention (2 s here); its inputs are still
    on the topics: explain says so and still tells the story."""
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_STATE_RETENTION_S="2")
    settings = load_settings(env)
    topics = settings.topics
    old = f"wfx_exold_{RUN}"
    async with running_pod(env):
        await produce(
            kafka_bootstrap, env, created(old, WF, f"evt-ex-old-{RUN}", workflow_execution_target=P.LOCAL)
        )
        await produce(
            kafka_bootstrap,
            env,
            phase(old, WF, P.EXECUTION_IN_PROGRESS, P.EXECUTION_COMPLETED, f"evt-ex-old-done-{RUN}"),
        )
        deadline = time.monotonic() + 60
        while True:  # until the pod tombstones the finished state (the verdict is the record, not a clock)
            records = await read_topic(kafka_bootstrap, topics.state, at_least=1, settle_s=0.2)
            if any(r.key == old and r.value is None for r in records):
                break
            assert time.monotonic() < deadline, "the finished state was not tombstoned within 60 s"
            await asyncio.sleep(0.5)
    story = await explain(kafka_bootstrap, topics, lane_config(settings), old, guarantee=settings.guarantee)
    assert _rules(story) == ["workflow lane (does not fire)", "terminal observer"]
    assert "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET" in story["steps"][0]["why"]
    assert _outcome_types(story) == ["SandboxDeprovisioned"]
    assert story["final_states"][old]["recorded"] == "tombstoned"
    (note,) = story["notes"]
    assert note.startswith(f"{old}: past retention: its state was tombstoned at ") and "finished" in note
    assert "what its inputs, still on the topic, show" in render_text(story)
