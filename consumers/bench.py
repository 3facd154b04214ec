"""``sandbox-lanes bench``: the pod measured against the plain aiokafka pipe on the same broker.

Figures (every one bounded, repeated ``--repeats`` times, reported as median and min-max):

1. ``ceiling``  — a plain aiokafka consume→produce pipe (no decode, no rules, no transaction) over the
   same pre-produced ``ExecutionCreated`` records and the same topic settings: the most this stack
   does on this machine. Also ``ceiling_eos_x2``: the same pipe with the pod's write shape (one
   Kafka transaction per batch, two records written per input, offsets in the transaction).
2. ``pod``      — the pod (in this process) with the counting in-memory driver, ``exactly_once`` and
   ``at_least_once``: input events/s and the ratio pod / ceiling.
3. ``latency``  — produce ``ExecutionCreated`` → consume ``SandboxProvisioned`` (read_committed),
   p50/p95/p99 at a fixed offered load (``--latency-load`` x the measured pod throughput); the load
   generator and the collector run in a child process so they do not share the pod's event loop.
4. ``rules``    — pure ``decide`` + ``complete`` per input event, no I/O, one core.
5. ``restore``  — state-store restore from the compacted topic for 10k/100k/1M executions, in a child
   process (its peak RSS is the restore's own, from ``VmHWM``).
6. ``drivers``  — ensure (absent → running) and re-ensure (running → fast path) latency of the
   local-process driver (``drivers/stub_runner.py``) and the docker driver (a private dockerd from
   ``scripts/dockerd.py`` with the imported busybox image). A driver that cannot start is reported as
   an error in its row; the other figures still run.
7. ``burst``    — time to sandbox: N workflow creates at once through the pod with the memory driver
   at an injected latency, and with the docker driver next to the raw engine's own time for the
   same containers (``consumers/bench_burst.py``). Not in the default set (``--only burst``).

Without ``--bootstrap`` a fresh Apache Kafka broker (``scripts/kafka_broker.py``) is started and
stopped. The table is printed as markdown; ``--out`` gets the JSON (figures + machine + versions).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import functools
import json
import logging
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

from consumers.progress import progress

logger = logging.getLogger("sandbox_lanes.bench")

FIGURES = ("ceiling", "pod", "latency", "rules", "restore", "drivers", "burst")
GOALS = {
    "pod_ratio": 0.5,
    "restore_1m_seconds": 60.0,
    "restore_1m_rss_mib": 1024.0,
    "rules_per_core": 200_000.0,
    "latency_p99_ms": 50.0,
}
STATE_COMPRESSION = "none"  # the 1M state records: no compression (lz4 is not a dependency)


# --- arguments ----------------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            mult, part = 1_000, part[:-1]
        elif part.endswith("m"):
            mult, part = 1_000_000, part[:-1]
        out.append(int(float(part) * mult))
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive: {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", help="use this Kafka instead of starting a fresh Apache Kafka broker")
    parser.add_argument("--out", default="bench-results.json", help="JSON results file")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median and min-max)")
    parser.add_argument("--events", type=int, default=20_000, help="input events per ceiling/pod run")
    parser.add_argument("--partitions", type=int, default=3, help="partitions of every bench topic")
    parser.add_argument("--max-batch", type=int, default=500, help="records per getmany (pod and pipe)")
    parser.add_argument("--latency-load", type=float, default=0.5, help="offered load x pod throughput")
    parser.add_argument("--latency-rate", type=float, default=0.0, help="offered events/s (overrides load)")
    parser.add_argument(
        "--latency-guarantees",
        default="exactly_once,at_least_once",
        help="processing guarantees to measure latency under (comma-separated)",
    )
    parser.add_argument("--latency-seconds", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--latency-warmup", type=float, default=1.0, help="seconds discarded per run")
    parser.add_argument("--rules-events", type=int, default=200_000, help="events per pure-rules run")
    parser.add_argument(
        "--restore-sizes", type=_sizes, default=[10_000, 100_000, 1_000_000], help="e.g. 10k,100k,1m"
    )
    parser.add_argument("--driver-samples", type=int, default=20, help="sandboxes per local-process run")
    parser.add_argument("--docker-samples", type=int, default=5, help="containers per docker run")
    parser.add_argument("--burst-n", type=int, default=2000, help="creates per memory-driver burst")
    parser.add_argument("--burst-docker-n", type=int, default=200, help="creates per docker burst")
    parser.add_argument("--burst-latency-ms", type=float, default=200.0, help="memory driver ms per call")
    parser.add_argument("--burst-concurrency", type=int, default=32, help="driver concurrency in a burst")
    parser.add_argument("--docker-host", help="use this engine (unix://...) instead of a private dockerd")
    parser.add_argument("--docker-image", default="", help="image on --docker-host (default: busybox tag)")
    parser.add_argument(
        "--only",
        default=",".join(f for f in FIGURES if f != "burst"),
        help=f"comma-separated subset of {','.join(FIGURES)} (default: all but burst)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


# --- small helpers ------------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return float(ordered[rank - 1])


def _summary(values: Sequence[float]) -> dict[str, Any]:
    vals = [float(v) for v in values]
    return {
        "median": statistics.median(vals) if vals else 0.0,
        "min": min(vals) if vals else 0.0,
        "max": max(vals) if vals else 0.0,
        "runs": vals,
    }


def _read_status(field: str, pid: str = "self") -> int:
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


def _machine() -> dict[str, Any]:
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


def _versions() -> dict[str, str]:
    return {
        name: _version(name)
        for name in ("sandbox-lanes", "aiokafka", "protobuf", "prometheus-client", "docker", "rich")
    }


# --- events -------------------------------------------------------------------------------------


def _lane_env(bootstrap: str, tag: str, partitions: int, guarantee: str) -> dict[str, str]:
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


def _created(execution_id: str, event_id: str, *, agent: bool = False) -> Any:
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


async def _create_topics(bootstrap: str, topics: Any, partitions: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    from consumers.topology import TopologyError, ensure_topics

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


async def _delete_topics(bootstrap: str, names: list[str]) -> None:
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


async def _produce_inputs(bootstrap: str, topic: str, n: int, tag: str, show: bool) -> None:
    from aiokafka import AIOKafkaProducer

    from events.codec import encode

    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=20, max_batch_size=512 * 1024
    )
    await producer.start()
    try:
        futures: list[asyncio.Future[Any]] = []
        with progress(f"produce {n:,} inputs", n, enabled=show) as bar:
            for i in range(n):
                rec = encode(_created(f"{tag}-wf-{i}", f"{tag}-ev-{i}"), source="bench")
                futures.append(await producer.send(topic, rec.value, key=rec.key, headers=rec.headers))
                if len(futures) >= 5_000:
                    await asyncio.gather(*futures)
                    bar.advance(len(futures))
                    futures = []
            await asyncio.gather(*futures)
            bar.advance(len(futures))
    finally:
        await producer.stop()


# --- 1. ceiling: the plain pipe -----------------------------------------------------------------


async def _pipe(
    bootstrap: str,
    source: str,
    sink: str,
    n: int,
    *,
    group: str,
    max_batch: int,
    transactional: bool = False,
    fanout: int = 1,
) -> float:
    """Consume ``n`` records from ``source`` and write each ``fanout`` times to ``sink``; events/s."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.abc import ConsumerRebalanceListener
    from aiokafka.structs import OffsetAndMetadata

    assigned_at: list[float] = []

    class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
        async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
            return None

        async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
            if assigned and not assigned_at:
                assigned_at.append(time.perf_counter())

    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=5,
        enable_idempotence=transactional,
        transactional_id=f"{group}-tx" if transactional else None,
    )
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    await producer.start()
    await consumer.start()
    try:
        consumer.subscribe([source], listener=Listener())
        done = 0
        while done < n:
            batch = await consumer.getmany(timeout_ms=200, max_records=max_batch)
            if not batch:
                continue
            offsets = {tp: OffsetAndMetadata(recs[-1].offset + 1, "") for tp, recs in batch.items() if recs}
            if transactional:
                await producer.begin_transaction()
            futures = []
            for recs in batch.values():
                for rec in recs:
                    for _ in range(fanout):
                        futures.append(
                            await producer.send(sink, rec.value, key=rec.key, headers=list(rec.headers))
                        )
                    done += 1
            await asyncio.gather(*futures)
            if transactional:
                await producer.send_offsets_to_transaction(offsets, group)
                await producer.commit_transaction()
            else:
                await consumer.commit(offsets)
        ended = time.perf_counter()
    finally:
        await consumer.stop()
        await producer.stop()
    return n / (ended - assigned_at[0])


