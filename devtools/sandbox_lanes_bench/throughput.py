"""Figures 1 and 2: the plain aiokafka pipe (alone, and with the pod's write shape) and the pod's events/s."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.common import (
    create_topic,
    delete_topics,
    prepared_inputs,
    running_pod,
    summary,
)

logger = logging.getLogger("sandbox_lanes.bench")


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


async def _pod_throughput(
    env: dict[str, str], n: int, max_batch: int, timeout_s: float
) -> tuple[float, float]:
    """Events/s, and the event loop's thread CPU per event in µs (the pod's Python, which the GIL
    serialises: the budget a faster design must cut; the bench's own 2 ms wait loop is in it)."""
    async with running_pod(env, max_batch) as pod:
        cpu_started = time.thread_time()
        started = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while sum(pod.stats.outputs.values()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod wrote {sum(pod.stats.outputs.values())}/{n} outcomes in time")
            await asyncio.sleep(0.002)
        ended = time.perf_counter()
        cpu_us = (time.thread_time() - cpu_started) * 1e6 / n
        if pod.stats.dead_lettered:
            raise RuntimeError(f"{pod.stats.dead_lettered} bench records dead-lettered")
    return n / (ended - started), cpu_us


async def measure_throughput(args: argparse.Namespace, bootstrap: str, show: bool) -> dict[str, Any]:
    n = args.events
    tag, base, topics, created = await prepared_inputs(bootstrap, "bench", args.partitions, n, show)
    plain: list[float] = []
    eos_x2: list[float] = []
    pod_eos: list[float] = []
    pod_alo: list[float] = []
    cpu: dict[str, list[float]] = {"exactly_once": [], "at_least_once": []}
    timeout = max(120.0, n / 200)
    try:
        with progress("ceiling + pod runs", args.repeats * 4, enabled=show) as bar:
            for r in range(args.repeats):
                # Interleaved, so drift in the machine's load hits every variant alike.
                sink = f"{tag}.pipe-{r}"
                created.append(sink)
                await create_topic(bootstrap, sink, args.partitions)
                plain.append(
                    await _pipe(
                        bootstrap, topics.execution_created, sink, n, group=f"{tag}-pipe-{r}",
                        max_batch=args.max_batch,
                    )
                )  # fmt: skip
                bar.advance()
                sink2 = f"{tag}.pipe-eos-{r}"
                created.append(sink2)
                await create_topic(bootstrap, sink2, args.partitions)
                eos_x2.append(
                    await _pipe(
                        bootstrap, topics.execution_created, sink2, n, group=f"{tag}-pipe-eos-{r}",
                        max_batch=args.max_batch, transactional=True, fanout=2,
                    )
                )  # fmt: skip
                bar.advance()
                for guarantee, out in (("exactly_once", pod_eos), ("at_least_once", pod_alo)):
                    env = {
                        **_run_env(base, tag, f"{guarantee}-{r}", created),
                        "SANDBOX_LANES_PROCESSING_GUARANTEE": guarantee,
                    }
                    rate, cpu_us = await _pod_throughput(env, n, args.max_batch, timeout)
                    out.append(rate)
                    cpu[guarantee].append(cpu_us)
                    bar.advance()
    finally:
        await delete_topics(bootstrap, created)
    ratios = [p / c for p, c in zip(pod_eos, plain, strict=True)]
    ratios_alo = [p / c for p, c in zip(pod_alo, plain, strict=True)]
    return {
        "events": n,
        "partitions": args.partitions,
        "max_batch": args.max_batch,
        "ceiling": {
            "plain_pipe_events_per_s": summary(plain),
            "eos_pipe_2_writes_events_per_s": summary(eos_x2),
        },
        "pod": {
            "exactly_once_events_per_s": summary(pod_eos),
            "at_least_once_events_per_s": summary(pod_alo),
            "ratio_exactly_once": summary(ratios),
            "ratio_at_least_once": summary(ratios_alo),
            "ratio_exactly_once_vs_eos_pipe": summary([p / c for p, c in zip(pod_eos, eos_x2, strict=True)]),
            "exactly_once_loop_cpu_us_per_event": summary(cpu["exactly_once"]),
            "at_least_once_loop_cpu_us_per_event": summary(cpu["at_least_once"]),
        },
    }


def _run_env(base: dict[str, str], tag: str, run: str, created: list[str]) -> dict[str, str]:
    """``base`` with one pod run's own group and output topics (named by ``run``), which are added
    to ``created`` (deleted after the figure)."""
    topics = {
        "SANDBOX_LANES_TOPIC_OUTCOMES": f"{tag}.outcomes-{run}",
        "SANDBOX_LANES_TOPIC_STATE": f"{tag}.state-{run}",
        "SANDBOX_LANES_TOPIC_DLQ": f"{tag}.dlq-{run}",
    }
    created.extend(topics.values())
    return {**base, "SANDBOX_LANES_GROUP_ID": f"{tag}-pod-{run}", **topics}


# --- figure 2 with the state store on disk (issue 38) -------------------------------------------


async def measure_store_pairs(
    bootstrap: str, n: int, partitions: int, pairs: int, max_batch: int, show: bool
) -> dict[str, Any]:
    """Figure 2's pod (exactly_once, memory driver) with ``SANDBOX_LANES_STATE_STORE=memory`` and
    ``rocksdb``, in interleaved pairs on the same input (the order swapped every other pair, so a
    drift in the machine's load does not favour one store); each pair's ratio rocksdb / memory."""
    import tempfile

    tag, base, _topics, created = await prepared_inputs(bootstrap, "bench-stores", partitions, n, show)
    runs: dict[str, list[float]] = {"memory": [], "rocksdb": []}
    cpu: dict[str, list[float]] = {"memory": [], "rocksdb": []}
    timeout = max(120.0, n / 200)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-stores-") as tmp,
            progress("store pairs", pairs * 2, enabled=show) as bar,
        ):
            for r in range(pairs):
                order = ("memory", "rocksdb") if r % 2 == 0 else ("rocksdb", "memory")
                for store in order:
                    env = {
                        **_run_env(base, tag, f"{store}-{r}", created),
                        "SANDBOX_LANES_STATE_STORE": store,
                        "SANDBOX_LANES_STATE_DIR": f"{tmp}/{store}-{r}",
                    }
                    rate, cpu_us = await _pod_throughput(env, n, max_batch, timeout)
                    runs[store].append(rate)
                    cpu[store].append(cpu_us)
                    bar.advance()
    finally:
        await delete_topics(bootstrap, created)
    ratios = [d / m for d, m in zip(runs["rocksdb"], runs["memory"], strict=True)]
    return {
        "events": n,
        "partitions": partitions,
        "pairs": pairs,
        "memory_events_per_s": runs["memory"],
        "rocksdb_events_per_s": runs["rocksdb"],
        "ratio_per_pair": ratios,
        "ratio": summary(ratios),
        "memory_loop_cpu_us_per_event": cpu["memory"],
        "rocksdb_loop_cpu_us_per_event": cpu["rocksdb"],
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m sandbox_lanes_bench.throughput``: the store pairs alone, on a fresh broker (or
    ``--bootstrap``); prints the JSON."""
    import json

    parser = argparse.ArgumentParser(prog="python -m sandbox_lanes_bench.throughput")
    parser.add_argument("--bootstrap")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=500)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        from harness.kafka_broker import KafkaBroker

        broker = KafkaBroker()
        broker.start()
        bootstrap = broker.bootstrap
    try:
        result = asyncio.run(
            measure_store_pairs(bootstrap, args.events, args.partitions, args.pairs, args.max_batch, True)
        )
    finally:
        if broker is not None:
            broker.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
