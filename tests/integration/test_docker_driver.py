"""docker driver against a real engine (the harness's private dockerd + a locally imported busybox image)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import docker
import docker.errors
import pytest
from harness.dockerd import Dockerd

from drivers.contract import (
    DEFAULT_INSTALLATION,
    DriverConfig,
    SandboxCollision,
    SandboxEnvironment,
    SandboxError,
    SandboxProvisioner,
)
from drivers.docker import (
    BACKEND_ENDPOINT_REQUIRED,
    LOG_LEFT_ALONE,
    TEMPORAL_ADDRESS_REQUIRED,
    DockerProvisioner,
    new_docker_provisioner,
)
from drivers.naming import (
    LABEL_INSTALLATION,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    LABEL_SCOPE,
    MANAGED_BY_VALUE,
    sandbox_base_name,
    sandbox_labels,
)
from tests.support.collisions import FIRST, SECOND, assert_collide

pytestmark = pytest.mark.docker

TOKEN = "tok-docker-secret-axr_dk_1"
RUNNER_SECRET = "sk-docker-runner-secret"
TEMPORAL_KEY = "temporal-docker-key"
LOGGER = logging.getLogger("tests.docker_driver")

Factory = Callable[..., DockerProvisioner]


def _config(**options: str) -> DriverConfig:
    return DriverConfig(
        backend_endpoint="http://host.docker.internal:7234",
        temporal_address="host.docker.internal:7233",
        mcp_public_endpoint="https://mcp.example.test",
        temporal_namespace="sandbox-ns",
        temporal_connection_env={"STIGMER_TEMPORAL_API_KEY": TEMPORAL_KEY},
        runner_env={"RUNNER_SETTING": "plain-value"},
        runner_secret_env={"ANTHROPIC_API_KEY": RUNNER_SECRET},
        options=options,
    )


def _env(queue: str, token: str = TOKEN) -> SandboxEnvironment:
    return SandboxEnvironment(task_queue=queue, stigmer_token=token, caller_class="user")


@pytest.fixture
def client(dockerd: Dockerd) -> Iterator[Any]:
    c = docker.DockerClient(base_url=dockerd.socket_url, version="auto", timeout=60)
    yield c
    c.close()


def _remove_all(client: Any) -> None:
    for container in client.containers.list(all=True):
        container.remove(force=True, v=True)


@pytest.fixture
async def make(dockerd: Dockerd, docker_image: str, client: Any) -> AsyncIterator[Factory]:
    made: list[DockerProvisioner] = []

    def factory(**options: str) -> DockerProvisioner:
        p = new_docker_provisioner(
            _config(
                **{"docker_host": dockerd.socket_url, "image": docker_image, "network": "none", **options}
            ),
            LOGGER,
        )
        made.append(p)
        return p

    await asyncio.to_thread(_remove_all, client)
    yield factory
    for p in made:
        await p.close()
    dockerd.start()  # a test may have stopped the engine; bring it back before cleaning up
    await asyncio.to_thread(_remove_all, client)


def _inspect(client: Any, name: str) -> dict[str, Any]:
    attrs: dict[str, Any] = client.api.inspect_container(name)
    return attrs


def _env_of(attrs: dict[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in attrs["Config"]["Env"])


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(repr(r.__dict__) + r.getMessage() for r in caplog.records)


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == text]


async def _wait_logs(client: Any, name: str, needle: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        logs: str = client.containers.get(name).logs().decode()
        if needle in logs or time.monotonic() > deadline:
            return logs
        await asyncio.sleep(0.1)


def test_boot_checks_use_the_upstream_messages() -> None:
    with pytest.raises(ValueError) as err:
        new_docker_provisioner(DriverConfig(backend_endpoint="", temporal_address="t:7233"), LOGGER)
    assert str(err.value) == BACKEND_ENDPOINT_REQUIRED
    assert str(err.value) == (
        "sandbox provisioner 'docker' requires STIGMER_SANDBOX_BACKEND_ENDPOINT"
        " — a container cannot reach the server on this process's localhost"
    )
    with pytest.raises(ValueError) as err:
        new_docker_provisioner(DriverConfig(backend_endpoint="http://b", temporal_address=""), LOGGER)
    assert str(err.value) == TEMPORAL_ADDRESS_REQUIRED
    assert str(err.value) == (
        "sandbox provisioner 'docker' requires STIGMER_SANDBOX_TEMPORAL_ADDRESS (or TEMPORAL_HOST_PORT)"
        " reachable from inside a container"
    )
    with pytest.raises(ValueError, match="memory"):
        new_docker_provisioner(_config(memory="lots"), LOGGER)


async def test_provisions_a_labeled_hardened_container_probes_and_tears_down(
    make: Factory, client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    p = make(hardened="true", memory="2g", cpus="2", pids_limit="4096")
    assert isinstance(p, SandboxProvisioner) and p.driver_name == "docker"
    name = sandbox_base_name("session", "ses_docker_1")
    assert await p.probe("session", "ses_docker_1") == "absent"

    assert await p.ensure("session", "ses_docker_1", _env("session:ses_docker_1")) == "running"
    assert await p.probe("session", "ses_docker_1") == "running"
    attrs = await asyncio.to_thread(_inspect, client, name)
    first_id = attrs["Id"]

    assert attrs["Name"] == f"/{name}"
    assert attrs["Config"]["Labels"] == {
        LABEL_MANAGED_BY: MANAGED_BY_VALUE,
        LABEL_INSTALLATION: "sandbox-lanes",  # the default installation (the default consumer group)
        LABEL_SCOPE: "session",
        LABEL_SANDBOX_ID: "ses_docker_1",
    }
    assert attrs["Config"]["User"] == "0:0"
    assert attrs["Config"]["WorkingDir"] == "/workspace"
    assert attrs["Config"]["Entrypoint"] == ["/runner/bin/start"]
    assert attrs["Config"]["Cmd"] == ["/runner/dist/main.js"]
    env = _env_of(attrs)
    assert env["MODE"] == "local"
    assert env["STIGMER_TASK_QUEUE"] == "session:ses_docker_1"
    assert env["STIGMER_BACKEND_ENDPOINT"] == "http://host.docker.internal:7234"
    assert env["TEMPORAL_SERVICE_ADDRESS"] == "host.docker.internal:7233"
    assert env["WORKSPACE_ROOT_DIR"] == "/workspace"
    assert env["TEMPORAL_NAMESPACE"] == "sandbox-ns"
    assert env["HOME"] == "/root"
    assert env["STIGMER_MCP_PUBLIC_ENDPOINT"] == "https://mcp.example.test"
    assert env["RUNNER_SETTING"] == "plain-value"
    assert env["ANTHROPIC_API_KEY"] == RUNNER_SECRET
    assert env["STIGMER_TEMPORAL_API_KEY"] == TEMPORAL_KEY
    assert env["STIGMER_TOKEN"] == TOKEN  # env is the channel, as upstream (inspect = Secret boundary)

    host = attrs["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["CapDrop"] == ["ALL"]
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert host["Memory"] == 2 * 1024**3
    assert host["MemorySwap"] == 2 * 1024**3
    assert host["NanoCpus"] == 2_000_000_000
    assert host["PidsLimit"] == 4096
    assert host["ReadonlyRootfs"] is False
    assert host["RestartPolicy"]["Name"] in ("", "no")
    assert host["AutoRemove"] is False

    # The token is never on a command line: not in Path/Args/Cmd/Entrypoint of the container.
    for field in (attrs["Path"], attrs["Args"], attrs["Config"]["Cmd"], attrs["Config"]["Entrypoint"]):
        assert TOKEN not in repr(field)
        assert RUNNER_SECRET not in repr(field)

    # The hardening holds inside: no capabilities, only the loopback interface, no new privileges.
    container = client.containers.get(name)
    status = container.exec_run(["cat", "/proc/self/status"]).output.decode()
    assert "CapEff:\t0000000000000000" in status
    assert "NoNewPrivs:\t1" in status
    assert container.exec_run(["ls", "/sys/class/net"]).output.decode().split() == ["lo"]

    # The stand-in runner came up through /runner/bin/start and sees the token by name.
    logs = await _wait_logs(client, name, "env-key: STIGMER_TOKEN")
    assert "env-key: STIGMER_TOKEN" in logs and "cwd=/workspace" in logs and "uid=0" in logs
    assert TOKEN not in logs

    # A second ensure is the fast path: same container, nothing logged.
    await p.ensure_session_sandbox("ses_docker_1", _env("session:ses_docker_1"))
    assert (await asyncio.to_thread(_inspect, client, name))["Id"] == first_id
    provisioned = _messages(caplog, "Docker sandbox provisioned")
    assert len(provisioned) == 1
    assert provisioned[0].__dict__["container"] == name
    assert provisioned[0].__dict__["taskQueue"] == "session:ses_docker_1"
    assert _messages(caplog, "Docker sandbox restarted") == []

    listed = await p.list_managed()
    assert [(m.scope, m.sandbox_id, m.name, m.state) for m in listed] == [
        ("session", "ses_docker_1", name, "running")
    ]

    await p.deprovision_session_sandbox("ses_docker_1")
    assert await p.probe("session", "ses_docker_1") == "absent"
    await p.deprovision_session_sandbox("ses_docker_1")  # a second deprovision is OK
    assert len(_messages(caplog, "Docker sandbox deprovisioned")) == 1
    assert await p.list_managed() == []

    logged = _logged(caplog)
    for secret in (TOKEN, RUNNER_SECRET, TEMPORAL_KEY):
        assert secret not in logged


async def test_a_token_less_sandbox_carries_no_token(make: Factory, client: Any) -> None:
    p = make()
    await p.ensure_workflow_sandbox("wfx_docker_tokenless", _env("wfexec:wfx_docker_tokenless", token=""))
    attrs = await asyncio.to_thread(_inspect, client, sandbox_base_name("workflow", "wfx_docker_tokenless"))
    assert "STIGMER_TOKEN" not in _env_of(attrs)


async def test_two_concurrent_ensures_make_one_container(make: Factory, client: Any) -> None:
    p = make()
    await asyncio.gather(
        p.ensure("workflow", "wfx_race", _env("wfexec:wfx_race")),
        p.ensure("workflow", "wfx_race", _env("wfexec:wfx_race")),
    )
    # Two instances (two pods) racing: the loser of the create adopts the winner's container.
    q, r = make(), make()
    await asyncio.gather(
        q.ensure("workflow", "wfx_race2", _env("wfexec:wfx_race2")),
        r.ensure("workflow", "wfx_race2", _env("wfexec:wfx_race2")),
    )
    containers = await asyncio.to_thread(client.containers.list, all=True)
    assert sorted(c.name for c in containers) == sorted(
        [sandbox_base_name("workflow", "wfx_race"), sandbox_base_name("workflow", "wfx_race2")]
    )
    assert await p.probe("workflow", "wfx_race") == "running"
    assert await q.probe("workflow", "wfx_race2") == "running"


def _precreate(client: Any, image: str, name: str, labels: dict[str, str]) -> str:
    container = client.containers.create(image, name=name, labels=labels, network_mode="none")
    return str(container.id)


def _inspect_misses_once(p: DockerProvisioner, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A race: the driver's first inspect of ``name`` misses, so its create meets the engine's 409."""
    real_inspect = p._inspect
    misses = [name]

    async def racy_inspect(n: str) -> dict[str, Any] | None:
        if n in misses:
            misses.remove(n)
            return None
        return await real_inspect(n)

    monkeypatch.setattr(p, "_inspect", racy_inspect)


