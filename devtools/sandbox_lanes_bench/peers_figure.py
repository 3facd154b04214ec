"""Figure 8: the pod next to what a user would pick instead, one broker, one run, one measure.

Every system consumes the same protobuf ``ExecutionCreated`` topic from the start, keeps per-execution
state in its changelog-backed store and writes one outcome per event to its own sink. The sink topics
use ``LogAppendTime``: a system's events/s is the number of events over the broker's append times of its
first and last outcome, so start-up (and the clients' own clocks) are out of every figure alike. A run
ends when the system's group has committed every input offset; its sink is then read with
``read_committed`` and must hold one outcome per event (a duplicate is counted, never hidden).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.cells import cells, goal
from sandbox_lanes_bench.common import (
    create_topic,
    delete_topics,
    kafka_admin,
    prepared_inputs,
    running_pod,
    summary,
)

#: (system, guarantee) → the peer module run as ``python -m`` (None = the pod itself, in process).
SYSTEMS: tuple[tuple[str, str, str | None], ...] = (
    ("pod", "exactly_once", None),
    ("pod", "at_least_once", None),
    ("quix", "exactly_once", "sandbox_lanes_bench.peers.quix_app"),
    ("quix", "at_least_once", "sandbox_lanes_bench.peers.quix_app"),
    ("faust", "exactly_once", "sandbox_lanes_bench.peers.faust_app"),
    ("faust", "at_least_once", "sandbox_lanes_bench.peers.faust_app"),
    ("confluent", "exactly_once", "sandbox_lanes_bench.peers.confluent_pipe"),
    ("pod-rules-confluent", "exactly_once", "sandbox_lanes_bench.peers.pod_rules_confluent"),
)
PEER_DISTS = {
    "quix": "quixstreams",
    "faust": "faust",
    "confluent": "confluent_kafka",
    "pod-rules-confluent": "confluent_kafka",
}
#: Issue 28: the pod at least as fast as Quix Streams on the same job, both exactly-once.
GOAL_VS_QUIX = 1.0
GOAL_VS_CONFLUENT = 0.5


@dataclass(frozen=True)
class SinkReading:
    records: int
    distinct: int
    first_ms: int
    last_ms: int


def installed(system: str) -> bool:
    if system == "pod":
        return True
    import importlib.util

    return importlib.util.find_spec(PEER_DISTS[system]) is not None


#: Sinks stamped by the broker: a system's span is measured on one clock, the broker's.
SINK_CONFIG = {"message.timestamp.type": "LogAppendTime"}
CHANGELOG_CONFIG = {"cleanup.policy": "compact"}


async def _committed(admin: Any, group: str, topic: str) -> int:
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    except Exception:  # the group may not exist yet
        return 0
    return sum(meta.offset for tp, meta in offsets.items() if tp.topic == topic and meta.offset > 0)


async def wait_committed(
    bootstrap: str, group: str, topic: str, n: int, timeout_s: float, alive: Callable[[], None]
) -> None:
    deadline = time.monotonic() + timeout_s
    async with kafka_admin(bootstrap) as admin:
        while True:
            alive()
            done = await _committed(admin, group, topic)
            if done >= n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{group} committed {done}/{n} input offsets in {timeout_s:.0f}s")
            await asyncio.sleep(0.25)


async def read_sink(bootstrap: str, topic: str, partitions: int) -> SinkReading:
    """Every committed record of ``topic``: count, distinct values, first and last append time."""
    from aiokafka import TopicPartition

    from consumers.runtime.kafka.topic_reader import read_to_end

    seen: set[bytes] = set()
    records = 0
    first = last = 0
    async for _, recs in read_to_end(bootstrap, [TopicPartition(topic, p) for p in range(partitions)]):
        for rec in recs:
            records += 1
            seen.add(rec.value or b"")
            first = rec.timestamp if not first else min(first, rec.timestamp)
            last = max(last, rec.timestamp)
    return SinkReading(records, len(seen), first, last)


def peer_command(module: str, bootstrap: str, source: str, sink: str, group: str, guarantee: str,
                 partitions: int, state_dir: str, extra: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", module, "--bootstrap", bootstrap, "--source", source, "--sink", sink,
        "--group", group, "--guarantee", guarantee, "--partitions", str(partitions),
        "--state-dir", state_dir, *extra,
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def peer_process(
    module: str, bootstrap: str, source: str, sink: str, group: str, guarantee: str,
    partitions: int, state_dir: str | None = None, extra: tuple[str, ...] = (),
) -> AsyncIterator[Callable[[], None]]:  # fmt: skip
    """A peer running for the block (stopped with SIGTERM after it); yields ``alive()``, which raises
    with the tail of the peer's output once it has exited."""
    with tempfile.TemporaryDirectory(prefix="sandbox-lanes-peer-") as scratch:
        state_dir = state_dir or scratch
        cmd = peer_command(module, bootstrap, source, sink, group, guarantee, partitions, state_dir, extra)
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=state_dir,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip

            def alive() -> None:
                if proc.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-800:]
                    raise RuntimeError(f"{module} exited {proc.returncode}: {tail}")

            try:
                yield alive
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        await asyncio.to_thread(proc.wait, 30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        await asyncio.to_thread(proc.wait)


async def run_peer(
    module: str, bootstrap: str, source: str, sink: str, group: str, guarantee: str,
    partitions: int, n: int, timeout_s: float, state_dir: str | None = None,
) -> None:  # fmt: skip
    """Run a peer until its group has committed ``n`` input offsets, then stop it (SIGTERM)."""
    async with peer_process(module, bootstrap, source, sink, group, guarantee, partitions,
                            state_dir) as alive:  # fmt: skip
        await wait_committed(bootstrap, group, source, n, timeout_s, alive)


async def _run_pod(base: dict[str, str], sink: str, guarantee: str, tag: str, n: int,
                   timeout_s: float, max_batch: int, created: list[str]) -> str:  # fmt: skip
    group = f"{tag}-pod-{guarantee}"
    env = {
        **base,
        "SANDBOX_LANES_PROCESSING_GUARANTEE": guarantee,
        "SANDBOX_LANES_GROUP_ID": group,
        "SANDBOX_LANES_TOPIC_OUTCOMES": sink,
        "SANDBOX_LANES_TOPIC_STATE": f"{sink}.state",
        "SANDBOX_LANES_TOPIC_DLQ": f"{sink}.dlq",
    }
    created.extend((f"{sink}.state", f"{sink}.dlq"))
    async with running_pod(env, max_batch) as pod:
        await wait_committed(base["KAFKA_BOOTSTRAP_SERVERS"], group,
                              base["SANDBOX_LANES_TOPIC_EXECUTION_CREATED"], n, timeout_s,
                              lambda: None)  # fmt: skip
        if pod.stats.dead_lettered:
            raise RuntimeError(f"{pod.stats.dead_lettered} bench records dead-lettered")
    return group


async def measure_peers(
    args: argparse.Namespace,
    bootstrap: str,
    show: bool,
    only: tuple[tuple[str, str, str | None], ...] = SYSTEMS,
) -> dict[str, Any]:
    n = args.peer_events
    tag, base, topics, created = await prepared_inputs(bootstrap, "bench-peers", args.partitions, n, show)
    source = topics.execution_created
    rates: dict[str, list[float]] = {}
    checks: dict[str, dict[str, int]] = {}
    errors: dict[str, str] = {}
    missing = sorted({s for s, _, _ in only if not installed(s)})
    systems = [s for s in only if s[0] not in missing]
    timeout = max(180.0, n / 100)
    try:
        with progress("pod and peers", args.repeats * len(systems), enabled=show) as bar:
            for r in range(args.repeats):
                # Interleaved, so drift in the machine's load hits every system alike.
                for system, guarantee, module in systems:
                    name = f"{system}.{guarantee}"
                    sink = f"{tag}.{system}-{guarantee}-{r}"
                    group = f"{tag}-{system}-{guarantee}-{r}"
                    created.append(sink)
                    await create_topic(bootstrap, sink, args.partitions, SINK_CONFIG)
                    run: Awaitable[Any]
                    if module is None:
                        run = _run_pod({**base, "SANDBOX_LANES_GROUP_ID": group}, sink, guarantee,
                                       f"{tag}-{r}", n, timeout, args.max_batch, created)  # fmt: skip
                    else:
                        if system in ("confluent", "pod-rules-confluent"):
                            created.append(f"{group}-changelog")
                            await create_topic(bootstrap, f"{group}-changelog", args.partitions,
                                               CHANGELOG_CONFIG)  # fmt: skip
                        run = run_peer(module, bootstrap, source, sink, group, guarantee,
                                        args.partitions, n, timeout)  # fmt: skip
                    try:
                        await run
                    except Exception as exc:  # one peer's failure is its figure, not the bench's
                        errors.setdefault(name, f"{type(exc).__name__}: {exc}"[-600:])
                        bar.advance()
                        continue
                    reading = await read_sink(bootstrap, sink, args.partitions)
                    span_s = max(reading.last_ms - reading.first_ms, 1) / 1000
                    rates.setdefault(name, []).append(n / span_s)
                    prev = checks.setdefault(name, {"outcomes": 0, "duplicates": 0, "missing": 0})
                    prev["outcomes"] += reading.records
                    prev["duplicates"] += reading.records - reading.distinct
                    prev["missing"] += max(n - reading.distinct, 0)
                    bar.advance()
    finally:
        await delete_topics(bootstrap, created + await peer_internal_topics(bootstrap, tag))
    out: dict[str, Any] = {
        "events": n,
        "partitions": args.partitions,
        "repeats": args.repeats,
        "not_installed": missing,
        "events_per_s": {name: summary(vals) for name, vals in rates.items()},
        "checks": checks,
        "errors": errors,
    }
    pod = rates.get("pod.exactly_once")
    ratios: dict[str, Any] = {}
    for peer in (
        "quix.exactly_once",
        "confluent.exactly_once",
        "faust.exactly_once",
        "pod-rules-confluent.exactly_once",
    ):
        if pod and peer in rates:
            ratios[f"pod.exactly_once / {peer}"] = summary(
                [p / q for p, q in zip(pod, rates[peer], strict=True)]
            )
    out["ratios"] = ratios
    return out


async def peer_internal_topics(bootstrap: str, tag: str) -> list[str]:
    """The changelog and repartition topics the frameworks made for themselves (names carry the tag)."""
    async with kafka_admin(bootstrap) as admin:
        try:
            names = await admin.list_topics()
        except Exception:
            return []
    return [t for t in names if tag in t]


def report_rows(fig: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    labels = {
        "pod": "this pod",
        "quix": "Quix Streams (RocksDB state + changelog)",
        "faust": "faust-streaming (Table, memory store + changelog)",
        "confluent": "plain confluent-kafka pipe (KIP-447 EOS, 2 writes/event)",
        "pod-rules-confluent": "the pod's rules + codec on confluent-kafka (KIP-447, 3 writes/event, inline)",
    }
    first = True
    for name, s in fig["events_per_s"].items():
        system, guarantee = name.rsplit(".", 1)
        check = fig["checks"][name]
        flag = ""
        if check["duplicates"] or check["missing"]:
            flag = f" ({check['duplicates']} duplicates, {check['missing']} missing)"
        head = f"8. peers ({fig['events']:,} events): " if first else "   "
        first = False
        rows.append((f"{head}{labels[system]}, {guarantee}, events/s{flag}", *cells(s), ""))
    for name, s in fig["ratios"].items():
        target = {
            "pod.exactly_once / quix.exactly_once": GOAL_VS_QUIX,
            "pod.exactly_once / confluent.exactly_once": GOAL_VS_CONFLUENT,
        }.get(name)
        text = goal(s["median"] >= target, f"≥ {target}") if target is not None else ""
        rows.append((f"   {name}", *cells(s), text))
    for name, error in fig.get("errors", {}).items():
        rows.append((f"   {name}", "error", error[:160], ""))
    if fig["not_installed"]:
        rows.append(("   not installed (the [bench] extra)", ", ".join(fig["not_installed"]), "", ""))
    return rows
