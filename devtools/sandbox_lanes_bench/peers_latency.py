"""``sandbox-lanes bench --only peers_latency``: the latency lead, measured side by side.

For the pod (exactly_once) and each exactly-once peer of figure 8, at its own default commit
cadence: the time from produce to the outcome readable with read_committed (figure 3's load and
collector, ``bench.latency``: a child process offers the load and matches each outcome to its input
by the outcome's causation id, the input's event id), p50 and p99,

* at half of the system's own throughput (figure 8's events/s: from figure 8 of the same run, else
  measured here with figure 8's machinery, one run each; ``--latency-rates system=rate,...`` sets
  them instead), and
* one event at a time: events 50-100 ms apart (seeded), the floor before any load.

Each system consumes a fresh input topic; ``--latency-prime`` inputs go first and the load starts
once their outcomes are readable, so start-up and the first rebalance are out of every figure alike.
The goal row: the pod's p99 at half rate below Quix's p50 at half rate.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.cells import fmt
from sandbox_lanes_bench.common import create_topic, create_topics, delete_topics, lane_env, running_pod
from sandbox_lanes_bench.latency import latency_run, latency_summary, paced, spaced
from sandbox_lanes_bench.peers_figure import CHANGELOG_CONFIG, installed, peer_internal_topics, peer_process
from sandbox_lanes_bench.peers_figure import SYSTEMS as PEER_SYSTEMS

logger = logging.getLogger("sandbox_lanes.bench")

#: The exactly-once systems, in figure 8's order, with each one's module (None: the pod, in process).
SYSTEMS: tuple[tuple[str, str | None], ...] = tuple(
    (system, module)
    for system, guarantee, module in PEER_SYSTEMS
    if guarantee == "exactly_once" and system != "pod-rules-confluent"
)
#: What decides when a system's outcomes become readable: each at its default.
CADENCE = {
    "pod": "a transaction per turn (one fetch), no timer",
    "quix": "commit_interval 5 s (default)",
    "faust": "broker_commit_interval 2.8 s (default)",
    "confluent": "a transaction per consume() batch (up to 500 records, 0.2 s timeout)",
}
FLOOR_GAP_MS = (50.0, 100.0)


def parse_rates(text: str) -> dict[str, float]:
    """``pod=1500,quix=3000`` → {"pod": 1500.0, "quix": 3000.0} (events/s each system sustains)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in {s for s, _ in SYSTEMS} or float(value) <= 0:
            known = ", ".join(s for s, _ in SYSTEMS)
            raise argparse.ArgumentTypeError(f"--latency-rates wants system=events/s ({known}): {part!r}")
        out[name] = float(value)
    return out


async def _throughputs(
    args: argparse.Namespace, bootstrap: str, show: bool, peers: dict[str, Any] | None
) -> tuple[dict[str, float], dict[str, str]]:
    """Each system's events/s and where it came from: --latency-rates, figure 8 of this run, or
    figure 8's machinery run here (one run per system)."""
    from sandbox_lanes_bench.peers_figure import measure_peers

    rates: dict[str, float] = dict(args.latency_rates)
    source = {name: "--latency-rates" for name in rates}
    if peers is not None and "events_per_s" in peers:
        for name, _ in SYSTEMS:
            fig = peers["events_per_s"].get(f"{name}.exactly_once")
            if name not in rates and fig is not None:
                rates[name] = fig["median"]
                source[name] = "figure 8 of this run"
    wanted = tuple(
        s for s in PEER_SYSTEMS if s[1] == "exactly_once" and s[0] in dict(SYSTEMS) and s[0] not in rates
    )
    if wanted:
        measured = await measure_peers(
            argparse.Namespace(**{**vars(args), "repeats": 1}), bootstrap, show, wanted
        )
        for name, _ in SYSTEMS:
            fig = measured["events_per_s"].get(f"{name}.exactly_once")
            if name not in rates and fig is not None:
                rates[name] = fig["median"]
                source[name] = f"measured here ({measured['events']:,} events, figure 8's machinery)"
    return rates, source


@contextlib.asynccontextmanager
async def running_system(
    system: str, module: str | None, bootstrap: str, tag: str, partitions: int, max_batch: int,
    created: list[str], provisioner: Any = None, extra: tuple[str, ...] = (),
) -> AsyncIterator[tuple[str, str, Callable[[], None]]]:  # fmt: skip
    """The system (exactly_once) running on fresh topics for the block: (input topic, outcome topic,
    ``alive()``). The pod runs in this process (the memory driver unless given ``provisioner``)."""
    if module is None:
        from consumers.ops.settings import load_settings

        env = lane_env(bootstrap, f"{tag}-pod", partitions, "exactly_once")
        topics = load_settings(env).topics
        created.extend(topics.all())
        await create_topics(bootstrap, topics, partitions)
        async with running_pod(env, max_batch, provisioner=provisioner):
            yield topics.execution_created, topics.outcomes, lambda: None
        return
    source, sink, group = f"{tag}.{system}.in", f"{tag}.{system}.out", f"{tag}-{system}"
    for topic in (source, sink):
        created.append(topic)
        await create_topic(bootstrap, topic, partitions)
    if system in ("confluent", "pod-rules-confluent"):
        created.append(f"{group}-changelog")
        await create_topic(bootstrap, f"{group}-changelog", partitions, CHANGELOG_CONFIG)
    async with peer_process(module, bootstrap, source, sink, group, "exactly_once", partitions,
                            extra=extra) as alive:  # fmt: skip
        yield source, sink, alive


