"""The bench's figures as pictures: SVG files drawn from the bench's JSON document (what ``--out`` holds).

``render(doc, directory)`` is a pure function of the document: one file per chart, a chart whose figure is
absent (or is an error) is not written, and it returns the files written. It draws only what the document
holds: per-sample lists as box plots, and where a row has only percentiles, its p50 and p99 as markers.

* ``burst-latency.svg`` — figure 7, per driver and launch type: event → ``SandboxProvisioned``, event →
  runner holds its secrets, event → runner ready. A row's ``samples_ms: {"provisioned": [...],
  "secrets_held": [...], "runner_ready": [...]}`` as a box (p25-p75, whiskers p1-p99); otherwise its
  p50 and p99 (``time_to_sandbox_*``, ``secrets_held_*``, ``runner_started_*`` or ``running_*``). The
  warm row's ``sequential_*`` (one create at a time) is a row of its own.
* ``burst-breakdown.svg`` — figure 7's rows with ``steps_p50_ms`` (ordered ``{"step": ms}``, each step
  since the one before): stacked bars, one per row (the warm and cold breakdowns).
* ``latency.svg`` — figure 3 (``latency``, ``latency_<guarantee>``): produce → outcome at a fixed offered
  load, p50 / p95 / p99, the median of the runs with their min-max.
* ``peers.svg`` — figures 8 and 10 side by side: events/s of the pod and its peers, and their p50 / p99
  at half their own rate and one event at a time.
* ``scale.svg`` and ``soak.svg`` — drawn by their figures' own modules (``scale.draw``, ``soak.draw``).
* ``retention.svg`` — figure 9: keys held and the pod's RSS over time, with retention and kept (each
  run's ``samples``); a document from before the samples gets the per-wave values.

Matplotlib's ``Figure`` is used without pyplot (no display, no global state); the SVGs are written
without a date and with a fixed id salt, so the same document gives the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Every chart, in the order written; the file is ``<name>.svg``.
CHARTS = ("burst-latency", "burst-breakdown", "latency", "peers", "retention", "scale", "soak")

POD_COLOR = "#1f6feb"
PEER_COLOR = "#8c959f"
P50_COLOR = "#1f6feb"
P99_COLOR = "#cf222e"
RUN_COLORS = {"retention": "#1a7f37", "kept": "#cf222e"}
#: A step's colour in the breakdown, by its place among the steps met (the same step, the same colour).
STEP_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
    "#dbdb8d", "#9edae5",
)  # fmt: skip

BURST_LABELS = {
    "memory": "memory driver",
    "docker": "docker",
    "kubernetes": "kubernetes",
    "kubernetes/docker_same_n": "docker, kubernetes' n",
    "kubernetes/agent_sandbox_cold": "agent-sandbox cold",
    "kubernetes/agent_sandbox_warm": "agent-sandbox warm",
}
#: A row's step breakdowns (``launch_steps.breakdown``): labelled as the launch they time.
STEP_ROWS = {"steps": "", "burst_steps": "", "sequential_steps": ", one at a time"}
#: What a burst row's distribution is of: its ``samples_ms`` key, the panel's title, and the percentile
#: keys (p50, p99) drawn where the row has no samples, the first pair the row has.
BURST_METRICS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "provisioned": ("event → SandboxProvisioned", (("time_to_sandbox_p50_ms", "time_to_sandbox_p99_ms"),)),
    "secrets_held": ("event → runner holds its secrets", (("secrets_held_p50_ms", "secrets_held_p99_ms"),)),
    "runner_ready": (
        "event → runner ready",
        (("runner_started_p50_ms", "runner_started_p99_ms"), ("running_p50_ms", "running_p99_ms")),
    ),
}
#: A burst row's keys that are not rows of their own.
NOT_ROWS = ("samples_ms", "sequential_samples_ms", "steps_p50_ms", "steps_p99_ms", "launches")
PEER_LABELS = {
    "pod": "this pod",
    "quix": "Quix Streams",
    "faust": "faust-streaming",
    "confluent": "confluent-kafka pipe",
    "pod-rules-confluent": "pod rules on confluent-kafka",
}


# --- the documents ------------------------------------------------------------------------------


def load(paths: Sequence[Path]) -> dict[str, Any]:
    """The bench's JSON documents as one: their figures merged, a later document's figure replacing an
    earlier one's of the same name (a burst run's JSON beside the default set's). Each figure keeps the
    ``meta`` of the document it came from (``meta_of``)."""
    return merge([json.loads(Path(p).read_text()) for p in paths])


def merge(docs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    meta_of: dict[str, Any] = {}
    for doc in docs:
        for name, fig in (doc.get("figures") or {}).items():
            if _usable(fig) or name not in figures:
                figures[name] = fig
                meta_of[name] = doc.get("meta_of", {}).get(name, doc.get("meta", {}))
    return {"meta": docs[-1].get("meta", {}) if docs else {}, "figures": figures, "meta_of": meta_of}


def _usable(fig: Any) -> bool:
    return isinstance(fig, dict) and "error" not in fig


def _figure(doc: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    fig = (doc.get("figures") or {}).get(name)
    return fig if _usable(fig) else None


# --- the charts ---------------------------------------------------------------------------------


def render(doc: Mapping[str, Any], directory: Path) -> list[Path]:
    """Write each chart the document has the figures for into ``directory``; the files written."""
    import matplotlib

    directory.mkdir(parents=True, exist_ok=True)
    drawers = {
        "burst-latency": _burst_latency,
        "burst-breakdown": _burst_breakdown,
        "latency": _latency,
        "peers": _peers,
        "retention": _retention,
        "scale": _scale,
        "soak": _soak,
    }
    written: list[Path] = []
    with matplotlib.rc_context(
        {"svg.hashsalt": "sandbox-lanes-bench", "svg.fonttype": "none", "font.size": 9.0}
    ):
        for name in CHARTS:
            fig = drawers[name](doc)
            if fig is None:
                continue
            path = directory / f"{name}.svg"
            fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")
            written.append(path)
    return written


def _scale(doc: Mapping[str, Any]) -> Figure | None:
    from sandbox_lanes_bench.scale import draw

    fig = _figure(doc, "scale")
    return None if fig is None else draw(fig, doc)


def _soak(doc: Mapping[str, Any]) -> Figure | None:
    from sandbox_lanes_bench.soak import draw

    fig = _figure(doc, "soak")
    return None if fig is None else draw(fig, doc)


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _footer(fig: Figure, doc: Mapping[str, Any], *names: str) -> None:
    """Where the figure's numbers come from: the run's date and its machine."""
    meta = next((doc.get("meta_of", {}).get(n) for n in names if n in doc.get("meta_of", {})), None)
    meta = meta or doc.get("meta") or {}
    parts = []
    if meta.get("started_at"):
        parts.append(str(meta["started_at"]))
    mach = meta.get("machine") or {}
    if mach.get("cores"):
        parts.append(f"{mach.get('cpu', '?')}, {mach['cores']} cores")
    if parts:
        text = " · ".join(parts)
        fig.supxlabel(text if len(text) <= 160 else text[:157] + "…", fontsize=6.5, color="#57606a")


# (a) latency distributions per driver and launch type ---------------------------------------------


def burst_rows(
    fig: Mapping[str, Any], prefix: str = "", parent: str = ""
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every measured row of the burst figure, depth first (``kubernetes`` holds the agent-sandbox rows,
    the warm row its step breakdowns): its label and the row. A row that is an error is left out."""
    for key, value in fig.items():
        if key in NOT_ROWS or not isinstance(value, dict) or "error" in value:
            continue
        path = f"{prefix}{key}"
        if path in BURST_LABELS:
            label = BURST_LABELS[path]
        elif parent and key in STEP_ROWS:
            label = parent + STEP_ROWS[key]
        else:
            label = f"{parent}, {key.replace('_', ' ')}" if parent else key
        if _is_row(value):
            yield label, value
        yield from burst_rows(value, path + "/", label)


