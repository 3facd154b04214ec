"""Configuration from the environment (12-factor), validated at start-up.

Upstream's variable names are kept where the knob is upstream's
(``SANDBOX_PROVISIONER_TYPE``, ``STIGMER_*``, ``TEMPORAL_*``); the pod's own
knobs are ``SANDBOX_LANES_*`` and ``KAFKA_BOOTSTRAP_SERVERS``. An empty value
counts as unset, as upstream does.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import get_args

from consumers.constants import (
    DEFAULT_EXECUTION_TARGET_LOCAL,
    ROUTING_GLOBAL,
    ROUTING_SESSION,
    WORKFLOW_ROUTING_EXECUTION,
    WORKFLOW_ROUTING_GLOBAL,
)
from consumers.dispatch import AgentExecutionTemporalConfig, WorkflowExecutionTemporalConfig
from consumers.sink import Guarantee
from consumers.topology import Topics
from drivers.contract import SANDBOX_DRIVER_OWNED_RUNNER_ENV, DriverConfig


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the variable and what is allowed."""


@dataclass(frozen=True)
class Setting:
    env: str
    default: str
    help: str
    secret: bool = False


#: Every knob, in the order the README's config table lists them.
SETTINGS: tuple[Setting, ...] = (
    Setting("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092", "Kafka bootstrap servers"),
    Setting(
        "SANDBOX_LANES_GROUP_ID", "sandbox-lanes", "consumer group id (also the transactional id prefix)"
    ),
    Setting(
        "SANDBOX_LANES_POD_ID", "", "this instance's id (default: hostname); part of the transactional id"
    ),
    Setting("SANDBOX_LANES_PROCESSING_GUARANTEE", "exactly_once", "exactly_once or at_least_once"),
    Setting("SANDBOX_LANES_SEQUENTIAL_PRODUCE", "false", "one record per produce request (needed on Tansu)"),
    Setting("SANDBOX_LANES_PARTITIONS", "3", "partitions of topics the pod creates"),
    Setting("SANDBOX_LANES_REPLICATION", "1", "replication factor of topics the pod creates"),
    Setting("SANDBOX_LANES_CREATE_TOPICS", "true", "create missing topics at start-up"),
    Setting("SANDBOX_LANES_TOPIC_EXECUTION_CREATED", "execution-created", "input: ExecutionCreated"),
    Setting("SANDBOX_LANES_TOPIC_PHASE_CHANGED", "phase-changed", "input: PhaseChanged"),
    Setting("SANDBOX_LANES_TOPIC_SESSION_DELETED", "session-deleted", "input: SessionDeleted"),
    Setting("SANDBOX_LANES_TOPIC_OUTCOMES", "sandbox-outcomes", "output: Sandbox* outcome events"),
    Setting(
        "SANDBOX_LANES_TOPIC_STATE", "sandbox-lanes-state", "compacted execution state (key = execution id)"
    ),
    Setting("SANDBOX_LANES_TOPIC_DLQ", "sandbox-lanes-dlq", "dead letters (reason in header dlq_reason)"),
    Setting("SANDBOX_LANES_SESSION_TIMEOUT_MS", "10000", "consumer group session timeout"),
    Setting("SANDBOX_LANES_SHUTDOWN_TIMEOUT_S", "30", "bound on graceful shutdown after SIGTERM"),
    Setting("SANDBOX_LANES_ENSURE_TIMEOUT_S", "120", "bound on one driver ensure"),
    Setting("SANDBOX_LANES_TEARDOWN_TIMEOUT_S", "60", "bound on one driver teardown"),
    Setting("SANDBOX_PROVISIONER_TYPE", "", "driver: '' (lane disabled), local-process, docker, kubernetes"),
    Setting("STIGMER_ACTIVITY_ROUTING", ROUTING_GLOBAL, "agent routing: global or session"),
    Setting(
        "STIGMER_DEFAULT_EXECUTION_TARGET",
        DEFAULT_EXECUTION_TARGET_LOCAL,
        "UNSPECIFIED session target: local or cloud",
    ),
    Setting(
        "STIGMER_WORKFLOW_ACTIVITY_ROUTING", WORKFLOW_ROUTING_GLOBAL, "workflow routing: global or execution"
    ),
    Setting(
        "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET",
        DEFAULT_EXECUTION_TARGET_LOCAL,
        "UNSPECIFIED workflow target",
    ),
    Setting("TEMPORAL_AGENT_EXECUTION_RUNNER_TASK_QUEUE", "stigmer_runner", "agent global runner queue"),
    Setting(
        "TEMPORAL_WORKFLOW_EXECUTION_RUNNER_TASK_QUEUE", "stigmer_runner", "workflow global runner queue"
    ),
    Setting("STIGMER_SANDBOX_BACKEND_ENDPOINT", "", "server URL as reachable from inside a sandbox"),
    Setting(
        "STIGMER_SANDBOX_TEMPORAL_ADDRESS",
        "",
        "Temporal host:port from inside a sandbox (→ TEMPORAL_HOST_PORT → localhost:7233)",
    ),
    Setting("STIGMER_SANDBOX_RUNNER_IMAGE", "ghcr.io/stigmer/runner:latest", "image for docker/kubernetes"),
    Setting("STIGMER_SANDBOX_RUNNER_COMMAND", "stigmer-runner", "executable for local-process"),
    Setting("STIGMER_SANDBOX_K8S_NAMESPACE", "stigmer-sandboxes", "the one shared sandbox namespace"),
    Setting("STIGMER_SANDBOX_MCP_PUBLIC_ENDPOINT", "", "public MCP address given to runners"),
    Setting(
        "STIGMER_SANDBOX_RUNNER_ENV", "", "comma-separated env names passed to runners as plain settings"
    ),
    Setting(
        "STIGMER_SANDBOX_RUNNER_SECRETS", "", "comma-separated env names passed through the secret channel"
    ),
    Setting("TEMPORAL_NAMESPACE", "default", "passed to runners as TEMPORAL_NAMESPACE"),
    Setting(
        "STIGMER_RUNNER_TOKEN_KEY", "", "base64 32-byte HS256 key; unset = token-less launches", secret=True
    ),
    Setting("SANDBOX_LANES_DRIVER_OPTIONS", "", "driver knobs as k=v,k=v (see the driver tables)"),
)
_BY_NAME = {s.env: s for s in SETTINGS}


