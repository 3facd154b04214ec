"""Figure ``scale`` (``--only scale``, issue 45 item 2): the pod on the RocksDB store with 0, 1M and 10M
states held, under the same input stream. What a pod does each second must not grow with what it holds.

Per size (``--scale-sizes``), its own topics: the held states written into the state topic by the
restore figure's writer (:func:`sandbox_lanes_bench.restore._write_states`: provisioned workflows, ids
``exec-NNNNNNNN``), with a few of the reaper's (finished executions' states, a deleted session's), then
the pod in child processes of its own (:mod:`.scale_pod`): one restores them from empty and stops;
each next one starts again on the same directory for a round of the stream, ``--scale-events``
ExecutionCreated, the same ids at every size, spread among the held ones (:func:`stream_id`); the
sizes' rounds (``--scale-rounds``) interleaved, so a drift in the machine's load hits them alike.

Per size: events/s, process CPU per event, the event loop's busy time per turn p50/p99/max
(:mod:`.loop_turns`) and the pod's own turns', the pod's reaper pass (its seconds and the longest turn
of the loop while it ran; a pass with a deleted session listed, whose references it reads, on its own),
restart to ready and its longest turn, RSS and disk; each as a ratio to the first size of the run (the
empty store, ``0``). Goals, printed, never asserted: at the largest size throughput and the loop's p99
within 10 % of the empty store's, every pass's longest hold under 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import shutil
import statistics
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from consumers.ops.progress import progress

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger("sandbox_lanes.bench")

#: The goals (issue 45): at the largest size against the empty store.
GOAL_RATE_RATIO = 0.9
GOAL_P99_RATIO = 1.1
GOAL_HOLD_MS = 50.0
#: Each round's ratio to the base in the same round (their spread: the table's min-max).
PAIRED_KEYS = (
    "events_per_s", "cpu_us_per_event", "loop_cpu_us_per_event", "loop_turn_p99_ms", "loop_turn_cpu_p99_ms",
)  # fmt: skip
#: The charts' colours (those of ``plots``, which imports this module).
P50_COLOR = "#1f6feb"
P99_COLOR = "#cf222e"
#: What the ratios to the first size are taken of (a size's row keys).
RATIO_KEYS = (
    "events_per_s",
    "cpu_us_per_event",
    "loop_cpu_us_per_event",
    "loop_turn_p50_ms",
    "loop_turn_p99_ms",
    "loop_turn_max_ms",
    "loop_turn_cpu_p99_ms",
    "loop_turn_cpu_max_ms",
    "pod_turn_p99_ms",
    "reaper_pass_s",
    "reaper_longest_hold_ms",
    "reaper_longest_hold_cpu_ms",
    "read_through_pass_s",
    "read_through_longest_hold_ms",
    "read_through_longest_hold_cpu_ms",
    "restart_to_ready_s",
    "restart_longest_hold_ms",
    "restart_longest_hold_cpu_ms",
    "rss_ready_mib",
    "rss_after_stream_mib",
)


def _sizes(text: str) -> list[int]:
    """``0,1m,10m`` or ``0,1000000``: states held per size."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1_000_000 if part.endswith("m") else 1000 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("mk")) * scale))
    if not out or any(n < 0 for n in out):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes like 0,1m,10m")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This figure's options on ``sandbox-lanes bench``."""
    parser.add_argument(
        "--scale-sizes", type=_sizes, default=[0, 1_000_000, 10_000_000],
        help="scale: states held per run, the first the base of the ratios (e.g. 0,1m,10m)",
    )  # fmt: skip
    parser.add_argument("--scale-events", type=int, default=20_000, help="scale: creates in the stream")
    parser.add_argument(
        "--scale-listed", type=int, default=200, help="scale: held states' sandboxes the driver lists"
    )
    parser.add_argument(
        "--scale-candidates",
        type=int,
        default=20,
        help="scale: finished executions' sandboxes reaped per pass",
    )
    parser.add_argument(
        "--scale-rounds", type=int, default=3, help="scale: rounds of the stream per size, interleaved"
    )
    parser.add_argument(
        "--scale-passes", type=int, default=3, help="scale: reaper passes (and one read-through)"
    )


