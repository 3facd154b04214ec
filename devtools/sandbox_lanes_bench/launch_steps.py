"""Where a launch's time goes: event in -> a runner that holds its secrets and runs, step by step.

Every mark is on one clock (``time.monotonic``; wall-clock stamps are moved onto it by the offset
read once at the start, both clocks being the host's). The sources:

* the bench: when each ``ExecutionCreated`` was sent;
* the pod's own spans (``consumers.runtime.tracing``, switched on for the run with an in-memory
  exporter): ``process`` (the record read), ``decide``, the decision's ``commit``, and the
  ``driver ensure`` call (its start and its end);
* warm: the warm pool's timeline of each claim (``WarmPool.on_timeline``);
* cold: a watch on the sandbox namespace's pods (``kube_burst.running_pods``: created, scheduled)
  and, on the private node, containerd's events (``containerd_events``: the pod sandbox started,
  the runner's container created and started);
* the runner's first log line (the kubelet's timestamp of ``runner stand-in up``): runner started.

Each step is the time from the step before it, so the steps of one create add up to its total.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Iterator, Mapping
from typing import Any

from sandbox_lanes_bench.common import pct

#: The pod's part of every launch: event sent -> the driver called.
POD_STEPS: tuple[tuple[str, str], ...] = (
    ("event_read", "event sent -> the pod's consumer span starts (fetch)"),
    ("decided", "-> the decision made"),
    ("decision_committed", "-> the decision's transaction committed"),
    ("driver_called", "-> the driver's ensure starts (the effect runner)"),
)
#: A warm claim (agent-sandbox, warm_assignment=async): the pod's steps, the pool's, the runner's.
WARM_STEPS: tuple[tuple[str, str], ...] = (
    *POD_STEPS,
    ("claim_created", "-> the SandboxClaim's create answered"),
    ("secret_kept", "-> the assignment Secret written (the ensure returns)"),
    ("named", "-> the claim names its Sandbox (controller adoption)"),
    ("ready", "-> that Sandbox seen Ready"),
    ("secrets_held", "-> the exec wrote the secrets into the pod"),
    ("runner_started", "-> the runner's first log line"),
)
#: A cold launch (the kubernetes driver, agent-sandbox without a pool) on the bench's private node:
#: what the node does after the driver's writes, containerd's steps from its own events.
COLD_STEPS: tuple[tuple[str, str], ...] = (
    *POD_STEPS,
    ("objects_written", "-> the driver's API writes answered (the ensure returns)"),
    ("pod_created", "-> the runner's Pod exists (a controller made it)"),
    ("scheduled", "-> the Pod bound to the node (the scheduler)"),
    ("sandbox_started", "-> volumes mounted, the pod sandbox started (containerd: pause, network namespace)"),
    ("container_created", "-> the runner's container created (containerd: its snapshot)"),
    ("container_started", "-> the runner's process started (containerd: its task)"),
    ("runner_started", "-> the runner's first log line"),
)
#: The same on a given cluster, where the bench cannot see containerd: what the API shows.
COLD_STEPS_API: tuple[tuple[str, str], ...] = (
    *POD_STEPS,
    ("objects_written", "-> the driver's API writes answered (the ensure returns)"),
    ("pod_created", "-> the runner's Pod exists (a controller made it)"),
    ("scheduled", "-> the Pod bound to the node (the scheduler)"),
    ("runner_started", "-> the pod sandbox and the runner started: its first log line"),
)


class SpanRecorder:
    """The pod's tracing on, into memory, for the length of a ``with``."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[SpanRecorder]:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from consumers.runtime import tracing

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        before = tracing.ACTIVE
        tracing.ACTIVE = tracing.Tracing(provider, "bench")
        try:
            yield self
        finally:
            tracing.ACTIVE = before
            self.spans = list(exporter.get_finished_spans())
            provider.shutdown()


def wall_offset() -> float:
    """``time.time() - time.monotonic()`` now: a wall stamp minus this is on the monotonic clock."""
    return time.time() - time.monotonic()


