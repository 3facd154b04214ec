"""The bench's plots from hand-made documents shaped like its JSON: each chart written when its figure is
there, left out when it is not, valid SVG; and the one command that redraws them from saved runs."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from sandbox_lanes_bench.plots import CHARTS, burst_panels, burst_rows, merge, render

ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}svg"


def _summary(median: float) -> dict[str, Any]:
    return {"median": median, "min": median * 0.9, "max": median * 1.2, "runs": [median * 0.9, median * 1.2]}


def _burst() -> dict[str, Any]:
    memory = {"n": 40, "time_to_sandbox_p50_ms": 210.0, "time_to_sandbox_p99_ms": 260.0}  # percentiles only
    cold = {
        "n": 3,
        "time_to_sandbox_p50_ms": 900.0,
        "time_to_sandbox_p99_ms": 1500.0,
        "running_p50_ms": 6700.0,
        "running_p99_ms": 7100.0,
        "samples_ms": {"provisioned": [850.0, 900.0, 1500.0], "runner_ready": [6500.0, 6700.0, 7100.0]},
        # the cold breakdown as the contract gives it: ordered steps on the row itself
        "steps_p50_ms": {
            "api_write": 12.0,
            "scheduling": 40.0,
            "sandbox_created": 5000.0,
            "runner_start": 900.0,
        },
    }

    def steps(scale: float) -> dict[str, Any]:  # sandbox_lanes_bench.warm_steps.breakdown's shape
        return {
            "creates": 3,
            "whole": 3,
            "steps_p50_ms": {
                "event_read": 2.0 * scale,
                "decided": 1.0,
                "claim_created": 15.0 * scale,
                "secrets_held": 60.0 * scale,
            },
            "steps_p99_ms": {"event_read": 3.0, "decided": 2.0, "claim_created": 30.0, "secrets_held": 90.0},
            "secrets_held_p50_ms": 78.0 * scale,
            "secrets_held_p99_ms": 120.0 * scale,
            "samples_ms": {
                "secrets_held": [70.0 * scale, 78.0 * scale, 120.0 * scale],
                "runner_ready": [120.0 * scale, 140.0 * scale, 280.0 * scale],
            },
        }

    warm = {
        "n": 3,
        "time_to_sandbox_p50_ms": 70.0,
        "time_to_sandbox_p99_ms": 131.0,
        "samples_ms": {"provisioned": [60.0, 70.0, 131.0]},
        "sequential_n": 3,
        "sequential_p50_ms": 65.0,
        "sequential_p99_ms": 90.0,
        "sequential_samples_ms": {"provisioned": [60.0, 65.0, 90.0]},
        "sequential_steps": steps(1.0),
        "burst_steps": steps(2.0),
        "launches": {"warm": 6},
    }
    k8s = {
        "n": 3,
        "cluster": "single-node cluster",
        "time_to_sandbox_p50_ms": 400.0,
        "time_to_sandbox_p99_ms": 600.0,
        "running_p50_ms": 6000.0,
        "running_p99_ms": 6900.0,
        # a cold launch's breakdown as kube_burst nests it; its runner_ready (first log line) is drawn
        "steps": {
            "steps_p50_ms": {
                "objects_written": 20.0,
                "pod_created": 30.0,
                "scheduled": 10.0,
                "sandbox_ready": 4000.0,
                "container_running": 1500.0,
            },
            "runner_started_p50_ms": 6100.0,
            "runner_started_p99_ms": 7000.0,
            # a cold launch holds its secrets as its runner starts: kept under that name, not drawn twice
            "secrets_held_p50_ms": 6100.0,
            "secrets_held_p99_ms": 7000.0,
            "samples_ms": {
                "runner_started": [6050.0, 6100.0, 7000.0],
                "runner_ready": [6050.0, 6100.0, 7000.0],
            },
        },
        "agent_sandbox_cold": cold,
        "agent_sandbox_warm": warm,
        "docker_same_n": {"error": "RuntimeError: no engine"},
    }
    return {"memory": memory, "docker": {"error": "RuntimeError: no engine"}, "kubernetes": k8s}


def _document() -> dict[str, Any]:
    def retention_run(seconds: int, keys: list[int]) -> dict[str, Any]:
        rows = [[0.25 * i, keys[min(i // 4, len(keys) - 1)], 80.0 + i] for i in range(12)]
        waves = [
            {"wave": w + 1, "t_s": 1.0 * (w + 1), "keys_held": k, "rss_mib": 80.0 + w}
            for w, k in enumerate(keys)
        ]
        return {
            "retention_s": seconds,
            "waves": waves,
            "samples": {"columns": ["t_s", "keys_held", "rss_mib"], "every_s": 0.25, "rows": rows},
        }

    def lat(p50: float) -> dict[str, Any]:
        return {"samples": 100, "lost": 0, "p50_ms": _summary(p50), "p99_ms": _summary(p50 * 4)}

    return {
        "meta": {"started_at": "2026-12-05T13:00:00+00:00", "machine": {"cpu": "test", "cores": 2}},
        "figures": {
            "burst": _burst(),
            "latency": {
                "guarantee": "exactly_once",
                "offered_rate": 2500.0,
                "p50_ms": _summary(20.0),
                "p95_ms": _summary(30.0),
                "p99_ms": _summary(45.0),
            },
            "latency_at_least_once": {
                "guarantee": "at_least_once",
                "offered_rate": 3000.0,
                "p50_ms": _summary(15.0),
                "p99_ms": _summary(35.0),
            },
            "peers": {
                "events": 5000,
                "events_per_s": {
                    "pod.exactly_once": _summary(8000.0),
                    "quix.exactly_once": _summary(20000.0),
                },
            },
            "peers_latency": {
                "half_rate": {"pod": lat(20.0), "quix": lat(4000.0)},
                "floor": {"pod": lat(17.0), "quix": lat(2500.0)},
            },
            "retention": {
                "waves": 3,
                "wave_size": 4,
                "retention_s": 2,
                "runs": {"retention": retention_run(2, [0, 0, 0]), "kept": retention_run(0, [4, 8, 12])},
            },
            "scale": _scale(),
            "soak": _soak(),
        },
    }


def _scale() -> dict[str, Any]:
    """The scale figure's chart input: per size, the rows ``scale.draw`` reads."""

    def row(n: int) -> dict[str, Any]:
        grow = 1 + n / 20_000_000
        return {
            "events_per_s": 3000.0 / grow, "cpu_us_per_event": 200.0 * grow, "loop_turn_p50_ms": 0.05,
            "loop_turn_p99_ms": 40.0 * grow, "loop_turn_max_ms": 90.0, "reaper_longest_hold_ms": 2.0,
            "read_through_longest_hold_ms": 3.0, "restart_to_ready_s": 1.2,
        }  # fmt: skip

    return {"events": 20000, "sizes": {str(n): row(n) for n in (0, 1_000_000, 10_000_000)}}