def argv_of(args: argparse.Namespace) -> list[str]:
    """This figure's options as the run's recorded command line."""
    sizes = ",".join(str(n) for n in args.scale_sizes)
    return [
        f"--scale-sizes {sizes} --scale-events {args.scale_events} --scale-listed {args.scale_listed} "
        f"--scale-candidates {args.scale_candidates} --scale-passes {args.scale_passes} "
        f"--scale-rounds {args.scale_rounds}"
    ]


# --- the states held and the stream ---------------------------------------------------------------


async def _write_reaper_states(bootstrap: str, topic: str, candidates: int) -> None:
    """The reaper's states beside the held ones: ``candidates`` finished workflows (their sandboxes
    reaped by each pass) and a deleted session whose sandbox's teardown failed."""
    from aiokafka import AIOKafkaProducer

    from drivers.naming import sandbox_base_name
    from events.codec import encode
    from events.sandbox_lanes.v1 import common_pb2, state_pb2
    from sandbox_lanes_bench.restore import _state_template
    from sandbox_lanes_bench.scale_pod import DELETED_ID, DONE_ID

    template = _state_template()
    states = []
    for i in range(candidates):
        state = state_pb2.ExecutionState()
        state.CopyFrom(template)
        eid = DONE_ID.format(i)
        state.execution_id = eid
        state.phase = common_pb2.EXECUTION_COMPLETED
        box = state.sandboxes[0]
        box.sandbox.sandbox_id = eid
        box.sandbox.name = sandbox_base_name("workflow", eid)
        state.updated_at.GetCurrentTime()
        states.append(state)
    deleted = state_pb2.ExecutionState(execution_id=DELETED_ID, session_deleted=True)
    deleted.updated_at.GetCurrentTime()
    record = deleted.sandboxes.add()
    record.sandbox.scope = common_pb2.SANDBOX_SCOPE_SESSION
    record.sandbox.sandbox_id = DELETED_ID
    record.lifecycle = state_pb2.SANDBOX_TEARDOWN_FAILED
    states.append(deleted)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for state in states:
            rec = encode(state)
            await producer.send_and_wait(topic, rec.value, key=rec.key, headers=rec.headers)
    finally:
        await producer.stop()


#: The stream's ids are spread over the held ids' range (``exec-NNNNNNNN``, up to 10M), each just past
#: one of them: a create's reads of its (absent) key then search the store's levels as a real id would,
#: instead of falling before every file's first key (``scale-wf-N`` sorts before ``exec-``).
STREAM_STRIDE = 499  # prime: i * 499 mod 10M differs for every i below 10M
STREAM_SPAN = 10_000_000


def stream_id(i: int) -> str:
    """The stream's i-th execution id, the same at every size."""
    return f"exec-{(i * STREAM_STRIDE + 7) % STREAM_SPAN:08d}-new"


async def _produce_stream(bootstrap: str, topic: str, n: int, show: bool, *, first: int = 0) -> None:
    """A round of the input stream: ``n`` ExecutionCreated (workflows, CLOUD), ids :func:`stream_id`
    from ``first`` (each round new executions, the same at every size)."""
    from sandbox_lanes_bench.common import produce_creates

    ids = [(stream_id(i), f"{stream_id(i)}-created") for i in range(first, first + n)]
    await produce_creates(bootstrap, topic, ids, f"produce {n:,} creates", show)


@dataclass
class _Size:
    """One size of the run: its topics and directory (kept for every round), and its children's reports."""

    n: int
    env: dict[str, str]
    topics: Any
    spec: dict[str, Any]
    write_s: float = 0.0
    restored: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)


