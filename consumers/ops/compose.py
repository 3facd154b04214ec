"""The composition root: settings → driver, credentials, lane config, processor, pod."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from consumers.lanes.commands import LaneConfig
from consumers.lanes.constants import (
    LOG_PROVISIONER_COMPOSED,
    ROUTING_SESSION,
    WORKFLOW_ROUTING_EXECUTION,
    routing_coherence_message,
)
from consumers.ops.settings import ConfigError, Settings
from consumers.runtime import tracing
from consumers.runtime.executor import CommandRunner, DriverExecutor
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.pod import Pod
from consumers.runtime.pod_config import PodConfig
from consumers.runtime.processor import LaneProcessor
from consumers.runtime.runner_tokens import (
    ExecutionScopedRunnerCredentialProvider,
    RunnerCredentialProvider,
    load_credential_provider,
)
from consumers.runtime.state.store import open_store
from consumers.runtime.tracing import decision_traceparent
from drivers.contract import SandboxProvisioner
from drivers.registry import new_sandbox_provisioner


@dataclass
class Composed:
    pod: Pod
    provisioner: SandboxProvisioner | None
    lane: LaneConfig
    metrics: PodMetrics


def build_provisioner(settings: Settings, logger: logging.Logger) -> SandboxProvisioner | None:
    """The configured driver, built and not started: a factory validates its options and finds its
    client configuration (kubeconfig, in-cluster account) without calling anything, so ``config check``
    builds it too. What a factory refuses (a ValueError, upstream's boot-fatal error) is a ConfigError."""
    try:
        provisioner = new_sandbox_provisioner(settings.provisioner_type, settings.driver, logger)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if provisioner is None:
        return None
    if (
        settings.agent.activity_routing != ROUTING_SESSION
        and settings.workflow.workflow_activity_routing != WORKFLOW_ROUTING_EXECUTION
    ):
        raise ConfigError(routing_coherence_message(settings.provisioner_type))
    logger.info(
        LOG_PROVISIONER_COMPOSED,
        extra={"type": settings.provisioner_type, "installation": settings.driver.installation},
    )
    return provisioner


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sandbox-lanes")
    except PackageNotFoundError:
        return "unknown"


def pod_config(settings: Settings) -> PodConfig:
    return PodConfig(
        bootstrap=settings.bootstrap,
        group_id=settings.group_id,
        topics=settings.topics,
        partitions=settings.partitions,
        replication=settings.replication,
        guarantee=settings.guarantee,
        sequential_produce=settings.sequential_produce,
        pod_id=settings.pod_id,
        static_membership=settings.static_membership,
        session_timeout_ms=settings.session_timeout_ms,
        shutdown_timeout_s=settings.shutdown_timeout_s,
        driver_concurrency=settings.driver_concurrency,
        max_batch=settings.max_batch,
        transaction_timeout_ms=settings.transaction_timeout_ms,
        dead_letter_attempts=settings.dead_letter_attempts,
        max_clock_ahead_s=settings.max_clock_ahead_s,
        state_retention_s=settings.state_retention_s,
        max_sandboxes=settings.max_sandboxes,
        max_sandboxes_per_org=settings.max_sandboxes_per_org,
        admission_timeout_s=settings.admission_timeout_s,
        create_topics=settings.create_topics,
        security=settings.kafka_security,
    )


def compose(
    settings: Settings,
    logger: logging.Logger,
    *,
    provisioner: SandboxProvisioner | None = None,
    credentials: RunnerCredentialProvider | None = None,
) -> Composed:
    """Build the pod. ``provisioner``/``credentials`` override the configured ones (tests, chaos)."""
    if provisioner is None:
        provisioner = build_provisioner(settings, logger)
    metrics = PodMetrics()
    metrics.set_build(package_version(), settings.revision)
    bind_metrics = getattr(provisioner, "bind_metrics", None)
    if bind_metrics is not None:  # a driver's own metrics (agent-sandbox's warm pool) on /metrics
        bind_metrics(metrics.registry)
    if credentials is not None:
        creds = credentials
    elif settings.credential_provider:
        creds = load_credential_provider(settings.credential_provider, settings.raw, logger)
    else:
        # The key as settings read and validated it (variable or file): the file is read once.
        creds = ExecutionScopedRunnerCredentialProvider.from_key_text(settings.runner_token_key)
    lane = LaneConfig(
        enabled=provisioner is not None,
        agent=settings.agent,
        workflow=settings.workflow,
        driver_name=provisioner.driver_name if provisioner is not None else "",
        source=f"sandbox-lanes/{settings.pod_id}",
        capacity=settings.topics.capacity_on,
    )
    # The disabled lane emits no commands, so the base runner (which refuses) is never called.
    runner: CommandRunner = (
        CommandRunner()
        if provisioner is None
        else DriverExecutor(
            provisioner,
            creds,
            logger,
            ensure_timeout_s=settings.ensure_timeout_s,
            teardown_timeout_s=settings.teardown_timeout_s,
            admission_timeout_s=settings.admission_timeout_s,
            metrics=metrics,
        )
    )
    processor = LaneProcessor(lane, runner, logger)
    config = pod_config(settings)
    store = open_store(
        "rocksdb" if settings.state_store == "rocksdb" else "memory",
        config.topics.state,
        config.state_retention_s,
        settings.state_dir,
    )
    pod = Pod(config, processor, metrics, store)
    try:
        active = tracing.configure(group=settings.group_id)  # off unless the OTEL_* variables ask
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if active is not None:
        pod.effects.trace_of = lambda partition, key, effect_id: decision_traceparent(
            store.get(partition, key), effect_id
        )
        pod.effects.driver = lane.driver_name
    return Composed(pod, provisioner, lane, metrics)
