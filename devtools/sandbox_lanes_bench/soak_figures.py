"""The soak's figures from its samples (pure: the run's JSON in, figures, table rows and chart out).

See :mod:`sandbox_lanes_bench.soak` for what is sampled and how.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sandbox_lanes_bench.common import pct

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The resources whose slope after the warm-up is the figure: flat, or growing with the time run.
FLAT = ("rss_mib", "threads", "fds", "tasks", "states")
#: The RSS beside what RocksDB holds in memory (its memtables fill slowly at a soak's rate, up to their
#: configured bound: a rise of the RSS that is only that is not a leak), when the samples have it.
BEYOND_ROCKSDB = "rss_beyond_rocksdb_mib"
#: What the process's heap is made of, trended beside the RSS when the samples have it: Python's blocks
#: in use, glibc's heap in use and free in its arenas (the RSS rising with these flat is neither), and
#: the same for the main thread's arena apart from the other threads' (whose allocations hold it).
HEAP = (
    "py_blocks",
    "malloc_used_mib",
    "malloc_free_mib",
    "main_arena_used_mib",
    "main_arena_free_mib",
    "thread_arenas_used_mib",
    "thread_arenas_free_mib",
)
#: The threads by who made them and the descriptors by what they are, trended when the samples have
#: them: a count that steps with the bounces (a broker's threads gone while it is down, a closed
#: producer's lingering) tells apart from one that grows, and which of the pod's parts it is.
KINDS = (
    "threads_python",
    "threads_librdkafka",
    "threads_rocksdb",
    "fds_sockets",
    "fds_store",
    "fds_other",
)
#: The census's types that grew the most after the warm-up, kept in the figures.
CENSUS_GROWTH = 12
#: Latency windows of the run: its post-warm-up time cut into this many.
WINDOWS = 6


# --- the figures from the samples (pure: the JSON in, the figures out) -----------------------------


def warmup_s(fig: dict[str, Any]) -> float:
    """When the run is in its steady state: states are removed as fast as they are made from then on (the
    first retention period after a lifetime, and a tenth of the run, at most a minute, to settle)."""
    settle = min(60.0, float(fig["minutes"]) * 6.0)
    return float(fig["retention_s"]) + float(fig["lifetime_s"]) + settle


def slope(points: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Least-squares slope (per hour) of (t_s, value) points, its 95 % half-interval (normal, no
    autocorrelation correction: a lower bound on the noise), and the residuals' spread."""
    n = len(points)
    if n < 3:
        return {"per_hour": 0.0, "ci95_per_hour": math.inf, "residual_sd": 0.0, "n": n}
    ts = [t / 3600.0 for t, _ in points]
    ys = [float(y) for _, y in points]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    sxx = sum((t - mt) ** 2 for t in ts)
    b = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / sxx if sxx else 0.0
    a = my - b * mt
    residuals = [y - (a + b * t) for t, y in zip(ts, ys, strict=True)]
    sd = math.sqrt(sum(r * r for r in residuals) / (n - 2))
    se = sd / math.sqrt(sxx) if sxx else math.inf
    return {"per_hour": b, "ci95_per_hour": 1.96 * se, "residual_sd": sd, "n": n}


#: Student's t two-sided 95 % quantiles where the expansion below is off (df 1: 9.7 for 12.7).
_T95_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}


def t95(df: int) -> float:
    """Student's t two-sided 95 % quantile for ``df`` degrees of freedom: the table up to 4, then
    Cornish-Fisher's expansion about the normal's 1.96 (within 0.01 of the table from df 4 up)."""
    z = 1.96
    if df <= 0:
        return math.inf
    if df in _T95_TABLE:
        return _T95_TABLE[df]
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


#: After a broker comes back, the seconds before its cycle's samples count: its clients reconnect, a
#: closed producer's threads linger, the lag drains (the run's lingering median is about a minute).
SETTLE_AFTER_BOUNCE_S = 60.0
#: The fewest samples a quiet stretch counts with (the soak's are about 160, a second apart).
MIN_STRETCH_SAMPLES = 30