def _soak() -> dict[str, Any]:
    """A soak of 3 minutes sampled every second, one bounce, through the figure's own summary."""
    from sandbox_lanes_bench.soak import BENCH_COLUMNS, POD_COLUMNS, summarise

    # py_blocks; glibc in use and free; the main arena, then the thread arenas, in use and free
    heap = (200_000, 25.0, 3.0, 12.0, 1.0, 4.0, 2.0)
    # the threads by maker (Python's, librdkafka's, RocksDB's), the descriptors by kind (sockets, the
    # store's files, the rest)
    kinds = (7, 18, 2, 30, 25, 15)
    pod_rows = [
        [float(t), 60.0 + t % 3, 27, 70, 24, 50, 0.5, t, t, 0, 0, 0, 0, 20.0 + t % 3, *heap, *kinds]
        for t in range(1, 181)
    ]
    bench_rows = [[float(t), t, t, t, None if 100 <= t < 110 else 3] for t in range(1, 181)]
    return summarise(
        {
            "minutes": 3.0, "rate_per_s": 1.0, "lifetime_s": 4.0, "retention_s": 10, "bounce_every_s": 60.0,
            "bounce_down_s": 5.0, "store": "rocksdb", "executions": 180, "provisioned": 180,
            "deprovisioned": 180, "lost": 0, "duplicates": 0, "bounces": [
                {"node": 0, "how": "SIGTERM", "down_t_s": 100.0, "up_t_s": 110.0, "isr_full_after_s": 2.0}
            ],
            "pod_samples": {"columns": ["t_s", *POD_COLUMNS], "rows": pod_rows},
            "bench_samples": {"columns": ["t_s", *BENCH_COLUMNS], "rows": bench_rows},
            "provision_ms": [(float(t), 20.0 + t % 7) for t in range(1, 181)],
            "teardown_ms": [(float(t), 15.0) for t in range(1, 181)],
        }
    )  # fmt: skip


def _svg_text(path: Path) -> str:
    assert path.stat().st_size > 0, path
    root = ET.parse(path).getroot()
    assert root.tag == SVG, (path, root.tag)
    return " ".join(t for t in root.itertext())


