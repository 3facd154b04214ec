"""Shared by the figures: percentiles, machine, versions, lane events and topics, an in-process pod."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import platform
import statistics
import subprocess
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

from consumers.ops.progress import progress

logger = logging.getLogger("sandbox_lanes.bench")


FIGURES = (
    "ceiling", "pod", "latency", "peers", "rules", "restore", "drivers", "burst", "retention",
    "peers_latency", "slow_driver", "scale", "soak",
)  # fmt: skip
#: Not in the default set (``--only`` them): minutes each, and measured for what they show, not per change.
OPT_IN = ("burst", "retention", "peers_latency", "slow_driver", "scale", "soak")
GOALS = {
    "pod_ratio": 0.5,
    "restore_1m_seconds": 60.0,
    "restore_1m_rss_mib": 1024.0,
    "rules_per_core": 200_000.0,
    "latency_p99_ms": 50.0,
}
STATE_COMPRESSION = "none"  # the 1M state records: no compression (lz4 is not a dependency)


# --- small helpers ------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return float(ordered[rank - 1])


def summary(values: Sequence[float]) -> dict[str, Any]:
    vals = [float(v) for v in values]
    return {
        "median": statistics.median(vals) if vals else 0.0,
        "min": min(vals) if vals else 0.0,
        "max": max(vals) if vals else 0.0,
        "runs": vals,
    }


def read_status(field: str, pid: str = "self") -> int:
    """A ``kB`` field of /proc/<pid>/status, in bytes (0 when unavailable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = _read_meminfo("MemTotal")
    java = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30, check=False)
        java = (out.stderr or out.stdout).splitlines()[0].strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 0,
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0,
        "memory_gib": round(mem / 1024**3, 1),
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "java": java,
    }


def _read_meminfo(field: str) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def versions() -> dict[str, str]:
    return {
        name: _version(name)
        for name in (
            "sandbox-lanes",
            "aiokafka",
            "protobuf",
            "prometheus-client",
            "docker",
            "rich",
            "quixstreams",
            "faust-streaming",
            "confluent-kafka",
        )
    }


# --- events -------------------------------------------------------------------------------------


def lane_env(bootstrap: str, tag: str, partitions: int, guarantee: str) -> dict[str, str]:
    key = base64.b64encode(b"bench-signing-key-0123456789abcd").decode()  # 32 bytes: tokens are minted
    return {
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "SANDBOX_LANES_GROUP_ID": f"{tag}-pod",
        "SANDBOX_LANES_POD_ID": "bench",
        "SANDBOX_LANES_PROCESSING_GUARANTEE": guarantee,
        "SANDBOX_LANES_PARTITIONS": str(partitions),
        "SANDBOX_LANES_TOPIC_EXECUTION_CREATED": f"{tag}.execution-created",
        "SANDBOX_LANES_TOPIC_PHASE_CHANGED": f"{tag}.phase-changed",
        "SANDBOX_LANES_TOPIC_SESSION_DELETED": f"{tag}.session-deleted",
        "SANDBOX_LANES_TOPIC_OUTCOMES": f"{tag}.sandbox-outcomes",
        "SANDBOX_LANES_TOPIC_STATE": f"{tag}.sandbox-lanes-state",
        "SANDBOX_LANES_TOPIC_DLQ": f"{tag}.sandbox-lanes-dlq",
        "STIGMER_ACTIVITY_ROUTING": "session",
        "STIGMER_WORKFLOW_ACTIVITY_ROUTING": "execution",
        "STIGMER_DEFAULT_EXECUTION_TARGET": "cloud",
        "STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET": "cloud",
        "STIGMER_RUNNER_TOKEN_KEY": key,
    }


def created_event(execution_id: str, event_id: str | None = None, *, agent: bool = False) -> Any:
    from events.codec import new_meta
    from events.sandbox_lanes.v1 import common_pb2, inputs_pb2

    if agent:
        return inputs_pb2.ExecutionCreated(
            meta=new_meta(event_id=event_id, source="bench"),
            kind=common_pb2.AGENT_EXECUTION,
            execution_id=execution_id,
            name=f"agent {execution_id}",
            org="bench-org",
            session_id=f"ses-{execution_id}",
            session_execution_target=common_pb2.CLOUD,
            caller_identity_id="usr-bench",
            caller_class="user",
        )
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(event_id=event_id, source="bench"),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        name=f"workflow {execution_id}",
        org="bench-org",
        workflow_execution_target=common_pb2.CLOUD,
        caller_identity_id="usr-bench",
        caller_class="user",
    )


