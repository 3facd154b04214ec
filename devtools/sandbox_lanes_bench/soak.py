"""Figure ``soak`` (``--only soak --minutes N``): is the pod's cost flat in how long it has run?

A real pod (exactly_once, RocksDB store, the harness's memory driver) in a child process of its own, on a
three-node KRaft cluster of its own (``harness.kafka_broker.KafkaCluster``: topics replicated three ways,
``min.insync.replicas`` 2), fed a steady stream of workflow executions that end: each one's create, its
IN_PROGRESS half its lifetime later, its COMPLETED at the end of it, ``--soak-rate`` executions a second.
The state retention is scaled down (``--soak-retention-s``) and the state topic's time constants with it
(``retention.BENCH_STATE_OVERRIDES``), so states are removed and compacted away all through the run. Every
``--soak-bounce-every-s`` one node goes down for ``--soak-bounce-down-s`` and comes back, the nodes in turn,
a controlled shutdown (SIGTERM) and a crash (SIGKILL) alternately.

Sampled every second:

* by the pod's child, of itself: RSS (``VmRSS``), threads, open file descriptors, asyncio tasks, states held
  (the store's count), how late the sampler's one-second sleep woke (the loop's lag), the pod's outcome
  counters, dead letters, failed commits and the closed producers whose threads still linger; what
  RocksDB holds in memory; the heap: Python's blocks in use, glibc's in use and free-but-kept, the main
  thread's arena apart from the other threads' (``c_heap``); the threads by who made them (Python,
  librdkafka, RocksDB) and the descriptors by kind (sockets, the store's files, the rest);
* by the bench: executions created, provisioned and torn down (read from the outcomes topic,
  read_committed), the pod's consumer lag on its inputs (end offsets minus the group's committed offsets;
  empty while the cluster cannot answer), and each outcome's latency from the event that caused it
  (create → ``SandboxProvisioned``, COMPLETED → ``SandboxDeprovisioned``, one clock: the bench's).

Both write their rows to JSON-lines files in ``--soak-dir`` as they go (a run stopped half-way keeps what it
had). The figure: after the warm-up (the first retention period plus a lifetime and a minute), each
resource's least-squares slope per hour with its 95 % interval, over the whole steady period and over its
later half (a growth that levels off rises over the whole only), next to the spread of its samples, and
the first and last quarters' medians; the same two slopes through one mean per quiet stretch between
bounces (``soak_figures.between_bounces``: samples a second apart are not independent, these far more
nearly are); latency p50/p99/max per window of the run; every execution provisioned once and torn
down once (lost and duplicate outcomes counted). Nothing is asserted here: the figures are printed,
drawn (``draw``) and kept in the run's JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import heapq
import json
import multiprocessing
import os
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.c_heap import arena_split, malloc_totals
from sandbox_lanes_bench.common import child_process, read_status
from sandbox_lanes_bench.soak_figures import HEAP, KINDS, draw, extra_lines, report_rows, summarise, warmup_s

MIB = 1024 * 1024
PARTITIONS = 3
#: What the pod's child samples of itself, in its rows' order (after ``t_s``).
POD_COLUMNS = (
    "rss_mib",
    "threads",
    "fds",
    "tasks",
    "states",
    "loop_lag_ms",
    "provisioned",
    "deprovisioned",
    "failed",
    "dead_lettered",
    "commit_failures",
    "lingering",
    "rocksdb_mib",
    *HEAP,  # py_blocks, then glibc's totals and its arenas' split, as _pod_run samples them
    *KINDS,  # the threads by who made them, the descriptors by kind (_threads_by_maker, _fds_by_kind)
)
#: Every this many seconds the pod's child also counts the objects the collector tracks, by type (the
#: census: what grows between the first after the warm-up and the last is the leak, if any).
CENSUS_EVERY_S = 300.0
#: The census keeps this many types, the most numerous.
CENSUS_TYPES = 40
#: ... and this many containers, the largest.
CENSUS_LARGEST = 12
#: With ``--soak-trace-allocations``: the allocation sites listed per census, those grown most.
TRACE_SITES = 15
#: What the bench samples, in its rows' order (after ``t_s``).
BENCH_COLUMNS = ("created", "provisioned_seen", "deprovisioned_seen", "lag")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This figure's options on ``sandbox-lanes bench``."""
    group = parser.add_argument_group("soak (--only soak)")
    group.add_argument("--minutes", type=float, default=120.0, help="how long the soak's stream runs")
    group.add_argument("--soak-rate", type=float, default=10.0, help="executions created per second")
    group.add_argument("--soak-lifetime-s", type=float, default=4.0, help="create to COMPLETED, seconds")
    group.add_argument(
        "--soak-retention-s", type=int, default=60, help="SANDBOX_LANES_STATE_RETENTION_S of the soak's pod"
    )
    group.add_argument("--soak-bounce-every-s", type=float, default=240.0, help="a broker bounce this often")
    group.add_argument(
        "--soak-bounce-down-s", type=float, default=15.0, help="how long a bounced node is down"
    )
    group.add_argument(
        "--soak-store", choices=("rocksdb", "memory"), default="rocksdb", help="the soak pod's state store"
    )
    group.add_argument(
        "--soak-trace-allocations",
        type=int,
        default=0,
        metavar="FRAMES",
        help="trace the pod's Python allocations (tracemalloc, this many frames; it slows the pod): each "
        "census also lists the allocation sites that grew most since the first after the warm-up",
    )
    group.add_argument(
        "--soak-preload",
        default="",
        metavar="LIB",
        help="a shared library preloaded into the pod's process (LD_PRELOAD), such as another allocator: "
        "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 (glibc's heap columns then read only what is left "
        "to glibc)",
    )
    group.add_argument(
        "--soak-dir",
        default=None,
        help="where the sample rows are written as they come (default: a temp dir)",
    )