def _get(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    return value if value != "" else _BY_NAME[name].default


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str:
    value = _get(env, name)
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is invalid; allowed: {', '.join(allowed)}")
    return value


def _int(env: Mapping[str, str], name: str, minimum: int = 1) -> int:
    value = _get(env, name)
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number") from None
    if number < minimum:
        raise ConfigError(f"{name}={number} must be at least {minimum}")
    return number


def _float(env: Mapping[str, str], name: str) -> float:
    value = _get(env, name)
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None
    if number <= 0:
        raise ConfigError(f"{name}={number} must be positive")
    return number


def _bool(env: Mapping[str, str], name: str) -> bool:
    value = _get(env, name).lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r} is invalid; allowed: true, false")


def _name_list(env: Mapping[str, str], name: str) -> list[str]:
    return [n.strip() for n in _get(env, name).split(",") if n.strip()]


def _options(env: Mapping[str, str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for item in _name_list(env, "SANDBOX_LANES_DRIVER_OPTIONS"):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"SANDBOX_LANES_DRIVER_OPTIONS item {item!r} is not key=value")
        options[key.strip()] = value.strip()
    return options


@dataclass(frozen=True)
class Settings:
    bootstrap: str
    group_id: str
    pod_id: str
    guarantee: Guarantee
    sequential_produce: bool
    partitions: int
    replication: int
    create_topics: bool
    topics: Topics
    session_timeout_ms: int
    shutdown_timeout_s: float
    ensure_timeout_s: float
    teardown_timeout_s: float
    provisioner_type: str
    agent: AgentExecutionTemporalConfig
    workflow: WorkflowExecutionTemporalConfig
    driver: DriverConfig
    raw: Mapping[str, str] = field(repr=False, default_factory=dict)

    def effective(self) -> dict[str, str]:
        """Every knob's effective value, secrets masked (``config show``)."""
        shown: dict[str, str] = {}
        for setting in SETTINGS:
            value = _get(self.raw, setting.env)
            if setting.env == "SANDBOX_LANES_POD_ID":
                value = self.pod_id
            shown[setting.env] = "****" if setting.secret and value else value
        return shown


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    env = dict(os.environ if environ is None else environ)
    guarantee = _choice(env, "SANDBOX_LANES_PROCESSING_GUARANTEE", get_args(Guarantee))
    agent = AgentExecutionTemporalConfig(
        runner_queue=_get(env, "TEMPORAL_AGENT_EXECUTION_RUNNER_TASK_QUEUE"),
        activity_routing=_choice(env, "STIGMER_ACTIVITY_ROUTING", (ROUTING_GLOBAL, ROUTING_SESSION)),
        default_execution_target=_get(env, "STIGMER_DEFAULT_EXECUTION_TARGET"),
    )
    workflow = WorkflowExecutionTemporalConfig(
        runner_queue=_get(env, "TEMPORAL_WORKFLOW_EXECUTION_RUNNER_TASK_QUEUE"),
        workflow_activity_routing=_choice(
            env, "STIGMER_WORKFLOW_ACTIVITY_ROUTING", (WORKFLOW_ROUTING_GLOBAL, WORKFLOW_ROUTING_EXECUTION)
        ),
        default_execution_target=_get(env, "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET"),
    )
    runner_env_names = _name_list(env, "STIGMER_SANDBOX_RUNNER_ENV")
    secret_names = _name_list(env, "STIGMER_SANDBOX_RUNNER_SECRETS")
    for listed in (*runner_env_names, *secret_names):
        if listed in SANDBOX_DRIVER_OWNED_RUNNER_ENV:
            raise ConfigError(f"runner env name '{listed}' is set by the driver itself and may not be listed")
        if listed not in env:
            raise ConfigError(f"runner env name '{listed}' is listed but has no value in the environment")
    both = sorted(set(runner_env_names) & set(secret_names))
    if both:
        raise ConfigError(f"runner env names on both lists: {', '.join(both)}")
    driver = DriverConfig(
        backend_endpoint=_get(env, "STIGMER_SANDBOX_BACKEND_ENDPOINT"),
        temporal_address=env.get("STIGMER_SANDBOX_TEMPORAL_ADDRESS")
        or env.get("TEMPORAL_HOST_PORT")
        or "localhost:7233",
        runner_image=_get(env, "STIGMER_SANDBOX_RUNNER_IMAGE"),
        runner_command=_get(env, "STIGMER_SANDBOX_RUNNER_COMMAND"),
        kubernetes_namespace=_get(env, "STIGMER_SANDBOX_K8S_NAMESPACE"),
        mcp_public_endpoint=_get(env, "STIGMER_SANDBOX_MCP_PUBLIC_ENDPOINT"),
        temporal_namespace=_get(env, "TEMPORAL_NAMESPACE"),
        runner_env={n: env[n] for n in runner_env_names},
        runner_secret_env={n: env[n] for n in secret_names},
        options=_options(env),
    )
    return Settings(
        bootstrap=_get(env, "KAFKA_BOOTSTRAP_SERVERS"),
        group_id=_get(env, "SANDBOX_LANES_GROUP_ID"),
        pod_id=_get(env, "SANDBOX_LANES_POD_ID") or socket.gethostname(),
        guarantee=guarantee,  # type: ignore[arg-type]
        sequential_produce=_bool(env, "SANDBOX_LANES_SEQUENTIAL_PRODUCE"),
        partitions=_int(env, "SANDBOX_LANES_PARTITIONS"),
        replication=_int(env, "SANDBOX_LANES_REPLICATION"),
        create_topics=_bool(env, "SANDBOX_LANES_CREATE_TOPICS"),
        topics=Topics(
            execution_created=_get(env, "SANDBOX_LANES_TOPIC_EXECUTION_CREATED"),
            phase_changed=_get(env, "SANDBOX_LANES_TOPIC_PHASE_CHANGED"),
            session_deleted=_get(env, "SANDBOX_LANES_TOPIC_SESSION_DELETED"),
            outcomes=_get(env, "SANDBOX_LANES_TOPIC_OUTCOMES"),
            state=_get(env, "SANDBOX_LANES_TOPIC_STATE"),
            dead_letter=_get(env, "SANDBOX_LANES_TOPIC_DLQ"),
        ),
        session_timeout_ms=_int(env, "SANDBOX_LANES_SESSION_TIMEOUT_MS", 1000),
        shutdown_timeout_s=_float(env, "SANDBOX_LANES_SHUTDOWN_TIMEOUT_S"),
        ensure_timeout_s=_float(env, "SANDBOX_LANES_ENSURE_TIMEOUT_S"),
        teardown_timeout_s=_float(env, "SANDBOX_LANES_TEARDOWN_TIMEOUT_S"),
        provisioner_type=_get(env, "SANDBOX_PROVISIONER_TYPE"),
        agent=agent,
        workflow=workflow,
        driver=driver,
        raw=env,
    )