def _size(args: argparse.Namespace, bootstrap: str, n: int) -> _Size:
    from consumers.ops.settings import load_settings
    from sandbox_lanes_bench.common import lane_env

    env = {
        **lane_env(bootstrap, f"bench-scale-{uuid.uuid4().hex[:6]}", args.partitions, "exactly_once"),
        "SANDBOX_LANES_STATE_STORE": "rocksdb",
        "SANDBOX_LANES_STATE_DIR": tempfile.mkdtemp(prefix="bench-scale-state-"),
    }
    events = args.scale_events
    spec = {
        "env": env,
        "events": events,
        "listed": args.scale_listed,
        "candidates": args.scale_candidates,
        "passes": args.scale_passes,
        "restore_timeout_s": max(300.0, n / 10_000),
        "restart_timeout_s": 120.0,
        "stream_timeout_s": max(300.0, events / 20),
    }
    return _Size(n, env, load_settings(env).topics, spec)


async def _prepare(ctx: Any, size: _Size, args: argparse.Namespace, bootstrap: str, show: bool) -> None:
    """The size's topics, its held states written, and restored from empty by a pod of its own."""
    from sandbox_lanes_bench.common import create_topics
    from sandbox_lanes_bench.restore import _write_states

    await create_topics(bootstrap, size.topics, args.partitions)
    size.write_s = await _write_states(bootstrap, size.topics.state, size.n, args.partitions, show)
    await _write_reaper_states(bootstrap, size.topics.state, args.scale_candidates)
    timeout = size.spec["restore_timeout_s"] + 120
    with progress(f"scale {size.n:,}: restore from empty", 1, enabled=show) as bar:
        size.restored = await _child(ctx, {**size.spec, "step": "restore"}, timeout)
        bar.advance()


async def _round(ctx: Any, size: _Size, bootstrap: str, r: int, show: bool) -> None:
    """Round ``r`` of the stream through the size's pod: restart, stream, reaper passes, restart."""
    events = size.spec["events"]
    await _produce_stream(bootstrap, size.topics.execution_created, events, show, first=r * events)
    budget = size.spec["stream_timeout_s"] + 4 * size.spec["restart_timeout_s"] + 600
    with progress(f"scale {size.n:,}: round {r + 1}", 1, enabled=show) as bar:
        size.runs.append(await _child(ctx, {**size.spec, "step": "run"}, budget))
        bar.advance()