def argv_of(args: argparse.Namespace) -> list[str]:
    """This figure's options as the run's recorded command line."""
    return [
        f"--minutes {args.minutes:g} --soak-rate {args.soak_rate:g} "
        f"--soak-lifetime-s {args.soak_lifetime_s:g} --soak-retention-s {args.soak_retention_s} "
        f"--soak-bounce-every-s {args.soak_bounce_every_s:g} "
        f"--soak-bounce-down-s {args.soak_bounce_down_s:g} --soak-store {args.soak_store}"
        + (f" --soak-trace-allocations {args.soak_trace_allocations}" if args.soak_trace_allocations else "")
        + (f" --soak-preload {args.soak_preload}" if args.soak_preload else "")
    ]


# --- the pod's child process --------------------------------------------------------------------


def _census() -> tuple[dict[str, int], list[list[Any]]]:
    """One walk of the objects the collector tracks: their counts by type (the most numerous
    ``CENSUS_TYPES``), and the largest containers with one item each (a structure that grows with
    the work done shows by its length: its items, strings and numbers, are not tracked)."""
    counts: dict[str, int] = {}
    sized = []
    for obj in gc.get_objects():
        name = type(obj).__qualname__
        counts[name] = counts.get(name, 0) + 1
        if isinstance(obj, dict | set | list | deque):
            sized.append(obj)
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:CENSUS_TYPES]
    biggest = heapq.nlargest(CENSUS_LARGEST, sized, key=len)
    return (
        {"total": sum(counts.values()), **dict(top)},
        [[type(obj).__name__, len(obj), _sample(obj)] for obj in biggest],
    )


