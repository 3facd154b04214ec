"""Ports of upstream's pure driver tests (spec 7.1): ``runner-launch.test.ts`` and ``docker-run.test.ts``.

The docker argv itself has no Python equivalent (the SDK sends an API body, so no value is ever on a
command line); its tests' meaning is pinned on the env contract both container drivers share.
The real-engine/real-API-server tests of the same paths are test_docker_driver.py and
test_kubernetes_driver.py.
"""

from __future__ import annotations

import posixpath

import drivers.docker as docker_driver
import drivers.kubernetes.manifests as kubernetes_manifests
from drivers.contract import DriverConfig, SandboxEnvironment
from drivers.runner.env import build_runner_env
from drivers.runner.launch import (
    RUNNER_HOME,
    RUNNER_MAIN,
    RUNNER_NODE,
    RUNNER_START,
    RUNNER_UID,
    WAITER_MAIN,
    runner_command,
    waiter_command,
)

# --- runner-launch.test.ts -----------------------------------------------------------------------


def test_starts_both_entries_through_the_layers_start_script_by_absolute_path() -> None:
    assert runner_command() == ["/runner/bin/start", "/runner/dist/main.js"]
    assert waiter_command() == ["/runner/bin/start", "/runner/dist/attach/main.js"]
    assert all(posixpath.isabs(p) for p in [*runner_command(), *waiter_command()])
    assert (docker_driver.RUNNER_ENTRYPOINT, docker_driver.RUNNER_COMMAND) == (RUNNER_START, RUNNER_MAIN)
    assert list(kubernetes_manifests.RUNNER_COMMAND) == runner_command()


def test_keeps_the_runners_node_beside_the_start_script_that_execs_it() -> None:
    assert RUNNER_NODE == "/runner/bin/node"
    assert posixpath.dirname(RUNNER_NODE) == posixpath.dirname(RUNNER_START)


def test_runs_the_runner_as_root_with_roots_home() -> None:
    assert RUNNER_UID == 0 and RUNNER_HOME == "/root"
    assert docker_driver.CONTAINER_USER == "0:0" and docker_driver.CONTAINER_HOME == "/root"
    assert kubernetes_manifests.RUNNER_HOME == "/root"


def test_keeps_the_waiter_beside_the_runner_it_starts() -> None:
    assert posixpath.dirname(posixpath.dirname(WAITER_MAIN)) == posixpath.dirname(RUNNER_MAIN)


def test_returns_a_fresh_array_on_every_call() -> None:
    first = runner_command()
    first.append("--mutated")
    assert runner_command() == ["/runner/bin/start", "/runner/dist/main.js"]
    waiter = waiter_command()
    waiter.clear()
    assert waiter_command() == ["/runner/bin/start", "/runner/dist/attach/main.js"]


# --- docker-run.test.ts --------------------------------------------------------------------------

CONFIG = DriverConfig(
    backend_endpoint="http://backend:7234",
    temporal_address="temporal:7233",
    temporal_namespace="ns",
    runner_env={"RUNNER_SETTING": "plain-value"},
    runner_secret_env={"ANTHROPIC_API_KEY": "sk-secret"},
    temporal_connection_env={"STIGMER_TEMPORAL_API_KEY": "temporal-key"},
)


def test_names_labels_and_configures_the_container_plain_settings_by_value() -> None:
    contract = build_runner_env(
        CONFIG, SandboxEnvironment("session:ses_1", "tok"), workspace_dir="/workspace", home="/root"
    )
    assert contract.plain["STIGMER_TASK_QUEUE"] == "session:ses_1"
    assert contract.plain["RUNNER_SETTING"] == "plain-value"
    assert contract.plain["MODE"] == "local" and contract.plain["WORKSPACE_ROOT_DIR"] == "/workspace"
    assert contract.plain["STIGMER_BACKEND_ENDPOINT"] == "http://backend:7234"
    assert contract.plain["TEMPORAL_SERVICE_ADDRESS"] == "temporal:7233"
    assert "STIGMER_MCP_PUBLIC_ENDPOINT" not in contract.plain  # no empty STIGMER_MCP_PUBLIC_ENDPOINT=


def test_passes_every_credential_through_the_secret_channel_only() -> None:
    contract = build_runner_env(CONFIG, SandboxEnvironment("q", "tok-secret"), workspace_dir="/workspace")
    assert contract.secret == {
        "ANTHROPIC_API_KEY": "sk-secret",
        "STIGMER_TEMPORAL_API_KEY": "temporal-key",
        "STIGMER_TOKEN": "tok-secret",
    }
    assert not set(contract.secret) & set(contract.plain)
    assert not {"sk-secret", "temporal-key", "tok-secret"} & set(contract.plain.values())


def test_carries_no_token_when_none_was_minted_and_the_public_address_when_one_is_named() -> None:
    bare = DriverConfig(
        backend_endpoint="http://b", temporal_address="t:1", mcp_public_endpoint="https://mcp.example"
    )
    contract = build_runner_env(bare, SandboxEnvironment("q", ""), workspace_dir="/workspace")
    assert contract.secret == {}
    assert contract.plain["STIGMER_MCP_PUBLIC_ENDPOINT"] == "https://mcp.example"
