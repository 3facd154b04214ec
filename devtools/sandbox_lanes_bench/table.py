"""The markdown table of a bench run."""

from __future__ import annotations

import importlib
import logging
from typing import Any

from sandbox_lanes_bench.cells import cells, fmt, goal
from sandbox_lanes_bench.common import GOALS

logger = logging.getLogger("sandbox_lanes.bench")


# --- the table ----------------------------------------------------------------------------------


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
                         *cells(c["plain_pipe_events_per_s"]), ""))  # fmt: skip
            rows.append(("   pipe with the pod's write shape (EOS txn, 2 writes/event), events/s",
                         *cells(c["eos_pipe_2_writes_events_per_s"]), ""))  # fmt: skip
            rows.append(("2. pod, memory driver, exactly_once, events/s",
                         *cells(p["exactly_once_events_per_s"]), ""))  # fmt: skip
            ratio = p["ratio_exactly_once"]
            rows.append(("   pod / ceiling (exactly_once)", *cells(ratio),
                         goal(ratio["median"] >= GOALS["pod_ratio"], "≥ 0.5")))  # fmt: skip
            rows.append(("   pod, at_least_once, events/s", *cells(p["at_least_once_events_per_s"]), ""))
            rows.append(("   pod / ceiling (at_least_once)", *cells(p["ratio_at_least_once"]), ""))
            rows.append(("   pod / EOS pipe with the same write shape",
                         *cells(p["ratio_exactly_once_vs_eos_pipe"]), ""))  # fmt: skip
            for guarantee in ("exactly_once", "at_least_once"):
                key = f"{guarantee}_loop_cpu_us_per_event"
                if key in p:
                    rows.append((f"   pod, {guarantee}: event loop CPU per event, µs", *cells(p[key]), ""))
    for lat in (figs.get("latency"), figs.get("latency_at_least_once")):
        if lat is None:
            continue
        if "error" in lat:
            err("3. latency", lat)
        else:
            load = lat["load_fraction_of_pod"]
            head = f"3. e2e latency, {lat['guarantee']}, {lat['offered_rate']:,.0f}/s ({load:.0%} of pod)"
            rows.append((f"{head}, p50", *cells(lat["p50_ms"], " ms"), ""))
            rows.append(("   p95", *cells(lat["p95_ms"], " ms"), ""))
            p99 = lat["p99_ms"]
            rows.append(("   p99", *cells(p99, " ms"),
                         goal(p99["median"] < GOALS["latency_p99_ms"], "< 50 ms")))  # fmt: skip
    rules = figs.get("rules")
    if rules is not None:
        if "error" in rules:
            err("4. rules", rules)
        else:
            r = rules["decisions_per_s_per_core"]
            rows.append(("4. pure rules (decide + complete), events/s per core", *cells(r),
                         goal(r["median"] >= GOALS["rules_per_core"], "≥ 200k")))  # fmt: skip
            alone = rules["decide_only_per_s_per_core"]
            rows.append(("   decide() alone, decisions/s per core", *cells(alone), ""))
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
                    goal_t = goal(fig["seconds"]["median"] < GOALS["restore_1m_seconds"], "< 60 s")
                    goal_m = goal(fig["rss_peak_mib"]["median"] < GOALS["restore_1m_rss_mib"], "< 1 GiB")
                rows.append((f"5. restore {label} executions, seconds", *cells(fig["seconds"], " s"), goal_t))
                rows.append((f"   restore {label}, records/s", *cells(fig["records_per_s"]), ""))
                rows.append((f"   restore {label}, peak RSS", *cells(fig["rss_peak_mib"], " MiB"), goal_m))
                rows.extend(_quix_restore_rows(figs.get("restore_quix"), size, label))
    drv = figs.get("drivers")
    if drv is not None:
        for name, fig in drv.items():
            if "error" in fig:
                err(f"6. {name}", fig)
                continue
            for op, label in (("ensure", f"6. {name} ensure"), ("re_ensure", f"   {name} re-ensure")):
                p50, p99 = fmt(fig[f"{op}_p50_ms"], " ms"), fmt(fig[f"{op}_p99_ms"], " ms")
                rows.append((f"{label} p50 / p99 ({fig['samples']} sandboxes)", f"{p50} / {p99}", "", ""))
    peers = figs.get("peers")
    if peers is not None:
        if "error" in peers:
            err("8. peers", peers)
        else:
            from sandbox_lanes_bench.peers_figure import report_rows as peer_rows

            rows.extend(peer_rows(peers))
    for key, title, module in (
        ("peers_latency", "10. peers latency", "peers_latency"),
        ("slow_driver", "11. slow driver", "slow_driver"),
    ):
        fig = figs.get(key)
        if fig is None:
            continue
        if "error" in fig:
            err(title, fig)
        elif module == "peers_latency":
            from sandbox_lanes_bench.peers_latency import report_rows as latency_rows

            rows.extend(latency_rows(fig))
        else:
            from sandbox_lanes_bench.slow_driver import report_rows as slow_rows

            rows.extend(slow_rows(fig))
    burst = figs.get("burst")
    if burst is not None:
        if "error" in burst:
            err("7. burst", burst)
        else:
            from sandbox_lanes_bench.burst import report_rows

            rows.extend(report_rows(burst))
    retention = figs.get("retention")
    if retention is not None:
        if "error" in retention:
            err("9. retention", retention)
        else:
            from sandbox_lanes_bench.retention import report_rows as retention_rows

            rows.extend(retention_rows(retention))
    extra: list[str] = []
    for name in ("scale", "soak"):
        fig = figs.get(name)
        if fig is None:
            continue
        if "error" in fig:
            err(name, fig)
            continue
        figure_module = importlib.import_module(f"sandbox_lanes_bench.{name}")
        rows.extend(figure_module.report_rows(fig))
        extra += figure_module.extra_lines(fig)
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
    if retention is not None and "error" not in retention:
        from sandbox_lanes_bench.retention import wave_table

        lines += ["", *wave_table(retention)]
    if extra:
        lines += ["", *extra]
    return "\n".join(lines)


def _quix_restore_rows(quix: dict[str, Any] | None, size: str, label: str) -> list[tuple[str, str, str, str]]:
    """Quix Streams restoring the same number of keys, under the pod's rows of that size."""
    if quix is None:
        return []
    if "error" in quix:
        return [(f"   Quix Streams restore {label}", "error", str(quix["error"])[:160], "")]
    fig = quix["sizes"].get(size)
    if fig is None:
        return []
    return [
        (f"   Quix Streams restore {label} keys (RocksDB), seconds", *cells(fig["seconds"], " s"), ""),
        (f"   Quix Streams restore {label}, records/s", *cells(fig["records_per_s"]), ""),
        (f"   Quix Streams restore {label}, peak RSS", *cells(fig["rss_peak_mib"], " MiB"), ""),
    ]