async def test_a_stopped_container_of_ours_is_adopted_and_started(
    make: Factory,
    client: Any,
    docker_image: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E.g. an earlier create whose start failed, or a concurrent ensure mid-way."""
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    name = sandbox_base_name("session", "ses_adopt")
    labels = sandbox_labels("session", "ses_adopt", DEFAULT_INSTALLATION)
    existing = await asyncio.to_thread(_precreate, client, docker_image, name, labels)
    p = make()
    assert await p.probe("session", "ses_adopt") == "stopped"
    assert await p.ensure("session", "ses_adopt", _env("session:ses_adopt")) == "running"
    attrs = await asyncio.to_thread(_inspect, client, name)
    assert attrs["Id"] == existing and attrs["State"]["Running"] is True
    assert await p.probe("session", "ses_adopt") == "running"

    # The same through the engine's own 409: inspect misses (a race), create conflicts, ensure adopts.
    name2 = sandbox_base_name("session", "ses_adopt409")
    labels2 = {**labels, LABEL_SANDBOX_ID: "ses_adopt409"}
    existing2 = await asyncio.to_thread(_precreate, client, docker_image, name2, labels2)
    _inspect_misses_once(p, name2, monkeypatch)
    await p.ensure_session_sandbox("ses_adopt409", _env("session:ses_adopt409"))
    attrs2 = await asyncio.to_thread(_inspect, client, name2)
    assert attrs2["Id"] == existing2 and attrs2["State"]["Running"] is True
    assert [r.__dict__["container"] for r in _messages(caplog, "Docker sandbox adopted")] == [name2]


async def test_a_foreign_container_under_our_name_is_a_clear_error(
    make: Factory, client: Any, docker_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = sandbox_base_name("session", "ses_foreign")
    foreign = await asyncio.to_thread(_precreate, client, docker_image, name, {"owner": "someone-else"})
    p = make()
    with pytest.raises(
        SandboxError, match=f"'{name}' is taken by a container that is not the managed sandbox"
    ):
        await p.ensure_session_sandbox("ses_foreign", _env("session:ses_foreign"))
    with pytest.raises(SandboxError, match="refusing"):
        await p.deprovision_session_sandbox("ses_foreign")
    with pytest.raises(SandboxError, match="is taken"):
        await p.probe("session", "ses_foreign")
    # Through the 409 path too: inspect misses once (a race), the engine's create conflicts.
    _inspect_misses_once(p, name, monkeypatch)
    with pytest.raises(SandboxError, match="is taken"):
        await p.ensure_session_sandbox("ses_foreign", _env("session:ses_foreign"))
    attrs = await asyncio.to_thread(_inspect, client, name)
    assert attrs["Id"] == foreign and attrs["State"]["Running"] is False, "the foreign container is untouched"


async def test_a_running_container_another_tool_started_under_our_name_is_refused_and_left_alone(
    make: Factory,
    client: Any,
    docker_image: str,
    dockerd: Dockerd,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A squatter started by testcontainers (its own labels, running) on the same engine."""
    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.container import DockerContainer

    # Ryuk, testcontainers' own reaper, is an image from a registry this machine cannot reach.
    monkeypatch.setattr(testcontainers_config, "ryuk_disabled", True)
    monkeypatch.setenv("DOCKER_HOST", dockerd.socket_url)
    name = sandbox_base_name("workflow", "wfx_squatted")
    squatter = DockerContainer(
        docker_image, name=name, entrypoint="sleep", command="300", network_mode="none"
    )
    await asyncio.to_thread(squatter.start)
    try:
        p = make()
        with pytest.raises(SandboxError, match=f"'{name}' is taken by a container that is not the managed"):
            await p.ensure_workflow_sandbox("wfx_squatted", _env("wfexec:wfx_squatted"))
        with pytest.raises(SandboxError, match="refusing"):
            await p.deprovision_workflow_sandbox("wfx_squatted")
        assert name not in [m.name for m in await p.list_managed()], "the reaper would never see it"
        attrs = await asyncio.to_thread(_inspect, client, name)
        assert attrs["State"]["Running"] is True, "the squatter is untouched"
        assert attrs["Config"]["Labels"].get("org.testcontainers") == "true"
        assert LABEL_MANAGED_BY not in attrs["Config"]["Labels"]
    finally:
        await asyncio.to_thread(squatter.stop)


async def test_a_stopped_sandbox_is_restarted_as_it_is(
    make: Factory, client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    p = make()
    await p.ensure_session_sandbox("ses_restart", _env("session:ses_restart"))
    name = sandbox_base_name("session", "ses_restart")
    first = await asyncio.to_thread(_inspect, client, name)
    await asyncio.to_thread(lambda: client.containers.get(name).stop(timeout=10))
    assert await p.probe("session", "ses_restart") == "stopped"
    assert [(m.sandbox_id, m.state) for m in await p.list_managed()] == [("ses_restart", "stopped")]

    await p.ensure_session_sandbox("ses_restart", _env("session:ses_restart", token="a-newer-token"))
    again = await asyncio.to_thread(_inspect, client, name)
    assert again["Id"] == first["Id"] and again["State"]["Running"] is True
    assert _env_of(again)["STIGMER_TOKEN"] == TOKEN, "a restart keeps the original env (upstream Q6)"
    restarted = _messages(caplog, "Docker sandbox restarted")
    assert len(restarted) == 1
    assert restarted[0].__dict__["container"] == name
    assert restarted[0].__dict__["scope"] == "session"
    assert restarted[0].__dict__["id"] == "ses_restart"


async def test_read_only_root_keeps_the_workspace_writable(make: Factory, client: Any) -> None:
    p = make(read_only="true", memory="256m", cpus="0.5", network="none")
    await p.ensure("connect", "mcr_ro", _env("mcpconnect:mcr_ro"))
    name = sandbox_base_name("connect", "mcr_ro")
    attrs = await asyncio.to_thread(_inspect, client, name)
    assert attrs["HostConfig"]["ReadonlyRootfs"] is True
    assert attrs["HostConfig"]["Memory"] == 256 * 1024**2
    assert attrs["HostConfig"]["NanoCpus"] == 500_000_000
    container = client.containers.get(name)
    assert container.exec_run(["touch", "/workspace/ok"]).exit_code == 0
    assert container.exec_run(["touch", "/tmp/ok"]).exit_code == 0
    assert container.exec_run(["touch", "/etc/nope"]).exit_code != 0
    await p.deprovision_connect_sandbox("mcr_ro")
    assert await p.probe("connect", "mcr_ro") == "absent"
    assert await asyncio.to_thread(client.volumes.list) == [], "the workspace volume goes with the container"


async def test_the_engine_going_away_is_the_failure_path_with_the_engine_error(
    make: Factory, dockerd: Dockerd, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    p = make()
    await p.ensure("session", "ses_engine", _env("session:ses_engine"))
    assert await p.probe("session", "ses_engine") == "running"
    dockerd.stop_engine_only()
    try:
        with pytest.raises(SandboxError) as err:
            await p.ensure("session", "ses_engine_2", _env("session:ses_engine_2"))
        message = str(err.value)
        assert message.startswith(f"docker engine error ({dockerd.socket_url}): ")
        assert "Connection" in message or "No such file" in message, message
        assert TOKEN not in message
        with pytest.raises(SandboxError, match="docker engine error"):
            await p.probe("session", "ses_engine")
        with pytest.raises(SandboxError, match="docker engine error"):
            await p.deprovision("session", "ses_engine")
        # A provisioner that never reached the engine fails the same way on first use.
        fresh = make()
        with pytest.raises(SandboxError, match="docker engine error"):
            await fresh.ensure("session", "ses_engine_3", _env("session:ses_engine_3"))
    finally:
        dockerd.start()
    # The same instance recovers once the engine is back.
    await p.ensure("session", "ses_engine_2", _env("session:ses_engine_2"))
    assert await p.probe("session", "ses_engine_2") == "running"
    assert TOKEN not in _logged(caplog)


async def test_an_unreachable_engine_at_first_use_is_a_sandbox_error(tmp_path: Any) -> None:
    p = new_docker_provisioner(_config(docker_host=f"unix://{tmp_path}/nothing.sock"), LOGGER)
    with pytest.raises(SandboxError, match="docker engine error"):
        await p.probe("session", "ses_none")
    await p.close()


async def test_a_missing_image_that_cannot_be_pulled_is_a_sandbox_error(make: Factory) -> None:
    p = make(image="sandbox-lanes/not-here:never")
    with pytest.raises(SandboxError, match=r"docker engine error .*not-here"):
        await p.ensure("session", "ses_noimage", _env("session:ses_noimage"))
    assert await p.probe("session", "ses_noimage") == "absent"


def test_the_defaults_are_upstreams_docker_run_no_network_limit_or_capability_change() -> None:
    """Upstream's `docker run` sets no network, limit or capability: a runner reaches the backend and
    Temporal it is told to use. Hardening is opt-in (the options above)."""
    from drivers.docker import DockerSettings

    s = DockerSettings.from_config(_config())
    assert (s.network, s.memory_bytes, s.nano_cpus, s.pids_limit, s.hardened, s.read_only) == (
        "",
        0,
        0,
        0,
        False,
        False,
    )
    hardened = DockerSettings.from_config(
        _config(network="none", memory="1g", cpus="1", pids_limit="64", hardened="yes")
    )
    assert (
        hardened.network,
        hardened.memory_bytes,
        hardened.nano_cpus,
        hardened.pids_limit,
        hardened.hardened,
    ) == (
        "none",
        1024**3,
        1_000_000_000,
        64,
        True,
    )


async def test_colliding_ids_never_touch_each_others_container(
    make: Factory, client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Two real ids with one sandbox name, through the pod's executor: the second's ensure is a failed
    result (the lane's SandboxFailed reason) naming the first's container and id; the container, its
    labels and its token stay the first's; the second's deprovision leaves it running."""
    import base64

    from consumers.lanes.commands import Deprovision, Ensure
    from consumers.lanes.credentials import SandboxCredentialRequest
    from consumers.runtime.executor import DriverExecutor
    from consumers.runtime.runner_tokens import ExecutionScopedRunnerCredentialProvider

    caplog.set_level(logging.INFO, logger=LOGGER.name)
    name = assert_collide("workflow")
    p = make()
    executor = DriverExecutor(
        p, ExecutionScopedRunnerCredentialProvider.from_key_text(base64.b64encode(b"k" * 32).decode()), LOGGER
    )

    def ensure(execution_id: str) -> Ensure:
        mint = SandboxCredentialRequest("workflow", "", execution_id, "org", "user-1")
        return Ensure("workflow", execution_id, f"wfexec:{execution_id}", "user", mint, True)

    first = await executor.run(ensure(FIRST))
    assert first.ok and first.token_minted, first
    before = await asyncio.to_thread(_inspect, client, name)
    token = _env_of(before)["STIGMER_TOKEN"]

    second = await executor.run(ensure(SECOND))
    assert not second.ok
    assert second.error == (
        f"docker sandbox name collision: container {name} ({before['Id'][:12]}) belongs to workflow "
        f"'{FIRST}', not to workflow '{SECOND}' (both map to the name {name}); the container was left "
        "untouched"
    )
    with pytest.raises(SandboxCollision):  # the driver's own exception type, under the executor
        await p.ensure_workflow_sandbox(SECOND, _env(f"wfexec:{SECOND}"))
    after = await asyncio.to_thread(_inspect, client, name)
    assert after["Id"] == before["Id"] and after["State"]["Running"] is True
    assert after["State"]["StartedAt"] == before["State"]["StartedAt"], "never restarted"
    assert after["Config"]["Labels"][LABEL_SANDBOX_ID] == FIRST
    assert _env_of(after)["STIGMER_TOKEN"] == token
    assert _env_of(after)["STIGMER_TASK_QUEUE"] == f"wfexec:{FIRST}"
    assert await p.probe("workflow", SECOND) == "absent"
    assert await p.probe("workflow", FIRST) == "running"

    assert (await executor.run(Deprovision("workflow", SECOND, 0))).ok
    left = _messages(caplog, LOG_LEFT_ALONE)
    assert [(r.__dict__["id"], r.__dict__["ownerId"], r.__dict__["container"]) for r in left] == [
        (SECOND, FIRST, name)
    ]
    still = await asyncio.to_thread(_inspect, client, name)
    assert still["Id"] == before["Id"] and still["State"]["Running"] is True
    assert [m.sandbox_id for m in await p.list_managed()] == [FIRST]

    assert (await executor.run(Deprovision("workflow", FIRST, 0))).ok
    assert await p.probe("workflow", FIRST) == "absent"
    assert await p.list_managed() == []


async def test_two_installations_on_one_engine_never_touch_each_others_containers(
    dockerd: Dockerd, docker_image: str, client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Production and staging on one Docker engine, beside a container made before installations were
    labelled (our other labels) and a plain one under a sandbox's name: each installation lists,
    probes, starts and removes only its own; staging's ensure of an id production runs fails naming
    production's container, which runs on, never restarted."""
    from dataclasses import replace

    caplog.set_level(logging.INFO, logger=LOGGER.name)
    await asyncio.to_thread(_remove_all, client)
    options = {"docker_host": dockerd.socket_url, "image": docker_image, "network": "none"}
    production = new_docker_provisioner(replace(_config(**options), installation="production"), LOGGER)
    staging = new_docker_provisioner(replace(_config(**options), installation="staging"), LOGGER)
    shared, legacy, plain = "wfx_dk_shared", "wfx_dk_legacy", "wfx_dk_plain"
    try:
        await production.ensure("workflow", shared, _env(f"wfexec:{shared}"))
        await staging.ensure("workflow", "wfx_dk_staging", _env("wfexec:wfx_dk_staging", token="tok-staging"))
        for sid, labels in (
            (legacy, {LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_SCOPE: "workflow", LABEL_SANDBOX_ID: legacy}),
            (plain, {"app": "someone-elses"}),
        ):
            await asyncio.to_thread(
                client.containers.run,
                docker_image,
                ["sleep", "3600"],
                name=sandbox_base_name("workflow", sid),
                labels=labels,
                detach=True,
                network_mode="none",
                entrypoint=[],
            )
        names = {sid: sandbox_base_name("workflow", sid) for sid in (shared, legacy, plain)}
        before = {sid: await asyncio.to_thread(_inspect, client, name) for sid, name in names.items()}
        assert before[shared]["Config"]["Labels"][LABEL_INSTALLATION] == "production"

        assert [m.sandbox_id for m in await production.list_managed()] == [shared]
        assert [m.sandbox_id for m in await staging.list_managed()] == ["wfx_dk_staging"]
        assert await staging.probe("workflow", shared) == "absent"
        with pytest.raises(SandboxCollision) as err:
            await staging.ensure("workflow", shared, _env(f"wfexec:{shared}", token="tok-staging"))
        assert f"belongs to workflow '{shared}' of installation 'production'" in str(err.value)
        await staging.deprovision("workflow", shared)
        left = _messages(caplog, LOG_LEFT_ALONE)
        assert [(r.__dict__["ownerId"], r.__dict__["ownerInstallation"]) for r in left] == [
            (shared, "production")
        ]
        with pytest.raises(SandboxCollision, match="of no installation"):
            await production.ensure("workflow", legacy, _env(f"wfexec:{legacy}"))
        with pytest.raises(SandboxError, match="refusing to use or remove it"):
            await production.ensure("workflow", plain, _env(f"wfexec:{plain}"))
        assert await production.probe("workflow", legacy) == "absent"
        await production.deprovision("workflow", legacy)
        with pytest.raises(SandboxError, match="refusing to use or remove it"):
            await production.deprovision("workflow", plain)
        for sid, name in names.items():
            after = await asyncio.to_thread(_inspect, client, name)
            assert (after["Id"], after["State"]["Running"], after["State"]["StartedAt"]) == (
                before[sid]["Id"],
                True,
                before[sid]["State"]["StartedAt"],
            ), sid
            assert after["Config"]["Labels"] == before[sid]["Config"]["Labels"]
        await production.deprovision("workflow", shared)
        await staging.deprovision("workflow", "wfx_dk_staging")
        assert await production.list_managed() == [] and await staging.list_managed() == []
        left_running = {c.name for c in await asyncio.to_thread(client.containers.list, all=True)}
        assert left_running == {names[legacy], names[plain]}
        assert len(production._locks) == 0 and len(staging._locks) == 0
    finally:
        await asyncio.to_thread(_remove_all, client)
        await production.close()
        await staging.close()