# --- 2. the pod ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _running_pod(env: dict[str, str], max_batch: int) -> AsyncIterator[Any]:
    from consumers.compose import compose
    from consumers.settings import load_settings
    from drivers.memory import MemoryProvisioner

    settings = load_settings(env)
    composed = compose(settings, logging.getLogger("sandbox_lanes"), provisioner=MemoryProvisioner())
    pod = composed.pod
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


async def _pod_throughput(env: dict[str, str], n: int, max_batch: int, timeout_s: float) -> float:
    async with _running_pod(env, max_batch) as pod:
        started = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while sum(pod.stats.outputs.values()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod wrote {sum(pod.stats.outputs.values())}/{n} outcomes in time")
            await asyncio.sleep(0.002)
        ended = time.perf_counter()
        if pod.stats.dead_lettered:
            raise RuntimeError(f"{pod.stats.dead_lettered} bench records dead-lettered")
    return n / (ended - started)


async def _throughput(args: argparse.Namespace, bootstrap: str, show: bool) -> dict[str, Any]:
    from consumers.settings import load_settings

    tag = f"bench-{uuid.uuid4().hex[:6]}"
    base = _lane_env(bootstrap, tag, args.partitions, "exactly_once")
    topics = load_settings(base).topics
    await _create_topics(bootstrap, topics, args.partitions)
    created: list[str] = list(topics.all())
    n = args.events
    await _produce_inputs(bootstrap, topics.execution_created, n, tag, show)
    plain: list[float] = []
    eos_x2: list[float] = []
    pod_eos: list[float] = []
    pod_alo: list[float] = []
    timeout = max(120.0, n / 200)
    try:
        with progress("ceiling + pod runs", args.repeats * 4, enabled=show) as bar:
            for r in range(args.repeats):
                # Interleaved, so drift in the machine's load hits every variant alike.
                sink = f"{tag}.pipe-{r}"
                created.append(sink)
                await _create_sink(bootstrap, sink, args.partitions)
                plain.append(
                    await _pipe(
                        bootstrap, topics.execution_created, sink, n, group=f"{tag}-pipe-{r}",
                        max_batch=args.max_batch,
                    )
                )  # fmt: skip
                bar.advance()
                sink2 = f"{tag}.pipe-eos-{r}"
                created.append(sink2)
                await _create_sink(bootstrap, sink2, args.partitions)
                eos_x2.append(
                    await _pipe(
                        bootstrap, topics.execution_created, sink2, n, group=f"{tag}-pipe-eos-{r}",
                        max_batch=args.max_batch, transactional=True, fanout=2,
                    )
                )  # fmt: skip
                bar.advance()
                for guarantee, out in (("exactly_once", pod_eos), ("at_least_once", pod_alo)):
                    env = {
                        **base,
                        "SANDBOX_LANES_PROCESSING_GUARANTEE": guarantee,
                        "SANDBOX_LANES_GROUP_ID": f"{tag}-pod-{guarantee}-{r}",
                        "SANDBOX_LANES_TOPIC_OUTCOMES": f"{tag}.outcomes-{guarantee}-{r}",
                        "SANDBOX_LANES_TOPIC_STATE": f"{tag}.state-{guarantee}-{r}",
                        "SANDBOX_LANES_TOPIC_DLQ": f"{tag}.dlq-{guarantee}-{r}",
                    }
                    created.extend(
                        env[k]
                        for k in (
                            "SANDBOX_LANES_TOPIC_OUTCOMES",
                            "SANDBOX_LANES_TOPIC_STATE",
                            "SANDBOX_LANES_TOPIC_DLQ",
                        )
                    )
                    out.append(await _pod_throughput(env, n, args.max_batch, timeout))
                    bar.advance()
    finally:
        await _delete_topics(bootstrap, created)
    ratios = [p / c for p, c in zip(pod_eos, plain, strict=True)]
    ratios_alo = [p / c for p, c in zip(pod_alo, plain, strict=True)]
    return {
        "events": n,
        "partitions": args.partitions,
        "max_batch": args.max_batch,
        "ceiling": {
            "plain_pipe_events_per_s": _summary(plain),
            "eos_pipe_2_writes_events_per_s": _summary(eos_x2),
        },
        "pod": {
            "exactly_once_events_per_s": _summary(pod_eos),
            "at_least_once_events_per_s": _summary(pod_alo),
            "ratio_exactly_once": _summary(ratios),
            "ratio_at_least_once": _summary(ratios_alo),
            "ratio_exactly_once_vs_eos_pipe": _summary([p / c for p, c in zip(pod_eos, eos_x2, strict=True)]),
        },
    }


async def _create_sink(bootstrap: str, name: str, partitions: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()


# --- 3. end-to-end latency ----------------------------------------------------------------------


def _latency_child(
    bootstrap: str, source: str, outcomes: str, rate: float, seconds: float, warmup: float, conn: Any
) -> None:
    """Child process: offer ``rate`` events/s for warmup+seconds, collect produce→outcome latencies."""
    try:
        conn.send(asyncio.run(_latency_load(bootstrap, source, outcomes, rate, seconds, warmup)))
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


async def _latency_load(
    bootstrap: str, source: str, outcomes: str, rate: float, seconds: float, warmup: float
) -> dict[str, Any]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from events.codec import OUTCOME_TYPES, decode, encode

    tag = uuid.uuid4().hex[:8]
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        fetch_max_wait_ms=100,
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    await consumer.start()
    await producer.start()
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    received = 0
    try:
        parts = consumer.partitions_for_topic(outcomes) or set()
        if not parts:
            await consumer._client.force_metadata_update()
            parts = consumer.partitions_for_topic(outcomes) or set()
        tps = [TopicPartition(outcomes, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)
        total = int(rate * (seconds + warmup))
        measure_from = int(rate * warmup)
        # Pre-encode so the generator's own cost does not shape the offered load.
        records = [
            (f"{tag}-ev-{i}", encode(_created(f"{tag}-wf-{i}", f"{tag}-ev-{i}"), source="bench"))
            for i in range(total)
        ]

        async def collect() -> None:
            nonlocal received
            while True:
                batch = await consumer.getmany(timeout_ms=50)
                now = time.perf_counter()
                for recs in batch.values():
                    for rec in recs:
                        message = decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
                        at = sent_at.get(message.meta.causation_id)  # type: ignore[attr-defined]
                        if at is not None:
                            received += 1
                            if at >= 0:
                                latencies.append((now - at) * 1000.0)

        collector = asyncio.create_task(collect())
        started = time.perf_counter()
        futures = []
        for i, (event_id, rec) in enumerate(records):
            due = started + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            sent_at[event_id] = now if i >= measure_from else -1.0
            futures.append(await producer.send(source, rec.value, key=rec.key, headers=rec.headers))
        await asyncio.gather(*futures)
        offered_s = time.perf_counter() - started
        deadline = time.monotonic() + 30
        while received < total and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        collector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await collector
    finally:
        await producer.stop()
        await consumer.stop()
    return {
        "sent": total,
        "received": received,
        "offered_rate": total / offered_s if offered_s > 0 else 0.0,
        "latencies_ms": latencies,
    }


async def _latency(
    args: argparse.Namespace, bootstrap: str, pod_rate: float, show: bool, guarantee: str
) -> dict[str, Any]:
    from consumers.settings import load_settings

    rate = args.latency_rate or max(1.0, args.latency_load * pod_rate)
    tag = f"bench-{uuid.uuid4().hex[:6]}"
    env = _lane_env(bootstrap, tag, args.partitions, guarantee)
    topics = load_settings(env).topics
    await _create_topics(bootstrap, topics, args.partitions)
    ctx = multiprocessing.get_context("spawn")
    runs: list[dict[str, Any]] = []
    try:
        async with _running_pod(env, args.max_batch):
            with progress(f"latency {guarantee} at {rate:,.0f}/s", args.repeats, enabled=show) as bar:
                for _ in range(args.repeats):
                    parent, child = ctx.Pipe(duplex=False)
                    proc = ctx.Process(
                        target=_latency_child,
                        args=(
                            bootstrap, topics.execution_created, topics.outcomes, rate,
                            args.latency_seconds, args.latency_warmup, child,
                        ),
                    )  # fmt: skip
                    proc.start()
                    child.close()
                    budget = args.latency_seconds + args.latency_warmup + 120
                    result = await asyncio.get_running_loop().run_in_executor(None, _recv, parent, budget)
                    await asyncio.get_running_loop().run_in_executor(None, proc.join, 30)
                    if "error" in result:
                        raise RuntimeError(f"latency load generator failed: {result['error']}")
                    runs.append(result)
                    bar.advance()
    finally:
        await _delete_topics(bootstrap, list(topics.all()))
    p = {q: [_pct(r["latencies_ms"], q) for r in runs] for q in (50, 95, 99)}
    return {
        "guarantee": guarantee,
        "offered_rate": rate,
        "offered_rate_measured": _summary([r["offered_rate"] for r in runs]),
        "load_fraction_of_pod": rate / pod_rate if pod_rate else 0.0,
        "seconds_per_run": args.latency_seconds,
        "samples": sum(len(r["latencies_ms"]) for r in runs),
        "lost": sum(r["sent"] - r["received"] for r in runs),
        "p50_ms": _summary(p[50]),
        "p95_ms": _summary(p[95]),
        "p99_ms": _summary(p[99]),
        "max_ms": _summary([max(r["latencies_ms"], default=0.0) for r in runs]),
    }


def _recv(conn: Any, timeout: float) -> dict[str, Any]:
    if not conn.poll(timeout):
        return {"error": f"no answer from the child in {timeout:.0f}s"}
    result: dict[str, Any] = conn.recv()
    return result


# --- 4. pure rules ------------------------------------------------------------------------------


def _rules(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    from consumers.dispatch import AgentExecutionTemporalConfig, WorkflowExecutionTemporalConfig
    from consumers.rules import CommandResult, LaneConfig, StateView, complete, decide
    from events.codec import new_meta
    from events.sandbox_lanes.v1 import common_pb2, inputs_pb2

    config = LaneConfig(
        enabled=True,
        agent=AgentExecutionTemporalConfig(activity_routing="session", default_execution_target="cloud"),
        workflow=WorkflowExecutionTemporalConfig(
            workflow_activity_routing="execution", default_execution_target="cloud"
        ),
        driver_name="memory",
        source="sandbox-lanes/bench",
    )
    # Per execution: ExecutionCreated (→ ensure) then PhaseChanged RUNNING→COMPLETED (→ deprovision
    # for a workflow; nothing for an agent). Half agent (session lane), half workflow.
    executions = max(1, args.rules_events // 2)
    pairs = []
    for i in range(executions):
        agent = i % 2 == 0
        eid = f"rx-{i}"
        pairs.append(
            (
                _created(eid, f"rx-ev-{i}", agent=agent),
                inputs_pb2.PhaseChanged(
                    meta=new_meta(event_id=f"rx-ph-{i}", source="bench"),
                    kind=common_pb2.AGENT_EXECUTION if agent else common_pb2.WORKFLOW_EXECUTION,
                    execution_id=eid,
                    previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
                    new_phase=common_pb2.EXECUTION_COMPLETED,
                ),
            )
        )
    ok = CommandResult(ok=True, probe_state="running", token_minted=True)
    empty = StateView(None)
    rates: list[float] = []
    decide_rates: list[float] = []
    with progress("pure rules", args.repeats, enabled=show) as bar:
        for _ in range(args.repeats):
            started = time.perf_counter()
            decisions = 0
            for created, phase in pairs:
                d = decide(created, empty, config)
                o = complete(d, [ok] * len(d.commands), config)
                d2 = decide(phase, StateView(o.state), config)
                complete(d2, [ok] * len(d2.commands), config)
                decisions += 2
            rates.append(decisions / (time.perf_counter() - started))
            # decide() alone: the decision without folding in the commands' results.
            states = [StateView(complete(decide(c, empty, config), [ok], config).state) for c, _ in pairs[:1]]
            started = time.perf_counter()
            for created, phase in pairs:
                decide(created, empty, config)
                decide(phase, states[0], config)
            decide_rates.append(decisions / (time.perf_counter() - started))
            bar.advance()
    return {
        "events_per_run": executions * 2,
        "decisions_per_s_per_core": _summary(rates),
        "decide_only_per_s_per_core": _summary(decide_rates),
    }


# --- 5. restore and growth ----------------------------------------------------------------------


def _state_template() -> Any:
    """A realistic state value: what the pod stores after a workflow's sandbox is provisioned."""
    from consumers.dispatch import WorkflowExecutionTemporalConfig
    from consumers.rules import CommandResult, LaneConfig, StateView, complete, decide

    config = LaneConfig(
        enabled=True,
        workflow=WorkflowExecutionTemporalConfig(
            workflow_activity_routing="execution", default_execution_target="cloud"
        ),
        driver_name="memory",
        source="sandbox-lanes/bench",
    )
    decision = decide(_created("tpl", "tpl-ev"), StateView(None), config)
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
        from consumers.state_store import StateStore

        store = StateStore(topic)
        baseline = _read_status("VmRSS")
        report = asyncio.run(store.restore(bootstrap, range(partitions), isolation_level="read_uncommitted"))
        conn.send(
            {
                "seconds": report.seconds,
                "records": report.records,
                "keys": len(store),
                "rss_baseline_bytes": baseline,
                "rss_peak_bytes": _read_status("VmHWM"),
            }
        )
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


async def _restore(args: argparse.Namespace, bootstrap: str, show: bool) -> dict[str, Any]:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from consumers.topology import STATE_TOPIC_CONFIG

    tag = f"bench-{uuid.uuid4().hex[:6]}"
    ctx = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {"compression": STATE_COMPRESSION, "sizes": {}}
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
                    result = await loop.run_in_executor(None, _recv, parent, 600.0)
                    await loop.run_in_executor(None, proc.join, 60)
                    if "error" in result:
                        raise RuntimeError(f"restore of {n} failed: {result['error']}")
                    if result["keys"] != n:
                        raise RuntimeError(f"restore of {n} executions found {result['keys']} keys")
                    runs.append(result)
                    bar.advance()
        finally:
            await _delete_topics(bootstrap, [topic])
        mib = 1024 * 1024
        out["sizes"][str(n)] = {
            "executions": n,
            "write_seconds": write_s,
            "write_records_per_s": n / write_s,
            "seconds": _summary([r["seconds"] for r in runs]),
            "records_per_s": _summary([n / r["seconds"] for r in runs]),
            "rss_peak_mib": _summary([r["rss_peak_bytes"] / mib for r in runs]),
            "rss_baseline_mib": _summary([r["rss_baseline_bytes"] / mib for r in runs]),
            "rss_per_execution_bytes": _summary(
                [(r["rss_peak_bytes"] - r["rss_baseline_bytes"]) / n for r in runs]
            ),
        }
    return out


# --- 6. drivers ---------------------------------------------------------------------------------


async def _driver_latency(
    provisioner: Any, samples: int, tag: str, repeats: int, show: bool, label: str
) -> dict[str, Any]:
    from drivers.contract import SandboxEnvironment

    ensure_ms: list[float] = []
    re_ensure_ms: list[float] = []
    teardown_ms: list[float] = []
    with progress(f"{label} ensure/re-ensure", samples * repeats, enabled=show) as bar:
        for r in range(repeats):
            ids = [f"{tag}-{r}-{i}" for i in range(samples)]
            try:
                for sid in ids:
                    env = SandboxEnvironment(task_queue=f"wfexec:{sid}", caller_class="user")
                    t = time.perf_counter()
                    await provisioner.ensure("workflow", sid, env)
                    ensure_ms.append((time.perf_counter() - t) * 1000)
                    state = await provisioner.probe("workflow", sid)
                    if state != "running":
                        raise RuntimeError(f"{label}: sandbox {sid} is {state} after ensure")
                    t = time.perf_counter()
                    await provisioner.ensure("workflow", sid, env)
                    re_ensure_ms.append((time.perf_counter() - t) * 1000)
                    bar.advance()
            finally:
                for sid in ids:
                    t = time.perf_counter()
                    with contextlib.suppress(Exception):
                        await provisioner.deprovision("workflow", sid)
                    teardown_ms.append((time.perf_counter() - t) * 1000)
    return {
        "samples": len(ensure_ms),
        "ensure_p50_ms": _pct(ensure_ms, 50),
        "ensure_p99_ms": _pct(ensure_ms, 99),
        "re_ensure_p50_ms": _pct(re_ensure_ms, 50),
        "re_ensure_p99_ms": _pct(re_ensure_ms, 99),
        "teardown_p50_ms": _pct(teardown_ms, 50),
        "teardown_p99_ms": _pct(teardown_ms, 99),
    }


async def _local_process(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    import shlex

    from drivers.contract import DriverConfig
    from drivers.local_process import new_local_process_provisioner

    state_dir = tempfile.mkdtemp(prefix="sl-bench-lp-")
    try:
        config = DriverConfig(
            backend_endpoint="http://127.0.0.1:7234",
            temporal_address="127.0.0.1:7233",
            runner_command=f"{shlex.quote(sys.executable)} -m drivers.stub_runner",
            options={"state_dir": state_dir, "grace_seconds": "5"},
        )
        provisioner = new_local_process_provisioner(config, logger)
        try:
            return await _driver_latency(
                provisioner, args.driver_samples, "lp", args.repeats, show, "local-process"
            )
        finally:
            await provisioner.close()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def docker_engine(args: argparse.Namespace) -> AsyncIterator[tuple[str, str, bool]]:
    """``(host, image, private)``: ``--docker-host`` as given, or a private dockerd for the block."""
    from scripts.dockerd import DEFAULT_TAG, Dockerd

    loop = asyncio.get_running_loop()
    image = args.docker_image or DEFAULT_TAG
    if args.docker_host is not None:
        yield args.docker_host, image, False
        return
    engine = Dockerd()
    try:
        await loop.run_in_executor(None, engine.start)
        await loop.run_in_executor(None, engine.build_image, image)
    except BaseException:
        tail = engine.log_tail(10)
        await loop.run_in_executor(None, engine.stop)
        raise RuntimeError(f"private dockerd did not start: {tail[-600:]}") from None
    try:
        yield engine.socket_url, image, True
    finally:
        await loop.run_in_executor(None, engine.stop)


async def _docker(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    from drivers.contract import DriverConfig
    from drivers.docker_driver import new_docker_provisioner

    started = time.perf_counter()
    async with docker_engine(args) as (host, image, private):
        engine_s = time.perf_counter() - started
        config = DriverConfig(
            backend_endpoint="http://127.0.0.1:7234",
            temporal_address="127.0.0.1:7233",
            options={"docker_host": host, "image": image, "memory": "64m", "cpus": "0.5"},
        )
        provisioner = new_docker_provisioner(config, logger)
        try:
            result = await _driver_latency(
                provisioner, args.docker_samples, f"bx{uuid.uuid4().hex[:4]}", args.repeats, show, "docker"
            )
        finally:
            await provisioner.close()
        result["engine"] = "private dockerd (vfs)" if private else host
        result["engine_start_seconds"] = engine_s
        return result


async def _drivers(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in (("local-process", _local_process), ("docker", _docker)):
        try:
            out[name] = await fn(args, show)
        except Exception as exc:
            logger.error("driver benchmark failed", extra={"driver": name, "error": str(exc)})
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


# --- orchestration ------------------------------------------------------------------------------


async def _main(args: argparse.Namespace, bootstrap: str | None, only: set[str]) -> dict[str, Any]:
    show = not args.no_progress
    figures: dict[str, Any] = {}
    timings: dict[str, float] = {}

    async def timed(name: str, fn: Callable[[], Any]) -> None:
        started = time.perf_counter()
        try:
            figures[name] = await fn()
        except Exception as exc:
            logger.error("figure failed", extra={"figure": name, "error": str(exc)})
            figures[name] = {"error": f"{type(exc).__name__}: {exc}"}
        timings[name] = time.perf_counter() - started

    if "rules" in only:
        await timed("rules", lambda: asyncio.to_thread(_rules, args, show))
    if bootstrap is not None:
        if "ceiling" in only or "pod" in only or ("latency" in only and not args.latency_rate):
            await timed("throughput", lambda: _throughput(args, bootstrap, show))
        if "latency" in only:
            pod_rate = 0.0
            with contextlib.suppress(KeyError, TypeError):
                pod_rate = figures["throughput"]["pod"]["exactly_once_events_per_s"]["median"]
            if pod_rate <= 0 and not args.latency_rate:
                figures["latency"] = {"error": "no pod throughput to derive the offered load from"}
            else:
                for guarantee in [g.strip() for g in args.latency_guarantees.split(",") if g.strip()]:
                    name = "latency" if guarantee == "exactly_once" else f"latency_{guarantee}"
                    await timed(name, functools.partial(_latency, args, bootstrap, pod_rate, show, guarantee))
        if "restore" in only:
            await timed("restore", lambda: _restore(args, bootstrap, show))
        if "burst" in only:
            from consumers.bench_burst import burst

            await timed("burst", lambda: burst(args, bootstrap, show, _lane_env, docker_engine))
    if "drivers" in only:
        await timed("drivers", lambda: _drivers(args, show))
    return {"figures": figures, "seconds": timings}


def run(args: argparse.Namespace) -> int:
    from consumers.logs import setup_logging

    # The pod's per-decision info lines are not what is measured: warning unless asked (--log-level).
    level = getattr(args, "log_level", None)
    setup_logging(level if level not in (None, "info") else "warning")
    only = {f.strip() for f in args.only.split(",") if f.strip()}
    unknown = only - set(FIGURES)
    if unknown:
        print(f"sandbox-lanes bench: unknown figure(s) {sorted(unknown)}; known: {FIGURES}", file=sys.stderr)
        return 2
    needs_kafka = bool(only & {"ceiling", "pod", "latency", "restore", "burst"})
    began = time.perf_counter()
    meta: dict[str, Any] = {
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "sandbox-lanes bench " + " ".join(_argv_of(args)),
        "machine": _machine(),
        "versions": _versions(),
        "state_compression": STATE_COMPRESSION,
    }
    broker = None
    bootstrap = args.bootstrap
    if needs_kafka and bootstrap is None:
        from scripts.kafka_broker import DEFAULT_JVM_OPTS, KAFKA_VERSION, KafkaBroker

        broker = KafkaBroker()
        print("starting Apache Kafka for the bench …", file=sys.stderr)
        broker.start()
        bootstrap = broker.bootstrap
        jvm = os.environ.get("SANDBOX_LANES_KAFKA_JVM_OPTS", "").split() or list(DEFAULT_JVM_OPTS)
        meta["broker"] = {
            "kind": f"Apache Kafka {KAFKA_VERSION} (KRaft, single node, scripts/kafka_broker.py)",
            "bootstrap": bootstrap,
            "jvm_opts": " ".join(jvm),
            "startup_seconds": round(broker.startup_seconds, 1),
        }
    elif needs_kafka:
        meta["broker"] = {"kind": "given with --bootstrap", "bootstrap": bootstrap}
    try:
        result = asyncio.run(_main(args, bootstrap, only))
    finally:
        if broker is not None:
            broker.stop()
    meta["seconds"] = round(time.perf_counter() - began, 1)
    doc = {"meta": meta, **result}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(render_table(doc))
    print(f"\nJSON: {args.out}")
    return 0


def _argv_of(args: argparse.Namespace) -> list[str]:
    out = []
    for name in ("repeats", "events", "partitions", "restore_sizes", "driver_samples", "docker_samples"):
        value = getattr(args, name)
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        out.append(f"--{name.replace('_', '-')} {value}")
    if args.only != ",".join(FIGURES):
        out.append(f"--only {args.only}")
    return out


# --- the table ----------------------------------------------------------------------------------


def _fmt(value: float, unit: str = "") -> str:
    if value >= 100:
        text = f"{value:,.0f}"
    elif value >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text}{unit}"


def _mm(s: dict[str, Any], unit: str = "") -> tuple[str, str]:
    return _fmt(s["median"], unit), f"{_fmt(s['min'], unit)}-{_fmt(s['max'], unit)}"


def render_table(doc: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str, str]] = []
    figs = doc["figures"]

    def err(name: str, fig: dict[str, Any]) -> None:
        rows.append((name, "error", fig["error"][:160], ""))

    tp = figs.get("throughput")
    if tp is not None:
        if "error" in tp:
            err("ceiling / pod", tp)
        else:
            n = tp["events"]
            c = tp["ceiling"]
            p = tp["pod"]
            rows.append((f"1. ceiling: plain aiokafka pipe ({n:,} events), events/s",
                         *_mm(c["plain_pipe_events_per_s"]), ""))  # fmt: skip
            rows.append(("   pipe with the pod's write shape (EOS txn, 2 writes/event), events/s",
                         *_mm(c["eos_pipe_2_writes_events_per_s"]), ""))  # fmt: skip
            rows.append(("2. pod, memory driver, exactly_once, events/s",
                         *_mm(p["exactly_once_events_per_s"]), ""))  # fmt: skip
            ratio = p["ratio_exactly_once"]
            rows.append(("   pod / ceiling (exactly_once)", *_mm(ratio),
                         _goal(ratio["median"] >= GOALS["pod_ratio"], "≥ 0.5")))  # fmt: skip
            rows.append(("   pod, at_least_once, events/s", *_mm(p["at_least_once_events_per_s"]), ""))
            rows.append(("   pod / ceiling (at_least_once)", *_mm(p["ratio_at_least_once"]), ""))
            rows.append(("   pod / EOS pipe with the same write shape",
                         *_mm(p["ratio_exactly_once_vs_eos_pipe"]), ""))  # fmt: skip
    for lat in (figs.get("latency"), figs.get("latency_at_least_once")):
        if lat is None:
            continue
        if "error" in lat:
            err("3. latency", lat)
        else:
            load = lat["load_fraction_of_pod"]
            head = f"3. e2e latency, {lat['guarantee']}, {lat['offered_rate']:,.0f}/s ({load:.0%} of pod)"
            rows.append((f"{head}, p50", *_mm(lat["p50_ms"], " ms"), ""))
            rows.append(("   p95", *_mm(lat["p95_ms"], " ms"), ""))
            p99 = lat["p99_ms"]
            rows.append(("   p99", *_mm(p99, " ms"),
                         _goal(p99["median"] < GOALS["latency_p99_ms"], "< 50 ms")))  # fmt: skip
    rules = figs.get("rules")
    if rules is not None:
        if "error" in rules:
            err("4. rules", rules)
        else:
            r = rules["decisions_per_s_per_core"]
            rows.append(("4. pure rules (decide + complete), events/s per core", *_mm(r),
                         _goal(r["median"] >= GOALS["rules_per_core"], "≥ 200k")))  # fmt: skip
            alone = rules["decide_only_per_s_per_core"]
            rows.append(("   decide() alone, decisions/s per core", *_mm(alone), ""))
    rest = figs.get("restore")
    if rest is not None:
        if "error" in rest:
            err("5. restore", rest)
        else:
            for size, fig in rest["sizes"].items():
                n = int(size)
                label = f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}k" if n >= 1000 else str(n)
                goal_t = goal_m = ""
                if n == 1_000_000:
                    goal_t = _goal(fig["seconds"]["median"] < GOALS["restore_1m_seconds"], "< 60 s")
                    goal_m = _goal(fig["rss_peak_mib"]["median"] < GOALS["restore_1m_rss_mib"], "< 1 GiB")
                rows.append((f"5. restore {label} executions, seconds", *_mm(fig["seconds"], " s"), goal_t))
                rows.append((f"   restore {label}, records/s", *_mm(fig["records_per_s"]), ""))
                rows.append((f"   restore {label}, peak RSS", *_mm(fig["rss_peak_mib"], " MiB"), goal_m))
    drv = figs.get("drivers")
    if drv is not None:
        for name, fig in drv.items():
            if "error" in fig:
                err(f"6. {name}", fig)
                continue
            for op, label in (("ensure", f"6. {name} ensure"), ("re_ensure", f"   {name} re-ensure")):
                p50, p99 = _fmt(fig[f"{op}_p50_ms"], " ms"), _fmt(fig[f"{op}_p99_ms"], " ms")
                rows.append((f"{label} p50 / p99 ({fig['samples']} sandboxes)", f"{p50} / {p99}", "", ""))
    burst = figs.get("burst")
    if burst is not None:
        if "error" in burst:
            err("7. burst", burst)
        else:
            from consumers.bench_burst import report_rows

            rows.extend(report_rows(burst))
    m = doc["meta"]["machine"]
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux {m['kernel']}, "
        f"Python {m['python']}, {m['java']}",
        f"broker: {doc['meta'].get('broker', {}).get('kind', '-')}",
        "",
        "| figure | median | min-max | goal |",
        "|---|---|---|---|",
    ]
    lines.extend(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    return "\n".join(lines)


def _goal(met: bool, text: str) -> str:
    return f"{text} {'met' if met else 'MISSED'}"


if __name__ == "__main__":
    from consumers.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
