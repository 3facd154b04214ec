"""Figure 3: end-to-end latency at a fixed offered load, load and collector in a child process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import time
import uuid
from typing import Any

from consumers.ops.progress import progress
from consumers.tools.bench.common import (
    create_topics,
    created_event,
    delete_topics,
    lane_env,
    pct,
    recv,
    running_pod,
    summary,
)

logger = logging.getLogger("sandbox_lanes.bench")


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
            (f"{tag}-ev-{i}", encode(created_event(f"{tag}-wf-{i}", f"{tag}-ev-{i}"), source="bench"))
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


async def measure_latency(
    args: argparse.Namespace, bootstrap: str, pod_rate: float, show: bool, guarantee: str
) -> dict[str, Any]:
    from consumers.ops.settings import load_settings

    rate = args.latency_rate or max(1.0, args.latency_load * pod_rate)
    tag = f"bench-{uuid.uuid4().hex[:6]}"
    env = lane_env(bootstrap, tag, args.partitions, guarantee)
    topics = load_settings(env).topics
    await create_topics(bootstrap, topics, args.partitions)
    ctx = multiprocessing.get_context("spawn")
    runs: list[dict[str, Any]] = []
    try:
        async with running_pod(env, args.max_batch):
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
                    result = await asyncio.get_running_loop().run_in_executor(None, recv, parent, budget)
                    await asyncio.get_running_loop().run_in_executor(None, proc.join, 30)
                    if "error" in result:
                        raise RuntimeError(f"latency load generator failed: {result['error']}")
                    runs.append(result)
                    bar.advance()
    finally:
        await delete_topics(bootstrap, list(topics.all()))
    p = {q: [pct(r["latencies_ms"], q) for r in runs] for q in (50, 95, 99)}
    return {
        "guarantee": guarantee,
        "offered_rate": rate,
        "offered_rate_measured": summary([r["offered_rate"] for r in runs]),
        "load_fraction_of_pod": rate / pod_rate if pod_rate else 0.0,
        "seconds_per_run": args.latency_seconds,
        "samples": sum(len(r["latencies_ms"]) for r in runs),
        "lost": sum(r["sent"] - r["received"] for r in runs),
        "p50_ms": summary(p[50]),
        "p95_ms": summary(p[95]),
        "p99_ms": summary(p[99]),
        "max_ms": summary([max(r["latencies_ms"], default=0.0) for r in runs]),
    }
