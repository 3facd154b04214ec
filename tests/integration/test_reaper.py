"""The reaper: the pure plan, then `sandbox-lanes reap` and the pod's periodic pass on real parts.

Real Kafka holds the execution state (written by the real pod), the real local-process
driver and the real Docker engine hold the sandboxes; a sandbox without our labels (a
foreign process or container) must survive every pass.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest
from harness.dockerd import Dockerd

from consumers.lanes.commands import LaneConfig
from consumers.lanes.reap import plan_reap, reaped_event
from consumers.ops.reaper import start_periodic_reaper
from consumers.ops.settings import load_settings
from drivers.contract import ManagedSandbox, SandboxEnvironment, SandboxScope
from drivers.docker import new_docker_provisioner
from drivers.local_process import new_local_process_provisioner
from drivers.naming import LABEL_SANDBOX_ID, sandbox_base_name
from events.codec import OUTCOME_TYPES, decode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2
from tests.support.chaos_verify import read_all
from tests.support.pod_harness import ROOT, PodProcess, produce, read_topic, running_pod, unique_env
from tests.support.proc_util import runner_pids

LOG = logging.getLogger("tests.reaper")
RUN = uuid.uuid4().hex[:8]


# --- the pure plan -------------------------------------------------------------------------------


def _state(
    key: str,
    *,
    phase: int = 0,
    kind: int = common_pb2.WORKFLOW_EXECUTION,
    session: str = "",
    records: tuple[tuple[int, str, int], ...] = (),
    at: int = 100,
) -> state_pb2.ExecutionState:
    state = state_pb2.ExecutionState(
        execution_id=key,
        created=kind != 0,
        kind=kind,
        phase=phase,
        session_id=session,  # type: ignore[arg-type]
    )
    state.updated_at.FromSeconds(at)
    for scope, sid, lifecycle in records:
        status = state.sandboxes.add()
        status.sandbox.scope = scope  # type: ignore[assignment]
        status.sandbox.sandbox_id = sid
        status.lifecycle = lifecycle  # type: ignore[assignment]
    return state


def _sb(scope: SandboxScope, sid: str, created_at: float | None = 0.0) -> ManagedSandbox:
    return ManagedSandbox(scope, sid, sandbox_base_name(scope, sid), "running", created_at=created_at)


def test_plan_reap_rules() -> None:
    wf, ses = common_pb2.SANDBOX_SCOPE_WORKFLOW, common_pb2.SANDBOX_SCOPE_SESSION
    states = {
        "wfx_done": _state("wfx_done", phase=common_pb2.EXECUTION_COMPLETED),
        "wfx_live": _state("wfx_live", phase=common_pb2.EXECUTION_IN_PROGRESS),
        "wfx_paused": _state("wfx_paused", phase=common_pb2.EXECUTION_PAUSED),
        "axr_1": _state(
            "axr_1",
            kind=common_pb2.AGENT_EXECUTION,
            session="ses_live",
            records=((ses, "ses_live", state_pb2.SANDBOX_PROVISIONED),),
        ),
        "ses_gone": _state(
            "ses_gone", kind=0, records=((ses, "ses_gone", state_pb2.SANDBOX_TEARDOWN_FAILED),), at=200
        ),
        "axr_2": _state(
            "axr_2",
            kind=common_pb2.AGENT_EXECUTION,
            session="ses_gone",
            records=((ses, "ses_gone", state_pb2.SANDBOX_PROVISIONED),),
            at=150,
        ),
        "ses_back": _state(
            "ses_back", kind=0, records=((ses, "ses_back", state_pb2.SANDBOX_DEPROVISIONED),), at=100
        ),
        "axr_3": _state(
            "axr_3",
            kind=common_pb2.AGENT_EXECUTION,
            session="ses_back",
            records=((ses, "ses_back", state_pb2.SANDBOX_PROVISIONED),),
            at=300,
        ),
    }
    del wf
    now, grace = 1000.0, 600.0
    managed = [
        _sb("workflow", "wfx_done", created_at=990),
        _sb("workflow", "wfx_live", created_at=0),
        _sb("workflow", "wfx_paused", created_at=0),
        _sb("workflow", "wfx_orphan_old", created_at=100),
        _sb("workflow", "wfx_orphan_young", created_at=900),
        _sb("workflow", "wfx_orphan_ageless", created_at=None),
        _sb("session", "ses_live", created_at=0),
        _sb("session", "ses_gone", created_at=990),
        _sb("session", "ses_back", created_at=0),
        _sb("session", "ses_orphan_old", created_at=0),
        _sb("session", "ses_orphan_young", created_at=999),
        _sb("connect", "mcp_1", created_at=0),
    ]
    plans = {p.sandbox.sandbox_id: p for p in plan_reap(managed, states, now, grace)}
    verdicts = {k: p.verdict for k, p in plans.items()}
    assert verdicts == {
        "wfx_done": "reap",
        "wfx_live": "keep",
        "wfx_paused": "keep",  # PAUSED is not terminal
        "wfx_orphan_old": "reap",
        "wfx_orphan_young": "keep",
        "wfx_orphan_ageless": "keep",  # an age the driver cannot tell is never past grace
        "ses_live": "keep",
        "ses_gone": "reap",  # deleted after its last provisioning
        "ses_back": "keep",  # provisioned again after the delete
        "ses_orphan_old": "reap",
        "ses_orphan_young": "keep",
        "mcp_1": "keep",
    }
    assert plans["wfx_done"].reason == "execution terminal (EXECUTION_COMPLETED)"
    assert plans["wfx_done"].phase == common_pb2.EXECUTION_COMPLETED
    assert plans["ses_gone"].reason == "session deleted"
    assert plans["wfx_orphan_old"].reason == "no execution state past grace"
    # A refused create's half-done sandbox (created, never started) is reaped: nothing else will.
    refused = _state("wfx_refused", phase=common_pb2.EXECUTION_PENDING)
    refused.refused, refused.refusal_reason = True, "start failed"
    (plan,) = plan_reap(
        [_sb("workflow", "wfx_refused", created_at=990)], {"wfx_refused": refused}, now, grace
    )
    assert (plan.verdict, plan.reason) == ("reap", "execution refused (create)")
    # A terminal execution whose own teardown is decided and not folded back yet is the lane's to
    # remove: a reap would race it and report the removal twice. Once folded, the rule applies.
    tearing = _state("wfx_tearing", phase=common_pb2.EXECUTION_COMPLETED)
    tearing.pending.add(
        op=state_pb2.EFFECT_OP_DEPROVISION, scope=common_pb2.SANDBOX_SCOPE_WORKFLOW, sandbox_id="wfx_tearing"
    )
    listed = [_sb("workflow", "wfx_tearing", created_at=990)]
    (plan,) = plan_reap(listed, {"wfx_tearing": tearing}, now, grace)
    assert (plan.verdict, plan.reason) == (
        "keep",
        "execution terminal (EXECUTION_COMPLETED), its teardown in flight",
    )
    other_sandbox = _state("wfx_tearing", phase=common_pb2.EXECUTION_COMPLETED)
    other_sandbox.pending.add(
        op=state_pb2.EFFECT_OP_DEPROVISION, scope=common_pb2.SANDBOX_SCOPE_SESSION, sandbox_id="wfx_tearing"
    )
    ensuring = _state("wfx_tearing", phase=common_pb2.EXECUTION_COMPLETED)
    ensuring.pending.add(
        op=state_pb2.EFFECT_OP_ENSURE, scope=common_pb2.SANDBOX_SCOPE_WORKFLOW, sandbox_id="wfx_tearing"
    )
    for not_its_teardown in (other_sandbox, ensuring):
        (plan,) = plan_reap(listed, {"wfx_tearing": not_its_teardown}, now, grace)
        assert plan.verdict == "reap", plan
    # The removal event's id is deterministic per (scope, id, creation time).
    lane = LaneConfig(enabled=True, driver_name="local-process")
    one, two = reaped_event(plans["wfx_done"], lane, 1.0), reaped_event(plans["wfx_done"], lane, 2.0)
    assert one.meta.event_id == two.meta.event_id and one.execution_id == "wfx_done"
    other = plan_reap([_sb("workflow", "wfx_done", created_at=991)], states, now, grace)[0]
    assert reaped_event(other, lane, 1.0).meta.event_id != one.meta.event_id


async def test_a_candidate_gone_since_the_listing_is_not_reaped_again() -> None:
    """The listing precedes the state read, so a lane's teardown can remove a candidate in between:
    nothing is deprovisioned and no SandboxReaped is written for it. A live one is removed."""
    from harness.memory_driver import MemoryProvisioner

    from consumers.ops.reaper import Reaper, ReapResult
    from consumers.runtime.kafka.topology import Topics

    class Outcomes:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        async def send_and_wait(self, topic: str, value: bytes, **_: Any) -> None:
            self.sent.append(value)

    provisioner = MemoryProvisioner()
    await provisioner.ensure("workflow", "wfx_still_here", SandboxEnvironment(task_queue="wfexec:x"))
    reaper = Reaper(provisioner, "127.0.0.1:9", Topics(), LaneConfig(enabled=True, driver_name="memory"))
    now, grace = 1000.0, 600.0
    done = {k: _state(k, phase=common_pb2.EXECUTION_COMPLETED) for k in ("wfx_gone", "wfx_still_here")}
    plans = plan_reap([_sb("workflow", k, created_at=990) for k in done], done, now, grace)
    results = [ReapResult(p) for p in plans]
    outcomes = Outcomes()
    for result in results:
        await reaper._remove(result, outcomes)  # type: ignore[arg-type]
    by_id = {r.plan.sandbox.sandbox_id: r for r in results}
    assert (by_id["wfx_gone"].removed, by_id["wfx_gone"].event_id, by_id["wfx_gone"].error) == (False, "", "")
    assert by_id["wfx_still_here"].removed and by_id["wfx_still_here"].event_id
    assert [c.sandbox_id for c in provisioner.calls if c.op == "deprovision"] == ["wfx_still_here"]
    assert len(outcomes.sent) == 1


# --- real parts ----------------------------------------------------------------------------------


def wf_created(execution_id: str) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        workflow_execution_target=common_pb2.CLOUD,
        caller_identity_id="ida_reap",
    )


def agent_created(execution_id: str, session_id: str) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id=execution_id,
        session_id=session_id,
        session_execution_target=common_pb2.CLOUD,
        caller_identity_id="ida_reap",
    )


def wf_phase(execution_id: str, previous: int, new: int) -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        previous_phase=previous,
        new_phase=new,  # type: ignore[arg-type]
    )


def reap_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumers.tools.cli", "reap", "--log-level", "warning", *args],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def _reaped(bootstrap: str, topic: str) -> list[outcomes_pb2.SandboxReaped]:
    """Every committed ``SandboxReaped`` so far: the topic read up to its end offsets (a broker-side
    end, so "none" means none was written before the read, not "none arrived within a settle")."""
    records = await read_all(bootstrap, topic)
    messages = [
        decode(r.key, r.value, [(k, v.encode()) for k, v in r.headers.items()], allowed=OUTCOME_TYPES)
        for r in records
    ]
    return [m for m in messages if isinstance(m, outcomes_pb2.SandboxReaped)]


async def _older_than(driver: Any, sandbox_id: str, age_s: float, timeout_s: float = 30.0) -> None:
    """Wait until the driver's own listing dates ``sandbox_id`` more than ``age_s`` in the past."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = {m.sandbox_id: m for m in await driver.list_managed()}
        created = listed[sandbox_id].created_at if sandbox_id in listed else None
        if created is not None and time.time() - created > age_s:
            return
        assert time.monotonic() < deadline, f"{sandbox_id} not older than {age_s}s: {listed.get(sandbox_id)}"
        await asyncio.sleep(0.2)