async def create_topics(bootstrap: str, topics: Any, partitions: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    from consumers.runtime.kafka.topology import TopologyError, ensure_topics

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for attempt in range(40):  # just-created topics take a moment to show in the metadata
            try:
                await ensure_topics(admin, topics, partitions, 1)
                return
            except TopologyError:
                if attempt == 39:
                    raise
                await asyncio.sleep(0.25)
    finally:
        await admin.close()


@contextlib.asynccontextmanager
async def kafka_admin(bootstrap: str) -> AsyncIterator[Any]:
    """An admin client for the block (a failing close is not the figure's business)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        yield admin
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


async def create_topic(
    bootstrap: str, name: str, partitions: int, config: Mapping[str, str] | None = None
) -> None:
    """One bench topic (replication 1), with topic ``config`` if given."""
    from aiokafka.admin import NewTopic

    async with kafka_admin(bootstrap) as admin:
        await admin.create_topics(
            [
                NewTopic(
                    name, num_partitions=partitions, replication_factor=1, topic_configs=dict(config or {})
                )
            ]
        )


async def delete_topics(bootstrap: str, names: list[str]) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    if not names:
        return
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        await admin.delete_topics(names)
    except Exception as exc:  # best effort: a leftover topic only costs disk
        logger.warning("bench topics not deleted", extra={"error": str(exc)})
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


async def produce_creates(
    bootstrap: str, topic: str, ids: Sequence[tuple[str, str]], label: str, show: bool
) -> None:
    """One workflow ``ExecutionCreated`` (CLOUD) per ``(execution id, event id)``, acknowledged by all
    replicas, 5,000 in flight at most, progress shown as ``label``."""
    from aiokafka import AIOKafkaProducer

    from events.codec import encode

    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=20, max_batch_size=512 * 1024
    )
    await producer.start()
    try:
        futures: list[asyncio.Future[Any]] = []
        with progress(label, len(ids), enabled=show) as bar:
            for execution_id, event_id in ids:
                rec = encode(created_event(execution_id, event_id), source="bench")
                futures.append(await producer.send(topic, rec.value, key=rec.key, headers=rec.headers))
                if len(futures) >= 5_000:
                    await asyncio.gather(*futures)
                    bar.advance(len(futures))
                    futures = []
            await asyncio.gather(*futures)
            bar.advance(len(futures))
    finally:
        await producer.stop()


async def produce_inputs(bootstrap: str, topic: str, n: int, tag: str, show: bool) -> None:
    ids = [(f"{tag}-wf-{i}", f"{tag}-ev-{i}") for i in range(n)]
    await produce_creates(bootstrap, topic, ids, f"produce {n:,} inputs", show)


async def prepared_inputs(
    bootstrap: str, prefix: str, partitions: int, n: int, show: bool
) -> tuple[str, dict[str, str], Any, list[str]]:
    """A fresh tag, its lane env, its topics (created) holding ``n`` ExecutionCreated, and the topic
    names to delete afterwards."""
    import uuid

    from consumers.ops.settings import load_settings

    tag = f"{prefix}-{uuid.uuid4().hex[:6]}"
    base = lane_env(bootstrap, tag, partitions, "exactly_once")
    topics = load_settings(base).topics
    await create_topics(bootstrap, topics, partitions)
    await produce_inputs(bootstrap, topics.execution_created, n, tag, show)
    return tag, base, topics, list(topics.all())


def bench_lane_config() -> Any:
    """The lane config of the rules figures: both lanes on CLOUD with per-queue routing, memory driver."""
    from consumers.lanes.commands import LaneConfig
    from consumers.lanes.dispatch import AgentExecutionTemporalConfig, WorkflowExecutionTemporalConfig

    return LaneConfig(
        enabled=True,
        agent=AgentExecutionTemporalConfig(activity_routing="session", default_execution_target="cloud"),
        workflow=WorkflowExecutionTemporalConfig(
            workflow_activity_routing="execution", default_execution_target="cloud"
        ),
        driver_name="memory",
        source="sandbox-lanes/bench",
    )


def memory_provisioner(**options: float) -> Any:
    """The dev harness's counting in-memory driver (``harness.memory_driver``), selected by name as the
    pod selects a driver: the harness registers it (entry point), so the bench never imports it."""
    from drivers.contract import DriverConfig
    from drivers.registry import UnknownProvisionerError, new_sandbox_provisioner

    config = DriverConfig(options={name: str(value) for name, value in options.items()})
    try:
        return new_sandbox_provisioner("memory", config, logger)
    except UnknownProvisionerError as exc:
        raise RuntimeError(
            "the in-memory driver needs the dev harness (a checkout set up by scripts/bootstrap.sh)"
        ) from exc


# --- 2. the pod ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_pod(
    env: dict[str, str], max_batch: int | None = None, provisioner: Any = None
) -> AsyncIterator[Any]:
    """A pod in this process (the counting memory driver unless given one), ready, stopped on exit."""
    from consumers.ops.compose import compose
    from consumers.ops.settings import load_settings

    settings = load_settings(env)
    # The pod never creates its inputs: the bench owns them here, as a producer would.
    await create_topics(settings.bootstrap, settings.topics, settings.partitions)
    composed = compose(
        settings, logging.getLogger("sandbox_lanes"), provisioner=provisioner or memory_provisioner()
    )
    pod = composed.pod
    if max_batch is not None:
        pod.config = replace(pod.config, max_batch=max_batch)
    task = asyncio.create_task(pod.run())
    try:
        ready = asyncio.ensure_future(pod.ready.wait())
        done, _ = await asyncio.wait({ready, task}, timeout=90, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
        if ready not in done:
            raise TimeoutError("bench pod did not become ready in 90s")
        yield pod
    finally:
        pod.request_stop()
        await asyncio.wait_for(task, 60)


def child_process(
    run: Callable[[dict[str, Any], Any], Coroutine[Any, Any, None]], spec: dict[str, Any], conn: Any
) -> None:
    """A figure's child process (the ``target`` of a spawned ``Process``): warning-level logs, ``run(spec,
    conn)`` on a loop of its own, any failure sent back on the pipe as ``{"error": ...}``, the pipe closed."""
    try:
        from consumers.ops.logs import setup_logging

        setup_logging("warning")
        asyncio.run(run(spec, conn))
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def recv(conn: Any, timeout: float) -> dict[str, Any]:
    if not conn.poll(timeout):
        return {"error": f"no answer from the child in {timeout:.0f}s"}
    result: dict[str, Any] = conn.recv()
    return result