def test_every_chart_from_a_document_with_every_figure(tmp_path: Path) -> None:
    written = render(_document(), tmp_path)
    assert [p.name for p in written] == [f"{c}.svg" for c in CHARTS]
    texts = {p.stem: _svg_text(p) for p in written}
    # each driver and launch type that ran has its row; the warm pool one at a time beside it
    for label in ("memory driver", "kubernetes", "agent-sandbox cold", "agent-sandbox warm", "one at a time"):
        assert label in texts["burst-latency"], label
    for panel in ("event → SandboxProvisioned", "event → runner holds its secrets", "event → runner ready"):
        assert panel in texts["burst-latency"], panel
    assert "docker" not in texts["burst-latency"]  # an error row is not drawn
    # the breakdown: the cold row's steps and the warm row's (burst and one at a time)
    for step in ("api write", "sandbox created", "sandbox ready", "claim created", "secrets held"):
        assert step in texts["burst-breakdown"], step
    for label in (
        "kubernetes",
        "agent-sandbox cold",
        "agent-sandbox warm",
        "agent-sandbox warm, one at a time",
    ):
        assert label in texts["burst-breakdown"], label
    assert "memory driver" not in texts["burst-breakdown"]
    assert "at_least_once" in texts["latency"] and "p95" in texts["latency"]
    assert "Quix Streams" in texts["peers"] and "one event at a time" in texts["peers"]
    assert "kept for ever" in texts["retention"] and "retention 2 s" in texts["retention"]
    for label in (
        "RSS, MiB",
        "rss_beyond_rocksdb_mib",
        "asyncio tasks",
        "states held",
        "by maker, by kind",  # the threads by who made them, the descriptors by kind
        "fds_store",
        "consumer lag, records",
        "1 broker bounces",
    ):
        assert label in texts["soak"], label
    for label in ("10M", "restart to ready", "goal: 50 ms", "p99"):
        assert label in texts["scale"], label


def test_a_chart_whose_figure_is_absent_is_not_written(tmp_path: Path) -> None:
    doc = _document()
    figures = doc["figures"]
    cases: dict[str, tuple[list[str], list[str]]] = {
        # figures removed -> the charts still written
        "no burst": (["burst"], ["latency", "peers", "retention", "scale", "soak"]),
        "no latency": (
            ["latency", "latency_at_least_once"],
            ["burst-latency", "burst-breakdown", "peers", "retention", "scale", "soak"],
        ),
        "no peers": (
            ["peers", "peers_latency"],
            ["burst-latency", "burst-breakdown", "latency", "retention", "scale", "soak"],
        ),
        "no retention": (
            ["retention"],
            ["burst-latency", "burst-breakdown", "latency", "peers", "scale", "soak"],
        ),
        "no scale": (
            ["scale"],
            ["burst-latency", "burst-breakdown", "latency", "peers", "retention", "soak"],
        ),
        "no soak": (["soak"], ["burst-latency", "burst-breakdown", "latency", "peers", "retention", "scale"]),
        "nothing": (list(figures), []),
    }
    for case, (removed, expected) in cases.items():
        partial = {**doc, "figures": {k: v for k, v in figures.items() if k not in removed}}
        out = tmp_path / case.replace(" ", "-")
        assert [p.stem for p in render(partial, out)] == expected, case
        assert sorted(p.stem for p in out.glob("*.svg")) == sorted(expected), case

    # a figure that is an error is drawn as nothing; rows without steps give no breakdown
    errored = copy.deepcopy(doc)
    errored["figures"] = {"retention": {"error": "TimeoutError: 0/4"}, "burst": _burst()}
    kube = errored["figures"]["burst"]["kubernetes"]
    del kube["steps"]
    del kube["agent_sandbox_cold"]["steps_p50_ms"]
    del kube["agent_sandbox_warm"]["sequential_steps"], kube["agent_sandbox_warm"]["burst_steps"]
    assert [p.stem for p in render(errored, tmp_path / "errored")] == ["burst-latency"]


def test_one_half_of_the_peers_is_drawn_alone(tmp_path: Path) -> None:
    doc = _document()
    only_latency = {**doc, "figures": {"peers_latency": doc["figures"]["peers_latency"]}}
    text = _svg_text(render(only_latency, tmp_path / "latency-only")[0])
    assert "one event at a time" in text and "8. throughput" not in text
    only_rate = {**doc, "figures": {"peers": doc["figures"]["peers"]}}
    text = _svg_text(render(only_rate, tmp_path / "rate-only")[0])
    assert "8. throughput" in text and "one event at a time" not in text


def test_retention_without_samples_draws_the_waves(tmp_path: Path) -> None:
    doc = _document()
    for run in doc["figures"]["retention"]["runs"].values():
        del run["samples"]
    (path,) = render({**doc, "figures": {"retention": doc["figures"]["retention"]}}, tmp_path)
    assert "wave" in _svg_text(path) and "seconds since the first wave" not in _svg_text(path)


