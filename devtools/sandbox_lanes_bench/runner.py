"""The bench's arguments and its run: which figures, the broker, the JSON, the table."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandbox_lanes_bench.common import FIGURES, OPT_IN, STATE_COMPRESSION, machine, versions
from sandbox_lanes_bench.drivers import measure_drivers
from sandbox_lanes_bench.latency import measure_latency
from sandbox_lanes_bench.restore import measure_restore
from sandbox_lanes_bench.rules import measure_rules
from sandbox_lanes_bench.table import render_table
from sandbox_lanes_bench.throughput import measure_throughput

logger = logging.getLogger("sandbox_lanes.bench")


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


def _sizes_one(text: str) -> int:
    return _sizes(text)[0]


def _latency_rates(text: str) -> dict[str, float]:
    from sandbox_lanes_bench.peers_latency import parse_rates

    return parse_rates(text)


def _latency_range(text: str) -> tuple[float, float]:
    from sandbox_lanes_bench.slow_driver import latency_range

    return latency_range(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", help="use this Kafka instead of starting a fresh Apache Kafka broker")
    parser.add_argument("--out", default="bench-results.json", help="JSON results file")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median and min-max)")
    parser.add_argument("--events", type=int, default=20_000, help="input events per ceiling/pod run")
    parser.add_argument("--partitions", type=int, default=3, help="partitions of every bench topic")
    parser.add_argument("--max-batch", type=int, default=500, help="records per getmany (pod and pipe)")
    parser.add_argument("--peer-events", type=int, default=20_000, help="input events per pod/peer run")
    parser.add_argument("--latency-load", type=float, default=0.5, help="offered load x pod throughput")
    parser.add_argument("--latency-rate", type=float, default=0.0, help="offered events/s (overrides load)")
    parser.add_argument(
        "--latency-guarantees",
        default="exactly_once,at_least_once",
        help="processing guarantees to measure latency under (comma-separated)",
    )
    parser.add_argument("--latency-seconds", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--latency-warmup", type=float, default=1.0, help="seconds discarded per run")
    parser.add_argument(
        "--latency-rates",
        type=_latency_rates,
        default={},
        help="peers_latency: system=events/s,... to halve (pod, quix, faust, confluent) instead of measuring",
    )
    parser.add_argument(
        "--latency-floor-seconds", type=float, default=15.0, help="peers_latency: one-at-a-time seconds"
    )
    parser.add_argument(
        "--latency-prime",
        type=int,
        default=6,
        help="peers_latency/slow_driver: inputs awaited before the load",
    )
    parser.add_argument(
        "--slow-latency-ms",
        type=_latency_range,
        default=(50.0, 300.0),
        help="slow_driver: LOW,HIGH per ensure",
    )
    parser.add_argument("--slow-seed", type=int, default=28, help="slow_driver: seed of the latency draws")
    parser.add_argument("--slow-events", type=int, default=400, help="slow_driver: inputs per system")
    parser.add_argument(
        "--slow-timeout-s",
        type=float,
        default=60.0,
        help="slow_driver: seconds before the rate reached is taken",
    )
    parser.add_argument("--rules-events", type=int, default=200_000, help="events per pure-rules run")
    parser.add_argument(
        "--restore-sizes", type=_sizes, default=[10_000, 100_000, 1_000_000], help="e.g. 10k,100k,1m"
    )
    parser.add_argument("--driver-samples", type=int, default=20, help="sandboxes per local-process run")
    parser.add_argument("--docker-samples", type=int, default=5, help="containers per docker run")
    parser.add_argument("--burst-n", type=int, default=2000, help="creates per memory-driver burst (0: skip)")
    parser.add_argument("--burst-docker-n", type=int, default=200, help="creates per docker burst (0: skip)")
    parser.add_argument("--burst-latency-ms", type=float, default=200.0, help="memory driver ms per call")
    parser.add_argument("--burst-concurrency", type=int, default=32, help="driver concurrency in a burst")
    parser.add_argument(
        "--burst-k8s-n", type=int, default=50, help="creates per kubernetes burst (0: skip kubernetes)"
    )
    parser.add_argument(
        "--kubeconfig", help="run the kubernetes burst on this cluster instead of a private single-node one"
    )
    parser.add_argument(
        "--no-burst-agent-sandbox",
        dest="burst_agent_sandbox",
        action="store_false",
        help="skip the agent-sandbox cold and warm bursts after the kubernetes one",
    )
    parser.add_argument(
        "--runner-image", default="", help="runner image for --kubeconfig (must run the runner contract)"
    )
    parser.add_argument(
        "--burst-kube",
        default="kubernetes,agent-sandbox-cold,agent-sandbox-warm",
        help="which cluster bursts to run (comma-separated subset of the default)",
    )
    parser.add_argument(
        "--retention-waves", type=int, default=3, help="waves of executions per retention run"
    )
    parser.add_argument(
        "--retention-wave-size", type=_sizes_one, default=10_000, help="executions per retention wave"
    )
    parser.add_argument(
        "--retention-seconds", type=int, default=2, help="SANDBOX_LANES_STATE_RETENTION_S of the short run"
    )
    from sandbox_lanes_bench import scale, soak

    scale.add_arguments(parser)
    soak.add_arguments(parser)
    parser.add_argument("--docker-host", help="use this engine (unix://...) instead of a private dockerd")
    parser.add_argument("--docker-image", default="", help="image on --docker-host (default: busybox tag)")
    parser.add_argument(
        "--only",
        default=",".join(f for f in FIGURES if f not in OPT_IN),
        help=f"comma-separated subset of {','.join(FIGURES)} (default: all but {', '.join(OPT_IN)})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--plots",
        metavar="DIR",
        help="where the run writes its figures as SVG plots (default: beside --out, <out stem>-plots/)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write no plots after the run")
    parser.add_argument(
        "--plots-from",
        nargs="+",
        metavar="JSON",
        help="measure nothing: draw the plots of these saved --out files (figures merged, a later "
        "file's figure replacing an earlier one's) into --plots DIR",
    )


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
        await timed("rules", lambda: asyncio.to_thread(measure_rules, args, show))
    if bootstrap is not None:
        if "ceiling" in only or "pod" in only or ("latency" in only and not args.latency_rate):
            await timed("throughput", lambda: measure_throughput(args, bootstrap, show))
        if "latency" in only:
            pod_rate = 0.0
            with contextlib.suppress(KeyError, TypeError):
                pod_rate = figures["throughput"]["pod"]["exactly_once_events_per_s"]["median"]
            if pod_rate <= 0 and not args.latency_rate:
                figures["latency"] = {"error": "no pod throughput to derive the offered load from"}
            else:
                for guarantee in [g.strip() for g in args.latency_guarantees.split(",") if g.strip()]:
                    name = "latency" if guarantee == "exactly_once" else f"latency_{guarantee}"
                    await timed(
                        name, functools.partial(measure_latency, args, bootstrap, pod_rate, show, guarantee)
                    )
        if "peers" in only:
            from sandbox_lanes_bench.peers_figure import measure_peers

            await timed("peers", lambda: measure_peers(args, bootstrap, show))
        if "peers_latency" in only:
            from sandbox_lanes_bench.peers_latency import measure_peers_latency

            await timed(
                "peers_latency", lambda: measure_peers_latency(args, bootstrap, show, figures.get("peers"))
            )
        if "slow_driver" in only:
            from sandbox_lanes_bench.slow_driver import measure_slow_driver

            await timed("slow_driver", lambda: measure_slow_driver(args, bootstrap, show))
        if "restore" in only:
            await timed("restore", lambda: measure_restore(args, bootstrap, show))
            from sandbox_lanes_bench.peers_restore import measure_quix_restore

            await timed("restore_quix", lambda: measure_quix_restore(args, bootstrap, show))
        if "burst" in only:
            from sandbox_lanes_bench.burst import measure_burst

            await timed("burst", lambda: measure_burst(args, bootstrap, show))
        if "retention" in only:
            from sandbox_lanes_bench.retention import measure_retention

            await timed("retention", lambda: measure_retention(args, bootstrap, show))
        if "scale" in only:
            from sandbox_lanes_bench.scale import measure_scale

            await timed("scale", lambda: measure_scale(args, bootstrap, show))
    if "soak" in only:  # its own three-node cluster: it bounces brokers
        from sandbox_lanes_bench.soak import measure_soak

        await timed("soak", lambda: measure_soak(args, show))
    if "drivers" in only:
        await timed("drivers", lambda: measure_drivers(args, show))
    return {"figures": figures, "seconds": timings}


def run(args: argparse.Namespace) -> int:
    from consumers.ops.logs import setup_logging

    # The pod's per-decision info lines are not what is measured: warning unless asked (--log-level).
    level = getattr(args, "log_level", None)
    setup_logging(level if level not in (None, "info") else "warning")
    if getattr(args, "plots_from", None):
        return _plots_only(args.plots_from, getattr(args, "plots", None))
    only = {f.strip() for f in args.only.split(",") if f.strip()}
    unknown = only - set(FIGURES)
    if unknown:
        print(f"sandbox-lanes bench: unknown figure(s) {sorted(unknown)}; known: {FIGURES}", file=sys.stderr)
        return 2
    needs_kafka = bool(
        only
        & {
            "ceiling",
            "pod",
            "latency",
            "peers",
            "restore",
            "burst",
            "retention",
            "peers_latency",
            "slow_driver",
            "scale",
        }
    )
    # SIGTERM takes Ctrl-C's path: the running figure is cancelled and everything it started (its
    # broker, node, controller, pods, topics) is stopped on the way out instead of left running.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(args, only, needs_kafka)
    except KeyboardInterrupt:
        print("sandbox-lanes bench: interrupted; what it started is stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(args: argparse.Namespace, only: set[str], needs_kafka: bool) -> int:
    began = time.perf_counter()
    meta: dict[str, Any] = {
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "sandbox-lanes bench " + " ".join(_argv_of(args)),
        "machine": machine(),
        "versions": versions(),
        "state_compression": STATE_COMPRESSION,
    }
    broker = None
    bootstrap = args.bootstrap
    if needs_kafka and bootstrap is None:
        from harness.kafka_broker import DEFAULT_JVM_OPTS, KAFKA_VERSION, KafkaBroker

        broker = KafkaBroker()
        print("starting Apache Kafka for the bench …", file=sys.stderr)
        broker.start()
        bootstrap = broker.bootstrap
        jvm = os.environ.get("SANDBOX_LANES_KAFKA_JVM_OPTS", "").split() or list(DEFAULT_JVM_OPTS)
        meta["broker"] = {
            "kind": f"Apache Kafka {KAFKA_VERSION} (KRaft, single node, devtools/harness/kafka_broker.py)",
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
    if getattr(args, "no_plots", False):
        return 0
    return _write_plots(doc, Path(args.plots) if getattr(args, "plots", None) else plots_dir_of(args.out))


# --- plots --------------------------------------------------------------------------------------


def plots_dir_of(out: str) -> Path:
    """Where a run's plots go by default: beside its JSON, ``<out stem>-plots/``."""
    path = Path(out)
    return path.with_name(f"{path.stem}-plots")


