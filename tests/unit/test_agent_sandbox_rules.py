"""The agent-sandbox tier's pure parts: upstream's config.test.ts, idle-decision.test.ts and
manifest.test.ts (``sandbox/agent-sandbox/__tests__``), same meaning."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from drivers.agent_sandbox.idle import (
    SUSPEND_AFTER_ENV,
    SWEEP_INTERVAL_ENV,
    IdleConfig,
    SandboxView,
    SessionActivity,
    idle_config,
    should_suspend,
)
from drivers.agent_sandbox.manifests import owned_secret_manifest, sandbox_manifest, wake_patch
from drivers.contract import DriverConfig, SandboxEnvironment
from drivers.naming import sandbox_base_name

CONFIG = DriverConfig(
    backend_endpoint="http://stigmer-server.stigmer.svc:7234",
    temporal_address="temporal-frontend.temporal.svc:7233",
    runner_image="ghcr.io/stigmer/runner:test",
    kubernetes_namespace="stigmer-sandboxes",
    temporal_namespace="sandboxes",
    runner_env={"RUNNER_LOG_LEVEL": "debug"},
    runner_secret_env={"ANTHROPIC_API_KEY": "sk-ant-secret"},
    temporal_connection_env={"STIGMER_TEMPORAL_API_KEY": "temporal-key"},
)
ENV = SandboxEnvironment(task_queue="session:ses_1", stigmer_token="tok.en.value")


# --------------------------------------------------------------------------- config.test.ts


def test_the_idle_settings_default_to_330_and_30_seconds() -> None:
    assert idle_config({}) == IdleConfig(suspend_after_s=330, sweep_interval_s=30)


def test_whole_seconds_are_taken_and_blank_means_default() -> None:
    got = idle_config({"suspend_after_seconds": "600", "sweep_interval_seconds": " "})
    assert got == IdleConfig(suspend_after_s=600, sweep_interval_s=30)


@pytest.mark.parametrize("bad", ["0", "-5", "1.5", "soon"])
def test_the_window_refuses_what_is_not_a_positive_whole_number(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        idle_config({"suspend_after_seconds": bad})
    assert str(err.value) == f"{SUSPEND_AFTER_ENV} must be a positive whole number of seconds, got {bad!r}"
    with pytest.raises(ValueError, match=SWEEP_INTERVAL_ENV):
        idle_config({"sweep_interval_seconds": bad})


def test_an_interval_longer_than_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match=f"{SWEEP_INTERVAL_ENV} \\(61\\) must not exceed"):
        idle_config({"suspend_after_seconds": "60", "sweep_interval_seconds": "61"})
    assert idle_config({"suspend_after_seconds": "60", "sweep_interval_seconds": "60"}).sweep_interval_s == 60


# --------------------------------------------------------------------------- idle-decision.test.ts

WINDOW = 330.0
T0 = 1_000_000.0
RUNNING = SandboxView(name="sbx", running=True, deleting=False, created_at=T0 - 10_000)
IDLE = SessionActivity(busy=False, last_active_at=T0)


@pytest.mark.parametrize(
    ("case", "now", "view", "activity", "ensured", "expected"),
    [
        ("suspends at exactly the window", T0 + WINDOW, RUNNING, IDLE, None, True),
        ("and beyond it", T0 + WINDOW + 3600, RUNNING, IDLE, None, True),
        ("not at 1 ms less", T0 + WINDOW - 0.001, RUNNING, IDLE, None, False),
        ("not when just active", T0 + 1, RUNNING, IDLE, None, False),
        ("not when busy", T0 + 10 * WINDOW, RUNNING, SessionActivity(True, T0), None, False),
        (
            "not when already Suspended",
            T0 + 10 * WINDOW,
            SandboxView("sbx", running=False, deleting=False, created_at=T0),
            IDLE,
            None,
            False,
        ),
        (
            "not when being deleted",
            T0 + 10 * WINDOW,
            SandboxView("sbx", running=True, deleting=True, created_at=T0),
            IDLE,
            None,
            False,
        ),
        ("not within the window of this replica's last ensure", T0 + WINDOW, RUNNING, IDLE, T0 + 100, False),
        (
            "another replica's Sandbox: the clock starts at its creation",
            T0 + WINDOW - 1,
            SandboxView("sbx", running=True, deleting=False, created_at=T0),
            SessionActivity(False, None, executions=0),
            None,
            False,
        ),
    ],
)
def test_the_idle_decision(
    case: str,
    now: float,
    view: SandboxView,
    activity: SessionActivity,
    ensured: float | None,
    expected: bool,
) -> None:
    assert should_suspend(now, WINDOW, view, activity, ensured) is expected, case


# --------------------------------------------------------------------------- manifest.test.ts


def _container(manifest: dict[str, Any]) -> dict[str, Any]:
    (container,) = manifest["spec"]["podTemplate"]["spec"]["containers"]
    return container


def test_a_session_sandbox_is_a_suspended_labelled_v1beta1_sandbox_with_one_workspace_claim() -> None:
    m = sandbox_manifest(CONFIG, "session", "ses_1", ENV)
    assert (m["apiVersion"], m["kind"]) == ("agents.x-k8s.io/v1beta1", "Sandbox")
    assert m["metadata"]["name"] == sandbox_base_name("session", "ses_1")  # pinned in test_naming_registry
    assert m["metadata"]["namespace"] == "stigmer-sandboxes"
    assert m["metadata"]["labels"] == {
        "stigmer.ai/managed-by": "stigmer-server",
        "stigmer.ai/installation": "sandbox-lanes",  # the default installation (the default group)
        "stigmer.ai/scope": "session",
        "stigmer.ai/sandbox-id": "ses_1",
    }
    assert m["spec"]["operatingMode"] == "Suspended"
    assert "service" not in m["spec"]  # no Service
    assert m["spec"]["volumeClaimTemplates"] == [
        {
            "metadata": {"name": "workspace"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}},
        }
    ]
    assert "volumes" not in m["spec"]["podTemplate"]["spec"]  # the claim template provides it


@pytest.mark.parametrize("scope", ["connect", "workflow"])
def test_connect_and_workflow_use_an_empty_dir(scope: Any) -> None:
    m = sandbox_manifest(CONFIG, scope, "x_1", ENV)
    assert "volumeClaimTemplates" not in m["spec"]
    assert m["spec"]["podTemplate"]["spec"]["volumes"] == [{"name": "workspace", "emptyDir": {}}]


def test_the_runner_container_is_the_kubernetes_tiers_with_capabilities_added_back() -> None:
    m = sandbox_manifest(CONFIG, "session", "ses_1", ENV)
    pod = m["spec"]["podTemplate"]["spec"]
    c = _container(m)
    assert c["command"] == ["/runner/bin/start", "/runner/dist/main.js"]
    assert c["image"] == "ghcr.io/stigmer/runner:test" and c["workingDir"] == "/workspace"
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert c["resources"] == {
        "requests": {"cpu": "500m", "memory": "512Mi"},
        "limits": {"cpu": "2", "memory": "2Gi"},
    }
    assert not {"livenessProbe", "readinessProbe", "startupProbe"} & set(c)
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["SETUID", "SETGID", "CHOWN", "KILL", "DAC_OVERRIDE"]},
        "runAsUser": 0,
        "runAsGroup": 0,
    }
    assert pod["terminationGracePeriodSeconds"] == 600
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert c["volumeMounts"] == [{"name": "workspace", "mountPath": "/workspace"}]


def test_the_env_contract_with_every_secret_an_optional_secret_key_ref() -> None:
    env = {e["name"]: e for e in _container(sandbox_manifest(CONFIG, "session", "ses_1", ENV))["env"]}
    plain = {k: v["value"] for k, v in env.items() if "value" in v}
    assert plain == {
        "MODE": "local",
        "STIGMER_TASK_QUEUE": "session:ses_1",
        "STIGMER_BACKEND_ENDPOINT": "http://stigmer-server.stigmer.svc:7234",
        "TEMPORAL_SERVICE_ADDRESS": "temporal-frontend.temporal.svc:7233",
        "WORKSPACE_ROOT_DIR": "/workspace",
        "TEMPORAL_NAMESPACE": "sandboxes",
        "HOME": "/root",
        "RUNNER_LOG_LEVEL": "debug",
    }  # no STIGMER_MCP_PUBLIC_ENDPOINT when unset
    refs = {k: v["valueFrom"]["secretKeyRef"] for k, v in env.items() if "valueFrom" in v}
    assert set(refs) == {"STIGMER_TOKEN", "ANTHROPIC_API_KEY", "STIGMER_TEMPORAL_API_KEY"}
    for key, ref in refs.items():
        assert ref == {"name": f"{sandbox_manifest(CONFIG, 'session', 'ses_1', ENV)['metadata']['name']}-env",
                       "key": key, "optional": True}  # fmt: skip
    assert "tok.en.value" not in str(sandbox_manifest(CONFIG, "session", "ses_1", ENV))


def test_a_token_less_sandbox_has_no_token_ref_but_still_its_secret() -> None:
    tokenless = SandboxEnvironment(task_queue="session:ses_1")
    names = [e["name"] for e in _container(sandbox_manifest(CONFIG, "session", "ses_1", tokenless))["env"]]
    assert "STIGMER_TOKEN" not in names
    secret = owned_secret_manifest(CONFIG, "session", "ses_1", tokenless, "uid-1")
    assert "STIGMER_TOKEN" not in secret["data"] and "ANTHROPIC_API_KEY" in secret["data"]


def test_the_secret_is_owned_by_the_sandbox_and_holds_the_runner_secrets() -> None:
    sandbox = sandbox_manifest(CONFIG, "session", "ses_1", ENV)
    secret = owned_secret_manifest(CONFIG, "session", "ses_1", ENV, "uid-123")
    assert secret["metadata"]["name"] == sandbox["metadata"]["name"] + "-env"
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox", "name": sandbox["metadata"]["name"],
         "uid": "uid-123"}
    ]  # fmt: skip
    decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert decoded == {
        "STIGMER_TOKEN": "tok.en.value",
        "ANTHROPIC_API_KEY": "sk-ant-secret",
        "STIGMER_TEMPORAL_API_KEY": "temporal-key",
    }


def test_the_wake_is_one_json_patch_of_add_ops_with_this_servers_template() -> None:
    patch = wake_patch(CONFIG, "session", "ses_1", ENV)
    assert [(op["op"], op["path"]) for op in patch] == [
        ("add", "/spec/operatingMode"),
        ("add", "/spec/podTemplate"),
    ]
    assert patch[0]["value"] == "Running"
    assert patch[1]["value"] == sandbox_manifest(CONFIG, "session", "ses_1", ENV)["spec"]["podTemplate"]


# --------------------------------------------------------------------------- warm pools (no upstream test)


def test_the_warm_template_holds_no_secret_and_no_per_sandbox_value() -> None:
    import json

    from drivers.agent_sandbox.warm import pool_manifest, pool_name, template_manifest

    template = template_manifest(CONFIG)
    text = json.dumps(template)
    for secret in ("sk-ant-secret", "temporal-key", "tok.en.value"):
        assert secret not in text
    (container,) = template["spec"]["podTemplate"]["spec"]["containers"]
    names = {e["name"] for e in container["env"]}
    assert "STIGMER_TASK_QUEUE" not in names and "STIGMER_TOKEN" not in names
    assert {"MODE", "STIGMER_BACKEND_ENDPOINT", "TEMPORAL_SERVICE_ADDRESS", "RUNNER_LOG_LEVEL"} <= names
    volumes = {v["name"]: v for v in template["spec"]["podTemplate"]["spec"]["volumes"]}
    assert volumes["assignment"]["emptyDir"]["medium"] == "Memory"
    assert volumes["podinfo"]["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"] == "metadata.annotations"
    assert pool_manifest(CONFIG, 4)["spec"] == {
        "replicas": 4,
        "sandboxTemplateRef": {"name": pool_name(CONFIG)},
    }
    other = DriverConfig(**{**CONFIG.__dict__, "runner_image": "ghcr.io/stigmer/runner:next"})
    assert pool_name(other) != pool_name(CONFIG)  # a new runner template is a new pool


def test_a_claim_carries_the_queue_as_an_annotation_and_no_secret() -> None:
    from drivers.agent_sandbox.warm import claim_manifest, pool_name

    claim = claim_manifest(CONFIG, "workflow", "wfx_1", SandboxEnvironment("wfexec:wfx_1", "tok.en.value"))
    assert claim["metadata"]["name"] == sandbox_base_name("workflow", "wfx_1")
    assert claim["metadata"]["labels"]["stigmer.ai/sandbox-id"] == "wfx_1"
    assert claim["spec"]["warmPoolRef"] == {"name": pool_name(CONFIG)}
    assert claim["spec"]["additionalPodMetadata"]["annotations"]["stigmer.ai/task-queue"] == "wfexec:wfx_1"
    assert "env" not in claim["spec"]  # a claim with env is always cold-started
    assert "tok.en.value" not in str(claim)


def test_the_kept_assignment_is_a_secret_owned_by_the_claim_holding_exactly_the_assignment_file() -> None:
    from drivers.agent_sandbox.warm import assignment_file, assignment_secret_manifest

    env = SandboxEnvironment("wfexec:wfx_1", "tok.en.value")
    data = assignment_file(CONFIG, env)
    secret = assignment_secret_manifest(CONFIG, "workflow", "wfx_1", data, "uid-1")
    base = sandbox_base_name("workflow", "wfx_1")
    assert secret["metadata"]["name"] == f"{base}-env"
    assert secret["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
            "kind": "SandboxClaim",
            "name": base,
            "uid": "uid-1",
        }
    ]
    assert base64.b64decode(secret["data"]["assignment.env"]) == data
    assert b"tok.en.value" in data and b"sk-ant-secret" in data
    # the values are only in the data: not in a name, a label or an owner
    assert "tok.en.value" not in str(secret["metadata"]) and "sk-ant-secret" not in str(secret["metadata"])


def test_warm_assignment_defaults_to_async_and_refuses_an_unknown_mode_at_boot(tmp_path: Any) -> None:
    from drivers.agent_sandbox.driver import new_agent_sandbox_provisioner

    kubeconfig = tmp_path / "kubeconfig"  # read at construction; nothing connects
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )

    def build(**options: str) -> Any:
        opts = {"kubeconfig": str(kubeconfig), "warm_pool_size": "2", **options}
        config = DriverConfig(**{**CONFIG.__dict__, "options": opts})
        return new_agent_sandbox_provisioner(config, __import__("logging").getLogger("test"))

    assert build().warm.assignment == "async"
    assert build(warm_assignment="sync").warm.assignment == "sync"
    with pytest.raises(ValueError, match="warm_assignment must be one of async, sync, got 'later'"):
        build(warm_assignment="later")


def test_the_assignment_file_round_trips_awkward_values_through_a_real_shell(tmp_path: Any) -> None:
    import subprocess

    from drivers.agent_sandbox.warm import assignment_file

    awkward = 'a\'b "c" $HOME `x` \\ end'
    config = DriverConfig(**{**CONFIG.__dict__, "runner_secret_env": {"ANTHROPIC_API_KEY": awkward}})
    path = tmp_path / "assignment.env"
    path.write_bytes(assignment_file(config, SandboxEnvironment("q", "tok.en.value")))
    out = subprocess.run(
        [
            "/bin/busybox",
            "sh",
            "-c",
            f'set -a; . {path}; printf "%s|%s" "$ANTHROPIC_API_KEY" "$STIGMER_TOKEN"',
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == f"{awkward}|tok.en.value"


# --------------------------------------------------------------------------- session activity (the pod's state)


class _Store:
    """The two reads StoreSessionActivity makes of a pod's held states (the real stores' session index:
    test_state_session_index.py; the idle sweep through Kafka: test_agent_sandbox_driver.py)."""

    def __init__(self, states: list[Any]) -> None:
        self._states = states

    def owned(self) -> set[int]:
        return {0}

    def referencing(self, partition: int, session_id: str) -> Any:
        from consumers.lanes.reap import sessions_referenced

        return iter((s.execution_id, s) for s in self._states if session_id in sessions_referenced(s))


class _Pod:
    def __init__(self, states: list[Any], partition: int | None = 0) -> None:
        self.states = _Store(states)
        self._partition = partition

    def input_partition_of(self, key: str) -> int | None:
        return self._partition


def _agent_state(execution_id: str, session: str, phase: int, stamp: float) -> Any:
    from events.sandbox_lanes.v1 import common_pb2, state_pb2

    state = state_pb2.ExecutionState(
        execution_id=execution_id,
        kind=common_pb2.AGENT_EXECUTION,
        session_id=session,
        created=True,
        phase=phase,
    )
    state.updated_at.FromNanoseconds(int(stamp * 1e9))
    return state


def test_session_activity_is_busy_while_any_execution_runs_and_idle_since_the_latest_stamp() -> None:
    from consumers.runtime.session_activity import StoreSessionActivity
    from events.sandbox_lanes.v1 import common_pb2

    now = 1_000_000.0
    done = common_pb2.EXECUTION_COMPLETED
    states = [
        _agent_state("axr_1", "ses_a", done, now - 500),
        _agent_state("axr_2", "ses_a", done, now - 100),
        _agent_state("axr_3", "ses_b", common_pb2.EXECUTION_IN_PROGRESS, now - 900),
        _agent_state("axr_4", "ses_c", done, now + 59),  # within the allowance: counts as it is
        _agent_state("axr_5", "ses_d", done, now - 300),
        _agent_state("axr_6", "ses_d", done, now + 61),  # more than 60 s ahead: skipped
    ]
    reader = StoreSessionActivity(_Pod(states), wall=lambda: now)  # type: ignore[arg-type]
    assert reader.activity("ses_a") == SessionActivity(busy=False, last_active_at=now - 100, executions=2)
    assert reader.activity("ses_b") == SessionActivity(busy=True, last_active_at=now - 900, executions=1)
    assert reader.activity("ses_c") == SessionActivity(busy=False, last_active_at=now + 59, executions=1)
    assert reader.activity("ses_d") == SessionActivity(busy=False, last_active_at=now - 300, executions=2)
    assert reader.activity("ses_none") == SessionActivity(busy=False, last_active_at=None, executions=0)
    # A session whose partition this pod does not own is not its to judge.
    assert StoreSessionActivity(_Pod(states, partition=7)).activity("ses_a") is None  # type: ignore[arg-type]


def _warm_script_in(tmp_path: Any, poll_s: float | None = None) -> tuple[str, Any, Any]:
    """The warm runner script (``poll_s``: its unwoken poll) with its paths moved under ``tmp_path`` and a
    runner that prints its queue."""
    from drivers.agent_sandbox.warm import (
        ASSIGNMENT_FILE,
        PODINFO_DIR,
        WARM_RUNNER_SCRIPT,
        warm_runner_script,
    )
    from drivers.runner.launch import runner_command

    (tmp_path / "podinfo").mkdir()
    runner = tmp_path / "runner"
    runner.write_text(
        '#!/bin/busybox sh\nprintf "queue=%s token=%s" "$STIGMER_TASK_QUEUE" "$STIGMER_TOKEN"\n'
    )
    runner.chmod(0o755)
    script = (
        (WARM_RUNNER_SCRIPT if poll_s is None else warm_runner_script(poll_s))
        .replace(ASSIGNMENT_FILE, str(tmp_path / "assignment.env"))
        .replace(PODINFO_DIR, str(tmp_path / "podinfo"))
        .replace(" ".join(runner_command()), str(runner))
    )
    return script, tmp_path / "assignment.env", tmp_path / "podinfo" / "annotations"


def test_a_warm_runner_takes_its_queue_from_the_assignment_file_without_the_annotation(tmp_path: Any) -> None:
    import subprocess

    from drivers.agent_sandbox.warm import assignment_file

    script, assignment, annotations = _warm_script_in(tmp_path)
    assignment.write_bytes(assignment_file(CONFIG, SandboxEnvironment("wfexec:wfx_q", "tok.en.value")))
    assert not annotations.exists()  # the downward-API copy has not caught up: no wait on it
    out = subprocess.run(
        ["/bin/busybox", "sh", "-c", script], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    assert out == "queue=wfexec:wfx_q token=tok.en.value"


def test_a_warm_runner_given_a_file_without_its_queue_waits_for_the_annotation(tmp_path: Any) -> None:
    import subprocess

    script, assignment, annotations = _warm_script_in(tmp_path)
    assignment.write_text("# stigmer sandbox assignment\nSTIGMER_TOKEN=tok.old\n")  # an older driver's file
    runner = subprocess.Popen(["/bin/busybox", "sh", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            runner.wait(timeout=0.5)  # no queue anywhere yet: still waiting
        annotations.write_text('stigmer.ai/sandbox-id="wfx_q"\nstigmer.ai/task-queue="wfexec:wfx_q"\n')
        out, _ = runner.communicate(timeout=10)
    finally:
        runner.kill()
    assert out == "queue=wfexec:wfx_q token=tok.old"


def test_a_waiting_warm_runner_is_woken_by_the_writer_of_its_file_not_by_its_poll(tmp_path: Any) -> None:
    """The lost wake-up, forced: the runner has looked for its file (not there) and is held before it
    sleeps; only then does the writer put the file in place and send its wake. A runner whose wake is
    armed late, or whose wait can miss a signal that came between its look and its sleep, sleeps out its
    60 s poll and the 10 s deadline below fails; one that cannot miss it starts at once."""
    import os
    import subprocess

    from drivers.agent_sandbox.warm import assignment_command, assignment_file

    script, assignment, _ = _warm_script_in(tmp_path, poll_s=60)  # a poll that would not find it in time
    look = '[ -s "$a" ]'
    assert script.count(look) == 1
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    # After a look that found nothing: say so, then wait (a child process: a signal that lands meanwhile
    # is handled when it ends, as one between the look and the sleep would be) until the test lets go.
    held = f'{{ {look} || {{ echo looked >&2; head -n 1 "{gate}" >/dev/null; false; }}; }}'
    runner = subprocess.Popen(
        ["/bin/busybox", "sh", "-c", script.replace(look, held)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert runner.stderr is not None
        assert runner.stderr.readline() == "looked\n"  # the fact: it has looked and is not asleep yet
        data = assignment_file(CONFIG, SandboxEnvironment("wfexec:wfx_w", "tok.wake"))
        # the writer's command as the driver sends it, its file and wake aimed at this runner's pid
        command = [
            part.replace("/run/stigmer/assignment.env", str(assignment)).replace(
                "kill -WINCH 1", f"kill -WINCH {runner.pid}"
            )
            for part in assignment_command(len(data))
        ]
        subprocess.run(
            ["/bin/busybox", "sh", *command[1:]], input=data.decode(), check=True, timeout=10, text=True
        )
        with open(gate, "w") as release:  # the file is there and the wake was sent: let it go to sleep
            release.write("go\n")
        out, _ = runner.communicate(timeout=10)  # well before the 60 s poll: woken
    finally:
        runner.kill()
        runner.wait()
    assert out == "queue=wfexec:wfx_w token=tok.wake"
