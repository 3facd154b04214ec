"""Configuration from the environment (12-factor), validated at start-up.

Upstream's variable names are kept where the knob is upstream's
(``SANDBOX_PROVISIONER_TYPE``, ``STIGMER_*``, ``TEMPORAL_*``); the pod's own
knobs are ``SANDBOX_LANES_*`` and ``KAFKA_BOOTSTRAP_SERVERS``. An empty value
counts as unset, as upstream does.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from consumers.lanes.constants import (
    DEFAULT_EXECUTION_TARGET_LOCAL,
    ROUTING_GLOBAL,
    ROUTING_SESSION,
    WORKFLOW_ROUTING_EXECUTION,
    WORKFLOW_ROUTING_GLOBAL,
)
from consumers.lanes.dispatch import AgentExecutionTemporalConfig, WorkflowExecutionTemporalConfig
from consumers.ops.config_file import CONFIG_FILE_ENV, ConfigFileError, did_you_mean, merge, read_config_file
from consumers.runtime.kafka.security import KafkaSecurity, KafkaSecurityError
from consumers.runtime.kafka.sink import Guarantee
from consumers.runtime.kafka.topology import Topics
from drivers.contract import SANDBOX_DRIVER_OWNED_RUNNER_ENV, DriverConfig
from drivers.naming import valid_installation
from drivers.runner.env import is_temporal_connection_name
from events.output_format import OUTPUT_FORMATS


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the variable and what is allowed."""


@dataclass(frozen=True)
class Setting:
    env: str
    default: str
    #: Its row in docs/configuration.md (Markdown; links relative to docs/), generated from here.
    help: str
    secret: bool = False
    #: The pod's own, never a runner's: a local-process runner inherits the pod's environment
    #: without these (every secret, and where a secret is read from).
    pod_only: bool = False
    #: What an empty ``default`` stands for, when it is computed at start-up (the doc's default column).
    doc_default: str = ""


