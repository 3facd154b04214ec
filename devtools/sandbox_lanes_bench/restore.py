"""Figure 5: state-store restore from the compacted topic (10k/100k/1M executions) in a child process;
beside the memory store, the RocksDB store: from empty, restarted with a checkpoint (issue 38)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import tempfile
import time
import uuid
from pathlib import Path
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
                    if len(pending) >= 16:  # at most 16 MiB of batches in flight (10M states: GiBs)
                        await asyncio.gather(*pending)
                        pending = []
                if i % 10_000 == 9_999:
                    bar.advance(10_000)
            for part, batch in batches.items():
                if batch.record_count():
                    batch.close()
                    pending.append(await producer.send_batch(batch, topic, partition=part))
            await asyncio.gather(*pending)
            bar.advance(n % 10_000)
    finally:
        await producer.stop()
    return time.perf_counter() - started


def _restore_child(
    bootstrap: str, topic: str, partitions: int, conn: Any, kind: str = "memory", directory: str = ""
) -> None:
    """Child process: restore every partition of ``topic`` into a ``kind`` store; report time, keys,
    peak RSS, the RSS with the states held, and (a disk store) its bytes on disk."""
    try:
        from consumers.runtime.state.store import open_store

        store = open_store("rocksdb" if kind == "rocksdb" else "memory", topic, 0.0, directory or None)
        baseline = read_status("VmRSS")
        report = asyncio.run(store.restore(bootstrap, range(partitions), isolation_level="read_uncommitted"))
        conn.send(
            {
                "seconds": report.seconds,
                "records": report.records,
                "keys": len(store),
                "from_checkpoint": report.from_checkpoint,
                "rss_baseline_bytes": baseline,
                "rss_peak_bytes": read_status("VmHWM"),
                "rss_held_bytes": read_status("VmRSS"),
                "disk_bytes": _disk_bytes(Path(directory)) if directory else 0,
            }
        )
        store.close()
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def _disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _apply_child(kind: str, directory: str, n: int, conn: Any) -> None:
    """Child process: ``n`` states applied as committed transactions of 50 writes each into one
    partition of a ``kind`` store (what the pod does after each commit); states per second."""
    try:
        from consumers.runtime.state.memory import MemoryStore
        from consumers.runtime.state.rocksdb import RocksDBStore
        from consumers.runtime.state.store import StateStore

        template = _state_template()
        store: StateStore
        if kind == "rocksdb":
            disk = RocksDBStore("bench-apply", 0.0, directory=directory)
            disk.adopt([0])
            store = disk
        else:
            store = MemoryStore("bench-apply")
        states = []
        for i in range(n):
            state = type(template)()
            state.CopyFrom(template)
            state.execution_id = f"exec-{i:08d}"
            states.append(state)
        started = time.perf_counter()
        for i in range(0, n, 50):
            store.apply(0, {s.execution_id: s for s in states[i : i + 50]})
        seconds = time.perf_counter() - started
        store.close()
        conn.send({"seconds": seconds, "states_per_s": n / seconds})
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


async def _in_child(ctx: Any, target: Any, *args: Any) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args[:-1], child, *args[-1]))
    proc.start()
    child.close()
    result: dict[str, Any] = await loop.run_in_executor(None, recv, parent, 900.0)
    await loop.run_in_executor(None, proc.join, 60)
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


async def _disk_rows(
    ctx: Any, bootstrap: str, topic: str, n: int, partitions: int, repeats: int, memory: dict[str, Any]
) -> dict[str, Any]:
    """The RocksDB store beside the memory store's runs of the same size (issue 38): a restore from
    empty, restarts with a checkpoint, the RSS with the states held, bytes on disk, apply throughput;
    each also as a ratio to the memory store in the same run."""
    mib = 1024 * 1024
    with tempfile.TemporaryDirectory(prefix="bench-state-") as tmp:
        empty = await _in_child(ctx, _restore_child, bootstrap, topic, partitions, ("rocksdb", tmp))
        restarts = [
            await _in_child(ctx, _restore_child, bootstrap, topic, partitions, ("rocksdb", tmp))
            for _ in range(repeats)
        ]
    if empty["keys"] != n or any(r["keys"] != n or r["records"] != 0 for r in restarts):
        raise RuntimeError(f"disk restore of {n}: {empty['keys']} keys, restarts {restarts}")
    applied = min(n, 100_000)
    with tempfile.TemporaryDirectory(prefix="bench-apply-") as tmp:
        apply_memory = await _in_child(ctx, _apply_child, "memory", tmp, applied, ())
        apply_disk = await _in_child(ctx, _apply_child, "rocksdb", tmp, applied, ())
    memory_s = memory["seconds"]["median"]
    memory_held = memory["rss_held_mib"]["median"]
    restart_s = summary([r["seconds"] for r in restarts])
    restart_held = summary([r["rss_held_bytes"] / mib for r in restarts])
    return {
        "restore_from_empty_seconds": empty["seconds"],
        "restore_from_empty_vs_memory": empty["seconds"] / memory_s,
        "restart_with_checkpoint_seconds": restart_s,
        "restart_with_checkpoint_vs_memory_restore": restart_s["median"] / memory_s,
        "rss_held_mib": restart_held,
        "rss_held_vs_memory": restart_held["median"] / memory_held,
        "rss_peak_from_empty_mib": empty["rss_peak_bytes"] / mib,
        "disk_bytes_per_state": empty["disk_bytes"] / n,
        "apply_states": applied,
        "apply_states_per_s": apply_disk["states_per_s"],
        "apply_states_per_s_memory": apply_memory["states_per_s"],
        "apply_vs_memory": apply_disk["states_per_s"] / apply_memory["states_per_s"],
    }


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
            disk = None
            if getattr(args, "restore_disk", True):
                memory = {
                    "seconds": summary([r["seconds"] for r in runs]),
                    "rss_held_mib": summary([r["rss_held_bytes"] / (1024 * 1024) for r in runs]),
                }
                with progress(f"restore {n:,} (rocksdb)", 1, enabled=show) as bar:
                    disk = await _disk_rows(ctx, bootstrap, topic, n, args.partitions, args.repeats, memory)
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
            "rss_held_mib": summary([r["rss_held_bytes"] / mib for r in runs]),
        }
        if disk is not None:
            out["sizes"][str(n)]["disk"] = disk
    return out