def _is_row(value: Mapping[str, Any]) -> bool:
    return (
        "samples_ms" in value
        or "steps_p50_ms" in value
        or any(p50 in value for _, pairs in BURST_METRICS.values() for p50, _ in pairs)
    )


def _one_at_a_time(rows: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """Beside each row with ``sequential_*`` figures (the warm pool, one create at a time on a full pool):
    a row of those, its samples where the row has them."""
    out: list[tuple[str, dict[str, Any]]] = []
    for label, row in rows:
        out.append((label, row))
        one: dict[str, Any] = {}
        if isinstance(row.get("sequential_samples_ms"), dict):
            one["samples_ms"] = row["sequential_samples_ms"]
        if "sequential_p50_ms" in row and "sequential_p99_ms" in row:
            one["time_to_sandbox_p50_ms"] = row["sequential_p50_ms"]
            one["time_to_sandbox_p99_ms"] = row["sequential_p99_ms"]
        if one:
            out.append((f"{label}, one at a time", one))
    return out


#: One panel of the latency chart: its title, and per label the samples or the (p50, p99) drawn.
Panel = tuple[str, list[tuple[str, list[float] | None, tuple[float, float] | None]]]


def burst_panels(burst: Mapping[str, Any]) -> list[Panel]:
    """What the latency chart draws, per metric that any row has."""
    rows = _one_at_a_time(list(burst_rows(burst)))
    panels: list[Panel] = []
    for metric, (title, pairs) in BURST_METRICS.items():
        # A label once per panel. A launch's step breakdown comes after its row and times the runner to
        # its first log line: a later row replaces an earlier one, but never samples with percentiles.
        # A row that keeps samples but none of this metric has no such figure (a cold launch's
        # breakdown names its runner's start "secrets held" too): its percentiles are not drawn.
        by_label: dict[str, tuple[list[float] | None, tuple[float, float] | None]] = {}
        for label, row in rows:
            kept = row.get("samples_ms")
            given = [float(v) for v in (kept or {}).get(metric) or []]
            pair = next(((row[a], row[b]) for a, b in pairs if row.get(a) and row.get(b)), None)
            if isinstance(kept, dict) and metric not in kept:
                pair = None
            if given:
                by_label[label] = (given, None)
            elif pair is not None and by_label.get(label, (None, None))[0] is None:
                by_label[label] = (None, (float(pair[0]), float(pair[1])))
        drawn = [(label, samples, marks) for label, (samples, marks) in by_label.items()]
        if drawn:
            panels.append((title, drawn))
    return panels


def _burst_latency(doc: Mapping[str, Any]) -> Figure | None:
    burst = _figure(doc, "burst")
    if burst is None:
        return None
    panels = burst_panels(burst)
    if not panels:
        return None
    rows = _one_at_a_time(list(burst_rows(burst)))
    order = [label for label, _ in rows]
    labels = sorted({label for _, drawn in panels for label, _, _ in drawn}, key=order.index)
    fig = _new_figure(4.2 * len(panels) + 2.0, 0.45 * len(labels) + 1.6)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (title, drawn) in zip(axes, panels, strict=True):
        values: list[float] = []
        for label, samples, marks in drawn:
            y = len(labels) - 1 - labels.index(label)
            if samples is not None:
                box = ax.boxplot(
                    [samples], positions=[y], orientation="horizontal", whis=(1, 99), widths=0.5,
                    showfliers=False, patch_artist=True, boxprops={"facecolor": "#ddf4ff"},
                    medianprops={"color": P50_COLOR},
                )  # fmt: skip
                right = float(max(box["whiskers"][1].get_xdata()))  # the p99 whisker's end
                ax.annotate(f"n={len(samples)}", (right, y), xytext=(4, 0), textcoords="offset points",
                            va="center", fontsize=7, color="#57606a", annotation_clip=False)  # fmt: skip
                values.extend(samples)
            elif marks is not None:
                ax.plot(list(marks), [y, y], color="#8c959f", linewidth=1, zorder=1)
                ax.scatter([marks[0]], [y], marker="o", color=P50_COLOR, zorder=2)
                ax.scatter([marks[1]], [y], marker="^", color=P99_COLOR, zorder=2)
                values.extend(marks)
        _log_if_wide(ax, values)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(labels)), list(reversed(labels)))
    axes[0].set_ylim(-0.7, len(labels) - 0.3)
    if any(marks is not None for _, drawn in panels for _, _, marks in drawn):
        _markers_legend(fig, axes[-1])
    fig.suptitle("7. time to sandbox per driver and launch type (box: p25-p75, whiskers p1-p99)")
    _footer(fig, doc, "burst")
    return fig


