"""Audit replay on real Kafka: the real pod (real local-process driver) records, replay re-derives.

A clean run replays with zero divergence; a tampered outcome topic is reported
precisely; replay never builds the configured driver and starts no sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from consumers.ops.settings import load_settings
from consumers.tools.cli import build_parser
from consumers.tools.replay import Window, lane_config, replay
from events.codec import encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2
from tests.support.pod_harness import ROOT, produce, produce_raw, read_topic, running_pod, unique_env
from tests.support.proc_util import processes_under

pytestmark = pytest.mark.kafka
RUN = uuid.uuid4().hex[:8]


def created(
    execution_id: str, kind: int, event_id: str | None = None, **fields: object
) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(event_id=event_id),
        kind=kind,
        execution_id=execution_id,  # type: ignore[arg-type]
        caller_identity_id="ida_replay",
        **fields,  # type: ignore[arg-type]
    )


def phase(
    execution_id: str, kind: int, previous: int, new: int, error: str = "", session_id: str = ""
) -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=kind,
        execution_id=execution_id,
        session_id=session_id,
        previous_phase=previous,  # type: ignore[arg-type]
        new_phase=new,
        error=error,  # type: ignore[arg-type]
    )


WF, AG = common_pb2.WORKFLOW_EXECUTION, common_pb2.AGENT_EXECUTION
PENDING, RUNNING, DONE = (
    common_pb2.EXECUTION_PENDING,
    common_pb2.EXECUTION_IN_PROGRESS,
    common_pb2.EXECUTION_COMPLETED,
)


async def _record_a_run(bootstrap: str, env: dict[str, str]) -> dict[str, str]:
    """Both lanes, success and real driver failures (an id the local-process driver refuses), a
    session delete, a redelivered input, a terminal phase, and two dead letters."""
    topics = load_settings(env).topics
    ids = {
        "wf": f"wfx_rp_{RUN}",
        "wf_bad": f"wfx_rp/{RUN}",
        "axr": f"axr_rp_{RUN}",
        "ses": f"ses_rp_{RUN}",
        "axr_bad": f"axr_rpbad_{RUN}",
        "ses_bad": f"ses_rp/{RUN}",
    }
    first = created(ids["wf"], WF, event_id=f"evt-wf-{RUN}", workflow_execution_target=common_pb2.CLOUD)
    async with running_pod(env):
        await produce(
            bootstrap,
            env,
            first,
            created(ids["wf_bad"], WF, workflow_execution_target=common_pb2.CLOUD),
            created(ids["axr"], AG, session_id=ids["ses"], session_execution_target=common_pb2.CLOUD),
            created(ids["axr_bad"], AG, session_id=ids["ses_bad"], session_execution_target=common_pb2.CLOUD),
            created(f"wfx_rp_local_{RUN}", WF, workflow_execution_target=common_pb2.LOCAL),
        )
        await read_topic(bootstrap, topics.outcomes, at_least=4)
        good = encode(first)
        await produce_raw(
            bootstrap, topics.execution_created, b"\x08\xff\xff garbage", good.key, good.headers
        )
        await produce(
            bootstrap,
            env,
            first,  # redelivered
            phase(ids["wf"], WF, PENDING, RUNNING),
            phase(ids["wf"], WF, RUNNING, DONE),
            phase(
                ids["axr_bad"], AG, PENDING, common_pb2.EXECUTION_FAILED, "runner never came", ids["ses_bad"]
            ),
            phase(f"wfx_rp_never_{RUN}", WF, RUNNING, DONE),  # unknown execution: dead-lettered
            inputs_pb2.SessionDeleted(meta=new_meta(), session_id=ids["ses"]),
        )
        await read_topic(bootstrap, topics.outcomes, at_least=6)
        await read_topic(bootstrap, topics.dead_letter, at_least=2)
    return ids


def replay_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumers.tools.cli", "replay", "--log-level", "warning", *args],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_a_clean_run_replays_with_zero_divergence_and_tampering_is_reported_precisely(
    kafka_bootstrap: str, tmp_path: Path, no_leaked_runners: None
) -> None:
    env = unique_env(kafka_bootstrap, tmp_path)
    settings = load_settings(env)
    topics = settings.topics
    ids = await _record_a_run(kafka_bootstrap, env)

    report = await replay(kafka_bootstrap, topics, lane_config(settings), guarantee=settings.guarantee)
    assert report.divergences == [], json.dumps(report.as_dict(), indent=1)
    assert report.derived_outcomes == report.recorded_outcomes == report.matched_outcomes == 6
    assert report.matched_dead_letters == report.recorded_dead_letters == 2
    assert report.duplicates_ignored == 1
    assert report.states_compared == report.states_matched >= 6  # incl. the pre-stamped status.error

    # A narrower window compares fewer decisions, still exactly.
    narrow = await replay(
        kafka_bootstrap,
        topics,
        lane_config(settings),
        guarantee=settings.guarantee,
        window=Window(from_offset=3),
    )
    assert narrow.divergences == [] and 0 < narrow.in_window < report.in_window

    clean = replay_cli(env, "--from-beginning", "--report", str(tmp_path / "clean.json"))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "no divergence" in clean.stdout
    assert json.loads((tmp_path / "clean.json").read_text())["summary"]["divergences"] == 0

    # Tamper: a forged outcome, and the real session failure appended again with a changed reason.
    recorded = await read_topic(kafka_bootstrap, topics.outcomes, at_least=6)
    failed = next(
        r.message
        for r in recorded
        if isinstance(r.message, outcomes_pb2.SandboxFailed) and r.message.execution_id == ids["axr_bad"]
    )
    changed = outcomes_pb2.SandboxFailed()
    changed.CopyFrom(failed)
    changed.reason = "quota exceeded"
    forged = outcomes_pb2.SandboxProvisioned(
        meta=new_meta(causation_id="evt-nobody"), execution_id=f"wfx_forged_{RUN}", probe_state="running"
    )
    forged.sandbox.CopyFrom(failed.sandbox)
    for message in (forged, changed):
        record = encode(message, source="mallory")
        await produce_raw(kafka_bootstrap, topics.outcomes, record.value, record.key, record.headers)

    tampered = replay_cli(env, "--report", str(tmp_path / "tampered.json"))
    assert tampered.returncode == 1, tampered.stdout + tampered.stderr
    assert "DIVERGED: 2 divergences" in tampered.stdout, tampered.stdout
    doc = json.loads((tmp_path / "tampered.json").read_text())
    by_kind = {d["kind"]: d for d in doc["divergences"]}
    assert sorted(by_kind) == ["conflicting_outcome", "unexpected_outcome"]
    assert by_kind["unexpected_outcome"]["event_id"] == forged.meta.event_id
    assert by_kind["unexpected_outcome"]["causation_id"] == "evt-nobody"
    conflict = by_kind["conflicting_outcome"]
    assert conflict["event_id"] == failed.meta.event_id and conflict["key"] == ids["axr_bad"]
    assert conflict["fields"] == {"reason": {"first": failed.reason, "again": "quota exceeded"}}


async def test_replay_never_builds_the_driver_and_touches_no_sandbox(
    kafka_bootstrap: str, tmp_path: Path, no_leaked_runners: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = unique_env(kafka_bootstrap, tmp_path)
    topics = load_settings(env).topics
    execution_id = f"wfx_rpnone_{RUN}"
    async with running_pod(env):
        await produce(
            kafka_bootstrap, env, created(execution_id, WF, workflow_execution_target=common_pb2.CLOUD)
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
        await produce(kafka_bootstrap, env, phase(execution_id, WF, PENDING, DONE))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
    records_dir = tmp_path / "sandboxes" / ".local-process"
    before = sorted(p.name for p in records_dir.glob("*")) if records_dir.exists() else []
    assert processes_under(tmp_path) == []

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("replay built the configured driver")

    import consumers.ops.compose
    import drivers.registry

    monkeypatch.setattr(drivers.registry, "new_sandbox_provisioner", refuse)
    monkeypatch.setattr(consumers.ops.compose, "new_sandbox_provisioner", refuse)
    monkeypatch.setattr(consumers.ops.compose, "build_provisioner", refuse)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["replay", "--from-beginning", "--report", str(tmp_path / "r.json")])
    assert await asyncio.to_thread(args.func, args) == 0  # the CLI's own asyncio.run, off this loop
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["matched_outcomes"] == 2
    assert processes_under(tmp_path) == []  # the replayed ExecutionCreated started no runner
    after = sorted(p.name for p in records_dir.glob("*")) if records_dir.exists() else []
    assert after == before
