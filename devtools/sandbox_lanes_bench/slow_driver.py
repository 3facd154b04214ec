"""``sandbox-lanes bench --only slow_driver``: the same job with a driver call that takes time.

Every ensure takes a seeded uniform ``--slow-latency-ms`` (default 50-300 ms). The pod (exactly_once)
makes it through the memory driver (``ensure_latency_ms`` = the low end, ``latency_jitter_ms`` = the
span, the seed: as figure 7 configures it) at its default driver concurrency, outside any
transaction; Quix Streams and the plain confluent-kafka pipe (exactly-once, default cadence) make it
inline, a blocking wait of the same seeded draws per record, as their idiom has it. ``--slow-events``
inputs are produced at once (after ``--latency-prime`` whose outcomes are awaited first) and each
system's events/s is the time until the last outcome is readable with read_committed; a system that
has not finished after ``--slow-timeout-s`` reports the rate it reached (outcomes readable / time).
"""

from __future__ import annotations

import argparse
import logging
import uuid
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.cells import cells
from sandbox_lanes_bench.common import delete_topics, lane_env, memory_provisioner, pct, summary
from sandbox_lanes_bench.latency import latency_run
from sandbox_lanes_bench.peers_figure import SYSTEMS as PEER_SYSTEMS
from sandbox_lanes_bench.peers_figure import installed, peer_internal_topics
from sandbox_lanes_bench.peers_latency import running_system

logger = logging.getLogger("sandbox_lanes.bench")

SYSTEMS: tuple[tuple[str, str | None], ...] = tuple(
    (system, module)
    for system, guarantee, module in PEER_SYSTEMS
    if guarantee == "exactly_once" and system in ("pod", "quix", "confluent")
)
LABELS = {
    "pod": "this pod, exactly_once (memory driver, driver concurrency {concurrency})",
    "quix": "Quix Streams, exactly-once (the call inline)",
    "confluent": "plain confluent-kafka pipe, KIP-447 (the call inline)",
}


def latency_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    lo, hi = float(low), float(high or low)
    if lo < 0 or hi < lo:
        raise argparse.ArgumentTypeError(f"--slow-latency-ms wants LOW,HIGH with 0 <= LOW <= HIGH: {text!r}")
    return lo, hi


async def measure_slow_driver(args: argparse.Namespace, bootstrap: str, show: bool) -> dict[str, Any]:
    from consumers.ops.settings import load_settings

    low, high = args.slow_latency_ms
    n, seed, timeout = args.slow_events, args.slow_seed, args.slow_timeout_s
    missing = sorted(s for s, _ in SYSTEMS if not installed(s))
    systems = [(s, m) for s, m in SYSTEMS if s not in missing]
    runs: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    # the pod's as configured by default (running_system sets no SANDBOX_LANES_DRIVER_CONCURRENCY)
    concurrency = load_settings(lane_env(bootstrap, "slow", 1, "exactly_once")).driver_concurrency
    tag = f"bench-slow-{uuid.uuid4().hex[:6]}"
    created: list[str] = []
    try:
        with progress(f"slow driver ({low:.0f}-{high:.0f} ms per ensure)", args.repeats * len(systems),
                      enabled=show) as bar:  # fmt: skip
            for r in range(args.repeats):
                for system, module in systems:  # interleaved, as figure 8
                    provisioner = memory_provisioner(
                        ensure_latency_ms=low, latency_jitter_ms=high - low, seed=seed
                    )
                    extra = ("--ensure-latency-ms", f"{low},{high}", "--seed", str(seed))
                    try:
                        async with running_system(system, module, bootstrap, f"{tag}-{r}", args.partitions,
                                                  args.max_batch, created, provisioner,
                                                  extra) as (source, sink, alive):  # fmt: skip
                            result = await latency_run(bootstrap, source, sink, ([0.0] * n, 0),
                                                       prime=args.latency_prime, drain_s=timeout,
                                                       bare=module is not None)  # fmt: skip
                            alive()
                    except Exception as exc:  # one system's failure is its row, not the figure's
                        logger.error("slow driver failed", extra={"system": system, "error": str(exc)})
                        errors.setdefault(system, f"{type(exc).__name__}: {exc}"[-600:])
                        bar.advance()
                        continue
                    runs.setdefault(system, []).append(result)
                    bar.advance()
    finally:
        await delete_topics(bootstrap, created + await peer_internal_topics(bootstrap, tag))
    figures: dict[str, Any] = {}
    for system, results in runs.items():
        rates = [_rate(res, n) for res in results]
        figures[system] = {
            "events_per_s": summary(rates),
            "readable": [res["received"] for res in results],
            "finished": all(res["received"] >= n for res in results),
            "seconds": summary([_seconds(res, n) for res in results]),
            "time_to_outcome_p50_ms": summary([pct(res["latencies_ms"], 50) for res in results]),
            "time_to_outcome_p99_ms": summary([pct(res["latencies_ms"], 99) for res in results]),
        }
    out: dict[str, Any] = {
        "events": n,
        "partitions": args.partitions,
        "latency_ms": [low, high],
        "seed": seed,
        "timeout_s": timeout,
        "pod_driver_concurrency": concurrency,
        "systems": figures,
        "not_installed": missing,
        "errors": errors,
    }
    if "pod" in runs and "quix" in runs and len(runs["pod"]) == len(runs["quix"]):
        out["ratio_pod_quix"] = summary(
            [_rate(p, n) / max(_rate(q, n), 1e-9) for p, q in zip(runs["pod"], runs["quix"], strict=True)]
        )
    return out


def _seconds(result: dict[str, Any], n: int) -> float:
    """Until the last outcome was readable, or the whole wait when some never were."""
    if result["received"] >= n:
        return float(result["last_outcome_s"])
    return float(result["offered_seconds"]) + float(result["waited_s"])


def _rate(result: dict[str, Any], n: int) -> float:
    return float(result["received"]) / max(_seconds(result, n), 1e-3)


def report_rows(fig: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    first = True
    n = fig["events"]
    for system, _ in SYSTEMS:
        s = fig["systems"].get(system)
        if s is None:
            continue
        low, high = fig["latency_ms"]
        head = f"11. slow driver ({n:,} events, {low:.0f}-{high:.0f} ms per ensure): " if first else "    "
        first = False
        label = LABELS[system].format(concurrency=fig["pod_driver_concurrency"])
        if s["finished"]:
            note = f"all {n} readable after {s['seconds']['median']:.1f} s"
        else:
            note = (f"timed out: {min(s['readable'])}-{max(s['readable'])} of {n} readable after "
                    f"{s['seconds']['median']:.0f} s (the rate reached)")  # fmt: skip
        median, spread = cells(s["events_per_s"])
        rows.append((f"{head}{label}, events/s", median, f"{spread}; {note}", ""))
    ratio = fig.get("ratio_pod_quix")
    if ratio is not None:
        rows.append(("    pod / Quix Streams (events/s)", *cells(ratio), ""))
    for system, error in fig.get("errors", {}).items():
        rows.append((f"    slow driver, {system}", "error", error[:160], ""))
    if fig["not_installed"]:
        rows.append(("    not installed (the [bench] extra)", ", ".join(fig["not_installed"]), "", ""))
    return rows
