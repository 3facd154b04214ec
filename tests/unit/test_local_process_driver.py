"""local-process driver against real child processes (upstream local-process.test.ts, plus restart/group)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from drivers.contract import (
    DEFAULT_INSTALLATION,
    DriverConfig,
    SandboxCollision,
    SandboxEnvironment,
    SandboxError,
    SandboxProvisioner,
    SandboxScope,
)
from drivers.local_process import (
    INSTALLATION_ENV,
    LOG_LEFT_ALONE,
    LocalProcessProvisioner,
    live_group_members,
    new_local_process_provisioner,
)
from drivers.naming import sandbox_base_name
from tests.support.collisions import FIRST, SECOND, assert_collide
from tests.support.proc_util import processes_under
from tests.support.runner_stub import ENV_FILE, GRANDCHILD_FILE, STARTS_FILE, runner_command

TOKEN = "tok-secret-axr_lp_1"
RUNNER_SECRET = "sk-runner-secret-value"
TEMPORAL_KEY = "temporal-api-key-value"

LOGGER = logging.getLogger("tests.local_process")

Factory = Callable[..., LocalProcessProvisioner]


def _config(state_dir: Path, **options: str) -> DriverConfig:
    return DriverConfig(
        backend_endpoint="http://127.0.0.1:7234",
        temporal_address="127.0.0.1:7233",
        runner_command=runner_command(),
        mcp_public_endpoint="https://mcp.example.test",
        temporal_namespace="sandbox-ns",
        temporal_connection_env={
            "STIGMER_TEMPORAL_API_KEY": TEMPORAL_KEY,
            "STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_DATA": "-----BEGIN CERTIFICATE-----",
        },
        runner_env={
            "RUNNER_SETTING": "plain-value",
            **{k: v for k, v in options.items() if k.startswith("STUB_")},
        },
        runner_secret_env={"ANTHROPIC_API_KEY": RUNNER_SECRET},
        options={
            "state_dir": str(state_dir),
            **{k: v for k, v in options.items() if not k.startswith("STUB_")},
        },
    )


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Factory]:
    """Builds provisioners on one state dir; tears down whatever they left running."""
    made: list[LocalProcessProvisioner] = []

    def factory(**options: str) -> LocalProcessProvisioner:
        p = new_local_process_provisioner(_config(tmp_path / "state", **options), LOGGER)
        made.append(p)
        return p

    yield factory
    cleaner = new_local_process_provisioner(_config(tmp_path / "state", grace_seconds="1"), LOGGER)
    for sandbox in await cleaner.list_managed():
        await cleaner.deprovision(sandbox.scope, sandbox.sandbox_id)
    for p in made:
        await p.close()


def _env(queue: str, token: str = TOKEN) -> SandboxEnvironment:
    return SandboxEnvironment(task_queue=queue, stigmer_token=token, caller_class="user")


async def _wait_for(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        await asyncio.sleep(0.02)


async def _runner_env(p: LocalProcessProvisioner, scope: SandboxScope, sandbox_id: str) -> dict[str, str]:
    path = p.workspace_dir(scope, sandbox_id) / ENV_FILE
    await _wait_for(path)
    env: dict[str, str] = json.loads(path.read_text())
    return env


def _starts(p: LocalProcessProvisioner, scope: SandboxScope, sandbox_id: str) -> list[int]:
    path = p.workspace_dir(scope, sandbox_id) / STARTS_FILE
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def _runners(p: LocalProcessProvisioner, scope: SandboxScope, sandbox_id: str) -> list[int]:
    """The live processes running in this sandbox's workspace (what the kernel says)."""
    return processes_under(p.workspace_dir(scope, sandbox_id))


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


