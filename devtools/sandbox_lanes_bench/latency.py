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
from sandbox_lanes_bench.common import (
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


def paced(rate: float, seconds: float, warmup: float) -> tuple[list[float], int]:
    """A constant offered load: send times (seconds from the start) and the first measured index."""
    total = int(rate * (seconds + warmup))
    return [i / rate for i in range(total)], int(rate * warmup)


def spaced(gap_ms: tuple[float, float], seconds: float, seed: int) -> tuple[list[float], int]:
    """One event at a time: gaps drawn uniformly from ``gap_ms`` (seeded) for ``seconds``."""
    import random

    rng = random.Random(seed)
    times: list[float] = []
    at = 0.0
    while at < seconds:
        times.append(at)
        at += rng.uniform(*gap_ms) / 1000
    return times, 0


def _latency_child(
    bootstrap: str,
    source: str,
    outcomes: str,
    schedule: list[float],
    measure_from: int,
    conn: Any,
    prime: int = 0,
    drain_s: float = 30.0,
    bare: bool = False,
) -> None:
    """Child process: send one input at each of ``schedule``'s times, collect produce→outcome latencies."""
    try:
        load = _latency_load(bootstrap, source, outcomes, schedule, measure_from, prime, drain_s, bare)
        conn.send(asyncio.run(load))
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


async def _latency_load(
    bootstrap: str,
    source: str,
    outcomes: str,
    schedule: list[float],
    measure_from: int,
    prime: int = 0,
    drain_s: float = 30.0,
    bare: bool = False,
) -> dict[str, Any]:
    """Send ``schedule``'s inputs (the ``measure_from`` first unmeasured) and time each one's outcome
    readable with read_committed, matched by the outcome's causation id (the input's event id).

    ``prime`` inputs go first, and the schedule starts once all their outcomes are readable (a
    system still starting or restoring is not what is measured). The outcomes of the schedule are
    awaited ``drain_s`` after the last send; ``last_outcome_s`` is the last one's time from the start.
    ``bare``: the outcomes are the bench peers' (``peers/job.py``): a ``SandboxProvisioned``'s bytes
    without CloudEvents headers of their own, read as that type.
    """
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from events.codec import OUTCOME_TYPES, decode, encode
    from events.sandbox_lanes.v1 import outcomes_pb2

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
    last_at = 0.0
    total = len(schedule)
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
        # Pre-encode so the generator's own cost does not shape the offered load.
        records = [
            (f"{tag}-ev-{i}", encode(created_event(f"{tag}-wf-{i}", f"{tag}-ev-{i}"), source="bench"))
            for i in range(prime + total)
        ]

        async def collect() -> None:
            nonlocal received, last_at
            while True:
                batch = await consumer.getmany(timeout_ms=50)
                now = time.perf_counter()
                for recs in batch.values():
                    for rec in recs:
                        message = (
                            outcomes_pb2.SandboxProvisioned.FromString(rec.value)
                            if bare
                            else decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
                        )
                        at = sent_at.pop(message.meta.causation_id, None)  # type: ignore[attr-defined]
                        if at is not None:
                            received += 1
                            last_at = now
                            if at >= 0:
                                latencies.append((now - at) * 1000.0)

        collector = asyncio.create_task(collect())

        async def until(count: int, seconds: float) -> bool:
            """Whether ``count`` outcomes were read within ``seconds`` (a failed collector raises)."""
            deadline = time.monotonic() + seconds
            while received < count and time.monotonic() < deadline:
                if collector.done():
                    collector.result()
                await asyncio.sleep(0.05)
            return received >= count

        try:
            if prime:
                for event_id, rec in records[:prime]:
                    sent_at[event_id] = -1.0
                    await producer.send_and_wait(source, rec.value, key=rec.key, headers=rec.headers)
                if not await until(prime, 120):
                    raise TimeoutError(f"{received}/{prime} priming outcomes readable in 120s")
                received = 0
            started = time.perf_counter()
            futures = []
            for i, (event_id, rec) in enumerate(records[prime:]):
                delay = started + schedule[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent_at[event_id] = time.perf_counter() if i >= measure_from else -1.0
                futures.append(await producer.send(source, rec.value, key=rec.key, headers=rec.headers))
            await asyncio.gather(*futures)
            offered_s = time.perf_counter() - started
            await until(total, drain_s)
            waited_s = time.perf_counter() - started - offered_s
        finally:
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
        "offered_seconds": offered_s,
        "last_outcome_s": last_at - started if received else 0.0,
        "waited_s": waited_s,
        "latencies_ms": latencies,
    }


async def latency_run(
    bootstrap: str,
    source: str,
    outcomes: str,
    schedule: tuple[list[float], int],
    *,
    prime: int = 0,
    drain_s: float = 30.0,
    bare: bool = False,
) -> dict[str, Any]:
    """One load-and-collect run in a child process (its own core's worth of Python), its result."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    times, measure_from = schedule
    proc = ctx.Process(
        target=_latency_child,
        args=(bootstrap, source, outcomes, times, measure_from, child, prime, drain_s, bare),
    )
    proc.start()
    child.close()
    budget = (times[-1] if times else 0.0) + drain_s + (150 if prime else 30) + 60
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(None, recv, parent, budget)
    await loop.run_in_executor(None, proc.join, 30)
    if proc.is_alive():
        proc.kill()
    if "error" in result:
        raise RuntimeError(f"latency load generator failed: {result['error']}")
    return result


def latency_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p95/p99/max over runs (median and min-max of the per-run percentiles), samples and lost."""
    p = {q: [pct(r["latencies_ms"], q) for r in runs] for q in (50, 95, 99)}
    return {
        "offered_rate_measured": summary([r["offered_rate"] for r in runs]),
        "samples": sum(len(r["latencies_ms"]) for r in runs),
        "lost": sum(r["sent"] - r["received"] for r in runs),
        "p50_ms": summary(p[50]),
        "p95_ms": summary(p[95]),
        "p99_ms": summary(p[99]),
        "max_ms": summary([max(r["latencies_ms"], default=0.0) for r in runs]),
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
    runs: list[dict[str, Any]] = []
    try:
        async with running_pod(env, args.max_batch):
            with progress(f"latency {guarantee} at {rate:,.0f}/s", args.repeats, enabled=show) as bar:
                for _ in range(args.repeats):
                    schedule = paced(rate, args.latency_seconds, args.latency_warmup)
                    runs.append(
                        await latency_run(bootstrap, topics.execution_created, topics.outcomes, schedule)
                    )
                    bar.advance()
    finally:
        await delete_topics(bootstrap, list(topics.all()))
    return {
        "guarantee": guarantee,
        "offered_rate": rate,
        "load_fraction_of_pod": rate / pod_rate if pod_rate else 0.0,
        "seconds_per_run": args.latency_seconds,
        **latency_summary(runs),
    }