class AllocationTrace:
    """tracemalloc's view of the pod's Python allocations: the sites that grew most between the first
    snapshot taken after the warm-up and each later one (what a census's type counts cannot show:
    strings and numbers, and the dicts holding only them, which the collector does not track)."""

    def __init__(self, frames: int, from_s: float) -> None:
        self._from_s = from_s
        self._base: tracemalloc.Snapshot | None = None
        tracemalloc.start(frames)

    def grown(self, t_s: float) -> list[list[Any]]:
        if t_s < self._from_s:
            return []
        snapshot = tracemalloc.take_snapshot().filter_traces(
            (tracemalloc.Filter(False, tracemalloc.__file__),)
        )
        if self._base is None:
            self._base = snapshot
            return []
        stats = snapshot.compare_to(self._base, "traceback")[:TRACE_SITES]
        return [
            [stat.size_diff, stat.count_diff, " <- ".join(f"{f.filename}:{f.lineno}" for f in stat.traceback)]
            for stat in stats
        ]


def _sample(container: Any) -> str:
    """One item of a container, short: enough to find the code that fills it."""
    for item in container:
        text = repr(item if not isinstance(container, dict) else (item, container[item]))
        return text[:120]
    return ""


def _threads() -> int:
    """The process's threads, native ones included (librdkafka's, RocksDB's): /proc's count."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def _threads_by_maker() -> tuple[int, int, int]:
    """The threads as Python's (the main one, the executors' workers: Python 3.11 names none of them),
    librdkafka's (``rdk:*``) and RocksDB's (``rocksdb:*``): a rise shows whose."""
    python = librdkafka = rocksdb = 0
    for task in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:  # the thread ended between the listing and the read
            continue
        if name.startswith("rdk:"):
            librdkafka += 1
        elif name.startswith("rocksdb:"):
            rocksdb += 1
        else:
            python += 1
    return python, librdkafka, rocksdb


def _fds_by_kind(store_dir: str) -> tuple[int, int, int]:
    """The open descriptors as sockets (the brokers' connections; also the loop's self-pipe and the
    child's line to the bench, socket pairs both, three that never change), the state store's files
    (RocksDB keeps each live table file open: their count follows its levels, not the time run) and
    the rest (pipes, event fds, the samples' own files)."""
    sockets = store = other = 0
    store_root = os.path.realpath(store_dir) + os.sep  # what readlink gives: absolute, resolved
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between the listing and the read (the listing's own)
            continue
        if target.startswith("socket:"):
            sockets += 1
        elif target.startswith(store_root):
            store += 1
        else:
            other += 1
    return sockets, store, other


def _outputs(pod: Any, kind: str) -> int:
    return sum(n for name, n in pod.stats.outputs.items() if name.endswith("." + kind))


async def _pod_run(spec: dict[str, Any], conn: Any) -> None:
    from consumers.runtime.kafka.txn_producer import lingering
    from sandbox_lanes_bench.common import memory_provisioner, running_pod

    provisioner = memory_provisioner(ensure_latency_ms=spec["ensure_latency_ms"])
    trace = AllocationTrace(spec["trace_frames"], spec["trace_from_s"]) if spec["trace_frames"] else None
    async with running_pod(spec["env"], provisioner=provisioner) as pod:
        conn.send({"ready": True, "pid": os.getpid()})
        began = time.perf_counter()
        census_at = began + 30.0
        with (
            Path(spec["samples"]).open("a") as out,
            Path(spec["census"]).open("a") as census,
        ):
            due = time.perf_counter()
            while not conn.poll():
                due += 1.0
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                now = time.perf_counter()
                # the harness driver keeps every call for the tests: not the pod's memory
                provisioner.calls.clear()
                row = [
                    round(now - began, 3),
                    round(read_status("VmRSS") / MIB, 2),
                    _threads(),
                    len(os.listdir("/proc/self/fd")),
                    len(asyncio.all_tasks()),
                    len(pod.states),
                    round(max(0.0, now - due) * 1000.0, 2),
                    _outputs(pod, "SandboxProvisioned"),
                    _outputs(pod, "SandboxDeprovisioned"),
                    _outputs(pod, "SandboxFailed") + _outputs(pod, "SandboxTeardownFailed"),
                    pod.stats.dead_lettered,
                    pod.stats.commit_failures,
                    lingering(),
                    round((pod.states.memory_bytes() or 0) / MIB, 2),
                    sys.getallocatedblocks(),
                    *malloc_totals(),
                    *arena_split().mib(),
                    *_threads_by_maker(),
                    *_fds_by_kind(spec["env"]["SANDBOX_LANES_STATE_DIR"]),
                ]
                out.write(json.dumps(row) + "\n")
                out.flush()
                if now >= census_at:
                    census_at = now + CENSUS_EVERY_S
                    at = round(now - began, 3)
                    grown = [trace.grown(at)] if trace is not None else []
                    census.write(json.dumps([at, *_census(), *grown]) + "\n")
                    census.flush()
                if now - due > 5.0:  # the loop was held: sample from now on, not to catch up
                    due = now


# --- the bench's side: load, outcomes, lag, bounces ---------------------------------------------


def _phase(execution_id: str, event_id: str, previous: int, new: int) -> Any:
    from events.codec import new_meta
    from events.sandbox_lanes.v1 import common_pb2, inputs_pb2

    return inputs_pb2.PhaseChanged(
        meta=new_meta(event_id=event_id, source="bench"),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        previous_phase=previous,  # type: ignore[arg-type]
        new_phase=new,  # type: ignore[arg-type]
    )


class _Run:
    """The bench's book of one soak: what was sent when, what came back when."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.created = 0
        #: event id of a create / a COMPLETED -> when the bench sent it (perf_counter)
        self.sent_at: dict[str, float] = {}
        self.provisioned: set[str] = set()
        self.deprovisioned: set[str] = set()
        self.duplicates = 0
        #: each duplicate outcome: its kind, its cause, and whether the bench sent that input more than once
        self.duplicate_details: list[dict[str, Any]] = []
        #: event id -> seconds from its first try to its last try, for the inputs the bench sent again
        #: after a send it was told failed (the ack may be lost while the record was written: then the
        #: input is in the topic twice, under one event id)
        self.resent: dict[str, float] = {}
        self.unexpected = 0
        self.send_retries = 0
        self.send_errors: dict[str, int] = {}
        #: (t_s since the start, ms) per outcome
        self.provision_ms: list[tuple[float, float]] = []
        self.teardown_ms: list[tuple[float, float]] = []


async def _load(
    run: _Run, producer: Any, topics: Any, rate: float, lifetime: float, began: float, stop: asyncio.Event
) -> None:
    """Creates at ``rate`` a second from ``began``; each one's IN_PROGRESS and COMPLETED after it."""
    from events.codec import encode
    from events.sandbox_lanes.v1 import common_pb2
    from sandbox_lanes_bench.common import created_event

    later: list[
        tuple[float, int, str, Any, str, bool]
    ] = []  # a heap: (due, seq, topic, message, id, tracked)
    pending: set[asyncio.Task[None]] = set()

    async def send(topic: str, message: Any, event_id: str, tracked: bool) -> None:
        rec = encode(message, source="bench")
        first = time.perf_counter()
        while True:  # the cluster may be bouncing: a send that failed is sent again (same event id)
            try:
                if tracked:  # latency from the first try
                    run.sent_at.setdefault(event_id, time.perf_counter())
                await (await producer.send(topic, rec.value, key=rec.key, headers=rec.headers))
                return
            except Exception as exc:
                run.send_retries += 1
                run.send_errors[type(exc).__name__] = run.send_errors.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.5)
                run.resent[event_id] = time.perf_counter() - first

    def spawn(topic: str, message: Any, event_id: str, tracked: bool) -> None:
        task = asyncio.create_task(send(topic, message, event_id, tracked))
        pending.add(task)
        task.add_done_callback(pending.discard)

    while not stop.is_set():
        now = time.perf_counter()
        while run.created < int((now - began) * rate):
            eid = f"{run.tag}-{run.created:08d}"
            run.created += 1
            spawn(topics.execution_created, created_event(eid, f"{eid}-c"), f"{eid}-c", True)
            running = _phase(eid, f"{eid}-r", common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_IN_PROGRESS)
            done = _phase(eid, f"{eid}-t", common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_COMPLETED)
            heapq.heappush(
                later, (now + lifetime / 2, 2 * run.created, topics.phase_changed, running, f"{eid}-r", False)
            )
            heapq.heappush(
                later, (now + lifetime, 2 * run.created + 1, topics.phase_changed, done, f"{eid}-t", True)
            )
        while later and later[0][0] <= now:
            _, _, topic, message, event_id, tracked = heapq.heappop(later)
            spawn(topic, message, event_id, tracked)
        await asyncio.sleep(0.02)
    # the stream's tail: every execution created is also ended, in due order
    while later:
        _, _, topic, message, event_id, tracked = heapq.heappop(later)
        spawn(topic, message, event_id, tracked)
    if pending:
        await asyncio.gather(*pending)


async def _collect(run: _Run, bootstrap: str, outcomes: str, began: float) -> None:
    """Every outcome of the run (read_committed), matched to the event that caused it."""
    from aiokafka import AIOKafkaConsumer

    from events.codec import OUTCOME_TYPES, decode

    consumer = AIOKafkaConsumer(
        outcomes,
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        fetch_max_wait_ms=100,
    )
    await consumer.start()
    try:
        while True:
            batch = await consumer.getmany(timeout_ms=200)
            now = time.perf_counter()
            for records in batch.values():
                for rec in records:
                    message = decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
                    kind = type(message).__name__
                    cause: str = message.meta.causation_id  # type: ignore[attr-defined]
                    if kind == "SandboxProvisioned":
                        seen, series = run.provisioned, run.provision_ms
                    elif kind == "SandboxDeprovisioned":
                        seen, series = run.deprovisioned, run.teardown_ms
                    else:
                        run.unexpected += 1
                        continue
                    if cause in seen:
                        run.duplicates += 1
                        create = cause[:-2] + "-c"  # the execution's create (the cause of a provision)
                        run.duplicate_details.append(
                            {"kind": kind, "cause": cause, "create_resent_after_s": run.resent.get(create)}
                        )
                        continue
                    seen.add(cause)
                    at = run.sent_at.pop(cause, None)
                    if at is not None:
                        series.append((round(now - began, 3), round((now - at) * 1000.0, 2)))
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()


async def _read_back(bootstrap: str, outcomes: str) -> dict[tuple[str, str], int]:
    """After the run: the outcome topic read again from its beginning to its end offsets (read_committed,
    a fresh consumer), each outcome counted by (kind, cause). The verdict on lost and duplicate outcomes
    is this read's, not the live collector's (which only times them)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from events.codec import OUTCOME_TYPES, decode

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )
    await consumer.start()
    counts: dict[tuple[str, str], int] = {}
    try:
        tps = [TopicPartition(outcomes, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        pending = {tp for tp in tps if end[tp] > 0}
        deadline = time.monotonic() + 300.0
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {outcomes} back did not reach its end in 300 s")
            batch = await consumer.getmany(*pending, timeout_ms=500, max_records=20_000)
            for records in batch.values():
                for rec in records:
                    message = decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
                    key = (type(message).__name__, message.meta.causation_id)  # type: ignore[attr-defined]
                    counts[key] = counts.get(key, 0) + 1
            for tp in list(pending):
                if await consumer.position(tp) >= end[tp]:
                    pending.discard(tp)
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()
    return counts


class CommittedLag:
    """End offsets less the group's committed offsets, where a partition's committed offset is known.

    While a group coordinator loads (a broker bounced), an offset fetch can answer "no committed
    offset" (-1) for partitions that have one: counted as 0, the whole partition read as lag (spikes
    the size of the run's input, 200k records at two hours, that were never there). A partition that
    had a committed offset and is answered without one makes the sample unknown (None); one that never
    had one (before the group's first commit) counts from 0, as the group would read it.
    """

    def __init__(self) -> None:
        self._seen: set[Any] = set()

    def lag(self, committed: dict[Any, int], ends: dict[Any, int]) -> int | None:
        total, unknown = 0, False
        for tp, end in ends.items():
            at = committed.get(tp, -1)
            if at >= 0:
                self._seen.add(tp)
                total += max(0, end - at)
            elif tp in self._seen:
                unknown = True
            else:
                total += end
        return None if unknown else total


class _Lag:
    """The pod group's lag on its inputs: end offsets minus committed offsets, or None while the cluster
    does not answer within the sample's time (clients kept for the run: they reconnect on their own)."""

    def __init__(self, bootstrap: str, group: str, inputs: Sequence[str]) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition
        from aiokafka.admin import AIOKafkaAdminClient

        self.group = group
        self.tps = [TopicPartition(t, p) for t in inputs for p in range(PARTITIONS)]
        self.admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
        self.consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, request_timeout_ms=3000)
        self.known = CommittedLag()

    async def start(self) -> None:
        await asyncio.gather(self.admin.start(), self.consumer.start())

    async def read(self) -> int | None:
        try:
            committed, ends = await asyncio.wait_for(
                asyncio.gather(
                    self.admin.list_consumer_group_offsets(self.group, partitions=self.tps),
                    self.consumer.end_offsets(self.tps),
                ),
                0.8,
            )
        except Exception:
            return None
        return self.known.lag(
            {tp: at.offset for tp, at in committed.items() if at is not None},
            {tp: int(ends[tp]) for tp in self.tps},
        )

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.admin.close()
        with contextlib.suppress(Exception):
            await self.consumer.stop()


async def _bounces(
    cluster: Any, every_s: float, down_s: float, began: float, stop: asyncio.Event, log: list[dict[str, Any]]
) -> None:
    """One node down and back every ``every_s``, in turn; SIGTERM and SIGKILL alternately."""
    n = 0
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        if stop.is_set():
            return
        index = n % len(cluster.nodes)
        how = "SIGTERM" if n % 2 == 0 else "SIGKILL"
        down = time.perf_counter() - began
        if how == "SIGTERM":
            await asyncio.to_thread(cluster.stop_node, index)
        else:
            await asyncio.to_thread(cluster.kill, index)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(cluster.start_node, index)
        up = time.perf_counter() - began
        isr_s = await asyncio.to_thread(cluster.wait_isr_full, 300.0, confirm=False)
        log.append(
            {
                "node": index,
                "how": how,
                "down_t_s": round(down, 1),
                "up_t_s": round(up, 1),
                "isr_full_after_s": round(isr_s, 1),
            }
        )
        n += 1


@contextlib.contextmanager
def _preloaded(library: str) -> Iterator[None]:
    """``LD_PRELOAD`` in this process's environment while the pod's child is spawned (a spawned child
    is a new interpreter, exec'd with the parent's environment), not after."""
    if not library:
        yield
        return
    if not Path(library).is_file():
        raise FileNotFoundError(f"--soak-preload: no such library: {library}")
    before = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = library
    try:
        yield
    finally:
        if before is None:
            del os.environ["LD_PRELOAD"]
        else:
            os.environ["LD_PRELOAD"] = before


async def measure_soak(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    from harness.kafka_broker import KafkaCluster

    if args.soak_preload and not Path(args.soak_preload).is_file():  # before a cluster is started
        raise FileNotFoundError(f"--soak-preload: no such library: {args.soak_preload}")
    cluster = KafkaCluster(3)
    await asyncio.to_thread(cluster.start)
    try:
        return await _soak(args, cluster, show)
    finally:
        await asyncio.to_thread(cluster.stop)


async def _soak(args: argparse.Namespace, cluster: Any, show: bool) -> dict[str, Any]:
    from aiokafka import AIOKafkaProducer

    from consumers.ops.settings import load_settings
    from consumers.runtime.kafka.topology import ensure_topics
    from sandbox_lanes_bench.common import kafka_admin, lane_env
    from sandbox_lanes_bench.retention import state_topic_config

    bootstrap = cluster.bootstrap
    tag = f"soak-{uuid.uuid4().hex[:6]}"
    directory = Path(args.soak_dir) if args.soak_dir else Path(tempfile.mkdtemp(prefix="bench-soak-"))
    directory.mkdir(parents=True, exist_ok=True)
    state_dir = directory / "state"
    env = {
        **lane_env(bootstrap, tag, PARTITIONS, "exactly_once"),
        "SANDBOX_LANES_STATE_RETENTION_S": str(args.soak_retention_s),
        "SANDBOX_LANES_STATE_STORE": args.soak_store,
        "SANDBOX_LANES_STATE_DIR": str(state_dir),
        "SANDBOX_LANES_REPLICATION": "-1",
    }
    topics = load_settings(env).topics
    async with kafka_admin(bootstrap) as admin:
        from aiokafka.admin import NewTopic

        await admin.create_topics(
            [
                NewTopic(
                    topics.state,
                    num_partitions=PARTITIONS,
                    replication_factor=3,
                    topic_configs=state_topic_config(),
                )
            ]
        )
        for attempt in range(40):
            try:
                await ensure_topics(admin, topics, PARTITIONS)
                break
            except Exception:
                if attempt == 39:
                    raise
                await asyncio.sleep(0.25)
    pod_samples = directory / "pod.jsonl"
    bench_samples = directory / "bench.jsonl"
    census_samples = directory / "census.jsonl"
    spec = {
        "env": env,
        "samples": str(pod_samples),
        "census": str(census_samples),
        "ensure_latency_ms": 5.0,
        "trace_frames": args.soak_trace_allocations,
        "trace_from_s": warmup_s(
            {
                "minutes": args.minutes,
                "retention_s": args.soak_retention_s,
                "lifetime_s": args.soak_lifetime_s,
            }
        ),
    }
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=child_process, args=(_pod_run, spec, child))
    with _preloaded(args.soak_preload):
        proc.start()
    child.close()
    loop = asyncio.get_running_loop()
    from sandbox_lanes_bench.common import recv

    first = await loop.run_in_executor(None, recv, parent, 180.0)
    if "error" in first:
        raise RuntimeError(f"the soak's pod did not start: {first['error']}")
    run = _Run(tag)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=True,
        linger_ms=5,
        request_timeout_ms=30_000,
    )
    await producer.start()
    duration = args.minutes * 60.0
    began = time.perf_counter()
    stop_load, stop_bounces = asyncio.Event(), asyncio.Event()
    bounces: list[dict[str, Any]] = []
    collector = asyncio.create_task(_collect(run, bootstrap, topics.outcomes, began))
    load = asyncio.create_task(
        _load(run, producer, topics, args.soak_rate, args.soak_lifetime_s, began, stop_load)
    )
    bouncer = asyncio.create_task(
        _bounces(cluster, args.soak_bounce_every_s, args.soak_bounce_down_s, began, stop_bounces, bounces)
    )
    group = env["SANDBOX_LANES_GROUP_ID"]
    inputs = (topics.execution_created, topics.phase_changed)
    drained_s: float | None = None
    lags = _Lag(bootstrap, group, inputs)
    await lags.start()
    try:
        with (
            bench_samples.open("a") as out,
            progress(f"soak: {args.minutes:g} min", int(duration), enabled=show) as bar,
        ):
            due, done_s = began, 0
            while True:
                due += 1.0
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                t = time.perf_counter() - began
                for task in (collector, load, bouncer):
                    if task.done() and task.exception() is not None:
                        raise RuntimeError(f"soak: {task.get_name()} failed: {task.exception()!r}")
                if not proc.is_alive():
                    raise RuntimeError(f"soak: the pod's process ended (exit {proc.exitcode})")
                lag = await lags.read()
                row = [round(t, 3), run.created, len(run.provisioned), len(run.deprovisioned), lag]
                out.write(json.dumps(row) + "\n")
                out.flush()
                if t < duration:
                    bar.advance(int(t) - done_s)
                    done_s = int(t)
                elif not stop_load.is_set():
                    stop_load.set()
                    stop_bounces.set()
                if stop_load.is_set() and load.done() and len(run.deprovisioned) >= run.created:
                    drained_s = t - duration
                    break
                if t > duration + 180.0:  # what is missing by now is counted as lost
                    break
                if time.perf_counter() - due > 5.0:
                    due = time.perf_counter()
    finally:
        stop_load.set()
        stop_bounces.set()
        with contextlib.suppress(Exception):
            parent.send("stop")
        await loop.run_in_executor(None, proc.join, 90)
        if proc.is_alive():
            proc.kill()
        parent.close()
        for task in (collector, load, bouncer):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(Exception):
            await producer.stop()
        await lags.close()
    counts = await _read_back(bootstrap, topics.outcomes)
    provisioned = {cause for (kind, cause) in counts if kind == "SandboxProvisioned"}
    deprovisioned = {cause for (kind, cause) in counts if kind == "SandboxDeprovisioned"}
    creates = {f"{tag}-{i:08d}" for i in range(run.created)}
    lost = sorted(e for e in creates if f"{e}-c" not in provisioned or f"{e}-t" not in deprovisioned)
    doubled = {cause: n for (kind, cause), n in counts.items() if n > 1}
    pod_rows = [json.loads(line) for line in pod_samples.read_text().splitlines() if line.strip()]
    bench_rows = [json.loads(line) for line in bench_samples.read_text().splitlines() if line.strip()]
    censuses = (
        [json.loads(line) for line in census_samples.read_text().splitlines() if line.strip()]
        if census_samples.exists()
        else []
    )
    return summarise(
        {
            "minutes": args.minutes,
            "rate_per_s": args.soak_rate,
            "lifetime_s": args.soak_lifetime_s,
            "retention_s": args.soak_retention_s,
            "bounce_every_s": args.soak_bounce_every_s,
            "bounce_down_s": args.soak_bounce_down_s,
            "store": args.soak_store,
            "preload": args.soak_preload,
            "directory": str(directory),
            "executions": run.created,
            # read back from the outcome topic after the run
            "provisioned": len(provisioned),
            "deprovisioned": len(deprovisioned),
            "lost": len(lost),
            "lost_examples": lost[:10],
            "duplicates": sum(n - 1 for n in doubled.values()),
            "unexpected_outcomes": sum(
                n
                for (kind, _), n in counts.items()
                if kind not in ("SandboxProvisioned", "SandboxDeprovisioned")
            ),
            # what the live collector saw twice while the run went on (its reads, not the topic's)
            "live_duplicates": run.duplicates,
            # a create sent again once its execution's state could be removed (its lifetime and the
            # retention after its first try) is a new execution by design (docs/guarantees.md,
            # Retention); any other duplicate is the pod's
            "duplicates_unexplained": sum(
                n - 1
                for cause, n in doubled.items()
                if run.resent.get(cause[:-2] + "-c", 0.0) < args.soak_lifetime_s + args.soak_retention_s
            ),
            "duplicate_details": [
                {"cause": cause, "outcomes": n, "create_resent_after_s": run.resent.get(cause[:-2] + "-c")}
                for cause, n in sorted(doubled.items())[:50]
            ],
            "live_duplicate_details": run.duplicate_details[:50],
            "send_retries": run.send_retries,
            "send_errors": run.send_errors,
            "drained_after_s": None if drained_s is None else round(drained_s, 1),
            "bounces": bounces,
            "pod_samples": {"columns": ["t_s", *POD_COLUMNS], "rows": pod_rows},
            "bench_samples": {"columns": ["t_s", *BENCH_COLUMNS], "rows": bench_rows},
            "censuses": censuses,
            "provision_ms": run.provision_ms,
            "teardown_ms": run.teardown_ms,
        }
    )


__all__ = ["add_arguments", "argv_of", "draw", "extra_lines", "measure_soak", "report_rows", "summarise"]