def pod_marks(spans: list[Any], offset: float) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """By execution id: when its create's record was read, decided, committed, its ensure began and
    ended; and each execution id by the name of the sandbox its ensure made (the driver span's)."""
    by_trace: dict[int, list[Any]] = {}
    for span in spans:
        by_trace.setdefault(span.context.trace_id, []).append(span)
    marks: dict[str, dict[str, float]] = {}
    names: dict[str, str] = {}
    for trace in by_trace.values():
        decide = next((s for s in trace if s.name == "decide"), None)
        if decide is None or decide.attributes.get("sandbox_lanes.event.type") != "ExecutionCreated":
            continue
        execution_id = str(decide.attributes.get("sandbox_lanes.execution.id", ""))
        process = next((s for s in trace if s.name.startswith("process ")), None)
        if process is None:
            continue
        commit = min(
            (
                s
                for s in trace
                if s.name == "commit" and s.parent is not None and s.parent.span_id == process.context.span_id
            ),
            key=lambda s: s.end_time,
            default=None,
        )
        driver = next(
            (
                s
                for s in trace
                if s.name.startswith("driver ") and s.attributes.get("sandbox_lanes.operation") == "ensure"
            ),
            None,
        )
        if commit is None or driver is None:
            continue
        names[str(driver.attributes.get("sandbox_lanes.sandbox.name", ""))] = execution_id
        marks[execution_id] = {
            "event_read": process.start_time / 1e9 - offset,
            "decided": decide.end_time / 1e9 - offset,
            "decision_committed": commit.end_time / 1e9 - offset,
            "driver_called": driver.start_time / 1e9 - offset,
            "objects_written": driver.end_time / 1e9 - offset,
        }
    return marks, names


def runner_started(log_text: str, offset: float) -> float | None:
    """The monotonic time of the runner's first line in a pod log read with ``timestamps=True``."""
    for line in log_text.splitlines():
        stamp, _, text = line.partition(" ")
        if text.startswith("runner stand-in up"):
            return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - offset
    return None


def breakdown(
    steps: tuple[tuple[str, str], ...],
    sent: Mapping[str, float],
    marks: Mapping[str, Mapping[str, float]],
    *,
    held: str = "secrets_held",
) -> dict[str, Any]:
    """Per step p50/p99 (ms since the step before) over the creates whose every step was seen, and
    the totals from the event to ``held`` and to ``runner_started``. ``sent`` and ``marks`` are keyed
    by execution id; a step seen before the step before it counts 0 ms (two marks of one instant,
    seen by two watchers)."""
    per_step: dict[str, list[float]] = {name: [] for name, _ in steps}
    to_held: list[float] = []
    to_runner: list[float] = []
    whole = 0
    missing: dict[str, int] = {}
    for execution_id, t0 in sent.items():
        mine = marks.get(execution_id, {})
        unseen = [name for name, _ in steps if name not in mine]
        for name in unseen:
            missing[name] = missing.get(name, 0) + 1
        if unseen:
            continue
        whole += 1
        before = t0
        for name, _ in steps:
            at = max(mine[name], before)
            per_step[name].append((at - before) * 1000)
            before = at
        if held in mine:
            to_held.append((mine[held] - t0) * 1000)
        to_runner.append((mine["runner_started"] - t0) * 1000)
    return {
        "creates": len(sent),
        "whole": whole,
        "missing": missing,  # creates without a mark of the step (not timed whole)
        "steps": [name for name, _ in steps],
        "steps_p50_ms": {name: pct(per_step[name], 50) for name, _ in steps},
        "steps_p99_ms": {name: pct(per_step[name], 99) for name, _ in steps},
        "secrets_held_p50_ms": pct(to_held, 50),
        "secrets_held_p99_ms": pct(to_held, 99),
        "runner_started_p50_ms": pct(to_runner, 50),
        "runner_started_p99_ms": pct(to_runner, 99),
        "samples_ms": {held: to_held, "runner_ready": to_runner},
    }


def merge_marks(*sources: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """One mark table by execution id from several (a later source's mark of a step wins)."""
    merged: dict[str, dict[str, float]] = {}
    for source in sources:
        for execution_id, marks in source.items():
            merged.setdefault(execution_id, {}).update(marks)
    return merged
