"""Figure 5: state-store restore from the compacted topic (10k/100k/1M executions) in a child process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import time
import uuid
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.common import (
    STATE_COMPRESSION,
    created_event,
    delete_topics,
    read_status,
    recv,
    summary,
)

logger = logging.getLogger("sandbox_lanes.bench")


# --- 5. restore and growth ----------------------------------------------------------------------


def _state_template() -> Any:
    """A realistic state value: what the pod stores after a workflow's sandbox is provisioned."""
    from consumers.lanes.commands import CommandResult, LaneConfig, StateView
    from consumers.lanes.dispatch import WorkflowExecutionTemporalConfig
    from consumers.lanes.rules import complete, decide

    config = LaneConfig(
        enabled=True,
        workflow=WorkflowExecutionTemporalConfig(
            workflow_activity_routing="execution", default_execution_target="cloud"
        ),
        driver_name="memory",
        source="sandbox-lanes/bench",
    )
    decision = decide(created_event("tpl", "tpl-ev"), StateView(None), config)
    outcome = complete(decision, [CommandResult(ok=True, probe_state="running")], config)
    return outcome.state


async def _write_states(bootstrap: str, topic: str, n: int, partitions: int, show: bool) -> float:
    """n distinct executions' state records, with the pod's headers, by whole batches; seconds."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.partitioner import DefaultPartitioner

    from drivers.naming import sandbox_base_name
    from events.codec import encode
    from events.sandbox_lanes.v1 import state_pb2

    template = _state_template()
    headers = encode(template).headers
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks=1,
        linger_ms=0,
        max_batch_size=1024 * 1024,
        max_request_size=4 * 1024 * 1024,
        compression_type=None,
    )
    partitioner = DefaultPartitioner()
    all_parts = list(range(partitions))
    started = time.perf_counter()
    await producer.start()
    try:
        batches = {p: producer.create_batch() for p in all_parts}
        pending: list[asyncio.Future[Any]] = []
        with progress(f"write {n:,} states", n, enabled=show) as bar:
            state = state_pb2.ExecutionState()
            for i in range(n):
                eid = f"exec-{i:08d}"
                state.CopyFrom(template)
                state.execution_id = eid
                state.applied_event_ids[0] = f"ev-{i:08d}-created"
                box = state.sandboxes[0]
                box.sandbox.sandbox_id = eid
                box.sandbox.name = sandbox_base_name("workflow", eid)
                box.sandbox.task_queue = f"wfexec:{eid}"
                key = eid.encode()
                part = partitioner(key, all_parts, all_parts)
                value = state.SerializeToString()
                batch = batches[part]
                if batch.append(key=key, value=value, timestamp=None, headers=headers) is None:
                    batch.close()
                    pending.append(await producer.send_batch(batch, topic, partition=part))
                    batch = batches[part] = producer.create_batch()
                    batch.append(key=key, value=value, timestamp=None, headers=headers)
                if i % 10_000 == 9_999:
                    bar.advance(10_000)
                    if len(pending) > 64:
                        await asyncio.gather(*pending)
                        pending = []
            for part, batch in batches.items():
                if batch.record_count():
                    batch.close()
                    pending.append(await producer.send_batch(batch, topic, partition=part))
            await asyncio.gather(*pending)
            bar.advance(n % 10_000)
    finally:
        await producer.stop()
    return time.perf_counter() - started


def _restore_child(bootstrap: str, topic: str, partitions: int, conn: Any) -> None:
    """Child process: restore every partition of ``topic``; report time, keys and peak RSS."""
    try:
        from consumers.runtime.state.store import MemoryStore

        store = MemoryStore(topic)
        baseline = read_status("VmRSS")
        report = asyncio.run(store.restore(bootstrap, range(partitions), isolation_level="read_uncommitted"))
        conn.send(
            {
                "seconds": report.seconds,
                "records": report.records,
                "keys": len(store),
                "rss_baseline_bytes": baseline,
                "rss_peak_bytes": read_status("VmHWM"),
            }
        )
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


async def measure_restore(args: argparse.Namespace, bootstrap: str, show: bool) -> dict[str, Any]:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from consumers.runtime.kafka.topology import STATE_TOPIC_CONFIG

    tag = f"bench-{uuid.uuid4().hex[:6]}"
    ctx = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {
        "compression": STATE_COMPRESSION,
        "state_value_bytes": len(_state_template().SerializeToString()),
        "sizes": {},
    }
    loop = asyncio.get_running_loop()
    for n in args.restore_sizes:
        topic = f"{tag}.state-{n}"
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics(
                [NewTopic(topic, args.partitions, 1, topic_configs=dict(STATE_TOPIC_CONFIG))]
            )
        finally:
            await admin.close()
        try:
            write_s = await _write_states(bootstrap, topic, n, args.partitions, show)
            runs: list[dict[str, Any]] = []
            with progress(f"restore {n:,}", args.repeats, enabled=show) as bar:
                for _ in range(args.repeats):
                    parent, child = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_restore_child, args=(bootstrap, topic, args.partitions, child))
                    proc.start()
                    child.close()
                    result = await loop.run_in_executor(None, recv, parent, 600.0)
                    await loop.run_in_executor(None, proc.join, 60)
                    if "error" in result:
                        raise RuntimeError(f"restore of {n} failed: {result['error']}")
                    if result["keys"] != n:
                        raise RuntimeError(f"restore of {n} executions found {result['keys']} keys")
                    runs.append(result)
                    bar.advance()
        finally:
            await delete_topics(bootstrap, [topic])
        mib = 1024 * 1024
        out["sizes"][str(n)] = {
            "executions": n,
            "write_seconds": write_s,
            "write_records_per_s": n / write_s,
            "seconds": summary([r["seconds"] for r in runs]),
            "records_per_s": summary([n / r["seconds"] for r in runs]),
            "rss_peak_mib": summary([r["rss_peak_bytes"] / mib for r in runs]),
            "rss_baseline_mib": summary([r["rss_baseline_bytes"] / mib for r in runs]),
            "rss_per_execution_bytes": summary(
                [(r["rss_peak_bytes"] - r["rss_baseline_bytes"]) / n for r in runs]
            ),
        }
    return out