def test_burst_rows_walk_into_the_kubernetes_row_and_skip_errors() -> None:
    labels = [label for label, _ in burst_rows(_burst())]
    assert labels == [
        "memory driver",
        "kubernetes",
        "kubernetes",  # its steps
        "agent-sandbox cold",
        "agent-sandbox warm",
        "agent-sandbox warm, one at a time",  # its sequential_steps
        "agent-sandbox warm",  # its burst_steps
    ]
    unknown = {
        "kubernetes": {"n": 1, "agent_sandbox_cold": {"n": 1, "cold_steps": {"steps_p50_ms": {"a": 1}}}}
    }
    assert [label for label, _ in burst_rows(unknown)][-1] == "agent-sandbox cold, cold steps"


def test_burst_panels_draw_samples_before_percentiles_and_nothing_a_row_lacks() -> None:
    panels = {title: {label: (samples, marks) for label, samples, marks in drawn}
              for title, drawn in burst_panels(_burst())}  # fmt: skip
    provisioned = panels["event → SandboxProvisioned"]
    assert provisioned["memory driver"] == (None, (210.0, 260.0))  # percentiles only
    assert provisioned["agent-sandbox warm"] == ([60.0, 70.0, 131.0], None)
    assert provisioned["agent-sandbox warm, one at a time"] == ([60.0, 65.0, 90.0], None)
    # the runner's first log line (the launch's steps) over its pod Running (the row's own samples)
    ready = panels["event → runner ready"]
    assert ready["kubernetes"] == ([6050.0, 6100.0, 7000.0], None)
    assert ready["agent-sandbox cold"] == ([6500.0, 6700.0, 7100.0], None)
    assert ready["agent-sandbox warm"] == ([240.0, 280.0, 560.0], None)  # the burst's steps
    # a cold launch's breakdown keeps no "secrets_held" samples: it is not in that panel
    assert set(panels["event → runner holds its secrets"]) == {
        "agent-sandbox warm",
        "agent-sandbox warm, one at a time",
    }
    # a document from before the samples: every row by its percentiles
    old = {"kubernetes": {"time_to_sandbox_p50_ms": 4.0, "time_to_sandbox_p99_ms": 9.0, "running_p50_ms": 60.0,
                          "running_p99_ms": 90.0}}  # fmt: skip
    assert burst_panels(old) == [
        ("event → SandboxProvisioned", [("kubernetes", None, (4.0, 9.0))]),
        ("event → runner ready", [("kubernetes", None, (60.0, 90.0))]),
    ]


def test_the_same_document_gives_the_same_bytes(tmp_path: Path) -> None:
    first = render(_document(), tmp_path / "a")
    second = render(_document(), tmp_path / "b")
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_merge_takes_a_later_documents_figure_unless_it_is_an_error() -> None:
    doc = _document()
    burst_run = {"meta": {"started_at": "later"}, "figures": {"burst": {"memory": {"n": 1}}}}
    failed = {"meta": {}, "figures": {"retention": {"error": "x"}, "rules": {"error": "y"}}}
    merged = merge([doc, burst_run, failed])
    assert merged["figures"]["burst"] == {"memory": {"n": 1}}
    assert merged["meta_of"]["burst"] == {"started_at": "later"}
    assert merged["figures"]["retention"] == doc["figures"]["retention"]  # kept: the later one failed
    assert merged["figures"]["rules"] == {"error": "y"}  # nothing better to keep
    assert merged["figures"]["peers"] == doc["figures"]["peers"]


def test_plots_from_saved_runs_is_one_command(tmp_path: Path) -> None:
    doc = _document()
    figures = doc["figures"]
    default_set = tmp_path / "default.json"
    default_set.write_text(json.dumps({**doc, "figures": {k: v for k, v in figures.items() if k != "burst"}}))
    burst_run = tmp_path / "burst.json"
    burst_run.write_text(json.dumps({**doc, "figures": {"burst": figures["burst"]}}))
    out = tmp_path / "plots"
    cmd = [sys.executable, "-m", "consumers.tools.cli", "bench", "--plots-from", str(default_set),
           str(burst_run), "--plots", str(out)]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.stem for p in out.glob("*.svg")) == sorted(CHARTS)
    assert "starting Apache Kafka" not in proc.stderr  # nothing measured
    # without --plots: beside the first file
    proc = subprocess.run(
        [*cmd[:-2]], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.stem for p in (tmp_path / "default-plots").glob("*.svg")) == sorted(CHARTS)
    missing = subprocess.run(
        [*cmd[:5], str(tmp_path / "absent.json")], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert missing.returncode == 2 and "no such file" in missing.stderr