#: Every knob, in the order docs/configuration.md lists them (``python -m consumers.ops.config_doc``
#: writes that file from this tuple; tests/unit/test_config_doc.py fails when the two differ).
SETTINGS: tuple[Setting, ...] = (
    Setting("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092", "Kafka bootstrap servers"),
    Setting(
        "KAFKA_SECURITY_PROTOCOL", "PLAINTEXT", "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL", pod_only=True
    ),
    Setting(
        "KAFKA_SSL_CA_FILE",
        "",
        "PEM CA bundle the brokers' certificates chain to (empty = the system's)",
        pod_only=True,
    ),
    Setting(
        "KAFKA_SSL_CERT_FILE", "", "PEM client certificate (mTLS), with KAFKA_SSL_KEY_FILE", pod_only=True
    ),
    Setting("KAFKA_SSL_KEY_FILE", "", "PEM private key of the client certificate", pod_only=True),
    Setting("KAFKA_SSL_KEY_PASSWORD", "", "password of an encrypted KAFKA_SSL_KEY_FILE", secret=True),
    Setting("KAFKA_SSL_KEY_PASSWORD_FILE", "", "read KAFKA_SSL_KEY_PASSWORD from this file", pod_only=True),
    Setting(
        "KAFKA_SSL_CHECK_HOSTNAME",
        "true",
        "verify the broker's host name against its certificate",
        pod_only=True,
    ),
    Setting("KAFKA_SASL_MECHANISM", "", "PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER", pod_only=True),
    Setting("KAFKA_SASL_USERNAME", "", "SASL user (PLAIN, SCRAM)", pod_only=True),
    Setting("KAFKA_SASL_PASSWORD", "", "SASL password (PLAIN, SCRAM)", secret=True),
    Setting("KAFKA_SASL_PASSWORD_FILE", "", "read KAFKA_SASL_PASSWORD from this file", pod_only=True),
    Setting(
        "KAFKA_SASL_OAUTHBEARER_TOKEN_FILE",
        "",
        "OAUTHBEARER: a file holding the token, re-read at every login (rotation)",
        pod_only=True,
    ),
    Setting(
        "KAFKA_SASL_OAUTHBEARER_TOKEN_COMMAND",
        "",
        "OAUTHBEARER: a command (no shell) printing the token, run at every login",
        pod_only=True,
    ),
    Setting(
        "SANDBOX_LANES_GROUP_ID",
        "sandbox-lanes",
        "consumer group id (also the transactional id prefix: `<group>-p<N>`)",
    ),
    Setting(
        "SANDBOX_LANES_INSTALLATION",
        "",
        "this installation's name, label `stigmer.ai/installation` on every object its driver makes; "
        "the pod acts only on objects carrying it, so two installations (production, staging) can share "
        "a namespace or an engine (see [drivers.md](drivers.md#installations)); 1-63 of a-z A-Z 0-9 - _ .",
        doc_default="`SANDBOX_LANES_GROUP_ID`",
    ),
    Setting(
        "SANDBOX_LANES_POD_ID",
        "",
        "this instance's id (logs, dead-letter headers, client id)",
        doc_default="hostname",
    ),
    Setting(
        "SANDBOX_LANES_STATIC_MEMBERSHIP",
        "false",
        "join the consumer group as static member `SANDBOX_LANES_POD_ID` (KIP-345): only with "
        "stable pod names, see [Probes](operations.md#probes-and-what-kubernetes-does-with-them)",
    ),
    Setting("SANDBOX_LANES_PROCESSING_GUARANTEE", "exactly_once", "`exactly_once` or `at_least_once`"),
    Setting("SANDBOX_LANES_SEQUENTIAL_PRODUCE", "false", "one record per produce request (needed on Tansu)"),
    Setting(
        "SANDBOX_LANES_PARTITIONS",
        "3",
        "partitions of every topic `sandbox-lanes topics` plans; the pod creates its own topics "
        "with its input topics' count (see [Topics](operations.md#topics))",
    ),
    Setting(
        "SANDBOX_LANES_REPLICATION",
        "-1",
        "replication factor of the topics created (`topics --apply`, the pod's own); `-1` = the "
        "broker's `default.replication.factor`",
    ),
    Setting(
        "SANDBOX_LANES_CREATE_TOPICS",
        "true",
        "the pod creates its own missing topics (state, outcomes, dead letters) at start-up; its "
        "input topics never",
    ),
    Setting("SANDBOX_LANES_TOPIC_EXECUTION_CREATED", "execution-created", "input: ExecutionCreated"),
    Setting("SANDBOX_LANES_TOPIC_PHASE_CHANGED", "phase-changed", "input: PhaseChanged"),
    Setting("SANDBOX_LANES_TOPIC_SESSION_DELETED", "session-deleted", "input: SessionDeleted"),
    Setting("SANDBOX_LANES_TOPIC_OUTCOMES", "sandbox-outcomes", "output: Sandbox* outcome events"),
    Setting(
        "SANDBOX_LANES_TOPIC_STATE", "sandbox-lanes-state", "compacted execution state (key = execution id)"
    ),
    Setting("SANDBOX_LANES_TOPIC_DLQ", "sandbox-lanes-dlq", "dead letters (reason in header `dlq_reason`)"),
    Setting(
        "SANDBOX_LANES_DEAD_LETTER_ATTEMPTS",
        "3",
        "attempts of a record whose transaction fails the same way each time (size, encoding) "
        "before it is dead-lettered (see [Bad input](guarantees.md#bad-input))",
    ),
    Setting(
        "SANDBOX_LANES_MAX_CLOCK_AHEAD_S",
        "300",
        ("how far an input's `occurred_at` may be ahead of its record timestamp before it is dead-lettered"),
    ),
    Setting(
        "SANDBOX_LANES_STATE_RETENTION_S",
        "604800",
        "age (since its last input) at which a finished execution's state is tombstoned; `0` keeps "
        "every state for ever (see [Retention](guarantees.md#retention))",
    ),
    Setting(
        "SANDBOX_LANES_MAX_SANDBOXES",
        "0",
        "live sandboxes this installation may hold at once (all pods, all partitions); over it a create "
        "waits its turn, admitted fairly across organisations as sandboxes end; `0`: no cap, upstream's "
        "behaviour (see [Capacity](guarantees.md#capacity))",
    ),
    Setting(
        "SANDBOX_LANES_MAX_SANDBOXES_PER_ORG",
        "0",
        "live sandboxes one organisation may hold at once; `0`: no cap "
        "(see [Capacity](guarantees.md#capacity))",
    ),
    Setting(
        "SANDBOX_LANES_ADMISSION_TIMEOUT_S",
        "600",
        "longest a create waits for capacity (a cap, or the engine's quota) before it ends as the lane's "
        "provisioning failure, its reason starting `capacity:`",
    ),
    Setting(
        "SANDBOX_LANES_STATE_STORE",
        "memory",
        "where a pod keeps its partitions' states: `memory` (restored from the state topic's beginning "
        "on every take-over) or `rocksdb` (one RocksDB database per partition under "
        "`SANDBOX_LANES_STATE_DIR`, with a checkpoint: a take-over reads only the topic's tail; see "
        "[State checkpoints](guarantees.md#state-checkpoints))",
    ),
    Setting(
        "SANDBOX_LANES_STATE_DIR",
        "/var/lib/sandbox-lanes/state",
        "the `rocksdb` state store's directory, one per pod (a database is locked by the pod that "
        "opened it): a volume that outlives the container, an `emptyDir` or a PersistentVolumeClaim per pod",
    ),
    Setting(
        "SANDBOX_LANES_SCHEMA_REGISTRY_URL",
        "",
        "a Confluent-compatible Schema Registry (`http(s)://host:port[/path]`, e.g. Apicurio's "
        "`/apis/ccompat/v7`): a framed input's schema id is looked up (cached) and its message checked "
        "against the topic's; empty = the framing is read and checked against this project's `.proto` "
        "layout ([input formats](input-formats.md))",
    ),
    Setting(
        "SANDBOX_LANES_OUTPUT_FORMAT",
        "cloudevents",
        "`cloudevents` (CloudEvents binary headers, protobuf value) or `schema-registry`: outcome values "
        "also framed in the Schema Registry wire format for `KafkaProtobufDeserializer` consumers, the "
        "schema registered at start-up under `<outcomes topic>-value` (needs "
        "`SANDBOX_LANES_SCHEMA_REGISTRY_URL`)",
    ),
    Setting(
        "SANDBOX_LANES_REDRIVE_MAX",
        "3",
        "`sandbox-lanes redrive`: a dead letter re-driven this many times is parked "
        "(left out unless `--force`)",
    ),
    Setting("SANDBOX_LANES_SESSION_TIMEOUT_MS", "10000", "consumer group session timeout"),
    Setting("SANDBOX_LANES_SHUTDOWN_TIMEOUT_S", "30", "bound on graceful shutdown after SIGTERM"),
    Setting("SANDBOX_LANES_ENSURE_TIMEOUT_S", "120", "bound on one driver ensure"),
    Setting("SANDBOX_LANES_MAX_BATCH", "500", "records fetched per turn at most"),
    Setting(
        "SANDBOX_LANES_TRANSACTION_TIMEOUT_MS",
        "15000",
        "Kafka transaction timeout (a transaction holds decisions and results, never a driver call)",
    ),
    Setting(
        "SANDBOX_LANES_DRIVER_CONCURRENCY",
        "32",
        "driver calls running at once across sandboxes (one sandbox's calls run in order)",
    ),
    Setting("SANDBOX_LANES_TEARDOWN_TIMEOUT_S", "60", "bound on one driver teardown"),
    Setting("SANDBOX_LANES_REAP_INTERVAL_S", "300", "seconds between the pod's reaper passes; `0` = off"),
    Setting("SANDBOX_LANES_REAP_GRACE_S", "600", "an orphan (no state) is reaped only when older than this"),
    Setting(
        "SANDBOX_PROVISIONER_TYPE",
        "",
        "driver: empty (lane disabled), `local-process`, `docker`, `kubernetes` (extensions: "
        "entry-point group `sandbox_lanes.drivers`; the in-memory test driver `memory` is "
        "registered by the dev harness only, never by the product)",
    ),
    Setting("STIGMER_ACTIVITY_ROUTING", ROUTING_GLOBAL, "agent routing: `global` or `session`"),
    Setting(
        "STIGMER_DEFAULT_EXECUTION_TARGET",
        DEFAULT_EXECUTION_TARGET_LOCAL,
        "what an UNSPECIFIED session target means: `local` or `cloud` (other values are kept, = "
        "local, with a start-up warning)",
    ),
    Setting(
        "STIGMER_WORKFLOW_ACTIVITY_ROUTING",
        WORKFLOW_ROUTING_GLOBAL,
        "workflow routing: `global` or `execution`",
    ),
    Setting(
        "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET",
        DEFAULT_EXECUTION_TARGET_LOCAL,
        "what an UNSPECIFIED workflow target means",
    ),
    Setting("TEMPORAL_AGENT_EXECUTION_RUNNER_TASK_QUEUE", "stigmer_runner", "agent global runner queue"),
    Setting(
        "TEMPORAL_WORKFLOW_EXECUTION_RUNNER_TASK_QUEUE", "stigmer_runner", "workflow global runner queue"
    ),
    Setting(
        "STIGMER_SANDBOX_BACKEND_ENDPOINT",
        "",
        "server URL as reachable from inside a sandbox (required by docker, kubernetes)",
    ),
    Setting(
        "STIGMER_SANDBOX_TEMPORAL_ADDRESS",
        "",
        "Temporal host:port from inside a sandbox",
        doc_default="`TEMPORAL_HOST_PORT`, else `localhost:7233`",
    ),
    Setting(
        "STIGMER_SANDBOX_RUNNER_IMAGE", "ghcr.io/stigmer/runner:latest", "image for docker and kubernetes"
    ),
    Setting("STIGMER_SANDBOX_RUNNER_COMMAND", "stigmer-runner", "executable for local-process"),
    Setting("STIGMER_SANDBOX_K8S_NAMESPACE", "stigmer-sandboxes", "the one shared sandbox namespace"),
    Setting("STIGMER_SANDBOX_MCP_PUBLIC_ENDPOINT", "", "public MCP address given to runners"),
    Setting(
        "STIGMER_SANDBOX_AGENT_SANDBOX_SUSPEND_AFTER_SECONDS",
        "330",
        "agent-sandbox: suspend a Running session Sandbox idle this long (whole seconds)",
    ),
    Setting(
        "STIGMER_SANDBOX_AGENT_SANDBOX_SWEEP_INTERVAL_SECONDS",
        "30",
        "agent-sandbox: idle sweep period (whole seconds, at most the window)",
    ),
    Setting(
        "STIGMER_SANDBOX_RUNNER_ENV", "", "comma-separated env names passed to runners as plain settings"
    ),
    Setting(
        "STIGMER_SANDBOX_RUNNER_SECRETS",
        "",
        "comma-separated env names passed through the driver's secret channel",
    ),
    Setting("TEMPORAL_NAMESPACE", "default", "passed to runners as `TEMPORAL_NAMESPACE`"),
    Setting(
        "STIGMER_RUNNER_TOKEN_KEY", "", "base64 32-byte HS256 key; unset = token-less launches", secret=True
    ),
    Setting(
        "SANDBOX_LANES_DRIVER_OPTIONS",
        "",
        "driver knobs as `k=v,k=v` (each driver's table in [drivers.md](drivers.md))",
    ),
    Setting(
        "SANDBOX_LANES_CREDENTIAL_PROVIDER",
        "",
        "an installed credential provider by its entry-point name (group "
        "`sandbox_lanes.credentials`, a factory `(environ, logger) → provider`; with "
        "`mint_sandbox_credential` it decides every mint); empty = the execution-scoped HS256 "
        "provider",
    ),
    Setting(
        "STIGMER_RUNNER_TOKEN_KEY_FILE", "", "read `STIGMER_RUNNER_TOKEN_KEY` from this file", pod_only=True
    ),
    Setting("SANDBOX_LANES_HTTP_HOST", "0.0.0.0", "address of the `/metrics`, `/healthz`, `/readyz` server"),
    Setting("SANDBOX_LANES_HTTP_PORT", "8080", "its port; `0` = no HTTP server"),
    Setting(
        "SANDBOX_LANES_STALL_SECONDS",
        "30",
        "the loop counts as stalled (`/healthz` 503) after standing still this long beyond the "
        "deadlines of the broker waits it is in; commits failing this long make `/readyz` 503",
    ),
    Setting("SANDBOX_LANES_LOG_LEVEL", "info", "`debug`, `info`, `warning`, `error` (`--log-level` wins)"),
    Setting("SANDBOX_LANES_LOG_FORMAT", "auto", "`auto` (human on a terminal, else JSON), `json`, `human`"),
    Setting(
        "SANDBOX_LANES_CONFIG_FILE",
        "",
        "optional YAML or `.env` file of these variables (`--config FILE`); the environment wins",
    ),
    Setting(
        "SANDBOX_LANES_REVISION",
        "",
        "the source revision of the build (the image sets it from its `REVISION` build argument); "
        "the `revision` label of `sandbox_lanes_build_info`",
    ),
)