def between_bounces(
    points: Sequence[tuple[float, float]], bounces: Sequence[dict[str, Any]]
) -> list[tuple[float, float]]:
    """One point per quiet stretch of the run (from a minute after a broker came back to the next one's
    going down): its samples' mean at their mean time. Samples a second apart are not independent (a
    count stays where a bounce left it for minutes), so a slope through them claims a precision it
    does not have. Through these means (batch means) the interval holds as far as one stretch's level
    does not carry into the next: a step that a bounce leaves for good is a change the slope should see.
    A stretch with fewer than ``MIN_STRETCH_SAMPLES`` samples (cut by the warm-up's end) is left out."""
    if not points:
        return []
    times = [t for t, _ in points]
    starts = [times[0], *(float(b["up_t_s"]) + SETTLE_AFTER_BOUNCE_S for b in bounces)]
    ends = [*(float(b["down_t_s"]) for b in bounces), times[-1] + 1.0]
    out = []
    for lo, hi in zip(starts, ends, strict=True):
        inside = points[bisect.bisect_left(times, lo) : bisect.bisect_left(times, hi)]
        if len(inside) >= MIN_STRETCH_SAMPLES:
            out.append((statistics.fmean(t for t, _ in inside), statistics.fmean(v for _, v in inside)))
    return out


def later_half(points: Sequence[tuple[float, float]]) -> dict[str, float]:
    """The slope over the later half of the steady period: what tells a growth that levels off (a
    cache filling, an allocator's free lists reaching their working size) from one that goes on with
    the time run, which a slope over the whole period cannot."""
    if not points:
        return slope(points)
    middle = (points[0][0] + points[-1][0]) / 2.0
    return slope([p for p in points if p[0] >= middle])