async def measure_peers_latency(
    args: argparse.Namespace, bootstrap: str, show: bool, peers: dict[str, Any] | None = None
) -> dict[str, Any]:
    rates, rate_source = await _throughputs(args, bootstrap, show, peers)
    missing = sorted(s for s, _ in SYSTEMS if not installed(s))
    systems = [(s, m) for s, m in SYSTEMS if s not in missing]
    half: dict[str, Any] = {}
    floor: dict[str, Any] = {}
    errors: dict[str, str] = {}
    tag = f"bench-plat-{uuid.uuid4().hex[:6]}"
    created: list[str] = []
    try:
        with progress("latency, pod and peers", len(systems) * (args.repeats + 1), enabled=show) as bar:
            for system, module in systems:
                if rates.get(system, 0.0) <= 0:
                    errors[system] = "no throughput to halve (its figure 8 run failed)"
                    bar.advance(args.repeats + 1)
                    continue
                rate = rates[system] / 2
                try:
                    async with running_system(system, module, bootstrap, tag, args.partitions,
                                              args.max_batch, created) as (source, sink, alive):  # fmt: skip
                        runs = []
                        for r in range(args.repeats):
                            schedule = paced(rate, args.latency_seconds, args.latency_warmup)
                            runs.append(await _checked(alive, latency_run(
                                bootstrap, source, sink, schedule, prime=args.latency_prime if r == 0 else 0,
                                bare=module is not None,
                            )))  # fmt: skip
                            bar.advance()
                        half[system] = {"offered_rate": rate, **latency_summary(runs)}
                        schedule = spaced(FLOOR_GAP_MS, args.latency_floor_seconds, seed=28)
                        bare = module is not None
                        one = await _checked(alive, latency_run(bootstrap, source, sink, schedule, bare=bare))
                        floor[system] = latency_summary([one])
                        bar.advance()
                except Exception as exc:  # one system's failure is its row, not the figure's
                    logger.error("peers latency failed", extra={"system": system, "error": str(exc)})
                    errors[system] = f"{type(exc).__name__}: {exc}"[-600:]
    finally:
        await delete_topics(bootstrap, created + await peer_internal_topics(bootstrap, tag))
    out: dict[str, Any] = {
        "partitions": args.partitions,
        "seconds_per_run": args.latency_seconds,
        "floor_seconds": args.latency_floor_seconds,
        "floor_gap_ms": list(FLOOR_GAP_MS),
        "throughput": rates,
        "throughput_from": rate_source,
        "cadence": {s: CADENCE[s] for s, _ in systems},
        "half_rate": half,
        "floor": floor,
        "not_installed": missing,
        "errors": errors,
    }
    if "pod" in half and "quix" in half:
        pod_p99, quix_p50 = half["pod"]["p99_ms"]["median"], half["quix"]["p50_ms"]["median"]
        out["goal"] = {"pod_p99_ms": pod_p99, "quix_p50_ms": quix_p50, "met": pod_p99 < quix_p50}
    return out


async def _checked(alive: Callable[[], None], run: Any) -> dict[str, Any]:
    """The run's result; a system that exited meanwhile raises with its own output instead."""
    try:
        result: dict[str, Any] = await run
    except Exception:
        alive()
        raise
    alive()
    return result


LABELS = {
    "pod": "this pod, exactly_once",
    "quix": "Quix Streams, exactly-once",
    "faust": "faust-streaming, exactly_once",
    "confluent": "plain confluent-kafka pipe, KIP-447",
}


def report_rows(fig: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    first = True
    for system, _ in SYSTEMS:
        half, floor = fig["half_rate"].get(system), fig["floor"].get(system)
        if half is None or floor is None:
            continue
        head = "10. produce -> outcome readable (read_committed), p50 / p99: " if first else "    "
        first = False
        lost = f", {half['lost'] + floor['lost']} lost" if half["lost"] or floor["lost"] else ""
        p99 = half["p99_ms"]
        rate, own = half["offered_rate"], fig["throughput"][system]
        rows.append((
            f"{head}{LABELS[system]} at {rate:,.0f}/s (half its {own:,.0f}/s)",
            f"{fmt(half['p50_ms']['median'], ' ms')} / {fmt(p99['median'], ' ms')}",
            f"p99 {fmt(p99['min'], ' ms')}-{fmt(p99['max'], ' ms')}; {fig['cadence'][system]}{lost}",
            "",
        ))  # fmt: skip
        low, high = fig["floor_gap_ms"]
        rows.append((
            f"    {LABELS[system]}, one event at a time ({low:.0f}-{high:.0f} ms apart)",
            f"{fmt(floor['p50_ms']['median'], ' ms')} / {fmt(floor['p99_ms']['median'], ' ms')}",
            f"{floor['samples']} events",
            "",
        ))  # fmt: skip
    goal = fig.get("goal")
    if goal is not None:
        rows.append((
            "    pod p99 at half rate vs Quix p50 at half rate",
            f"{fmt(goal['pod_p99_ms'], ' ms')} vs {fmt(goal['quix_p50_ms'], ' ms')}",
            "",
            f"pod p99 < Quix p50 {'met' if goal['met'] else 'MISSED'}",
        ))  # fmt: skip
    for system, error in fig.get("errors", {}).items():
        rows.append((f"    latency, {system}", "error", error[:160], ""))
    if fig["not_installed"]:
        rows.append(("    not installed (the [bench] extra)", ", ".join(fig["not_installed"]), "", ""))
    return rows