#: ``SANDBOX_LANES_*`` names read by the dev harness and the bench, not by the pod: accepted (a test
#: run exports them to every pod it starts), never a setting.
TOOL_ENV_NAMES: frozenset[str] = frozenset(
    {
        "SANDBOX_LANES_CACHE",
        "SANDBOX_LANES_FORBID_SKIPS",
        "SANDBOX_LANES_KAFKA_JVM_OPTS",
        "SANDBOX_LANES_KUBE_VERSION",
    }
)
_OWN_PREFIX = "SANDBOX_LANES_"
#: What Kubernetes puts into a pod's environment for every Service of its namespace (service links:
#: a Service ``sandbox-lanes-metrics`` gives ``SANDBOX_LANES_METRICS_SERVICE_HOST``, ``…_PORT``,
#: ``…_PORT_8080_TCP_ADDR`` …): never a typo of a setting, so passed through.
_SERVICE_LINK = re.compile(
    r"^[A-Z0-9_]+_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT|PORT_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)$"
)
_UPSTREAM_PREFIX = "STIGMER_"

#: Drivers that start an image: its runner's HOME is the image's, never a listed value.
IMAGE_DRIVERS: frozenset[str] = frozenset({"docker", "kubernetes", "agent-sandbox"})
#: Runner secrets this pod knows by name: they belong on STIGMER_SANDBOX_RUNNER_SECRETS (the
#: drivers' secret channel), never on the plain list.
KNOWN_RUNNER_SECRETS: frozenset[str] = frozenset(
    {"ANTHROPIC_API_KEY", "OPENAI_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "GITHUB_TOKEN"}
)

#: Names a runner never inherits from the pod's environment (the local-process driver's children).
RUNNER_WITHHELD_ENV: frozenset[str] = frozenset(s.env for s in SETTINGS if s.secret or s.pod_only)
_BY_NAME = {s.env: s for s in SETTINGS}


def _get(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    return value if value != "" else _BY_NAME[name].default


_STATE_STORES = ("memory", "rocksdb")


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


def _replication(env: Mapping[str, str]) -> int:
    value = _get(env, "SANDBOX_LANES_REPLICATION")
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1 and number != -1:
        raise ConfigError(
            f"SANDBOX_LANES_REPLICATION={value!r} is invalid; allowed: -1 (the broker's default) or a whole "
            f"number of at least 1"
        )
    return number


def _float(env: Mapping[str, str], name: str, *, allow_zero: bool = False) -> float:
    value = _get(env, name)
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None
    if allow_zero and number < 0:
        raise ConfigError(f"{name}={number:g} must be zero or positive")
    if not allow_zero and number <= 0:
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


#: Upstream's named driver settings, handed to the driver as options (it validates them at boot).
_NAMED_DRIVER_OPTIONS: dict[str, str] = {
    "STIGMER_SANDBOX_AGENT_SANDBOX_SUSPEND_AFTER_SECONDS": "suspend_after_seconds",
    "STIGMER_SANDBOX_AGENT_SANDBOX_SWEEP_INTERVAL_SECONDS": "sweep_interval_seconds",
}


def _options(env: Mapping[str, str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for item in _name_list(env, "SANDBOX_LANES_DRIVER_OPTIONS"):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"SANDBOX_LANES_DRIVER_OPTIONS item {item!r} is not key=value")
        options[key.strip()] = value.strip()
    for env_name, option in _NAMED_DRIVER_OPTIONS.items():
        if env.get(env_name, "").strip():
            options[option] = env[env_name]
    return options


_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("auto", "json", "human")
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_SECRET_OPTION = re.compile(r"token|password|secret|credential", re.IGNORECASE)


def _port(env: Mapping[str, str], name: str) -> int:
    value = _get(env, name)
    if not value.isdigit() or not 0 <= int(value) <= 65535:
        raise ConfigError(f"{name}={value!r} is invalid; allowed: a port number 0-65535 (0 = off)")
    return int(value)


def _log_level(env: Mapping[str, str]) -> str:
    value = _get(env, "SANDBOX_LANES_LOG_LEVEL").lower()
    if value not in _LOG_LEVELS:
        raise ConfigError(f"SANDBOX_LANES_LOG_LEVEL={value!r} is invalid; allowed: {', '.join(_LOG_LEVELS)}")
    return value


def _bootstrap(env: Mapping[str, str]) -> str:
    value = _get(env, "KAFKA_BOOTSTRAP_SERVERS")
    for item in value.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(
                f"KAFKA_BOOTSTRAP_SERVERS={value!r} is invalid; allowed: comma-separated host:port "
                f"(port 1-65535), e.g. 127.0.0.1:9092"
            )
    return value


def _topics(env: Mapping[str, str], *, capacity_on: bool = False) -> Topics:
    names = {
        "SANDBOX_LANES_TOPIC_EXECUTION_CREATED": "execution_created",
        "SANDBOX_LANES_TOPIC_PHASE_CHANGED": "phase_changed",
        "SANDBOX_LANES_TOPIC_SESSION_DELETED": "session_deleted",
        "SANDBOX_LANES_TOPIC_OUTCOMES": "outcomes",
        "SANDBOX_LANES_TOPIC_STATE": "state",
        "SANDBOX_LANES_TOPIC_DLQ": "dead_letter",
    }
    values: dict[str, str] = {}
    for var in names:
        topic = _get(env, var)
        if not _TOPIC.match(topic) or topic in (".", ".."):
            raise ConfigError(
                f"{var}={topic!r} is invalid; allowed: a Kafka topic name of 1-249 characters from "
                f"a-z A-Z 0-9 . _ -"
            )
        clash = next((other for other, t in values.items() if t == topic), None)
        if clash is not None:
            raise ConfigError(
                f"{var}={topic!r} is invalid: the same topic as {clash}; every topic must differ"
            )
        values[var] = topic
    return Topics(**{names[var]: topic for var, topic in values.items()}, capacity_on=capacity_on)


def _registry_url(env: Mapping[str, str]) -> str:
    url = _get(env, "SANDBOX_LANES_SCHEMA_REGISTRY_URL")
    if url and not re.match(r"^https?://[^/\s]+(/\S*)?$", url):
        raise ConfigError(
            f"SANDBOX_LANES_SCHEMA_REGISTRY_URL={url!r} is not an http:// or https:// URL "
            "(e.g. http://registry:8080/apis/ccompat/v7)"
        )
    return url.rstrip("/")


def _output_format(env: Mapping[str, str]) -> str:
    chosen = _choice(env, "SANDBOX_LANES_OUTPUT_FORMAT", OUTPUT_FORMATS)
    if chosen == "schema-registry" and not _get(env, "SANDBOX_LANES_SCHEMA_REGISTRY_URL"):
        raise ConfigError(
            "SANDBOX_LANES_OUTPUT_FORMAT=schema-registry needs SANDBOX_LANES_SCHEMA_REGISTRY_URL "
            "(the outcomes' schema is registered there at start-up)"
        )
    return chosen


def _installation(env: Mapping[str, str]) -> str:
    """``SANDBOX_LANES_INSTALLATION``, else the consumer group: a label value either way."""
    name = "SANDBOX_LANES_INSTALLATION"
    if not _get(env, name):
        name = "SANDBOX_LANES_GROUP_ID"
    try:
        return valid_installation(_get(env, name))
    except ValueError as exc:
        hint = "" if name == "SANDBOX_LANES_INSTALLATION" else " (set SANDBOX_LANES_INSTALLATION)"
        raise ConfigError(f"{name}: {exc}{hint}") from None


def _provisioner_type(env: Mapping[str, str]) -> str:
    from drivers.registry import known_types

    value = _get(env, "SANDBOX_PROVISIONER_TYPE")
    known = known_types()
    if value and value not in known:
        listed = ", ".join(f"'{n}'" for n in known)
        raise ConfigError(f"unknown sandbox provisioner type '{value}' — known types: {listed}")
    return value


def _secret_text(env: Mapping[str, str], name: str) -> str:
    """A secret from its variable or, when that is empty, from the file ``<name>_FILE`` names."""
    value = _get(env, name)
    path = _get(env, f"{name}_FILE")
    if value and path:
        raise ConfigError(f"{name} and {name}_FILE are both set: give one")
    if value or not path:
        return value
    return _secret_file_text(name, path)


def _secret_file_text(name: str, path: str) -> str:
    """The text of the file ``<name>_FILE`` names (stripped), or a ConfigError naming it."""
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{name}_FILE={path!r} cannot be read: {exc.strerror}") from None


def _kafka_security(env: Mapping[str, str]) -> KafkaSecurity:
    security = KafkaSecurity(
        protocol=_get(env, "KAFKA_SECURITY_PROTOCOL").upper(),
        ca_file=_get(env, "KAFKA_SSL_CA_FILE"),
        cert_file=_get(env, "KAFKA_SSL_CERT_FILE"),
        key_file=_get(env, "KAFKA_SSL_KEY_FILE"),
        key_password=_secret_text(env, "KAFKA_SSL_KEY_PASSWORD"),
        check_hostname=_bool(env, "KAFKA_SSL_CHECK_HOSTNAME"),
        sasl_mechanism=_get(env, "KAFKA_SASL_MECHANISM").upper(),
        sasl_username=_get(env, "KAFKA_SASL_USERNAME"),
        sasl_password=_secret_text(env, "KAFKA_SASL_PASSWORD"),
        oauth_token_file=_get(env, "KAFKA_SASL_OAUTHBEARER_TOKEN_FILE"),
        oauth_token_command=_get(env, "KAFKA_SASL_OAUTHBEARER_TOKEN_COMMAND"),
    )
    try:
        security.validate()
    except KafkaSecurityError as exc:
        raise ConfigError(str(exc)) from None
    return security


def _token_key_text(env: Mapping[str, str]) -> str:
    """The signing key's base64 text, from the variable or its file, validated ('' = unset)."""
    name, raw = "STIGMER_RUNNER_TOKEN_KEY", _get(env, "STIGMER_RUNNER_TOKEN_KEY")
    path = _get(env, "STIGMER_RUNNER_TOKEN_KEY_FILE")
    if not raw and path:
        raw = _secret_file_text(name, path)
        name = "STIGMER_RUNNER_TOKEN_KEY_FILE"
    if not raw:
        return ""
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{name} is invalid; allowed: base64 of a 32-byte key (not valid base64)") from None
    if len(key) != 32:
        raise ConfigError(
            f"{name} is invalid; allowed: base64 of a 32-byte key (it decodes to {len(key)} bytes)"
        )
    return raw


#: The server's own Temporal connection settings, handed to every runner (spec 1.2.7).
TEMPORAL_CONNECTION_PREFIX = "STIGMER_TEMPORAL_"


def _temporal_connection_env(env: Mapping[str, str]) -> dict[str, str]:
    """``STIGMER_TEMPORAL_*`` re-rendered for a runner: every ``…_PATH`` (a PEM on the pod's disk) as
    its ``…_DATA`` twin with the file's content, every other setting as is. Never both forms of one:
    the runner refuses to boot next to both."""
    out: dict[str, str] = {}
    for name, value in sorted(env.items()):
        if not name.startswith(TEMPORAL_CONNECTION_PREFIX) or not value:
            continue
        if name.endswith("_PATH"):
            twin = name[: -len("_PATH")] + "_DATA"
            if env.get(twin):
                raise ConfigError(f"{name} and {twin} are both set; give the file or its content, not both")
            try:
                out[twin] = Path(value).read_text()
            except OSError as exc:
                raise ConfigError(f"{name}={value!r} cannot be read: {exc.strerror}") from None
        else:
            out[name] = value
    return out


def _credential_provider(env: Mapping[str, str]) -> str:
    from consumers.runtime.runner_tokens import credential_provider_names

    name = _get(env, "SANDBOX_LANES_CREDENTIAL_PROVIDER")
    if not name:
        return ""
    installed = credential_provider_names()
    if name not in installed:
        known = ", ".join(f"'{n}'" for n in installed) or "none installed"
        raise ConfigError(
            f"SANDBOX_LANES_CREDENTIAL_PROVIDER={name!r} is invalid: no credential provider of that name "
            f"is installed (entry-point group sandbox_lanes.credentials; known: {known})"
        )
    return name


def _unknown_names(env: Mapping[str, str], runner_names: set[str]) -> list[str]:
    """Refuse an unknown ``SANDBOX_LANES_*`` name, and a ``STIGMER_*`` name close to one of ours (a
    typo); the warnings for other ``STIGMER_*`` names (upstream's server reads more of them, so a
    shared ConfigMap may carry them). Passed through: ``STIGMER_TEMPORAL_*`` (the server's Temporal
    connection, handed to every runner), names listed for the runners, the dev tools' names."""
    known = set(_BY_NAME)
    warnings = []
    for name in sorted(env):
        if name in known or name in TOOL_ENV_NAMES or name in runner_names or _SERVICE_LINK.match(name):
            continue
        if name.startswith(_OWN_PREFIX):
            raise ConfigError(
                f"unknown setting {name!r}{did_you_mean(name, known)} (see `sandbox-lanes config show`)"
            )
        if name.startswith(_UPSTREAM_PREFIX) and not name.startswith(TEMPORAL_CONNECTION_PREFIX):
            hint = did_you_mean(name, known)
            if hint:
                raise ConfigError(f"unknown setting {name!r}{hint}")
            warnings.append(f"{name} is not a setting of this pod; ignored")
    return warnings


def _driver_option_keys(provisioner_type: str, options: Mapping[str, str]) -> None:
    from drivers.registry import option_keys

    allowed = option_keys(provisioner_type)
    if allowed is None:
        return
    for key in options:
        if key not in allowed:
            raise ConfigError(
                f"SANDBOX_LANES_DRIVER_OPTIONS: unknown option {key!r} for driver '{provisioner_type}'"
                f"{did_you_mean(key, allowed)} (known: {', '.join(sorted(allowed))})"
            )


def _target_warnings(env: Mapping[str, str]) -> list[str]:
    warnings = []
    for name in ("STIGMER_DEFAULT_EXECUTION_TARGET", "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET"):
        value = _get(env, name)
        if value not in ("local", "cloud"):
            warnings.append(
                f"{name}={value!r} is neither 'local' nor 'cloud'; as upstream, anything but exactly "
                f"'cloud' means local"
            )
    return warnings


@dataclass(frozen=True)
class Settings:
    bootstrap: str
    group_id: str
    pod_id: str
    guarantee: Guarantee
    sequential_produce: bool
    static_membership: bool
    partitions: int
    replication: int
    create_topics: bool
    topics: Topics
    session_timeout_ms: int
    shutdown_timeout_s: float
    driver_concurrency: int
    max_batch: int
    transaction_timeout_ms: int
    dead_letter_attempts: int
    max_clock_ahead_s: float
    state_retention_s: float
    max_sandboxes: int
    max_sandboxes_per_org: int
    admission_timeout_s: float
    #: The state store (``memory`` or ``rocksdb``) and the ``rocksdb`` store's directory.
    state_store: str
    state_dir: str
    ensure_timeout_s: float
    teardown_timeout_s: float
    provisioner_type: str
    #: Seconds between the pod's reaper passes (0 = off) and the reaper's grace period.
    reap_interval_s: float
    reap_grace_s: float
    agent: AgentExecutionTemporalConfig
    workflow: WorkflowExecutionTemporalConfig
    driver: DriverConfig
    raw: Mapping[str, str] = field(repr=False, default_factory=dict)
    http_host: str = "0.0.0.0"
    http_port: int = 8080
    stall_seconds: float = 30.0
    log_level: str = "info"
    log_format: str = "auto"
    config_file: str = ""
    #: Accepted but suspicious values (logged at start-up, printed by ``config show``).
    warnings: tuple[str, ...] = ()
    #: The signing key's text however it was given (variable or file): the provider's key, redacted.
    runner_token_key: str = field(repr=False, default="")
    #: An installed credential provider's entry-point name; "" = the execution-scoped provider.
    credential_provider: str = ""
    #: How every Kafka client of the pod and its tools authenticates (TLS, SASL).
    kafka_security: KafkaSecurity = field(default_factory=KafkaSecurity)
    #: The source revision of this build (the image sets SANDBOX_LANES_REVISION); "" = unknown.
    revision: str = ""
    #: A Confluent-compatible Schema Registry's base URL; "" = none (docs/input-formats.md).
    schema_registry_url: str = ""
    #: ``cloudevents`` or ``schema-registry`` (outcomes framed for ``KafkaProtobufDeserializer``).
    output_format: str = "cloudevents"
    #: ``sandbox-lanes redrive`` parks a dead letter re-driven this many times.
    redrive_max: int = 3

    @property
    def secret_values(self) -> list[str]:
        """Values the logs must never show: the signing key and the runner secrets."""
        values = [
            self.runner_token_key,
            *self.kafka_security.secret_values,
            *self.driver.runner_secret_env.values(),
            *self.driver.temporal_connection_env.values(),
        ]
        return [v for v in values if v]

    def effective(self) -> dict[str, str]:
        """Every knob's effective value, secrets masked (``config show``)."""
        shown: dict[str, str] = {}
        for setting in SETTINGS:
            value = _get(self.raw, setting.env)
            if setting.env == "SANDBOX_LANES_POD_ID":
                value = self.pod_id
            if setting.env == "SANDBOX_LANES_DRIVER_OPTIONS" and value:
                value = ",".join(
                    f"{k}=****" if _SECRET_OPTION.search(k) and v else f"{k}={v}"
                    for k, v in self.driver.options.items()
                )
            shown[setting.env] = "****" if setting.secret and value else value
        return shown


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    env = dict(os.environ if environ is None else environ)
    config_file = env.get(CONFIG_FILE_ENV, "")
    if config_file:
        try:
            env = merge(read_config_file(Path(config_file), _BY_NAME), env)
        except ConfigFileError as exc:
            raise ConfigError(str(exc)) from None
    token_key = _token_key_text(env)
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
    provisioner_type = _provisioner_type(env)
    runner_env_names = _name_list(env, "STIGMER_SANDBOX_RUNNER_ENV")
    secret_names = _name_list(env, "STIGMER_SANDBOX_RUNNER_SECRETS")
    name_warnings = _unknown_names(env, {*runner_env_names, *secret_names})
    if provisioner_type:
        _driver_option_keys(
            provisioner_type,
            _options({"SANDBOX_LANES_DRIVER_OPTIONS": _get(env, "SANDBOX_LANES_DRIVER_OPTIONS")}),
        )
    for var, listed in [
        *(("STIGMER_SANDBOX_RUNNER_ENV", n) for n in runner_env_names),
        *(("STIGMER_SANDBOX_RUNNER_SECRETS", n) for n in secret_names),
    ]:
        if listed in SANDBOX_DRIVER_OWNED_RUNNER_ENV:
            raise ConfigError(
                f"{var}: runner env name '{listed}' is set by the driver itself and may not be listed"
            )
        if not env.get(listed):
            raise ConfigError(
                f"{var}: runner env name '{listed}' is listed but has no value in the environment"
            )
        if is_temporal_connection_name(listed):
            raise ConfigError(
                f"{var}: runner env name '{listed}' is a Temporal connection setting; the runner gets the "
                f"server's own Temporal connection, never a listed one"
            )
        if listed == "HOME" and provisioner_type in IMAGE_DRIVERS:
            raise ConfigError(
                f"{var}: runner env name 'HOME' may not be listed for the image-starting driver "
                f"'{provisioner_type}' (the image's runner home is fixed)"
            )
    plain_secrets = sorted(set(runner_env_names) & set(KNOWN_RUNNER_SECRETS))
    if plain_secrets:
        raise ConfigError(
            f"STIGMER_SANDBOX_RUNNER_ENV: known runner secrets on the plain list: {', '.join(plain_secrets)} "
            f"(list them in STIGMER_SANDBOX_RUNNER_SECRETS)"
        )
    both = sorted(set(runner_env_names) & set(secret_names))
    if both:
        raise ConfigError(
            f"STIGMER_SANDBOX_RUNNER_ENV and STIGMER_SANDBOX_RUNNER_SECRETS: runner env names on both "
            f"lists: {', '.join(both)}"
        )
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
        temporal_connection_env=_temporal_connection_env(env),
        withheld_env=RUNNER_WITHHELD_ENV,
        installation=_installation(env),
    )
    max_sandboxes = _int(env, "SANDBOX_LANES_MAX_SANDBOXES", 0)
    max_per_org = _int(env, "SANDBOX_LANES_MAX_SANDBOXES_PER_ORG", 0)
    return Settings(
        bootstrap=_bootstrap(env),
        group_id=_get(env, "SANDBOX_LANES_GROUP_ID"),
        pod_id=_get(env, "SANDBOX_LANES_POD_ID") or socket.gethostname(),
        guarantee=guarantee,  # type: ignore[arg-type]
        sequential_produce=_bool(env, "SANDBOX_LANES_SEQUENTIAL_PRODUCE"),
        static_membership=_bool(env, "SANDBOX_LANES_STATIC_MEMBERSHIP"),
        partitions=_int(env, "SANDBOX_LANES_PARTITIONS"),
        replication=_replication(env),
        create_topics=_bool(env, "SANDBOX_LANES_CREATE_TOPICS"),
        topics=_topics(env, capacity_on=max_sandboxes > 0 or max_per_org > 0),
        session_timeout_ms=_int(env, "SANDBOX_LANES_SESSION_TIMEOUT_MS", 1000),
        shutdown_timeout_s=_float(env, "SANDBOX_LANES_SHUTDOWN_TIMEOUT_S"),
        driver_concurrency=_int(env, "SANDBOX_LANES_DRIVER_CONCURRENCY", 1),
        max_batch=_int(env, "SANDBOX_LANES_MAX_BATCH", 1),
        transaction_timeout_ms=_int(env, "SANDBOX_LANES_TRANSACTION_TIMEOUT_MS", 1000),
        dead_letter_attempts=_int(env, "SANDBOX_LANES_DEAD_LETTER_ATTEMPTS", 1),
        max_clock_ahead_s=_float(env, "SANDBOX_LANES_MAX_CLOCK_AHEAD_S"),
        state_retention_s=_int(env, "SANDBOX_LANES_STATE_RETENTION_S", 0),
        max_sandboxes=max_sandboxes,
        max_sandboxes_per_org=max_per_org,
        admission_timeout_s=_float(env, "SANDBOX_LANES_ADMISSION_TIMEOUT_S", allow_zero=True),
        state_store=_choice(env, "SANDBOX_LANES_STATE_STORE", _STATE_STORES),
        state_dir=_get(env, "SANDBOX_LANES_STATE_DIR"),
        ensure_timeout_s=_float(env, "SANDBOX_LANES_ENSURE_TIMEOUT_S"),
        teardown_timeout_s=_float(env, "SANDBOX_LANES_TEARDOWN_TIMEOUT_S"),
        provisioner_type=provisioner_type,
        reap_interval_s=_float(env, "SANDBOX_LANES_REAP_INTERVAL_S", allow_zero=True),
        reap_grace_s=_float(env, "SANDBOX_LANES_REAP_GRACE_S", allow_zero=True),
        agent=agent,
        workflow=workflow,
        driver=driver,
        raw=env,
        http_host=_get(env, "SANDBOX_LANES_HTTP_HOST"),
        http_port=_port(env, "SANDBOX_LANES_HTTP_PORT"),
        stall_seconds=_float(env, "SANDBOX_LANES_STALL_SECONDS"),
        log_level=_log_level(env),
        log_format=_choice(env, "SANDBOX_LANES_LOG_FORMAT", _LOG_FORMATS),
        config_file=config_file,
        warnings=(*_target_warnings(env), *name_warnings),
        runner_token_key=token_key,
        credential_provider=_credential_provider(env),
        kafka_security=_kafka_security(env),
        revision=_get(env, "SANDBOX_LANES_REVISION"),
        schema_registry_url=_registry_url(env),
        output_format=_output_format(env),
        redrive_max=_int(env, "SANDBOX_LANES_REDRIVE_MAX", 1),
    )