def summarise(fig: dict[str, Any]) -> dict[str, Any]:
    """The soak's figures from its samples: each resource's trend after the warm-up, latency per window."""
    columns = fig["pod_samples"]["columns"]
    rows = fig["pod_samples"]["rows"]
    start = warmup_s(fig)
    end = float(fig["minutes"]) * 60.0
    steady = [r for r in rows if start <= r[0] <= end]
    trends: dict[str, Any] = {}
    names: tuple[str, ...] = FLAT
    if "rocksdb_mib" in columns:  # samples of runs before it lack the column
        names = (*FLAT, BEYOND_ROCKSDB)
    names = (*names, *(name for name in (*HEAP, *KINDS) if name in columns))
    for name in names:
        points = [(r[0], _value(columns, r, name)) for r in steady]
        values = [v for _, v in points]
        trend = slope(points)
        if values:
            quarter = max(1, len(values) // 4)
            trend.update(
                {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                    "first_quarter_median": statistics.median(values[:quarter]),
                    "last_quarter_median": statistics.median(values[-quarter:]),
                }
            )
            span_h = (points[-1][0] - points[0][0]) / 3600.0
            trend["change_over_steady"] = trend["per_hour"] * span_h
            later = later_half(points)
            trend["later_half_per_hour"] = later["per_hour"]
            trend["later_half_ci95_per_hour"] = later["ci95_per_hour"]
            cycles = between_bounces(points, fig["bounces"])
            for key, fit in (("cycles", slope(cycles)), ("cycles_later_half", later_half(cycles))):
                if fit["n"] < 3:
                    continue
                trend[f"{key}_n"] = fit["n"]
                trend[f"{key}_per_hour"] = fit["per_hour"]
                # Student's t on n - 2 degrees of freedom, not the normal's 1.96: few points
                trend[f"{key}_ci95_per_hour"] = fit["ci95_per_hour"] / 1.96 * t95(int(fit["n"]) - 2)
        trends[name] = trend
    fig["steady_from_s"] = start
    fig["trends"] = trends
    fig["census_growth"] = census_growth(fig.get("censuses", []), start)
    fig["latency_windows"] = _windows(fig, start, end)
    steady_ms = [ms for t, ms in fig["provision_ms"] if start <= t <= end]
    per_minute: dict[int, list[float]] = {}
    for ts, ms in fig["provision_ms"]:
        per_minute.setdefault(int(ts // 60), []).append(ms)
    fig["provision_per_minute"] = [
        [m, len(v), pct(v, 50), pct(v, 99), max(v)] for m, v in sorted(per_minute.items())
    ]
    fig["provision_p50_ms"] = pct(steady_ms, 50)
    fig["provision_p99_ms"] = pct(steady_ms, 99)
    lag_i = fig["bench_samples"]["columns"].index("lag")
    lags = [r[lag_i] for r in fig["bench_samples"]["rows"] if r[lag_i] is not None and start <= r[0] <= end]
    fig["lag_max"] = max(lags) if lags else None
    fig["lag_median"] = statistics.median(lags) if lags else None
    return fig


def census_growth(censuses: Sequence[Any], start: float) -> dict[str, Any]:
    """The types whose tracked objects grew the most from the first census after the warm-up to the
    last (a type missing from a census's top list counts as 0 there)."""
    steady = [(c[0], c[1]) for c in censuses if c[0] >= start]
    if len(steady) < 2:
        return {}
    (t0, first), (t1, last) = steady[0], steady[-1]
    grown = sorted(
        ((name, last.get(name, 0) - first.get(name, 0)) for name in set(first) | set(last)),
        key=lambda kv: -kv[1],
    )
    largest = [c[2] for c in censuses if c[0] >= start and len(c) > 2]
    traced = [c[3] for c in censuses if c[0] >= start and len(c) > 3 and c[3]]
    return {
        "from_s": t0,
        "to_s": t1,
        "grown": dict(grown[:CENSUS_GROWTH]),
        "largest_first": largest[0] if largest else [],
        "largest_last": largest[-1] if largest else [],
        # --soak-trace-allocations: [size grown, count grown, traceback] of the sites grown most
        "allocations_grown": traced[-1] if traced else [],
    }


def _value(columns: list[str], row: list[Any], name: str) -> float:
    if name == BEYOND_ROCKSDB:
        return float(row[columns.index("rss_mib")]) - float(row[columns.index("rocksdb_mib")])
    return float(row[columns.index(name)])


def _windows(fig: dict[str, Any], start: float, end: float) -> list[dict[str, Any]]:
    if end <= start:
        return []
    width = (end - start) / WINDOWS
    out = []
    for k in range(WINDOWS):
        lo, hi = start + k * width, start + (k + 1) * width
        prov = [ms for t, ms in fig["provision_ms"] if lo <= t < hi]
        down = [ms for t, ms in fig["teardown_ms"] if lo <= t < hi]
        out.append(
            {
                "from_s": round(lo, 1),
                "to_s": round(hi, 1),
                "outcomes": len(prov) + len(down),
                "provision_p50_ms": pct(prov, 50),
                "provision_p99_ms": pct(prov, 99),
                "provision_max_ms": max(prov) if prov else 0.0,
                "teardown_p99_ms": pct(down, 99),
            }
        )
    return out


# --- the table and the chart ----------------------------------------------------------------------

_UNITS = {
    "rss_mib": "MiB",
    BEYOND_ROCKSDB: "MiB",
    "threads": "threads",
    "fds": "fds",
    "tasks": "tasks",
    "states": "states",
    "py_blocks": "blocks",
    "malloc_used_mib": "MiB",
    "malloc_free_mib": "MiB",
    "main_arena_used_mib": "MiB",
    "main_arena_free_mib": "MiB",
    "thread_arenas_used_mib": "MiB",
    "thread_arenas_free_mib": "MiB",
    "threads_python": "threads",
    "threads_librdkafka": "threads",
    "threads_rocksdb": "threads",
    "fds_sockets": "fds",
    "fds_store": "fds",
    "fds_other": "fds",
}


def report_rows(fig: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """This figure's rows of the run's table: (figure, median, min-max, goal)."""
    rows = [
        (
            f"soak {fig['minutes']:g} min: executions lost / duplicate outcomes",
            f"{fig['lost']} / {fig['duplicates']}",
            f"of {fig['executions']:,}",
            "0 / 0",
        )
    ]
    for name in (*FLAT, BEYOND_ROCKSDB, *HEAP, *KINDS):
        t = fig["trends"].get(name) or {}
        if "median" not in t:
            continue
        rows.append(
            (
                f"soak: {name} slope after warm-up; its later half; a mean per cycle between bounces, "
                f"all and later half, {_UNITS[name]}/h (±95 %)",
                f"{t['per_hour']:+.3g} ± {t['ci95_per_hour']:.2g}; {_later(t)}; {_cycles(t)}",
                f"{t['min']:g}-{t['max']:g} (median {t['median']:g})",
                "flat",
            )
        )
    rows.append(
        (
            "soak: create → provisioned p50 / p99, ms",
            f"{fig['provision_p50_ms']:.1f} / {fig['provision_p99_ms']:.1f}",
            f"{len(fig['bounces'])} bounces",
            "steady",
        )
    )
    return rows


def _later(trend: dict[str, Any]) -> str:
    if "later_half_per_hour" not in trend:  # figures summarised before the later half was
        return "-"
    return f"{trend['later_half_per_hour']:+.3g} ± {trend['later_half_ci95_per_hour']:.2g}"


def _cycles(trend: dict[str, Any]) -> str:
    if "cycles_per_hour" not in trend:  # too few bounces, or figures summarised before these were
        return "-"

    def fit(key: str) -> str:
        if f"{key}_per_hour" not in trend:
            return "-"
        return f"{trend[f'{key}_per_hour']:+.3g} ± {trend[f'{key}_ci95_per_hour']:.2g} ({trend[f'{key}_n']})"

    return f"{fit('cycles')}; {fit('cycles_later_half')}"


def extra_lines(fig: dict[str, Any]) -> list[str]:
    """The latency per window of the run, under the table."""
    lines = [
        "| soak window, min | outcomes | provision p50 ms | p99 ms | max ms | teardown p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for w in fig.get("latency_windows", []):
        lines.append(
            f"| {w['from_s'] / 60:.1f}-{w['to_s'] / 60:.1f} | {w['outcomes']:,} | "
            f"{w['provision_p50_ms']:.1f} | {w['provision_p99_ms']:.1f} | {w['provision_max_ms']:.0f} | "
            f"{w['teardown_p99_ms']:.1f} |"
        )
    growth = fig.get("census_growth") or {}
    if growth:
        grown = ", ".join(f"{name} {n:+,}" for name, n in growth["grown"].items())
        lines.append(
            f"\nObjects tracked, grown from minute {growth['from_s'] / 60:.0f} to {growth['to_s'] / 60:.0f}: "
            + grown
        )
    for size, count, where in growth.get("allocations_grown", [])[:5]:
        lines.append(f"\nAllocations grown {size / 1024:+,.0f} KiB ({count:+,} blocks) at {where}")
    return lines


def draw(fig: dict[str, Any], doc: Any) -> Figure | None:
    """``soak.svg``: each sampled resource over the run's minutes, the bounces shaded, the warm-up marked."""
    from matplotlib.figure import Figure

    rows = fig["pod_samples"]["rows"]
    if not rows:
        return None
    columns = fig["pod_samples"]["columns"]
    t = [r[0] / 60.0 for r in rows]
    panels = [
        ("RSS, MiB", [n for n in ("rss_mib", "rocksdb_mib") if n in columns]),
        ("threads, descriptors", ["threads", "fds"]),
        *((("by maker, by kind", kinds),) if (kinds := [n for n in KINDS if n in columns]) else ()),
        ("asyncio tasks", ["tasks"]),
        ("states held", ["states"]),
    ]
    chart = Figure(figsize=(8.0, 10.0), layout="constrained")
    axes = chart.subplots(len(panels) + 2, 1, sharex=True)
    for ax, (title, names) in zip(axes, panels, strict=False):
        for name in names:
            i = columns.index(name)
            ax.plot(t, [r[i] for r in rows], linewidth=0.8, label=name)
        if "rocksdb_mib" in names:  # the RSS less RocksDB's bounded sawtooth: what a leak would raise
            values = [_value(columns, r, BEYOND_ROCKSDB) for r in rows]
            ax.plot(t, values, linewidth=0.8, label=BEYOND_ROCKSDB)
        ax.set_ylabel(title)
        if len(names) > 1:
            ax.legend(loc="upper left", fontsize=7)
    bench_cols = fig["bench_samples"]["columns"]
    lag_i = bench_cols.index("lag")
    brows = [r for r in fig["bench_samples"]["rows"] if r[lag_i] is not None]
    axes[-2].plot([r[0] / 60.0 for r in brows], [r[lag_i] for r in brows], linewidth=0.8, color="#8250df")
    axes[-2].set_ylabel("consumer lag, records")
    minutes = [row[0] for row in fig["provision_per_minute"]]
    axes[-1].plot(
        [m + 0.5 for m in minutes],
        [row[2] for row in fig["provision_per_minute"]],
        color="#1f6feb",
        label="p50",
    )
    axes[-1].plot(
        [m + 0.5 for m in minutes],
        [row[3] for row in fig["provision_per_minute"]],
        color="#cf222e",
        label="p99",
    )
    axes[-1].set_yscale("log")
    axes[-1].set_ylabel("create → provisioned, ms")
    axes[-1].legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("minutes into the run")
    for ax in axes:
        ax.axvline(fig["steady_from_s"] / 60.0, color="#57606a", linestyle=":", linewidth=0.8)
        for b in fig["bounces"]:
            ax.axvspan(b["down_t_s"] / 60.0, b["up_t_s"] / 60.0, color="#d0d7de", alpha=0.6, linewidth=0)
    chart.suptitle(
        f"soak: {fig['executions']:,} executions at {fig['rate_per_s']:g}/s over {fig['minutes']:g} min, "
        f"{len(fig['bounces'])} broker bounces (shaded), retention {fig['retention_s']} s "
        "(dotted: steady from)",
        fontsize=9,
    )
    return chart


def without_samples_of_each_outcome(fig: dict[str, Any]) -> dict[str, Any]:
    """The figure as kept in docs/bench: every figure and per-second row, not the latency of each outcome
    (the per-minute and per-window percentiles stay; ``draw`` needs no more)."""
    return {k: v for k, v in fig.items() if k not in ("provision_ms", "teardown_ms")}