async def _until_gone(queues: dict[str, str], timeout_s: float = 15.0) -> list[str]:
    """The keys whose runner still runs once every runner of ``queues`` is gone, or at the deadline
    (a removed runner is a child of this process until its watcher reaps it)."""
    deadline = time.monotonic() + timeout_s
    while (left := [k for k, q in queues.items() if runner_pids(q)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return left


async def _leave_state_behind(bootstrap: str, env: dict[str, str], ids: dict[str, str]) -> None:
    """The real pod writes the state: live + finished workflows, a live and a deleted session."""
    topics = load_settings(env).topics
    async with running_pod(env):
        await produce(
            bootstrap,
            env,
            wf_created(ids["live"]),
            wf_created(ids["done"]),
            agent_created(ids["axr_live"], ids["ses_live"]),
            agent_created(ids["axr_gone"], ids["ses_gone"]),
        )
        await read_topic(bootstrap, topics.outcomes, at_least=4)
        await produce(
            bootstrap,
            env,
            wf_phase(ids["done"], common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_COMPLETED),
            inputs_pb2.SessionDeleted(meta=new_meta(), session_id=ids["ses_gone"]),
        )
        await read_topic(bootstrap, topics.outcomes, at_least=6)


@pytest.mark.kafka
async def test_reap_cli_with_the_local_process_driver(
    kafka_bootstrap: str, tmp_path: Path, no_leaked_runners: None
) -> None:
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_REAP_INTERVAL_S="0")
    topics = load_settings(env).topics
    ids = {
        k: f"{k}_{RUN}" for k in ("live", "done", "orphan", "axr_live", "ses_live", "axr_gone", "ses_gone")
    }
    await _leave_state_behind(kafka_bootstrap, env, ids)
    driver = new_local_process_provisioner(load_settings(env).driver, LOG)
    # Leaks: teardowns that did not happen (the driver re-creates what the pod removed) and an orphan.
    for scope, sid, queue in (
        ("workflow", ids["done"], f"wfexec:{ids['done']}"),
        ("session", ids["ses_gone"], f"session:{ids['ses_gone']}"),
        ("workflow", ids["orphan"], f"wfexec:{ids['orphan']}"),
    ):
        await driver.ensure(scope, sid, SandboxEnvironment(task_queue=queue))  # type: ignore[arg-type]
    # A foreign process: same runner, same workspace tree, no record of ours.
    foreign = subprocess.Popen(
        [sys.executable, "-m", "consumers.tools.stub_runner"],
        env={
            **os.environ,
            "STIGMER_TASK_QUEUE": f"foreign:{RUN}",
            "WORKSPACE_ROOT_DIR": str(tmp_path / "foreign"),
            "PYTHONPATH": str(ROOT),
        },
        start_new_session=True,
    )
    queues = {
        "live": f"wfexec:{ids['live']}",
        "done": f"wfexec:{ids['done']}",
        "orphan": f"wfexec:{ids['orphan']}",
        "ses_live": f"session:{ids['ses_live']}",
        "ses_gone": f"session:{ids['ses_gone']}",
    }
    try:
        assert all(len(runner_pids(q)) == 1 for q in queues.values())
        # Dry run with a long grace: the orphan is young; the two finished ones are listed, nothing changes.
        dry = reap_cli(env, "--grace", "3600")
        assert dry.returncode == 0, dry.stderr
        assert "2 to reap, 0 removed" in dry.stdout and "dry run" in dry.stdout, dry.stdout
        await _older_than(driver, ids["orphan"], 2.0)  # past a 2 s grace by the driver's own record
        dry = reap_cli(env, "--grace", "2")
        assert "3 to reap, 0 removed" in dry.stdout, dry.stdout
        assert all(len(runner_pids(q)) == 1 for q in queues.values()), "a dry run changed something"
        assert await _reaped(kafka_bootstrap, topics.outcomes) == []

        applied = reap_cli(env, "--apply", "--grace", "2")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "3 removed, 0 failed" in applied.stdout, applied.stdout
        removed = {k: q for k, q in queues.items() if k in ("done", "orphan", "ses_gone")}
        assert await _until_gone(removed) == []
        # The reap has exited (nothing else removes runners here): the live ones are still there.
        assert [k for k, q in queues.items() if runner_pids(q)] == ["live", "ses_live"]
        assert foreign.poll() is None, "the reaper touched a process without our record"
        events = await _reaped(kafka_bootstrap, topics.outcomes)
        by_id = {e.sandbox.sandbox_id: e for e in events}
        assert sorted(by_id) == sorted([ids["done"], ids["ses_gone"], ids["orphan"]])
        assert by_id[ids["done"]].reason == "execution terminal (EXECUTION_COMPLETED)"
        assert by_id[ids["done"]].execution_id == ids["done"]
        assert by_id[ids["ses_gone"]].reason == "session deleted"
        assert by_id[ids["orphan"]].reason == "no execution state past grace"
        assert by_id[ids["orphan"]].age_seconds >= 2
        assert len({e.meta.event_id for e in events}) == 3

        # A second pass finds nothing left to do and writes nothing.
        again = reap_cli(env, "--apply", "--grace", "2")
        assert "0 to reap, 0 removed" in again.stdout, again.stdout
        assert len(await _reaped(kafka_bootstrap, topics.outcomes)) == 3
    finally:
        foreign.kill()
        foreign.wait(10)
        for scope, sid in (("workflow", ids["live"]), ("session", ids["ses_live"])):
            await driver.deprovision(scope, sid)  # type: ignore[arg-type]
        await driver.close()


@pytest.mark.kafka
async def test_the_pods_periodic_reaper_removes_an_orphan_and_counts_it(
    kafka_bootstrap: str, tmp_path: Path, no_leaked_runners: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sandbox_lanes.reaper")
    env = unique_env(
        kafka_bootstrap, tmp_path, SANDBOX_LANES_REAP_INTERVAL_S="0.5", SANDBOX_LANES_REAP_GRACE_S="1"
    )
    settings = load_settings(env)
    orphan, live = f"wfx_porphan_{RUN}", f"wfx_plive_{RUN}"
    driver = new_local_process_provisioner(settings.driver, LOG)
    await driver.ensure("workflow", orphan, SandboxEnvironment(task_queue=f"wfexec:{orphan}"))
    async with running_pod(env) as composed:
        await produce(kafka_bootstrap, env, wf_created(live))
        await read_topic(kafka_bootstrap, settings.topics.outcomes, at_least=1)
        (born,) = [m.created_at for m in await driver.list_managed() if m.sandbox_id == live]
        assert born is not None
        task = start_periodic_reaper(settings, composed)
        assert task is not None
        deadline = time.monotonic() + 20
        while runner_pids(f"wfexec:{orphan}") and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert runner_pids(f"wfexec:{orphan}") == []
        # The live sandbox stays (its state is PENDING). A positive barrier first: a whole pass that
        # started once the live sandbox was past the 1 s grace (a sandbox without a state that old
        # is reaped, as the orphan was) and listed it. Passes run one after another, so the second
        # pass logged after that moment started after it.
        while (aged := time.time()) - born <= 1.0:
            await asyncio.sleep(0.05)

        def passes_since() -> list[logging.LogRecord]:
            return [
                r
                for r in caplog.records
                if r.name == "sandbox_lanes.reaper" and r.getMessage() == "reaper pass" and r.created > aged
            ]

        deadline = time.monotonic() + 20
        while len(passes_since()) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        judged = passes_since()
        assert len(judged) >= 2, caplog.text[-3000:]
        assert len(runner_pids(f"wfexec:{live}")) == 1
        second = judged[1]
        counts = tuple(second.__dict__.get(k) for k in ("listed", "removed", "failed"))
        assert counts == (1, 0, 0), second.__dict__  # the live one listed past grace, and kept
        assert composed.metrics.reaped.labels("local-process")._value.get() == 1
    assert task.done()  # the pod awaited its background task on stop
    events = await _reaped(kafka_bootstrap, settings.topics.outcomes)
    assert [e.sandbox.sandbox_id for e in events] == [orphan]
    await driver.deprovision("workflow", live)
    await driver.close()


@pytest.mark.kafka
@pytest.mark.docker
async def test_reap_with_the_docker_driver_never_touches_a_foreign_container(
    kafka_bootstrap: str, dockerd: Dockerd, docker_image: str, tmp_path: Path
) -> None:
    ids = {
        k: f"{k}_dk_{RUN}" for k in ("live", "done", "orphan", "axr_live", "ses_live", "axr_gone", "ses_gone")
    }
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="docker",
        SANDBOX_LANES_DRIVER_OPTIONS=f"docker_host={dockerd.socket_url},image={docker_image},network=none",
        STIGMER_SANDBOX_BACKEND_ENDPOINT="http://127.0.0.1:7234",
        STIGMER_SANDBOX_TEMPORAL_ADDRESS="127.0.0.1:7233",
        SANDBOX_LANES_REAP_INTERVAL_S="0",
    )
    topics = load_settings(env).topics
    client: Any = docker.DockerClient(base_url=dockerd.socket_url, version="auto")
    driver = new_docker_provisioner(load_settings(env).driver, LOG)
    foreign_names = [f"foreign-{RUN}", sandbox_base_name("workflow", f"lookalike_{RUN}")]
    try:
        await _leave_state_behind(kafka_bootstrap, env, ids)
        for scope, sid, queue in (
            ("workflow", ids["done"], f"wfexec:{ids['done']}"),
            ("session", ids["ses_gone"], f"session:{ids['ses_gone']}"),
            ("workflow", ids["orphan"], f"wfexec:{ids['orphan']}"),
        ):
            await driver.ensure(scope, sid, SandboxEnvironment(task_queue=queue))  # type: ignore[arg-type]
        for name in foreign_names:  # no labels of ours (one even carries a sandbox-shaped name)
            await asyncio.to_thread(
                client.containers.run,
                docker_image,
                ["sleep", "600"],
                name=name,
                detach=True,
                network_mode="none",
            )
        names = {
            k: sandbox_base_name("session" if k.startswith("ses") else "workflow", v)
            for k, v in ids.items()
            if k in ("live", "done", "orphan", "ses_live", "ses_gone")
        }

        def present() -> set[str]:
            return {c.name for c in client.containers.list(all=True)}

        assert set(names.values()) | set(foreign_names) <= present()
        await _older_than(driver, ids["orphan"], 2.0)  # past a 2 s grace by the driver's own record
        dry = reap_cli(env, "--grace", "2")
        assert dry.returncode == 0 and "3 to reap, 0 removed" in dry.stdout, dry.stdout + dry.stderr
        assert set(names.values()) | set(foreign_names) <= present()
        applied = reap_cli(env, "--apply", "--grace", "2")
        assert applied.returncode == 0 and "3 removed, 0 failed" in applied.stdout, (
            applied.stdout + applied.stderr
        )
        left = present()
        assert {k for k, n in names.items() if n in left} == {"live", "ses_live"}
        assert set(foreign_names) <= left
        assert all(client.containers.get(n).status == "running" for n in foreign_names)
        events = await _reaped(kafka_bootstrap, topics.outcomes)
        assert sorted(e.sandbox.sandbox_id for e in events) == sorted(
            [ids["done"], ids["ses_gone"], ids["orphan"]]
        )
        assert {e.sandbox.driver for e in events} == {"docker"}
    finally:
        for c in client.containers.list(all=True):
            if c.name in foreign_names or c.labels.get(LABEL_SANDBOX_ID, "").endswith(RUN):
                c.remove(force=True)
        await driver.close()
        client.close()


@pytest.mark.kafka
async def test_sandbox_lanes_run_starts_the_periodic_reaper(
    kafka_bootstrap: str, tmp_path: Path, no_leaked_runners: None
) -> None:
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_LANES_REAP_INTERVAL_S="0.5",
        SANDBOX_LANES_REAP_GRACE_S="1",
        SANDBOX_LANES_HTTP_PORT="0",
    )
    orphan = f"wfx_runorphan_{RUN}"
    driver = new_local_process_provisioner(load_settings(env).driver, LOG)
    await driver.ensure("workflow", orphan, SandboxEnvironment(task_queue=f"wfexec:{orphan}"))
    pod = PodProcess(env, tmp_path / "pod.log")
    pod.start()
    try:
        await pod.wait_for_log("Sandbox reaped", timeout_s=60)
        assert runner_pids(f"wfexec:{orphan}") == []
    finally:
        code, seconds = await asyncio.to_thread(pod.terminate)
        await driver.close()
    assert code == 0 and seconds < 30
    assert "periodic reaper on" in pod.log()