async def _gone(pid: int, timeout: float = 5.0) -> bool:
    """True once /proc/<pid> no longer exists (exited *and* reaped)."""
    deadline = time.monotonic() + timeout
    while _proc_state(pid) is not None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _records(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(repr(r.__dict__) + r.getMessage() for r in caplog.records)


def test_factory_satisfies_the_contract(tmp_path: Path) -> None:
    p = new_local_process_provisioner(_config(tmp_path), LOGGER)
    assert isinstance(p, SandboxProvisioner)
    assert p.driver_name == "local-process"


async def test_ensure_spawns_once_injects_env_contract_and_is_idempotent(
    make: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The server's own Temporal connection settings must not be inherited.
    monkeypatch.setenv("STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_PATH", "/etc/server/ca.pem")
    monkeypatch.setenv("TEMPORAL_ADDRESS", "server-only:7233")
    monkeypatch.setenv("SERVER_PLAIN_SETTING", "inherited")
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    p = make()

    await p.ensure_session_sandbox("ses_smoke", _env("session:ses_smoke"))
    env = await _runner_env(p, "session", "ses_smoke")
    assert await p.probe("session", "ses_smoke") == "running"

    await p.ensure_session_sandbox("ses_smoke", _env("session:ses_smoke"))
    # The barrier is the ensure's return: a spawn inside it has exec'd by then (create_subprocess_exec
    # returns after the exec), so a second runner would already be in /proc.
    assert _runners(p, "session", "ses_smoke") == _starts(p, "session", "ses_smoke"), (
        "a second ensure must not respawn"
    )
    assert len(_starts(p, "session", "ses_smoke")) == 1

    assert env["MODE"] == "local"
    assert env["STIGMER_TASK_QUEUE"] == "session:ses_smoke"
    assert env["STIGMER_TOKEN"] == TOKEN
    assert env["STIGMER_BACKEND_ENDPOINT"] == "http://127.0.0.1:7234"
    assert env["TEMPORAL_SERVICE_ADDRESS"] == "127.0.0.1:7233"
    assert env["STIGMER_MCP_PUBLIC_ENDPOINT"] == "https://mcp.example.test"
    assert env["TEMPORAL_NAMESPACE"] == "sandbox-ns"
    assert env["WORKSPACE_ROOT_DIR"].endswith(os.sep + "session-ses_smoke")
    assert env["WORKSPACE_ROOT_DIR"] == str(p.workspace_dir("session", "ses_smoke"))
    assert env["RUNNER_SETTING"] == "plain-value"
    assert env["ANTHROPIC_API_KEY"] == RUNNER_SECRET
    assert env["STIGMER_TEMPORAL_API_KEY"] == TEMPORAL_KEY
    assert env["STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_DATA"] == "-----BEGIN CERTIFICATE-----"
    assert "STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_PATH" not in env
    assert "TEMPORAL_ADDRESS" not in env
    assert env["SERVER_PLAIN_SETTING"] == "inherited"

    started = [r for r in caplog.records if r.getMessage() == "Local-process sandbox started"]
    assert len(started) == 1
    assert started[0].__dict__["scope"] == "session"
    assert started[0].__dict__["id"] == "ses_smoke"
    assert started[0].__dict__["taskQueue"] == "session:ses_smoke"
    assert started[0].__dict__["pid"] == _starts(p, "session", "ses_smoke")[0]
    logged = _records(caplog)
    for secret in (TOKEN, RUNNER_SECRET, TEMPORAL_KEY):
        assert secret not in logged


async def test_token_less_sandbox_has_no_token_variable(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STIGMER_TOKEN", "the-servers-own-token")
    p = make()
    await p.ensure_workflow_sandbox("wfx_tokenless", _env("wfexec:wfx_tokenless", token=""))
    env = await _runner_env(p, "workflow", "wfx_tokenless")
    assert "STIGMER_TOKEN" not in env
    assert env["STIGMER_TASK_QUEUE"] == "wfexec:wfx_tokenless"


async def test_empty_endpoints_are_not_set(tmp_path: Path) -> None:
    config = DriverConfig(
        backend_endpoint="",
        temporal_address="",
        runner_command=runner_command(),
        options={"state_dir": str(tmp_path)},
    )
    p = new_local_process_provisioner(config, LOGGER)
    try:
        await p.ensure("connect", "mcr_1", _env("mcpconnect:mcr_1"))
        env = await _runner_env(p, "connect", "mcr_1")
        for name in ("STIGMER_BACKEND_ENDPOINT", "TEMPORAL_SERVICE_ADDRESS", "STIGMER_MCP_PUBLIC_ENDPOINT"):
            assert name not in env
    finally:
        await p.deprovision("connect", "mcr_1")


async def test_concurrent_ensures_spawn_once(make: Factory) -> None:
    p = make()
    await asyncio.gather(*(p.ensure("session", "ses_race", _env("session:ses_race")) for _ in range(8)))
    await _runner_env(p, "session", "ses_race")
    # Every ensure has returned (the barrier): any runner one of them spawned is in /proc now.
    assert len(_runners(p, "session", "ses_race")) == 1
    assert _starts(p, "session", "ses_race") == _runners(p, "session", "ses_race")
    assert [m.sandbox_id for m in await p.list_managed()] == ["ses_race"]


async def test_deprovision_ends_the_whole_group_and_leaves_no_process(make: Factory) -> None:
    p = make(STUB_SPAWN_GRANDCHILD="1")
    await p.ensure_session_sandbox("ses_group", _env("session:ses_group"))
    await _runner_env(p, "session", "ses_group")
    workspace = p.workspace_dir("session", "ses_group")
    pid = _starts(p, "session", "ses_group")[0]
    grandchild = int((workspace / GRANDCHILD_FILE).read_text())
    assert os.getpgid(pid) == pid, "the runner leads its own process group"
    assert os.getpgid(grandchild) == pid
    assert os.getsid(pid) == pid

    await p.deprovision_session_sandbox("ses_group")

    assert await _gone(pid), f"runner pid {pid} still in /proc (state {_proc_state(pid)})"
    assert _proc_state(grandchild) in (None, "Z"), "the grandchild must not keep running"
    assert live_group_members(pid) == []
    assert await p.probe("session", "ses_group") == "absent"
    assert await p.list_managed() == []

    # Repair without stored state: re-ensure respawns.
    (workspace / ENV_FILE).unlink()
    await p.ensure_session_sandbox("ses_group", _env("session:ses_group"))
    assert await p.probe("session", "ses_group") == "running"
    await _runner_env(p, "session", "ses_group")
    starts = _starts(p, "session", "ses_group")
    assert len(starts) == 2 and starts[1] != pid


async def test_sigterm_ignored_is_followed_by_sigkill_after_grace(make: Factory) -> None:
    p = make(STUB_IGNORE_TERM="1", grace_seconds="0.5")
    await p.ensure("workflow", "wfx_stubborn", _env("wfexec:wfx_stubborn"))
    await _runner_env(p, "workflow", "wfx_stubborn")
    pid = _starts(p, "workflow", "wfx_stubborn")[0]
    began = time.monotonic()
    await p.deprovision("workflow", "wfx_stubborn")
    assert time.monotonic() - began >= 0.5
    assert await _gone(pid)
    assert live_group_members(pid) == []


async def test_deprovision_of_an_absent_sandbox_is_success(make: Factory) -> None:
    p = make()
    await p.deprovision_workflow_sandbox("wfx_never_existed")
    await p.deprovision_connect_sandbox("mcr_never_existed")
    assert await p.probe("workflow", "wfx_never_existed") == "absent"


async def test_a_restarted_pod_finds_probes_and_tears_down_its_children(make: Factory) -> None:
    first = make()
    await first.ensure_session_sandbox("ses_restart", _env("session:ses_restart"))
    await _runner_env(first, "session", "ses_restart")
    pid = _starts(first, "session", "ses_restart")[0]
    await first.close()  # the old pod goes away; its children keep running

    second = make()  # a new instance on the same state dir = the restarted pod
    assert await second.probe("session", "ses_restart") == "running"
    managed = await second.list_managed()
    assert [(m.scope, m.sandbox_id, m.name, m.state) for m in managed] == [
        ("session", "ses_restart", sandbox_base_name("session", "ses_restart"), "running")
    ]
    # ensure on the new instance adopts instead of spawning a second runner
    await second.ensure_session_sandbox("ses_restart", _env("session:ses_restart"))
    assert _starts(second, "session", "ses_restart") == [pid]

    await second.deprovision_session_sandbox("ses_restart")
    assert await _gone(pid)
    assert live_group_members(pid) == []
    assert await second.probe("session", "ses_restart") == "absent"
    assert await first.probe("session", "ses_restart") == "absent"


async def test_a_recycled_pid_is_not_mistaken_for_the_runner(make: Factory, tmp_path: Path) -> None:
    p = make()
    await p.ensure("session", "ses_recycled", _env("session:ses_recycled"))
    await _runner_env(p, "session", "ses_recycled")
    name = sandbox_base_name("session", "ses_recycled")
    record_path = p.state_dir / ".local-process" / f"{name}.json"
    real = json.loads(record_path.read_text())
    await p.deprovision("session", "ses_recycled")

    # An unrelated live process now sits under the recorded pid with another start time.
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        forged = {**real, "pid": bystander.pid, "pgid": bystander.pid, "start_time": real["start_time"] - 1}
        record_path.write_text(json.dumps(forged))
        fresh = make()
        assert await fresh.probe("session", "ses_recycled") == "absent"
        record_path.write_text(json.dumps(forged))
        await fresh.deprovision("session", "ses_recycled")
        assert bystander.poll() is None, "deprovision must not signal a recycled pid"
        assert not record_path.exists()
    finally:
        bystander.kill()
        bystander.wait()


async def test_a_runner_that_cannot_start_fails_the_ensure(tmp_path: Path) -> None:
    config = DriverConfig(runner_command="/nonexistent/stigmer-runner", options={"state_dir": str(tmp_path)})
    p = new_local_process_provisioner(config, LOGGER)
    with pytest.raises(SandboxError, match="failed to start"):
        await p.ensure("session", "ses_nobinary", _env("session:ses_nobinary"))
    assert await p.probe("session", "ses_nobinary") == "absent"


async def test_a_path_escaping_id_is_refused(make: Factory) -> None:
    p = make()
    with pytest.raises(SandboxError, match="not usable as a directory name"):
        await p.ensure("session", "../escape", _env("session:../escape"))


async def test_a_runner_another_pod_spawned_but_never_recorded_is_adopted_not_doubled(make: Factory) -> None:
    """A pod that stopped (SIGSTOP, a crash) between spawning a runner and recording it left a live,
    unrecorded runner: the next ensure (another pod, same state dir) adopts it instead of starting
    a second, and its deprovision ends it."""
    p = make()
    workspace = p.workspace_dir("workflow", "wfx_lp_orphan")
    workspace.mkdir(parents=True)
    stray = _runner_of_another_pod(workspace)
    try:
        await _wait_for(workspace / STARTS_FILE)
        assert await p.ensure("workflow", "wfx_lp_orphan", _env("wfexec:wfx_lp_orphan")) == "running"
        assert _starts(p, "workflow", "wfx_lp_orphan") == [stray.pid]  # no second runner
        assert [s.sandbox_id for s in await p.list_managed()] == ["wfx_lp_orphan"]
        await p.deprovision("workflow", "wfx_lp_orphan")
        assert stray.wait(10) is not None
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait(5)
    # An unrecorded runner met first by a deprovision is ended as well.
    again = _runner_of_another_pod(workspace)
    try:
        deadline = time.monotonic() + 10
        while again.pid not in _starts(p, "workflow", "wfx_lp_orphan"):  # the runner is up
            assert time.monotonic() < deadline, "the unrecorded runner never started"
            await asyncio.sleep(0.02)
        await p.deprovision("workflow", "wfx_lp_orphan")
        assert again.wait(10) is not None
    finally:
        if again.poll() is None:
            again.kill()
            again.wait(5)


def _runner_of_another_pod(
    workspace: Path, installation: str = DEFAULT_INSTALLATION
) -> subprocess.Popen[bytes]:
    """A runner as another pod's driver starts it (own process group, the sandbox's workspace and its
    installation in its environment), with no record in the state dir."""
    return subprocess.Popen(
        shlex.split(runner_command()),
        env={
            **os.environ,
            "WORKSPACE_ROOT_DIR": str(workspace),
            "STIGMER_TASK_QUEUE": "wfexec:wfx_lp_orphan",
            INSTALLATION_ENV: installation,
        },
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )


async def test_colliding_ids_never_touch_each_others_runner(
    make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """Two real ids with one sandbox name: the second's ensure fails naming the first's runner, and
    neither its ensure nor its deprovision signals that runner."""
    caplog.set_level(logging.INFO, logger=LOGGER.name)
    name = assert_collide("workflow")
    p = make()
    await p.ensure_workflow_sandbox(FIRST, _env(f"wfexec:{FIRST}"))
    first_env = await _runner_env(p, "workflow", FIRST)
    (pid,) = _starts(p, "workflow", FIRST)
    record = p.state_dir / ".local-process" / f"{name}.json"
    kept = record.read_text()

    with pytest.raises(SandboxCollision) as err:
        await p.ensure_workflow_sandbox(SECOND, _env(f"wfexec:{SECOND}", token="tok-second"))
    message = str(err.value)
    assert message == (
        f"local-process sandbox name collision: runner process group {pid} (record {record}) belongs "
        f"to workflow '{FIRST}', not to workflow '{SECOND}' (both map to the name {name}); the runner "
        "process group was left untouched"
    )
    assert _starts(p, "workflow", SECOND) == [], "nothing was spawned for the second id"
    assert await p.probe("workflow", SECOND) == "absent"
    assert await p.probe("workflow", FIRST) == "running"

    await p.deprovision_workflow_sandbox(SECOND)
    left = [r for r in caplog.records if r.getMessage() == LOG_LEFT_ALONE]
    assert [(r.__dict__["id"], r.__dict__["ownerId"], r.__dict__["pid"]) for r in left] == [
        (SECOND, FIRST, pid)
    ]
    # The barrier is the deprovision's return: a kill of the group would have been waited out in it.
    assert _proc_state(pid) not in (None, "Z"), "the first id's runner still runs"
    assert live_group_members(pid) != []
    assert record.read_text() == kept, "its record is untouched"
    assert await _runner_env(p, "workflow", FIRST) == first_env
    assert [m.sandbox_id for m in await p.list_managed()] == [FIRST]

    await p.deprovision_workflow_sandbox(FIRST)
    assert await _gone(pid)
    assert await p.probe("workflow", FIRST) == "absent"
    assert not record.exists()
    assert await p.list_managed() == []


async def test_two_installations_sharing_a_state_dir_and_an_id_never_touch_each_others_runner(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Production and staging on one host, one state dir, one sandbox id: staging's ensure fails naming
    production's runner, its probe and listing do not see it, its deprovision ends nothing (neither the
    recorded runner nor, searched by workspace, production's process). A record written before
    installations were recorded (none in it) and its live runner are nobody's: left untouched too."""
    caplog.set_level(logging.INFO, logger=LOGGER.name)
    state = tmp_path / "state"
    production = new_local_process_provisioner(replace(_config(state), installation="production"), LOGGER)
    staging = new_local_process_provisioner(replace(_config(state), installation="staging"), LOGGER)
    name = sandbox_base_name("workflow", "wfx_shared")
    legacy_workspace = production.workspace_dir("workflow", "wfx_legacy")
    legacy_workspace.mkdir(parents=True)
    legacy = subprocess.Popen(  # a runner started before installations were recorded: no marker
        shlex.split(runner_command()),
        env={**os.environ, "WORKSPACE_ROOT_DIR": str(legacy_workspace)},
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        await production.ensure("workflow", "wfx_shared", _env("wfexec:wfx_shared"))
        assert (await _runner_env(production, "workflow", "wfx_shared"))[INSTALLATION_ENV] == "production"
        (pid,) = _starts(production, "workflow", "wfx_shared")
        record = state / ".local-process" / f"{name}.json"
        kept = record.read_text()
        assert json.loads(kept)["installation"] == "production"

        with pytest.raises(SandboxCollision) as err:
            await staging.ensure("workflow", "wfx_shared", _env("wfexec:wfx_shared", token="tok-staging"))
        assert str(err.value) == (
            f"local-process sandbox name collision: runner process group {pid} (record {record}) belongs "
            f"to workflow 'wfx_shared' of installation 'production', not to workflow 'wfx_shared' (both "
            f"map to the name {name}); the runner process group was left untouched"
        )
        assert await staging.probe("workflow", "wfx_shared") == "absent"
        assert await staging.list_managed() == []
        await staging.deprovision("workflow", "wfx_shared")
        left = [r for r in caplog.records if r.getMessage() == LOG_LEFT_ALONE]
        assert [(r.__dict__["ownerId"], r.__dict__["ownerInstallation"]) for r in left] == [
            ("wfx_shared", "production")
        ]
        # The barrier is the deprovision's return: a kill of the group would have been waited out in it.
        assert _proc_state(pid) not in (None, "Z") and live_group_members(pid) != []
        assert record.read_text() == kept
        assert _starts(production, "workflow", "wfx_shared") == [pid], "staging spawned nothing"
        assert await production.probe("workflow", "wfx_shared") == "running"

        # A record of no installation (as written before they were recorded) naming a live runner.
        await _wait_for(legacy_workspace / STARTS_FILE)
        legacy_name = sandbox_base_name("workflow", "wfx_legacy")
        legacy_record = state / ".local-process" / f"{legacy_name}.json"
        identity = Path(f"/proc/{legacy.pid}/stat").read_text().rsplit(")", 1)[1].split()
        legacy_record.write_text(
            json.dumps(
                {
                    "scope": "workflow",
                    "sandbox_id": "wfx_legacy",
                    "name": legacy_name,
                    "pid": legacy.pid,
                    "pgid": legacy.pid,
                    "start_time": int(identity[19]),
                    "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                    "command": shlex.split(runner_command()),
                    "workspace": str(legacy_workspace),
                    "started_at": time.time(),
                }
            )
        )
        legacy_kept = legacy_record.read_text()
        assert [m.sandbox_id for m in await production.list_managed()] == ["wfx_shared"]
        with pytest.raises(SandboxCollision, match="of no installation"):
            await production.ensure("workflow", "wfx_legacy", _env("wfexec:wfx_legacy"))
        assert await production.probe("workflow", "wfx_legacy") == "absent"
        await production.deprovision("workflow", "wfx_legacy")
        assert legacy.poll() is None and live_group_members(legacy.pid) != [], "the legacy runner runs on"
        assert legacy_record.read_text() == legacy_kept

        await production.deprovision("workflow", "wfx_shared")
        assert await _gone(pid)
        assert len(production._locks) == 0 and len(staging._locks) == 0  # no lock outlives its use
    finally:
        if legacy.poll() is None:
            legacy.kill()
            legacy.wait(5)
        for p in (production, staging):
            for sandbox in await p.list_managed():
                await p.deprovision(sandbox.scope, sandbox.sandbox_id)
            await p.close()