def _write_plots(doc: dict[str, Any], directory: Path) -> int:
    try:
        from sandbox_lanes_bench.plots import render
    except ImportError as exc:  # matplotlib is a dependency of the dev tools' distribution (devtools/)
        print(f"plots: not drawn ({exc}; reinstall the dev tools: pip install -e devtools)", file=sys.stderr)
        return 0
    written = render(doc, directory)
    print(f"plots: {', '.join(str(p) for p in written) if written else 'none (no figure to draw)'}")
    return 0


def _plots_only(sources: list[str], directory: str | None) -> int:
    """``--plots-from``: the plots of saved runs, nothing measured."""
    from sandbox_lanes_bench.plots import load, render

    missing = [s for s in sources if not Path(s).is_file()]
    if missing:
        print(f"sandbox-lanes bench: no such file {missing}", file=sys.stderr)
        return 2
    target = Path(directory) if directory else plots_dir_of(sources[0])
    written = render(load([Path(s) for s in sources]), target)
    print(f"plots: {', '.join(str(p) for p in written) if written else 'none (no figure to draw)'}")
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
    if "retention" in args.only:
        out.append(
            f"--retention-waves {args.retention_waves} --retention-wave-size {args.retention_wave_size} "
            f"--retention-seconds {args.retention_seconds}"
        )
    if "peers_latency" in args.only:
        rates = ",".join(f"{k}={v:g}" for k, v in args.latency_rates.items())
        out.append(
            f"--latency-seconds {args.latency_seconds:g} --latency-warmup {args.latency_warmup:g} "
            f"--latency-floor-seconds {args.latency_floor_seconds:g} --latency-prime {args.latency_prime}"
            + (f" --latency-rates {rates}" if rates else f" --peer-events {args.peer_events}")
        )
    if "scale" in args.only:
        from sandbox_lanes_bench.scale import argv_of as scale_argv

        out.extend(scale_argv(args))
    if "soak" in args.only:
        from sandbox_lanes_bench.soak import argv_of as soak_argv

        out.extend(soak_argv(args))
    if "slow_driver" in args.only:
        low, high = args.slow_latency_ms
        out.append(
            f"--slow-events {args.slow_events} --slow-latency-ms {low:g},{high:g} "
            f"--slow-seed {args.slow_seed} --slow-timeout-s {args.slow_timeout_s:g}"
        )
    return out