# --- the reaper in the effect runner's per-sandbox order (issue 34) ---------------------------------


async def _a_recover_while_the_reaper_runs(driver: Any, sandbox_id: str, *, held: bool) -> None:
    """The reaper plans a sandbox no state names (an orphan past grace), then a take-over restores
    its execution's live state and resumes its ensure through the pod's effect runner. With ``held``
    the ensure is still held (the stall guard's gate) when the reaper's removal starts, so the removal
    waits for the sandbox's turn behind it; without, the ensure has run before the removal starts (a
    plan minutes old). Either way the sandbox ends alive: the removal judges again, in its turn, from
    the states as they are then. A reaper acting on its plan (or beside the order) deletes it."""
    from consumers.lanes.commands import Command, CommandResult, Ensure
    from consumers.lanes.credentials import SandboxCredentialRequest
    from consumers.ops.reaper import Reaper, ReapResult
    from consumers.ops.reaper_states import StoreStates
    from consumers.runtime.effects import EffectRunner
    from consumers.runtime.kafka.topology import Topics
    from consumers.runtime.state.store import MemoryStore

    class Outcomes:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        async def send_and_wait(self, topic: str, value: bytes, **_: Any) -> None:
            self.sent.append(value)

    env = SandboxEnvironment(task_queue=f"wfexec:{sandbox_id}")
    await driver.ensure("workflow", sandbox_id, env)  # the runner a crashed pod left behind
    assert await driver.probe("workflow", sandbox_id) == "running"
    (listed,) = [m for m in await driver.list_managed() if m.sandbox_id == sandbox_id]
    ensures: list[str] = []

    async def run(command: Command) -> CommandResult:
        state = await driver.ensure(command.scope, command.sandbox_id, env)
        ensures.append(state)
        return CommandResult(ok=True, probe_state=state)

    gate_open = asyncio.Event()
    if not held:
        gate_open.set()
    runner = EffectRunner(run, concurrency=4, gate=gate_open.wait)
    runner.own([0])
    store = MemoryStore("state")  # the pod's held states: one partition (0), held by this pod
    store.put(0, "wfx_another", _state("wfx_another", phase=common_pb2.EXECUTION_IN_PROGRESS))
    reaper = Reaper(
        driver,
        "127.0.0.1:9",
        Topics(),
        LaneConfig(enabled=True, driver_name=driver.driver_name),
        grace_s=0.0,
        local=StoreStates(store, lambda _key: 0),
        order=runner.exclusive,
    )
    (plan,) = plan_reap([listed], {}, time.time() + 1, 0.0)
    assert plan.verdict == "reap", plan  # an orphan when the pass planned
    # The take-over: the execution's live state restored, its pending ensure resumed.
    store.put(0, sandbox_id, _state(sandbox_id, phase=common_pb2.EXECUTION_IN_PROGRESS))
    mint = SandboxCredentialRequest("workflow", "", sandbox_id, "org", "usr")
    assert runner.submit(
        0, sandbox_id, f"effect-{sandbox_id}", Ensure("workflow", sandbox_id, env.task_queue, "", mint, True)
    )
    if not held:
        await wait_until(lambda: runner.outstanding == 1 and runner.ready.is_set())
    outcomes = Outcomes()
    result = ReapResult(plan)
    removal = asyncio.create_task(reaper._remove(result, outcomes))  # type: ignore[arg-type]
    if held:
        await wait_until(lambda: len(runner._chains[("workflow", sandbox_id)]) == 2)  # queued behind
        assert not removal.done() and ensures == []
        gate_open.set()
    await asyncio.wait_for(removal, 60)
    assert ensures == ["running"]
    assert (result.removed, result.error, outcomes.sent) == (False, "", [])
    assert await driver.probe("workflow", sandbox_id) == "running", "the recovered sandbox was reaped"

    # Once the execution is over, the same removal in the same order does reap it.
    store.put(0, sandbox_id, _state(sandbox_id, phase=common_pb2.EXECUTION_COMPLETED))
    (done,) = plan_reap(
        [listed], {sandbox_id: _state(sandbox_id, phase=common_pb2.EXECUTION_COMPLETED)}, time.time(), 0.0
    )
    again = ReapResult(done)
    await asyncio.wait_for(reaper._remove(again, outcomes), 60)
    assert again.removed and len(outcomes.sent) == 1
    assert await driver.probe("workflow", sandbox_id) == "absent"


