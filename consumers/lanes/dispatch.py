"""Execution-target resolution and task-queue dispatch (spec 2.6), as pure functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from consumers.lanes.constants import (
    DEFAULT_EXECUTION_TARGET_CLOUD,
    DEFAULT_EXECUTION_TARGET_LOCAL,
    ROUTING_GLOBAL,
    ROUTING_SESSION,
    SESSION_QUEUE_PREFIX,
    WFEXEC_QUEUE_PREFIX,
    WORKFLOW_ROUTING_EXECUTION,
    WORKFLOW_ROUTING_GLOBAL,
)
from events.sandbox_lanes.v1 import common_pb2


@dataclass(frozen=True)
class AgentExecutionTemporalConfig:
    """Upstream's positional ``(stigmerQueue, runnerQueue, activityRouting, defaultExecutionTarget)``."""

    stigmer_queue: str = "agent_execution_stigmer"
    runner_queue: str = "stigmer_runner"
    activity_routing: str = ROUTING_GLOBAL
    default_execution_target: str = DEFAULT_EXECUTION_TARGET_LOCAL


@dataclass(frozen=True)
class WorkflowExecutionTemporalConfig:
    """Upstream's positional ``(stigmerQueue, runnerQueue, workflowActivityRouting, defaultTarget)``."""

    stigmer_queue: str = "workflow_execution_stigmer"
    runner_queue: str = "stigmer_runner"
    workflow_activity_routing: str = WORKFLOW_ROUTING_GLOBAL
    default_execution_target: str = DEFAULT_EXECUTION_TARGET_LOCAL


def format_session_task_queue(session_id: str) -> str:
    return SESSION_QUEUE_PREFIX + session_id


def format_wfexec_task_queue(execution_id: str) -> str:
    return WFEXEC_QUEUE_PREFIX + execution_id


def resolve_execution_target(target: int, default_execution_target: str) -> int:
    """The single UNSPECIFIED rule (oss#397): CLOUD only when the default is exactly "cloud"."""
    if target != common_pb2.EXECUTION_TARGET_UNSPECIFIED:
        return target
    if default_execution_target == DEFAULT_EXECUTION_TARGET_CLOUD:
        return common_pb2.CLOUD
    return common_pb2.LOCAL


class Dispatch(NamedTuple):
    """Immutable and compared by value; a NamedTuple because one is built per decision."""

    task_queue: str
    execution_target: int
    via_override: bool = False


def resolve_activity_task_queue(
    session_id: str,
    session_target: int,
    config: AgentExecutionTemporalConfig,
    override: str = "",
) -> Dispatch:
    """Agent dispatch. The session's target comes with the event (no store read)."""
    if override:
        return Dispatch(override, common_pb2.LOCAL, via_override=True)
    target = resolve_execution_target(session_target, config.default_execution_target)
    if config.activity_routing == ROUTING_SESSION and session_id:
        return Dispatch(format_session_task_queue(session_id), target)
    return Dispatch(config.runner_queue, target)


def resolve_workflow_task_queue(
    execution_id: str, target: int, config: WorkflowExecutionTemporalConfig
) -> Dispatch:
    """Workflow dispatch: per-execution queue under execution routing, whatever the target."""
    resolved = resolve_execution_target(target, config.default_execution_target)
    if config.workflow_activity_routing == WORKFLOW_ROUTING_EXECUTION:
        return Dispatch(format_wfexec_task_queue(execution_id), resolved)
    return Dispatch(config.runner_queue, resolved)


__all__ = [
    "DEFAULT_EXECUTION_TARGET_CLOUD",
    "DEFAULT_EXECUTION_TARGET_LOCAL",
    "AgentExecutionTemporalConfig",
    "Dispatch",
    "WorkflowExecutionTemporalConfig",
    "format_session_task_queue",
    "format_wfexec_task_queue",
    "resolve_activity_task_queue",
    "resolve_execution_target",
    "resolve_workflow_task_queue",
]