async def _child(ctx: Any, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One step of :mod:`.scale_pod` in a process of its own: its report."""
    from sandbox_lanes_bench.common import recv
    from sandbox_lanes_bench.scale_pod import pod_child

    loop = asyncio.get_running_loop()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=pod_child, args=(spec, child))
    proc.start()
    child.close()
    try:
        report: dict[str, Any] = await loop.run_in_executor(None, recv, parent, timeout_s)
        await loop.run_in_executor(None, proc.join, 120)
    finally:
        if proc.is_alive():
            proc.kill()
    if "error" in report:
        raise RuntimeError(f"{spec['step']}: {report['error']}")
    return report


#: A round's stream figures: the size's figure is their median over the rounds (their list beside it).
MEDIAN_KEYS = (
    "stream_seconds", "events_per_s", "cpu_us_per_event", "loop_cpu_us_per_event", "cpu_cores",
    "loop_turn_p50_ms", "loop_turn_p99_ms", "loop_turn_cpu_p50_ms", "loop_turn_cpu_p99_ms", "pod_turn_p50_ms",
    "pod_turn_p99_ms", "rss_ready_mib", "rss_after_stream_mib", "heap_objects",
)  # fmt: skip
#: ... and these their largest.
MAX_KEYS = (
    "loop_turn_max_ms", "loop_turn_cpu_max_ms", "pod_turn_max_ms", "restart_longest_hold_ms",
    "restart_longest_hold_cpu_ms", "rss_peak_mib", "stream_gc_longest_ms",
)  # fmt: skip


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _first(i: int, passes: list[dict[str, Any]]) -> bool:
    """Is pass ``i`` the first of its process (a process's passes come together, read-through last)?"""
    return i == 0 or bool(passes[i - 1]["read_through"])


def _row(size: _Size) -> dict[str, Any]:
    """A size's figures from its children's reports: the rounds' medians (their lists beside them),
    the longest holds of all rounds, every reaper pass summed up beside their list."""
    runs = size.runs
    passes = [p for run in runs for p in run["passes"]]
    usual = [p for p in passes if not p["read_through"]]
    through = [p for p in passes if p["read_through"]]
    restarts = [s for run in runs for s in run["restart_to_ready_s"]]
    return {
        "states": size.n,
        "write_seconds": size.write_s,
        **size.restored,
        **{key: _median([run[key] for run in runs]) for key in MEDIAN_KEYS},
        **{key: max(run[key] for run in runs) for key in MAX_KEYS},
        "rounds": {key: [run[key] for run in runs] for key in MEDIAN_KEYS},
        "ensures_per_round": [run["ensures"] for run in runs],
        "states_held_after": runs[-1]["states_held_after"],
        "heap_top_types": runs[-1]["heap_top_types"],
        "disk_mib": runs[-1]["disk_mib"],
        "reaper_pass_s": _median([p["seconds"] for p in usual]),
        "reaper_longest_hold_ms": max((p["longest_hold_ms"] for p in usual), default=0.0),
        "reaper_longest_hold_cpu_ms": max((p["longest_hold_cpu_ms"] for p in usual), default=0.0),
        "reaper_gc_longest_ms": max((p["gc_longest_ms"] for p in usual), default=0.0),
        "gc_longest_ms": max(
            max(run["stream_gc_longest_ms"] for run in runs), max(p["gc_longest_ms"] for p in passes)
        ),
        # A process's first pass (right after its stream) apart from the later ones: with the
        # collector's longest pause beside, whether its hold was the pass's or the collector's.
        "reaper_later_passes_longest_hold_ms": max(
            (
                p["longest_hold_ms"]
                for i, p in enumerate(passes)
                if not p["read_through"] and not _first(i, passes)
            ),
            default=0.0,
        ),
        "read_through_pass_s": _median([p["seconds"] for p in through]),
        "read_through_longest_hold_ms": max((p["longest_hold_ms"] for p in through), default=0.0),
        "read_through_longest_hold_cpu_ms": max((p["longest_hold_cpu_ms"] for p in through), default=0.0),
        "reaper_passes": passes,
        "restart_to_ready_s": _median(restarts),
        "restart_to_ready_max_s": max(restarts),
        "restart_to_ready_runs_s": restarts,
    }


async def measure_scale(args: argparse.Namespace, bootstrap: str, show: bool) -> dict[str, Any]:
    from sandbox_lanes_bench.common import delete_topics

    ctx = multiprocessing.get_context("spawn")
    sizes = [_size(args, bootstrap, n) for n in args.scale_sizes]
    try:
        for size in sizes:
            await _prepare(ctx, size, args, bootstrap, show)
        # The rounds interleaved (their order turned every other round), so a drift in the
        # machine's load hits every size alike.
        for r in range(args.scale_rounds):
            for size in sizes if r % 2 == 0 else sizes[::-1]:
                await _round(ctx, size, bootstrap, r, show)
    finally:
        for size in sizes:
            await delete_topics(bootstrap, list(size.topics.all()))
            shutil.rmtree(size.env["SANDBOX_LANES_STATE_DIR"], ignore_errors=True)
    rows: dict[str, dict[str, Any]] = {}
    for size in sizes:
        rows[str(size.n)] = _row(size)
        print(_progress_line(size.n, rows[str(size.n)]), flush=True)
    base = rows[str(sizes[0].n)]
    ratios = {
        key: {name: (row[name] / base[name] if base[name] else 0.0) for name in RATIO_KEYS}
        for key, row in rows.items()
    }
    # Each round's figure over the base's in the same round: the spread of the ratios.
    paired = {
        key: {
            name: [
                v / b if b else 0.0 for v, b in zip(row["rounds"][name], base["rounds"][name], strict=True)
            ]
            for name in PAIRED_KEYS
        }
        for key, row in rows.items()
    }
    return {
        "events": args.scale_events,
        "rounds": args.scale_rounds,
        "partitions": args.partitions,
        "listed": args.scale_listed,
        "candidates": args.scale_candidates,
        "base": sizes[0].n,
        "sizes": rows,
        "ratios": ratios,
        "ratios_by_round": paired,
        "goals": _goals(rows, ratios),
    }


def _progress_line(n: int, row: dict[str, Any]) -> str:
    return (
        f"scale {n:>10,} states: {row['events_per_s']:,.0f} events/s, "
        f"{row['cpu_us_per_event']:.0f} µs CPU per event, loop turn p99 {row['loop_turn_p99_ms']:.2f} ms "
        f"(max {row['loop_turn_max_ms']:.1f}), reaper pass {row['reaper_pass_s'] * 1000:.0f} ms "
        f"(hold {row['reaper_longest_hold_ms']:.1f} ms), read-through {row['read_through_pass_s']:.2f} s "
        f"(hold {row['read_through_longest_hold_ms']:.1f} ms), restart {row['restart_to_ready_s']:.2f} s "
        f"(hold {row['restart_longest_hold_ms']:.1f} ms)"
    )


def _goals(rows: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The issue's goals at the largest size, and whether this run met them (printed, never asserted)."""
    largest = max(rows, key=int)
    r = ratios[largest]
    holds = [
        row[k] for row in rows.values() for k in ("reaper_longest_hold_ms", "read_through_longest_hold_ms")
    ]
    return {
        "at": int(largest),
        "throughput_ratio": r["events_per_s"],
        "throughput_met": r["events_per_s"] >= GOAL_RATE_RATIO,
        "loop_p99_ratio": r["loop_turn_p99_ms"],
        "loop_p99_met": r["loop_turn_p99_ms"] <= GOAL_P99_RATIO,
        "longest_hold_ms": max(holds),
        "longest_hold_met": max(holds) < GOAL_HOLD_MS,
    }


# --- the table and the chart ------------------------------------------------------------------------


def _label(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return f"{n:,}"


def _mark(met: bool) -> str:
    return "✅" if met else "❌"


def report_rows(fig: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """This figure's rows of the run's table: (figure, median, min-max, goal). The ratios are of the
    rounds' medians; min-max is the spread of each round's ratio (the two sizes in the same round)."""
    goals = fig["goals"]
    at = _label(goals["at"])
    base = _label(fig["base"])
    by_round = (fig.get("ratios_by_round") or {}).get(str(goals["at"])) or {}

    def spread(key: str) -> str:
        values = by_round.get(key) or []
        return f"{min(values):.2f}-{max(values):.2f}" if values else ""

    cpu = fig["ratios"][str(goals["at"])]["cpu_us_per_event"]

    return [
        (f"12. scale: events/s with {at} states held / with {base}", f"{goals['throughput_ratio']:.2f}",
         spread("events_per_s"), f"{_mark(goals['throughput_met'])} ≥ 0.90"),
        (f"    process CPU per event with {at} / with {base}", f"{cpu:.2f}", spread("cpu_us_per_event"), ""),
        (f"    loop turn p99 with {at} / with {base}", f"{goals['loop_p99_ratio']:.2f}",
         spread("loop_turn_p99_ms"), f"{_mark(goals['loop_p99_met'])} ≤ 1.10"),
        ("    longest loop hold of a reaper pass, any size", f"{goals['longest_hold_ms']:.1f} ms", "",
         f"{_mark(goals['longest_hold_met'])} < 50 ms"),
    ]  # fmt: skip


#: The per-size table's rows: (label, row key, format).
TABLE = (
    ("events/s", "events_per_s", "{:,.0f}"),
    ("process CPU per event, µs", "cpu_us_per_event", "{:,.0f}"),
    ("  of it the event loop's thread, µs", "loop_cpu_us_per_event", "{:,.0f}"),
    ("loop turn p50, ms", "loop_turn_p50_ms", "{:.3f}"),
    ("loop turn p99, ms", "loop_turn_p99_ms", "{:.2f}"),
    ("loop turn max, ms", "loop_turn_max_ms", "{:.1f}"),
    ("loop turn, the loop thread's CPU, p50, ms", "loop_turn_cpu_p50_ms", "{:.3f}"),
    ("loop turn, its CPU, p99, ms", "loop_turn_cpu_p99_ms", "{:.2f}"),
    ("loop turn, its CPU, max, ms", "loop_turn_cpu_max_ms", "{:.1f}"),
    ("pod turn (fetch decided and committed) p50, ms", "pod_turn_p50_ms", "{:.1f}"),
    ("pod turn p99, ms", "pod_turn_p99_ms", "{:.1f}"),
    ("longest garbage collection, stream and passes, ms", "gc_longest_ms", "{:.1f}"),
    ("  objects the collector tracks after the stream", "heap_objects", "{:,.0f}"),
    ("reaper pass, s (median)", "reaper_pass_s", "{:.3f}"),
    ("reaper pass, longest loop hold, ms", "reaper_longest_hold_ms", "{:.2f}"),
    ("  its longest turn by the loop thread's CPU, ms", "reaper_longest_hold_cpu_ms", "{:.2f}"),
    ("  the longest garbage collection in a pass, ms", "reaper_gc_longest_ms", "{:.1f}"),
    ("  longest loop hold of a process's later passes, ms", "reaper_later_passes_longest_hold_ms", "{:.2f}"),
    ("pass reading a deleted session's references, s", "read_through_pass_s", "{:.2f}"),
    ("  its longest loop hold, ms", "read_through_longest_hold_ms", "{:.2f}"),
    ("  its longest turn by the loop thread's CPU, ms", "read_through_longest_hold_cpu_ms", "{:.2f}"),
    ("restart to ready, s (median)", "restart_to_ready_s", "{:.2f}"),
    ("restart to ready, the slowest, s", "restart_to_ready_max_s", "{:.2f}"),
    ("  its longest loop hold, ms", "restart_longest_hold_ms", "{:.1f}"),
    ("  its longest turn by the loop thread's CPU, ms", "restart_longest_hold_cpu_ms", "{:.1f}"),
    ("restore from empty, s", "restore_from_empty_s", "{:.1f}"),
    ("  then its compactions settled, s", "compaction_after_restore_s", "{:.1f}"),
    ("RSS restarted and ready, MiB", "rss_ready_mib", "{:.0f}"),
    ("RSS after the stream, MiB", "rss_after_stream_mib", "{:.0f}"),
    ("state directory, MiB", "disk_mib", "{:.0f}"),
)


def extra_lines(fig: dict[str, Any]) -> list[str]:
    """Markdown printed under the run's table: every size's figures, with the ratio to the first."""
    sizes = list(fig["sizes"])
    head = [f"{_label(int(s))} states" for s in sizes]
    lines = [
        f"12. scale: the pod on RocksDB, {fig.get('rounds', 1)} rounds of {fig['events']:,} creates per "
        f"size, {fig['partitions']} partitions: the rounds' medians, holds the longest of all "
        f"(ratio to {_label(fig['base'])} in brackets)",
        "",
        "| figure | " + " | ".join(head) + " |",
        "|---" * (len(sizes) + 1) + "|",
    ]
    for label, key, form in TABLE:
        cells = []
        for size in sizes:
            value = fig["sizes"][size].get(key)
            if value is None:
                cells.append("-")
                continue
            ratio = fig["ratios"][size].get(key)
            cells.append(
                form.format(value) + (f" ({ratio:.2f}x)" if ratio is not None and size != sizes[0] else "")
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def draw(fig: dict[str, Any], doc: Any) -> Figure | None:
    """This figure's chart (``scale.svg``): per size, events/s and CPU per event; the loop's turn
    p50/p99/max; the reaper pass's longest hold against the 50 ms goal; restart to ready."""
    from matplotlib.figure import Figure

    sizes = list(fig.get("sizes") or {})
    if not sizes:
        return None
    rows = [fig["sizes"][s] for s in sizes]
    labels = [_label(int(s)) for s in sizes]
    x = list(range(len(sizes)))
    chart = Figure(figsize=(11.0, 6.8), layout="constrained")
    (rate_ax, loop_ax), (hold_ax, restart_ax) = chart.subplots(2, 2)
    rate_ax.bar(x, [r["events_per_s"] for r in rows], color=P50_COLOR, width=0.6)
    rate_ax.set_ylabel("events/s")
    cpu_ax = rate_ax.twinx()
    cpu_ax.plot(x, [r["cpu_us_per_event"] for r in rows], color=P99_COLOR, marker="o")
    cpu_ax.set_ylabel("process CPU per event, µs", color=P99_COLOR)
    cpu_ax.set_ylim(bottom=0)
    rate_ax.set_title("throughput (bars) and CPU per event")
    for key, color, marker in (("p50", P50_COLOR, "o"), ("p99", P99_COLOR, "^"), ("max", "#57606a", "s")):
        loop_ax.plot(x, [r[f"loop_turn_{key}_ms"] for r in rows], color=color, marker=marker, label=key)
        cpu_key = f"loop_turn_cpu_{key}_ms"
        if all(cpu_key in r for r in rows) and key != "p50":
            loop_ax.plot(x, [r[cpu_key] for r in rows], color=color, marker=marker, linestyle="--",
                         fillstyle="none", label=f"{key}, the loop thread's CPU")  # fmt: skip
    loop_ax.set_yscale("log")
    loop_ax.set_ylabel("ms busy per turn of the event loop")
    loop_ax.set_title("the event loop's turns during the stream")
    loop_ax.legend(fontsize=6.5)
    width = 0.38
    hold_ax.bar([i - width / 2 for i in x], [r["reaper_longest_hold_ms"] for r in rows], width,
                color=P50_COLOR, label="reaper pass")  # fmt: skip
    hold_ax.bar([i + width / 2 for i in x], [r["read_through_longest_hold_ms"] for r in rows], width,
                color="#bf8700", label="pass with a deleted session listed")  # fmt: skip
    for offset, key in (
        (-width / 2, "reaper_longest_hold_cpu_ms"),
        (width / 2, "read_through_longest_hold_cpu_ms"),
    ):
        if all(key in r for r in rows):
            hold_ax.scatter([i + offset for i in x], [r[key] for r in rows], marker="_", s=300, color="black",
                            zorder=3, label="the loop thread's CPU" if offset < 0 else None)  # fmt: skip
    hold_ax.axhline(GOAL_HOLD_MS, color=P99_COLOR, linestyle="--", linewidth=1, label="goal: 50 ms")
    hold_ax.set_ylabel("longest loop hold, ms")
    hold_ax.set_title("a reaper pass's longest hold of the loop")
    hold_ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    medians = [r["restart_to_ready_s"] for r in rows]
    slowest = [r.get("restart_to_ready_max_s", m) for r, m in zip(rows, medians, strict=True)]
    above = [s - m for s, m in zip(slowest, medians, strict=True)]
    restart_ax.bar(x, medians, color=P50_COLOR, width=0.6, yerr=[[0.0] * len(x), above], capsize=4)
    restart_ax.set_ylabel("seconds (median; whisker: the slowest)")
    restart_ax.set_title("restart to ready (with a checkpoint)")
    for ax in (rate_ax, loop_ax, hold_ax, restart_ax):
        ax.set_xticks(x, [f"{label}\nstates" for label in labels])
        ax.grid(axis="y", alpha=0.3)
    chart.suptitle(
        f"12. the pod with the states held (RocksDB store, {fig.get('events', 0):,} creates per size)"
    )
    meta = (doc.get("meta_of") or {}).get("scale") or doc.get("meta") or {}
    machine = meta.get("machine") or {}
    where = [str(meta["started_at"])] if meta.get("started_at") else []
    if machine.get("cores"):
        where.append(f"{machine.get('cpu', '?')}, {machine['cores']} cores")
    if where:  # where the numbers come from, as the other charts say it
        chart.supxlabel(" · ".join(where)[:160], fontsize=6.5, color="#57606a")
    return chart