async def wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("held", [True, False], ids=["ensure-held-in-its-turn", "ensure-done-before"])
async def test_a_recover_re_ensuring_a_local_process_sandbox_while_the_reaper_runs_keeps_it(
    tmp_path: Path, held: bool
) -> None:
    from drivers.contract import DriverConfig
    from tests.support.runner_stub import runner_command

    driver = new_local_process_provisioner(
        DriverConfig(
            runner_command=runner_command(), options={"state_dir": str(tmp_path), "grace_seconds": "1"}
        ),
        LOG,
    )
    try:
        await _a_recover_while_the_reaper_runs(driver, f"wfx_recover_lp_{RUN}", held=held)
    finally:
        for sandbox in await driver.list_managed():
            await driver.deprovision(sandbox.scope, sandbox.sandbox_id)
        await driver.close()


@pytest.mark.parametrize("held", [True, False], ids=["ensure-held-in-its-turn", "ensure-done-before"])
async def test_a_recover_re_ensuring_a_docker_sandbox_while_the_reaper_runs_keeps_it(
    dockerd: Dockerd, docker_image: str, held: bool
) -> None:
    from drivers.contract import DriverConfig

    driver = new_docker_provisioner(
        DriverConfig(
            backend_endpoint="http://127.0.0.1:7234",
            temporal_address="127.0.0.1:7233",
            options={"docker_host": dockerd.socket_url, "image": docker_image, "network": "none"},
        ),
        LOG,
    )
    sandbox_id = f"wfx_recover_dk_{RUN}_{held}".lower()
    try:
        await _a_recover_while_the_reaper_runs(driver, sandbox_id, held=held)
    finally:
        await driver.deprovision("workflow", sandbox_id)
        await driver.close()