def _markers_legend(fig: Figure, ax: Axes) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], marker="o", linestyle="", color=P50_COLOR, label="p50 (percentiles only)"),
        Line2D([], [], marker="^", linestyle="", color=P99_COLOR, label="p99 (percentiles only)"),
    ]
    ax.legend(handles=handles, loc="lower right", fontsize=7)


def _log_if_wide(ax: Axes, values: Sequence[float]) -> None:
    """A log axis where the values span more than 30x, its ticks as plain numbers (10, 100, 1,000)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 30:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 3.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())


# (b) the warm and cold breakdowns --------------------------------------------------------------


def _burst_breakdown(doc: Mapping[str, Any]) -> Figure | None:
    """One bar per row, each on its own scale (a warm create's 100 ms beside a cold one's seconds)."""
    from matplotlib.patches import Patch

    burst = _figure(doc, "burst")
    if burst is None:
        return None
    rows = [(label, row["steps_p50_ms"]) for label, row in burst_rows(burst) if row.get("steps_p50_ms")]
    if not rows:
        return None
    steps = list(dict.fromkeys(step for _, row in rows for step in row))
    color = {step: STEP_COLORS[i % len(STEP_COLORS)] for i, step in enumerate(steps)}
    fig = _new_figure(9.0, 0.95 * len(rows) + 1.9)
    axes = fig.subplots(len(rows), 1, squeeze=False)[:, 0]
    for ax, (label, row) in zip(axes, rows, strict=True):
        total = sum(float(ms) for ms in row.values()) or 1.0
        left = 0.0
        for step, ms in row.items():
            width = float(ms)
            ax.barh(0, width, left=left, height=0.6, color=color[step], edgecolor="white", linewidth=0.5)
            if width >= 0.07 * total:  # its number inside where it fits
                ax.text(left + width / 2, 0, f"{width:,.0f}", ha="center", va="center", fontsize=7,
                        color="white")  # fmt: skip
            left += width
        ax.set_xlim(0, total * 1.12)
        ax.annotate(f"{total:,.0f} ms", (total, 0), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=7)  # fmt: skip
        ax.set_yticks([0], [label])
        ax.set_ylim(-0.5, 0.5)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel(
        "ms: each step's p50 since the step before, stacked in order (each row its own scale)"
    )
    axes[-1].legend(
        handles=[Patch(color=color[s], label=s.replace("_", " ")) for s in steps],
        loc="upper center", bbox_to_anchor=(0.5, -0.9), ncol=min(5, len(steps)), fontsize=7, frameon=False,
    )  # fmt: skip
    fig.suptitle("7. where a create's time goes: p50 per step, warm and cold")
    _footer(fig, doc, "burst")
    return fig


# (a) figure 3: produce -> outcome at a fixed load --------------------------------------------------


def _latency(doc: Mapping[str, Any]) -> Figure | None:
    names = sorted(n for n in (doc.get("figures") or {}) if n == "latency" or n.startswith("latency_"))
    figs = [(n, f) for n in names if (f := _figure(doc, n)) is not None and "p50_ms" in f]
    if not figs:
        return None
    fig = _new_figure(7.5, 0.7 * len(figs) + 1.8)
    ax = fig.subplots()
    labels = []
    for i, (name, f) in enumerate(figs):
        y = len(figs) - 1 - i
        guarantee = f.get("guarantee") or name.removeprefix("latency_")
        labels.append(f"{guarantee}\nat {float(f.get('offered_rate', 0)):,.0f}/s")
        for offset, (key, color, marker) in zip(
            (0.15, 0.0, -0.15),
            (("p50_ms", P50_COLOR, "o"), ("p95_ms", "#bf8700", "s"), ("p99_ms", P99_COLOR, "^")),
            strict=True,
        ):
            s = f.get(key)
            if not isinstance(s, dict):
                continue
            med = float(s["median"])
            err = [[med - float(s["min"])], [float(s["max"]) - med]]
            ax.errorbar([med], [y + offset], xerr=err, fmt=marker, color=color, capsize=3,
                        label=key.removesuffix("_ms") if i == 0 else None)  # fmt: skip
    ax.set_yticks(range(len(figs)), list(reversed(labels)))
    ax.set_ylim(-0.6, len(figs) - 0.4)
    ax.set_xlabel("ms, produce ExecutionCreated → SandboxProvisioned readable (median of runs, min-max)")
    ax.set_xlim(left=0)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    fig.suptitle("3. latency at a fixed offered load (memory driver)")
    _footer(fig, doc, *names)
    return fig


# (c) the peers side by side ----------------------------------------------------------------------


def _peers(doc: Mapping[str, Any]) -> Figure | None:
    throughput = _figure(doc, "peers")
    rates = (throughput or {}).get("events_per_s") or {}
    latency = _figure(doc, "peers_latency") or {}
    half, floor = latency.get("half_rate") or {}, latency.get("floor") or {}
    panels: list[str] = [p for p, has in (("rate", rates), ("half", half), ("floor", floor)) if has]
    if not panels:
        return None
    most = max(len(rates), len(half), len(floor))
    fig = _new_figure(4.3 * len(panels) + 1.0, max(3.6, 0.5 * most + 1.6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        if panel == "rate":
            names = list(rates)
            meds = [float(rates[n]["median"]) for n in names]
            errs = [
                [m - float(rates[n]["min"]) for n, m in zip(names, meds, strict=True)],
                [float(rates[n]["max"]) - m for n, m in zip(names, meds, strict=True)],
            ]
            ys = list(range(len(names)))[::-1]
            colors = [POD_COLOR if n.startswith("pod.") else PEER_COLOR for n in names]
            ax.barh(ys, meds, xerr=errs, color=colors, capsize=3, height=0.6)
            ax.set_yticks(ys, [_peer_label(n) for n in names])
            ax.set_xlabel("events/s (median of runs, min-max)")
            events = (throughput or {}).get("events")
            ax.set_title(f"8. throughput{f', {events:,} events' if events else ''}")
            ax.grid(axis="x", alpha=0.3)
        else:
            source = half if panel == "half" else floor
            _p50_p99_bars(ax, source)
            if panel == "half":
                ax.set_title("10. produce → outcome, each at half its rate")
            else:
                ax.set_title("10. produce → outcome, one event at a time")
    fig.suptitle("the pod and its peers on the same broker and job")
    _footer(fig, doc, "peers", "peers_latency")
    return fig


def _peer_label(name: str) -> str:
    system, _, guarantee = name.partition(".")
    label = PEER_LABELS.get(system, system)
    return f"{label}\n{guarantee}" if guarantee else label


def _p50_p99_bars(ax: Axes, source: Mapping[str, Any]) -> None:
    systems = list(source)
    ys = list(range(len(systems)))[::-1]
    values: list[float] = []
    for offset, key, color in ((0.18, "p50_ms", P50_COLOR), (-0.18, "p99_ms", P99_COLOR)):
        meds, lows, highs = [], [], []
        for system in systems:
            s = source[system].get(key) or {}
            med = float(s.get("median", 0.0))
            meds.append(med)
            lows.append(med - float(s.get("min", med)))
            highs.append(float(s.get("max", med)) - med)
        values.extend(meds)
        ax.barh([y + offset for y in ys], meds, xerr=[lows, highs], height=0.36, color=color, capsize=2,
                label=key.removesuffix("_ms"))  # fmt: skip
    ax.set_yticks(ys, [PEER_LABELS.get(s, s) for s in systems])
    _log_if_wide(ax, values)
    ax.set_xlabel("ms (median of runs, min-max)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)


# (d) retention: keys and RSS over time ------------------------------------------------------------


def _retention(doc: Mapping[str, Any]) -> Figure | None:
    ret = _figure(doc, "retention")
    given = (ret or {}).get("runs") or {}
    runs = {k: r for k, r in given.items() if isinstance(r, dict) and r.get("waves")}
    if not runs:
        return None
    fig = _new_figure(8.0, 5.2)
    keys_ax, rss_ax = fig.subplots(2, 1, sharex=True)
    timed = all((r.get("samples") or {}).get("rows") for r in runs.values())
    for name, run in runs.items():
        seconds = run.get("retention_s", 0)
        label = f"retention {seconds} s" if seconds else "kept for ever"
        color = RUN_COLORS.get(name)
        if timed:
            columns = run["samples"].get("columns", ["t_s", "keys_held", "rss_mib"])
            rows = run["samples"]["rows"]
            t = [row[columns.index("t_s")] for row in rows]
            keys_ax.plot(t, [row[columns.index("keys_held")] for row in rows], color=color, label=label)
            rss_ax.plot(t, [row[columns.index("rss_mib")] for row in rows], color=color, label=label)
            ends = [w["t_s"] for w in run["waves"] if "t_s" in w]
            for ax, key in ((keys_ax, "keys_held"), (rss_ax, "rss_mib")):
                if len(ends) == len(run["waves"]):
                    ax.scatter(ends, [w[key] for w in run["waves"]], color=color, marker="|", s=120, zorder=3)
        else:
            x = [w["wave"] for w in run["waves"]]
            keys_ax.plot(x, [w["keys_held"] for w in run["waves"]], marker="o", color=color, label=label)
            rss_ax.plot(x, [w["rss_mib"] for w in run["waves"]], marker="o", color=color, label=label)
    keys_ax.set_ylabel("keys held")
    rss_ax.set_ylabel("pod RSS, MiB")
    rss_ax.set_xlabel("seconds since the first wave (|: a wave's report)" if timed else "wave")
    for ax in (keys_ax, rss_ax):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    keys_ax.set_ylim(bottom=0)
    rss_ax.set_ylim(bottom=0)
    waves, size = (ret or {}).get("waves"), (ret or {}).get("wave_size")
    what = f"{waves} waves of {size:,} workflow executions" if waves and size else "waves of executions"
    fig.suptitle(f"9. bounded state: {what}, with retention and kept")
    _footer(fig, doc, "retention")
    return fig
